"""Public failure cases about CUDA graphs (docs/cases.md: B03, B04, B05, B07,
B08, B10, B11), each with the scenario's own numbers, on the emulated graph (CPU).

Where refspec deliberately picks one of the policies a case allows (padded rows: seq_lens fill
1 / W pointing at the reserved dummy page 0; verify ``cu_seqlens_q`` keeps the uniform stride on
padded rows), the test asserts refspec's documented policy and says so.
"""

from __future__ import annotations

import pytest
import torch
from graph_kit import N, DraftSteps, Requests, captured_key, poison_dummy_page, real_rows_differ, scenario

from refspec.mutants import variants
from refspec.core import tolerance as tol
from refspec.fa3.backend import FlashAttentionBackend
from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode
from refspec.harness.scenario import Scenario


def _raises(inv_id, fn, *args):
    with pytest.raises(InvariantError) as e:
        fn(*args)
    assert e.value.inv_id == inv_id, str(e.value)


# ---- B03 ----
@pytest.mark.spec("CG-005", "CG-010", "MD-010", "PA-008")
def test_case_B03_padded_slot_across_draft_steps():
    """Case B03: draft-decode graphs for bs {1, 2, 4, 8}, real bs 3 padded to 4, seq_lens
    [5, 17, 33], ps 16, 3 draft steps in one graph (refspec: Sd - 1 = 3 step backends, Sd = 4).

    refspec's padding policy is (b): seq_lens fill 1 and req_pool_indices 0, whose
    req_to_token row is all zeros -> the reserved dummy page 0.  At every step the padded slot's
    K = 1 + s + 1 (never 0: it never goes from "reads nothing" to "reads something") and its page
    row is page 0, inside the table.  Page 0 is NaN-poisoned after capture: the real rows of all 3
    steps are NaN-free and equal an eager bs=3 run (T0) and the oracle (T1).
    """
    ds = DraftSteps(16, Sd=4, lens=[5, 17, 33])
    built = ds.fresh()
    runner, multi = ds.runner(built, capture_bs=(1, 2, 4, 8))
    poison_dummy_page(built.pool)
    out = runner.replay(*ds.live(built, [0, 1, 2]))
    for s, be in enumerate(multi.backends):
        md = be.forward_metadata
        assert md.cache_seqlens_int32.tolist() == [5 + s + 1, 17 + s + 1, 33 + s + 1, 1 + s + 1]
        assert md.page_table[3, 0].item() == 0  # ceil((s + 2) / 16) = 1 column: the dummy page
        assert 1 + s + 1 <= md.page_table.shape[1] * 16
    assert bool(torch.isfinite(out).all())
    eager, _ = ds.eager(ds.fresh(), [0, 1, 2])
    assert tol.t0(out, eager).ok
    tol.assert_t1(out, ds.oracle(ds.fresh(), [0, 1, 2]), what="B03")


# ---- B04 ----
@pytest.mark.spec("CG-005", "CG-007", "CG-002")
def test_case_B04_verify_padded_tail_and_buckets():
    """Case B04: target_verify graph for bs 4 (ndt 4).  Replay 1: prefixes [57, 47, 79, 58] ->
    cache_seqlens [61, 51, 83, 62].  Replay 2 on the same graph: [57, 47, 79] padded to 4: slot 3
    holds the fill 1 + N = 5, not 62.  cu_seqlens_q has bs_g + 1 = 5 entries and is monotone;
    refspec's policy keeps the uniform stride on padded rows, [0, 4, 8, 12, 16] (the case also
    allows [0, 4, 8, 12, 12]).  Real outputs equal the oracle.  bs 9 with largest captured 8 is
    refused (CG-007) and runs eagerly; a stale padded row (bug) is caught as CG-005.
    """
    reqs = Requests(scenario("verify", 16, lens=[57, 47, 79, 58, 11, 3, 26, 40, 8]))
    runner = reqs.runner(capture_bs=(4, 8))
    for idx, K in (([0, 1, 2, 3], [61, 51, 83, 62]), ([0, 1, 2], [61, 51, 83, 5])):
        fb, x, ref = reqs.live(idx)
        out = runner.replay(fb, x)
        md = runner.backend.forward_metadata
        assert md.cache_seqlens_int32.tolist() == K
        assert md.cu_seqlens_q.tolist() == [0, 4, 8, 12, 16]
        tol.assert_t1(out, ref, what=f"B04 replay of {len(idx)}")
    fb, x, ref = reqs.live(list(range(9)))
    assert not runner.can_run(fb)
    _raises("CG-007", runner.replay, fb, x)
    tol.assert_t1(reqs.eager(fb, x)[0], ref, what="B04 bs 9 eager")
    runner.replay(*reqs.live([0, 1, 2, 3])[:2])
    with variants.enabled("stale-padded-rows"):
        _raises("CG-005", runner.replay, *reqs.live([0, 1, 2])[:2])


