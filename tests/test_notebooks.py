"""The tutorials: every ``tutorials/*.ipynb`` runs top to bottom on CPU, is stored without outputs,
and equals its jupytext percent source ``tutorials/NN_name.py``.

Notebooks are found by glob, so new tutorials are picked up without editing this file.  They run
in-process through ``nbclient`` on a kernel that is this interpreter (a temporary kernelspec whose
argv is ``sys.executable``), so they see exactly the refspec being tested.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
SOURCES = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
TIMEOUT_S = 120  #: per cell; each notebook is meant to finish in well under a minute

nbformat = pytest.importorskip("nbformat", reason="notebook tests: install the `notebooks` extra")
jupytext = pytest.importorskip("jupytext", reason="notebook tests: install the `notebooks` extra")


def _ids(paths):
    return [p.stem for p in paths]


def test_there_are_tutorials():
    assert NOTEBOOKS, "no tutorials/*.ipynb found"


def test_every_notebook_has_a_source_and_back():
    nb_stems, py_stems = {p.stem for p in NOTEBOOKS}, {p.stem for p in SOURCES}
    assert nb_stems == py_stems, (f"unpaired: notebooks without .py {sorted(nb_stems - py_stems)}, "
                                  f".py without notebook {sorted(py_stems - nb_stems)}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have stored outputs (clear them before committing)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_matches_its_percent_source(path):
    src = path.with_suffix(".py")
    assert src.is_file(), f"{path.name} has no paired {src.name}"
    nb = nbformat.read(path, as_version=4)
    py = jupytext.read(src)
    cells = lambda n: [(c.cell_type, c.source.strip()) for c in n.cells]
    assert cells(nb) == cells(py), (f"{path.name} and {src.name} differ: run "
                                    f"`jupytext --sync {src.relative_to(ROOT)}` (or `--to ipynb`)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_ends_with_asserts(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and "assert " in code[-1].source, f"{path.name}: the last code cell must check something"


@pytest.fixture(scope="module")
def kernel_manager_factory(tmp_path_factory):
    """Kernel managers for a kernelspec that runs *this* interpreter."""
    pytest.importorskip("nbclient", reason="notebook tests: install the `notebooks` extra")
    pytest.importorskip("ipykernel", reason="notebook tests: install the `notebooks` extra")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kdir = tmp_path_factory.mktemp("kernels") / "refspec-test"
    kdir.mkdir()
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "refspec test", "language": "python"}))
    ksm = KernelSpecManager(kernel_dirs=[str(kdir.parent)])
    return lambda: KernelManager(kernel_name="refspec-test", kernel_spec_manager=ksm)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_executes_top_to_bottom(path, kernel_manager_factory):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, km=kernel_manager_factory(), timeout=TIMEOUT_S,
                            resources={"metadata": {"path": str(TUTORIALS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    ran = [c for c in code if c.execution_count is not None]
    assert ran, f"{path.name}: no code cell was executed"
    assert len(ran) == len(code), f"{path.name}: {len(code) - len(ran)} code cells did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


#: tutorials without exercises (none: a new tutorial gets 2-3 before it is merged)
NO_EXERCISES: set[str] = set()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_exercises_have_hidden_checks(path):
    """2-3 exercises: an ``answer_x = ...`` cell, a collapsed solution, and a check cell tagged
    ``check`` with its source hidden that calls ``exercises.check``."""
    if path.stem in NO_EXERCISES:
        pytest.skip(f"{path.stem} has no exercises yet (listed in NO_EXERCISES)")
    nb = nbformat.read(path, as_version=4)
    answers = [c for c in nb.cells if c.cell_type == "code" and re.search(r"^answer_\w+ = \.\.\.", c.source, re.M)]
    checks = [c for c in nb.cells if c.cell_type == "code" and "check" in c.metadata.get("tags", [])]
    solutions = [c for c in nb.cells if c.cell_type == "markdown" and "<details><summary>Solution" in c.source]
    assert 2 <= len(answers) <= 3, f"{path.name}: {len(answers)} exercises"
    assert len(checks) == len(answers) == len(solutions), (path.name, len(checks), len(answers), len(solutions))
    for c in checks:
        assert c.metadata.get("jupyter", {}).get("source_hidden") is True, f"{path.name}: a check cell is not hidden"
        assert "exercises.check(" in c.source, f"{path.name}: a check cell does not call exercises.check"
