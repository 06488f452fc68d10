"""Eager FA3 metadata per mode (``refspec.fa3.metadata``, MD-003) and its output vs the oracle.

Worked examples: P = 4, an unshuffled pool (pages come out 1, 2, 3, ...), two requests in rows 1
and 2, so every slot and page is computed by hand (page g holds slots 4g .. 4g+3).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refspec.core import batch as B
from refspec.mutants import variants
from refspec.harness.modes import MODES, mode_scenarios
from refspec.fa3 import kernel
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.metadata import init_forward_metadata
from refspec.fa3.validate import validate_metadata
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode
from refspec.oracle.backend import OracleBackend, oracle_metadata
from refspec.harness.scenario import SENTINEL, Scenario
from refspec.core.tolerance import assert_t1, t0

PAGE_SIZES = [1, 2, 3, 4, 16, 64, 128]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def raises(inv_id):
    return pytest.raises(InvariantError, match=rf"^\[{inv_id}\]")


def cache(allocs, P=4):
    """A fresh P = 4 cache; ``allocs`` = [(prefix_lens, seq_lens), ...] applied to rows 1, 2."""
    kv = KVCache(max_reqs=4, max_context=24, num_pages=16, page_size=P, extra=8)
    rows = [kv.alloc_req(), kv.alloc_req()]
    for pre, seq in allocs:
        kv.alloc_extend(rows, pre, seq)
    return kv, rows


def metadata(kv, fb, step=None):
    md = init_forward_metadata(fb, kv.req_to_token, kv.page_size, step)
    validate_metadata(md, fb, kv.req_to_token, kv.page_size)
    return md


def numbers(md):
    return dict(K=md.cache_seqlens_int32.tolist(), cu_q=md.cu_seqlens_q.tolist(), cu_k=md.cu_seqlens_k.tolist(),
                max_q=md.max_seq_len_q, max_k=md.max_seq_len_k, table=md.page_table.tolist())


# ---------------------------------------------------------------- worked examples, every mode
def example(name):
    """(kv, fb, step, expected numbers, expected out_cache_loc) for each mode, by hand."""
    if name == "DECODE":  # L = [5, 9] including the new token: r1 slots 4..8, r2 slots 12..20
        kv, r = cache([([0, 0], [5, 9])])
        return kv, B.decode_batch(kv, r, [5, 9]), None, dict(
            K=[5, 9], cu_q=[0, 1, 2], cu_k=[0, 5, 14], max_q=1, max_k=9, table=[[1, 2, 0], [3, 4, 5]]), [8, 20]
    if name.startswith("DRAFT_DECODE"):  # L = [5, 9] committed, L + N = [9, 13] reserved (N = 4)
        s = int(name[-1])
        kv, r = cache([([0, 0], [9, 13])])  # r1 slots 4..12 (pages 1-3), r2 slots 16..28 (pages 4-7)
        K = [5 + s + 1, 9 + s + 1]
        return kv, B.draft_decode_batch(kv, r, [5, 9], s), s, dict(
            K=K, cu_q=[0, 1, 2], cu_k=[0, K[0], K[0] + K[1]], max_q=1, max_k=K[1],
            table=[[1, 2, 3], [4, 5, 6]]), [4 + 5 + s, 16 + 9 + s]
    if name == "EXTEND":  # no prefix: e = [3, 6]; r1 slots 4..6, r2 slots 8..13
        kv, r = cache([([0, 0], [3, 6])])
        return kv, B.extend_batch(kv, r, [0, 0], [3, 6]), None, dict(
            K=[3, 6], cu_q=[0, 3, 9], cu_k=[0, 3, 9], max_q=6, max_k=6, table=[[1, 0], [2, 3]]), \
            [4, 5, 6, 8, 9, 10, 11, 12, 13]
    if name == "EXTEND_PREFIX":  # r1 prefix 4 (page 1) + 3 new (page 2: 8, 9, 10); r2 5 new (pages 3, 4)
        kv = KVCache(max_reqs=4, max_context=24, num_pages=16, page_size=4, extra=8)
        r = [kv.alloc_req(), kv.alloc_req()]
        kv.alloc_extend([r[0]], [0], [4])
        kv.alloc_extend(r, [4, 0], [7, 5])
        return kv, B.extend_batch(kv, r, [4, 0], [3, 5]), None, dict(
            K=[7, 5], cu_q=[0, 3, 8], cu_k=[0, 7, 12], max_q=5, max_k=7, table=[[1, 2], [3, 4]]), \
            [8, 9, 10, 12, 13, 14, 15, 16]
    # verify / draft extend: L = [5, 9] committed, N = 4 slots reserved: r1 4..12, r2 16..28
    kv, r = cache([([0, 0], [9, 13])])
    table = [[1, 2, 3, 0], [4, 5, 6, 7]]
    if name == "TARGET_VERIFY":
        return kv, B.verify_batch(kv, r, [5, 9], 4), None, dict(
            K=[9, 13], cu_q=[0, 4, 8], cu_k=[0, 9, 22], max_q=4, max_k=13, table=table), \
            [9, 10, 11, 12, 25, 26, 27, 28]
    if name == "DRAFT_EXTEND":  # a = [2, 4] (n = 1, 3): L' = [7, 13], packed rows
        return kv, B.draft_extend_batch(kv, r, [7, 13], [2, 4], num_draft_tokens=4), None, dict(
            K=[7, 13], cu_q=[0, 2, 6], cu_k=[0, 7, 20], max_q=4, max_k=13, table=table), [9, 10, 25, 26, 27, 28]
    if name == "DRAFT_EXTEND_V2":  # seq_lens = L + N = [9, 13]: K = seq_lens, all N rows
        return kv, B.draft_extend_v2_batch(kv, r, [9, 13], 4, [2, 4]), None, dict(
            K=[9, 13], cu_q=[0, 4, 8], cu_k=[0, 9, 22], max_q=4, max_k=13, table=table), \
            [9, 10, 11, 12, 25, 26, 27, 28]
    assert name == "IDLE"
    return kv, B.idle_batch(kv), None, dict(K=[], cu_q=[0], cu_k=[0], max_q=1, max_k=0, table=[]), []


EXAMPLES = ["DECODE", "DRAFT_DECODE_s0", "DRAFT_DECODE_s1", "DRAFT_DECODE_s2", "EXTEND", "EXTEND_PREFIX",
            "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2", "IDLE"]


@pytest.mark.spec("MD-002", "MD-003", "MD-005", "MD-006", "MD-007", "MD-008", "MD-009", "MD-010", "MD-011")
@pytest.mark.parametrize("name", EXAMPLES)
def test_worked_example(name):
    kv, fb, step, expected, loc = example(name)
    md = metadata(kv, fb, step)
    assert numbers(md) == expected
    assert fb.out_cache_loc.tolist() == loc  # INV-TAIL's left-hand side, by hand


@pytest.mark.spec("MD-001")
@pytest.mark.parametrize("name", EXAMPLES)
def test_metadata_tensors_are_int32_and_contiguous(name):
    kv, fb, step, _, _ = example(name)
    md = metadata(kv, fb, step)
    for t in (md.cache_seqlens_int32, md.cu_seqlens_q, md.cu_seqlens_k, md.page_table):
        assert t.dtype == torch.int32 and t.is_contiguous() and (t.numel() == 0 or t.stride(-1) == 1)
    assert type(md.max_seq_len_q) is int and type(md.max_seq_len_k) is int


@pytest.mark.spec("MD-007")
def test_page_size_1_table_is_the_token_slots():
    """P = 1: r1 L = 3 -> slots 1 2 3, r2 L = 2 -> slots 4 5; the table is req_to_token itself."""
    kv, r = cache([([0, 0], [3, 2])], P=1)
    md = metadata(kv, B.decode_batch(kv, r, [3, 2]))
    assert md.page_table.tolist() == [[1, 2, 3], [4, 5, 0]]


@pytest.mark.spec("MD-006")
def test_max_seq_len_k_comes_from_the_cpu_mirror():
    """The device seq_lens are never synced: a mirror saying 13 widens the table to 4 columns."""
    kv, fb, _, _, _ = example("DECODE")
    fb = fb.replace(seq_lens_cpu=torch.tensor([5, 13]))
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    assert md.max_seq_len_k == 13 and md.page_table.shape == (2, 4)
    assert md.cache_seqlens_int32.tolist() == [5, 9]


@pytest.mark.spec("MD-010")
def test_draft_steps_add_exactly_one_key_each():
    """MD-010: K grows by 1 per step; page tables agree on their common width."""
    mds = [metadata(*example(f"DRAFT_DECODE_s{s}")[:2], s) for s in range(3)]
    Ks = [md.cache_seqlens_int32 for md in mds]
    assert all(torch.equal(b - a, torch.ones(2, dtype=torch.int32)) for a, b in zip(Ks, Ks[1:]))
    w = min(md.page_table.shape[1] for md in mds)
    assert all(torch.equal(md.page_table[:, :w], mds[0].page_table[:, :w]) for md in mds)


@pytest.mark.spec("MD-008")
def test_v2_metadata_ignores_accept_counts_and_never_adds_extend_again():
    kv, fb, _, expected, _ = example("DRAFT_EXTEND_V2")
    other = B.draft_extend_v2_batch(kv, fb.req_pool_indices.tolist(), [9, 13], 4, [4, 1])
    assert numbers(metadata(kv, other)) == numbers(metadata(kv, fb)) == expected
    assert expected["K"] == fb.seq_lens.tolist()  # K = seq_lens = L + N, not L + 2N


# ---------------------------------------------------------------- oracle twin
@pytest.mark.spec("MD-002", "MD-003")
@pytest.mark.parametrize("P", [1, 3, 16], ids=lambda P: f"P{P}")
@pytest.mark.parametrize("label", MODES)
def test_oracle_twin_agrees_with_fa3(label, P):
    """The oracle derives K from positions and q from the mode; FA3 from seq_lens + delta (MD-003)."""
    built = mode_scenarios(P)[label].build()
    step = built.fb.draft_step
    md = init_forward_metadata(built.fb, built.kv.req_to_token, P, step)
    om = oracle_metadata(built.fb)
    assert om.cache_seqlens == md.cache_seqlens_int32.tolist() == built.K
    assert om.cu_seqlens_q == md.cu_seqlens_q.tolist()


# ---------------------------------------------------------------- full matrix
MATRIX = [(m, P, g, d) for m in MODES for P in PAGE_SIZES for g in (1, 4, 8) for d in DTYPES]


@pytest.mark.spec("MD-003", "MD-005", "PA-002", "TOL-002")
@pytest.mark.parametrize("label,P,gqa,dtype", MATRIX, ids=[f"{m}-P{P}-gqa{g}-{d}" for m, P, g, d in MATRIX])
def test_fa3_eager_equals_oracle(label, P, gqa, dtype):
    sc = mode_scenarios(P, dtype=DTYPES[dtype], num_heads=8, num_kv_heads=8 // gqa, head_dim=32, seed=P + gqa)[label]
    built = sc.build()
    ref, low = built.run_oracle(), built.run_oracle(upcast=False)
    out = built.run_fa3(provider="emulator")
    assert bool(torch.isfinite(out).all())
    assert_t1(out, ref, low, f"{label} P={P} GQA {gqa} {dtype}")


# ---------------------------------------------------------------- horizon probe per mode (PA-004)
def section_3_4_last_key(sc: Scenario, b: int, i: int) -> int:
    """The last key row i of request b sees, as PA-004 gives it per mode (from ``lens``)."""
    L, label = sc.lens[b], sc.mode
    if label == ForwardMode.DECODE and sc.draft_step is not None:
        return L + sc.draft_step  # [0, L + s]
    if label == ForwardMode.DECODE:
        return L - 1  # [0, L - 1]: L counts the new token
    return L + i  # extend [0, prefix + i]; verify, v1 and v2 draft extend [0, L + i]


@pytest.mark.spec("PA-004", "MD-003", "MD-005")
@pytest.mark.parametrize("P", [1, 4, 16], ids=lambda P: f"P{P}")
@pytest.mark.parametrize("label", [m for m in MODES if m != "IDLE"])
def test_horizon_probe_per_mode(label, P):
    """q = 0 and V = key position: row i returns the mean of positions 0..last = last / 2."""
    sc = mode_scenarios(P, head_dim=8)[label]
    built = sc.build()
    kv, fb = built.kv, built.fb
    _, vf = built.pool.get_flat_kv(0)
    for r, K in zip(fb.req_pool_indices.tolist(), built.K):
        vf[kv.req_to_token[r, :K].long()] = torch.arange(K, dtype=torch.float32)[:, None, None]
    built.q.zero_()
    built.v.copy_(fb.positions.float()[:, None, None].expand_as(built.v))
    out = built.run_fa3(provider="emulator")[:, :, 0]
    cu = [0] + torch.cumsum(torch.tensor(built.q_lens), 0).tolist()
    expected = torch.tensor([section_3_4_last_key(sc, b, i) / 2 for b in range(len(sc.lens))
                             for i in range(cu[b + 1] - cu[b])])
    torch.testing.assert_close(out, expected[:, None].expand_as(out), atol=1e-4, rtol=0)


# ---------------------------------------------------------------- store-then-attend
@pytest.mark.spec("PA-009")
@pytest.mark.parametrize("label", ["DECODE", "DRAFT_DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"])
def test_store_then_attend(label):
    """Before the forward, this forward's slots hold the 1e4 sentinel; ``forward`` writes k / v
    at ``out_cache_loc`` first (bitwise), so the kernel sees them.  Attending before storing
    reads the sentinel instead: a gross error, so the order is what makes the output right."""
    built = mode_scenarios(4, head_dim=16)[label].build()
    loc = built.fb.out_cache_loc
    kf, vf = built.pool.get_flat_kv(0)
    assert bool((kf[loc] == SENTINEL).all()) and bool((vf[loc] == SENTINEL).all())
    be = built.fa3_backend(provider="emulator")
    md = be.init_forward_metadata(built.fb)
    early = kernel.flash_attn_with_kvcache(built.q, *built.pool.get_kv_buffer(0), cache_seqlens=md.cache_seqlens_int32,
                                           page_table=md.page_table, cu_seqlens_q=md.cu_seqlens_q,
                                           max_seqlen_q=md.max_seq_len_q, provider="emulator")
    out = be.forward(built.q, built.k, built.v, built.layer, built.fb)
    assert torch.equal(kf[loc], built.k) and torch.equal(vf[loc], built.v)
    ref = built.run_oracle()
    assert_t1(out, ref, None, label)
    assert float((early - ref).abs().max()) > 100  # V = 1e4 at the unwritten slots


# ---------------------------------------------------------------- negative tests
@pytest.mark.spec("PA-001", "PA-002")
@pytest.mark.parametrize("swap,inv_id", [((1, 2), "PA-001"), ((1, 5), "PA-002")])
def test_non_page_contiguous_row_is_refused(swap, inv_id):
    """Swap two prefix positions of r2 (verify, K = 13).  Positions 1 <-> 2 break the offset
    rule (PA-001); 1 <-> 5 keep offsets but cross pages, so the table gives wrong slots (PA-002)."""
    kv, fb, _, _, _ = example("TARGET_VERIFY")
    r = 2
    a, b = swap
    kv.req_to_token[r, [a, b]] = kv.req_to_token[r, [b, a]].clone()
    with raises("PA-001"):
        kv.check_page_contiguous(r, 13)
    with raises(inv_id):
        FlashAttentionBackend(None, kv).init_forward_metadata(fb)


@pytest.mark.spec("MD-005", "MD-008")
def test_v2_double_counted_k_is_refused():
    """#26512 (reverted by #26628): K = seq_lens + extend = L + 2N reads N unwritten positions."""
    kv, fb, _, _, _ = example("DRAFT_EXTEND_V2")
    with variants.enabled("de-v2-k-double-count"):
        md = init_forward_metadata(fb, kv.req_to_token, 4)
        assert md.cache_seqlens_int32.tolist() == [13, 17]
        with raises("MD-005"):
            validate_metadata(md, fb, kv.req_to_token, 4)


