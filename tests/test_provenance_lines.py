"""Every rule source a reader can open at a fixed place, and the cited line holds the cited name (issue 23).

* Every :data:`refspec.core.invariants.RULES` source that links an upstream file (a GitHub
  ``blob`` URL) is at a release tag or a full 40-hex commit, *and* names a line (``#L<n>``).
* No link anywhere in the repository points at a moving branch (``blob/main``, ``blob/master``)
  of SGLang or FlashAttention, and the references a reader could not open (issue 23: the FA3
  tree backend "read at ``003e7b77a``", tutorial 01's ``a23c30205`` / #9784) stay gone.
* ``-m conformance`` (``make conformance``, which installs the pinned wheels): for every SGLang
  source at a release tag, the file is read from that release's wheel (the pins' installs under
  ``.conformance/``; other releases are fetched with ``pip download --no-deps`` into
  ``.conformance/sources/``) and the cited line must lie inside the definition the label names
  (``path:Class.method@version``, found with :mod:`ast`), or, for a name that is not a
  definition (a class attribute set elsewhere), the line's text must contain it.  FlashAttention is not on the package
  index in source form; its lines were read at the tag in ``refspec.core.sources.FA_TAG``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from refspec.core.invariants import RULES

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / ".conformance"

TAG = r"v\d+\.\d+\.\d+(?:\.post\d+)?|fa\d-v\d+\.\d+\.\d+(?:\.beta\d+)?"
BLOB = re.compile(r"^https://github\.com/(?P<repo>sgl-project/sglang|Dao-AILab/flash-attention)/blob/"
                  rf"(?P<ref>{TAG}|[0-9a-f]{{40}})/(?P<path>[\w./-]+)#L(?P<line>\d+)$")
LABEL = re.compile(r"^python/sglang/(?P<path>[\w./-]+):(?P<symbol>[\w.]+)@(?P<ref>\S+)$")


def blob_sources():
    return [(inv_id, s) for inv_id, r in RULES.items() for s in r.sources if "/blob/" in s.url]


def blob_problems(sources) -> list[str]:
    return [f"{inv_id}: {s.url}: not a file:line at a release tag or a full commit"
            for inv_id, s in sources if not BLOB.match(s.url)]


def test_every_upstream_file_source_is_a_tag_or_commit_and_a_line():
    assert len(blob_sources()) > 50  # the catalogue's file citations (the scan is not vacuous)
    problems = blob_problems(blob_sources())
    assert not problems, "\n".join(problems)


def test_the_blob_check_rejects_what_issue_23_found():
    from refspec.core.sources import Source
    bad = [("X", Source("l", "https://github.com/sgl-project/sglang/blob/003e7b77aeee2fba80ff241c7f45dcb0e613164d/"
                             "python/sglang/srt/layers/attention/flashattention_backend.py")),   # no line
           ("X", Source("l", "https://github.com/sgl-project/sglang/blob/003e7b77a/python/sglang/x.py#L3")),  # short
           ("X", Source("l", "https://github.com/sgl-project/sglang/blob/main/python/sglang/x.py#L3"))]     # branch
    assert len(blob_problems(bad)) == 3
    good = [("X", Source("l", "https://github.com/Dao-AILab/flash-attention/blob/fa4-v4.0.0.beta27/hopper/"
                              "flash_api.cpp#L768"))]
    assert not blob_problems(good)


# ---------------------------------------------------------------- the whole repository
SCANNED = ("README.md", "docs", "refspec", "tests", "tutorials", "benchmarks/results")
MOVING = re.compile(r"github\.com/(?:sgl-project/sglang|Dao-AILab/flash-attention)/(?:blob|tree)/(?:main|master)/")
#: references issue 23 could not open, each with what replaced it
GONE = {"003e7b77a": "v0.5.23 file:line", "a23c30205": "speculative_hook.py:1271@v0.5.23", "#9784": "#7725"}


def scanned_files() -> list[Path]:
    out = []
    for name in SCANNED:
        p = ROOT / name
        out += [p] if p.is_file() else [q for q in p.rglob("*") if q.suffix in (".md", ".py")]
    return sorted(q for q in out if q.resolve() != Path(__file__).resolve() and "site" not in q.parts)


def test_no_link_to_a_moving_branch_and_no_unopenable_reference():
    problems = []
    for p in scanned_files():
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if MOVING.search(line):
                problems.append(f"{p.relative_to(ROOT)}:{n}: a branch, not a release tag or commit")
            problems += [f"{p.relative_to(ROOT)}:{n}: {ref} (cite {fix})" for ref, fix in GONE.items() if ref in line]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the cited line holds the name
def definition_span(source: str, symbol: str) -> tuple[int, int] | None:
    """``(first, last)`` line of ``symbol`` (``f`` or ``Class.method``) in Python ``source``."""
    body, node = ast.parse(source).body, None
    for part in symbol.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node.lineno, node.end_lineno


def sglang_tree(version: str) -> Path:
    """The ``sglang`` package of release ``version`` (``v0.5.23``), from ``.conformance``."""
    pin = version.removeprefix("v")
    installed = CONF / f"sglang-{pin}" / "sglang"
    if installed.is_dir():
        return installed
    target = CONF / "sources" / f"sglang-{pin}"
    if not (target / "sglang").is_dir():
        wheels = CONF / "sources" / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={pin}",
                        "-d", str(wheels)], check=True, capture_output=True, timeout=600)
        wheel = next(wheels.glob(f"sglang-{pin}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target, [m for m in z.namelist() if m.startswith("sglang/") and m.endswith(".py")])
    return target / "sglang"


def line_problems(sources, tree=sglang_tree) -> list[str]:
    problems = []
    for inv_id, s in sources:
        m, lab = BLOB.match(s.url), LABEL.match(s.label)
        if not m or m.group("repo") != "sgl-project/sglang" or not m.group("ref").startswith("v"):
            continue
        if not lab or lab.group("ref") != m.group("ref"):
            problems.append(f"{inv_id}: {s.label}: the label does not name a symbol at {m.group('ref')}")
            continue
        path = tree(m.group("ref")) / m.group("path").removeprefix("python/sglang/")
        if not path.is_file():
            problems.append(f"{inv_id}: {m.group('path')} is not in sglang {m.group('ref')}")
            continue
        text, symbol, line = path.read_text(), lab.group("symbol"), int(m.group("line"))
        span = definition_span(text, symbol)
        lines = text.splitlines()
        if span is None and 0 < line <= len(lines) and symbol in lines[line - 1]:
            continue  # an attribute the line assigns (``EagleDraftInput.ALLOC_LEN_PER_DECODE = ...``)
        if span is None:
            problems.append(f"{inv_id}: {lab.group('symbol')} is not defined in {m.group('path')}@{m.group('ref')}")
        elif not span[0] <= line <= span[1]:
            problems.append(f"{inv_id}: line {line} is outside {lab.group('symbol')} "
                            f"(lines {span[0]}..{span[1]} at {m.group('ref')})")
    return problems


@pytest.mark.conformance
def test_every_cited_sglang_line_is_inside_the_cited_definition():
    sources = blob_sources()
    checked = [s for s in sources if "sgl-project/sglang/blob/v" in s[1].url]
    assert len(checked) > 50
    problems = line_problems(sources)
    assert not problems, "\n".join(problems)


@pytest.mark.conformance
def test_the_line_check_catches_a_wrong_line_and_a_wrong_name():
    """Negative control on the real wheel: PA-002's source moved off its function, then renamed."""
    from refspec.core.sources import Source
    (src,) = [s for s in RULES["PA-002"].sources if "/blob/" in s.url]
    assert not line_problems([("PA-002", src)])
    off = Source(src.label, re.sub(r"#L\d+$", "#L1", src.url))
    renamed = Source(src.label.replace("init_forward_metadata", "no_such_method"), src.url)
    assert "outside" in line_problems([("PA-002", off)])[0]
    assert "not defined" in line_problems([("PA-002", renamed)])[0]
