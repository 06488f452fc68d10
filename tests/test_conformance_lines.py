"""The cited upstream line is the line that ran (offline: a tiny fake upstream module run in-process
under :class:`refspec.conformance.lines.Tracer`), and the report's wording, order and counts.

The fake backend writes ``cache_seqlens_int32`` in a nested branch that does not run (the ragged
layout) and in the one that does; the static rule ("first write after the mode's branch") cites
the dead one (the negative control), the traced rule the executed one.  A capture-style buffer
binding is passed over for the line that writes values; a keyword argument is not a write; a
write in a helper file names the backend line that called it.
"""

from __future__ import annotations

import importlib.util
import textwrap
from types import SimpleNamespace as NS

import torch

from refspec.conformance import lines, report, rules
from refspec.conformance.compare import Diff

FA_SRC = '''
import torch

from sglang.kernels.pages import fill_pages


class FlashAttentionBackend:
    def _apply_cuda_graph_metadata(self, metadata, forward_batch, ragged=None):
        if forward_batch.forward_mode.is_target_verify():
            metadata.cache_seqlens_int32 = self.buffers["cache_seqlens"][:2]
            if ragged is not None:
                metadata.cache_seqlens_int32.copy_(ragged)
            else:
                metadata.cache_seqlens_int32.copy_(
                    forward_batch.seq_lens + 3
                )
            if ragged is not None:
                metadata.cu_seqlens_k = ragged.cu_seqlens_k
            else:
                metadata.cu_seqlens_k = torch.cumsum(metadata.cache_seqlens_int32, 0)
            fill_pages(
                page_table=metadata.page_table,
                cache_seqlens=metadata.cache_seqlens_int32,
            )
'''
HELPER_SRC = '''
def fill_pages(page_table, cache_seqlens):
    n = int(cache_seqlens.max())
    page_table[:, :n] = 7
'''


def _site(tmp_path):
    site = tmp_path / "python"
    for rel, src in ((rules.FA, FA_SRC), ("sglang/kernels/pages.py", HELPER_SRC)):
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))
    return site


def _line(site, rel, text, nth=0):
    hits = [i for i, x in enumerate((site / rel).read_text().splitlines(), 1) if text in x]
    return hits[nth]


def _run(site, monkeypatch):
    """Run the fake replay hook as the worker does: traced, fields marked, lines attached."""
    monkeypatch.syspath_prepend(str(site))
    mod = {}
    for name, rel in (("sglang", None), ("sglang.kernels", None), ("sglang.kernels.pages", "sglang/kernels/pages.py"),
                      ("fake_fa", rules.FA)):
        if rel is None:
            monkeypatch.setitem(__import__("sys").modules, name, NS(__path__=[str(site / name.replace(".", "/"))]))
            continue
        spec = importlib.util.spec_from_file_location(name, site / rel)
        m = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(__import__("sys").modules, name, m)
        spec.loader.exec_module(m)
        mod[name] = m
    be = mod["fake_fa"].FlashAttentionBackend()
    be.buffers = {"cache_seqlens": torch.zeros(4, dtype=torch.int32)}
    md = NS(page_table=torch.zeros(2, 8, dtype=torch.int32))
    fb = NS(forward_mode=NS(is_target_verify=lambda: True), seq_lens=torch.tensor([2, 4], dtype=torch.int32))
    tracer = lines.Tracer(str(site))
    with tracer.job():
        be._apply_cuda_graph_metadata(md, fb)
        out = {("replay", None): lines.mark({"cache_seqlens_int32": md.cache_seqlens_int32.clone()})}
    assert md.cache_seqlens_int32.tolist() == [5, 7]  # the else branch ran
    return tracer.attach(out)[("replay", None)][lines.EXECUTED]


