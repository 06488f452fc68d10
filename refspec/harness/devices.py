"""Which device refspec runs on here: the one wording of ``--device`` and of
:class:`~refspec.harness.scenario.Scenario` ``device=``.

A library function the command line (``refspec/cli/_args.py``) and the harness both take; it
lives below the command line so that the harness does not import ``cli``.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations


def device_problem(text, auto: bool = False) -> str | None:
    """Why ``text`` is not a device refspec runs on here (None when it is): ``cpu``, or ``cuda``
    where a CUDA device exists; ``auto`` too when ``auto`` (the command picks one)."""
    if auto and text == "auto":
        return None
    if text not in ("cpu", "cuda"):
        return f"{text!r}: choose {'auto, ' if auto else ''}cpu or cuda"
    if text == "cuda":
        import torch

        if not torch.cuda.is_available():
            return f"no CUDA device here (torch {torch.__version__}); use cpu"
    return None
