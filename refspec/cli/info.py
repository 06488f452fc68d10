"""``python -m refspec info``: the active FA3 provider and why, and whether it may run MLA (ML-013).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.cli._args import PROG, ArgumentParser, run
from refspec.fa3.kernel import hopper_reason, mla_kernel_problem, provider_status, select_provider


def main(argv=None) -> int:
    """Print torch / CUDA, each FA3 provider's status and the one selected here; exit 0."""
    return run(_main, argv, f"{PROG} info")


def _main(argv) -> int:
    ArgumentParser(prog=f"{PROG} info", description=__doc__).parse_args(argv)
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    for name, status in provider_status().items():
        print(f"  {name:<11} {status}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = select_provider(dev)
    why = "a real FA3 kernel on a Hopper GPU" if chosen != "emulator" else (
        f"no real kernel usable here ({hopper_reason() or 'no FA3 module'})")
    print(f"active provider on {dev.type}: {chosen} ({why})")
    problems = {call: mla_kernel_problem(chosen, call) for call in ("qv", "prefill")}
    mla = "yes" if not any(problems.values()) else "refused (ML-013): " + "; ".join(
        f"{call}: {why}" for call, why in problems.items() if why)
    print(f"MLA on {chosen}: {mla}")
    return 0
