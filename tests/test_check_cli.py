"""``python -m refspec check --quick`` in-process: exit code 0 and a row for every mode."""

from __future__ import annotations

from pathlib import Path

from refspec.mutants import variants
from refspec.cli.check import GRAPHED, QUICK_CHECKS, format_header, main
from refspec.harness.modes import MODES


def _table(capsys, argv):
    rc = main(argv)
    return rc, capsys.readouterr().out


def test_check_quick_passes_and_lists_every_mode(capsys):
    rc, out = _table(capsys, ["--quick"])
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines()]
    eager = {r[1] for r in rows if r and r[0] == "eager" and "pass" in r}
    graph = {r[1] for r in rows if r and r[0] == "graph" and "pass" in r}
    assert set(MODES) <= eager, f"eager rows {eager}"
    assert set(GRAPHED) <= graph, f"graph rows {graph}"
    assert {"horizon", "empty", "slack"} <= {r[1] for r in rows if r and r[0] == "contract"}
    assert " FAIL " not in out and "0 FAIL" in out
    # the count check --help and the README quote (issue 43), and the legend: once, above the table
    assert f"\n{QUICK_CHECKS} checks: {QUICK_CHECKS} pass, 0 FAIL" in out
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert f"GQA 4: {QUICK_CHECKS} checks)" in " ".join(readme.split())
    lines = out.splitlines()
    assert lines[0].startswith("How to read the table") and out.count("How to read the table") == 1
    header = lines.index(format_header().splitlines()[0])
    legend = "\n".join(lines[:header])
    for word in ("horizon (h-1)/2", "slack columns", "% of budget", "bitwise", "PA-004", "PA-005", "PA-007",
                 "TOL-002", "contract:", "eager:", "graph:", "loops:", "tree:"):
        assert word in legend, word


def test_check_fails_on_a_bug_variant(capsys):
    """The table is not decorative: the v2 double-counted K (MD-008) makes it exit 1."""
    with variants.enabled("de-v2-k-double-count"):
        rc, out = _table(capsys, ["--quick", "--page-sizes", "4", "--sections", "eager"])
    assert rc == 1
    failing = [line for line in out.splitlines() if " FAIL " in line]
    assert failing and all("DRAFT_EXTEND_V2" in line for line in failing), out
    legend = out.split("section    mode", 1)[0]  # only the run section's line in the legend
    assert "  eager:" in legend and "contract:" not in legend and "loops:" not in legend
