"""The kernel's real arguments (issue 39 item 3): a recorder in place of the kernel, refspec's call
and upstream's compared argument by argument, ``scheduler_metadata`` checked against the
``get_scheduler_metadata`` call that made it, and the metadata fields the FA3 call does not read
never a failure.

The first part needs no upstream (synthetic calls, refspec's own backend); the last part
(marker ``conformance``: ``make conformance``) runs SGLang 0.5.23 with planted mutants that change
only what the kernel is handed (``refspec/conformance/patches/mutants/``).
"""

from __future__ import annotations

import types

import pytest
import torch

from refspec.conformance import cases, compare, recorder, rules
from refspec.conformance import run as conformance
from refspec.conformance.compare import SCHED_MARK, kernel_diffs, scheduler_diffs
from refspec.conformance.recorder import Recorder, installed
from refspec.core import batch as fbatch
from refspec.core.kv_cache import KVCache, KVPool
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.emulator import emulate_flash_attn_with_kvcache


def _decode_backend(P: int = 4, L=(5, 9, 13)):
    kv = KVCache(max_reqs=4, max_context=64, num_pages=64, page_size=P, seed=0)
    rows = [kv.alloc_req() for _ in L]
    kv.alloc_extend(rows, [0] * len(L), [x + 1 for x in L])
    pool = KVPool(num_layers=1, num_pages=kv.allocator.num_free_pages + 1, page_size=P, num_kv_heads=1, head_dim=8)
    be = FlashAttentionBackend(pool, kv, validate=False)
    fb = fbatch.decode_batch(kv, rows, list(L))
    be.init_forward_metadata(fb)
    return be, fb


def test_the_recorder_binds_the_kernel_signature_defaults_included_and_rereads_captured_buffers():
    """An omitted ``causal`` is recorded as FA3's default (False), tensors are cloned (a later in-place
    write does not change the record) and :meth:`Call.reread` reads the passed tensor again, as a
    graph replay would; :func:`installed` restores the global."""
    mod = types.ModuleType("m")
    mod.flash_attn_with_kvcache = "the real one"
    rec = Recorder("flash_attn_with_kvcache")
    k = torch.tensor([3, 4], dtype=torch.int32)
    q = torch.zeros(2, 1, 8)
    with installed(mod, {"flash_attn_with_kvcache": rec}):
        out = mod.flash_attn_with_kvcache(q=q, k_cache=torch.zeros(4, 2, 1, 8), v_cache=torch.zeros(4, 2, 1, 8),
                                          cache_seqlens=k, max_seqlen_q=1, ver=3)
    assert mod.flash_attn_with_kvcache == "the real one"
    (c,) = rec.calls
    assert c.args["causal"] is False and c.args["num_splits"] == 0 and c.args["window_size"] == (-1, -1)
    assert c.args["ver"] == 3 and c.where and c.where[0].endswith("test_conformance_kernel.py")
    assert out.shape == (2, 1, 8) and not out.any()
    k.add_(10)
    assert c.args["cache_seqlens"]["tensor"].tolist() == [3, 4]
    assert c.reread().args["cache_seqlens"]["tensor"].tolist() == [13, 14]


def test_the_recorder_can_forward_to_refspecs_emulator():
    """``forward=recorder.emulated``: the recorded call returns the FA3 emulator's output, so an
    adapter can compare outputs too (MLA's forward path reuses this)."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 4, 1, 8, generator=g), torch.randn(6, 4, 1, 8, generator=g)
    q = torch.randn(3, 2, 8, generator=g)
    a = dict(cache_seqlens=torch.tensor([5, 9, 2], dtype=torch.int32),
             page_table=torch.tensor([[1, 2, 0], [3, 4, 5], [2, 0, 0]], dtype=torch.int32),
             cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32), max_seqlen_q=1, softmax_scale=0.3,
             causal=True)
    rec = Recorder("flash_attn_with_kvcache", forward=recorder.emulated)
    got = rec(q=q, k_cache=kc, v_cache=vc, **a)
    assert torch.equal(got, emulate_flash_attn_with_kvcache(q, kc, vc, **a)) and len(rec.calls) == 1
    with pytest.raises(ValueError, match="without k, v"):
        rec(q=q, k_cache=kc, v_cache=vc, k=q, v=q, **a)


@pytest.mark.spec("PA-012", "PA-004")
def test_refspecs_own_call_is_recorded_from_its_backend_forward():
    """refspec's side: ``FlashAttentionBackend.forward``'s ``kernel.attention`` call, recorded with
    FA3's signature: the metadata's own tensors, causal, the layer's scale, no window, no new K/V."""
    be, fb = _decode_backend()
    (c,) = cases.kernel_calls(be, fb)
    md = be.forward_metadata
    a = c.args
    assert torch.equal(a["cache_seqlens"]["tensor"], md.cache_seqlens_int32)
    assert torch.equal(a["page_table"]["tensor"], md.page_table) and a["max_seqlen_q"] == 1
    assert a["causal"] is True and a["softmax_scale"] == 8 ** -0.5 and a["window_size"] == (-1, -1)
    assert a["softcap"] == 0.0 and a["k"] is None and a["num_splits"] == 0 and a["k_cache"]["shape"][1:] == (4, 1, 8)


