"""The FA3 contract emulator (``kernel.flash_attn_with_kvcache(provider="emulator")``) vs the oracle.

Inputs are built here directly (no allocator, no metadata builder): each request gets random,
shuffled physical pages, ``req_to_token`` holds ``page * P + offset`` and the page table holds
the pages.  Poison: every page outside all tables is NaN (page 0 included), slots of a used page
past K_b hold 1e4, and page-table columns past ``ceil(K_b / P)`` point at a NaN page.
docs/fa3-contract.md (PA-003..PA-007, PA-010, PA-011) and cases B16, B18.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refspec.core.batch import decode_batch, verify_batch
from refspec.fa3 import kernel
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.metadata import init_forward_metadata, strided_page_table
from refspec.fa3.validate import validate_metadata
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.oracle.attention import attention_by_slot
from refspec.oracle.backend import OracleBackend
from refspec.core.tolerance import assert_t1, t0

PAGE_SIZES = [1, 2, 3, 4, 16, 64, 128]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SENTINEL = 1e4


def raises(inv_id):
    return pytest.raises(InvariantError, match=rf"^\[{inv_id}\]")


def paged_case(P, reqs, H=8, Hkv=2, D=32, dtype=torch.float32, seed=0, poison=True, width=None,
               shuffle=True, spare_pages=3):
    """A kernel-level batch.  ``reqs``: ``[(Q_b, K_b), ...]`` (query rows, keys, tokens).

    Returns a dict: ``args`` (kwargs of ``flash_attn_with_kvcache`` except q / k / v), ``q``,
    ``k_cache`` / ``v_cache`` ``[NP, P, Hkv, D]``, ``R`` (req_to_token, row b+1 = request b),
    ``pages`` per request, ``poison_page`` (a NaN page in no table), ``K``, ``cu``.
    """
    g = torch.Generator().manual_seed(seed)  # data
    need = [-(-K // P) for _, K in reqs]
    NP = 1 + sum(need) + spare_pages
    gp = torch.Generator().manual_seed(seed + 1)  # placement, so the data do not depend on it
    ids = torch.randperm(NP - 1, generator=gp) + 1 if shuffle else torch.arange(1, NP)
    pages, used = [], 0
    for n in need:
        pages.append(ids[used:used + n].tolist())
        used += n
    poison_page = int(ids[-1])
    W = width or max(need + [1])
    fill = float("nan") if poison else 0.0
    k_cache = torch.full((NP, P, Hkv, D), fill, dtype=dtype)
    v_cache = torch.full((NP, P, Hkv, D), fill, dtype=dtype)
    R = torch.zeros((len(reqs) + 1, max([K for _, K in reqs] + [1])), dtype=torch.int32)
    table = torch.full((len(reqs), W), poison_page, dtype=torch.int32)
    for b, ((_Q, K), pg) in enumerate(zip(reqs, pages)):
        table[b, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
        p = torch.arange(K)
        page, off = torch.tensor(pg, dtype=torch.long)[p // P], p % P
        R[b + 1, :K] = (page * P + off).to(torch.int32)
        if pg:
            k_cache[pg] = SENTINEL if poison else 0.0
            v_cache[pg] = SENTINEL if poison else 0.0
        k_cache[page, off] = torch.randn(K, Hkv, D, generator=g).to(dtype)
        v_cache[page, off] = torch.randn(K, Hkv, D, generator=g).to(dtype)
    cu = [0]
    for Q, _ in reqs:
        cu.append(cu[-1] + Q)
    q = torch.randn(cu[-1], H, D, generator=g).to(dtype)
    args = dict(cache_seqlens=torch.tensor([K for _, K in reqs], dtype=torch.int32), page_table=table,
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=max([Q for Q, _ in reqs] + [1]))
    return dict(args=args, q=q, k_cache=k_cache, v_cache=v_cache, R=R, pages=pages, poison_page=poison_page,
                K=[K for _, K in reqs], cu=cu)


def emulate(c, **over):
    args = {**c["args"], **over}
    return kernel.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"],
                                          provider="emulator", **args)


def oracle(c, upcast=True, **kw):
    kf, vf = c["k_cache"].flatten(0, 1), c["v_cache"].flatten(0, 1)
    return attention_by_slot(c["q"], kf, vf, c["R"], list(range(1, len(c["K"]) + 1)), c["K"], c["cu"],
                             upcast=upcast, **kw)


def check_vs_oracle(c, what=""):
    out = emulate(c)
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output (poison leaked)"
    return assert_t1(out, oracle(c), oracle(c, upcast=False), what)


def edge_batches(P):
    """Keys at page boundaries +-1 for Q in {1, 2, 4}, and S == Q."""
    return {
        "Q1": [(1, max(1, P - 1)), (1, P), (1, P + 1), (1, 2 * P + 1)],
        "Q2": [(2, max(2, P - 1)), (2, P + 1), (2, 2 * P)],
        "Q4": [(4, max(4, P - 1)), (4, P + 1), (4, 2 * P)],
        "S==Q": [(1, 1), (2, 2), (4, 4)],
    }


@pytest.mark.spec("PA-002", "PA-004", "TOL-002")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["Q1", "Q2", "Q4", "S==Q"])
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
def test_emulator_equals_oracle(P, shape, dtype):
    c = paged_case(P, edge_batches(P)[shape], dtype=DTYPES[dtype], seed=P)
    check_vs_oracle(c, f"P={P} {shape} {dtype}")


@pytest.mark.spec("PA-006")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv", [8, 4, 2, 1], ids=lambda h: f"gqa{8 // h}")
@pytest.mark.parametrize("P", [3, 16], ids=lambda P: f"P{P}")
def test_emulator_gqa_equals_oracle(P, Hkv, dtype):
    c = paged_case(P, [(1, 2 * P + 1), (4, P + 3), (2, 5)], H=8, Hkv=Hkv, dtype=DTYPES[dtype], seed=Hkv)
    check_vs_oracle(c, f"GQA {8 // Hkv}")


def test_physical_placement_does_not_matter():
    """Metamorphic: the same keys on shuffled or on in-order pages give bitwise the same output."""
    reqs = [(4, 21), (1, 9)]
    a = paged_case(4, reqs, seed=5, shuffle=True)
    b = paged_case(4, reqs, seed=5, shuffle=False)
    assert a["pages"] != b["pages"]
    assert t0(emulate(a), emulate(b)).ok


@pytest.mark.spec("PA-007")
@pytest.mark.parametrize("P", [1, 3, 16], ids=lambda P: f"P{P}")
def test_poisoned_pool_changes_nothing_on_real_rows(P):
    """NaN everywhere outside the tables and 1e4 past K_b: bitwise the same as a clean pool."""
    reqs = [(4, 2 * P + 1), (1, P + 1), (2, max(2, P - 1))]
    dirty, clean = paged_case(P, reqs, seed=2, poison=True), paged_case(P, reqs, seed=2, poison=False)
    assert torch.isnan(dirty["k_cache"]).any()
    assert P == 1 or (dirty["k_cache"] == SENTINEL).any()  # P = 1: no slot of a used page is past K
    out = emulate(dirty)
    assert bool(torch.isfinite(out).all())
    assert t0(out, emulate(clean)).ok


@pytest.mark.spec("PA-007")
@pytest.mark.parametrize("P", [1, 4, 16], ids=lambda P: f"P{P}")
def test_columns_past_ceil_k_over_p_are_never_read(P):
    """Slack columns hold int32 max (a page id far outside the pool): no error, same output."""
    c = paged_case(P, [(1, P + 1), (4, 3 * P), (2, 2)], width=6, seed=3)
    base = emulate(c)
    huge = c["args"]["page_table"].clone()
    for b, K in enumerate(c["K"]):
        huge[b, -(-K // P):] = 2**31 - 1
    assert t0(emulate(c, page_table=huge), base).ok


@pytest.mark.spec("CG-002", "TOL-001")
@pytest.mark.parametrize("P", [1, 4, 16], ids=lambda P: f"P{P}")
@pytest.mark.parametrize("reqs", [
    [(4, 130), (4, 9), (1, 1), (1, 1)],  # verify-like, two tiles for request 0, graph-padded rows (K = 1)
    [(2, 40), (1, 300), (4, 4), (3, 129)],  # uneven Q and K, a request of three tiles
    [(1, 1), (5, 77)],  # the long request second
], ids=["verify-padded", "uneven", "short-first"])
def test_a_requests_output_does_not_depend_on_the_batch(P, reqs):
    """Each request's rows (output and LSE) are bitwise those of the request alone: the emulator's
    side-by-side requests and full-width key tiles never let the other rows of the batch (their
    count, their Q, their K: graph padding) change a request's arithmetic, which CG-002's T0
    replay == eager on CPU rests on."""
    c = paged_case(P, reqs, seed=P)
    out, lse = emulate(c, return_softmax_lse=True)
    for b, (Q, K) in enumerate(reqs):
        lo, hi = c["cu"][b], c["cu"][b + 1]
        one = dict(cache_seqlens=c["args"]["cache_seqlens"][b:b + 1], page_table=c["args"]["page_table"][b:b + 1],
                   cu_seqlens_q=torch.tensor([0, Q], dtype=torch.int32), max_seqlen_q=Q)
        alone, alone_lse = kernel.flash_attn_with_kvcache(c["q"][lo:hi], c["k_cache"], c["v_cache"],
                                                          provider="emulator", return_softmax_lse=True, **one)
        assert torch.equal(out[lo:hi], alone), f"request {b} (Q={Q}, K={K}) differs inside the batch"
        assert torch.equal(lse[:, lo:hi], alone_lse), f"request {b}: LSE differs inside the batch"


@pytest.mark.spec("PA-004", "PA-005")
@pytest.mark.parametrize("P", [1, 3, 16], ids=lambda P: f"P{P}")
def test_horizon_probe(P):
    """q = 0 and V = key position: row i of a request (Q, K) returns (h - 1) / 2, h = K - Q + i + 1.

    Hand values: (Q 4, K 9) -> 2.5 3 3.5 4;  (Q 1, K 5) -> 2;  (Q 5, K 2) -> 0 0 0 0 0.5
    (rows 0..2 see nothing and are exactly 0).
    """
    c = paged_case(P, [(4, 9), (1, 5), (5, 2)], seed=1)
    v_flat = c["v_cache"].flatten(0, 1)  # a view: writes land in the pool
    for b, K in enumerate(c["K"]):
        v_flat[c["R"][b + 1, :K].long()] = torch.arange(K, dtype=torch.float32)[:, None, None]
    c["q"] = torch.zeros_like(c["q"])
    out = emulate(c)
    expected = torch.tensor([2.5, 3, 3.5, 4, 2, 0, 0, 0, 0, 0.5])
    assert torch.allclose(out[:, :, 0], expected[:, None].expand(-1, 8), atol=1e-5)
    assert torch.equal(out[5:8], torch.zeros_like(out[5:8]))


# ------------------------------------------------------------------ contract violations
@pytest.mark.spec("PA-010")
def test_more_query_rows_than_max_seqlen_q_raises_PA_010():
    c = paged_case(4, [(1, 5), (4, 9)])
    with raises("PA-010"):
        emulate(c, max_seqlen_q=3)


@pytest.mark.spec("PA-003")
def test_page_table_too_narrow_raises_PA_003():
    c = paged_case(4, [(1, 5), (4, 9)])  # K = 9 needs 3 pages
    with raises("PA-003"):
        emulate(c, page_table=c["args"]["page_table"][:, :2].contiguous())


@pytest.mark.spec("PA-011")
@pytest.mark.parametrize("bad", ["cache_seqlens-int64", "page_table-int64", "cu_seqlens_q-int64",
                                 "cu-not-from-0", "cu-decreasing", "cu-past-T", "page-id-out-of-pool",
                                 "page-id-negative", "batch-mismatch", "max_seqlen_q-tensor"])
def test_malformed_arguments_raise_PA_011(bad):
    c = paged_case(4, [(1, 5), (4, 9)])
    a = c["args"]
    over = {
        "cache_seqlens-int64": dict(cache_seqlens=a["cache_seqlens"].long()),
        "page_table-int64": dict(page_table=a["page_table"].long()),
        "cu_seqlens_q-int64": dict(cu_seqlens_q=a["cu_seqlens_q"].long()),
        "cu-not-from-0": dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)),
        "cu-decreasing": dict(cu_seqlens_q=torch.tensor([0, 3, 2], dtype=torch.int32)),
        "cu-past-T": dict(cu_seqlens_q=torch.tensor([0, 1, 6], dtype=torch.int32)),
        "page-id-out-of-pool": dict(page_table=torch.tensor([[1, 99, 0], [2, 3, 4]], dtype=torch.int32)),
        "page-id-negative": dict(page_table=torch.tensor([[-1, 5, 0], [2, 3, 4]], dtype=torch.int32)),
        "batch-mismatch": dict(cache_seqlens=torch.tensor([5, 9, 3], dtype=torch.int32)),
        "max_seqlen_q-tensor": dict(max_seqlen_q=torch.tensor(4)),
    }[bad]
    with raises("PA-011"):
        emulate(c, **over)


# ------------------------------------------------------------------ random batches
BATCH = st.lists(st.tuples(st.integers(1, 5), st.integers(0, 24)), min_size=1, max_size=3)


@pytest.mark.spec("PA-004", "PA-005", "PA-006", "TOL-002")
@given(P=st.sampled_from(PAGE_SIZES[:5]), reqs=BATCH, Hkv=st.sampled_from([1, 2, 4, 8]),
       dtype=st.sampled_from(list(DTYPES.values())), seed=st.integers(0, 2**16))
def test_random_batches_equal_oracle(P, reqs, Hkv, dtype, seed):
    """Any mix of Q in 1..5 and K in 0..24 (Q > K allowed: those rows must be 0) on shuffled pages."""
    c = paged_case(P, reqs, H=8, Hkv=Hkv, D=16, dtype=dtype, seed=seed)
    check_vs_oracle(c)
    out = emulate(c)
    for b, (Q, K) in enumerate(reqs):
        empty = max(0, Q - K)  # rows i < Q - K see no key
        assert torch.equal(out[c["cu"][b]:c["cu"][b] + empty].float(), torch.zeros(empty, 8, 16))


# ------------------------------------------------------------------ public cases
def _b16_cache():
    """Case B16 layout, P = 4: request A (row 1), 11 tokens on pages [7, 2, 9] = slots 28-31,
    8-11, 36-38; request B (row 2), 5 tokens on pages [3, 4] = slots 12-15, 16."""
    kv = KVCache(max_reqs=3, max_context=16, num_pages=10, page_size=4)
    kv.req_to_token[1, :11] = torch.tensor([28, 29, 30, 31, 8, 9, 10, 11, 36, 37, 38], dtype=torch.int32)
    kv.req_to_token[2, :5] = torch.tensor([12, 13, 14, 15, 16], dtype=torch.int32)
    pool = KVPool(1, 10, 4, 2, 32, fill=float("nan"))
    g = torch.Generator().manual_seed(16)
    kf, vf = pool.get_flat_kv(0)
    for r, K in ((1, 11), (2, 5)):
        s = kv.req_to_token[r, :K].long()
        kf[s], vf[s] = torch.randn(K, 2, 32, generator=g), torch.randn(K, 2, 32, generator=g)
    return kv, pool, g


@pytest.mark.spec("PA-001", "PA-002", "PA-003", "PA-011")
@pytest.mark.parametrize("mode", ["decode", "target_verify"])
def test_case_B16_page_table_is_in_page_units(mode):
    """Case B16 (tokenspeed #913/#958, sglang #16267): the table must hold page ids in the
    kernel's page unit.  Correct: rows [7, 2, 9] and [3, 4]; FA3 equals the oracle.  Misuse:
    slot ids [28, 8, 36] (PA-011 in the kernel, PA-002 in validation), or a table built for
    P = 8 read with P = 4 (PA-003)."""
    kv, pool, g = _b16_cache()
    fb = decode_batch(kv, [1, 2], [11, 5]) if mode == "decode" else verify_batch(kv, [1, 2], [7, 1], 4)
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    assert md.cache_seqlens_int32.tolist() == [11, 5]
    assert md.page_table[0].tolist() == [7, 2, 9] and md.page_table[1, :2].tolist() == [3, 4]
    for b, (r, K) in enumerate(((1, 11), (2, 5))):
        for t in range(K):
            assert int(kv.req_to_token[r, t]) == int(md.page_table[b, t // 4]) * 4 + t % 4
    layer = AttentionLayer(0, 8, 2, 32)
    T = fb.num_tokens
    q, k, v = (torch.randn(T, h, 32, generator=g) for h in (8, 2, 2))
    fa3 = FlashAttentionBackend(pool, kv, provider="emulator")
    fa3.init_forward_metadata(fb)
    out = fa3.forward(q, k, v, layer, fb)
    ora = OracleBackend(pool, kv)
    ora.init_forward_metadata(fb)
    ref = ora.forward(q, None, None, layer, fb)
    assert_t1(out, ref, None, f"B16 {mode}")
    # misuse 1: token slots in the table
    slots_table = md.page_table.clone()
    slots_table[0] = torch.tensor([28, 8, 36], dtype=torch.int32)
    kf, vf = pool.get_kv_buffer(0)
    with raises("PA-011"):  # page 28 is outside the 10-page pool
        kernel.flash_attn_with_kvcache(q, kf, vf, cache_seqlens=md.cache_seqlens_int32, page_table=slots_table,
                                       cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q, provider="emulator")
    md.page_table = slots_table
    with raises("PA-002"):
        validate_metadata(md, fb, kv.req_to_token, 4)
    # misuse 2: a table built for P = 8 ([3, 4] for request A) read with P = 4
    md.page_table = strided_page_table(kv.req_to_token, fb.req_pool_indices, 11, 8)
    assert md.page_table[0].tolist() == [3, 4]
    with raises("PA-003"):
        validate_metadata(md, fb, kv.req_to_token, 4)
    with raises("PA-003"):
        kernel.flash_attn_with_kvcache(q, kf, vf, cache_seqlens=md.cache_seqlens_int32, page_table=md.page_table,
                                       cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q, provider="emulator")


@pytest.mark.spec("PA-007", "PA-005")
@pytest.mark.parametrize("mode,q_lens,pad_q,pad_k", [
    ("decode", [1, 1, 1], 1, 1),
    ("target_verify", [4, 4, 4], 4, 1),
    ("draft_extend", [1, 4, 2], 4, 4),
], ids=lambda x: x if isinstance(x, str) else None)
def test_case_B18_slack_and_padded_entries_point_at_a_poison_page(mode, q_lens, pad_q, pad_k):
    """Case B18 (ROCm/rocm-libraries #6932): P = 16, K = [32, 48, 33] (page multiple, and a
    row exactly full: width ceil(max_ctx / P) = 3 with max_ctx = 48, and one page + 1), one
    padded row as in a bs = 4 graph.  Every slack column and the whole padded row hold the id
    of a NaN page (not the live page 0).  Real rows: finite and equal to the oracle.  The
    padded row's non-empty rows do read the poison (NaN), which proves the poison is live."""
    reqs = list(zip(q_lens, [32, 48, 33]))
    c = paged_case(16, reqs, width=3, seed=18)
    a = c["args"]
    assert (a["page_table"][0, 2:] == c["poison_page"]).all() and (a["page_table"][1] != c["poison_page"]).all()
    T = c["cu"][-1]
    padded = dict(
        cache_seqlens=torch.cat([a["cache_seqlens"], torch.tensor([pad_k], dtype=torch.int32)]),
        page_table=torch.cat([a["page_table"], torch.full((1, 3), c["poison_page"], dtype=torch.int32)]),
        cu_seqlens_q=torch.cat([a["cu_seqlens_q"], torch.tensor([T + pad_q], dtype=torch.int32)]),
        max_seqlen_q=4,
    )
    q = torch.cat([c["q"], torch.randn(pad_q, 8, 32)])
    out = kernel.flash_attn_with_kvcache(q, c["k_cache"], c["v_cache"], provider="emulator", **padded)
    real = out[:T]
    assert bool(torch.isfinite(real).all())
    assert_t1(real, oracle(c), oracle(c, upcast=False), f"B18 {mode}")
    # padded row: its rows i < pad_q - pad_k see nothing (exactly 0); the others read the NaN page
    empty = pad_q - pad_k if pad_q > pad_k else 0
    assert torch.equal(out[T:T + empty], torch.zeros_like(out[T:T + empty]))
    assert bool(torch.isnan(out[T + empty:]).all())
