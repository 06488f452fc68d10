"""The production top-k > 1 round under spec v2 (EAGLE tree, ``EAGLEWorkerV2``), with or without overlap.

One round over the running batch at committed lengths L, B requests, k = topk, S = num_steps,
N = num_draft_tokens, R = :func:`~refspec.speculative.tree.kv.alloc_len_per_decode`.  Its inputs
are on the device, in the engine's :class:`~refspec.speculative.tree.future.TreeFutureMap` by
``req_to_token`` row: L, the root t_L, the root children ``topk_p`` / ``topk_index`` and the
draft hidden the previous draft extend left.

0. **reserve** (TR-020, :func:`prepare_tree_v2`, before the round): each row is topped up to
   ``alloc_len = L + R`` positions (overlap: ``ceil_P(L + 2R)``, below).  Nothing is allocated
   or freed inside the round;
1. **draft** (TR-013..TR-015): the branch layout of v1 (branch t, step j at row position
   ``prefix_base + t*npp*P + lp + j``, the partial tail page copied into branches t >= 1), but
   the branch slots are *inside the reserve*: no ``backup_state`` / ``restore_state``; slots,
   tail copies and positions are gathered on the device from the device L (the tail copies by
   the draft forward itself, inside its graph when replayed);
2. **tree** (TR-016) and **verify** (TR-010..TR-012) at ``L .. L+N-1``:
   :func:`~refspec.speculative.tree.device.build_tree_device`;
3. **accept** (TR-016): :func:`~refspec.speculative.tree.device.verify_tree_greedy_device` ->
   ``predict`` [B*N] (0 off the path), ``accept_index`` [B, S+1], n; a = n + 1 stays on the device;
4. **compact** (TR-020): the path's target KV moves to the first a verify slots of each
   request (:func:`move_accept_tokens_to_target_kvcache`); ``predict`` and the target hidden
   are gathered to the front of each request's N-row block (:func:`compact_accept_to_front`);
   both are the verify forward's last work (upstream's ``run_eagle_verify`` tail; inside the
   verify graph when replayed, :meth:`~refspec.speculative.tree.runners.TreeRunners._tree_verify_fn`).
   The rejected branches' slots are *not* freed: they stay in the reserve and the next round's
   draft / verify overwrite them; the row is freed whole when the request finishes (KV-006);
5. **draft extend v2** (TR-021): ``DRAFT_EXTEND_V2`` over the whole verify window, N rows per
   request at KV ``L .. L+N-1`` (``seq_lens = L + N``), tokens = compacted ``predict``, hidden =
   compacted target hidden; row ``b*N + a_b - 1`` (``select_index``) seeds the next round:
   its softmax top-k are the next root children, its hidden the next draft hidden, and
   ``predict`` there (the bonus) the next root, all written to the future map with the next
   L = ``L + a`` (``new_seq_lens = seq_lens + accept_lens``).

Returns ``[B, 3 + N + S]`` on the device: ``[a, c_0 .. c_(N-1), d_1 .. d_S, draft_len, L]`` with
``c[:a]`` the emitted tokens (then -1), ``d`` the accepted drafts (then -1), ``draft_len = L + a``
and the device L the round started from; the engine reads it once after the round
(``"post_round"``).  **No device -> host read inside the round** (``tests/test_tree_overlap.py``
pins every value read of a run to host data).

**Overlap** (``TreeEngine(version="v2", overlap=True)``; the loop is the chain's,
:mod:`refspec.speculative.overlap`): round k+1 is launched before round k's rows are read, so
the host does not know its L.  The engine's launch hook (``TreeEngine._overlap_round``) passes
host bounds ``L_hi`` (``L_hi = L + N`` for a request whose round is in flight, L for a
newcomer) and the round takes L from the future map; ``seq_lens_cpu`` holds the bounds
(``seq_lens_cpu_is_bound``, MD-006: they size ``max_seqlen_k`` and the page tables), the flat
FULL_MASK is sized ``sum(L_hi) * N + B*N*N`` (its blocks at the exact device offsets, the unused
tail True).  The reserve is upstream's 2x: ``ceil((L + 2R) / P) * P`` past the host's L (the
start of the round in flight), so the exact start ``L' <= L + N <= L + R`` still has its R
positions (:func:`reserve_len`).  Finishes are seen one round late and their rows dropped
(``RoundTrace.discarded``), as in the chain's overlap loop.

Upstream, sgl-project/sglang v0.5.23:

* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_worker_v2.py
  ``EAGLEWorkerV2.forward_batch_generation`` (draft -> verify -> ``_draft_extend_for_decode``),
  ``EagleDraftWorker._draft_extend_for_decode`` (``num_tokens_per_req =
  speculative_num_draft_tokens``; ``select_index = arange(0, B*N, N) + accept_lens - 1``);
* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_worker_common.py
  ``prepare_for_draft`` (the page > 1 branch positions, ``duplicate_prefix_tail_to_draft_branches``),
  ``run_eagle_verify`` -> ``_finalize_accept_tree_path`` / ``_compact_accept_to_front``,
  ``prepare_for_draft_extend`` (``DRAFT_EXTEND_V2``, ``seq_lens + num_draft_tokens``);
* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/spec_utils.py
  ``move_accept_tokens_to_target_kvcache``;
* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/allocation_sizing.py
  ``get_alloc_len_per_decode`` / ``get_alloc_reserve_per_decode``, and ``eagle_utils.py``
  ``eagle_prepare_for_decode`` (the reserve);
* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/managers/scheduler.py
  ``event_loop_overlap`` and ``managers/overlap_utils.py`` ``FutureMap`` (the overlap schedule).

Where refspec differs from upstream: (1) without overlap the reserve is 1x (upstream always
reserves ``2 * get_alloc_len_per_decode()``, rounded up to whole pages); (2) overlap is off
unless asked for (upstream's v2 worker overlaps by default), and refspec's overlap loop is the
one of :mod:`refspec.speculative.overlap` (one result read per round, after the next launch;
finishes one round late), not upstream's scheduler with its separate forward thread / stream;
(3) tree building and acceptance are torch tensor programs
(:mod:`refspec.speculative.tree.device`) where upstream calls one CUDA kernel each
(``build_tree_kernel_efficient``, ``verify_tree_greedy``): ``organize_draft_results`` and the
tree's length-free structure run inside the draft graph (its last ops), the target's argmax and
the greedy walk, the path's KV move and the compaction inside the verify graph; the draft
slots and positions, the flat mask (its size is a host value) and the draft-extend seeds are
assembled eagerly between the graphs;
(4) the tail copies are a fixed-shape gather padded with slot 0 -> slot 0 copies (upstream's
``duplicate_prefix_tail_to_draft_branches`` kernel copies exactly lp slots per branch);
(5) draft step s runs at position L + s (SD-007).
"""

