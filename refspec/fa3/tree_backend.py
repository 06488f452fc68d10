"""The FA3 backend for top-k > 1: tree verify and branch draft decode (store, then cascade attention).

Batches (subclasses of :class:`~refspec.core.batch.ForwardBatch`, field names as SGLang's):

* :class:`TreeVerifyBatch` (TARGET_VERIFY): ``seq_lens`` L (committed), N node rows per request
  written at ``out_cache_loc = req_to_token[r, L + i]`` (node i's verify slot), RoPE
  ``positions = L + depth(i)``, and the flat FULL_MASK ``custom_mask`` of
  :func:`refspec.speculative.tree.build.build_tree`;
* :class:`TreeDraftBatch` (DECODE, draft step s): ``seq_lens`` L, ``draft_cache_loc`` the
  ``[B, k, S]`` branch slots flattened (what SGLang's ``out_cache_loc`` holds when the metadata is
  built), and, per step, ``out_cache_loc = draft_cache_loc.view(-1, S)[:, s]`` (B*k rows).

:class:`FlashAttentionTreeBackend` builds the prefix + expand metadata of
:mod:`refspec.fa3.tree_metadata` (eager) or replays them in place
(:mod:`refspec.speculative.tree.graphs`), then ``forward`` stores K/V at ``out_cache_loc``
(PA-009) and runs :func:`refspec.fa3.tree_attention.cascade_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refspec.core.batch import ForwardBatch
from refspec.core.invariants import require
from refspec.core.kv_cache import KVCache, KVPool
from refspec.fa3 import kernel
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.mla import MLAForwardMixin, check_mla_provider, is_mla_pool
from refspec.fa3.tree_attention import cascade_attention, mla_cascade_attention


@dataclass
class TreeVerifyBatch(ForwardBatch):
    topk: int = 1
    custom_mask: torch.Tensor | None = None  #: flat bool, FULL_MASK layout (TR-011)
    #: bool [B*N, N] or None: the tree columns of ``custom_mask`` (TR-011's mask rows) where the
    #: builder already has them on the device (``build_tree_device``'s ``tree_mask``); graph
    #: replay reads them instead of extracting them again (:func:`~refspec.fa3.tree_metadata.verify_mask_rows`)
    tree_mask: torch.Tensor | None = None


@dataclass
class TreeDraftBatch(ForwardBatch):
    topk: int = 1
    num_steps: int = 1  #: S (speculative_num_steps); S - 1 draft forwards
    draft_cache_loc: torch.Tensor | None = None  #: int64 [B*k*S], layout [B, k, S]


def draft_step_batch(fb: TreeDraftBatch, step: int) -> TreeDraftBatch:
    """Step ``s`` of a draft batch: ``out_cache_loc`` / ``positions`` of its B*k rows (views)."""
    rows = tm.draft_cache_loc_rows(fb.draft_cache_loc, fb.num_steps)
    pos = fb.positions.view(-1, fb.num_steps)
    return fb.replace(out_cache_loc=rows[:, step], positions=pos[:, step], draft_step=step)


class FlashAttentionTreeBackend(MLAForwardMixin):
    """One model's top-k > 1 attention: the verify backend, or the draft backend of step s.

    Args:
        pool: the model's KV pool ``[NP, P, Hkv, D]`` per layer, or an MLA pool (the MLA cascade,
            ML-011).  kv: ``req_to_token`` + allocator.
        topk: k >= 2.  num_draft_tokens: N (verify).  num_steps: S (draft decode).
        speculative_step_id: s for the draft-decode backend of step s, else None (verify).
        validate: audit every expand row's reads (TR-011 / TR-014) when metadata is built.
        provider: kernel provider (None: :func:`refspec.fa3.kernel.select_provider`).
    """

    name = "fa3-tree"

    def __init__(self, pool: KVPool, kv: KVCache, *, topk: int, num_draft_tokens: int | None = None,
                 num_steps: int | None = None, speculative_step_id: int | None = None,
                 validate: bool = True, provider: str | None = None):
        if not isinstance(topk, int) or topk < 2:
            raise ValueError(f"FlashAttentionTreeBackend needs topk >= 2, got {topk!r}")
        self.pool, self.kv, self.page_size, self.topk = pool, kv, kv.page_size, topk
        self.num_draft_tokens, self.num_steps = num_draft_tokens, num_steps
        self.speculative_step_id = speculative_step_id
        self.validate = validate
        self.provider = provider or kernel.select_provider(kv.device)
        self.use_mla = is_mla_pool(pool)
        if self.use_mla:
            check_mla_provider(self.provider)  # ML-013
        self.forward_metadata = None
        self.forward_metadata_spec_decode_expand = None
        self.graph_state = None

    # ---- eager metadata ----
    def init_forward_metadata(self, fb) -> None:
        """Prefix and expand metadata for ``fb`` (a TreeVerifyBatch, or a TreeDraftBatch for step s).

        Raises: TypeError for a batch of the wrong kind; InvariantError TR-011 / TR-014 (with
        ``validate``) when an expand row would read a slot outside its own keys.
        """
        R, P = self.kv.req_to_token, self.page_size
        if isinstance(fb, TreeVerifyBatch):
            N = self.num_draft_tokens
            self.forward_metadata = tm.verify_prefix_metadata(fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices,
                                                              R, N, P)
            self.forward_metadata_spec_decode_expand = tm.verify_expand_metadata(
                fb.custom_mask, fb.seq_lens, fb.req_pool_indices, R, N)
            if self.validate:
                own = [set(fb.out_cache_loc[b * N:(b + 1) * N].tolist()) for b in range(fb.batch_size)]
                tm.check_expand_reads_own_rows(self.forward_metadata_spec_decode_expand,
                                               [own[t // N] for t in range(fb.batch_size * N)], 1)
        elif isinstance(fb, TreeDraftBatch):
            s, S, k = self.speculative_step_id, self.num_steps, self.topk
            self.forward_metadata = tm.draft_prefix_metadata(fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices,
                                                             R, k, P)
            self.forward_metadata_spec_decode_expand = tm.draft_expand_metadata(
                fb.draft_cache_loc, fb.seq_lens, s, k, S, P)
            if self.validate:
                self._check_draft_expand(fb)
        else:
            raise TypeError(f"FlashAttentionTreeBackend takes a TreeVerifyBatch or TreeDraftBatch, got "
                             f"{type(fb).__name__}")

    def _check_draft_expand(self, fb: TreeDraftBatch) -> None:
        """Row b*k + t may read only branch t's tail copy and its own steps 0..s (TR-014)."""
        s, S, P = self.speculative_step_id, self.num_steps, self.page_size
        rows = tm.draft_cache_loc_rows(fb.draft_cache_loc, S)
        tails = tm.branch_tail_slots(fb.draft_cache_loc, fb.seq_lens, self.topk, S, P)  # exact L (overlap: bound)
        allowed = [set(tails[t]) | set(rows[t, :s + 1].tolist()) for t in range(rows.shape[0])]
        tm.check_expand_reads_own_rows(self.forward_metadata_spec_decode_expand, allowed, P)

    # ---- the forward ----
    def forward(self, q, k, v, layer, fb, q_rope=None, k_rope=None):
        """Store-then-attend: ``q [T, H, D]``, ``k, v [T, Hkv, D]`` -> ``[T, H, D]`` (graph-safe).
        An MLA pool takes SGLang's MLA call (:mod:`refspec.fa3.mla`) and :meth:`mla_attend`.

        Raises: RuntimeError before any metadata; InvariantError PA-011 (shapes).
        """
        if self.forward_metadata is None:
            raise RuntimeError("FlashAttentionTreeBackend.forward before init_forward_metadata")
        if self.use_mla:
            return self.forward_mla(q, k, v, layer, fb, q_rope, k_rope)
        if q_rope is not None or k_rope is not None:
            raise ValueError("q_rope / k_rope are MLA arguments: this backend's pool is an MHA KVPool")
        require(q.dim() == 3 and tuple(q.shape[1:]) == (layer.num_heads, layer.head_dim), "PA-011",
                lambda: f"q {tuple(q.shape)} vs layer {layer.layer_id}: [T, H = {layer.num_heads}, D]")
        if k is not None:  # store ...
            kernel.store_kv(pool=self.pool, loc=fb.out_cache_loc, layer_id=layer.layer_id, k=k, v=v)
        k_cache, v_cache = self.pool.get_kv_buffer(layer.layer_id)
        window = (layer.sliding_window_size, 0) if layer.sliding_window_size >= 0 else (-1, -1)
        return cascade_attention(q, k_cache, v_cache, self.forward_metadata,
                                 self.forward_metadata_spec_decode_expand, layer,
                                 expand_page1=isinstance(fb, TreeVerifyBatch), provider=self.provider,
                                 window=window)

    def mla_attend(self, q, q_rope, layer, fb):
        """MLA's attend step at top-k > 1: the cascade over this backend's prefix and expand metadata (ML-011)."""
        return mla_cascade_attention(q, q_rope, self.pool, self.forward_metadata,
                                     self.forward_metadata_spec_decode_expand, layer,
                                     expand_page1=isinstance(fb, TreeVerifyBatch), provider=self.provider)
