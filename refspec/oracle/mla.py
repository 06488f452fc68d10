"""The MLA oracle: multi-head latent attention by slot, in both of DeepSeek's forms (ML-008).

Keys come from the pool's latent rows ``[c | k_pe]`` (ML-001), gathered *by slot* through
``req_to_token`` exactly as the MHA oracle gathers K / V (:func:`refspec.oracle.attention.attention_by_position`:
the row at position t sees its request's keys 0..t).  One function, one flag, as DeepSeek-V3's own
``MLA`` module holds both forms side by side (``attn_impl = "naive" | "absorb"``):

* ``absorb=False``, **non-absorbed**: every slot's latent is expanded to per-head keys and values,
  ``k_h = [W_UK[h] c | k_pe]`` (Dn + Dr wide) and ``v_h = W_UV[h] c`` (Dv wide), then ordinary
  multi-head attention with ``q_h = [q_nope_h | q_pe_h]``;
* ``absorb=True``, **absorbed**: the query absorbs ``W_UK``, ``q_h = [W_UK[h]^T q_nope_h | q_pe_h]``
  (R + Dr wide), attends the latent rows themselves (one KV head, value ``c``, R wide), and the
  output is brought back with ``W_UV``: ``out_h = W_UV[h] o_h``.

Both give the same result (up to fp32 rounding), since ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``
and ``sum_j p_j W_UV c_j = W_UV sum_j p_j c_j``: that equality is ML-008, and it is why the 576-wide
latent row is all an MLA model needs to cache.

Weights use SGLang's names and layouts, ``w_kc [H, Dn, R]`` (W_UK) and ``w_vc [H, R, Dv]`` (W_UV
transposed), with the helpers of :mod:`refspec.core.mla` (``split_kv_b_proj``, ``absorb_q``,
``latent_to_v``, ``expand_latent``): the weight layout, which a model needs as much as the oracle.
"""

from __future__ import annotations

import torch

from refspec.core.invariants import require
from refspec.core.mla import absorb_q, expand_latent, latent_to_v
from refspec.oracle.attention import attention_by_position


def absorbed_attention(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, rows_flat: torch.Tensor,
                       v_head_dim: int, req_to_token, req_pool_indices, cu_seqlens_q, positions, *,
                       softmax_scale: float, softcap: float = 0.0, upcast: bool = True, out_dtype=None):
    """The absorbed core (what an MLA backend returns, before ``W_UV``): MQA over the latent rows.

    Shapes: ``q_nope_absorbed [T, H, Dv]`` (Dv = ``v_head_dim``, R for DeepSeek), ``q_rope
    [T, H, D - Dv]``, ``rows_flat [S, 1, D]`` (the pool's rows, ``D = R + Dr``), the rest as
    :func:`~refspec.oracle.attention.attention_by_position`.  Returns ``[T, H, Dv]``:
    ``softmax_j(scale * [q_nope_absorbed | q_rope] . row_j) . row_j[:Dv]``, the scores over the
    whole row (``q_nope_absorbed . c + q_rope . k_pe``), the value its first Dv columns.
    Raises: InvariantError ML-005 if ``q_nope_absorbed`` / ``q_rope`` do not split the row at Dv.
    """
    D = rows_flat.shape[-1]
    require(q_nope_absorbed.dim() == 3 and q_rope.shape[:2] == q_nope_absorbed.shape[:2]
            and q_nope_absorbed.shape[-1] == v_head_dim and q_rope.shape[-1] == D - v_head_dim, "ML-005",
            lambda: f"q {tuple(q_nope_absorbed.shape)} and q_rope {tuple(q_rope.shape)} must be [T, H, {v_head_dim}] "
            f"and [T, H, {D - v_head_dim}]: the {D}-wide row split at v_head_dim = {v_head_dim}")
    q = torch.cat([q_nope_absorbed, q_rope], dim=-1)
    return attention_by_position(q, rows_flat, rows_flat[..., :v_head_dim], req_to_token, req_pool_indices,
                                 cu_seqlens_q, positions, softmax_scale=softmax_scale, softcap=softcap,
                                 upcast=upcast, out_dtype=out_dtype)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, rows_flat: torch.Tensor, w_kc: torch.Tensor,
                  w_vc: torch.Tensor, req_to_token, req_pool_indices, cu_seqlens_q, positions, *,
                  softmax_scale: float, absorb: bool, upcast: bool = True, out_dtype=None) -> torch.Tensor:
    """MLA for a batch of requests over the latent pool, keys by slot: ``[T, H, Dv]`` (module doc).

    Shapes: ``q_nope [T, H, Dn]``, ``q_pe [T, H, Dr]`` (RoPE applied); ``rows_flat [S, 1, R + Dr]``
    (:meth:`~refspec.core.kv_cache.MLAKVPool.get_key_buffer`); ``w_kc [H, Dn, R]``, ``w_vc [H, R, Dv]``
    (:func:`~refspec.core.mla.split_kv_b_proj`); ``req_to_token`` / ``req_pool_indices`` / ``cu_seqlens_q`` /
    ``positions`` as :func:`~refspec.oracle.attention.attention_by_position` (row at position t
    sees its request's keys 0..t).  ``softmax_scale``: ML-007's, the same in both forms.
    ``absorb``: False the non-absorbed form, True the absorbed one.  ``upcast``: compute in fp32.
    Returns ``[T, H, Dv]`` in ``out_dtype`` (default ``q_nope.dtype``).
    Raises: InvariantError PA-011 / ML-005 on inconsistent shapes.
    """
    R = w_kc.shape[-1]
    cdt = torch.float32 if upcast else q_nope.dtype
    require(rows_flat.dim() == 3 and rows_flat.shape[1] == 1 and rows_flat.shape[2] == R + q_pe.shape[-1], "PA-011",
            lambda: f"rows_flat {tuple(rows_flat.shape)} must be [S, 1, R + Dr] = [S, 1, {R} + {q_pe.shape[-1]}]")
    args = (req_to_token, req_pool_indices, cu_seqlens_q, positions)
    if absorb:
        o = absorbed_attention(absorb_q(q_nope.to(cdt), w_kc), q_pe.to(cdt), rows_flat.to(cdt), R, *args,
                               softmax_scale=softmax_scale, upcast=upcast, out_dtype=cdt)
        return latent_to_v(o, w_vc).to(out_dtype or q_nope.dtype)
    rows = rows_flat[:, 0].to(cdt)
    k, v = expand_latent(rows[:, :R], rows[:, R:], w_kc, w_vc)
    return attention_by_position(torch.cat([q_nope, q_pe], dim=-1).to(cdt), k, v, *args, softmax_scale=softmax_scale,
                                 upcast=upcast, out_dtype=out_dtype or q_nope.dtype)
