"""The package layers (issues 13, 22): imports point down, the reference imports no instrument,
the bug zoo stays outside production, and both wings satisfy the backend contract of
:mod:`refspec.core.backend`.

Allowed imports between top-level folders of ``refspec/`` (a folder may always import itself):

===========  ==================================  ===============================================
folder       may import                          why
===========  ==================================  ===============================================
core         (nothing)                           the shared words: modes, KV cache, batch, IDs
oracle       core                                the readable truth shares nothing with FA3
graphs       core                                capture / runner know backends only by hooks
fa3          core, graphs                        SGLang's FA3 rules and their graph hooks
model        core                                backends are passed in, never imported
speculative  core, oracle, graphs, fa3, model    the engine runs either wing through the model
===========  ==================================  ===============================================

Those six folders are the reference (what a learner reads); every other folder is an instrument
(:data:`INSTRUMENTS`: command line, conformance, bug zoo, harness, traces, audits, real inputs),
which the reference never imports, and whose modules say in their docstring that a learner can
skip them.  No folder but ``mutants``, ``cli`` and ``conformance`` (whose negative controls apply
a variant on refspec's side on purpose) imports ``refspec.mutants``.
"""

from __future__ import annotations

import ast
import re
import inspect
from pathlib import Path

import pytest

from refspec.core.backend import AttentionBackend, GraphableBackend
from refspec.core.kv_cache import KVCache, KVPool
from refspec.fa3.backend import FlashAttentionBackend
from refspec.oracle.backend import OracleBackend

ROOT = Path(__file__).resolve().parents[1] / "refspec"
ALLOWED = {"core": set(), "oracle": {"core"}, "graphs": {"core"}, "fa3": {"core", "graphs"}, "model": {"core"},
           "speculative": {"core", "oracle", "graphs", "fa3", "model"}}
#: the folders a learner can skip: tools around the reference (the keys of ALLOWED)
INSTRUMENTS = {"cli", "conformance", "mutants", "harness", "traces", "audits", "real"}


