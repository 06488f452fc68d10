"""SGLang's FA3 attention backend, top-k = 1: store-then-attend over the paged pool.

Mirrors ``FlashAttentionBackend``
(https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L132;
the v0.5.5 code the rules quote: ``forward_extend`` line 672 (PA-009, MD-005), ``forward_decode`` line 989
(PA-009)).

``forward`` first writes this forward's K/V at ``out_cache_loc`` (PA-009), then calls the FA3
kernel contract with no new k/v, so ``cache_seqlens`` counts this forward's own tokens
(docs/fa3-contract.md).  Eager metadata comes from :mod:`refspec.fa3.metadata`; CUDA-graph
capture/replay hooks from :mod:`refspec.fa3.graph_metadata`.  Validation
(:mod:`refspec.fa3.validate`) runs after every metadata build unless ``validate=False``.
With an MLA pool the same metadata feeds the MLA branch of ``forward`` (:mod:`refspec.fa3.mla`).
"""

from __future__ import annotations

from refspec.core.batch import ForwardBatch
from refspec.fa3 import kernel
from refspec.fa3.graph_metadata import GraphMetadataMixin
from refspec.fa3.mla import MLAForwardMixin, check_mla_provider, is_mla_pool, mla_kv_views, qv_call
from refspec.fa3.metadata import FlashAttentionMetadata, init_forward_metadata
from refspec.fa3.validate import validate_batch, validate_metadata
from refspec.core.invariants import require
from refspec.core.kv_cache import KVCache, KVPool, check_pool_fits
from refspec.core.layer import AttentionLayer


def kernel_window_size(layer: AttentionLayer) -> tuple[int, int]:
    """FA3's ``window_size`` for ``layer``: ``(w, 0)`` for a left window of w tokens, else
    ``(-1, -1)`` (no window).  A query at position t then sees keys ``t - w .. t``, w + 1 keys
    (PA-004), the meaning of ``AttentionLayer.sliding_window_size``.

    Upstream: sglang ``flashattention_backend.py`` ``forward_extend`` / ``forward_decode``,
    ``window_size = (layer.sliding_window_size, 0)``.
    """
    w = layer.sliding_window_size
    return (w, 0) if w >= 0 else (-1, -1)


