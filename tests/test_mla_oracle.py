"""The MLA oracle in both forms, the absorption identity, the scale, the path choice.

ML-008: non-absorbed MLA (per-head keys and values expanded from the latent) equals absorbed MLA
(the query absorbs W_UK, attention over the latent rows, then W_UV) in fp32, for page sizes 1, 4,
16, 64, tiny dims and DeepSeek's, and a plain per-request reference written with explicit loops
agrees with both.  ML-007: the scale's formula and numbers.  ML-009: the handler's path choice.
"""

from __future__ import annotations

import math

import pytest
import torch

from refspec.core import batch as B
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, MLAKVPool
from refspec.core.mla import (CHUNKED_PREFIX_CACHE_THRESHOLD, DEEPSEEK_V3_DIMS, DEEPSEEK_V3_ROPE_SCALING,
                              MAX_KV_CHUNK_CAPACITY, AttnForwardMethod, MLADims, absorb_q, latent_to_v,
                              mla_attention_layers, mla_forward_method, mla_softmax_scale, split_kv_b_proj,
                              yarn_get_mscale)
from refspec.core.modes import ForwardMode
from refspec.core.tolerance import assert_t1
from refspec.harness.mla_scenario import TINY_DIMS, MLAScenario
from refspec.oracle.mla import mla_attention

PAGE_SIZES = (1, 4, 16, 64)


