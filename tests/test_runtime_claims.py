"""Run-time claims quote a measurement (issue 43, item 5): ``check --help``, the README's ``check``
paragraph and every tutorial's first paragraph say "W s wall, C s of CPU", and those numbers are
the row of ``benchmarks/results/cpu_learner_times.md`` (written by ``benchmarks/learner_times.py``,
with its command, machine, load, date and commit) for that item.  No timing happens here: speed
lives in the committed benchmark, this test keeps the sentences equal to it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results/cpu_learner_times.md"
CLAIM = re.compile(r"(\d+) s wall, (\d+) s of CPU")
TUTORIALS = {p.name[:2]: p for p in sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))}
SITES = {"check-quick": [ROOT / "refspec" / "cli" / "check.py", ROOT / "README.md"],
         **{n: [p] for n, p in TUTORIALS.items()}}


def _rows() -> dict[str, tuple[str, int, int, int, str]]:
    """item -> (command, exit, wall s, CPU s, commit), read off the Markdown table."""
    out = {}
    for line in RESULTS.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[2].lstrip("-").isdigit():
            out[cells[0]] = (cells[1].strip("`"), int(cells[2]), int(cells[3]), int(cells[4]), cells[7])
    return out


def test_the_results_cover_check_quick_and_every_tutorial_and_every_run_passed():
    rows = _rows()
    assert set(rows) == set(SITES), f"rows {sorted(rows)} vs items {sorted(SITES)}"
    assert rows["check-quick"][0] == "python -m refspec check --quick"
    for n, p in TUTORIALS.items():
        assert rows[n][0] == f"python tutorials/{p.name}", rows[n]
    failed = {k: r for k, r in rows.items() if r[1] != 0}
    assert not failed, f"a timed run failed: {failed}"
    text = RESULTS.read_text(encoding="utf-8")
    assert "benchmarks/learner_times.py" in text and "Machine:" in text
    assert all(re.fullmatch(r"[0-9a-f]{7,}( \(with uncommitted changes\))?", r[4]) for r in rows.values())


@pytest.mark.parametrize("item", sorted(SITES))
def test_each_claim_is_its_measured_row(item):
    cmd, rc, wall, cpu, _ = _rows()[item]
    for site in SITES[item]:
        text = site.read_text(encoding="utf-8")
        if site.name == "README.md":  # the README's claim sits in its check paragraph
            text = text.split("## The whole matrix on a CPU", 1)[1].split("\n## ", 1)[0]
        claims = [(int(w), int(c)) for w, c in CLAIM.findall(" ".join(text.replace("#", " ").split()))]
        assert claims, f"{site.relative_to(ROOT)} states no measured run time for {item}"
        assert set(claims) == {(wall, cpu)}, f"{site.relative_to(ROOT)} says {claims}, {RESULTS.name} has {wall}, {cpu}"
        assert "benchmarks/results/cpu_learner_times.md" in text, f"{site.relative_to(ROOT)}: name the measurement"


def test_no_stale_estimates_remain():
    """The claims issue 43 found are gone (the guesses and the 2-5 minutes)."""
    stale = {"refspec/cli/check.py": "5 min measured", "tutorials/06_seed_bug.py": "expect 2-5 minutes",
             "tutorials/05_spec_decoding.py": "About 40–70 s", "docs/tutorials/index.md": "128-258 s"}
    found = [f for f, s in stale.items() if s in (ROOT / f).read_text(encoding="utf-8")]
    assert not found, found
