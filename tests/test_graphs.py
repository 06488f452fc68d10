"""The CUDA-graph path on CPU: :class:`~refspec.graphs.capture.EmulatedGraph`, the graph runner and the
FA3 capture/replay hooks (docs/spec/graphs.md; invariants CG-001..CG-010).

Every graphed mode (DECODE, draft decode, TARGET_VERIFY, DRAFT_EXTEND v1, DRAFT_EXTEND_V2) is
replayed on live batches smaller than the captured size, with scattered pages and NaN-poisoned
unused pages, and compared with the eager path of the same backend (T0 bitwise: metadata on real
rows and outputs) and with the fp32 oracle (T1).  Expected numbers (buckets, fills, ``cu_seqlens_q``
layouts, frozen scalars) are written by hand from the spec, never read back from the runner.
"""

from __future__ import annotations

import pytest
import torch
from graph_kit import (FROZEN_MAX_Q, K_DELTA, MODES, N, PAD_SEQ_LEN, PAGE_SIZES, TOKENS_PER_REQ, DraftSteps,
                       Requests, assert_real_rows_metadata_equal, captured_key, poison_dummy_page, poison_padding,
                       real_rows_differ, scenario)

from refspec.core import tolerance as tol
from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode
from refspec.graphs.capture import EmulatedGraph, launch
from refspec.harness.scenario import Scenario
from refspec.mutants import variants

ALL = list(MODES)


def _assert_t0(out, ref, what=""):
    v = tol.t0(out, ref)
    assert v.ok, f"T0 (TOL-001) {what}: {v}"


# ---- replay == eager == oracle, every mode and page size ----
@pytest.mark.spec("CG-002", "TOL-001", "TOL-002")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("name", ALL)
def test_replay_equals_eager_and_oracle(name, P):
    """Live batch of 3 in the bs=4 graph: metadata and outputs on real rows equal eager (T0),
    outputs equal the oracle (T1)."""
    reqs = Requests(scenario(name, P))
    runner = reqs.runner()
    fb, x, ref = reqs.live([0, 1, 2])
    out = runner.replay(fb, x)
    md_graph = runner.backend.forward_metadata
    eager, md_eager = reqs.eager(fb, x)
    assert_real_rows_metadata_equal(md_graph, md_eager, 3, P)
    _assert_t0(out, eager, f"{name} P={P}")
    tol.assert_t1(out, ref, what=f"{name} P={P}")


@pytest.mark.spec("CG-002", "MD-010", "TOL-001", "TOL-002")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_draft_decode_all_steps_in_one_graph(P):
    """Sd = 4: the 3 draft steps run in one graph (FlashAttentionMultiStepBackend, one backend and
    buffer set per step).  Step s reads the KV that steps < s wrote in the same replay (the draft
    positions start as sentinels).  Two batches (3 in bs 4, then 5 in bs 8) on one runner; per
    step, real-row metadata equals eager; outputs equal eager (T0) and the oracle (T1)."""
    ds = DraftSteps(P, Sd=4)
    built = ds.fresh()
    runner, multi = ds.runner(built)
    for idx in ([0, 1, 2], [3, 4, 5, 6, 7]):
        fb, x = ds.live(built, idx)
        out = runner.replay(fb, x)
        eager, mds = ds.eager(ds.fresh(), idx)
        for s, (be, md) in enumerate(zip(multi.backends, mds)):
            assert_real_rows_metadata_equal(be.forward_metadata, md, len(idx), P)
            lens = [ds.lens[j] for j in idx]
            assert md.cache_seqlens_int32.tolist() == [L + s + 1 for L in lens]  # MD-010, by hand
        _assert_t0(out, eager, f"draft steps P={P} idx={idx}")
        tol.assert_t1(out, ds.oracle(ds.fresh(), idx), what=f"draft steps P={P} idx={idx}")


