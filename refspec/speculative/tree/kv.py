"""Paged KV for top-k > 1: the per-branch draft layout and the accepted-path compaction (v1).

**Branch layout (TR-015, sgl-project/sglang#7725).**  With P > 1 the k draft branches of a
request cannot share the last, partial committed page: every branch continues it at the same
offsets.  So each branch gets its own page-aligned region of the ``req_to_token`` row, and the
lp = L mod P committed tokens of that page are *copied* into branches t >= 1::

    | full prefix pages | tail + b0 drafts .. | tail' + b1 drafts .. | ... |
      prefix_base = L - lp;  npp = ceil((lp + S) / P) pages per branch
      branch t: positions [prefix_base + t*npp*P, prefix_base + (t+1)*npp*P)
      its step j: position prefix_base + t*npp*P + lp + j

Branch 0's region starts on the real last page (its tail *is* the committed tail).  At P = 1,
lp = 0 and npp = S, so branch t, step j sits at position L + t*S + j.  v1 allocates the
regions under ``backup_state`` and restores the allocator after the draft (the slots are
transient).  Upstream v1: ``eagle_worker.py`` ``EAGLEWorker._draft_preprocess_decode``
(``get_last_loc_large_page_size_large_top_k``, ``alloc_paged_token_slots_extend``,
``assign_draft_cache_locs``, then ``move_kv_cache`` of the tail copies).

**Accepted-path compaction (TR-017).**  Verify writes node i at position L + i; the accepted
path (nodes ``accept_index[0..n]``) is generally not ``0..n``.  Upstream v1 (``eagle_info.py``
``EagleVerifyInput.verify``, top-k > 1 and P > 1; ``spec_utils.py`` ``get_src_tgt_cache_loc`` /
``get_target_cache_loc``) moves the accepted nodes' KV to the first n + 1 verify slots
(``req_to_token`` already maps L..L+n there) and frees the slots from
``keep = min(ceil_P(L + n + 1), L + N)`` on: whole pages, since keep is page-aligned.
refspec uses this one rule for every P (at P = 1 it frees exactly the rejected slots).

**Two forms of each rule.**  The rounds know L on the device, so they run the device forms
(``*_device``, :func:`path_to_window_slots`: fixed shapes, no host read).  The host forms beside
them are the readable twins: :func:`branch_step_positions`, :func:`assign_draft_cache_locs`,
the host-list form of :func:`tail_copy_slots` and upstream's :func:`get_src_tgt_cache_loc` /
:func:`get_target_cache_loc` have no caller in the rounds (their callers are the tests, the
conformance tree cases, the tree scenarios and the tree-trace replay): they are the rule, not a
path, and ``tests/test_twins.py`` requires each to agree with its device twin on random inputs.
:func:`branch_geometry` is both: the v1 round sizes its branch allocation with it
(:func:`draft_alloc_len`).

Units: positions are tokens of a row, slots are flat pool indices, pages are ``slot // P``.
"""

from __future__ import annotations

import torch

from refspec.core.invariants import require
from refspec.core.kv_cache import KVCache, KVPool
from refspec.speculative.tree import move_kernel
from refspec.speculative.tree.device import const_arange