def _plain(calls):
    return [c.plain() for c in calls]


@pytest.mark.spec("PA-004", "PA-012", "PA-010", "CG-006", "MD-003")
def test_a_changed_kernel_argument_is_a_kernel_diff_under_its_rule():
    """Each compared argument: a different ``causal`` is PA-004, a scale / window / softcap /
    num_splits PA-012, ``max_seqlen_q`` PA-010 eager and CG-006 in a graph phase,
    ``cache_seqlens`` the mode's K rule; identical calls give no diff (a negative control)."""
    be, fb = _decode_backend()
    ours = _plain(cases.kernel_calls(be, fb))
    assert kernel_diffs(ours, ours, 4) == []
    cases_ = {"causal": (False, "PA-004"), "softmax_scale": (0.5, "PA-012"), "window_size": ((4, 0), "PA-012"),
              "softcap": (30.0, "PA-012"), "num_splits": (1, "PA-012"), "max_seqlen_q": (4, "PA-010")}
    for name, (value, rid) in cases_.items():
        theirs = [dict(ours[0], args=dict(ours[0]["args"], **{name: value}))]
        (d,) = kernel_diffs(ours, theirs, 4)
        assert d.field == f"kernel:{name}" and rules.rule_for("decode", "eager", d.field) == rid, (name, d)
    assert rules.rule_for("decode", "replay", "kernel:max_seqlen_q") == "CG-006"
    # the same mask passed two ways is no difference: causal with (-1, 0) or (-1, -1) (FA3 sets the right
    # window to 0 under causal), and a non-causal (-1, 0), which FA3 runs as causal
    for same in ({"window_size": (-1, 0)}, {"causal": False, "window_size": (-1, 0)}):
        assert kernel_diffs(ours, [dict(ours[0], args=dict(ours[0]["args"], **same))], 4) == [], same
    k = ours[0]["args"]["cache_seqlens"]
    theirs = [dict(ours[0], args=dict(ours[0]["args"], cache_seqlens=dict(k, tensor=k["tensor"] + 1)))]
    assert [d.field for d in kernel_diffs(ours, theirs, 4)] == ["kernel:cache_seqlens"]
    assert rules.rule_for("decode", "eager", "kernel:cache_seqlens") == "MD-003"
    assert [d.field for d in kernel_diffs(ours, [], 4)] == ["kernel:calls"]


def test_a_kernel_diff_that_repeats_the_metadata_fields_difference_is_not_a_second_finding():
    """``cache_seqlens`` handed to the kernel *is* the metadata's: the same values differing twice
    is one finding (the metadata's, with the line that wrote it); a kernel value that differs from
    what the metadata compare saw is kept."""
    be, fb = _decode_backend()
    ours = _plain(cases.kernel_calls(be, fb))
    k = ours[0]["args"]["cache_seqlens"]
    theirs = [dict(ours[0], args=dict(ours[0]["args"], cache_seqlens=dict(k, tensor=k["tensor"] + 1)))]
    row = conformance.report.Row("x", "decode/P4/a", "decode", 4, "a", "eager", None)
    md = [compare.Diff("cache_seqlens_int32", compare._show(k["tensor"]), compare._show(k["tensor"] + 1))]
    assert conformance._kernel(row, ours, theirs, md, 4, None) == [] and row.kernel_calls == 1
    got = conformance._kernel(row, ours, theirs, [], 4, None)
    assert [d.field for d in got] == ["kernel:cache_seqlens"]