def latent_batch(P: int, dims: MLADims, H: int, lens=(5, 19, 40), seed: int = 0):
    """A decode-like batch of requests whose keys are latent rows at scattered slots, and random
    weights: ``(pool rows [S, 1, R + Dr], req_to_token, rows, cu, positions, q_nope, q_pe, w_kc, w_vc)``."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-L // P) for L in lens) + 2
    kv = KVCache(len(lens) + 1, max(lens), num_pages, P, seed=seed)
    pool = MLAKVPool(1, num_pages, P, dims.kv_lora_rank, dims.qk_rope_head_dim, fill=float("nan"))
    rows = [kv.alloc_req() for _ in lens]
    kv.alloc_extend(rows, [0] * len(lens), list(lens))
    for r, L in zip(rows, lens):
        pool.get_key_buffer(0)[kv.req_to_token[r, :L].long()] = torch.randn(L, 1, dims.kv_cache_dim, generator=g)
    # three query rows per request at its last three positions
    positions = [p for L in lens for p in range(L - 3, L)]
    cu = [0, 3, 6, 9]
    T = len(positions)
    R = dims.kv_lora_rank
    kv_b = torch.randn(H * (dims.qk_nope_head_dim + dims.v_head_dim), R, generator=g) / R ** 0.5
    w_kc, w_vc = split_kv_b_proj(kv_b, H, dims.qk_nope_head_dim)
    q_nope = torch.randn(T, H, dims.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(T, H, dims.qk_rope_head_dim, generator=g)
    return pool.get_key_buffer(0), kv.req_to_token, rows, cu, positions, q_nope, q_pe, w_kc, w_vc, kv_b


def explicit_mla(rows_flat, req_to_token, rows, cu, positions, q_nope, q_pe, kv_b, H, dims, scale):
    """The textbook non-absorbed MLA, one request, head and query at a time (the test's own loops)."""
    R, Dn = dims.kv_lora_rank, dims.qk_nope_head_dim
    w = kv_b.view(H, Dn + dims.v_head_dim, R)
    out = torch.zeros(len(positions), H, dims.v_head_dim)
    for b, r in enumerate(rows):
        for i in range(cu[b], cu[b + 1]):
            slots = req_to_token[r, :positions[i] + 1].long()
            c, k_pe = rows_flat[slots, 0, :R], rows_flat[slots, 0, R:]
            for h in range(H):
                k = torch.cat([c @ w[h, :Dn].T, k_pe], dim=-1)  # [n, Dn + Dr]
                v = c @ w[h, Dn:].T  # [n, Dv]
                p = torch.softmax(scale * (k @ torch.cat([q_nope[i, h], q_pe[i, h]])), dim=0)
                out[i, h] = p @ v
    return out


@pytest.mark.spec("ML-008")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("dims", [TINY_DIMS, DEEPSEEK_V3_DIMS], ids=["tiny", "deepseek"])
def test_absorbed_equals_non_absorbed_by_slot(P, dims):
    H = 4
    rows_flat, rtt, rows, cu, pos, q_nope, q_pe, w_kc, w_vc, kv_b = latent_batch(P, dims, H, seed=P)
    scale = mla_softmax_scale(dims)
    args = (rows_flat, w_kc, w_vc, rtt, rows, cu, pos)
    naive = mla_attention(q_nope, q_pe, *args, softmax_scale=scale, absorb=False)
    absorbed = mla_attention(q_nope, q_pe, *args, softmax_scale=scale, absorb=True)
    assert not torch.isnan(naive).any() and naive.shape == (9, H, dims.v_head_dim)
    assert_t1(absorbed, naive, what=f"absorbed vs non-absorbed P={P}")
    if dims is TINY_DIMS:  # the explicit loops are slow at DeepSeek's width
        assert_t1(naive, explicit_mla(rows_flat, rtt, rows, cu, pos, q_nope, q_pe, kv_b, H, dims, scale),
                  what="non-absorbed vs the explicit loops")


@pytest.mark.spec("ML-008")
def test_a_wrong_absorption_breaks_the_identity():
    """Negative control: each head absorbing another head's W_UK is far from the non-absorbed
    truth, so the identity test can fail."""
    H, dims = 4, TINY_DIMS
    rows_flat, rtt, rows, cu, pos, q_nope, q_pe, w_kc, w_vc, _ = latent_batch(4, dims, H, seed=3)
    scale = mla_softmax_scale(dims)
    naive = mla_attention(q_nope, q_pe, rows_flat, w_kc, w_vc, rtt, rows, cu, pos, softmax_scale=scale, absorb=False)
    wrong_kc = w_kc.flip(0)  # each head absorbs another head's W_UK
    bad = mla_attention(q_nope, q_pe, rows_flat, wrong_kc, w_vc, rtt, rows, cu, pos, softmax_scale=scale,
                        absorb=True)
    assert float((bad - naive).abs().max()) > 1e-2


@pytest.mark.spec("ML-008")
def test_absorb_and_unabsorb_are_upstreams_bmm_layouts():
    """``q_nope_out = bmm(q_nope^T, w_kc)`` and ``out = bmm(o^T, w_vc)`` as forward_mla.py writes them."""
    g = torch.Generator().manual_seed(0)
    w_kc, w_vc = torch.randn(3, 5, 7, generator=g), torch.randn(3, 7, 2, generator=g)
    q, o = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 7, generator=g)
    torch.testing.assert_close(absorb_q(q, w_kc), torch.bmm(q.transpose(0, 1), w_kc).transpose(0, 1))
    torch.testing.assert_close(latent_to_v(o, w_vc), torch.bmm(o.transpose(0, 1), w_vc).transpose(0, 1))
    kc, vc = split_kv_b_proj(torch.arange(3 * 9 * 7.0).view(27, 7), 3, 5)
    assert kc.shape == (3, 5, 7) and vc.shape == (3, 7, 4)
    assert kc[1, 0, 0] == 9 * 7 and vc[2, 0, 0] == (18 + 5) * 7  # head 1's first W_UK row; head 2's first W_UV row


# ---------------------------------------------------------------- the scale
@pytest.mark.spec("ML-007")
def test_mla_scale_values():
    assert yarn_get_mscale(1.0, 1.0) == 1.0 and yarn_get_mscale(0.5, 1.0) == 1.0
    assert math.isclose(yarn_get_mscale(40, 1.0), 0.1 * math.log(40) + 1)
    assert math.isclose(mla_softmax_scale(DEEPSEEK_V3_DIMS), 192 ** -0.5)
    s = mla_softmax_scale(DEEPSEEK_V3_DIMS, DEEPSEEK_V3_ROPE_SCALING)
    assert math.isclose(s, 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2) and round(s, 4) == 0.1352
    assert abs(s - 576 ** -0.5) > 0.09  # not FA3's qv default
    for off in ({"type": "default", "factor": 40}, {"factor": 40, "apply_yarn_scaling": False},
                {"factor": 40, "mscale_all_dim": 1, "apply_scale": False}):
        assert mla_softmax_scale(DEEPSEEK_V3_DIMS, off) == 192 ** -0.5
    assert mla_softmax_scale(DEEPSEEK_V3_DIMS, {"factor": 40}) == 192 ** -0.5  # mscale_all_dim 0 -> mscale 1


