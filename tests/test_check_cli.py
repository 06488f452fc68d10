"""``python -m refspec check --quick`` in-process: exit code 0 and a row for every mode."""

from __future__ import annotations

from refspec.mutants import variants
from refspec.cli.check import GRAPHED, main
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


def test_check_fails_on_a_bug_variant(capsys):
    """The table is not decorative: the v2 double-counted K (MD-008) makes it exit 1."""
    with variants.enabled("de-v2-k-double-count"):
        rc, out = _table(capsys, ["--quick", "--page-sizes", "4", "--sections", "eager"])
    assert rc == 1
    failing = [line for line in out.splitlines() if " FAIL " in line]
    assert failing and all("DRAFT_EXTEND_V2" in line for line in failing), out
