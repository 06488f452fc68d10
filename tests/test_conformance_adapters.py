"""The adapters (issue 39 items 1, 2 and 7), without upstream: one adapter per API shape on a shared
base, each release's own guards deciding what is reachable, each release's own input layouts read
from its code, and an input the adapter does not know named as an adapter gap (no rule broken).

(The same against real releases: ``tests/test_conformance_targets.py``, marker ``conformance``.)
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from refspec.conformance import cases, install, reach, report
from refspec.conformance import run as conformance

ROOT = Path(__file__).resolve().parents[1] / "refspec" / "conformance"
ADAPTERS = ("upstream_graph", "upstream_legacy")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            names |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return {x.rsplit(".", 1)[-1] if x.startswith("refspec.conformance") else x for x in names}


def test_one_adapter_per_api_shape_on_a_shared_base_and_run_report_one_way():
    """No adapter imports another (each takes only the shared base and the tree helpers), the tree
    helpers import no adapter, ``report`` does not import ``run`` (``run`` imports ``report``), and
    nothing in the conformance package imports ``refspec.cli``; each shape in ``install.ADAPTERS``
    names one of the adapter modules, whose ``Upstream`` subclasses the base ``Adapter``."""
    for name in ADAPTERS:
        got = _imports(ROOT / f"{name}.py")
        assert not got & (set(ADAPTERS) - {name}), (name, got)
        assert "upstream_common" in got and "worker" not in got
    assert not _imports(ROOT / "upstream_tree.py") & set(ADAPTERS)
    assert "run" not in _imports(ROOT / "report.py") and "report" in _imports(ROOT / "run.py")
    assert not [p.name for p in ROOT.glob("*.py") if any(x.startswith("refspec.cli") for x in _imports(p))]
    assert {m for m, *_ in install.ADAPTERS.values()} == {f"refspec.conformance.{n}" for n in ADAPTERS}
    for name in ADAPTERS:
        cls = next(n for n in ast.parse((ROOT / f"{name}.py").read_text()).body
                   if isinstance(n, ast.ClassDef) and n.name == "Upstream")
        assert [ast.unparse(b) for b in cls.bases] == ["uc.Adapter"], name


def _site(tmp_path: Path, files: dict) -> str:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return str(tmp_path)


#: 0.4.7's three guards, verbatim in their structure (server_args.py, eagle_worker.py)
SERVER_ARGS_047 = """
class ServerArgs:
    def __post_init__(self):
        if self.speculative_algorithm in ("EAGLE", "EAGLE3"):
            if self.speculative_num_steps is None:
                assert self.speculative_eagle_topk is None and self.speculative_num_draft_tokens is None
            if self.page_size > 1 and self.speculative_eagle_topk > 1:
                self.speculative_eagle_topk = 1
"""
WORKER_047 = """
class EAGLEWorker:
    def __init__(self, server_args):
        self.topk = server_args.speculative_eagle_topk
        self.page_size = server_args.page_size
    def draft(self, batch):
        if self.page_size == 1:
            pass
        else:
            if self.topk == 1:
                pass
            else:
                raise NotImplementedError("page_size > 1 and top_k > 1 are not supported.")
"""
#: 0.5.2 .. 0.5.5.post3: a refusal for every paged backend but FlashInfer
SERVER_ARGS_052 = """
class ServerArgs:
    def _handle_speculative_decoding(self):
        if self.speculative_algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
            if (
                self.speculative_eagle_topk > 1
                and self.page_size > 1
                and self.attention_backend != "flashinfer"
            ):
                raise ValueError("speculative_eagle_topk > 1 with page_size > 1 is unstable")