@pytest.mark.spec("ML-007")
def test_both_mla_layers_carry_the_one_scale():
    absorbed, mha = mla_attention_layers(3, 16, DEEPSEEK_V3_DIMS, 0.1352)
    assert (absorbed.num_kv_heads, absorbed.head_dim, absorbed.v_head_dim) == (1, 576, 512)
    assert (mha.num_kv_heads, mha.head_dim, mha.v_head_dim) == (16, 192, 128)
    assert absorbed.softmax_scale == mha.softmax_scale == 0.1352 and absorbed.layer_id == mha.layer_id == 3


@pytest.mark.spec("ML-007")
@pytest.mark.parametrize("wing", ["oracle", "fa3"])
def test_an_mla_layer_without_its_scale_is_refused(wing):
    """The default head_dim^-0.5 of a 576-wide layer is FA3's qv default, not MLA's: both wings refuse it."""
    import dataclasses
    built = MLAScenario(ForwardMode.DECODE, 4, [5, 9]).build()
    built.layer = dataclasses.replace(built.layer, scaling=None)
    with pytest.raises(InvariantError, match=r"\[ML-007\].*no scaling"):
        built.run_oracle() if wing == "oracle" else built.run_fa3()


# ---------------------------------------------------------------- the path choice
def extend(prefix, ext):
    kv = KVCache(len(prefix) + 1, max(p + e for p, e in zip(prefix, ext)) + 1, 64, 4)
    rows = [kv.alloc_req() for _ in prefix]
    kv.alloc_extend(rows, [0] * len(prefix), list(prefix))
    return B.extend_batch(kv, rows, list(prefix), list(ext))


@pytest.mark.spec("ML-009")
def test_path_choice_plain_prefill_without_prefix_is_mha():
    assert mla_forward_method(extend([0, 0], [5, 3])) is AttnForwardMethod.MHA_ONE_SHOT
    assert mla_forward_method(extend([0, 4], [5, 3])) is AttnForwardMethod.MLA  # 0 < prefix < 8192
    assert mla_forward_method(extend([0, 0], [5, 3]), deterministic=True) is AttnForwardMethod.MLA


@pytest.mark.spec("ML-009")
def test_path_choice_long_prefix_and_capacity():
    fb = extend([0], [1]).replace(seq_lens_cpu=torch.tensor([CHUNKED_PREFIX_CACHE_THRESHOLD + 1]),
                                  extend_seq_lens_cpu=[1])  # prefix = the threshold
    assert mla_forward_method(fb) is AttnForwardMethod.MHA_ONE_SHOT
    assert mla_forward_method(fb, disable_chunked_prefix_cache=True) is AttnForwardMethod.MLA
    big = fb.replace(seq_lens_cpu=torch.tensor([MAX_KV_CHUNK_CAPACITY + 1]), extend_seq_lens_cpu=[1])
    assert mla_forward_method(big) is AttnForwardMethod.MHA_CHUNKED_KV
    short = fb.replace(seq_lens_cpu=torch.tensor([CHUNKED_PREFIX_CACHE_THRESHOLD]), extend_seq_lens_cpu=[1])
    assert mla_forward_method(short) is AttnForwardMethod.MLA  # prefix 8191 < 8192


@pytest.mark.spec("ML-009")
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                                  ForwardMode.DRAFT_EXTEND_V2, ForwardMode.IDLE])
def test_path_choice_every_other_mode_is_absorbed(mode):
    built = MLAScenario(mode, 4, [] if mode.is_idle() else [5, 9],
                        num_accept_tokens=[2, 1] if mode.is_draft_extend(include_v2=True) else None).build()
    assert mla_forward_method(built.fb) is AttnForwardMethod.MLA
