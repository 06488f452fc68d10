"""The FA3 tree path at the attention level: cascade prefix + expand + LSE merge vs the slot oracle.

Every case: shuffled physical pages, GQA (H = 4, Hkv = 2), the pool NaN everywhere that was not
written (a read outside the rule poisons the row), page sizes 1, 4, 16, 64, emulator in fp32.
The expected output is ``attention_over_slots`` over the keys the rule names (the committed
prefix + the node's ancestors and itself; the prefix + the branch row's own steps).
"""

from __future__ import annotations

import math

import pytest
import torch

from refspec.fa3 import tree_metadata as tm
from refspec.fa3.tree_attention import merge_state, page1_view
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.harness.tree_scenario import LAYER, draft_setup, verify_setup
from refspec.oracle.slots import attention_over_slots
from refspec.speculative.tree import kv as tree_kv

PAGE_SIZES = (1, 4, 16, 64)
TOPKS = (2, 4, 8)
N_FOR_K = {2: 4, 4: 8, 8: 16}  # tree sizes used with each k (N - 1 <= k + (S-1) k^2 for S >= 2)
LENS = [5, 67, 130]  # partial last pages at every P > 1, one request longer than a P = 64 page


def _close(out, ref):
    assert not torch.isnan(out).any(), "a NaN (poisoned, unwritten slot) reached the output"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.spec("TR-010", "TR-011", "TR-012")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("topk", TOPKS)
def test_tree_verify_cascade_equals_attention_over_ancestor_slots(P, topk):
    N = N_FOR_K[topk]
    kv, pool, fb, q, slots, _ = verify_setup(P, LENS, N, seed=P * 10 + topk)
    be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_draft_tokens=N, provider="emulator")
    be.init_forward_metadata(fb)
    out = be.forward(q, None, None, LAYER, fb)
    k_flat, v_flat = pool.get_flat_kv(0)
    _close(out, attention_over_slots(q, k_flat, v_flat, slots))