@pytest.mark.spec("CG-001")
def test_a_replayed_kernel_reading_a_buffer_the_replay_did_not_rewrite_is_cg_001():
    """0.4.4.post2's legacy replay hook rebinds ``metadata.cache_seqlens_int32`` to a new tensor: the metadata
    is right, but the captured call (what the graph replays) still reads the capture-time buffer.  A
    replay's kernel difference whose metadata field agrees is CG-001 (not the K rule); the same values at
    eager are the field's own rule (a negative control)."""
    be, fb = _decode_backend()
    ours = _plain(cases.kernel_calls(be, fb))
    k = ours[0]["args"]["cache_seqlens"]
    stale = [dict(ours[0], args=dict(ours[0]["args"], cache_seqlens=dict(k, tensor=torch.ones_like(k["tensor"]))))]
    for phase, rid in (("replay", "CG-001"), ("eager", "MD-003")):
        row = conformance.report.Row("x", "decode/P4/a", "decode", 4, "a", phase, None)
        (d,) = conformance._kernel(row, ours, stale, [], 4, None)
        assert rules.rule_for("decode", phase, d.field, stale=d.stale) == rid, phase


def _sched_call(kernel: dict, **over) -> dict:
    kb = kernel["cache_seqlens"]["tensor"]
    args = dict(batch_size=int(kb.numel()), max_seqlen_q=kernel["max_seqlen_q"], max_seqlen_k=int(kb.max()),
                num_heads=1, num_heads_k=1, headdim=8, cache_seqlens={"tensor": kb.clone()},
                cu_seqlens_q={"tensor": kernel["cu_seqlens_q"]["tensor"].clone()}, page_size=4, causal=True,
                window_size=(-1, -1), has_softcap=False, num_splits=0)
    args.update(over)
    return {"name": "get_scheduler_metadata", "args": args, "where": None}


@pytest.mark.spec("PA-013")
def test_scheduler_metadata_must_be_the_output_of_a_call_with_this_calls_arguments():
    """The kernel's ``scheduler_metadata`` holds the marker of one ``get_scheduler_metadata`` call:
    consistent -> no diff; that call made for other lengths, or a ``max_seqlen_k`` below a K_b ->
    a PA-013 diff naming the argument; a buffer that is no call's output (stale) -> one diff."""
    be, fb = _decode_backend()
    a = _plain(cases.kernel_calls(be, fb))[0]["args"]
    marked = dict(a, scheduler_metadata={"tensor": torch.full((5,), SCHED_MARK + 1, dtype=torch.int32)})
    other = _sched_call(a, cache_seqlens={"tensor": a["cache_seqlens"]["tensor"] - 1})
    assert scheduler_diffs(marked, [other, _sched_call(a)]) == []
    (d,) = scheduler_diffs(marked, [other, other])
    assert d.field == "kernel:scheduler_metadata" and "cache_seqlens" in d.ours
    assert rules.rule_for("decode", "replay", d.field) == "PA-013"
    (d,) = scheduler_diffs(marked, [other, _sched_call(a, max_seqlen_k=2)])
    assert "max_seqlen_k" in d.theirs
    stale = dict(a, scheduler_metadata={"tensor": torch.zeros(5, dtype=torch.int32)})
    (d,) = scheduler_diffs(stale, [_sched_call(a)])
    assert "not the output of any" in d.theirs


@pytest.mark.spec("MD-006", "PA-007")
def test_a_field_the_fa3_call_does_not_read_is_reported_never_a_failure():
    """``max_seq_len_k``, ``cu_seqlens_k`` (no new K/V) and the dead page-table columns: their
    differences are documented as not read by the FA3 kernel; a call that does pass
    ``max_seqlen_k`` (FA4's static grid) makes it a failure again."""
    paged = [{"name": "flash_attn_with_kvcache", "args": {"k": None, "max_seqlen_k": None}, "where": None}]
    assert all(compare.unread_by(paged, f) for f in ("max_seq_len_k", "expand:cu_seqlens_k", "page_table[dead]"))
    assert compare.unread_by(None, "prefix:max_seq_len_k")  # no recorded call: the paged FA3 call
    assert not compare.unread_by(paged, "cache_seqlens_int32")
    fa4 = [{"name": "flash_attn_with_kvcache", "args": {"k": None, "max_seqlen_k": 64}, "where": None}]
    assert not compare.unread_by(fa4, "max_seq_len_k")
    job = cases.Job("decode/P4/a", "decode", 4, "a", False, {},
                    {("eager", None): {"cache_seqlens_int32": torch.tensor([5], dtype=torch.int32),
                                       "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32),
                                       "cu_seqlens_k": torch.tensor([0, 5], dtype=torch.int32), "max_seq_len_q": 1,
                                       "max_seq_len_k": 5, "page_table": torch.tensor([[3, 7, 1]], dtype=torch.int32)}})
    theirs = dict(job.refspec[("eager", None)], max_seq_len_k=320,
                  page_table=torch.tensor([[3, 7, 2]], dtype=torch.int32))  # column 2 is dead: K = 5, P = 4
    (row,) = conformance.rows_for("0.5.23", [job], {job.id: {("eager", None): theirs}})
    assert row.ok and {d.documented for d in row.diffs} == {compare.UNREAD}
    theirs["cache_seqlens_int32"] = torch.tensor([6], dtype=torch.int32)  # a read field still fails
    (row,) = conformance.rows_for("0.5.23", [job], {job.id: {("eager", None): theirs}})
    assert not row.ok and [d.field for d in row.undocumented] == ["cache_seqlens_int32"]


