"""The MLA KV pool: one latent row per slot, its store (slot 0 never written), its two strided views, its move.

ML-001 (the row), ML-002 (``set_mla_kv_buffer``), ML-003 (the views, DeepSeek's strides at every
page size), ML-012 (``move_kv_cache``).  Expected values are written out by hand or built with
plain indexing, never with the pool's own methods.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVPool, MLAKVPool, paged_view
from refspec.core.mla import DEEPSEEK_V3_DIMS
from refspec.speculative.tree import kv as tree_kv

PAGE_SIZES = (1, 4, 16, 64)
R, DR = DEEPSEEK_V3_DIMS.kv_lora_rank, DEEPSEEK_V3_DIMS.qk_rope_head_dim  # 512, 64


def deepseek_pool(P: int, num_pages: int = 3, layers: int = 2, fill: float = 0.0) -> MLAKVPool:
    return MLAKVPool(layers, num_pages, P, R, DR, fill=fill)


@pytest.mark.spec("ML-001")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_one_576_wide_row_per_slot_and_layer(P):
    pool = deepseek_pool(P, num_pages=3, layers=2)
    assert pool.kv_cache_dim == 576
    assert len(pool.kv_buffer) == 2
    for layer_id in range(2):
        row = pool.get_key_buffer(layer_id)
        assert tuple(row.shape) == (3 * P, 1, 576) and row.is_contiguous()
    assert pool.get_key_buffer(0).data_ptr() != pool.get_key_buffer(1).data_ptr()
    with pytest.raises(ValueError, match="layer_id 2 outside the pool's 2 layers"):
        pool.get_key_buffer(2)


@pytest.mark.spec("ML-002")
def test_store_writes_k_nope_then_k_rope_at_out_cache_loc_cast_to_the_pool_dtype():
    pool = MLAKVPool(1, 4, 4, 8, 4, dtype=torch.float16, fill=-1.0)
    loc = torch.tensor([5, 13, 6])
    k_nope = torch.arange(3 * 8, dtype=torch.float32).view(3, 1, 8) + 0.25
    k_rope = -torch.arange(3 * 4, dtype=torch.float32).view(3, 1, 4)
    pool.set_mla_kv_buffer(0, loc, k_nope, k_rope)
    row = pool.get_key_buffer(0)
    assert row.dtype == torch.float16
    for i, s in enumerate([5, 13, 6]):
        assert row[s, 0, :8].tolist() == (k_nope[i, 0].half()).tolist()
        assert row[s, 0, 8:].tolist() == (k_rope[i, 0].half()).tolist()
    untouched = [s for s in range(16) if s not in (5, 13, 6)]
    assert bool((row[untouched] == -1).all())


@pytest.mark.spec("ML-002")
def test_store_never_writes_slot_0():
    """Padded graph rows carry out_cache_loc 0: their rows must not reach slot 0 (sglang#36003); the
    other tokens of the same call are stored."""
    pool = MLAKVPool(1, 3, 4, 8, 4, fill=7.0)
    loc = torch.tensor([0, 9, 0])
    pool.set_mla_kv_buffer(0, loc, torch.full((3, 1, 8), 2.0), torch.full((3, 1, 4), 3.0))
    row = pool.get_key_buffer(0)
    assert row[0].tolist() == [[7.0] * 12]  # slot 0 keeps its bytes
    assert row[9, 0].tolist() == [2.0] * 8 + [3.0] * 4


@pytest.mark.spec("ML-002")
def test_the_mha_pool_writes_slot_0_the_mla_pool_does_not():
    """Negative control: the MHA pool's store (CG-005: padded rows write the dummy page) writes slot
    0, so a check "slot 0 unchanged" can fail; the MLA store keeps it."""
    mha = KVPool(1, 2, 4, 1, 4, fill=7.0)
    mha.set_kv_buffer(0, torch.tensor([0]), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    assert mha.get_flat_kv(0)[0][0].tolist() == [[0.0] * 4]
    mla = MLAKVPool(1, 2, 4, 2, 2, fill=7.0)
    mla.set_mla_kv_buffer(0, torch.tensor([0]), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    assert mla.get_key_buffer(0)[0].tolist() == [[7.0] * 4]


@pytest.mark.spec("ML-002")
@pytest.mark.parametrize("k_nope_shape,k_rope_shape", [((3, 1, 7), (3, 1, 4)), ((3, 2, 8), (3, 2, 4)),
                                                       ((3, 1, 8), (2, 1, 4)), ((1, 1, 8), (1, 1, 4))])
def test_store_refuses_rows_that_do_not_match_the_pool(k_nope_shape, k_rope_shape):
    pool = MLAKVPool(1, 3, 4, 8, 4)
    with pytest.raises(InvariantError, match=r"\[ML-002\].*kv_lora_rank = 8"):
        pool.set_mla_kv_buffer(0, torch.tensor([4, 5, 6]), torch.zeros(k_nope_shape), torch.zeros(k_rope_shape))


@pytest.mark.spec("ML-003")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_views_split_at_v_head_dim_with_deepseeks_strides(P):
    """DeepSeek-V3: k_rope [NP, P, 1, 64] and c_kv [NP, P, 1, 512], both strides (576 P, 576, 576, 1):
    views of the one row, neither contiguous (the kernel reads them through their strides)."""
    pool = deepseek_pool(P, num_pages=3)
    k_rope, c_kv = pool.paged_views(0, v_head_dim=512)
    assert tuple(k_rope.shape) == (3, P, 1, 64) and tuple(c_kv.shape) == (3, P, 1, 512)
    assert k_rope.stride() == c_kv.stride() == (576 * P, 576, 576, 1)
    assert not k_rope.is_contiguous() and not c_kv.is_contiguous()
    row = pool.get_key_buffer(0)
    assert c_kv.data_ptr() == row.data_ptr() and k_rope.data_ptr() == row.data_ptr() + 512 * row.element_size()
    row[2 * P - 1, 0] = torch.arange(576, dtype=row.dtype)  # slot 2P - 1: page 1, offset P - 1
    assert c_kv[1, P - 1, 0].tolist() == list(range(512))
    assert k_rope[1, P - 1, 0].tolist() == list(range(512, 576))


@pytest.mark.spec("ML-003")
def test_views_split_at_the_layers_v_head_dim_not_at_kv_lora_rank():
    """Upstream splits at layer.v_head_dim; a layer that says 500 gets a 500 / 76 split of the row."""
    pool = deepseek_pool(4)
    k_rope, c_kv = pool.paged_views(0, v_head_dim=500)
    assert k_rope.shape[-1] == 76 and c_kv.shape[-1] == 500
    for bad in (0, 576, 600, 512.0):
        with pytest.raises(InvariantError, match=r"\[ML-003\]"):
            pool.paged_views(0, v_head_dim=bad)


@pytest.mark.spec("ML-003")
def test_page_size_1_views_keep_the_slot_stride():
    """The verify expand call's page-size-1 views (ML-011): [slots, 1, 1, d] with stride 576 on dim 1
    (a .view would give the size-1 page dim the row stride, upstream's paged_view note)."""
    pool = deepseek_pool(4, num_pages=2)
    k_rope, c_kv = pool.paged_views(0, v_head_dim=512, page_size=1)
    assert tuple(c_kv.shape) == (8, 1, 1, 512) and c_kv.stride() == (576, 576, 576, 1)
    with pytest.raises(ValueError, match="not a whole number of pages of 3"):
        paged_view(pool.get_key_buffer(0), 3)


@pytest.mark.spec("ML-012")
def test_move_kv_cache_moves_whole_rows_in_every_layer_overlap_safe():
    pool = MLAKVPool(2, 3, 4, 6, 2)
    for layer_id in range(2):
        pool.get_key_buffer(layer_id).copy_(torch.arange(12 * 8, dtype=torch.float32).view(12, 1, 8) + 1000 * layer_id)
    before = [pool.get_key_buffer(i).clone() for i in range(2)]
    tgt, src = torch.tensor([5, 6, 7]), torch.tensor([6, 7, 9])  # overlapping: 6 and 7 are both source and target
    tree_kv.move_kv_cache(pool, tgt, src)  # the tree path's entry point dispatches to the pool's rule
    for layer_id in range(2):
        row = pool.get_key_buffer(layer_id)
        want = before[layer_id].clone()
        want[5], want[6], want[7] = before[layer_id][6], before[layer_id][7], before[layer_id][9]
        assert torch.equal(row, want)


@pytest.mark.spec("ML-012")
def test_mha_pool_move_kv_cache_is_the_same_rule_for_k_and_v():
    pool = KVPool(1, 3, 4, 1, 2)
    fk, fv = pool.get_flat_kv(0)
    fk.copy_(torch.arange(24, dtype=torch.float32).view(12, 1, 2))
    fv.copy_(-fk)
    pool.move_kv_cache(torch.tensor([1, 2]), torch.tensor([2, 11]))
    assert fk[1].tolist() == [[4.0, 5.0]] and fk[2].tolist() == [[22.0, 23.0]] and fv[2].tolist() == [[-22.0, -23.0]]