"""


def _sa(P: int, k: int, backend: str = "fa3"):
    return NS(page_size=P, speculative_eagle_topk=k, speculative_algorithm="EAGLE", speculative_num_steps=3,
              speculative_num_draft_tokens=2 * k, attention_backend=backend)


@pytest.mark.spec("TR-013", "TR-014")
def test_the_releases_own_guards_decide_what_is_reachable(tmp_path):
    """A configuration the release's own ServerArgs rewrites (top-k forced to 1 at P > 1) or refuses
    (a ValueError for FA3), or whose only EAGLE worker refuses it, is not reachable upstream, named by
    the guard's line and condition, evaluated on the job's own ServerArgs; P = 1 (or top-k 1, or
    FlashInfer where the guard allows it) is reachable (negative controls)."""
    site = _site(tmp_path / "a", {reach.SERVER_ARGS: SERVER_ARGS_047, reach.WORKER: WORKER_047})
    why, undetermined = reach.verdict(site, _sa(4, 2))
    assert not undetermined and why.startswith("sglang/srt/server_args.py:8 (ServerArgs.__post_init__) rewrites "
                                               "speculative_eagle_topk 2 to 1 when self.speculative_algorithm")
    assert "sglang/srt/speculative/eagle_worker.py:13 (EAGLEWorker.draft) raises (raise NotImplementedError(" in why
    assert reach.verdict(site, _sa(1, 2)) == (None, []) and reach.verdict(site, _sa(4, 1)) == (None, [])
    site = _site(tmp_path / "b", {reach.SERVER_ARGS: SERVER_ARGS_052})
    why, _ = reach.verdict(site, _sa(4, 2))
    assert why.startswith("sglang/srt/server_args.py:10 (ServerArgs._handle_speculative_decoding) raises (raise "
                          "ValueError(") and "self.attention_backend != 'flashinfer'" in why
    assert reach.verdict(site, _sa(4, 2, "flashinfer"))[0] is None
    # a condition that cannot be evaluated here (a name the guard's module would supply) is undetermined, never refuses
    site = _site(tmp_path / "c", {reach.SERVER_ARGS: SERVER_ARGS_052.replace('self.attention_backend != "flashinfer"',
                                                                             "not _is_flashinfer(self)")})
    why, undetermined = reach.verdict(site, _sa(4, 2))
    assert why is None and undetermined and "NameError" in undetermined[0]


def test_an_unreachable_job_is_named_not_compared_and_never_fails():
    """A job whose upstream result says the release's guards refuse it yields no row; the run lists it on
    the ``not reachable upstream`` line with the reason."""
    ref = {("eager", None): {"cache_seqlens_int32": torch.tensor([5], dtype=torch.int32)}}
    job = cases.Job("tree_verify/k2/P4", "tree_verify", 4, "k2", True, {}, ref)
    results = {job.id: {conformance.UNREACHABLE: "sglang/srt/server_args.py:459 (ServerArgs.__post_init__) ..."}}
    assert conformance.rows_for("0.4.7", [job], results) == []
    assert conformance.unreachable_why(results[job.id]).startswith("sglang/srt/server_args.py:459")


ACCEPT_FA = "    n = spec_info.{name}; m = spec_info.{name}_cpu\n"


@pytest.mark.spec("MD-009", "CG-003")
def test_each_releases_accept_length_layout_is_read_from_its_worker_code(tmp_path):
    """v1 draft extend's accepted counts: the names the backend reads and the values the release's own
    worker puts there (the device a = n + 1; the host n before sglang#23962, a after), each with the
    worker line that shows it; a name the adapter does not know (or no worker line) is a gap."""
    info = "sglang/srt/speculative/eagle_info.py"
    for name, worker, host_is_n in (("accept_length", "        self.accept_length.add_(1)\n", True),
                                    ("num_accepted_tokens", "num_accepted_tokens_cpu = drafts_cpu + 1\n", False),
                                    ("num_accept_tokens", "num_accept_tokens_cpu = correct_cpu + 1\n", False)):
        site = _site(tmp_path / name, {info: "x = 1\n" + worker})
        layout, gap = install.accept_layout(site, ACCEPT_FA.format(name=name))
        assert gap is None and layout == {"device": name, "host": f"{name}_cpu", "host_is_n": host_is_n,
                                          "at": f"{info}:2"}, name
    layout, gap = install.accept_layout(site, ACCEPT_FA.format(name="num_accepted_drafts_plus_one"))
    assert layout is None and "spec_info.num_accepted_drafts_plus_one" in gap and "does not know" in gap
    both = ACCEPT_FA.format(name="num_accept_tokens") + ACCEPT_FA.format(name="num_accepted_drafts_plus_one")
    layout, gap = install.accept_layout(site, both)  # a known name beside an unknown one: still a gap
    assert layout is None and "spec_info.num_accepted_drafts_plus_one" in gap
    layout, gap = install.accept_layout(str(tmp_path / "empty"), ACCEPT_FA.format(name="num_accept_tokens"))
    assert layout is None and "no worker statement" in gap
    assert install.accept_layout(str(tmp_path), "pass\n") == (None, None)


@pytest.mark.spec("TR-014", "TR-015")
def test_the_draft_out_cache_loc_order_is_the_releases_own(tmp_path):
    """0.4.7's worker reads the draft slots step-major ``[bs, steps, topk]``, 0.4.7.post1 on (sglang#7239)
    branch-major ``[bs, topk, steps]``: read from ``draft_forward``; refspec's branch-major slots are
    then handed over in the release's order (the same slots, reordered), so a finding shows an input
    production would give."""
    old = "        out_cache_loc = out_cache_loc.view(forward_batch.batch_size, -1)\n" \
          "        forward_batch.out_cache_loc = out_cache_loc[\n            :, self.topk * i : self.topk * (i + 1)\n"
    new = "        out_cache_loc = out_cache_loc.reshape(\n" \
          "            forward_batch.batch_size, self.topk, self.speculative_num_steps\n        )\n"
    for text, order, line in ((old, "bs,steps,topk", 5), (new, "bs,topk,steps", 4)):
        site = _site(tmp_path / order, {install.EAGLE_WORKER: "class W:\n    def draft_forward(self):\n" + text})
        assert install.draft_loc_layout(site) == {"order": order, "at": f"{install.EAGLE_WORKER}:{line}"}
    assert install.draft_loc_layout(str(tmp_path / "none")) is None
    from refspec.conformance.upstream_legacy import Upstream

    up = Upstream.__new__(Upstream)
    up.shape = NS(draft_loc={"order": "bs,steps,topk"})
    loc = torch.arange(2 * 2 * 3)  # B = 2, k = 2, S = 3: refspec's [B, k, S]
    assert up.draft_order(loc, 2, 2, 3).view(2, 3, 2)[1, 2, 0] == loc.view(2, 2, 3)[1, 0, 2]
    up.shape = NS(draft_loc=None)
    from refspec.conformance.upstream_common import AdapterGap

    with pytest.raises(AdapterGap, match="cannot be laid out"):
        up.draft_order(loc, 2, 2, 3)


def test_an_attribute_the_adapter_does_not_lay_out_is_an_adapter_gap_not_a_rule():
    """Upstream reading a field of a stand-in object that the adapter does not carry raises AdapterGap
    (an AttributeError: ``getattr(x, name, None)`` probes keep their meaning); its result is the row's
    gap: no rule broken, the wording says so, the run's exit status is 3."""
    from refspec.conformance.upstream_common import AdapterGap, Given, describe

    spec = Given("spec_info", num_accept_tokens=torch.tensor([2]))
    assert getattr(spec, "num_accepted_tokens", None) is None
    with pytest.raises(AdapterGap) as e:
        _ = spec.num_accepted_tokens
    text = describe(e.value)
    assert text.startswith("AdapterGap at ") and "upstream reads spec_info.num_accepted_tokens" in text
    assert report.is_gap(text) and not report.is_gap("AttributeError at sglang/srt/x.py:3: boom")
    ref = {("replay", None): {"cache_seqlens_int32": torch.tensor([5], dtype=torch.int32)}}
    job = cases.Job("draft_extend/P4/a", "draft_extend", 4, "a", True, {}, ref)
    gap = ("AdapterGap at sglang/srt/layers/attention/flashattention_backend.py:2147: upstream reads "
           "spec_info.num_accepted_tokens, which refspec's adapter does not lay out")
    (row,) = conformance.rows_for("@ /src/pr", [job], {job.id: {("replay", None): gap}})
    assert row.gap == gap and not row.broken and not row.ok
    (f,) = row.findings
    assert f.rule == report.ADAPTER and f.where == ("sglang/srt/layers/attention/flashattention_backend.py", 2147)
    assert report.finding_line(row, f) == (f"  ADAPTER GAP draft_extend/P4/a replay: no rule broken; refspec cannot "
                                           f"drive this code yet: {gap}")
    out = conformance.Outcome([row], {}, {})
    code, lines = conformance.verdict(out)
    assert code == conformance.EXIT_GAP == 3 and lines[-1].startswith("== ADAPTER GAP: 1 result not compared")
    assert conformance.verdict(conformance.Outcome([], {}, {}))[0] == 0


def test_a_branch_that_did_not_run_is_never_cited_statically(tmp_path):
    """0.5.4.post2's capture hook: ``elif forward_mode.is_draft_extend():`` excludes DRAFT_EXTEND_V2 there.
    With a trace, a write is read statically only where its branch is proven taken (an executed line in
    the same block); without one (canned results) the old static read stands."""
    from refspec.conformance import rules

    fa = textwrap.dedent("""
        class FlashAttentionBackend:
            def init_forward_metadata_capture_cuda_graph(self, bs, forward_mode):
                metadata = None
                if forward_mode.is_decode_or_idle():
                    metadata.page_table = 1
                elif forward_mode.is_draft_extend():
                    metadata.page_table = 2
                return metadata
    """)
    site = _site(tmp_path, {rules.FA: fa})
    line = next(i for i, x in enumerate(fa.splitlines(), 1) if "page_table = 2" in x)
    args = (site, (rules.FA,), "legacy", "draft_extend_v2", "capture", "page_table[live]")
    assert rules.locate(*args) == (rules.FA, line)  # no trace: read statically, as before
    ran_elsewhere = ((rules.FA, 4, None), (rules.FA, 5, None), (rules.FA, 9, None))  # the branch's test, not its body
    assert rules.locate(*args, executed=ran_elsewhere) is None
    ran_inside = ran_elsewhere + ((rules.FA, line, None),)
    assert rules.locate(*args, executed=ran_inside) == (rules.FA, line)


@pytest.mark.spec("TR-014")
def test_the_headline_names_the_smallest_failing_case_and_the_condition_that_triggers_it():
    """0.4.7's draft expand defect as the headline shows it: bs = 1 holds, bs = 2 and 3 fail, so the
    condition is bs >= 2 and the example is the smallest failing case, a real request's row before a
    graph's padding row; a known bug's headline comes after every unexplained one."""
    def row(job, batch, phase="eager", step=0, fail=True, padded=False, bug=None):
        r = report.Row("0.4.7", job, "tree_draft_decode", 1, "k2", phase, step, batch=batch, topk=2, num_steps=3)
        if fail:
            r.diffs = [report.Diff("expand:page_table[live]", "row 2: [95]", "row 2: [25]", padded=padded)]
            r.findings = [report.Finding("TR-014", "upstream behaviour", "expand:page_table[live]", "row 2: [95]",
                                         "row 2: [25]", ("sglang/srt/layers/attention/flashattention_backend.py", 414),
                                         None, padded=padded)]
        r.bug = bug
        return r
    rows = [row("tree_draft_decode/k2/B1/P1", 1, fail=False), row("tree_draft_decode/k2/P1", 3),
            row("tree_draft_decode/k2/B2/P1", 2, step=1), row("tree_draft_decode/k2/B2/P1", 2, padded=True)]
    (h,) = report.headlines(rows, "0.4.7")
    assert h.condition == "when bs >= 2 (every bs = 1 case holds)" and h.count == 3
    assert (h.row.batch, h.row.step) == (2, 1)  # bs = 2; the real row's finding before the padded one at step 0
    line = report.headline_line(h, "0.4.7", 1, 1)
    assert line.startswith("== FINDING 1 of 1: TR-014 (upstream behaviour) broken by sglang 0.4.7 in 3 results, "
                           "when bs >= 2 (every bs = 1 case holds); smallest case tree_draft_decode eager, bs = 2, "
                           "P = 1, k = 2, S = 3, step 1 (tree_draft_decode/k2/B2/P1)")
    assert line.endswith("expand:page_table[live]: refspec row 2: [95] | upstream row 2: [25]; upstream line at "
                         "flashattention_backend.py:414")
    # every case of those modes failing: the condition says so (no dimension invented)
    assert report.condition(rows[1:], rows[1:]) == "in every case compared (3)"
    known = row("decode/P16/x", 3, bug="context-wall-page-table")
    known.findings = [report.Finding("CG-008", "kernel contract", "page_table[live]", "a", "b", None, None)]
    known.mode = "decode"
    assert [h.rule for h in report.headlines(rows + [known], "0.4.7")] == ["TR-014", "CG-008"]
