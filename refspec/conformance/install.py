"""Install the pinned upstream releases next to the repository, never into the main venv.

``.conformance/deps`` holds the few real packages upstream's metadata path imports (shared by
both pins); ``.conformance/sglang-<pin>`` holds one SGLang wheel each.  All are
``pip install --no-deps --target``: SGLang's declared dependencies (CUDA kernels, a server
stack, a newer torch) are *not* installed; what the metadata path imports but never calls is
stubbed in the worker (:mod:`refspec.conformance.stubs`).  torch and numpy come from the
running interpreter.  A directory is reused while its stamp lists the same requirements, so a
second run installs nothing.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

PINS = ("0.5.23", "0.5.12.post1")  #: newest release; newest with DRAFT_EXTEND v1 + legacy hooks
#: real dependencies of the metadata path (``pip download --no-deps`` served these here)
DEPS = ("triton==3.9.0", "msgspec==0.23.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
        "typing-inspection==0.4.5", "typing-extensions==4.16.0", "dill==0.4.1", "packaging==26.4")
STAMP = ".installed"


def default_root() -> str:
    """``<repo>/.conformance`` (gitignored)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".conformance")


def _ensure(target: str, reqs: tuple[str, ...], log) -> bool:
    """Install ``reqs`` into ``target`` unless its stamp already lists them; True if installed."""
    stamp = os.path.join(target, STAMP)
    want = "\n".join(reqs) + "\n"
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == want:
                return False
    if os.path.exists(target):
        shutil.rmtree(target)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", target, *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install into {target} failed ({' '.join(reqs)}):\n{proc.stderr[-2000:]}")
    with open(stamp, "w") as f:
        f.write(want)
    log(f"installed {' '.join(reqs)} into {target} in {time.perf_counter() - t0:.0f} s")
    return True


def ensure(pins=PINS, root: str | None = None, log=print) -> dict[str, list[str]]:
    """Install what is missing; return ``{pin: [sglang dir, deps dir]}`` (the worker's path).

    Raises: RuntimeError if pip fails (the message carries pip's stderr); ValueError for an
    unknown pin.
    """
    root = root or default_root()
    deps = os.path.join(root, "deps")
    _ensure(deps, DEPS, log)
    out = {}
    for pin in pins:
        if pin not in PINS:
            raise ValueError(f"unknown pin {pin!r}; pinned releases: {PINS}")
        d = os.path.join(root, f"sglang-{pin}")
        _ensure(d, (f"sglang=={pin}",), log)
        out[pin] = [d, deps]
    return out