def test_the_cited_line_is_the_write_that_ran_not_the_first_after_the_branch(tmp_path, monkeypatch):
    site = _site(tmp_path)
    executed = _run(site, monkeypatch)
    dead = _line(site, rules.FA, "metadata.cache_seqlens_int32.copy_(ragged)")
    live = _line(site, rules.FA, "metadata.cache_seqlens_int32.copy_(", 1)
    binding = _line(site, rules.FA, 'metadata.cache_seqlens_int32 = self.buffers["cache_seqlens"][:2]')
    assert (rules.FA, dead, None) not in executed and (rules.FA, live, None) in executed
    # negative control: the static rule cites the binding / the dead branch, never the live write
    static = rules.locate(str(site), (rules.FA,), "graph", "verify", "replay", "cache_seqlens_int32")
    assert static == (rules.FA, binding) and static[1] != live
    # traced: the executed write of values (the binding ran too, before it)
    assert (rules.FA, binding, None) in executed
    assert rules.ran(str(site), executed, "cache_seqlens_int32") == (rules.FA, live, None)
    # a plain assignment in the branch that does not run: static cites it, traced the one that ran
    dead_k = _line(site, rules.FA, "metadata.cu_seqlens_k = ragged.cu_seqlens_k")
    live_k = _line(site, rules.FA, "metadata.cu_seqlens_k = torch.cumsum(")
    assert rules.locate(str(site), (rules.FA,), "graph", "verify", "replay", "cu_seqlens_k") == (rules.FA, dead_k)
    assert rules.ran(str(site), executed, "cu_seqlens_k") == (rules.FA, live_k, None)
    # the keyword argument cache_seqlens=... ran but reads the field: no executed line writes cu_seqlens_q
    assert rules.ran(str(site), executed, "cu_seqlens_q") is None
    # a write in a helper file: that line, run from the backend's call
    call = _line(site, rules.FA, "fill_pages(")
    helper = _line(site, "sglang/kernels/pages.py", "page_table[:, :n] = 7")
    assert rules.ran(str(site), executed, "page_table[live]") == ("sglang/kernels/pages.py", helper, call)


def test_a_finding_says_whether_its_line_ran_or_was_read_statically(tmp_path, monkeypatch):
    site = _site(tmp_path)
    executed = _run(site, monkeypatch)
    target = NS(site=str(site), tag=None, shape=NS(kernels=None, hooks="graph"))
    live = _line(site, rules.FA, "metadata.cache_seqlens_int32.copy_(", 1)
    diff = Diff("cache_seqlens_int32", "[6, 8]", "[5, 7]")
    row = report.Row("@ x", "verify/P1/B3/bs4", "verify", 1, "B3/bs4", "replay", None, [diff])
    report.find(row, target, executed)
    (f,) = row.findings
    assert (f.rule, f.where, f.how) == ("MD-011", (rules.FA, live), report.RAN)
    assert report.finding_line(row, f).endswith(f"(upstream {rules.FA}:{live})")
    report.find(row, target)  # nothing traced (e.g. canned results): the static line, said so
    (f,) = row.findings
    binding = _line(site, rules.FA, 'metadata.cache_seqlens_int32 = self.buffers["cache_seqlens"][:2]')
    assert f.where == (rules.FA, binding) and f.how == report.STATIC
    assert report.finding_line(row, f).endswith(f"(upstream {rules.FA}:{binding}, not traced, read statically)")


def _bug_a_rows():
    """bugA-like: TARGET_VERIFY replay's K_b one short, so cu_seqlens_k and the live pages differ too,
    and at the context wall the table falls below the kernel bound; plus an idle row whose upstream raised."""
    rows = []
    for job in ("verify/P4/B3/bs4", "verify/P4/B5/bs8"):
        rows.append(report.Row("@ pr", job, "verify", 4, job[10:], "replay", None, [
            Diff("cache_seqlens_int32", "[7, 9]", "[6, 8]"), Diff("cu_seqlens_k", "[0, 7, 16]", "[0, 6, 14]"),
            Diff("page_table[live]", "row 1: [87, 487, 327]", "row 1: [87, 487, 0]")]))
    rows.append(report.Row("@ pr", "verify/P16/B3/bs4/wall", "verify", 16, "B3/bs4/wall", "replay", None, [
        Diff("cache_seqlens_int32", "[65]", "[64]"), Diff("cu_seqlens_k", "[0, 65]", "[0, 64]"),
        Diff("page_table[live]", "row 0: [1, 2, 3, 4, 5]", "row 0: [1, 2, 3, 4]", short_table=True),
        Diff("page_table[dead]", "width 6", "width 4 (< 5 pages, the kernel bound)", short_table=True)]))
    rows.append(report.Row("@ pr", "idle/P1/B3/bs4", "idle", 1, "B3/bs4", "eager", None,
                           error="RuntimeError at sglang/srt/layers/attention/flashattention_backend.py:638: max()"))
    for r in rows:
        report.find(r)
    return rows