# ---- buckets, batches that change across replays ----
@pytest.mark.spec("CG-007", "CG-002")
@pytest.mark.parametrize("name", ALL)
def test_bucket_is_smallest_captured_geq_live_as_batch_grows_then_shrinks(name):
    """capture_bs = (1, 2, 4, 8); live sizes 1, 3, 5, 8, 2, 6 (grow, then shrink) on one runner,
    each time other requests (other pages).  Expected buckets by hand; every replay equals the
    oracle on its real rows."""
    reqs = Requests(scenario(name, 4))
    runner = reqs.runner(capture_bs=(1, 2, 4, 8))
    batches = [([4], 1), ([0, 1, 2], 4), ([3, 5, 6, 7, 8], 8), ([1, 2, 3, 4, 5, 6, 7, 8], 8), ([8, 0], 2),
               ([6, 2, 0, 4, 1, 3], 8)]
    for idx, bucket in batches:
        fb, x, ref = reqs.live(idx)
        assert runner.can_run(fb)
        out = runner.replay(fb, x)
        md = runner.backend.forward_metadata
        assert md.cache_seqlens_int32.shape[0] == bucket and md.page_table.shape[0] == bucket
        assert md is runner.backend.graph_state.captured[(captured_key(name), bucket)][0]
        tol.assert_t1(out, ref, what=f"{name} live {len(idx)} in bucket {bucket}")
    assert runner.num_replays == len(batches)


@pytest.mark.spec("CG-001", "CG-002", "CG-005")
@pytest.mark.parametrize("name", ALL)
def test_two_replays_in_a_row_with_different_requests(name):
    """One bs=4 graph, replay A = requests (0, 1, 2), replay B = requests (3, 4, 5): the page table
    rows the graph reads change, and both replays equal the oracle and the eager path."""
    P = 4
    reqs = Requests(scenario(name, P))
    runner = reqs.runner(capture_bs=(4,))
    tables = []
    for idx in ([0, 1, 2], [3, 4, 5]):
        fb, x, ref = reqs.live(idx)
        out = runner.replay(fb, x)
        md = runner.backend.forward_metadata
        tables.append(md.page_table[:3, :1].clone())
        eager, md_eager = reqs.eager(fb, x)
        assert_real_rows_metadata_equal(md, md_eager, 3, P)
        _assert_t0(out, eager, f"{name} idx={idx}")
        tol.assert_t1(out, ref, what=f"{name} idx={idx}")
    assert not torch.equal(tables[0], tables[1]), "the second batch has other pages"


@pytest.mark.spec("CG-009")
@pytest.mark.parametrize("name", ALL)
def test_real_rows_independent_of_padded_batch_size(name):
    """3 live requests replayed unpadded (capture_bs=[3]) and padded (capture_bs=[8]): real rows
    bitwise equal (CG-009)."""
    reqs = Requests(scenario(name, 16))
    fb, x, _ = reqs.live([2, 5, 7])
    exact = reqs.runner(capture_bs=(3,)).replay(fb, x)
    padded = reqs.runner(capture_bs=(8,)).replay(fb, x)
    _assert_t0(padded, exact, f"{name}: Bg=8 vs Bg=3")


@pytest.mark.spec("CG-007")
@pytest.mark.parametrize("name", ALL)
def test_batch_larger_than_every_captured_size_runs_eagerly(name):
    """capture_bs = (1, 2, 4), live batch of 5: can_run is False, replay raises CG-007, and the
    caller's eager fallback equals the oracle."""
    reqs = Requests(scenario(name, 4))
    runner = reqs.runner(capture_bs=(1, 2, 4))
    fb, x, ref = reqs.live([0, 1, 2, 3, 4])
    assert not runner.can_run(fb)
    with pytest.raises(InvariantError) as e:
        runner.replay(fb, x)
    assert e.value.inv_id == "CG-007"
    tol.assert_t1(reqs.eager(fb, x)[0], ref, what=f"{name} eager fallback")