def branch_geometry(L: int, num_steps: int, page_size: int) -> tuple[int, int, int]:
    """``(prefix_base, lp, npp)`` of a request with committed length L (TR-015).

    P = 1: ``(L, 0, S)``.  P > 1: ``(L - L % P, L % P, ceil((L % P + S) / P))``.
    Host twin of :func:`branch_geometry_device` (every request at once).
    """
    if page_size == 1:
        return L, 0, num_steps
    lp = L % page_size
    return L - lp, lp, -(-(lp + num_steps) // page_size)


def alloc_len_per_decode(topk: int, num_steps: int, num_draft_tokens: int, page_size: int) -> int:
    """TR-020: positions past L one top-k round may give slots (tokens): the branch regions or
    the N verify slots, whichever is larger.

    P = 1: ``max(k * S, N)``.  P > 1: ``max(npp * P * k, N)`` with ``npp = ceil((P - 1 + S) / P)``,
    the most pages a branch region spans (lp = P - 1).  Upstream: ``mem_cache/allocation_sizing.py``
    ``get_alloc_len_per_decode`` (v0.5.23); v1 uses it as the row headroom, v2 as the per-round
    reserve (:mod:`refspec.speculative.tree.v2`).
    """
    if page_size == 1:
        return max(num_steps * topk, num_draft_tokens)
    npp = (page_size - 1 + num_steps + page_size - 1) // page_size
    return max(npp * page_size * topk, num_draft_tokens)


def draft_alloc_len(L: int, topk: int, num_steps: int, page_size: int) -> int:
    """Row positions that hold slots during the draft: ``prefix_base + k * npp * P`` (tokens)."""
    base, _, npp = branch_geometry(L, num_steps, page_size)
    return base + topk * npp * page_size


def branch_step_positions(L: int, topk: int, num_steps: int, page_size: int) -> torch.Tensor:
    """TR-015: int64 ``[k, S]``: the row position of branch t's step j.

    Readable twin of :func:`branch_step_positions_device`, which the rounds run."""
    base, lp, npp = branch_geometry(L, num_steps, page_size)
    t = torch.arange(topk)[:, None]
    j = torch.arange(num_steps)[None, :]
    return base + t * npp * page_size + lp + j


def assign_draft_cache_locs(kv: KVCache, rows: list[int], seq_lens: list[int], topk: int,
                            num_steps: int) -> torch.Tensor:
    """The draft ``out_cache_loc``: int64 ``[B*k*S]``, layout ``[B, k, S]`` (request, branch, step).

    Reads the slots that the allocator gave the branch positions (:func:`branch_step_positions`)
    from ``req_to_token``; they must hold slots already (:func:`draft_alloc_len` positions).
    Readable twin of :func:`assign_draft_cache_locs_device`, which the rounds run.
    """
    P, dev = kv.page_size, kv.device
    out = []
    for r, L in zip(rows, seq_lens):
        pos = branch_step_positions(L, topk, num_steps, P).to(dev)
        out.append(kv.req_to_token[r, pos.flatten()].long())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=dev)


