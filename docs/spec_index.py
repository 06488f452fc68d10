"""Which tests prove which invariant: a static index of ``@pytest.mark.spec(...)`` citations.

The index is built by *parsing* the test sources with :mod:`ast` (no pytest run, no imports of
the tests), so it is cheap enough to rebuild on every docs build (``docs/hooks.py``) and in the
meta-test ``tests/test_spec_ids.py``.  It also reads the spec pages ``docs/spec/*.md`` and
returns the IDs they define as headings.

What counts as a citation of test ``f`` (node id ``tests/test_x.py::f`` or
``tests/test_x.py::TestC::f``): a call ``pytest.mark.spec("ID", ...)`` (or ``mark.spec(...)``)

* in ``f``'s decorators, including ``pytest.param(..., marks=pytest.mark.spec(...))`` inside a
  ``parametrize`` decorator,
* in the decorators of the class that holds ``f``,
* in the module's ``pytestmark``.

Arguments must be string literals, or names / ``*names`` bound at module level to a string or a
tuple / list of strings; anything else is reported as a problem (the meta-test fails on it).

It lives beside the pages it reads (``docs/``): tools import it with ``docs/`` on ``sys.path``
(the docs scripts, ``pytest``'s ``pythonpath``), and ``python -m refspec cite`` loads it from the
checkout (:func:`refspec.harness.docs_links.load_spec_index`).  Run ``python docs/spec_index.py`` to print the IDs
no test cites yet.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from refspec.core.invariants import INVARIANTS

ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = ROOT / "tests"
SPEC_DIR = ROOT / "docs" / "spec"

#: the spec page of each ID family (docs/spec/<page>)
FAMILY_PAGES = {
    "PA": "paging-attention.md",
    "KV": "kv.md",
    "MD": "metadata.md",
    "CG": "graphs.md",
    "SD": "spec-decode.md",
    "TR": "tree.md",
    "ML": "mla.md",
    "TOL": "tolerance.md",
}
ID_RE = re.compile(r"\b(?:PA|KV|MD|CG|SD|TR|ML|TOL)-\d{3}\b")
#: a spec heading: ``### CG-004 — title {#cg-004}``
HEADING_RE = re.compile(r"^#{2,6}\s+((?:PA|KV|MD|CG|SD|TR|ML|TOL)-\d{3})\b")


@dataclass
class Index:
    """``tests[id]``: sorted node ids citing ``id``; ``problems``: unparsable citations."""

    tests: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def uncovered(self) -> list[str]:
        """IDs of the catalogue that no test cites."""
        return [i for i in INVARIANTS if not self.tests.get(i)]

    def unknown(self) -> dict[str, list[str]]:
        """Cited IDs that are not in the catalogue -> the node ids citing them."""
        return {i: t for i, t in self.tests.items() if i not in INVARIANTS}


def _is_spec_mark(node: ast.AST) -> bool:
    """``pytest.mark.spec(...)`` or ``mark.spec(...)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "spec"):
        return False
    v = node.func.value
    return (isinstance(v, ast.Attribute) and v.attr == "mark") or (isinstance(v, ast.Name) and v.id == "mark")


def _module_strings(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level ``NAME = "ID"`` / ``NAME = ("ID", ...)`` bindings."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            v = node.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                out[node.targets[0].id] = [v.value]
            elif isinstance(v, (ast.Tuple, ast.List)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts):
                out[node.targets[0].id] = [e.value for e in v.elts]
    return out


def _mark_ids(nodes, consts, where, problems) -> list[str]:
    """The IDs of every spec mark found anywhere under ``nodes``."""
    ids = []
    for top in nodes:
        for node in ast.walk(top):
            if not _is_spec_mark(node):
                continue
            for arg in node.args:
                inner = arg.value if isinstance(arg, ast.Starred) else arg
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    ids.append(inner.value)
                elif isinstance(inner, ast.Name) and inner.id in consts:
                    ids.extend(consts[inner.id])
                else:
                    problems.append(f"{where} line {node.lineno}: cannot read spec mark argument "
                                    f"{ast.unparse(arg)!r} statically")
    return ids


def scan_file(path: Path, rel: str) -> tuple[dict[str, list[str]], list[str]]:
    """``({node_id: [IDs]}, problems)`` for one test module (``rel``: its path in node ids)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    consts = _module_strings(tree)
    problems: list[str] = []
    module_marks = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_marks.append(node.value)
    base = _mark_ids(module_marks, consts, rel, problems)
    cites: dict[str, list[str]] = {}

    def visit(body, prefix, inherited):
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, f"{prefix}::{node.name}",
                      inherited + _mark_ids(node.decorator_list, consts, rel, problems))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                ids = inherited + _mark_ids(node.decorator_list, consts, rel, problems)
                if ids:
                    cites[f"{prefix}::{node.name}"] = sorted(set(ids))

    visit(tree.body, rel, base)
    return cites, problems


def build_index(tests_dir: Path = TESTS_DIR) -> Index:
    """Scan ``tests_dir/**/test_*.py`` (node ids relative to the repo root, as pytest prints)."""
    by_id: dict[str, set[str]] = defaultdict(set)
    problems: list[str] = []
    root = tests_dir.parent
    for path in sorted(tests_dir.rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        try:
            cites, probs = scan_file(path, rel)
        except SyntaxError as e:  # a test file being written right now
            problems.append(f"{rel}: syntax error line {e.lineno}")
            continue
        problems.extend(probs)
        for node_id, ids in cites.items():
            for i in ids:
                by_id[i].add(node_id)
    return Index({i: sorted(t) for i, t in by_id.items()}, problems)


def doc_ids(spec_dir: Path = SPEC_DIR) -> dict[str, list[tuple[str, int]]]:
    """IDs defined as headings in ``spec_dir/*.md`` -> ``[(file name, line), ...]``."""
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for path in sorted(spec_dir.glob("*.md")):
        in_fence = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            m = None if in_fence else HEADING_RE.match(line)
            if m:
                out[m.group(1)].append((path.name, n))
    return dict(out)


def family_page(inv_id: str) -> str:
    """The spec page (file name) an ID belongs on."""
    return FAMILY_PAGES[inv_id.split("-")[0]]


def main(argv=None) -> int:
    idx = build_index()
    print(f"{len(INVARIANTS)} invariant IDs; {len(INVARIANTS) - len(idx.uncovered())} cited by a test")
    for i in idx.uncovered():
        print(f"  uncovered {i}: {INVARIANTS[i]}")
    for i, t in idx.unknown().items():
        print(f"  unknown {i} cited by {t}")
    for p in idx.problems:
        print(f"  problem: {p}")
    return 1 if idx.uncovered() or idx.unknown() or idx.problems else 0


if __name__ == "__main__":
    sys.exit(main())
