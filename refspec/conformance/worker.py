"""``python -m refspec.conformance.worker LABEL JOBS OUT``: run upstream on the jobs, save results.

Started by :func:`refspec.conformance.run.run_worker` in a subprocess whose ``PYTHONPATH`` is the
target's folder holding ``sglang/``, the shared dependency directory and the repository (for this
package only), with ``TRITON_INTERPRET=1``.  ``REFSPEC_SHAPE`` carries the target's
:class:`refspec.conformance.install.Shape` (JSON): its ``adapter`` is the module that drives
this code.  ``REFSPEC_REVERT_FIX`` (optional) names an upstream fix toggle to revert
(:func:`refspec.conformance.upstream_common.finish_imports`).  ``JOBS`` is a ``torch.save`` of
``[(job id, inputs)]``; ``OUT`` receives ``{"results": {job id: {(phase, step): fields} |
"error text"}, "info": ...}``.  A job whose upstream call raises (a stub used at run time
included) is reported with the exception, never as a result.  Each result's fields carry the
upstream lines that ran while it was built (:mod:`refspec.conformance.lines`).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import traceback

import torch


FA = "sglang/srt/layers/attention/flashattention_backend.py"
#: the backend methods that build a phase's metadata: an exception's row also cites the innermost of them
HOOKS = ("init_forward_metadata", "_apply_cuda_graph_metadata", "_init_full_cg_decode_metadata",
         "_set_decode_page_metadata", "stage_draft_extend_metadata")


def _rel(name: str) -> str:
    i = name.rfind("/sglang/")
    return name[i + 1:] if i >= 0 else name


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost upstream frame, and ``(run from flashattention_backend.py:N)``
    when that frame is not itself the innermost backend hook (:data:`HOOKS`, or any
    ``init_forward_metadata*``) that ran it: the hook's line."""
    tb = list(traceback.walk_tb(exc.__traceback__))
    frames = [(f, n) for f, n in tb if "/sglang/" in f.f_code.co_filename] or tb
    f, n = frames[-1]
    at = f"{_rel(f.f_code.co_filename)}:{n}"
    hook = next(((g, m) for g, m in reversed(frames) if _rel(g.f_code.co_filename) == FA and
                 g.f_code.co_name.startswith(HOOKS)), None)
    if hook is not None and hook[0] is not f:
        at += f" (run from {FA.rsplit('/', 1)[-1]}:{hook[1]})"
    return at


def describe(exc: BaseException) -> str:
    """``Type at file:line: message`` of an upstream exception (the text a result row carries);
    ``Type at file:line (run from flashattention_backend.py:N): message`` when it was raised in a
    helper or kernel the backend's metadata hook called (:func:`_where`)."""
    return f"{type(exc).__name__} at {_where(exc)}: {exc}"


def main(argv: list[str]) -> int:
    from refspec.conformance.install import Shape

    label, jobs_path, out_path = argv
    shape = Shape.from_json(os.environ["REFSPEC_SHAPE"])
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"sglang {label} is not on this worker's path (PYTHONPATH={os.environ.get('PYTHONPATH')})")
    site = os.path.dirname(os.path.dirname(spec.origin))
    t0 = time.perf_counter()
    up = importlib.import_module(shape.adapter).Upstream(site, shape)
    t_import = time.perf_counter() - t0
    from refspec.conformance import lines, stubs

    tracer = lines.Tracer(site)
    results = {}
    for job_id, inputs in torch.load(jobs_path, weights_only=False):
        try:
            with tracer.job():
                results[job_id] = tracer.attach(up.run(inputs))
        except Exception as e:  # noqa: BLE001 -- reported per job; the comparison counts it as an error
            results[job_id] = describe(e)
    info = dict(up.info(), site=site, import_s=round(t_import, 1), run_s=round(time.perf_counter() - t0 - t_import, 1),
                placeholders=len(stubs.handed_out()))
    torch.save({"results": results, "info": info}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