def tail_copy_slots(kv: KVCache, rows, seq_lens, topk: int,
                    num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TR-015: ``(src, tgt)`` int64 slots: the lp tail tokens, copied into every branch t >= 1.

    ``src = req_to_token[r, prefix_base + i]``, ``tgt = req_to_token[r, prefix_base + t*npp*P + i]``
    for i < lp, t = 1..k-1.  Two forms of the same rule:

    * ``rows`` / ``seq_lens`` host lists: exactly those pairs, request-major (empty at P = 1 and
      whenever L is page-aligned) -- the readable form, compared with upstream's kernels;
    * ``rows`` / ``seq_lens`` device tensors ``[B]`` (the production rounds: L may be known only
      on the device): fixed shape ``[B*(k-1)*(P-1)]``, every i >= lp padded as slot 0 -> slot 0
      (the reserved dummy page, PA-008: a no-op copy), no host read.

    The host-list form is the readable twin of the device form (:func:`_tail_copy_slots_device`),
    which the rounds run.
    """
    if isinstance(seq_lens, torch.Tensor):
        return _tail_copy_slots_device(kv, rows, seq_lens, topk, num_steps)
    P, dev = kv.page_size, kv.device
    src, tgt = [], []
    for r, L in zip(rows, seq_lens):
        base, lp, npp = branch_geometry(L, num_steps, P)
        for t in range(1, topk):
            src.append(kv.req_to_token[r, base:base + lp].long())
            tgt.append(kv.req_to_token[r, base + t * npp * P:base + t * npp * P + lp].long())
    cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long, device=dev))
    return cat(src), cat(tgt)


# ------------------------------------------------------------------ the same rules on device lengths
def branch_geometry_device(seq_lens: torch.Tensor, num_steps: int, page_size: int):
    """:func:`branch_geometry` per request: ``(prefix_base, lp, npp)`` int64 ``[B]`` each."""
    L = seq_lens.long()
    if page_size == 1:
        return L, torch.zeros_like(L), torch.full_like(L, num_steps)
    lp = L % page_size
    return L - lp, lp, (lp + (num_steps + page_size - 1)) // page_size


def branch_step_positions_device(seq_lens: torch.Tensor, topk: int, num_steps: int, page_size: int) -> torch.Tensor:
    """TR-015, :func:`branch_step_positions` for every request: int64 ``[B, k, S]`` row positions
    ``prefix_base + t*npp*P + lp + j``, summed as ``(L + j) + (npp*P) * t`` (prefix_base + lp = L)."""
    _, _, npp = branch_geometry_device(seq_lens, num_steps, page_size)
    t = const_arange(topk, seq_lens.device)[None, :, None]
    j = const_arange(num_steps, seq_lens.device)[None, None, :]
    return (seq_lens.long()[:, None, None] + j) + (npp * page_size)[:, None, None] * t


def assign_draft_cache_locs_device(kv: KVCache, rows: torch.Tensor, seq_lens: torch.Tensor, topk: int,
                                   num_steps: int) -> torch.Tensor:
    """:func:`assign_draft_cache_locs` from device ``rows`` / ``seq_lens`` ``[B]``: int64 ``[B*k*S]``
    (layout ``[B, k, S]``), one gather from ``req_to_token``, no host read."""
    pos = branch_step_positions_device(seq_lens, topk, num_steps, kv.page_size).flatten(1)
    return kv.req_to_token[rows.long()[:, None], pos].long().flatten()


def _tail_copy_slots_device(kv: KVCache, rows: torch.Tensor, seq_lens: torch.Tensor, topk: int, num_steps: int):
    """:func:`tail_copy_slots` from device ``rows`` / ``seq_lens`` ``[B]``: its device form (the
    production twin of the host-list form), fixed shape, padded with slot 0 -> slot 0."""
    P, dev = kv.page_size, kv.device
    if P == 1:
        z = torch.zeros(0, dtype=torch.long, device=dev)
        return z, z
    base, lp, npp = (x[:, None, None] for x in branch_geometry_device(seq_lens, num_steps, P))
    i = const_arange(P - 1, dev)[None, None, :]
    t = const_arange(topk - 1, dev, start=1)[None, :, None]  # branches 1 .. k-1
    src_pos = base + i  # [B, 1, P-1]: the committed tail (and past it, padding)
    pos = torch.stack([src_pos.expand(-1, topk - 1, -1), src_pos + (npp * P) * t])  # [2, B, k-1, P-1]
    slots = kv.req_to_token[rows.long()[None, :, None, None], pos].long().masked_fill(i >= lp, 0)  # i >= lp: 0 -> 0
    return slots[0].flatten(), slots[1].flatten()


def move_kv_cache(pool, tgt: torch.Tensor, src: torch.Tensor) -> None:
    """``pool[tgt] = pool[src]`` in every layer (gather first: overlapping src / tgt are safe).
    ``tgt``, ``src`` int64 ``[M]`` flat slots.  The rule is the pool's own ``move_kv_cache``
    (:meth:`KVPool.move_kv_cache <refspec.core.kv_cache.KVPool.move_kv_cache>`: K and V together;
    :meth:`MLAKVPool.move_kv_cache <refspec.core.kv_cache.MLAKVPool.move_kv_cache>`: whole latent
    rows, ML-012), as upstream's pools each have one.  On a CUDA device with Triton, an MHA pool's
    moves of at most 256 slots run as one kernel for all layers, the rule's fused twin
    (:func:`refspec.speculative.tree.move_kernel.move_kv_cache_fused`)."""
    if tgt.numel() == 0:
        return
    if isinstance(pool, KVPool) and move_kernel.available(tgt.device) and tgt.numel() <= move_kernel.MAX_SLOTS:
        move_kernel.move_kv_cache_fused(pool, tgt.long().contiguous(), src.long().contiguous())
        return
    pool.move_kv_cache(tgt, src)


# ------------------------------------------------------------------ accepted-path compaction
def get_src_tgt_cache_loc(seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, accept_index: torch.Tensor,
                          num_correct_drafts: torch.Tensor, num_draft_tokens: int, page_size: int):
    """TR-017, upstream ``get_src_tgt_cache_loc``: the accepted nodes' slots and what to free.

    Shapes: seq_lens [B] (L), out_cache_loc int64 [B*N] (node i of request b at ``b*N + i``),
    accept_index int [B, S+1] (flat node ids, -1 padded), num_correct_drafts [B] (n).
    Returns ``src`` int64 [sum(n + 1)] (request-major, path order), ``keep_len`` [B] =
    ``min(ceil_P(L + n + 1), L + N)`` and ``to_free_num_slots`` [B] = ``L + N - keep_len``.

    Readable twin (upstream's form, with :func:`get_target_cache_loc`) of
    :func:`path_to_window_slots` and the frees of :func:`compact_accepted_path`, which the rounds run.
    """
    src = out_cache_loc[accept_index[accept_index >= 0].long()]
    extended = seq_lens.long() + num_draft_tokens
    keep = torch.minimum((seq_lens.long() + num_correct_drafts.long() + 1 + page_size - 1)
                         // page_size * page_size, extended)
    return src, keep, extended - keep


def get_target_cache_loc(out_cache_loc: torch.Tensor, num_correct_drafts: torch.Tensor,
                         to_free_num_slots: torch.Tensor, num_draft_tokens: int):
    """TR-017, upstream ``get_target_cache_loc``: ``tgt`` = the first n + 1 verify slots of each
    request, ``to_free`` = its last ``to_free_num_slots`` verify slots (both int64, request-major).

    Readable twin, with :func:`get_src_tgt_cache_loc`, of :func:`path_to_window_slots`."""
    N = num_draft_tokens
    rows = out_cache_loc.view(-1, N)
    tgt, free = [], []
    for b, (n, f) in enumerate(zip(num_correct_drafts.tolist(), to_free_num_slots.tolist())):
        tgt.append(rows[b, :n + 1])
        free.append(rows[b, N - f:])
    return torch.cat(tgt), torch.cat(free)


def path_to_window_slots(out_cache_loc: torch.Tensor, accept_index: torch.Tensor,
                         num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tgt, src)`` int64 ``[B*W]``: entry (b, j) of the accepted path (``accept_index`` [B, W],
    flat node ids, -1 padded, ``W <= N``) moves ``out_cache_loc[accept_index[b, j]]`` to the j-th
    verify slot ``out_cache_loc[b*N + j]``; a padded entry is slot 0 -> slot 0 (the reserved
    dummy page, PA-008).  Device only: no host read, no data-dependent shape.

    Production twin of the readable :func:`get_src_tgt_cache_loc` / :func:`get_target_cache_loc`
    (the same moves, plus slot 0 -> slot 0 no-ops)."""
    B, W = accept_index.shape
    padded = accept_index < 0
    window = out_cache_loc.view(B, num_draft_tokens)[:, :W]
    tgt = window.masked_fill(padded, 0).flatten()
    src = out_cache_loc[accept_index.clamp(min=0).long()].masked_fill(padded, 0).flatten()
    return tgt, src


def compact_accepted_path(kv: KVCache, target_pool: KVPool, rows: list[int], seq_lens: list[int],
                          out_cache_loc: torch.Tensor, accept_index: torch.Tensor,
                          num_accept: list[int], num_draft_tokens: int) -> list[int]:
    """TR-017 (v1), once a is on the host: move the accepted KV to the front, free the whole
    pages past ``keep_len = min(ceil_P(L + a), L + N)``.

    ``accept_index`` [B, S+1] (device, flat node ids, -1 padded), ``num_accept`` the host a per
    request (the v1 round's one read).  The move is :func:`path_to_window_slots` +
    :func:`move_kv_cache` on the device; the frees use the allocator's host mirror
    (``free_tail``, KV-004's page rule: the page of position L + a - 1 stays).  After it,
    positions L..L+a-1 of each row hold the path's target KV (in path order) and the row owns
    exactly ``ceil(keep_len / P)`` pages.  Returns ``keep_len`` per request.  Raises:
    InvariantError TR-017 if a page backing a kept position was freed.  Upstream computes
    the same slots with ``get_src_tgt_cache_loc`` / ``get_target_cache_loc`` (above: the
    readable form, with its device reads).
    """
    N, P = num_draft_tokens, kv.page_size
    tgt, src = path_to_window_slots(out_cache_loc, accept_index[:, :min(accept_index.shape[1], N)], N)
    move_kv_cache(target_pool, tgt, src)
    keep_len = []
    for r, L, a in zip(rows, seq_lens, num_accept):
        kv.free_tail(r, keep_len=L + a, alloc_len=L + N)
        keep = min(-(-(L + a) // P) * P, L + N)
        freed = [p for p in kv.row_pages(r, keep) if not kv.allocator.is_in_use(p)]
        require(not freed, "TR-017", f"row {r}: pages {freed} are freed but back positions < keep_len {keep}")
        keep_len.append(keep)
    return keep_len
