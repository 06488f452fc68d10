"""``python -m refspec check --quick`` in-process: exit code 0 and a row for every mode."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
    row = re.compile(r"^mla +(\S+(?: k=2)?) +\d+ +emulator +(.+?) +pass ", re.M)  # an MLA row that passes
    mla = {(m.group(1), m.group(2)) for m in row.finditer(out)}
    want = {(m, "T1 vs oracle") for m in MODES}
    want |= {(m, c) for m in GRAPHED for c in ("graph == eager", "T1 graph vs oracle")}
    want |= {(t, c) for t in ("TREE_VERIFY k=2", "TREE_DRAFT k=2")
             for c in ("T1 eager vs oracle", "graph == eager", "T1 graph vs oracle")}
    assert want <= mla, f"mla rows missing: {sorted(want - mla)}"
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
                 "TOL-002", "contract:", "eager:", "graph:", "loops:", "tree:", "mla:", "ML-002", "ML-010"):
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


@pytest.mark.spec("ML-002", "ML-005", "ML-010")
def test_check_mla_rows_fail_on_mla_variants():
    """The MLA rows are not decorative either: without qv (mla-qv-dropped) the eager verdict misses
    its budget while the non-absorbed prefill, which makes no qv call, still passes; a store that
    writes slot 0 (mla-store-writes-slot-0) fails the replay check by ML-002."""
    from refspec.cli._check_mla import _eager_verdict, _graph_verdicts
    from refspec.harness.mla_scenario import mla_mode_scenarios

    scs = mla_mode_scenarios(4, num_heads=4, seed=4)
    assert _eager_verdict("TARGET_VERIFY", scs["TARGET_VERIFY"], "emulator").ok
    with variants.enabled("mla-qv-dropped"):
        assert not _eager_verdict("TARGET_VERIFY", scs["TARGET_VERIFY"], "emulator").ok
        assert _eager_verdict("EXTEND", scs["EXTEND"], "emulator").ok
    assert all(v.ok for v in _graph_verdicts(scs["DECODE"], "emulator"))
    with variants.enabled("mla-store-writes-slot-0"), pytest.raises(AssertionError, match=r"slot 0 \(ML-002\)"):
        _graph_verdicts(scs["DECODE"], "emulator")


@pytest.mark.spec("ML-013")
def test_check_mla_rows_skip_a_provider_without_the_mla_kernel():
    """A real provider whose build has no hdim 64 / 512 kernel (here: no readable build
    configuration at all) gets skip rows naming ML-013, never a pass or a FAIL."""
    from refspec.cli._check_mla import mla_rows
    from refspec.cli.check import _guard, _row

    rows = list(mla_rows("cpu", None, True, row=_row, guard=_guard, providers=lambda device: ["fa3"]))
    assert rows and all(r["result"] == "skip" and r["worst"].startswith("ML-013:") for r in rows)
    assert {r["mode"] for r in rows} == set(MODES) | {"TREE_VERIFY k=2", "TREE_DRAFT k=2"}
