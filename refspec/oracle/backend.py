"""The paged oracle backend: every length and mask from the request's meaning, no FA3 formula.

It reads from a :class:`~refspec.core.batch.ForwardBatch` only what upstream treats as the
forward's *inputs*:

* ``req_pool_indices [B]``: request b's row of ``req_to_token``;
* ``positions [T]``: token i's position t_i, which is also its KV index (SD-007);
* ``out_cache_loc [T]``: the slot token i's K/V is written to;
* which rows belong to which request: the input that counts them per mode (1 per request in
  DECODE; ``num_draft_tokens`` in TARGET_VERIFY, upstream ``spec_info.draft_token_num``;
  ``num_accept_tokens`` in DRAFT_EXTEND, upstream ``accept_length + 1``; ``extend_seq_lens``
  in EXTEND and DRAFT_EXTEND_V2).

and derives the rest itself:

* key p of request b is the slot ``req_to_token[r_b, p]`` (no page table);
* the row at position t sees its request's keys ``0 .. t`` (PA-004; no ``cache_seqlens``);
* its own INV-TAIL check (MD-005): ``out_cache_loc[i] == req_to_token[r_b, t_i]`` and a request's
  positions are consecutive, so that a wrong builder (a shifted cut, a mixed layout) is refused
  here instead of being attended the same wrong way by both wings;
* MD-012: distinct rows, no slot written twice, no slot twice among one request's keys, and no
  token writing a slot that is another request's key (what a page freed too early and handed
  out again looks like).

It shares with the FA3 wing only the core's data structures (``ForwardBatch``, ``KVCache``,
``KVPool`` / ``MLAKVPool``, ``AttentionLayer``, the MLA argument checks of :mod:`refspec.core.mla`):
no builder-derived field (``seq_lens``, ``q_lens_cpu``), and nothing from :mod:`refspec.fa3`.
``OracleMetadata.cache_seqlens`` (the last position + 1) is reported for comparisons with the
FA3 wing's ``cache_seqlens``; paged attention never reads it.

**MLA** (an :class:`~refspec.core.kv_cache.MLAKVPool`): the same store-then-attend, in the absorbed
form over the latent rows (:func:`refspec.oracle.mla.absorbed_attention`), or, for the non-absorbed
prefill (``fb.attn_attend_prefix_cache is False``, ML-010), plain attention over the ragged
per-head k / v the model passes: request b's keys are the next ``last position + 1`` rows of k,
in request order.

**First reading:** :class:`OracleBackend` (``forward``: store, then attend by position),
``rows_per_request`` and ``oracle_metadata``; skip the body of ``check_tail``, the checks that
refuse a wrong builder (INV-TAIL, MD-012), until one fires.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from refspec.core.batch import ForwardBatch, check_batch_shapes
from refspec.core.invariants import InvariantError, require
from refspec.core.kv_cache import KVCache, KVPool, MLAKVPool, check_pool_fits
from refspec.core.layer import AttentionLayer
from refspec.core.mla import check_absorbed_call, check_mha_pass, is_mha_pass
from refspec.oracle.attention import attention_by_position
from refspec.oracle.mla import absorbed_attention


@dataclass
class OracleMetadata:
    """Per request (Python ints): ``q_lens`` (query rows), ``cu_seqlens_q`` (B+1 row offsets),
    ``req_pool_indices``, ``cache_seqlens`` (last position + 1, tokens: for comparisons only);
    per token: ``positions`` (tokens)."""

    q_lens: list[int]
    cache_seqlens: list[int]
    cu_seqlens_q: list[int]
    req_pool_indices: list[int]
    positions: list[int]


def rows_per_request(fb: ForwardBatch) -> list[int]:
    """Query rows of each request, from the mode's input that counts them (module doc).

    Raises: ValueError if that input is missing or the rows do not add up to T.
    """
    m, B, T = fb.forward_mode, fb.batch_size, fb.num_tokens
    if m.is_idle():
        counts = []
    elif m.is_decode():  # one new token per request (draft decode too)
        counts = [1] * B
    elif m.is_target_verify():
        counts = [fb.num_draft_tokens] * B
    elif m.is_draft_extend():
        counts = fb.num_accept_tokens_cpu
    else:  # EXTEND, DRAFT_EXTEND_V2
        counts = fb.extend_seq_lens_cpu
    if counts is None or any(c is None for c in counts) or sum(counts) != T:
        raise ValueError(f"{m.name}: rows per request {counts} do not add up to the {T} tokens of the batch")
    return [int(c) for c in counts]


def oracle_metadata(fb: ForwardBatch, req_to_token: torch.Tensor | None = None) -> OracleMetadata:
    """What the oracle attends with (module doc); with ``req_to_token`` [R, ctx] int32 it also
    checks INV-TAIL and slot ownership against it.

    Raises: InvariantError MD-012 (a repeated row; with ``req_to_token``: a slot written twice,
    or a written slot that is another request's key), MD-005 (with ``req_to_token``: a token
    whose ``out_cache_loc`` is not ``req_to_token[r, position]``, or non-consecutive positions);
    ValueError from :func:`rows_per_request` and :func:`~refspec.core.batch.check_batch_shapes`.
    """
    check_batch_shapes(fb)
    rows = fb.req_pool_indices.tolist()
    require(len(set(rows)) == len(rows), "MD-012", f"req_pool_indices {rows} repeat a row")
    q = rows_per_request(fb)
    cu = [0, *accumulate(q)]
    pos = fb.positions.tolist()
    K = [pos[cu[b + 1] - 1] + 1 if q[b] else 0 for b in range(len(q))]
    tw = OracleMetadata(q, K, cu, rows, pos)
    if req_to_token is not None:
        check_tail(tw, fb.out_cache_loc.tolist(), req_to_token)
    return tw


def check_tail(tw: OracleMetadata, loc: list[int], req_to_token: torch.Tensor) -> None:
    """The oracle's INV-TAIL (MD-005) and write-ownership (MD-012) checks; see the module doc.

    ``loc``: ``out_cache_loc`` as T ints (slots).
    """
    width = req_to_token.shape[1]
    keys = {}
    for b, r in enumerate(tw.req_pool_indices):
        mine = tw.positions[tw.cu_seqlens_q[b]:tw.cu_seqlens_q[b + 1]]
        if not mine:
            continue
        if not (mine == list(range(mine[0], mine[0] + len(mine))) and 0 <= mine[0] and mine[-1] < width):
            raise InvariantError("MD-005", f"request {b} (row {r}): positions {mine} are not consecutive "
                                 f"inside [0, {width})")
        want = req_to_token[r, mine[0]:mine[-1] + 1].tolist()
        got = loc[tw.cu_seqlens_q[b]:tw.cu_seqlens_q[b + 1]]
        if got != want:
            raise InvariantError("MD-005", f"request {b} (row {r}): out_cache_loc {got} != req_to_token[{r}, "
                                 f"{mine[0]}:{mine[-1] + 1}] {want} (the slots of its own positions)")
        slots = req_to_token[r, :mine[-1] + 1].tolist()
        if len(set(slots)) != len(slots):
            raise InvariantError("MD-012", f"request {b} (row {r}): a slot appears twice among its keys "
                                 f"0..{mine[-1]} (a page handed out twice)")
        keys[b] = set(slots)
    require(len(set(loc)) == len(loc), "MD-012", lambda: f"out_cache_loc {loc} writes a slot twice")
    for b, ks in keys.items():
        for c in keys:
            written = set(loc[tw.cu_seqlens_q[c]:tw.cu_seqlens_q[c + 1]])
            clash = sorted(written & ks) if c != b else []
            if clash:
                raise InvariantError("MD-012", f"request {c} writes slot(s) {clash[:4]} that request {b} "
                                     f"(row {tw.req_pool_indices[b]}) reads as its keys")


class OracleBackend:
    """Reference backend: store-then-attend, attention by slot gather (fp32 by default).

    Args:
        pool: this model's KV pool; kv: the shared ``req_to_token`` / allocator.
        upcast: False computes in the input dtype (the T1 budget run, TOL-002).
        out_dtype: dtype of the output (default: the query's; ``torch.float32`` keeps the
            fp32 truth unrounded for T1 comparisons).
    """

    name = "oracle"

    def __init__(self, pool: KVPool, kv: KVCache, upcast: bool = True, out_dtype=None):
        check_pool_fits(pool, kv)  # ValueError: a pool paged otherwise than the cache
        self.pool, self.kv, self.upcast, self.out_dtype = pool, kv, upcast, out_dtype
        self.forward_metadata: OracleMetadata | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> OracleMetadata:
        """:func:`oracle_metadata` with this cache's ``req_to_token`` (its checks always run)."""
        self.forward_metadata = oracle_metadata(fb, self.kv.req_to_token)
        return self.forward_metadata

    def forward(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch, q_rope=None, k_rope=None):
        """``q [T, H, D]``, ``k, v [T, Hkv, D]`` (or None: nothing new to store) -> ``[T, H, D]``.

        MLA pool: SGLang's ``RadixAttention`` call of the absorbed layer, ``q [T, H, Dv]`` (the
        absorbed ``q_nope``), ``k [T, 1, R]`` (the latent; ``v`` is ignored, upstream passes ``k``
        again), ``q_rope [T, H, Dr]``, ``k_rope [T, 1, Dr]`` -> ``[T, H, Dv]`` (latent space,
        before ``W_UV``); or the MHA pass (module doc) -> ``[T, H, Dv]``.
        Raises: RuntimeError if no metadata was built yet; InvariantError PA-011 (shapes), and for
        MLA the checks of :func:`~refspec.core.mla.check_absorbed_call` / ``check_mha_pass``.
        """
        if self.forward_metadata is None:
            raise RuntimeError("OracleBackend.forward before init_forward_metadata(fb): there is no metadata")
        if isinstance(self.pool, MLAKVPool):
            return self._forward_mla(q, k, layer, fb, q_rope, k_rope, v)
        if q_rope is not None or k_rope is not None:
            raise ValueError("q_rope / k_rope are MLA arguments: this backend's pool is an MHA KVPool")
        require(q.dim() == 3 and tuple(q.shape[1:]) == (layer.num_heads, layer.head_dim), "PA-011",
                lambda: f"q {tuple(q.shape)} vs layer {layer.layer_id}: "
                f"[T, H = {layer.num_heads}, D = {layer.head_dim}]")
        if k is not None:
            self.pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        md = self.forward_metadata
        kf, vf = self.pool.get_flat_kv(layer.layer_id)
        return attention_by_position(q, kf, vf, self.kv.req_to_token, md.req_pool_indices, md.cu_seqlens_q,
                                     md.positions, softmax_scale=layer.softmax_scale,
                                     window_left=layer.sliding_window_size, softcap=layer.logit_cap,
                                     upcast=self.upcast, out_dtype=self.out_dtype)

    def _forward_mla(self, q, k, layer: AttentionLayer, fb: ForwardBatch, q_rope, k_rope, v):
        """The MLA branches of :meth:`forward` (module doc): store the latent row, then absorbed
        attention over the rows by slot; or the MHA pass over the given k / v (no store)."""
        md = self.forward_metadata
        if is_mha_pass(fb):
            return self._mha_pass(q, k, v, layer, md)
        check_absorbed_call(self.pool, layer, q, q_rope, k, k_rope)
        if k is not None:
            self.pool.set_mla_kv_buffer(layer.layer_id, fb.out_cache_loc, k, k_rope)
        rows = self.pool.get_key_buffer(layer.layer_id)
        return absorbed_attention(q, q_rope, rows, layer.v_head_dim, self.kv.req_to_token, md.req_pool_indices,
                                  md.cu_seqlens_q, md.positions, softmax_scale=layer.softmax_scale,
                                  softcap=layer.logit_cap, upcast=self.upcast, out_dtype=self.out_dtype)

    def _mha_pass(self, q, k, v, layer: AttentionLayer, md: OracleMetadata):
        """ML-010 in the oracle: request b's keys are its ``K_b`` (last position + 1) rows of the
        ragged ``k`` / ``v``, in request order; the row at position t sees keys 0..t.  Stores nothing."""
        K = md.cache_seqlens
        check_mha_pass(layer, q, k, v, sum(K))
        starts = [0, *accumulate(K)][:-1]
        table = torch.zeros((len(K), max(K, default=0) + 1), dtype=torch.long, device=q.device)
        for b, (s, n) in enumerate(zip(starts, K)):  # request b's key p is row s + p of k
            table[b, :n] = torch.arange(s, s + n, device=q.device)
        return attention_by_position(q, k, v, table, range(len(K)), md.cu_seqlens_q, md.positions,
                                     softmax_scale=layer.softmax_scale, softcap=layer.logit_cap, upcast=self.upcast,
                                     out_dtype=self.out_dtype)