@pytest.mark.spec("MD-002")
def test_verify_batch_with_the_wrong_q_length_is_refused():
    kv, fb, _, _, _ = example("TARGET_VERIFY")
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    md.cu_seqlens_q = torch.tensor([0, 3, 6], dtype=torch.int32)  # 3 rows per request, N = 4
    with raises("MD-002"):
        validate_metadata(md, fb, kv.req_to_token, 4)


@pytest.mark.spec("MD-005")
@pytest.mark.parametrize("how", ["wrong-step-backend", "shifted-out-cache-loc"])
def test_inv_tail_violation_is_refused(how):
    """Step 1's batch on step 0's backend (K one short), or out_cache_loc one slot late."""
    kv, fb, step, _, _ = example("DRAFT_DECODE_s1")
    if how == "wrong-step-backend":
        step = 0
    else:
        fb = fb.replace(out_cache_loc=fb.out_cache_loc + 1)
    with raises("MD-005"):
        FlashAttentionBackend(None, kv, speculative_step_id=step).init_forward_metadata(fb)


# ---------------------------------------------------------------- property test
@st.composite
def random_scenario(draw):
    label = draw(st.sampled_from(list(MODES)))
    mode, _ = MODES[label]
    P = draw(st.sampled_from([1, 2, 3, 4, 16, 64]))
    N = draw(st.integers(2, 5))
    Bn = 0 if label == "IDLE" else draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(1, 70), min_size=Bn, max_size=Bn))
    kw = dict(num_draft_tokens=N, num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
              dtype=draw(st.sampled_from(list(DTYPES.values()))), seed=draw(st.integers(0, 999)),
              shuffle_pages=draw(st.booleans()))
    if label == "DRAFT_DECODE":
        kw["draft_step"] = draw(st.integers(0, N - 2))
    if label.startswith("EXTEND"):
        kw["extend_lens"] = draw(st.lists(st.integers(1, 9), min_size=Bn, max_size=Bn))
        lens = [x * draw(st.booleans()) for x in lens]  # prefix 0 or not, per request
    if label.startswith("DRAFT_EXTEND"):
        kw["num_accept_tokens"] = draw(st.lists(st.integers(1, N), min_size=Bn, max_size=Bn))
    return Scenario(mode, P, lens, num_heads=8, head_dim=16, **kw)


