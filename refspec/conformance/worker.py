"""``python -m refspec.conformance.worker PIN JOBS OUT``: run upstream on the jobs, save results.

Started by :func:`refspec.conformance.run.run_pin` in a subprocess whose ``PYTHONPATH`` is the
pin's install directory, the shared dependency directory and the repository (for this package
only), with ``TRITON_INTERPRET=1``.  ``JOBS`` is a ``torch.save`` of ``[(job id, inputs)]``;
``OUT`` receives ``{"results": {job id: {(phase, step): fields} | "error text"}, "info": ...}``.
A job whose upstream call raises (a stub used at run time included) is reported with the
exception, never as a result.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import traceback

import torch

ADAPTERS = {"0.5.23": "refspec.conformance.upstream_0523", "0.5.12.post1": "refspec.conformance.upstream_0512"}


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "sglang" in f.filename] or \
        traceback.extract_tb(exc.__traceback__)
    f = frames[-1]
    return f"{f.filename.split('site-packages/')[-1].split('/.conformance/')[-1]}:{f.lineno}"


def describe(exc: BaseException) -> str:
    """``Type at file:line: message`` of an upstream exception (the text a result row carries)."""
    return f"{type(exc).__name__} at {_where(exc)}: {exc}"


def main(argv: list[str]) -> int:
    pin, jobs_path, out_path = argv
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"sglang {pin} is not on this worker's path (PYTHONPATH={os.environ.get('PYTHONPATH')})")
    site = os.path.dirname(os.path.dirname(spec.origin))
    t0 = time.perf_counter()
    up = importlib.import_module(ADAPTERS[pin]).Upstream(site)
    t_import = time.perf_counter() - t0
    from refspec.conformance import stubs

    results = {}
    for job_id, inputs in torch.load(jobs_path, weights_only=False):
        try:
            results[job_id] = up.run(inputs)
        except Exception as e:  # noqa: BLE001 -- reported per job; the comparison counts it as an error
            results[job_id] = describe(e)
    info = dict(up.info(), site=site, import_s=round(t_import, 1), run_s=round(time.perf_counter() - t0 - t_import, 1),
                placeholders=len(stubs.handed_out()))
    torch.save({"results": results, "info": info}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
