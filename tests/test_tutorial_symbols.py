"""One meaning of L (issue 43, item 4): the shape legend's L is a request's committed length
*before* the forward, so DECODE reads K = L + 1 keys and its ``seq_lens`` is L + 1.

* No tutorial, docs page or refspec docstring gives L a second meaning ("L (incl. the new token)",
  "K = L (incl. ...)", a DECODE row whose keys are `L`); the patterns are shown to match the
  lines issue 43 found.
* Tutorial 03's hand-computed table (its ``expected`` dict, read from the source without running
  it) follows the legend's formula for each mode, written out here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: a second meaning of L: L said to include the new token, or DECODE's keys given as plain `L`
MISUSE = [
    re.compile(r"`?\bL\b`?\s*\(?\s*(?:incl\.?|including)\b[^\n|]{0,25}new token", re.I),
    re.compile(r"\bK\s*=\s*L\s*\((?:incl|including)", re.I),
    re.compile(r"^\s*#?\s*\|\s*DECODE\s*\|[^\n]*\|\s*`L`\s*(?:\||\(incl)", re.M),
    re.compile(r"\bseq_lens\b`{0,2}\s*L including\b"),
]


def misuses(text: str) -> list[str]:
    return [m.group(0) for pat in MISUSE for m in pat.finditer(text)]


def _scanned() -> list[Path]:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs").glob("*.py"),
             *(ROOT / "tutorials").glob("[0-9][0-9]_*.py"), *(ROOT / "refspec").rglob("*.py")]
    return sorted(p for p in files if "site" not in p.relative_to(ROOT).parts)


def test_the_patterns_match_what_issue_43_found():
    found = [
        "# | DECODE | target, no speculation | 1 | `L` (incl. the new token) |",  # tutorial 03 line 27
        '    "decode":           ([6, 9, 13],   [0, 1, 2, 3]),     # K = L (incl. new token)',  # line 81
        "| DECODE | `L` including the new token | 1 | `L` | `arange(0 .. B)` |",  # docs/spec/metadata.md
        "``lens`` means per mode (tokens): DECODE, L including the new token; draft decode",  # scenario.py
        "captured per batch size (padded, CG-007), ``seq_lens`` L including the token being decoded",
    ]
    assert all(misuses(s) for s in found), [s for s in found if not misuses(s)]
    fixed = [
        "# | DECODE | target, no speculation | 1 | `L + 1` (the new token, at position `L`, included) |",
        "| DECODE | `L + 1`, including the new token | 1 | `L + 1` | `arange(0 .. B)` |",
        "| `L` | committed length of a request at the start of a round (before the forward, in every mode: "
        "`seq_lens` is `L + 1` in decode",
    ]
    assert not any(misuses(s) for s in fixed), [misuses(s) for s in fixed]


def test_no_page_gives_l_a_second_meaning():
    problems = [f"{p.relative_to(ROOT)}: {m!r}" for p in _scanned() for m in misuses(p.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def _literal(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name) and t.id == name:
                return ast.literal_eval(node.value)
            if isinstance(t, ast.Tuple) and name in [e.id for e in t.elts if isinstance(e, ast.Name)]:
                i = [e.id for e in t.elts].index(name)
                return ast.literal_eval(node.value.elts[i])
    raise AssertionError(f"tutorial 03 no longer assigns {name}")


def test_tutorial_03s_hand_table_follows_the_legend():
    """K_b and cu_seqlens_q per mode from the legend: DECODE L + 1 (one row), draft step s
    L + s + 1, TARGET_VERIFY L + N (N rows), DRAFT_EXTEND L + a (a rows, packed),
    DRAFT_EXTEND_V2 L + N (N rows)."""
    src = (ROOT / "tutorials" / "03_forward_modes.py").read_text(encoding="utf-8")
    tree = ast.parse(src)
    L, N, A = _literal(tree, "L"), _literal(tree, "N"), _literal(tree, "A")
    expected = _literal(tree, "expected")
    cu = lambda rows: [sum(rows[:b]) for b in range(len(rows) + 1)]
    legend = {
        "decode": ([x + 1 for x in L], cu([1] * len(L))),
        "draft decode s=0": ([x + 0 + 1 for x in L], cu([1] * len(L))),
        "draft decode s=1": ([x + 1 + 1 for x in L], cu([1] * len(L))),
        "target verify": ([x + N for x in L], cu([N] * len(L))),
        "draft extend v1": ([x + a for x, a in zip(L, A)], cu(A)),
        "draft extend v2": ([x + N for x in L], cu([N] * len(L))),
    }
    assert {k: tuple(map(list, v)) for k, v in expected.items()} == legend
    # the DECODE scenario is built with seq_lens = L + 1 (the Scenario's DECODE lens), not with L
    assert re.search(r'"decode": dict\(mode=M\.DECODE, lens=\[x \+ 1 for x in L\]\)', src)