@pytest.mark.spec("CG-007")
@pytest.mark.parametrize("name", ["draft_extend", "draft_extend_v2"])
def test_case_B04_draft_extend_buffers_count_tokens(name):
    """Case B04, draft extend: the bucket is chosen by requests, but the graph's token buffers
    hold bs * (steps + 1) = bs * N rows, so 3 requests with up to 12 tokens fit the bs=4 graph."""
    reqs = Requests(scenario(name, 4, lens=[9, 14, 5], accept=[4, 4, 4]))
    runner = reqs.runner(capture_bs=(1, 2, 4))
    assert runner.static[4].out_cache_loc.numel() == 4 * N
    assert runner.inputs["q"].shape[0] == 4 * N
    fb, x, ref = reqs.live([0, 1, 2])
    assert fb.num_tokens == 12
    tol.assert_t1(runner.replay(fb, x), ref, what=name)


# ---- B05 ----
@pytest.mark.spec("CG-004", "SD-010", "CG-002")
@pytest.mark.parametrize("B,cu", [(2, [0, 4, 8]), (3, [0, 4, 8, 12, 16])])
def test_case_B05_v2_cu_seqlens_q_stride_matches_layout(B, cu):
    """Case B05: draft_extend_v2, steps 3, ndt 4, prefixes [12, 30, 7], ps 4, bs 2 and 3 (3 is
    padded to 4).  Config: for top-k = 1, ndt = steps + 1 = N, and the cu_seqlens_q stride, the
    frozen max_seqlen_q and the runner's token rows per request are that one constant.  Requests 1
    and 2 (the ones a wrong stride hits) equal the eager path and the oracle; the packed stride
    (bug) breaks request 1 at bs >= 2."""
    reqs = Requests(scenario("draft_extend_v2", 4, lens=[12, 30, 7][:B], accept=[2, 4, 1][:B]))
    runner = reqs.runner(capture_bs=(1, 2, 4))
    Sd = 3
    assert N == Sd + 1 == runner.W == runner.N
    fb, x, ref = reqs.live(list(range(B)))
    out = runner.replay(fb, x)
    md = runner.backend.forward_metadata
    assert md.cu_seqlens_q.tolist() == cu and md.max_seq_len_q == N
    later = slice(N, B * N)  # rows of requests 1..B-1
    assert tol.t0(out[later], reqs.eager(fb, x)[0][later]).ok
    tol.assert_t1(out[later], ref[later], what=f"B05 bs {B}")
    with variants.enabled("de-v2-packed-cu-q"):
        bad = reqs.runner(capture_bs=(1, 2, 4), validate=False).replay(fb, x)
    assert real_rows_differ(bad[N:2 * N], ref[N:2 * N])


@pytest.mark.spec("CG-004")
def test_case_B05_other_token_count_is_the_stride():
    """Case B05's "ndt != steps + 1" variant: refspec derives the v2 stride from the one N the
    runner lays tokens out with, so with N = 3 the stride is 3 ([0, 3, 6, 9, 12] at bs 3 -> 4)
    and the outputs equal the oracle."""
    sc = Scenario(ForwardMode.DRAFT_EXTEND_V2, page_size=4, lens=[12, 30, 7], num_draft_tokens=3,
                  num_accept_tokens=[2, 3, 1], num_heads=8, num_kv_heads=2, head_dim=32)
    reqs = Requests(sc)
    runner = reqs.runner(capture_bs=(1, 2, 4))
    fb, x, ref = reqs.live([0, 1, 2])
    out = runner.replay(fb, x)
    assert runner.backend.forward_metadata.cu_seqlens_q.tolist() == [0, 3, 6, 9, 12]
    tol.assert_t1(out, ref, what="B05 N=3")


