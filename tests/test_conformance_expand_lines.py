"""The tree draft-decode expand page table's cited line (the review of sglang#15469).

A small fake backend with the shapes of 0.5.6.post2's / #15469's code: the P = 1 eager
assignment that the P > 1 block overwrites through ``self.forward_metadata_spec_decode_expand``,
a replay that calls a module-level helper of the backend's own file writing its ``page_table``
parameter with ``scatter_``, a P = 1 ``else:`` writing ``metadata_expand.page_table[: x.shape[0]]``
(nested brackets), and a TARGET_VERIFY branch that writes the same attribute.  The cited line
must be the write that ran, in the helper, named with the backend's call; a static read never
cites the other mode's branch.  The old pattern (written out below, as it was) is the negative
control: it matches none of the writes that ran.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
from types import SimpleNamespace as NS

import pytest
import torch

from refspec.conformance import lines, rules
from refspec.conformance.compare import UNREAD

FA_SRC = '''
import torch


class FlashAttentionBackend:
    def init_forward_metadata(self, fb, cache_loc):
        if fb.forward_mode.is_decode_or_idle():
            metadata_expand = NS()
            metadata_expand.page_table = cache_loc[:, :1].contiguous()
            self.forward_metadata_spec_decode_expand = metadata_expand
            if self.page_size > 1:
                expand_page_table = torch.zeros(cache_loc.shape[0], 3, dtype=torch.int32)
                set_expand(
                    page_table=expand_page_table,
                    cache_loc=cache_loc,
                )
                self.forward_metadata_spec_decode_expand.page_table = expand_page_table

    def init_forward_metadata_replay_cuda_graph(self, fb, cache_loc, metadata_expand):
        if fb.forward_mode.is_decode_or_idle():
            metadata = self.prefix
            metadata.page_table[:, :1].copy_(cache_loc[:, :1])
            if self.page_size > 1:
                set_expand(
                    page_table=metadata_expand.page_table,
                    cache_loc=cache_loc,
                )
            else:
                metadata_expand.page_table[: cache_loc.shape[0]].copy_(cache_loc[:, :1])
        elif fb.forward_mode.is_target_verify():
            metadata_expand.page_table.copy_(cache_loc)


def set_expand(page_table, cache_loc):
    positions = torch.zeros_like(cache_loc)
    page_table[: cache_loc.shape[0], :].scatter_(1, positions, cache_loc.to(torch.int32))


NS = __import__("types").SimpleNamespace
'''

#: the expand-table pattern before this fix (rules._writes with expand=True), for the negative control
OLD_EXPAND = re.compile(r"metadata_expand\.\bpage_table(?!\w*stride)\w*\b(\[[^\]]*\])?\s*(=(?!=)|\.copy_\(|\.fill_\(|"
                        r"\+=|-=)|tl\.store\(\s*page_table(?!\w*stride)")


def _site(tmp_path):
    site = tmp_path / "python"
    p = site / rules.FA
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(FA_SRC))
    return site


def _line(site, text, nth=0):
    return [i for i, x in enumerate((site / rules.FA).read_text().splitlines(), 1) if text in x][nth]


def _traced(site, monkeypatch, page_size):
    monkeypatch.setitem(sys.modules, "sglang", NS(__path__=[str(site / "sglang")]))
    spec = importlib.util.spec_from_file_location("fake_fa_expand", site / rules.FA)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    be = mod.FlashAttentionBackend()
    be.page_size, be.prefix = page_size, NS(page_table=torch.zeros(2, 4, dtype=torch.int32))
    fb = NS(forward_mode=NS(is_decode_or_idle=lambda: True, is_target_verify=lambda: False))
    cache_loc = torch.tensor([[4, 5, 6], [8, 9, 10]])
    graph = NS(page_table=torch.zeros(2, 3, dtype=torch.int32))
    tracer = lines.Tracer(str(site))
    with tracer.job():
        be.init_forward_metadata(fb, cache_loc)
        eager = lines.mark({"page_table": be.forward_metadata_spec_decode_expand.page_table.clone()})
        be.init_forward_metadata_replay_cuda_graph(fb, cache_loc, graph)
        replay = lines.mark({"page_table": graph.page_table.clone()})
    out = tracer.attach({("eager", 0): eager, ("replay", 0): replay})
    return out[("eager", 0)][lines.EXECUTED], out[("replay", 0)][lines.EXECUTED]


@pytest.mark.spec("TR-014", "TR-018")
def test_the_expand_table_cites_the_write_that_ran_through_any_owner_and_the_helper(tmp_path, monkeypatch):
    site = _site(tmp_path)
    eager, replay = _traced(site, monkeypatch, page_size=2)
    p1 = _line(site, "metadata_expand.page_table = cache_loc[:, :1]")
    scatter = _line(site, ".scatter_(1, positions")
    eager_call, replay_call = _line(site, "set_expand("), _line(site, "set_expand(", 1)
    owner = _line(site, "self.forward_metadata_spec_decode_expand.page_table = expand_page_table")
    assert (rules.FA, p1, None) in eager and (rules.FA, owner, None) in eager
    # negative control: the old pattern sees only the P = 1 assignment the P > 1 block overwrites
    text = (site / rules.FA).read_text().splitlines()
    old_hits = [n for rel, n, _ in eager if OLD_EXPAND.search(text[n - 1])]
    assert old_hits == [p1]
    assert not OLD_EXPAND.search(text[scatter - 1]) and not OLD_EXPAND.search(text[owner - 1])
    assert not OLD_EXPAND.search(text[_line(site, "metadata_expand.page_table[: cache_loc.shape[0]]") - 1])
    # eager: the helper's scatter_ into the local the backend then stores as the expand table (values, not the
    # binding of the local), named with the backend's call
    assert rules.ran(str(site), eager, "expand:page_table[live]") == (rules.FA, scatter, eager_call)
    # replay at P = 2: the helper's scatter_ into the argument metadata_expand.page_table, run from the call
    assert rules.ran(str(site), replay, "expand:page_table[live]") == (rules.FA, scatter, replay_call)
    # the prefix table: the prefix write, never the helper's write of the expand buffer
    prefix = _line(site, "metadata.page_table[:, :1].copy_(")
    assert rules.ran(str(site), replay, "prefix:page_table[live]") == (rules.FA, prefix, None)


@pytest.mark.spec("TR-018")
def test_the_p1_branch_is_cited_only_where_it_ran_and_never_another_modes_branch(tmp_path, monkeypatch):
    site = _site(tmp_path)
    _, replay = _traced(site, monkeypatch, page_size=1)
    nested = _line(site, "metadata_expand.page_table[: cache_loc.shape[0]].copy_(")
    verify = _line(site, "metadata_expand.page_table.copy_(cache_loc)")
    # P = 1 ran the else: its write (nested brackets in the index) is the one cited
    assert rules.ran(str(site), replay, "expand:page_table[live]") == (rules.FA, nested, None)
    # statically (nothing traced) the decode branch's first write, never the TARGET_VERIFY one
    assert rules.locate(str(site), (rules.FA,), "legacy", "tree_draft_decode", "replay",
                        "expand:page_table[live]") == (rules.FA, nested)
    # a mode whose only write is in another mode's branch: no line rather than that one
    src = textwrap.dedent(FA_SRC).replace("metadata_expand.page_table[: cache_loc.shape[0]].copy_(cache_loc[:, :1])",
                                          "pass")
    (site / rules.FA).write_text(src)
    rules._tree.cache_clear(), rules._lines.cache_clear(), rules._functions.cache_clear()
    got = rules.locate(str(site), (rules.FA,), "legacy", "tree_draft_decode", "replay", "expand:page_table[live]")
    assert got is None, got
    assert rules.locate(str(site), (rules.FA,), "legacy", "tree_verify", "replay",
                        "expand:page_table[live]") == (rules.FA, verify)
    rules._tree.cache_clear(), rules._lines.cache_clear(), rules._functions.cache_clear()


def test_a_keyword_argument_of_a_call_assigned_to_a_result_is_not_a_write(tmp_path):
    """``o = f(page_table=x.page_table)`` assigns o; the old check read any Assign statement as a write."""
    pat = rules._field_pattern("page_table[live]")
    src = "o = flash(\n    page_table=self.forward_metadata.page_table,\n)\nmetadata.page_table = x\n"
    path = tmp_path / "m.py"
    path.write_text(src)
    assert not rules._is_write(str(path), 2, src.splitlines()[1], pat)
    assert rules._is_write(str(path), 4, src.splitlines()[3], pat)  # the control: a real assignment is one


def _md(K, table_rows):
    cu = [0]
    for k in K:
        cu.append(cu[-1] + k)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return {"cache_seqlens_int32": i32(K), "cu_seqlens_q": i32(list(range(len(K) + 1))), "cu_seqlens_k": i32(cu),
            "max_seq_len_q": 1, "max_seq_len_k": 0, "page_table": i32(table_rows)}


@pytest.mark.spec("TR-014", "TR-018", "PA-003", "PA-007")
@pytest.mark.parametrize("pin", ["0.5.12.post1", "0.5.23"])
def test_a_tree_expand_width_fails_only_below_the_kernel_bound(pin):
    """P = 2, expand K = [2, 3] (lp + s + 1): rows read ceil(2/2) = 1 and ceil(3/2) = 2 pages, the kernel
    bound is 2 columns.  refspec's s + 2 = 3 wide buffer vs upstream's 2 (``decode_length + 1`` at s = 1):
    a width difference at the bound, documented in every phase; upstream's 1 column drops row 1's second
    page: PA-003 eager / CG-008 in a graph phase, never documented; a dead column that differs is reported
    as not read by the FA3 kernel (PA-007), never a failure."""
    from refspec.conformance.cases import Job
    from refspec.conformance.run import rows_for

    prefix = _md([4, 4], [[1, 2], [3, 4]])
    ours = {"prefix": prefix, "expand": _md([2, 3], [[7, 0, 0], [9, 10, 0]])}
    at_bound = {"prefix": prefix, "expand": _md([2, 3], [[7, 0], [9, 10]])}
    below = {"prefix": prefix, "expand": _md([2, 3], [[7], [9]])}
    content = {"prefix": prefix, "expand": _md([2, 3], [[7, 5], [9, 10]])}  # row 0's dead column 1 differs
    for phase in ("eager", "capture", "replay"):
        job = Job("tree_draft_decode/k2/P2", "tree_draft_decode", 2, "k2", True, {}, {(phase, 1): ours})
        (row,) = rows_for(pin, [job], {job.id: {(phase, 1): at_bound}})
        assert row.ok and [d.documented for d in row.diffs] == ["tree-expand-table-width"], (phase, row.diffs)
        (row,) = rows_for(pin, [job], {job.id: {(phase, 1): below}})
        assert not row.ok and {f.rule for f in row.findings} == {"PA-003" if phase == "eager" else "CG-008"}
        (row,) = rows_for(pin, [job], {job.id: {(phase, 1): content}})
        assert row.ok and [(d.field, d.documented) for d in row.diffs] == [("expand:page_table[dead]", UNREAD)]
        # negative control: the prefix part's width entry does not reach the expand table
        assert all(d.documented != "tree-prefix-table-width" for d in row.diffs)


def test_an_exception_in_a_helper_also_cites_the_backend_hook_that_ran_it(tmp_path, monkeypatch):
    """upstream_common.describe: the innermost upstream frame (the helper's scatter_) and the innermost backend hook's
    line (``init_forward_metadata*``) that was running it; the finding carries that line as ``via``."""
    from refspec.conformance import report
    from refspec.conformance import upstream_common as worker  # (describe: what the worker reports)

    site = _site(tmp_path)
    monkeypatch.setitem(sys.modules, "sglang", NS(__path__=[str(site / "sglang")]))
    spec = importlib.util.spec_from_file_location("fake_fa_err", site / rules.FA)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    be = mod.FlashAttentionBackend()
    be.page_size, be.prefix = 2, NS(page_table=torch.zeros(2, 4, dtype=torch.int32))
    fb = NS(forward_mode=NS(is_decode_or_idle=lambda: True, is_target_verify=lambda: False))
    cache_loc = torch.tensor([[4, 5, 6], [8, 9, 10]])
    narrow = NS(page_table=torch.zeros(2, 0, dtype=torch.int32))  # no column: scatter_ index 0 is out of bounds
    with pytest.raises(RuntimeError) as e:
        be.init_forward_metadata_replay_cuda_graph(fb, cache_loc, narrow)
    text = worker.describe(e.value)
    scatter, call = _line(site, ".scatter_(1, positions"), _line(site, "set_expand(", 1)
    hook = [n for n in range(call, call + 4) if f"flashattention_backend.py:{n})" in text]
    assert text.startswith(f"RuntimeError at {rules.FA}:{scatter} (run from flashattention_backend.py:") and hook
    row = report.Row("@ x", "tree_draft_decode/k2/P2", "tree_draft_decode", 2, "k2", "replay", 0, error=text)
    report.find(row, NS(site=str(site), tag=None, shape=NS(kernels=None, hooks="legacy")))
    (f,) = row.findings
    assert f.where == (rules.FA, scatter) and f.via == (rules.FA, hook[0])
    assert f"run from flashattention_backend.py:{hook[0]}" in report.finding_line(row, f)
    # negative control: raised in the hook itself, no "run from" (nothing further in)
    with pytest.raises(AttributeError) as e2:
        be.init_forward_metadata_replay_cuda_graph(fb, cache_loc, None)
    assert "run from" not in worker.describe(e2.value)


@pytest.mark.spec("TR-018")
def test_a_failure_like_a_known_bug_on_other_code_says_so_and_still_fails():
    """draft-expand-unsliced-scatter (known.BUGS) is recognised only at its pins; on other code (a PR tree) a
    row with its error in the draft-decode replay carries the hint naming the PR that introduced it and the
    one that fixed it (sglang#15469, sglang#27360) and stays a failure.  Its dead-column field alone (S = 3)
    is not read by the kernel: reported, never a failure, so no hint either."""
    from refspec.conformance import known, report
    from refspec.conformance.cases import Job
    from refspec.conformance.run import rows_for

    b = known.by_key("draft-expand-unsliced-scatter")
    assert (b.introduced, b.fixed_by) == (15469, 27360)
    prefix = _md([4, 4], [[1, 2], [3, 4]])
    ours = {"prefix": prefix, "expand": _md([2, 3], [[7, 0, 0], [9, 10, 0]])}
    theirs = {"prefix": prefix, "expand": _md([2, 3], [[7, 8, 0], [9, 10, 11]])}  # extra pages in dead columns
    err = ("RuntimeError at sglang/srt/layers/attention/flashattention_backend.py:2501 (run from "
           "flashattention_backend.py:1852): index 2 is out of bounds for dimension 1 with size 2")
    for phase in ("replay", "eager"):
        job = Job("tree_draft_decode/k2/P2", "tree_draft_decode", 2, "k2", True, {}, {(phase, 0): ours})
        (row,) = rows_for("@ /src/pr", [job], {job.id: {(phase, 0): theirs}})
        assert row.ok and row.like is None and {d.documented for d in row.diffs} == {UNREAD}
    for phase, got, hinted in (("replay", err, True), ("eager", err, False)):
        job = Job("tree_draft_decode/k2/P2", "tree_draft_decode", 2, "k2", True, {}, {(phase, 0): ours})
        (row,) = rows_for("@ /src/pr", [job], {job.id: {(phase, 0): got}})
        assert not row.ok and row.bug is None
        assert (row.like == b.key) == hinted, (phase, row.like)
        line = report.finding_line(row, row.findings[0])
        want = "matches known upstream bug draft-expand-unsliced-scatter (introduced by sglang#15469, fixed by " \
               "sglang#27360); still a failure here"
        assert (want in line) == hinted, line
    # at its pin the bug itself is named (and suppresses), not the hint
    job = Job("tree_draft_decode/k2/P2", "tree_draft_decode", 2, "k2", True, {}, {("replay", 0): ours})
    (row,) = rows_for("0.5.12.post1", [job], {job.id: {("replay", 0): err}})
    assert row.bug == b.key and row.like is None


def test_a_review_collapses_fixed_rows_by_rule_mode_and_phase_and_keeps_new_failures_on_top():
    """report.review_markdown: 2 P x 2 k x 2 steps fixed rows of one rule become one table row listing
    P, the cases and the steps; every group is still listed inside a <details> block; the new failure is
    in the first table, before anything collapsed."""
    from refspec.conformance import report
    from refspec.conformance.compare import Diff

    def row(pin, P, k, step, phase="capture", diffs=()):
        r = report.Row(pin, f"tree_draft_decode/k{k}/P{P}", "tree_draft_decode", P, f"k{k}", phase, step, list(diffs))
        report.find(r)
        return r

    bad = Diff("expand:page_table[dead]", "width 2, rows differing [0]", "width 2")
    base, test = [], []
    for P in (1, 4):
        for k in (2, 4):
            for s in (0, 1):
                base.append(row("b", P, k, s, diffs=[bad]))
                test.append(row("t", P, k, s))
    base.append(row("b", 2, 2, 0, "replay"))
    test.append(row("t", 2, 2, 0, "replay", [bad]))
    chs = report.changes(base, test)
    assert sum(c.status == report.FIXED for c in chs) == 8
    rev = NS(changes=chs, test=NS(targets={"t": None}, rows=test, unreachable=[]),
             baseline=NS(targets={"b": None}, rows=base, unreachable=[]), not_on_baseline=None)
    md = report.review_markdown(rev)
    head, rest = md.split("Other changes", 1)
    assert "| new failure | tree_draft_decode k2 s=0 | 2 | replay | 1 |" in head and "| fixed |" not in head
    collapsed = [x for x in rest.split("<details>")[0].splitlines() if x.startswith("| fixed |")]
    assert collapsed == ["| fixed | tree_draft_decode | capture | TR-018 (baseline) | 1, 4 | k2, k4 | 0, 1 | 8 |"]
    full = rest.split("<details><summary>Every other changed group")[1].split("</details>")[0]
    assert sum(x.startswith("| fixed |") for x in full.splitlines()) == 8  # every group, collapsed away


def test_many_new_failure_groups_of_one_rule_collapse_with_every_group_below():
    """More than report.TOP_ROWS new-failure groups (2 P x 2 k x 2 steps of one rule) read as one row
    (P, cases, steps listed), every group still in a <details> block under it; up to TOP_ROWS stay one
    row each (the test above: 1 group)."""
    from refspec.conformance import report
    from refspec.conformance.compare import Diff

    def row(pin, P, k, step, diffs=()):
        r = report.Row(pin, f"tree_draft_decode/k{k}/P{P}", "tree_draft_decode", P, f"k{k}", "replay", step,
                       list(diffs))
        report.find(r)
        return r

    bad = Diff("expand:page_table[dead]", "width 2, rows differing [0]", "width 2")
    keys = [(P, k, st) for P in (1, 4) for k in (2, 4) for st in (0, 1)]
    base = [row("b", *key) for key in keys]
    test = [row("t", *key, diffs=[bad]) for key in keys]
    chs = report.changes(base, test)
    assert sum(c.status == report.NEW_FAILURE for c in chs) == 8 > report.TOP_ROWS
    rev = NS(changes=chs, test=NS(targets={"t": None}, rows=test, unreachable=[]),
             baseline=NS(targets={"b": None}, rows=base, unreachable=[]), not_on_baseline=None)
    md = report.review_markdown(rev)
    head, below = md.split("<details><summary>Every new-failure group (8)</summary>", 1)
    assert [x for x in head.splitlines() if x.startswith("| new failure |")] == [
        "| new failure | tree_draft_decode | replay | TR-018 | 1, 4 | k2, k4 | 0, 1 | 8 |"]
    full = below.split("</details>")[0]
    assert sum(x.startswith("| new failure |") for x in full.splitlines()) == 8


@pytest.mark.spec("PA-011")
def test_a_live_page_id_outside_the_pool_is_pa_011_before_the_modes_rule():
    """PA-011: the page ids of the rows the kernel reads lie in [0, num_pages).  0.5.6.post2's tree
    draft-decode replay hands padded rows page id -1: PA-011 (kernel contract), not TR-018; a wrong id
    inside the pool (the negative control) stays the mode's rule."""
    from refspec.conformance import report
    from refspec.conformance.cases import Job
    from refspec.conformance.compare import compare
    from refspec.conformance.run import rows_for

    ours = _md([1, 1], [[7], [0]])  # row 1: a padded row, slot 0
    (d,) = compare(ours, _md([1, 1], [[7], [-1]]), page_size=2)
    assert (d.field, d.out_of_pool, d.theirs) == ("page_table[live]", True, "row 1: [-1]")
    (d,) = compare(ours, _md([1, 1], [[7], [5]]), page_size=2)
    assert not d.out_of_pool
    (d,) = compare(ours, _md([1, 1], [[7], [5]]), page_size=2, num_pages=5)  # 5 is past a 5-page pool
    assert d.out_of_pool
    prefix = _md([4, 4], [[1, 2], [3, 4]])
    for theirs, rule in ((-1, "PA-011"), (5, "TR-018")):
        job = Job("tree_draft_decode/k2/P2", "tree_draft_decode", 2, "k2", True, {},
                  {("replay", 0): {"prefix": prefix, "expand": ours}})
        got = {"prefix": prefix, "expand": _md([1, 1], [[7], [theirs]])}
        (row,) = rows_for("@ x", [job], {job.id: {("replay", 0): got}})
        assert [f.rule for f in row.findings] == [rule]
    assert report.rules.by_cause({"TR-018", "PA-011"}) == ["PA-011", "TR-018"]