# ---- address stability and frozen scalars ----
@pytest.mark.spec("CG-001")
@pytest.mark.parametrize("name", ALL)
def test_captured_addresses_stable_across_replays(name):
    """data_ptr of cache_seqlens, cu_seqlens_q, cu_seqlens_k, page_table of every captured
    (mode, bs), and of the runner's input buffers, is the same at capture and after each replay."""
    reqs = Requests(scenario(name, 4))
    runner = reqs.runner(capture_bs=(2, 4, 8))
    gs = runner.backend.graph_state
    names = ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table")
    key = captured_key(name)
    captured = {bs: {n: getattr(gs.captured[(key, bs)][0], n).data_ptr() for n in names} for bs in (2, 4, 8)}
    # capture binds slices [:bs] of the preallocated buffers, so every bs starts at the buffer's address
    base = dict(cache_seqlens_int32=gs.cache_seqlens, cu_seqlens_q=gs.cu_seqlens_q, cu_seqlens_k=gs.cu_seqlens_k,
                page_table=gs.page_table)
    assert all(captured[bs][n] == base[n].data_ptr() for bs in captured for n in names)
    inputs = {n: t.data_ptr() for n, t in {**runner.buf, **runner.inputs}.items()}
    for idx in ([0, 1, 2], [3, 4], [1, 2, 3, 4, 5, 6, 7]):
        fb, x, ref = reqs.live(idx)
        out = runner.replay(fb, x)
        md = runner.backend.forward_metadata
        bs = md.cache_seqlens_int32.shape[0]
        assert {n: getattr(md, n).data_ptr() for n in names} == captured[bs]
        assert {n: t.data_ptr() for n, t in {**runner.buf, **runner.inputs}.items()} == inputs
        tol.assert_t1(out, ref, what=f"{name} idx={idx}")


@pytest.mark.spec("CG-006")
@pytest.mark.parametrize("name", ALL)
def test_frozen_max_seqlen_q_is_the_mode_bound(name):
    """The max_seqlen_q frozen into every captured launch is 1 (decode, draft decode), N (verify)
    or Sd + 1 (both draft extends), at capture and still after replays of other batches."""
    reqs = Requests(scenario(name, 4))
    runner = reqs.runner(capture_bs=(1, 4))
    for idx in ([0, 1, 2], [3]):
        fb, x, _ = reqs.live(idx)
        runner.replay(fb, x)
    want = FROZEN_MAX_Q[name]
    for bs in (1, 4):
        assert runner.backend.graph_state.captured[(captured_key(name), bs)][0].max_seq_len_q == want
        frozen = [sc["max_seqlen_q"] for _, _, sc in runner.graphs[bs]._tape if "max_seqlen_q" in sc]
        assert frozen == [want]


@pytest.mark.spec("CG-006")
def test_frozen_max_seqlen_q_draft_steps():
    """Each of the Sd - 1 draft-step launches in the one draft graph freezes max_seqlen_q = 1."""
    ds = DraftSteps(4, Sd=4)
    built = ds.fresh()
    runner, multi = ds.runner(built, capture_bs=(2,))
    runner.replay(*ds.live(built, [0, 1]))
    assert [be.graph_state.captured[("decode", 2)][0].max_seq_len_q for be in multi.backends] == [1, 1, 1]
    assert [sc["max_seqlen_q"] for _, _, sc in runner.graphs[2]._tape if "max_seqlen_q" in sc] == [1, 1, 1]


# ---- cu_seqlens_q per mode ----
@pytest.mark.spec("CG-001", "MD-002")
@pytest.mark.parametrize("name", ["decode", "draft_decode", "verify"])
def test_uniform_cu_seqlens_q_never_modified_by_replay(name):
    """Decode, draft decode, verify: cu_seqlens_q is the capture-time arange(0, bs*q+1, q) and
    replays of other batches never write it (SGLang's replay never rewrites them either)."""
    reqs = Requests(scenario(name, 16))
    runner = reqs.runner(capture_bs=(2, 4, 8))
    gs = runner.backend.graph_state
    before = gs.cu_seqlens_q.clone()
    q = 1 if name != "verify" else N
    for idx in ([0, 1, 2], [3, 4, 5, 6, 7], [8]):
        runner.replay(*reqs.live(idx)[:2])
        assert torch.equal(gs.cu_seqlens_q, before)
    for bs in (2, 4, 8):
        cu = gs.captured[(captured_key(name), bs)][0].cu_seqlens_q
        assert cu.tolist() == list(range(0, bs * q + 1, q))


