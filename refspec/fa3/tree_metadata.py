"""FA3 metadata for top-k > 1: the cascade "prefix + expand" split of SGLang's FA3 backend.

With a tree of drafts the keys of one query row are no longer a causal span of one sequence, so
SGLang's ``FlashAttentionBackend`` splits every top-k > 1 attention into two kernel calls, each
a plain paged ``flash_attn_with_kvcache`` with ``causal=False``, merged by log-sum-exp
(:mod:`refspec.fa3.tree_attention`):

* **prefix**: the committed KV, shared by every query row of a request (one sequence per
  request, its q rows packed);
* **expand**: the per-row part (one sequence per query row, ``max_seqlen_q = 1``).

================  ===========================  ===================================================
mode              prefix (one seq per request)  expand (one seq per query row)
================  ===========================  ===================================================
TARGET_VERIFY     q = N rows, K = L,            K = mask row sum (depth + 1); page table = the row's
(TR-010, TR-011)  cu_q = arange(0, B*N+1, N),   allowed verify *slots* first, in node order, read on
                  table = R[r, ::P] // P        the page-size-1 view of the pool
draft decode s    q = k rows, K = L - lp        K = s + 1 + lp; table: P = 1 the row's own step
(TR-013, TR-014)  (lp = L % P if P > 1, else 0) slots ``cache_loc[:, :s+1]``; P > 1 the unique
                  cu_q = arange(0, B*k+1, k)    consecutive pages of the row's ``cache_loc // P``
================  ===========================  ===================================================

Upstream: ``python/sglang/srt/layers/attention/flashattention_backend.py``,
``FlashAttentionBackend.init_forward_metadata`` (the ``topk > 1`` branches of draft decode and
TARGET_VERIFY) and the module function ``draft_decode_set_expand_metadata``; P > 1 added by
sgl-project/sglang#7725, the unique-consecutive expand table by #15469 (its replay slice: #27360, the
fix of the #25077 family).  Each rule below is one named function: the seams a reviewer cites and a wrong
variant (:mod:`refspec.mutants.tree_variants`) replaces.

Shapes: B requests, k = topk, N = num_draft_tokens, S = speculative_num_steps, P = page size.
Every metadata tensor is int32; ``page_table`` columns are *pages* except in the verify expand
part, where they are token *slots* (page size 1).
"""

from __future__ import annotations

import torch

from refspec.core.invariants import require
from refspec.fa3.metadata import FlashAttentionMetadata, cumsum0, strided_page_table


def _i32(x: torch.Tensor) -> torch.Tensor:
    """A fresh row-major int32 copy (FA3 wants ``stride(-1) == 1`` even for width 1)."""
    return torch.empty(x.shape, dtype=torch.int32, device=x.device).copy_(x)


# ------------------------------------------------------------------ TARGET_VERIFY, top-k > 1
def verify_prefix_metadata(seq_lens, seq_lens_cpu, req_pool_indices, req_to_token, num_draft_tokens: int,
                           page_size: int) -> FlashAttentionMetadata:
    """TR-010: the committed prefix of every tree node, one sequence per request.

    ``cache_seqlens = L`` (only the committed KV: the N tree slots are the expand part's),
    ``cu_seqlens_q = arange(0, B*N + 1, N)``, ``max_seqlen_q = N``, the strided page table over
    ``req_to_token[r, :max L]``; run with ``causal=False`` (every node sees all of the prefix).
    Shapes: seq_lens int32 [B] (device), seq_lens_cpu int64 [B], req_pool_indices int64 [B].
    """
    N, B, dev = num_draft_tokens, seq_lens.shape[0], req_to_token.device
    cache_seqlens = _i32(seq_lens)
    max_k = int(seq_lens_cpu.max()) if B else 0
    cu_q = torch.arange(0, B * N + 1, N, dtype=torch.int32, device=dev)
    page_table = strided_page_table(req_to_token, req_pool_indices, max_k, page_size)
    return FlashAttentionMetadata(cache_seqlens, cu_q, cumsum0(cache_seqlens), N, max_k, page_table)


