"""No stale scope (issue 23): refspec runs EAGLE trees (top-k > 1, docs/spec/tree.md) and SGLang's
FA3 path runs them with P > 1 (#7725; ``speculative_hook.py:_handle_eagle_family@v0.5.23``), so no
page may say that refspec, or SGLang's FA3 path, is top-k = 1 only.

Scanned: ``README.md``, ``docs/**/*.md``, ``tutorials/*.py``.  A PR's own title ("#4908: P > 1 for
top-k = 1 only") is history, not scope, and is not matched: the patterns need refspec, the FA3 path,
an "out of scope" list or a glossary cell as the subject.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STALE = [
    re.compile(r"out of scope[^.\n]*top-k > 1", re.I),
    re.compile(r"refspec[^.\n]{0,40}\bis top-k = 1 only", re.I),
    re.compile(r"FA3 path[^.\n]{0,40}\bis top-k = 1", re.I),
    re.compile(r"\|\s*top-k = 1 only\s*\|"),
    re.compile(r"EAGLE \(top-k = 1\) speculative decoding"),
]


def files() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "tutorials").glob("*.py")])


def stale(text: str) -> list[str]:
    flat = re.sub(r"\n(?:#\s?)?", " ", text)  # a claim broken over Markdown or comment lines
    return [m.group(0) for pat in STALE for m in pat.finditer(flat)]


def test_no_page_says_top_k_1_only():
    problems = [f"{p.relative_to(ROOT)}: {s!r}" for p in files() for s in stale(p.read_text())]
    assert not problems, "\n".join(problems)


def test_the_patterns_match_the_claims_issue_23_found():
    found = [
        "Out of scope for now: top-k > 1 trees, MLA",
        "that is why refspec (like SGLang's\nFA3 path for `P > 1`) is top-k = 1 only.",
        "| tree width | top-k = 1 only | `speculative_eagle_topk` | (chain) |",
        "# copies for trees. refspec is top-k = 1 only.",
        "**Reference paged attention and EAGLE (top-k = 1) speculative decoding, in two wings",
    ]
    assert all(stale(s) for s in found), [s for s in found if not stale(s)]
    assert not stale("[sglang#4908 (P > 1 for top-k = 1 only)](https://github.com/sgl-project/sglang/pull/4908)")
