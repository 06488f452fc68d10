"""Named wrong variants of the MLA path (docs/mla.md), as *replacement functions* for its seams.

The same shape as :mod:`refspec.mutants.variants` and :mod:`refspec.mutants.tree_variants`: each
:class:`~refspec.mutants.variant.Variant` names one production function (a seam: one rule each)
and a small wrong replacement, applied from outside by :func:`~refspec.mutants.replace.replaced`;
production code has no switch for them.  The seams and the rules they hold:

* :func:`refspec.fa3.mla.mla_kv_views`: the two kernel operands, split at the layer's
  ``v_head_dim`` (ML-003);
* :func:`refspec.core.kv_cache.paged_view`: a paged view that keeps the row's own strides (ML-003);
* :func:`refspec.fa3.mla.qv_call`: the absorbed ``qv`` call with the layer's scale (ML-005, ML-007);
* :func:`refspec.core.kv_cache.store_rows_keep_slot_0`: the store that never writes slot 0 (ML-002).

Their probes (:mod:`refspec.mutants.mla_probes`) record every kernel call of the MLA branch and
check it against the rules as written, compare the output with the oracle, and check the pool
after the store.  :data:`MLA_VARIANTS` joins :data:`refspec.mutants.variants.VARIANTS`.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.core import kv_cache
from refspec.fa3 import kernel
from refspec.fa3 import mla as fa3_mla
from refspec.mutants.variant import Variant

SG = "https://github.com/sgl-project/sglang/pull/"
FA3 = "https://github.com/Dao-AILab/flash-attention/blob/fa4-v4.0.0.beta27/hopper/"


# ---- the replacements (each has its seam's signature) ----
def split_at_kv_lora_rank(pool, layer, page_size=None):
    """mla-split-at-kv-lora-rank: the views split at the pool's ``kv_lora_rank``, not the layer's ``v_head_dim``."""
    return pool.paged_views(layer.layer_id, pool.kv_lora_rank, page_size)


def paged_view_as_if_contiguous(flat: torch.Tensor, page_size: int) -> torch.Tensor:
    """mla-views-as-contiguous: the paged view's strides computed from its shape, as if ``flat``
    were a contiguous tensor of its own (right for the MHA pools, wrong for a slice of the MLA row)."""
    S = flat.shape[0]
    if S % page_size:
        raise ValueError(f"paged_view: {S} slots are not a whole number of pages of {page_size}")
    shape = (S // page_size, page_size, *flat.shape[1:])
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return flat.as_strided(shape, strides)  # same first element (storage offset), other strides


def qv_call_default_scale(q_nope, q_rope, k_rope_cache, c_kv_cache, md, layer, *, causal, return_lse, provider,
                          window=(-1, -1)):
    """mla-scale-fa3-default: the absorbed call without ``softmax_scale``: FA3's default with qv,
    ``(D + Dv)^-0.5`` (576^-0.5 for DeepSeek), not the layer's ``(Dn + Dr)^-0.5 * mscale^2``."""
    return kernel.attention(q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q_nope,
                            cache_seqlens=md.cache_seqlens_int32, page_table=md.page_table,
                            cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q,
                            softmax_scale=None, causal=causal, window_size=window,
                            softcap=layer.logit_cap, return_softmax_lse=return_lse, provider=provider)


def qv_call_without_qv(q_nope, q_rope, k_rope_cache, c_kv_cache, md, layer, *, causal, return_lse, provider,
                       window=(-1, -1)):
    """mla-qv-dropped: the absorbed call without ``qv``: scores from the RoPE half of the key alone."""
    return kernel.attention(q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache,
                            cache_seqlens=md.cache_seqlens_int32, page_table=md.page_table,
                            cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q,
                            softmax_scale=layer.softmax_scale, causal=causal, window_size=window,
                            softcap=layer.logit_cap, return_softmax_lse=return_lse, provider=provider)


def store_every_row(buf: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """mla-store-writes-slot-0: every token's row is stored, a padded row's too (at slot 0)."""
    buf[loc] = rows


MLA_VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("mla-split-at-kv-lora-rank", fa3_mla.mla_kv_views, split_at_kv_lora_rank,
            "the kernel's two views split the row at the pool's kv_lora_rank, not at the layer's v_head_dim",
            "docs/spec/mla.md#ml-003 (SGLang splits at layer.v_head_dim: kv_cache[:, :, :layer.v_head_dim], "
            "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/"
            "flashattention_backend.py#L1944); a near miss, the two agree for every DeepSeek layer",
            "right for every DeepSeek config (kv_lora_rank = v_head_dim = 512), so no DeepSeek run shows it; "
            "where they differ (the probe's layer reads a 512 / 64 split of a 576-wide row that the pool "
            "declares as 500 + 76) the views no longer match q and qv and the call is refused (the "
            "emulator names ML-005; FA3's host shape checks raise too): a crash where upstream runs",
            ("ML-003", "ML-005")),
    Variant("mla-scale-fa3-default", fa3_mla.qv_call, qv_call_default_scale,
            "the absorbed qv call passes no softmax_scale: FA3's default (D + Dv)^-0.5 = 576^-0.5 instead "
            "of the layer's (Dn + Dr)^-0.5 * mscale^2",
            f"docs/spec/mla.md#ml-007; {FA3}flash_attn_interface.py#L1062 (softmax_scale None: "
            "(head dim + v head dim)^-0.5 with qv)",
            "every score 3.2x too small for DeepSeek-V3 (0.0417 vs 0.1352): the softmax is flattened, "
            "outputs are finite and wrong, no error",
            ("ML-007", "TOL-002")),
    Variant("mla-views-as-contiguous", kv_cache.paged_view, paged_view_as_if_contiguous,
            "the paged views get strides computed from their shape (as if contiguous), not the row's "
            "(576 P, 576, 576, 1)",
            "docs/spec/mla.md#ml-003 (neither view is contiguous; SGLang's paged_view keeps the slot "
            "stride, https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/"
            "layout/paged_view.py#L11)",
            "slot s of c_kv is read at element 512 s instead of 576 s (k_rope likewise, from element "
            "512): other slots' latents, RoPE keys and poison; no error (a custom kernel that ignores "
            "strides does the same)",
            ("ML-003", "TOL-002")),
    Variant("mla-qv-dropped", fa3_mla.qv_call, qv_call_without_qv,
            "the absorbed call is made without qv (what a build without the hdim 64 / 512 kernel computes: "
            "its 64 x 64 kernel has no qv path)",
            "docs/mla.md#the-gpu-build (tokenspeed-fa3 is built with FLASH_ATTENTION_DISABLE_HDIMDIFF64; "
            "ML-013 refuses it); docs/spec/mla.md#ml-005",
            "the scores lose q_nope_absorbed . c_kv, the 512-wide half of q . k: every row attends by its "
            "RoPE half alone; finite, wrong, no error",
            ("ML-005", "TOL-002")),
    Variant("mla-store-writes-slot-0", kv_cache.store_rows_keep_slot_0, store_every_row,
            "the MLA store writes every token's row, a padded graph row's (out_cache_loc 0) into slot 0 too",
            f"{SG}36003, {SG}36207 (v0.5.12.post1's set_mla_kv_buffer_triton has no reserved_skip_index; "
            "GLM-5.2 + MTP read NaN from slot 0)",
            "CUDA-graph padding overwrites the padding slot with undefined rows; real rows of this batch are "
            "unchanged, any later read of slot 0 (a padded row, an idle request) sees them",
            ("ML-002",)),
]}
