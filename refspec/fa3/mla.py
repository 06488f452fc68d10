"""The MLA branches of SGLang's FA3 backend: store the latent row, then one ``qv`` call (or a cascade).

An FA3 backend whose pool is an :class:`~refspec.core.kv_cache.MLAKVPool` (SGLang: ``use_mla``)
keeps every metadata rule of the MHA path (ML-004: ``init_forward_metadata``, the graph hooks, the
multi-step draft backend and the top-k > 1 expand metadata never look at MLA) and changes only its
``forward``, which SGLang's ``RadixAttention`` calls as
``forward(q, k, v, layer, fb, q_rope=, k_rope=)``:

* **absorbed** (every mode but the prefix-free prefill, ML-009): ``q`` is the absorbed ``q_nope``
  ``[T, H, R]``, ``k`` the latent ``[T, 1, R]`` (``v`` is ``k`` again and unused), ``q_rope``
  ``[T, H, Dr]``, ``k_rope`` ``[T, 1, Dr]``.  Store ``[k | k_rope]`` at ``out_cache_loc``
  (ML-002, slot 0 never written), split the pool's rows at the layer's ``v_head_dim`` into the two
  strided paged views (ML-003), and call::

      flash_attn_with_kvcache(q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q,
                              page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q,
                              softmax_scale=layer.scaling, causal=True)      # -> [T, H, R]

  (ML-005, the scale explicit, ML-007).  Top-k > 1 (the tree backend) makes the same call on the
  prefix metadata and on the expand metadata, ``causal=False`` with the LSE, and merges them
  (TR-012); the verify expand reads the page-size-1 views, its table holding token slots (ML-011).
* **non-absorbed** (``fb.attn_attend_prefix_cache is False``: the prefix-free prefill the model
  chose, ML-009 / ML-010): the model has already written the latent rows and expanded every key;
  ``q [T, H, Dn + Dr]``, ``k [sum K, H, Dn + Dr]``, ``v [sum K, H, Dv]`` go to
  ``flash_attn_varlen_func`` with the metadata's ``cu_seqlens_q`` / ``cu_seqlens_k``,
  ``causal=True``; nothing is stored.

The output is ``[T, H, v_head_dim]`` (refspec's backends return 3-D; SGLang flattens it to
``[T, H * v_head_dim]``).  On a real FA3 build the constructor refuses MLA unless the build has the
hdim 64 / 512 kernel (ML-013).

Upstream: ``FlashAttentionBackend.forward_extend`` (the MLA branch from
`L1873 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L1873>`_)
and ``forward_decode``
(`L2348 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L2348>`_),
v0.5.23.
"""

from __future__ import annotations

from refspec.core.batch import ForwardBatch
from refspec.core.kv_cache import MLAKVPool
from refspec.core.layer import AttentionLayer
from refspec.core.mla import check_absorbed_call, check_mha_pass, is_mha_pass
from refspec.fa3 import kernel
from refspec.fa3.metadata import FlashAttentionMetadata


def is_mla_pool(pool) -> bool:
    """SGLang's ``use_mla``: the backend runs MLA iff its pool holds latent rows."""
    return isinstance(pool, MLAKVPool)


def check_mla_provider(provider: str) -> None:
    """At construction of an MLA backend: the provider has the absorbed ``qv`` kernel (ML-013)."""
    kernel.require_mla_kernel(provider, "qv")


def mla_kv_views(pool: MLAKVPool, layer: AttentionLayer, page_size: int | None = None):
    """ML-003: the absorbed call's two cache operands, ``(k_rope_cache [NP, P, 1, D - Dv], c_kv_cache
    [NP, P, 1, Dv])``: the pool's rows split at the *layer's* ``v_head_dim`` Dv (not at the pool's
    ``kv_lora_rank``; the two agree for every DeepSeek layer), paged by ``page_size`` (default the
    pool's P; 1 for a table of token slots, ML-011), strided views of the pool, never copies.
    Upstream: ``k_rope = kv_cache[:, :, layer.v_head_dim:]``, ``c_kv = kv_cache[:, :, :layer.v_head_dim]``
    (`forward_extend@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L1944>`_)."""
    return pool.paged_views(layer.layer_id, layer.v_head_dim, page_size)


def qv_call(q_nope, q_rope, k_rope_cache, c_kv_cache, md: FlashAttentionMetadata, layer: AttentionLayer, *,
            causal: bool, return_lse: bool, provider: str, window=(-1, -1)):
    """ONE absorbed kernel call on metadata ``md`` (ML-005): ``q=q_rope``, ``qv=q_nope``, the two
    views as K and V, the layer's scale.  Returns ``[T, H, Dv]`` (and the LSE ``[H, T]``)."""
    return kernel.attention(q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q_nope,
                            cache_seqlens=md.cache_seqlens_int32, page_table=md.page_table,
                            cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q,
                            softmax_scale=layer.softmax_scale, causal=causal, window_size=window,
                            softcap=layer.logit_cap, return_softmax_lse=return_lse, provider=provider)


def mha_prefill(q, k, v, layer: AttentionLayer, md: FlashAttentionMetadata, fb: ForwardBatch, provider: str):
    """ML-010: the non-absorbed prefill, one ``flash_attn_varlen_func`` call over every key of every
    request (MHA_ONE_SHOT: ``cu_seqlens_k`` = the metadata's, prefix included), bottom-right causal.
    Stores nothing: the model wrote the latent rows.  Returns ``[T, H, Dv]``."""
    check_mha_pass(layer, q, k, v, int(fb.seq_lens_cpu.sum()))
    return kernel.attention_varlen(q=q, k=k, v=v, cu_seqlens_q=md.cu_seqlens_q, cu_seqlens_k=md.cu_seqlens_k,
                                   max_seqlen_q=md.max_seq_len_q, max_seqlen_k=md.max_seq_len_k,
                                   softmax_scale=layer.softmax_scale, causal=True, provider=provider)


class MLAForwardMixin:
    """The MLA ``forward`` of an FA3 backend (module doc); the backend supplies ``pool``,
    ``forward_metadata``, ``provider`` and :meth:`mla_attend` (one call, or the cascade)."""

    def forward_mla(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch, q_rope, k_rope):
        """Store-then-attend for MLA (module doc): ``[T, H, layer.v_head_dim]``.

        Raises: InvariantError ML-002 / ML-003 / ML-005 / ML-007 (the call's arguments), ML-009 /
        ML-010 (the MHA pass outside EXTEND, or its k / v not every key), and the kernel's checks."""
        if is_mha_pass(fb):
            return mha_prefill(q, k, v, layer, self.forward_metadata, fb, self.provider)
        check_absorbed_call(self.pool, layer, q, q_rope, k, k_rope)
        if k is not None:  # store ...
            kernel.store_mla_kv(pool=self.pool, loc=fb.out_cache_loc, layer_id=layer.layer_id, k_nope=k, k_rope=k_rope)
        return self.mla_attend(q, q_rope, layer, fb)  # ... then attend, no new k / v
