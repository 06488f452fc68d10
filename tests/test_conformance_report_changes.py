"""``--baseline``'s change classes and what it says is newly checked, on synthetic rows (no upstream run).

A row failing on both sides is ``pre-existing`` only when it breaks the same (rule, field) pairs;
fewer pairs and none new is ``partly fixed`` (not a failure; said beside ``fixed`` with the pairs
gone); a new pair is ``newly broken on a failing row`` (a new failure, exit 1, with only its new
pairs listed as findings).  A code change that makes the kernel's ``scheduler_metadata`` checkable
(0.5.11's precompute) is said on the console and in the report: ``PA-013 now checked in N results``.
The expected words and rule IDs are written out here.
"""

from __future__ import annotations

import pytest

from refspec.conformance import report
from refspec.conformance import run as conformance
from refspec.conformance.report import Finding, Row

FA = "sglang/srt/layers/attention/flashattention_backend.py"


def row(pin: str, *broken: tuple[str, str | None], job: str = "mla_decode/P1/B3/bs4", sched: int = 0,
        calls: int = 0) -> Row:
    """A replay row of ``job`` failing by the (rule, field) pairs ``broken`` (none: it agrees)."""
    r = Row(pin, job, job.split("/")[0], 1, "B3/bs4", "replay", None, batch=4, kernel_calls=calls,
            sched_checked=sched)
    for rid, fld in broken:
        r.diffs.append(report.Diff(fld or "x", "a", "b"))
        r.findings.append(Finding(rid, "upstream behaviour", fld, "a", "b", (FA, 10), None))
    return r


# the reviewer's row: mla_decode/P1/B3/bs4 replay at 0.4.7 and 0.4.7.post1
BASE = (("MD-003", "kernel:cache_seqlens"), ("ML-002", "mla:slot0"), ("ML-005", "mla:out[padded]"))


@pytest.mark.spec("MD-003")
def test_a_failing_row_that_loses_a_rule_is_partly_fixed_not_pre_existing():
    (c,) = report.changes([row("base", *BASE)], [row("pr", *BASE[1:])])
    assert c.status == report.PARTLY_FIXED and not c.fails
    assert c.removed == {("MD-003", "kernel:cache_seqlens")} and c.added == set()
    said = report.change_summary([c], "pr", "base")
    assert "0 new failures, 0 fixed, 1 partly fixed [no longer MD-003 (kernel:cache_seqlens)]" in said
    assert "0 pre-existing" in said
    table = report.changes_table([c])
    assert any(x.startswith("partly fixed") and "no longer MD-003 (kernel:cache_seqlens); still DIFFERS" in x
               for x in table.splitlines())
    assert "pre-existing:" not in table


@pytest.mark.spec("MD-003")
def test_a_failing_row_that_gains_a_rule_is_newly_broken_and_a_new_failure_listing_only_the_new_pair():
    (c,) = report.changes([row("base", *BASE[1:])], [row("pr", *BASE)])
    assert c.status == report.NEWLY_BROKEN and c.fails
    assert [(f.rule, f.field) for f in c.shown.findings] == [("MD-003", "kernel:cache_seqlens")]
    assert len(c.row.findings) == 3  # (the row itself keeps every finding: the full comparison lists them)
    said = report.change_summary([c], "pr", "base")
    assert said.endswith("1 new failure [MD-003] (1 of them newly broken on a failing row), 0 fixed, 0 new results "
                         "(0 same, 0 DIFFERS), 0 pre-existing, 0 unchanged")
    table = report.changes_table([c]).splitlines()
    assert table[1].startswith("newly broken on a failing row") and "now also MD-003 (kernel:cache_seqlens)" in table[1]
    found = [x for x in table if x.startswith("  DIFFERS ")]
    assert len(found) == 1 and "MD-003" in found[0]  # ML-002 / ML-005 fail on the baseline too: not listed as new


def test_a_row_trading_one_rule_for_another_is_newly_broken_and_says_both():
    (c,) = report.changes([row("base", BASE[0], BASE[1])], [row("pr", BASE[1], BASE[2])])
    assert c.status == report.NEWLY_BROKEN
    cell = report._change_cell(c.status, [c])
    assert cell.startswith("now also ML-005 (mla:out[padded]), no longer MD-003 (kernel:cache_seqlens); DIFFERS")


def test_the_same_pairs_on_both_sides_stay_pre_existing_and_a_passing_row_is_fixed():
    """Negative controls of the two classes above: the same set, and the whole set gone."""
    chs = report.changes([row("base", *BASE), row("base", *BASE, job="mla_verify/P1/B3/bs4")],
                         [row("pr", *BASE), row("pr", job="mla_verify/P1/B3/bs4")])
    assert [c.status for c in chs] == [report.PRE_EXISTING, report.FIXED]
    assert "partly fixed" not in report.change_summary(chs, "pr", "base")


def review_of(base_rows: list[Row], test_rows: list[Row]) -> conformance.Review:
    outs = [conformance.Outcome(rows, {}, {"total": 0.0}, {rows[0].pin: None}) for rows in (base_rows, test_rows)]
    return conformance.Review(outs[0], outs[1], report.changes(base_rows, test_rows))


@pytest.mark.spec("PA-013")
def test_a_scheduler_metadata_new_in_the_code_under_test_is_said_newly_checked_on_console_and_report():
    """0.5.11's precompute: every row agrees on both sides (unchanged), yet PA-013 checks its calls only there."""
    base = [row("0.5.10.post1", job=f"decode/P{P}/B3/bs4", calls=2) for P in (1, 16)]
    test = [row("0.5.11", job=f"decode/P{P}/B3/bs4", calls=2, sched=2) for P in (1, 16)]
    rev = review_of(base, test)
    assert [c.status for c in rev.changes] == [report.UNCHANGED] * 2
    (line,) = report.checked_lines(rev.changes)
    assert line.startswith("PA-013 now checked in 2 results (scheduler_metadata, new in this code: 4 kernel calls "
                           "handed one")
    text = conformance.render_review(rev)
    assert f"== newly checked: {line}" in text
    md = report.review_markdown(rev)
    assert f"Newly checked: {line}." in md.split("<details>")[0]  # in what this PR changes, not only in the block
    # the reverse, and the kernel comparison itself
    rev = review_of(test, [row("0.5.11", job=f"decode/P{P}/B3/bs4") for P in (1, 16)])
    assert report.checked_lines(rev.changes) == [
        "PA-013 no longer checked in 2 results (the baseline's kernel calls there were handed a scheduler_metadata, "
        "this code's are not)",
        "kernel arguments no longer compared in 2 results (this code's forward recorded no kernel call there; the "
        "baseline's did)"]


def test_nothing_newly_checked_says_nothing():
    """Negative control: the same kernel counts on both sides add no line."""
    base = [row("a", calls=2, sched=2)]
    rev = review_of(base, [row("b", calls=2, sched=2)])
    assert report.checked_lines(rev.changes) == []
    assert "newly checked" not in conformance.render_review(rev) + report.review_markdown(rev)