@pytest.mark.spec("CG-003")
def test_v1_draft_extend_cu_seqlens_q_packed_then_padded_with_W():
    """v1 DE: cu_q = [0, cumsum a] over real rows, then + W (= Sd + 1 = 4) per padded row."""
    reqs = Requests(scenario("draft_extend", 4))  # a = [1, 3, 4, 2, 4, 1, 2, 3, 1]
    runner = reqs.runner(capture_bs=(4, 8))
    for idx, want in (([0, 1, 2], [0, 1, 4, 8, 12]), ([3, 4, 5, 6, 7], [0, 2, 6, 7, 9, 12, 16, 20, 24]),
                      ([8, 0, 1, 2], [0, 1, 2, 5, 9])):
        fb, x, ref = reqs.live(idx)
        out = runner.replay(fb, x)
        assert runner.backend.forward_metadata.cu_seqlens_q.tolist() == want
        tol.assert_t1(out, ref, what=f"v1 DE idx={idx}")


@pytest.mark.spec("CG-004")
def test_v2_draft_extend_cu_seqlens_q_is_uniform_arange():
    """v2 DE: cu_q = arange(0, Bg*W + 1, W), W = 4, whatever the accepted counts."""
    reqs = Requests(scenario("draft_extend_v2", 4))
    runner = reqs.runner(capture_bs=(4, 8))
    for idx, Bg in (([0, 1, 2], 4), ([3, 4, 5, 6, 7], 8), ([8, 0, 1, 2], 4)):
        fb, x, ref = reqs.live(idx)
        out = runner.replay(fb, x)
        assert runner.backend.forward_metadata.cu_seqlens_q.tolist() == list(range(0, Bg * 4 + 1, 4))
        tol.assert_t1(out, ref, what=f"v2 DE idx={idx}")


