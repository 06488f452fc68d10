"""The replacement functions of :mod:`refspec.mutants.variants`: one small wrong rule each.

Each has the signature of the production seam it replaces (named in its variant's ``target``).
Where a variant changes one mode only, the others go to the original, called through
:data:`_orig`: names bound here at import, which :func:`refspec.mutants.replace.replaced` never
rebinds (it skips :mod:`refspec.mutants`).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.core import batch as core_batch
from refspec.core.invariants import require
from refspec.fa3 import graph_metadata as gm
from refspec.fa3 import metadata as md
from refspec.graphs import runner as graph_runner

# the originals, bound once here (never rebound: the replacements call them)
_orig = {
    "mode_delta": md.mode_delta, "eager_cache_seqlens": md.eager_cache_seqlens,
    "eager_query_layout": md.eager_query_layout, "draft_extend_rows": gm.draft_extend_rows,
    "write_draft_extend_cu_q": gm.write_draft_extend_cu_q, "replay_page_table": gm.replay_page_table,
    "capture_query_rows": gm.capture_query_rows, "pad_rows": graph_runner.pad_rows,
    "tail_positions": core_batch.tail_positions,
}


def slots_as_pages(mdata, fb, req_to_token, strided_indices, max_k, page_size):
    """seed-page-table: verify and draft-decode replays copy token slots, not page ids."""
    if page_size > 1 and (fb.forward_mode.is_target_verify() or fb.is_draft_decode):
        width = mdata.page_table.shape[1]
        require(max_k <= width, "CG-008", lambda: f"seed-page-table: the replay copies max K = {max_k} token "
                f"slots into the graph page table, which has {width} columns (one per page); an engine whose "
                "req_to_token is at least P * max K wide holds them (refspec.mutants.sizing.roomy_sizes)")
        rows = req_to_token[fb.req_pool_indices[: mdata.page_table.shape[0]]]
        mdata.page_table[:, :max_k].copy_(rows[:, :max_k])  # 93470a141 (#5090): no ::P, no // P
        return
    _orig["replay_page_table"](mdata, fb, req_to_token, strided_indices, max_k, page_size)


def rebind_page_table(mdata, fb, req_to_token, strided_indices, max_k, page_size):
    """replay-rebind-page-table: a new tensor instead of a copy into the captured one."""
    rows = req_to_token[fb.req_pool_indices[: mdata.page_table.shape[0]]]
    mdata.page_table = (rows[:, strided_indices] // page_size).to(torch.int32)


def rebind_cache_seqlens(mdata, seq_lens, delta):
    """replay-rebind-cache-seqlens: ``cache_seqlens`` assigned, ``cu_seqlens_k`` still copied."""
    K = (seq_lens + delta).to(torch.int32)
    mdata.cache_seqlens_int32 = K
    mdata.cu_seqlens_k[1:].copy_(torch.cumsum(K, 0, dtype=torch.int32))


def uniform_cu_q(mdata, rows):
    """de-v1-uniform-cu-q: v2's uniform layout, W = the frozen max_seqlen_q rows per request."""
    _orig["write_draft_extend_cu_q"](mdata, torch.full_like(rows, mdata.max_seq_len_q))


def packed_rows_in_v2(fb, bs):
    """de-v2-packed-cu-q: v2 rows from v1's num_accept_tokens."""
    if fb.forward_mode.is_draft_extend_v2():
        return fb.num_accept_tokens[:bs]
    return _orig["draft_extend_rows"](fb, bs)


def accept_rows_minus_one(fb, bs):
    """de-v1-accept-off-by-one: n = num_correct_drafts instead of a = n + 1."""
    rows = _orig["draft_extend_rows"](fb, bs)
    return rows - 1 if fb.forward_mode.is_draft_extend() else rows


def delta_counts_n_twice(fb, speculative_step_id):
    """de-v2-k-double-count: DRAFT_EXTEND_V2 adds N to a seq_lens that already counts it."""
    if fb.forward_mode.is_draft_extend_v2():
        return fb.num_draft_tokens
    return _orig["mode_delta"](fb, speculative_step_id)


def v1_k_includes_rejected(fb, delta):
    """de-v1-attend-rejected: eager v1 draft extend K = L + N (every verify slot), not L + a."""
    if not fb.forward_mode.is_draft_extend():
        return _orig["eager_cache_seqlens"](fb, delta)
    a_cpu = torch.tensor(fb.num_accept_tokens_cpu)
    K = (fb.seq_lens - fb.num_accept_tokens + fb.num_draft_tokens).to(torch.int32)
    return K, int((fb.seq_lens_cpu - a_cpu).max()) + fb.num_draft_tokens


def verify_as_decode(fb, cu_k, max_k):
    """verify-as-decode: TARGET_VERIFY takes the DECODE layout (one row per request)."""
    if fb.forward_mode.is_target_verify():
        return torch.arange(fb.batch_size + 1, dtype=torch.int32, device=cu_k.device), 1
    return _orig["eager_query_layout"](fb, cu_k, max_k)


def capture_q_of_dummy_batch(fb, bs, num_tokens):
    """capture-max-seqlen-q-small: draft extend captured with the dummy batch's q = 1 (frozen)."""
    if fb.forward_mode.is_draft_extend(include_v2=True):
        return 1
    return _orig["capture_query_rows"](fb, bs, num_tokens)


#: the model context (tokens) the B07 variant sizes from: its probe replays at this wall
B07_CONTEXT = 64


def width_from_context(req_to_token, page_size):
    """page-table-width-from-context: ceil(max_context / P) columns (the model's context,
    :data:`B07_CONTEXT`, captured here: production never needs it), no speculative headroom."""
    return -(-B07_CONTEXT // page_size)


def pad_nothing(buf, name, start, stop, mode, W):
    """stale-padded-rows: padded rows keep whatever the previous replay left there (an empty copy)."""
    return buf[start:start], buf[start:start]


def pad_with_live_row(buf, name, start, stop, mode, W):
    """pad-rows-live-page: padded rows get the first live request's row instead of row 0."""
    if name == "req_pool_indices" and start > 0:
        return buf[start:stop], buf[:1].expand(stop - start)  # row 0 as this replay's copy writes it
    return _orig["pad_rows"](buf, name, start, stop, mode, W)


def seq_lens_fill_zero(mode, W):
    """pad-seq-lens-zero: padded rows get seq_lens 0."""
    return 0


def free_from_committed_page(keep_len, page_size):
    """free-last-committed-page: free from the start of the page holding keep_len - 1."""
    return max(0, (keep_len - 1) // page_size * page_size)


def step_major_cut(x, B, S1, step):
    """draft-loc-step-major: a step-major cut of the request-major layout."""
    return x.view(S1, B)[step]


def tail_one_early(first, q):
    """positions-one-early: this forward's tokens one position early (first - 1 .. first + q - 2)."""
    return _orig["tail_positions"](max(first - 1, 0), q)


def window_minus_one(layer):
    """fa3-window-minus-one: ``(w - 1, 0)``, a window of w keys instead of w + 1."""
    w = layer.sliding_window_size
    return (w - 1, 0) if w >= 0 else (-1, -1)


def window_edge_exclusive(p, row, K, Q, left):
    """emulator-window-edge: the left window edge exclusive, ``p > last - w``."""
    last = row + K - Q
    vis = p[None, :] <= last
    if left >= 0:
        vis &= p[None, :] > last - left
    return vis


def skip_replay_validate_batch(fb, req_to_token, num_real=None):
    """replay-skips-validate-batch: graph replay never checks the live batch."""