def test_the_report_lists_the_rules_cause_first_and_counts_results():
    rows = _bug_a_rows()
    md = report.markdown(NS(rows=rows))
    # citing.md "Which ID to quote": K_b's rule first, then what is derived from it, the kernel bound last
    assert "> this code violates **MD-003**, **MD-011**, **MD-006**, **PA-002**, **CG-008** (cause first" in md
    table = [x for x in md.splitlines() if x.startswith("| [")]
    assert [x.split("]")[0][3:] for x in table] == ["MD-003", "MD-011", "MD-006", "PA-002", "CG-008"]
    # CG-008: one result (the wall row) with two findings (live and dead columns): counted once, as the summary does
    cg = next(x for x in table if x.startswith("| [CG-008]"))
    assert "| kernel contract | 1 | page_table[dead], page_table[live] |" in cg
    assert "| upstream behaviour | 3 | cache_seqlens_int32 |" in next(x for x in table if "[MD-011]" in x)
    assert "4 cases compared, 4 failing" in md
    assert report._cell(rows[2:3]).endswith("[MD-011,MD-006,CG-008]")


def test_an_upstream_error_is_worded_as_such_and_the_console_counts_what_the_report_writes():
    rows = _bug_a_rows()
    md = report.markdown(NS(rows=rows))
    (err,) = [x for x in md.splitlines() if x.startswith("- **MD-003**")]
    assert "refspec builds the metadata, upstream `RuntimeError at sglang/" in err and "a result" not in err
    bullets = [x for x in md.splitlines() if x.startswith("- **")]
    # 11 findings: 3 rows x 3 on verify (the wall's dead columns a 4th, by CG-008), and the idle error;
    # distinct by (rule, field, line, mode, phase): MD-011, MD-006, PA-002, CG-008 x 2 fields, MD-003
    assert len(bullets) == 6 and "6 distinct findings of 11 (one example per rule" in md
    assert "(3 findings like it)" in next(x for x in bullets if x.startswith("- **MD-011**"))
    text = report.table(rows, "@ pr", limit=4)
    assert text.splitlines()[-1] == ("  ... 7 more findings (11 in all, 6 distinct by rule, field, upstream line, "
                                     "mode and phase: -v prints all 11, --report FILE.md writes the 6 distinct ones)")


def test_the_known_bug_footer_says_whose_line_a_recorded_release_line_is():
    """bugs_table: a bug's recorded line at release X reads "the line recorded for this bug" when X is the
    code under review, and "not the code under review" otherwise (the review trial's footer finding)."""
    from refspec.conformance.known import BUGS
    from refspec.conformance.report import Row, bugs_table

    bug = next(b for b in BUGS if b.upstream)
    pin = bug.upstream[0][0]
    row = Row(pin=pin, job="j", mode="verify", page_size=16, shape="B3", phase="replay", step=None, bug=bug.key)
    assert f"at the release {pin} (the line recorded for this bug)" in bugs_table({bug.key}, [row])
    other = Row(pin="/tmp/a-pr-tree", job="j", mode="verify", page_size=16, shape="B3", phase="replay", step=None,
                bug=bug.key)
    assert f"at the release {pin} (not the code under review)" in bugs_table({bug.key}, [other])
