"""Cascade attention for top-k > 1: two FA3 calls and a log-sum-exp merge (SGLang's FA3 backend).

For every query row, the prefix call attends the committed KV and the expand call the row's own
tree keys; both run ``causal=False`` with ``return_softmax_lse=True`` and are merged with the
rule of ``sgl_kernel.merge_state_v2`` (TR-012)::

    m = max(l1, l2);  o = (o1 e^(l1 - m) + o2 e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m))

which equals one softmax over the union of the two (disjoint) key sets.  FA3 returns the LSE as
``[H, T]``; ``merge_state_v2`` takes ``[T, H]``, hence the ``lse.T.contiguous()`` upstream (refspec
passes the ``.T`` view: both merges below read it through its strides).

:func:`merge_state_torch` is the rule in torch; :func:`merge_state` runs it as one fused kernel
where the device allows (:mod:`refspec.fa3.merge_kernel`: a CUDA device with Triton), as upstream
runs one ``merge_state_v2`` kernel per layer.

TARGET_VERIFY's expand call reads the pool as page size 1 (``key_cache.view(-1, 1, Hkv, D)``,
sgl-project/sglang#7725) because its table holds token slots; draft decode's expand call reads
the paged pool (its table holds the branch's pages).  MLA (:func:`mla_cascade_attention`) makes
the same two calls with the ``qv`` call's arguments and the same view rule (ML-011).

Upstream: ``python/sglang/srt/layers/attention/flashattention_backend.py``,
``FlashAttentionBackend.forward_extend`` (``use_cascade_attn = is_target_verify and topk > 1``)
and ``forward_decode`` (``use_cascade_attn = spec_info is not None and topk > 1``).
"""

from __future__ import annotations

import torch

from refspec.fa3 import kernel, merge_kernel
from refspec.fa3.metadata import FlashAttentionMetadata
from refspec.fa3.mla import mla_kv_views, qv_call


def merge_state(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """TR-012, as the production path runs it: :func:`refspec.fa3.merge_kernel.merge_state_fused`
    (one kernel) on a CUDA device with Triton, else :func:`merge_state_torch`.  Same arguments and
    result (up to fp32 rounding of exp / log); the fused kernel also refuses wrong shapes or a non-fp32
    LSE with a ValueError naming the argument."""
    if merge_kernel.available(o1.device):
        return merge_kernel.merge_state_fused(o1, lse1, o2, lse2)
    return merge_state_torch(o1, lse1, o2, lse2)


def merge_state_torch(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """TR-012: ``merge_state_v2(v_a, s_a, v_b, s_b)`` in pure torch.

    Shapes: o1, o2 ``[T, H, D]``; lse1, lse2 ``[T, H]`` fp32 (natural log; note the layout:
    FA3's ``[H, T]`` transposed).  Returns ``(o [T, H, D] in o1.dtype, lse [T, H] fp32)``.
    Computed in fp32.  As the sgl-kernel op, an LSE of ``+inf`` or ``-inf`` counts as an empty
    side (``p_lse = isinf(p_lse) ? -inf : p_lse``: FlashAttention kernels may report an empty
    row as ``+inf``), which gets weight 0 -- e.g. a draft-decode prefix with ``L - lp = 0``.  Both
    sides empty is undefined (NaN), as upstream; the tree path never has an empty expand side.

    The rule of the fused kernel :func:`refspec.fa3.merge_kernel.merge_state_fused` (what a CUDA
    device runs; equal up to fp32 rounding, ``tests/test_triton_interpret.py``).
    """
    # an empty side (LSE +-inf) counts as -inf; a Python scalar, so no host tensor is copied (graph-safe)
    l1 = torch.where(torch.isinf(lse1.float()), float("-inf"), lse1.float())
    l2 = torch.where(torch.isinf(lse2.float()), float("-inf"), lse2.float())
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    den = w1 + w2
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / den[..., None]
    return o.to(o1.dtype), m + torch.log(den)


def page1_view(cache: torch.Tensor) -> torch.Tensor:
    """The pool ``[NP, P, Hkv, D]`` seen as ``[NP*P, 1, Hkv, D]``: page id == token slot (same storage)."""
    return cache.view(-1, 1, cache.shape[2], cache.shape[3])


def _kernel_call(q, k_cache, v_cache, md: FlashAttentionMetadata, layer, window, provider):
    return kernel.attention(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=md.cache_seqlens_int32,
                            page_table=md.page_table, cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q,
                            softmax_scale=layer.softmax_scale, causal=False, window_size=window,
                            softcap=layer.logit_cap, return_softmax_lse=True, provider=provider)


def cascade_attention(q, k_cache, v_cache, prefix: FlashAttentionMetadata, expand: FlashAttentionMetadata,
                      layer, *, expand_page1: bool, provider: str | None = None, window=(-1, -1)):
    """Prefix call + expand call + merge: ``q [T, H, D]`` -> ``[T, H, D]`` in q.dtype.

    ``k_cache, v_cache [NP, P, Hkv, D]``; ``expand_page1`` reads the expand part on
    :func:`page1_view` (TARGET_VERIFY) instead of the paged pool (draft decode).
    Raises: InvariantError PA-003 / PA-010 / PA-011 from the kernel's argument checks.
    """
    o, lse, *_ = _kernel_call(q, k_cache, v_cache, prefix, layer, window, provider)  # FA3 may return more
    ke, ve = (page1_view(k_cache), page1_view(v_cache)) if expand_page1 else (k_cache, v_cache)
    o_exp, lse_exp, *_ = _kernel_call(q, ke, ve, expand, layer, window, provider)
    out, _ = merge_state(o, lse.T, o_exp, lse_exp.T)
    return out


def mla_cascade_attention(q_nope, q_rope, pool, prefix: FlashAttentionMetadata, expand: FlashAttentionMetadata,
                          layer, *, expand_page1: bool, provider: str | None = None):
    """The MLA cascade (ML-011): prefix ``qv`` call + expand ``qv`` call + merge (TR-012).

    ``q_nope [T, H, Dv]`` (absorbed), ``q_rope [T, H, D - Dv]``; ``pool`` an MLA pool whose rows
    the two calls read through :func:`~refspec.fa3.mla.mla_kv_views` (ML-003), the expand
    call through the page-size-1 views when ``expand_page1`` (TARGET_VERIFY: its table holds token
    slots), else the paged ones (draft decode: its table holds pages).  Returns ``[T, H, Dv]``.
    Raises: InvariantError PA-003 / PA-010 / PA-011 / ML-005 from the kernel's argument checks.
    """
    views = mla_kv_views(pool, layer)
    o, lse, *_ = qv_call(q_nope, q_rope, *views, prefix, layer, causal=False, return_lse=True, provider=provider)
    if expand_page1:  # the table holds token slots: page id == slot (upstream's MLA branch passes the P-paged views)
        views = mla_kv_views(pool, layer, page_size=1)
    o_exp, lse_exp, *_ = qv_call(q_nope, q_rope, *views, expand, layer, causal=False, return_lse=True,
                                 provider=provider)
    out, _ = merge_state(o, lse.T, o_exp, lse_exp.T)
    return out