from __future__ import annotations

import torch

from refspec.core.future_batch import draft_extend_v2_batch_future
from refspec.core.invariants import require
from refspec.core.kv_cache import KVPool
from refspec.speculative.round_row import pack
from refspec.speculative.tree import kv as tree_kv
from refspec.speculative.tree.build import draft_topk
from refspec.speculative.tree.device import const_arange
from refspec.speculative.tree.runners import draft_in_branches, round_inputs, tree_verify_accept


# ------------------------------------------------------------------ KV rules (TR-020)
def reserve_len(L: int, R: int, P: int, overlap: bool) -> int:
    """The positions a row holds before a v2 tree round launched at host-known L (tokens).

    Non-overlapped: ``L + R`` (the exact L).  Overlap: ``ceil((L + 2R) / P) * P``, where L is
    the start of the round in flight, so the exact start ``L' <= L + N <= L + R`` of the new
    round still has its R positions (upstream's ``2 * get_alloc_len_per_decode()``).
    """
    return -(-(L + 2 * R) // P) * P if overlap else L + R


def prepare_tree_v2(eng, reqs, overlap: bool = False) -> None:
    """Before a v2 tree round: top each row up to :func:`reserve_len` (TR-020).

    R = :func:`~refspec.speculative.tree.kv.alloc_len_per_decode` (tokens); the row keeps any
    larger ``alloc_len`` it already has (upstream ``max(kv_allocated_len, ...)``).
    """
    R = tree_kv.alloc_len_per_decode(eng.topk, eng.Sd, eng.N, eng.P)
    want = [reserve_len(r.seq_len, R, eng.P, overlap) for r in reqs]
    need = [(r, w) for r, w in zip(reqs, want) if r.alloc_len < w]
    if need:
        eng.kv.alloc_extend([r.row for r, _ in need], [r.alloc_len for r, _ in need], [w for _, w in need])
    for r, w in need:
        r.alloc_len = w


def move_accept_tokens_to_target_kvcache(pool: KVPool, out_cache_loc: torch.Tensor, accept_index: torch.Tensor,
                                         num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TR-020: the accepted path's target KV to the first a verify slots of each request, in place.

    ``out_cache_loc`` int64 [B*N] (the verify window, node i of request b at ``b*N + i``),
    ``accept_index`` [B, S+1] (flat node ids of the path, -1 padded).  Entry (b, j) moves
    ``out_cache_loc[accept_index[b, j]]`` to ``out_cache_loc[b*N + j]``; a padded entry moves
    slot 0 to slot 0 (the reserved dummy page, PA-008), as upstream's zero-filled
    ``tgt_cache_loc`` / ``accept_out_cache_loc`` tails do.  Gathered first, so a path node
    already at its target (j = node) and overlapping moves are safe.  Device only: no host read.
    Returns ``(tgt, src)`` int64 [B*(S+1)].
    """
    tgt, src = tree_kv.path_to_window_slots(out_cache_loc, accept_index, num_draft_tokens)
    tree_kv.move_kv_cache(pool, tgt, src)
    return tgt, src


def compact_accept_to_front(x: torch.Tensor, accept_index: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """TR-021, upstream ``_compact_accept_to_front``: the path to the front of each N-row block.

    ``x`` [B*N, ...] node-indexed (``predict``, or the target hidden); ``accept_index`` [B, S+1].
    Row ``b*N + j`` of the result is ``x[accept_index[b, j]]`` for j <= S, where a padded (-1)
    entry clamps to flat row 0 (request 0's root: upstream reads the same, past a, never kept);
    rows j > S keep their own value.  Returns a new tensor, ``x`` is not modified.
    """
    B, W = accept_index.shape
    require(W <= num_draft_tokens, "TR-021", f"accept_index has {W} columns, the window only N = {num_draft_tokens}")
    own = const_arange(B * num_draft_tokens, x.device).view(B, num_draft_tokens)[:, W:]  # rows j > S: their own
    return x[torch.cat([accept_index.clamp(min=0).long(), own], dim=1).flatten()]  # one gather


# ------------------------------------------------------------------ the round
def round_tree_v2(eng, reqs, seq_lens_hi: list[int] | None = None) -> torch.Tensor:
    """One v2 top-k round over ``reqs`` (module doc); :func:`prepare_tree_v2` must have run.

    The committed lengths L come from the engine's future map (device); ``seq_lens_hi`` are
    host upper bounds of them (the overlap schedule), or None: the host's exact ``seq_len``.
    Returns the device rows ``[B, 3 + N + S]`` int64 (module doc; the last column is the device
    L, checked against the host's by the overlap loop, SD-008).  Leaves each request's next
    L, root, root children and draft hidden in the future map.  No device -> host read.
    Raises: InvariantError TR-020 when a row's reserve does not hold the branch regions and the
    verify window of its bound (``alloc_len >= hi + R``).
    """
    kv, k, S, N, P = eng.kv, eng.topk, eng.Sd, eng.N, eng.P
    B = len(reqs)
    bound = seq_lens_hi is not None
    hi = list(seq_lens_hi) if bound else [r.seq_len for r in reqs]
    R = tree_kv.alloc_len_per_decode(k, S, N, P)
    for r, h in zip(reqs, hi):  # L <= hi, and every L' <= hi needs L' + R positions (branches, verify)
        require(r.alloc_len >= h + R, "TR-020", f"request {r.rid}: a round at L <= {h} needs {h + R} positions "
                                                f"with slots (branches and verify window), the row holds {r.alloc_len}")
    rows_dev, L, roots, x, dhid = round_inputs(eng, reqs)
    # 1. draft: the branch slots are inside the reserve (no allocation)
    drafted = (eng.runners._tree_draft_fn(None, x) if S == 1
                               else draft_in_branches(eng, reqs, rows_dev, L, hi, bound, x, dhid))
    # 2.-3. the tree, verify at L..L+N-1 (the slots exist), accept: a = n + 1 stays on the device
    tree, fb, target_predict, hidden, predict, accept_index, n, window = tree_verify_accept(
        eng, reqs, rows_dev, L, hi, bound, roots, drafted)
    a = n + 1
    # 4. compact: the verify forward moved the path KV to the first a verify slots and returned
    # predict and hidden at the front (TreeRunners._tree_verify_fn); nothing freed.  A path has at
    # most min(S + 1, N) nodes: with N < S + 1 the last columns are all -1 (dropped)
    eng.observe("tree_accept", reqs=reqs, parents=tree["parents"], accept_index=accept_index[:, :min(S + 1, N)],
                draft_tokens=tree["draft_tokens"], target_predict=target_predict)  # for recorders
    hidden = hidden if eng.draft.uses_hidden else None  # else the extend ignores it
    # 5. draft extend v2 over the whole window: N rows at L..L+N-1 (seq_lens = L + N); keep b*N + a_b - 1
    de = draft_extend_v2_batch_future(kv, [r.row for r in reqs], rows_dev, L, hi, N, window)
    de.seq_lens_cpu_is_bound = bound
    de.num_accept_tokens = a.to(torch.int32)  # SGLang's spec_info.num_accept_tokens; no rule reads it (chain round_v2)
    dl, dh = eng.runners.draft_extend(de, predict, hidden)
    eng.observe("draft_extend", reqs=reqs, fb=de)
    keep = const_arange(B, a.device, step=N) + n  # select_index = b*N + a - 1 (a - 1 = n)
    topk_p, topk_index = draft_topk(dl[keep], k)
    L_next = L + a  # new_seq_lens; draft_len: the kept row's KV index + 1
    eng.future.stash_tree(rows_dev, seq_lens=L_next, root=predict[keep], topk_p=topk_p, topk_index=topk_index,
                          hidden=dh[keep] if eng.draft.uses_hidden else None)
    pv, j = predict.view(B, N), const_arange(N, a.device)[None]
    c = pv.masked_fill(j >= a[:, None], -1)  # the a emitted tokens, then -1
    m = min(N, S)
    d = pv[:, :m].masked_fill(j[:, :m] >= n[:, None], -1)  # the a - 1 accepted drafts, then -1
    if m < S:  # N < S: no window row past N holds a draft
        d = torch.cat([d, d.new_full((B, S - m), -1)], dim=1)
    return pack(a, c, d, L_next, L)