class FlashAttentionBackend(GraphMetadataMixin, MLAForwardMixin):
    """The production backend of one model (target or draft).

    Args:
        pool: this model's KV pool ``[NP, P, Hkv, D]`` per layer, or an MLA pool (``use_mla``:
            the MLA branch of :meth:`forward`, :mod:`refspec.fa3.mla`).
        kv: shared ``req_to_token`` (int32 ``[max_reqs, ctx + extra]``) and allocator.
        speculative_step_id: s for the draft-decode backend of step s (K = L + s + 1), else None.
        validate: run :func:`refspec.fa3.validate.validate_metadata` on every build.
        provider: force a kernel provider (``"fa3"``, ``"emulator"``, ...); None picks one for
            the pool's device once, here (:func:`refspec.fa3.kernel.select_provider`).
        syncs: a ``Counter`` (the engine's ``syncs``); each validated metadata build adds one
            ``"validation"`` (its checks read the device), none without ``validate``.
    Raises: ValueError if the pool is not paged as ``kv`` (:func:`~refspec.core.kv_cache.check_pool_fits`);
    InvariantError ML-013 for an MLA pool on a provider without the ``qv`` kernel.
    """

    name = "fa3"

    def __init__(self, pool: KVPool, kv: KVCache, speculative_step_id: int | None = None,
                 validate: bool = True, provider: str | None = None, syncs=None):
        check_pool_fits(pool, kv)  # ValueError: a pool paged otherwise than the cache
        self.pool, self.kv = pool, kv
        self.page_size = kv.page_size
        self.speculative_step_id = speculative_step_id
        self.validate = validate
        self.syncs = syncs
        self.provider = provider or kernel.select_provider(kv.device)  # once, not per kernel call
        self.use_mla = is_mla_pool(pool)
        if self.use_mla:
            check_mla_provider(self.provider)  # ML-013: no MLA on a build without the 64 / 512 kernel
        self.forward_metadata: FlashAttentionMetadata | None = None
        self.graph_state = None

    def init_forward_metadata(self, fb: ForwardBatch) -> FlashAttentionMetadata:
        """Eager metadata (MD-003), validated against ``fb`` and ``req_to_token``.

        Raises (with ``validate``): see :func:`refspec.fa3.validate.validate_batch` (before the
        build) and :func:`refspec.fa3.validate.validate_metadata` (after it).
        """
        if self.validate:
            self.count_validation()
            validate_batch(fb, self.kv.req_to_token)
        md = init_forward_metadata(fb, self.kv.req_to_token, self.page_size, self.speculative_step_id)
        if self.validate:
            validate_metadata(md, fb, self.kv.req_to_token, self.page_size)
        self.forward_metadata = md
        return md

    def count_validation(self) -> None:
        if self.syncs is not None:
            self.syncs["validation"] += 1

    def forward(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch, q_rope=None, k_rope=None):
        """Store-then-attend.  ``q [T, H, D]``, ``k, v [T, Hkv, D]`` (None: nothing to store)
        -> ``[T, H, D]``.  Graph-safe: no host syncs here (validation ran at metadata time).
        An MLA pool takes SGLang's MLA call instead (``q_rope`` / ``k_rope``: :mod:`refspec.fa3.mla`).

        Raises: RuntimeError if no metadata was built yet; InvariantError PA-011 (k / v do not
        match ``out_cache_loc`` and the pool, or the kernel's argument checks fail).
        """
        if self.forward_metadata is None:
            raise RuntimeError("FlashAttentionBackend.forward before init_forward_metadata(fb) "
                               "(or a graph capture hook): there is no metadata to run on")
        if self.use_mla:
            return self.forward_mla(q, k, v, layer, fb, q_rope, k_rope)
        if q_rope is not None or k_rope is not None:
            raise ValueError("q_rope / k_rope are MLA arguments: this backend's pool is an MHA KVPool")
        require(q.dim() == 3 and tuple(q.shape[1:]) == (layer.num_heads, layer.head_dim), "PA-011",
                lambda: f"q {tuple(q.shape)} vs layer {layer.layer_id}: "
                f"[T, H = {layer.num_heads}, D = {layer.head_dim}]")
        if k is not None:  # store ...
            kernel.store_kv(pool=self.pool, loc=fb.out_cache_loc, layer_id=layer.layer_id, k=k, v=v)
        md = self.forward_metadata
        k_cache, v_cache = self.pool.get_kv_buffer(layer.layer_id)
        return kernel.attention(  # ... then attend, no new k / v
            q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=md.cache_seqlens_int32, page_table=md.page_table,
            cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q, softmax_scale=layer.softmax_scale,
            causal=True, window_size=kernel_window_size(layer), softcap=layer.logit_cap, provider=self.provider)

    def mla_attend(self, q, q_rope, layer: AttentionLayer, fb: ForwardBatch):
        """MLA's attend step (top-k = 1): one ``qv`` call on this backend's metadata, causal (ML-005)."""
        k_rope_cache, c_kv_cache = mla_kv_views(self.pool, layer)  # ML-003
        return qv_call(q, q_rope, k_rope_cache, c_kv_cache, self.forward_metadata, layer, causal=True,
                       return_lse=False, provider=self.provider)


class FlashAttentionMultiStepBackend:
    """The Sd - 1 draft-decode backends, one per step s = 0..Sd-2 (MD-010).

    SGLang's ``FlashAttentionMultiStepBackend``:
    https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L3477

    Each owns its metadata and graph buffers; step s's K is L + s + 1.  With Sd = 1 there is no
    draft-decode forward and ``backends`` is empty.
    """

    def __init__(self, pool: KVPool, kv: KVCache, speculative_num_steps: int, **kw):
        self.backends = [FlashAttentionBackend(pool, kv, speculative_step_id=s, **kw)
                         for s in range(speculative_num_steps - 1)]