def verify_mask_rows(custom_mask: torch.Tensor, seq_lens: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """The tree part of SGLang's flat FULL_MASK ``custom_mask``: bool ``[B*N, N]``.

    Request b's block starts at ``N * sum_{j<b} (L_j + N)``; node i's row there has length
    ``L_b + N`` and its tree columns are ``L_b .. L_b + N - 1`` (``cols = L + arange(N)``, row
    starts ``cumsum((L + N).repeat_interleave(N))``), exactly upstream's
    ``mask_extraction_indices``.
    """
    N = num_draft_tokens
    offsets = torch.arange(N, device=seq_lens.device)[None]
    cols = offsets + seq_lens.long()[:, None]  # [B, N]
    row_len = (seq_lens.long() + N).repeat_interleave(N)
    starts = torch.nn.functional.pad(torch.cumsum(row_len, 0), (1, 0))[:-1]  # [B*N]
    idx = cols.repeat_interleave(N, dim=0) + starts[:, None]
    return custom_mask[idx.flatten()].view(-1, N)


def verify_expand_page_table(mask: torch.Tensor, req_to_token, req_pool_indices, seq_lens,
                             num_draft_tokens: int) -> torch.Tensor:
    """TR-011: per node row, the *slots* of its allowed tree nodes first, in node order.

    ``keys = where(mask, col, col + N)``; ``argsort(keys)`` puts the allowed columns first (in
    ascending node order) and the rest after them, where ``cache_seqlens`` hides them.  Entries
    are ``req_to_token[r, L + col]``: token slots, not divided by P (the expand call reads the
    page-size-1 view of the pool).  Example: mask row [1, 0, 1] over slots [8, 9, 10] -> [8, 10, 9].
    Returns int32 ``[B*N, N]``.
    """
    N = num_draft_tokens
    col = torch.arange(N, device=mask.device).expand(mask.shape[0], N)
    keys = torch.where(mask, col, col + N)
    _, order = torch.sort(keys, dim=1)
    cols = torch.arange(N, device=seq_lens.device)[None] + seq_lens.long()[:, None]  # [B, N]
    slots = req_to_token[req_pool_indices].gather(1, cols).repeat_interleave(N, dim=0)
    return _i32(slots.gather(1, order))


def verify_expand_seqlens(mask: torch.Tensor) -> torch.Tensor:
    """TR-011: ``cache_seqlens`` of node row i = its allowed tree nodes (ancestors + self = depth + 1)."""
    return mask.sum(dim=1).to(torch.int32)


def verify_expand_metadata(custom_mask, seq_lens, req_pool_indices, req_to_token,
                           num_draft_tokens: int) -> FlashAttentionMetadata:
    """TR-011: the expand part of tree verify: one sequence per node, ``max_seqlen_q = 1``.

    The eager path (the mask rows extracted from ``custom_mask``, :func:`verify_mask_rows`).  Its
    graphed twin is :func:`refspec.speculative.tree.graphs.write_verify_expand`: inside the verify
    graph the same values are written in place from the tree builder's mask rows
    (``TreeVerifyBatch.tree_mask``), through :func:`verify_expand_seqlens` and
    :func:`verify_expand_page_table` but never through this function or :func:`verify_mask_rows`."""
    N, B = num_draft_tokens, seq_lens.shape[0]
    mask = verify_mask_rows(custom_mask, seq_lens, N)
    cache_seqlens = verify_expand_seqlens(mask)
    page_table = verify_expand_page_table(mask, req_to_token, req_pool_indices, seq_lens, N)
    cu_q = torch.arange(0, B * N + 1, dtype=torch.int32, device=req_to_token.device)
    return FlashAttentionMetadata(cache_seqlens, cu_q, cumsum0(cache_seqlens), 1, N, page_table)


# ------------------------------------------------------------------ draft decode, top-k > 1
def last_page_lens(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """lp = L mod P for P > 1, else 0: the committed tokens on the last, partial page (int32 [B])."""
    if page_size == 1:
        return torch.zeros_like(seq_lens, dtype=torch.int32)
    return (seq_lens % page_size).to(torch.int32)


def draft_prefix_seqlens(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """TR-013: K = L - lp: the prefix reads only *whole* committed pages when P > 1.

    The lp tokens of the partial page are read by the expand part instead, from the branch's own
    copy of that page (TR-015), because branches t >= 1 cannot share the page: their drafts
    continue it at the same offsets.
    """
    return (seq_lens.to(torch.int32) - last_page_lens(seq_lens, page_size)).to(torch.int32)


def draft_prefix_metadata(seq_lens, seq_lens_cpu, req_pool_indices, req_to_token, topk: int,
                          page_size: int) -> FlashAttentionMetadata:
    """TR-013: one sequence per request over its committed pages, its k branch rows packed.

    ``cu_seqlens_q = arange(0, B*k + 1, k)``, ``max_seqlen_q = k``, ``cache_seqlens = L - lp``,
    the strided page table of ``req_to_token[r, :max L]``; run with ``causal=False``.
    """
    B, dev = seq_lens.shape[0], req_to_token.device
    cache_seqlens = draft_prefix_seqlens(seq_lens, page_size)
    max_k = int(seq_lens_cpu.max()) if B else 0
    cu_q = torch.arange(0, B * topk + 1, topk, dtype=torch.int32, device=dev)
    page_table = strided_page_table(req_to_token, req_pool_indices, max_k, page_size)
    return FlashAttentionMetadata(cache_seqlens, cu_q, cumsum0(cache_seqlens), topk, max_k, page_table)


def draft_cache_loc_rows(out_cache_loc: torch.Tensor, num_steps: int) -> torch.Tensor:
    """The draft slots as ``[B*k, S]``: row ``b*k + t`` is branch t of request b, column j its step j.

    ``out_cache_loc`` is laid out ``[B, k, S]`` (request, branch, step) flattened, so the view is
    ``view(-1, S)`` (sgl-project/sglang#7239 fixed a ``view(S, -1).T`` that mixed requests).
    """
    return out_cache_loc.view(-1, num_steps)


def draft_decode_set_expand_metadata(cache_seqlens_int32: torch.Tensor, page_table: torch.Tensor,
                                     last_page_lens: torch.Tensor, decode_length: int,
                                     cache_loc: torch.Tensor, topk: int, page_size: int) -> None:
    """TR-014 (P > 1), in place: ``K = s + 1 + lp`` and the row's unique consecutive pages.

    Port of upstream's ``draft_decode_set_expand_metadata`` (``@torch.compile`` there; plain
    torch here): ``cache_loc // P`` per row, deduplicated consecutively with the mask / cumsum /
    ``scatter_`` trick, written into columns ``0..(#pages - 1)`` of ``page_table``.  The first
    page is the one holding the branch's (copied) prefix tail, because step 0 sits at offset lp of
    it (TR-015).  ``cache_loc`` [B*k, S] slots (replay: its first s + 1 columns); ``page_table`` int32
    [>= B*k, >= #pages].
    """
    cache_seqlens_int32.copy_(decode_length + last_page_lens.repeat_interleave(topk))
    pages = (cache_loc // page_size).to(torch.int32)
    if pages.dim() == 1:
        pages = pages.unsqueeze(0)
    change = torch.ones_like(pages, dtype=torch.bool)
    change[:, 1:] = pages[:, 1:] != pages[:, :-1]
    positions = change.cumsum(dim=1) - 1
    page_table[:pages.shape[0], :].scatter_(1, positions, pages)


def draft_expand_metadata(out_cache_loc, seq_lens, step: int, topk: int, num_steps: int,
                          page_size: int) -> FlashAttentionMetadata:
    """TR-014: the expand part of draft decode step ``s``: one sequence per branch row.

    ``cu_seqlens_q = arange(0, B*k + 1)``, ``max_seqlen_q = 1``.  P = 1: ``K = s + 1`` and the
    table is ``cache_loc[:, :s+1]`` (the row's own step slots = pages).  P > 1: an all-zero
    ``[B*k, S]`` table filled by :func:`draft_decode_set_expand_metadata` from the *whole*
    ``cache_loc`` row (eager; CUDA-graph replay slices it to ``s + 1`` columns, TR-019).
    Raises: ValueError unless ``0 <= step < num_steps - 1``.

    Eager twin of :func:`refspec.speculative.tree.graphs.write_draft_expand` (the same values,
    written in place inside the draft graph).
    """
    if not 0 <= step < num_steps - 1:
        raise ValueError(f"draft step {step} outside [0, {num_steps - 1}) for num_steps = {num_steps}")
    dev = out_cache_loc.device
    cache_loc = draft_cache_loc_rows(out_cache_loc, num_steps)
    rows = cache_loc.shape[0]
    decode_length = step + 1
    cache_seqlens = torch.full((rows,), decode_length, dtype=torch.int32, device=dev)
    if page_size == 1:
        page_table = _i32(cache_loc[:, :decode_length])
    else:
        page_table = torch.zeros((rows, num_steps), dtype=torch.int32, device=dev)
        draft_decode_set_expand_metadata(cache_seqlens, page_table, last_page_lens(seq_lens, page_size),
                                         decode_length, cache_loc, topk, page_size)
    cu_q = torch.arange(0, rows + 1, dtype=torch.int32, device=dev)
    max_k = decode_length + (page_size - 1 if page_size > 1 else 0)
    return FlashAttentionMetadata(cache_seqlens, cu_q, cumsum0(cache_seqlens), 1, max_k, page_table)


def branch_tail_slots(draft_cache_loc: torch.Tensor, seq_lens_cpu, topk: int, num_steps: int,
                      page_size: int) -> list[list[int]]:
    """Per branch row ``b*k + t``: the lp slots before its step-0 slot on the same page (its tail copy,
    TR-015).  ``draft_cache_loc`` int64 [B*k*S] (layout [B, k, S]); ``seq_lens_cpu`` [B] (L)."""
    rows = draft_cache_loc.view(-1, num_steps)[:, 0].tolist()
    lps = [0 if page_size == 1 else int(L) % page_size for L in seq_lens_cpu.tolist()]
    return [list(range(s0 - lps[i // topk], s0)) for i, s0 in enumerate(rows)]


def check_expand_reads_own_rows(md: FlashAttentionMetadata, allowed: list[set[int]], page_size: int) -> None:
    """TR-011 / TR-014 audit: every slot an expand row reads lies in that row's ``allowed`` set.

    ``allowed[t]`` are flat slots; key p of row t is at ``table[t, p // P] * P + p % P``.
    Raises: InvariantError TR-011 naming the row, the slot and the allowed set.
    """
    K = md.cache_seqlens_int32.tolist()
    table = md.page_table.tolist()
    for t, (k, ok) in enumerate(zip(K, allowed)):
        read = [table[t][p // page_size] * page_size + p % page_size for p in range(k)]
        require(len(set(read)) == len(read) and set(read) <= ok, "TR-011",
                lambda: f"expand row {t} reads slots {read}, may read only {sorted(ok)} (each once)")