# ---- against SGLang 0.5.23 (marker conformance: make conformance) ----

def quiet(*_):
    pass


@pytest.mark.conformance
@pytest.mark.spec("PA-004", "PA-010", "CG-006", "PA-013", "PA-012")
def test_planted_kernel_argument_mutants_of_0_5_23_are_caught_on_the_kernel_argument_only():
    """0.5.23 with two planted mutants in one patched copy (disjoint modes, one worker): its
    ``forward_decode`` call passes ``causal=False`` and its ``forward_extend`` call
    ``max_seqlen_q=1``.  No metadata field changes, so only the kernel-argument comparison can see
    them: decode and draft decode fail on ``kernel:causal`` (PA-004) -- and plain decode also on
    ``kernel:scheduler_metadata`` (PA-013: it was planned for ``causal=True``) -- every forward
    with more than one query row per request on ``kernel:max_seqlen_q`` (PA-010 eager, CG-006 in a
    graph phase) alone."""
    from refspec.conformance import controls

    code = controls.Code("0.5.23", ("decode-causal-false", "extend-max-seqlen-q-one"))
    t = code.target(log=quiet)
    out = conformance.run(sglang=[t], page_sizes=(4,), modes=("decode", "draft_decode", "verify", "extend_prefix",
                                                              "draft_extend_v2"), log=quiet)
    failing = {}
    for r in out.rows:
        assert r.gap is None and r.error is None, (r.job, r.gap, r.error)
        for f in r.findings:
            failing.setdefault((r.mode, r.phase), set()).add((f.field, f.rule))
    decode = {(m, p) for m in ("decode", "draft_decode") for p in ("eager", "capture", "replay")}
    assert {k for k in failing if k[0] in ("decode", "draft_decode")} == decode
    for k in decode:  # (plain decode also precomputes scheduler_metadata, planned for causal=True: PA-013 too)
        assert ("kernel:causal", "PA-004") in failing[k] and failing[k] <= {("kernel:causal", "PA-004"),
                                                                             ("kernel:scheduler_metadata", "PA-013")}
    assert ("kernel:scheduler_metadata", "PA-013") in failing[("decode", "replay")]
    many = {k: v for k, v in failing.items() if k not in decode}
    assert {m for m, _ in many} == {"verify", "extend_prefix", "draft_extend_v2"}
    for (mode, phase), v in many.items():
        assert v == {("kernel:max_seqlen_q", "PA-010" if phase == "eager" else "CG-006")}, (mode, phase, v)
    assert all(f.where and f.where[0].endswith("flashattention_backend.py") for r in out.rows for f in r.findings)
    assert sum(r.sched_checked for r in out.rows if r.mode == "decode") > 0
    sched = next(f for r in out.rows for f in r.findings if f.field == "kernel:scheduler_metadata")
    assert "the kernel call passes causal False" in conformance.report.finding_line(r, sched)
    assert all(r.kernel_calls == 1 for r in out.rows)


@pytest.mark.spec("PA-010")
def test_a_metadata_field_the_kernel_is_not_handed_is_not_a_failure():
    """0.4.x's decode keeps ``max_seq_len_q = 0`` in its metadata but hands the kernel ``max_seqlen_q=1``: the
    recorded call agrees with refspec's, so the metadata's 0 is reported (not read), never a failure; a call
    handed the metadata's wrong value fails (a negative control)."""
    be, fb = _decode_backend()
    ours = _plain(cases.kernel_calls(be, fb))
    md = {k: v for k, v in cases.snapshot_metadata(be.forward_metadata).items()}
    job = cases.Job("decode/P4/a", "decode", 4, "a", False, {}, {("eager", None): dict(md, **{cases.KERNEL: ours})})
    for handed, ok in ((1, True), (0, False)):
        theirs_calls = [dict(ours[0], args=dict(ours[0]["args"], max_seqlen_q=handed))]
        theirs = dict(md, max_seq_len_q=0, **{cases.KERNEL: theirs_calls})
        (row,) = conformance.rows_for("0.4.5", [job], {job.id: {("eager", None): theirs}})
        assert row.ok == ok, (handed, row.diffs)
        assert [d.documented for d in row.diffs if d.field == "max_seq_len_q"] == [compare.UNREAD if ok else None]