# ---- B07 ----
@pytest.mark.spec("CG-008", "PA-003", "PA-008")
def test_case_B07_page_table_width_at_the_context_wall():
    """Case B07: model context 64 (the variant's ``B07_CONTEXT``), ps 16 (a context-sized table has
    4 columns), ndt 4, bs 2 with seq_lens [61, 20].  Verify needs K = 65 keys = 5 pages for request 0.  With the bug
    "page-table-width-from-context" the replay raises CG-008 before any kernel runs; refspec's
    table is sized from req_to_token (>= ceil((64 + 4) / 16) = 5 columns) and matches the oracle.
    Verify positions >= 64 are written to request 0's own pages, never to page 0."""
    reqs = Requests(scenario("verify", 16, lens=[61, 20]))
    kv, pool = reqs.built.kv, reqs.built.pool
    fb, x, ref = reqs.live([0, 1])
    with variants.enabled("page-table-width-from-context"):
        narrow = reqs.runner_with(FlashAttentionBackend(pool, kv), capture_bs=(2,))
        assert narrow.backend.graph_state.width == 4
        _raises("CG-008", narrow.replay, fb, x)
    runner = reqs.runner_with(FlashAttentionBackend(pool, kv), capture_bs=(2,))
    assert runner.backend.graph_state.width >= 5
    out = runner.replay(fb, x)
    assert runner.backend.forward_metadata.cache_seqlens_int32.tolist() == [65, 24]
    tol.assert_t1(out, ref, what="B07 verify")
    own_pages = set((kv.req_to_token[reqs.rows[0], :65].long() // 16).tolist())
    assert 0 not in own_pages and set((fb.out_cache_loc[:N] // 16).tolist()) <= own_pages


@pytest.mark.spec("CG-008", "MD-010")
def test_case_B07_draft_step_2_fits_four_columns():
    """Case B07, draft step 2: K = 61 + 2 + 1 = 64 = 4 pages of 16, so even the context-sized
    (4-column) table holds it and the replay matches the oracle."""
    sc = Scenario(ForwardMode.DECODE, page_size=16, lens=[61, 20], draft_step=2, num_heads=8, num_kv_heads=2,
                  head_dim=32)
    reqs = Requests(sc)
    fb, x, ref = reqs.live([0, 1])
    with variants.enabled("page-table-width-from-context"):
        be = FlashAttentionBackend(reqs.built.pool, reqs.built.kv, speculative_step_id=2)
        runner = reqs.runner_with(be, capture_bs=(2,))
        out = runner.replay(fb, x)
    assert be.graph_state.width == 4 and be.forward_metadata.cache_seqlens_int32.tolist() == [64, 23]
    tol.assert_t1(out, ref, what="B07 draft step 2")


# ---- B08 ----
@pytest.mark.spec("CG-006", "PA-010", "CG-002")
@pytest.mark.parametrize("H,Hkv", [(8, 8), (32, 4), (16, 1)])
def test_case_B08_frozen_max_seqlen_q(H, Hkv):
    """Case B08: v1 draft_extend graph for bs 3, replayed with acc [3, 0, 2] (q lens a = [4, 1, 3])
    and KV lengths after extend [20, 9, 41], ps 4, GQA 8/8, 32/4, 16/1.  The captured
    max_seqlen_q is the bucket bound steps + 1 = 4, not the dummy batch's q; every row equals
    eager (T0) and the oracle (T1).  The bug "capture-max-seqlen-q-small" (dummy q lens 1 frozen)
    is caught by the replay check "captured max_seqlen_q >= max live q" (CG-006, named before PA-010)."""
    reqs = Requests(scenario("draft_extend", 4, lens=[16, 8, 38], accept=[4, 1, 3], num_heads=H, num_kv_heads=Hkv))
    runner = reqs.runner(capture_bs=(3,))
    fb, x, ref = reqs.live([0, 1, 2])
    out = runner.replay(fb, x)
    md = runner.backend.forward_metadata
    assert md.max_seq_len_q == 4 and md.cache_seqlens_int32.tolist() == [20, 9, 41]
    assert [s["max_seqlen_q"] for _, _, s in runner.graphs[3]._tape if "max_seqlen_q" in s] == [4]
    assert tol.t0(out, reqs.eager(fb, x)[0]).ok
    tol.assert_t1(out, ref, what=f"B08 H={H} Hkv={Hkv}")
    with variants.enabled("capture-max-seqlen-q-small"):
        bad = reqs.runner(capture_bs=(3,))
    _raises("CG-006", bad.replay, fb, x)


# ---- B10 ----
@pytest.mark.spec("CG-010", "CG-005", "MD-004")
@pytest.mark.parametrize("name", ["verify", "draft_extend", "draft_extend_v2"])
def test_case_B10_capture_metadata_has_no_empty_causal_span(name):
    """Case B10: graphs for bs {1, 2, 4}, ndt 4.  After capture every captured row has K >= q
    and the whole KV pool (dummy page 0 included, no poison) is finite; then real bs 2 with
    prefixes [0, 5] (request 0 is the minimum legal K == q for verify and v2) equals the oracle.

    The bug "pad-seq-lens-zero" (fill 0) makes the draft extends' dummy rows K = 0 < q = 4 and
    capture raises CG-010.  For verify refspec (like SGLang) sets K = seq_lens + N, so a zero
    fill still gives K = N = q: minimal but not empty; capture succeeds with padded K = 4.
    """
    sc = scenario(name, 4, lens=[0, 5], accept=[1, 4], poison=False)
    reqs = Requests(sc)
    runner = reqs.runner(capture_bs=(1, 2, 4))
    pool = reqs.built.pool
    assert all(bool(torch.isfinite(t).all()) for t in pool.k_buffer + pool.v_buffer)
    for bs in (1, 2, 4):
        md = runner.backend.graph_state.captured[(captured_key(name), bs)][0]
        q = md.cu_seqlens_q[1:] - md.cu_seqlens_q[:-1]
        assert bool((md.cache_seqlens_int32 >= q).all()), (bs, md.cache_seqlens_int32.tolist(), q.tolist())
    fb, x, ref = reqs.live([0, 1])
    out = runner.replay(fb, x)
    K = {"verify": [4, 9], "draft_extend": [1, 9], "draft_extend_v2": [4, 9]}[name]
    assert runner.backend.forward_metadata.cache_seqlens_int32.tolist() == K
    tol.assert_t1(out, ref, what=f"B10 {name}")
    with variants.enabled("pad-seq-lens-zero"):
        if name == "verify":
            r = reqs.runner(capture_bs=(1, 2, 4))
            assert r.backend.graph_state.captured[("target_verify", 4)][0].cache_seqlens_int32.tolist() == [N] * 4
        else:
            _raises("CG-010", reqs.runner, (1, 2, 4))


# ---- B11 ----
@pytest.mark.spec("CG-001", "CG-002", "PA-008")
@pytest.mark.parametrize("P", [1, 16])
def test_case_B11_replay_copies_in_place(P):
    """Case B11: decode graph at bs 4.  Replay A: seq_lens [10, 37, 5, 64]; replay B: other
    requests [3, 100, 1, 50] on other (shuffled) pages; physical page 0 holds +1e4.  Both equal
    the oracle, no output is dominated by page 0, and the data_ptr of page_table, cache_seqlens
    and cu_seqlens_q is the capture-time one.  With the bug "replay-rebind-page-table" the graph
    reads the unfilled capture-time table (all page 0): outputs ~1e4 without validation, CG-001
    with it."""
    reqs = Requests(scenario("decode", P, lens=[10, 37, 5, 64, 3, 100, 1, 50]))
    runner = reqs.runner(capture_bs=(4,))
    poison_dummy_page(reqs.built.pool, 1e4)
    names = ("page_table", "cache_seqlens_int32", "cu_seqlens_q")
    md0 = runner.backend.graph_state.captured[("decode", 4)][0]
    at_capture = {n: getattr(md0, n).data_ptr() for n in names}
    for idx in ([0, 1, 2, 3], [4, 5, 6, 7]):
        fb, x, ref = reqs.live(idx)
        out = runner.replay(fb, x)
        md = runner.backend.forward_metadata
        assert {n: getattr(md, n).data_ptr() for n in names} == at_capture
        assert float(out.abs().max()) < 100.0
        tol.assert_t1(out, ref, what=f"B11 P={P} idx={idx}")
    fb, x, ref = reqs.live([4, 5, 6, 7])
    stale = reqs.runner(capture_bs=(4,), validate=False)
    poison_dummy_page(reqs.built.pool, 1e4)
    with variants.enabled("replay-rebind-page-table"):
        out = stale.replay(fb, x)
        assert float(out.abs().max()) > 1e3
        _raises("CG-001", reqs.runner(capture_bs=(4,)).replay, fb, x)
