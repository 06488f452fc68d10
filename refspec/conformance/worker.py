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

import torch


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
    from refspec.conformance.upstream_common import describe

    tracer = lines.Tracer(site)
    results = {}
    for job_id, inputs in torch.load(jobs_path, weights_only=False):
        try:
            with tracer.job():
                results[job_id] = tracer.attach(up.run(inputs))
        except Exception as e:  # noqa: BLE001 -- reported per job; the comparison counts it as an error
            results[job_id] = describe(e)
    info = dict(up.info(), site=site, import_s=round(t_import, 1), run_s=round(time.perf_counter() - t0 - t_import, 1),
                placeholders=len(stubs.handed_out()), guards_undetermined=sorted(up.undetermined))
    torch.save({"results": results, "info": info}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