RUNS = {"examples": 0}


@pytest.mark.spec("MD-002", "MD-003", "MD-005", "PA-002", "TOL-002")
def test_property_production_equals_oracle(record_property):
    """Random batches (mode, P, lengths, accept counts, GQA, dtype, shuffled pages): the eager
    FA3 metadata equals the oracle twin and its output equals the oracle (T1).  Prints how many
    examples ran (60 in the ``ci`` profile; HYPOTHESIS_PROFILE=thorough gives 10 000)."""
    RUNS["examples"] = 0

    @given(sc=random_scenario())
    def check(sc):
        RUNS["examples"] += 1
        built = sc.build()
        out = built.run_fa3(provider="emulator")
        md, om = built.extra["metadata"], oracle_metadata(built.fb)
        assert md.cache_seqlens_int32.tolist() == om.cache_seqlens
        assert md.cu_seqlens_q.tolist() == om.cu_seqlens_q
        assert_t1(out, built.run_oracle(), built.run_oracle(upcast=False), repr(sc))

    check()
    print(f"test_property_production_equals_oracle: ran {RUNS['examples']} hypothesis examples")
    record_property("hypothesis_examples", RUNS["examples"])
    assert RUNS["examples"] > 0


# ---------------------------------------------------------------- public cases
def _b01_cache():
    """Case B01: P = 16, committed L = [14, 16, 31] on shuffled pages, NaN pool, random prefix KV."""
    L, N = [14, 16, 31], 4
    kv = KVCache(max_reqs=5, max_context=48, num_pages=12, page_size=16, extra=8, seed=1)
    pool = KVPool(1, 12, 16, 2, 32, fill=float("nan"))
    rows = [kv.alloc_req() for _ in L]
    kv.alloc_extend(rows, [0, 0, 0], L)
    kf, vf = pool.get_flat_kv(0)
    for r, n in zip(rows, L):
        s = kv.req_to_token[r, :n].long()
        kf[s], vf[s] = torch.randn(n, 2, 32), torch.randn(n, 2, 32)
    return kv, pool, rows, L, N


