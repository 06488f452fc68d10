"""The package layers (issue 13): imports point down, the bug zoo stays outside production, and
both wings satisfy the backend contract of :mod:`refspec.core.backend`.

Allowed imports between top-level folders of ``refspec/`` (a folder may always import itself):

=========  ==========================  ===============================================
folder     may import                  why
=========  ==========================  ===============================================
core       (nothing)                   the shared words: modes, KV cache, batch, IDs
oracle     core                        the readable truth shares nothing with FA3
graphs     core                        capture / runner know backends only by hooks
fa3        core, graphs                SGLang's FA3 rules and their graph hooks
model      core                        backends are passed in, never imported
=========  ==========================  ===============================================

and no folder but ``mutants``, ``cli`` and ``conformance`` (whose negative controls apply a variant
on refspec's side on purpose) imports ``refspec.mutants``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from refspec.core.backend import AttentionBackend, GraphableBackend
from refspec.core.kv_cache import KVCache, KVPool
from refspec.fa3.backend import FlashAttentionBackend
from refspec.oracle.backend import OracleBackend

ROOT = Path(__file__).resolve().parents[1] / "refspec"
ALLOWED = {"core": set(), "oracle": {"core"}, "graphs": {"core"}, "fa3": {"core", "graphs"}, "model": {"core"}}


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
        assert got <= ALLOWED[here], f"refspec/{path.relative_to(ROOT)} imports refspec.{sorted(got - ALLOWED[here])}"
    if here not in ("mutants", "cli", "conformance"):
        assert "mutants" not in got, f"refspec/{path.relative_to(ROOT)}: production imports the bug zoo"


def test_the_import_walk_sees_every_form():
    """The checker itself: ``import a.b``, ``from a.b import c``, ``from refspec import x`` and
    imports inside functions are all found (else the test above would pass vacuously)."""
    assert imported_folders(ROOT / "mutants" / "variants.py") >= {"core", "fa3", "graphs", "mutants"}
    assert imported_folders(ROOT / "fa3" / "backend.py") == {"core", "fa3", "graphs"}
    assert "fa3" in imported_folders(ROOT / "mutants" / "runner.py")  # a function-level import


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

