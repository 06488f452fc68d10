"""Batch builders for the overlap loop: lengths on the device, upper bounds on the host.

In the overlap loop the host launches round k+1 before it has read round k's accept counts, so
it does not know the committed length L of round k+1; the device does (the future map's
``seq_lens``, :mod:`refspec.speculative.future`).  These builders take

* ``seq_lens`` ``[B]`` int64 or int32 on the device: the exact L (or L + N) per request (the
  batches' ``seq_lens`` are int32: given int32, no builder converts it again);
* ``seq_lens_hi``: a host list of upper bounds, ``seq_lens_hi[b] >= seq_lens[b]``;

and compute ``positions = seq_lens[b] + i`` and ``out_cache_loc = req_to_token[r_b, positions]``
on the device (one indexing op), with no device -> host read.  The bound goes into
``seq_lens_cpu`` with ``seq_lens_cpu_is_bound = True``: the FA3 metadata takes
``max_seqlen_k`` and the page-table slice width from it (MD-006), while the kernel reads the
exact per-request ``cache_seqlens`` on the device.  SGLang does the same once
``seq_lens_cpu`` is gone: FA3 sets ``needs_cpu_seq_lens = False`` and sizes the page table from
a static bound (``python/sglang/srt/layers/attention/flashattention_backend.py``,
``FlashAttentionBackend.__init__``; ``decide_needs_cpu_seq_lens`` in
``python/sglang/srt/managers/overlap_utils.py``).

==================  ================  ===========================  =====================
builder             ``seq_lens``      positions (q rows)           ``seq_lens_cpu``
==================  ================  ===========================  =====================
draft decode steps  L                 L .. L + Sd - 2 (Sd - 1)     L_hi
TARGET_VERIFY       L                 L .. L + N - 1 (N)           L_hi
DRAFT_EXTEND_V2     L + N             L .. L + N - 1 (N)           L_hi + N
==================  ================  ===========================  =====================

The three share one window: positions L .. L + N - 1 and their slots are gathered once per round
(:func:`round_window`); each builder takes its first q columns.

Example: L = [5, 9] on the device, L_hi = [8, 12] (N = 4, the previous round still in flight):
verify positions [5..8, 9..12], ``seq_lens_cpu = [8, 12]``, so ``max_seqlen_k = 12 + 4 = 16``
while ``cache_seqlens = [9, 13]``; the page table spans ceil(16 / P) columns.
"""

from __future__ import annotations

import torch

from refspec.core.batch import ForwardBatch, _check_rows
from refspec.core.constants import const_arange, const_full
from refspec.core.kv_cache import KVCache
from refspec.core.modes import ForwardMode


def round_window(kv: KVCache, rows: list[int], rows_dev: torch.Tensor, seq_lens: torch.Tensor,
                 seq_lens_hi: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``L_b .. L_b + width - 1`` and their slots: ``(pos, loc)``, both int64 ``[B, width]``.

    Rows checked on the host (PA-008, MD-012).  Raises ValueError if a bound's window
    ``seq_lens_hi[b] + width`` passes the ``req_to_token`` width (KV-005's reserve keeps it inside).
    """
    _check_rows(kv, rows, seq_lens_hi)
    W = kv.req_to_token.shape[1]
    for b, hi in enumerate(seq_lens_hi):
        if hi + width > W:
            raise ValueError(f"request {b}: bound {hi} + {width} positions past the req_to_token width {W}")
    pos = seq_lens[:, None] + const_arange(width, seq_lens.device)
    return pos, kv.req_to_token[rows_dev[:, None], pos].long()


def _future_build(mode, kv: KVCache, rows: list[int], rows_dev: torch.Tensor, seq_lens: torch.Tensor,
                  seq_lens_hi: list[int], window, q: int, **fields) -> ForwardBatch:
    """q tokens per request: the first q columns of ``window`` (:func:`round_window`, or None:
    gather it here from the batch's start positions)."""
    if window is None:
        start = seq_lens - (fields.get("num_draft_tokens", 0) if mode.is_draft_extend_v2() else 0)
        hi = [h - (q if mode.is_draft_extend_v2() else 0) for h in seq_lens_hi]
        window = round_window(kv, rows, rows_dev, start, hi, q)
    pos, loc = (w[:, :q].flatten() for w in window)  # request-major [B * q] (a copy when q < width)
    return ForwardBatch(forward_mode=mode, req_pool_indices=rows_dev, seq_lens=seq_lens.to(torch.int32),
                        seq_lens_cpu=torch.tensor(seq_lens_hi, dtype=torch.long), out_cache_loc=loc,
                        positions=pos, seq_lens_cpu_is_bound=True, **fields)


def draft_decode_steps_batch_future(kv, rows, rows_dev, seq_lens, seq_lens_hi, num_steps,
                                    window=None) -> ForwardBatch:
    """All Sd - 1 draft-decode steps at L .. L + Sd - 2 (request-major, as
    :func:`refspec.core.batch.draft_decode_steps_batch`)."""
    return _future_build(ForwardMode.DECODE, kv, rows, rows_dev, seq_lens, list(seq_lens_hi), window, num_steps - 1)


def verify_batch_future(kv, rows, rows_dev, seq_lens, seq_lens_hi, num_draft_tokens, window=None) -> ForwardBatch:
    """TARGET_VERIFY: ``seq_lens`` L; N tokens at L .. L + N - 1."""
    return _future_build(ForwardMode.TARGET_VERIFY, kv, rows, rows_dev, seq_lens, list(seq_lens_hi), window,
                         num_draft_tokens, num_draft_tokens=num_draft_tokens)


def draft_extend_v2_batch_future(kv, rows, rows_dev, seq_lens, seq_lens_hi, num_draft_tokens,
                                 window=None) -> ForwardBatch:
    """DRAFT_EXTEND_V2 after a verify at L (``seq_lens`` and the bound are L's): ``seq_lens``
    L + N; N tokens at L .. L + N - 1."""
    N, B = num_draft_tokens, len(rows)
    ext = const_full(B, N, torch.int32, seq_lens.device)
    return _future_build(ForwardMode.DRAFT_EXTEND_V2, kv, rows, rows_dev, seq_lens + N,
                         [h + N for h in seq_lens_hi], window, N, num_draft_tokens=N,
                         extend_seq_lens=ext, extend_seq_lens_cpu=[N] * B)