def imported_folders(path: Path) -> set[str]:
    """Top-level ``refspec`` folders (or modules) that ``path`` imports, at any depth of its AST."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        if isinstance(node, ast.ImportFrom) and node.module == "refspec":
            names = [f"refspec.{a.name}" for a in node.names]  # from refspec import x
        out |= {n.split(".")[1] for n in names if n.startswith("refspec.")}
    return out


MODULES = sorted(p for p in ROOT.rglob("*.py") if len(p.relative_to(ROOT).parts) > 1)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    here = path.relative_to(ROOT).parts[0]
    got = imported_folders(path) - {here}
    if here in ALLOWED:
        assert not got & INSTRUMENTS, \
            f"refspec/{path.relative_to(ROOT)}: the reference imports instrument(s) {sorted(got & INSTRUMENTS)}"
        assert got <= ALLOWED[here], f"refspec/{path.relative_to(ROOT)} imports refspec.{sorted(got - ALLOWED[here])}"
    if here not in ("mutants", "cli", "conformance"):
        assert "mutants" not in got, f"refspec/{path.relative_to(ROOT)}: production imports the bug zoo"


def test_every_folder_is_reference_or_instrument():
    """A new folder must be placed on one side of the line (else the checks above skip it)."""
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED) | INSTRUMENTS, f"unclassified: {sorted(folders ^ (set(ALLOWED) | INSTRUMENTS))}"
    assert not set(ALLOWED) & INSTRUMENTS


@pytest.mark.parametrize("path", [p for p in MODULES if p.relative_to(ROOT).parts[0] in ALLOWED],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_reference_has_no_entry_point(path):
    """Command-line entry points (audits, replays) live with the instruments, not in the reference."""
    tree = ast.parse(path.read_text())
    mains = [n for n in ast.walk(tree) if isinstance(n, ast.Compare) and isinstance(n.left, ast.Name)
             and n.left.id == "__name__"]
    assert not mains and "argparse" not in imported_modules(tree), \
        f"refspec/{path.relative_to(ROOT)} is a command-line tool: move it to an instrument folder"


def test_traces_and_audits_live_with_the_instruments():
    """Issue 22: the trace and audit modules left ``refspec/speculative/`` (and no reference folder
    grew new ones); they are the ``traces`` and ``audits`` packages."""
    stray = [str(p.relative_to(ROOT)) for p in MODULES if p.relative_to(ROOT).parts[0] in ALLOWED
             and ("trace" in p.stem or "audit" in p.stem)]
    assert not stray, f"trace / audit modules inside the reference: {stray}"
    assert (ROOT / "traces" / "chain.py").is_file() and (ROOT / "audits" / "launch.py").is_file()


@pytest.mark.parametrize("path", [p for p in MODULES if p.relative_to(ROOT).parts[0] in INSTRUMENTS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_instrument_says_a_learner_can_skip_it(path):
    """Reading order (``refspec/__init__.py``): each instrument module's docstring says so, or its
    package's ``__init__`` does (one line: "... a learner reading the reference can skip ...")."""
    docs = [ast.get_docstring(ast.parse(f.read_text())) or "" for f in (path, path.parent / "__init__.py")]
    assert any("can skip" in " ".join(d.split()) for d in docs), \
        f"refspec/{path.relative_to(ROOT)}: no 'a learner can skip this' line in its docstring or its package's"


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module name an AST imports (``import a.b`` -> ``a.b``; ``from a import b`` -> ``a``)."""
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_the_import_walk_sees_every_form():
    """The checker itself: ``import a.b``, ``from a.b import c``, ``from refspec import x`` and
    imports inside functions are all found (else the test above would pass vacuously)."""
    assert imported_folders(ROOT / "mutants" / "variants.py") >= {"core", "fa3", "graphs", "mutants"}
    assert imported_folders(ROOT / "fa3" / "tree_backend.py") == {"core", "fa3"}
    assert imported_folders(ROOT / "fa3" / "kernel.py") == {"core", "fa3", "graphs"}
    assert "fa3" in imported_folders(ROOT / "mutants" / "runner.py")  # a function-level import
    assert "speculative" in imported_folders(ROOT / "audits" / "sync.py")  # an instrument may import the engine


def _backends():
    kv = KVCache(4, 32, 9, 4)
    pool = KVPool(1, 9, 4, 2, 8)
    return OracleBackend(pool, kv), FlashAttentionBackend(pool, kv)


def test_both_wings_satisfy_the_backend_protocol():
    oracle, fa3 = _backends()
    assert isinstance(oracle, AttentionBackend) and isinstance(fa3, AttentionBackend)
    assert isinstance(fa3, GraphableBackend) and not isinstance(oracle, GraphableBackend)  # the oracle is eager only


@pytest.mark.parametrize("method", ["init_forward_metadata", "forward", "init_cuda_graph_state",
                                    "init_forward_metadata_capture_cuda_graph",
                                    "init_forward_metadata_replay_cuda_graph"])
def test_backend_hooks_have_the_protocol_signature(method):
    """Same parameter names, in order, as the Protocol (``isinstance`` checks names only)."""
    want = list(inspect.signature(getattr(GraphableBackend, method)).parameters)
    for be in _backends():
        if hasattr(be, method):
            got = ["self", *inspect.signature(getattr(be, method)).parameters]
            assert got == want, f"{type(be).__name__}.{method}{got} vs the Protocol {want}"



def _reading_order(text: str) -> list[str]:
    return re.findall(r"^\s*\d+\. `{0,2}(refspec/[\w/]+\.py)", text, flags=re.M)


def test_the_reading_order_is_the_same_in_the_package_and_the_readme():
    """``refspec/__init__.py`` and the README list the same files, in the same order, all real and
    all in the reference (none an instrument)."""
    import refspec

    order = _reading_order(refspec.__doc__)
    assert 12 <= len(order) <= 21, order  # one sitting: core/backend.py made it 21
    assert order == _reading_order((ROOT.parent / "README.md").read_text())
    for f in order:
        assert (ROOT.parent / f).is_file(), f
        assert f.split("/")[1] in ALLOWED, f"{f}: an instrument in the reading order"