# ---- padding ----
@pytest.mark.spec("CG-005")
@pytest.mark.parametrize("name", ALL)
def test_padding_fills_rewritten_every_replay(name):
    """A full bs=4 batch, then 3 requests in the same graph: padded row 3 gets the fills again
    (req_pool_indices 0, seq_lens 1 or W, out_cache_loc / positions 0; K = fill + delta, its
    page-table row points at the dummy page 0), not the first batch's row-3 values."""
    P = 4
    reqs = Requests(scenario(name, P))
    runner = reqs.runner(capture_bs=(4,))
    runner.replay(*reqs.live([5, 6, 7, 3])[:2])
    fb, x, ref = reqs.live([0, 1, 2])
    out = runner.replay(fb, x)
    st, W, T = runner.static[4], TOKENS_PER_REQ[name], fb.num_tokens
    assert st.req_pool_indices[3].item() == 0
    assert st.seq_lens[3].item() == PAD_SEQ_LEN[name]
    assert st.out_cache_loc[T:4 * W].tolist() == [0] * (4 * W - T)
    assert st.positions[T:4 * W].tolist() == [0] * (4 * W - T)
    md = runner.backend.forward_metadata
    K_pad = PAD_SEQ_LEN[name] + K_DELTA[name]
    assert md.cache_seqlens_int32[3].item() == K_pad
    assert md.page_table[3, : -(-K_pad // P)].tolist() == [0] * -(-K_pad // P)
    tol.assert_t1(out, ref, what=name)


@pytest.mark.spec("CG-005")
@pytest.mark.parametrize("name", ALL)
def test_stale_padded_rows_are_caught(name):
    """Bug "stale-padded-rows" (case B04): padded row 3 keeps the previous batch's request -> CG-005."""
    reqs = Requests(scenario(name, 4))
    runner = reqs.runner(capture_bs=(4,))
    runner.replay(*reqs.live([5, 6, 7, 3])[:2])
    with variants.enabled("stale-padded-rows"), pytest.raises(InvariantError) as e:
        runner.replay(*reqs.live([0, 1, 2])[:2])
    assert e.value.inv_id == "CG-005"


@pytest.mark.spec("CG-005", "PA-007")
@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("name", ALL)
def test_poisoned_padding_and_unused_pages_leave_real_rows_unchanged(name, P):
    """Padded input rows are NaN, the dummy page 0 is NaN (after capture), unused pages are NaN
    (scenario poison): 3 real rows in the bs=8 graph are NaN-free and bitwise equal to the
    unpoisoned eager run."""
    reqs = Requests(scenario(name, P))
    runner = reqs.runner(capture_bs=(8,))
    poison_padding(runner)
    poison_dummy_page(reqs.built.pool)
    fb, x, ref = reqs.live([1, 4, 6])
    out = runner.replay(fb, x)
    assert bool(torch.isfinite(out).all())
    _assert_t0(out, reqs.eager(fb, x)[0], name)
    tol.assert_t1(out, ref, what=name)


@pytest.mark.spec("CG-005")
def test_poisoned_padding_draft_steps():
    """The same for the all-steps draft graph: 2 real requests padded to 8, padded rows NaN at
    every step, dummy page NaN; real rows of all 3 steps are finite and equal eager / oracle."""
    ds = DraftSteps(16, Sd=4)
    built = ds.fresh()
    runner, _ = ds.runner(built, capture_bs=(8,))
    poison_padding(runner)
    poison_dummy_page(built.pool)
    out = runner.replay(*ds.live(built, [3, 5]))
    assert bool(torch.isfinite(out).all())
    _assert_t0(out, ds.eager(ds.fresh(), [3, 5])[0])
    tol.assert_t1(out, ds.oracle(ds.fresh(), [3, 5]))


# ---- the EmulatedGraph contract ----
@pytest.mark.spec("CG-001")
def test_emulated_graph_reuses_capture_time_buffers_and_scalars():
    """The bare contract: a launch's ``static`` tensors and ``scalars`` are the capture-time ones
    at replay (a rebound buffer or a new scalar is invisible), ``live`` ones are re-read."""
    kernel = lambda x, buf, scale: x + scale * buf
    buf, state = torch.tensor([1.0, 2.0]), {"scale": 10.0}
    g = EmulatedGraph()
    fn = lambda: launch(kernel, live=dict(x=state["x"]), static=dict(buf=state["buf"]),
                        scalars=dict(scale=state["scale"]))
    state.update(x=torch.zeros(2), buf=buf)
    g.capture(fn)
    buf.copy_(torch.tensor([3.0, 4.0]))  # in place: seen by the replay
    state.update(x=torch.ones(2), buf=torch.tensor([100.0, 100.0]), scale=-1.0)  # rebound / new: not seen
    assert g.replay().tolist() == [31.0, 41.0]


@pytest.mark.spec("CG-001", "MD-006")
@pytest.mark.parametrize("name", ALL)
def test_the_lengths_are_the_graphs_own_work(name, monkeypatch):
    """``cache_seqlens = seq_lens + delta`` and ``cu_seqlens_k`` are recorded in the graph
    (``init_forward_metadata_in_graph``): without validation the out-of-graph replay hook writes
    neither, and the replay itself does.  Expected lengths by hand: the live ``seq_lens`` plus the
    mode's delta (K_DELTA), then ``1 + delta`` (verify, decode) or W (draft extend) per padded row.
    Negative control: a graph captured without its in-graph hook keeps the capture-time lengths."""
    from refspec.fa3.graph_metadata import GraphMetadataMixin

    reqs = Requests(scenario(name, 4))
    fb, x, _ = reqs.live([0, 1, 2])
    L = fb.seq_lens.tolist()
    d = K_DELTA[name]
    pad = TOKENS_PER_REQ[name] if name.startswith("draft_extend") else 1 + d
    want_K = [l + d for l in L] + [pad]
    want_cu = [0, *[sum(want_K[:i + 1]) for i in range(4)]]

    def lengths(runner):
        md = runner.backend.forward_metadata
        return md.cache_seqlens_int32.tolist(), md.cu_seqlens_k.tolist()

    runner = reqs.runner(capture_bs=(4,), validate=False)
    before = lengths(runner)  # the capture's: 4 padded rows
    static = runner.static[4]
    runner._fill(static, fb, 4, x)
    runner.backend.init_forward_metadata_replay_cuda_graph(4, static, num_real=3)
    assert lengths(runner) == before  # the hook alone leaves them
    runner.replay(fb, x)
    assert lengths(runner) == (want_K, want_cu)
    monkeypatch.setattr(GraphMetadataMixin, "init_forward_metadata_in_graph", lambda self, bs, fb: None)
    stale = reqs.runner(capture_bs=(4,), validate=False)  # captured without the in-graph write
    stale.replay(fb, x)
    assert lengths(stale)[0] != want_K


@pytest.mark.spec("CG-001")
@pytest.mark.parametrize("bug", ["replay-rebind-page-table", "replay-rebind-cache-seqlens"])
@pytest.mark.parametrize("name", ["decode", "verify"])
def test_rebinding_a_captured_buffer(name, bug):
    """A replay that rebinds ``page_table`` / ``cache_seqlens`` instead of copying in place:
    without validation the graph silently reads the stale capture-time buffer (output differs
    from the oracle); with validation the replay raises CG-001."""
    reqs = Requests(scenario(name, 4))
    fb, x, ref = reqs.live([0, 1, 2])
    runner = reqs.runner(capture_bs=(4,), validate=False)
    with variants.enabled(bug):
        out = runner.replay(fb, x)
    assert real_rows_differ(out, ref)
    runner = reqs.runner(capture_bs=(4,), validate=True)
    with variants.enabled(bug), pytest.raises(InvariantError) as e:
        runner.replay(fb, x)
    assert e.value.inv_id == "CG-001"


@pytest.mark.spec("CG-006", "PA-010")
@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("name", ["draft_extend", "draft_extend_v2"])
def test_live_query_longer_than_frozen_max_seqlen_q(name, validate):
    """Bug "capture-max-seqlen-q-small" (case B08): the draft-extend graph freezes max_seqlen_q = 1;
    a live request with more rows raises CG-006 from the replay validation (the graph rule, named
    before PA-010, the kernel contract the same numbers break) or, without validation, PA-010 from the
    emulated kernel that the frozen scalar reaches."""
    reqs = Requests(scenario(name, 4))
    with variants.enabled("capture-max-seqlen-q-small"):
        runner = reqs.runner(capture_bs=(4,), validate=validate)
    fb, x, _ = reqs.live([0, 1, 2])
    with pytest.raises(InvariantError) as e:
        runner.replay(fb, x)
    assert e.value.inv_id == ("CG-006" if validate else "PA-010")


@pytest.mark.spec("MD-006")
def test_replay_validates_the_live_batch_first():
    """Every validated replay runs :func:`refspec.fa3.validate.validate_batch` on the live batch:
    a CPU mirror ``seq_lens_cpu`` one token ahead of ``seq_lens`` (max K and the page-table width
    come from it) is refused with MD-006.  The ``replay-skips-validate-batch`` variant makes the
    same replay go through, which is what this test exists to notice."""
    b = Scenario(ForwardMode.TARGET_VERIFY, page_size=4, lens=[9, 14, 5], num_draft_tokens=4).build()
    runner = b.graph_runner(capture_bs=(4,))
    bad = b.fb.replace(seq_lens_cpu=b.fb.seq_lens_cpu + 1)
    inputs = {"q": b.q, "k": b.k, "v": b.v}
    with pytest.raises(InvariantError) as e:
        runner.replay(bad, inputs)
    assert e.value.inv_id == "MD-006" and "mirror" in str(e.value)
    with variants.enabled("replay-skips-validate-batch"):
        assert runner.replay(bad, inputs).shape == b.q.shape  # no check left to refuse it


@pytest.mark.spec("CG-001")
@pytest.mark.parametrize("name", ["decode", "verify", "draft_extend"])
def test_the_capture_records_the_page_table_the_graph_reads(name):
    """The capture hook records the captured tensors (what CG-001 compares every replay with) after
    its dummy page-table write, so the record holds the very tensor the captured forward reads and
    keeps it alive, also when the write rebinds ("replay-rebind-page-table" in force at capture).
    Recorded before that write (as 0fd39fc did), the graph read a tensor that only the metadata
    held, which the next rebinding replay freed: on the H200 the bug zoo's next replay hit an
    illegal memory access, which poisons the process (benchmarks/results/h200_peer5.md).
    Expected by construction: the record and the metadata name the same tensor right after capture.
    The lengths are not covered: they are written after the record, because they are the graph's
    own work (``init_forward_metadata_in_graph`` runs inside the capture), so under a rebinding length
    write the graph reads a tensor of its own private pool, which no later allocation is given."""
    reqs = Requests(scenario(name, 4))
    with variants.enabled("replay-rebind-page-table"):
        runner = reqs.runner(capture_bs=(4,), validate=False)
    captured = runner.backend.graph_state.captured
    assert captured
    for key, (md, bound) in captured.items():
        assert md.page_table is bound["page_table"], key