@pytest.mark.spec("TR-010")
@pytest.mark.parametrize("P", (1, 16))
def test_tree_verify_prefix_metadata_values(P):
    N = 4
    kv, _pool, fb, _, _, _ = verify_setup(P, LENS, N, seed=3)
    md = tm.verify_prefix_metadata(fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices, kv.req_to_token, N, P)
    assert md.cache_seqlens_int32.tolist() == LENS  # the committed KV only
    assert md.cu_seqlens_q.tolist() == [0, 4, 8, 12] and md.max_seq_len_q == 4
    assert md.page_table.shape == (3, math.ceil(130 / P))
    for b, r in enumerate(fb.req_pool_indices.tolist()):
        for p in range(LENS[b]):
            assert int(md.page_table[b, p // P]) * P + p % P == int(kv.req_to_token[r, p])


@pytest.mark.spec("TR-011")
def test_verify_expand_page_table_upstream_example():
    """The worked example of upstream's comment: mask row [1, 0, 1] over slots [8, 9, 10] -> [8, 10, 9]."""
    req_to_token = torch.zeros((2, 16), dtype=torch.int32)
    req_to_token[1, 5:8] = torch.tensor([8, 9, 10], dtype=torch.int32)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    table = tm.verify_expand_page_table(mask, req_to_token, torch.tensor([1]), torch.tensor([5]), 3)
    assert table.tolist() == [[8, 9, 10], [8, 9, 10], [8, 10, 9]]
    assert tm.verify_expand_seqlens(mask).tolist() == [1, 2, 2]


@pytest.mark.spec("TR-011")
def test_verify_mask_rows_reads_the_tree_columns_of_each_request():
    """Two requests, L = [2, 3], N = 2: rows [L | N] back to back; only the tree columns come out."""
    flat = torch.tensor([1, 1, 1, 0,   1, 1, 1, 1,          # request 0: L = 2, nodes 0, 1
                         1, 1, 1, 1, 0, 1, 1, 1, 0, 1],     # request 1: L = 3, node 1 sees only itself
                        dtype=torch.bool)
    rows = tm.verify_mask_rows(flat, torch.tensor([2, 3]), 2)
    assert rows.int().tolist() == [[1, 0], [1, 1], [1, 0], [0, 1]]


@pytest.mark.spec("TR-012")
def test_merge_state_textbook_float64():
    """Two key sets of sizes 2 and 3 with hand-made scores: the merged output is one softmax."""
    s = torch.tensor([0.3, -1.2, 2.0, 0.1, -0.4], dtype=torch.float64)
    v = torch.arange(5, dtype=torch.float64)[:, None] * torch.tensor([1.0, -2.0], dtype=torch.float64)
    w = torch.exp(s) / torch.exp(s).sum()
    want = (w[:, None] * v).sum(0)
    o1 = (torch.softmax(s[:2], 0)[:, None] * v[:2]).sum(0)
    o2 = (torch.softmax(s[2:], 0)[:, None] * v[2:]).sum(0)
    l1, l2 = torch.logsumexp(s[:2], 0), torch.logsumexp(s[2:], 0)
    o, lse = merge_state(o1[None, None], l1.reshape(1, 1), o2[None, None], l2.reshape(1, 1))
    torch.testing.assert_close(o[0, 0].double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[0, 0].double(), torch.logsumexp(s, 0), rtol=1e-6, atol=1e-6)


@pytest.mark.spec("TR-012")
@pytest.mark.parametrize("empty", [float("-inf"), float("inf")])
def test_merge_state_empty_side_has_weight_zero(empty):
    """An empty side's LSE is -inf (the emulator) or +inf (FlashAttention's empty-row convention):
    either way its weight is 0, as sgl-kernel's ``isinf(lse) ? -inf : lse``."""
    o2 = torch.randn(3, 2, 4)
    l2 = torch.randn(3, 2)
    o, lse = merge_state(torch.zeros(3, 2, 4), torch.full((3, 2), empty), o2, l2)
    assert torch.equal(o, o2) and torch.equal(lse, l2)


def test_page1_view_shares_storage_and_maps_slot_to_page():
    cache = torch.randn(5, 4, 2, 3)
    v = page1_view(cache)
    assert v.shape == (20, 1, 2, 3) and v.data_ptr() == cache.data_ptr()
    assert torch.equal(v[9, 0], cache[2, 1])


@pytest.mark.spec("TR-013", "TR-014", "TR-015", "TR-012")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("topk", TOPKS)
def test_tree_draft_decode_cascade_equals_prefix_plus_own_steps(P, topk):
    S = 4
    kv, pool, fb, rows, loc = draft_setup(P, LENS, topk, S, seed=P + topk)
    cache_loc = loc.view(-1, S)
    k_flat, v_flat = pool.get_flat_kv(0)
    gen = torch.Generator().manual_seed(7)
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_steps=S, speculative_step_id=s, provider="emulator")
        be.init_forward_metadata(fb)
        q = torch.randn((len(LENS) * topk, 4, 16), generator=gen)
        out = be.forward(q, None, None, LAYER, draft_step_batch(fb, s))
        slots = [kv.req_to_token[rows[i // topk], :LENS[i // topk]].tolist() + cache_loc[i, :s + 1].tolist()
                 for i in range(len(LENS) * topk)]
        _close(out, attention_over_slots(q, k_flat, v_flat, slots))


@pytest.mark.spec("TR-013", "TR-014", "TR-015")
def test_draft_metadata_worked_example_page_size_4():
    """L = 5, P = 4, k = 2, S = 3: lp = 1, prefix_base = 4, npp = ceil((1 + 3) / 4) = 1.

    Branch 0 continues the real last page (positions 4..7: tail 4, drafts 5, 6, 7); branch 1 owns
    positions 8..11 (tail copy 8, drafts 9, 10, 11).  Prefix K = 4; expand K = s + 2.
    """
    assert tree_kv.branch_geometry(5, 3, 4) == (4, 1, 1)
    assert tree_kv.branch_step_positions(5, 2, 3, 4).tolist() == [[5, 6, 7], [9, 10, 11]]
    kv, _pool, fb, rows, loc = draft_setup(4, [5], 2, 3, seed=0)
    r = rows[0]
    page_of = [int(kv.req_to_token[r, p]) // 4 for p in (4, 8)]
    src, tgt = tree_kv.tail_copy_slots(kv, rows, [5], 2, 3)
    assert src.tolist() == [int(kv.req_to_token[r, 4])] and tgt.tolist() == [int(kv.req_to_token[r, 8])]
    pre = tm.draft_prefix_metadata(fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices, kv.req_to_token, 2, 4)
    assert pre.cache_seqlens_int32.tolist() == [4] and pre.cu_seqlens_q.tolist() == [0, 2] and pre.max_seq_len_q == 2
    for s in range(2):
        ex = tm.draft_expand_metadata(loc, fb.seq_lens, s, 2, 3, 4)
        assert ex.cache_seqlens_int32.tolist() == [s + 2, s + 2]
        assert ex.page_table[:, 0].tolist() == page_of  # each branch's own first page
        assert ex.cu_seqlens_q.tolist() == [0, 1, 2] and ex.max_seq_len_q == 1


@pytest.mark.spec("TR-014")
def test_draft_expand_page_size_1_is_the_rows_own_step_slots():
    loc = torch.arange(100, 112)  # B = 1, k = 2, S = 6: rows [100..105], [106..111]
    ex = tm.draft_expand_metadata(loc, torch.tensor([9]), 2, 2, 6, 1)
    assert ex.page_table.tolist() == [[100, 101, 102], [106, 107, 108]]
    assert ex.cache_seqlens_int32.tolist() == [3, 3]


@pytest.mark.spec("TR-014")
def test_draft_set_expand_metadata_unique_consecutive_pages():
    """A row whose steps cross a page boundary lists both pages once, in order (#15469)."""
    cache_loc = torch.tensor([[29, 30, 31, 32], [37, 38, 39, 44]])  # P = 4: pages [7,7,7,8], [9,9,9,11]
    table = torch.zeros((2, 4), dtype=torch.int32)
    K = torch.zeros(2, dtype=torch.int32)
    tm.draft_decode_set_expand_metadata(K, table, torch.tensor([1], dtype=torch.int32), 4, cache_loc, 2, 4)
    assert table[:, :2].tolist() == [[7, 8], [9, 11]] and K.tolist() == [5, 5]


@pytest.mark.spec("TR-011")
def test_expand_audit_names_a_row_reading_outside_its_keys():
    kv, _pool, fb, _, _, _ = verify_setup(4, [6], 4, seed=1)
    md = tm.verify_expand_metadata(fb.custom_mask, fb.seq_lens, fb.req_pool_indices, kv.req_to_token, 4)
    allowed = [set(fb.out_cache_loc.tolist())] * 4
    tm.check_expand_reads_own_rows(md, allowed, 1)
    md.page_table[2, 0] = int(kv.req_to_token[fb.req_pool_indices[0], 0])  # a prefix slot, read twice
    with pytest.raises(Exception, match=r"\[TR-011\].*expand row 2"):
        tm.check_expand_reads_own_rows(md, allowed, 1)