def _run_both(kv, pool, fb, step, poison_page):
    """Eager FA3 with slack columns -> poison page, and the oracle; returns (out, ref, K)."""
    layer = AttentionLayer(0, 8, 2, 32)
    T = fb.num_tokens
    q, k, v = torch.randn(T, 8, 32), torch.randn(T, 2, 32), torch.randn(T, 2, 32)
    fa3 = FlashAttentionBackend(pool, kv, speculative_step_id=step, provider="emulator")
    md = fa3.init_forward_metadata(fb)
    for b, K in enumerate(md.cache_seqlens_int32.tolist()):
        md.page_table[b, -(-K // 16):] = poison_page
    out = fa3.forward(q, k, v, layer, fb)
    ora = OracleBackend(pool, kv)
    ora.init_forward_metadata(fb)
    return out, ora.forward(q, None, None, layer, fb), md.cache_seqlens_int32.tolist()


@pytest.mark.spec("KV-001", "MD-010", "MD-011", "PA-007", "PA-008")
def test_case_B01_draft_tokens_stay_inside_reserved_pages():
    """Case B01 (vllm #16370): bs 3, P 16, L = [14, 16, 31], Sd = 3, N = 4.  Before draft step 0
    each request owns ceil((L + N) / P) = [2, 2, 3] pages; draft step s sees L + s + 1 keys (s =
    0, 1, 2: the case's three steps; SGLang runs s < Sd - 1, the third stays inside the
    reservation too), verify row j sees L + j + 1.  Slack columns point at a NaN page; outputs
    equal the oracle with no NaN.  A missing reservation is refused (PA-008)."""
    kv, pool, rows, L, N = _b01_cache()
    kv.alloc_extend(rows, L, [x + N for x in L])
    assert [len(kv.row_pages(r, x + N)) for r, x in zip(rows, L)] == [2, 2, 3]
    for r, x in zip(rows, L):
        kv.check_page_contiguous(r, x + N)
    poison = kv.allocator.alloc_pages(1)[0]  # a page in no table, NaN in the pool
    for s in range(3):
        out, ref, K = _run_both(kv, pool, B.draft_decode_batch(kv, rows, L, s), s, poison)
        assert K == [x + s + 1 for x in L]
        assert bool(torch.isfinite(out).all())
        assert_t1(out, ref, None, f"B01 draft step {s}")
    out, ref, K = _run_both(kv, pool, B.verify_batch(kv, rows, L, N), None, poison)
    assert K == [x + N for x in L] and bool(torch.isfinite(out).all())
    assert_t1(out, ref, None, "B01 verify")


@pytest.mark.spec("PA-008")
@pytest.mark.parametrize("unreserved", [1, 0])
def test_case_B01_missing_reservation_is_refused(unreserved):
    """Request 1 (L = 16) without its draft pages writes position 16 to slot 0 of the dummy
    page, which every other check agrees with: PA-008 names it.  Request 0 (L = 14) without a
    reservation has slot 0 at position 14 (offset 0 != 14, so its row is not page-contiguous
    either), but the cause is the same missing reservation: PA-008 names it too, not PA-001."""
    inv_id = "PA-008"
    kv, pool, rows, L, N = _b01_cache()
    keep = [i for i in range(3) if i != unreserved]
    kv.alloc_extend([rows[i] for i in keep], [L[i] for i in keep], [L[i] + N for i in keep])
    fb = B.draft_decode_batch(kv, rows, L, 0)
    with raises(inv_id):
        FlashAttentionBackend(pool, kv, speculative_step_id=0).init_forward_metadata(fb)


@pytest.mark.parametrize("what", ["draft_step_0", "draft_step_1", "target_verify"])
def test_case_B01_under_a_graph_padded_to_4(what):
    """Case B01 under a CUDA graph (emulated) captured at bs 4 with 3 live requests: graph ==
    eager (T0), both == oracle; stale page-table columns and the padded row hit NaN page 0."""
    mode = ForwardMode.TARGET_VERIFY if what == "target_verify" else ForwardMode.DECODE
    step = None if what == "target_verify" else int(what[-1])
    built = Scenario(mode, 16, [14, 16, 31], num_draft_tokens=4, draft_step=step, head_dim=32).build()
    eager = built.run_fa3(provider="emulator")
    runner = built.graph_runner(capture_bs=(4,), provider="emulator")
    graph = built.run_fa3_graph(runner)
    assert runner.graph_bs(3) == 4
    assert t0(graph, eager).ok and bool(torch.isfinite(graph).all())
    assert_t1(graph, built.run_oracle(), None, f"B01 graph {what}")


@pytest.mark.spec("MD-011", "MD-002", "PA-004")
@pytest.mark.parametrize("D", [64, 128])
def test_case_B14_verify_rows_each_see_their_own_horizon(D):
    """Case B14 (vllm #32084): verify bs 2, N 4, prefixes [30, 45] (K = [34, 49]), P 16.  Horizon
    probe: row j of request i returns (prefix_i + j) / 2, every row separately (bf16 exact here)."""
    for dtype in (torch.float32, torch.bfloat16):
        built = Scenario(ForwardMode.TARGET_VERIFY, 16, [30, 45], num_draft_tokens=4, head_dim=D, dtype=dtype).build()
        assert built.K == [34, 49]
        _, vf = built.pool.get_flat_kv(0)
        for r, K in zip(built.fb.req_pool_indices.tolist(), built.K):
            vf[built.kv.req_to_token[r, :K].long()] = torch.arange(K, dtype=dtype)[:, None, None]
        built.q.zero_()
        built.v.copy_(built.fb.positions.to(dtype)[:, None, None].expand_as(built.v))
        out = built.run_fa3(provider="emulator")[:, :, 0].float()
        expected = torch.tensor([(30 + j) / 2 for j in range(4)] + [(45 + j) / 2 for j in range(4)])
        assert torch.equal(out, expected[:, None].expand_as(out))


@pytest.mark.spec("MD-002", "TOL-002")
def test_case_B14_random_qkv_and_the_decode_path_bug():
    """Case B14, random q/k/v against the oracle; and the bug itself (``verify-as-decode``: the
    verify batch takes the q_len-1 decode branch) is refused by MD-002 before the kernel runs."""
    built = Scenario(ForwardMode.TARGET_VERIFY, 16, [30, 45], num_draft_tokens=4, head_dim=64,
                     dtype=torch.bfloat16).build()
    assert_t1(built.run_fa3(provider="emulator"), built.run_oracle(), built.run_oracle(upcast=False), "B14")
    with variants.enabled("verify-as-decode"):
        with raises("MD-002"):
            built.run_fa3(provider="emulator")
