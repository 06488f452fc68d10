"""Eager FA3 attention metadata per forward mode (SGLang ``init_forward_metadata``, top-k = 1).

Mirrors ``flashattention_backend.py`` ``init_forward_metadata``
at ``0bfe1d145`` (#11874; the same code in v0.5.5, line 365), MD-003.  For request b, with L
its committed length before the forward (the legend's L; ``seq_lens`` per mode is the table of
:mod:`refspec.core.batch`):

==================  =====  ============  =====================  ==============================  =============
mode                q_b    ``seq_lens``  ``cache_seqlens`` K_b  ``cu_seqlens_q``                ``max_seq_len_q``
==================  =====  ============  =====================  ==============================  =============
DECODE              1      L + 1         seq_lens = L + 1       arange(0..B)                    1
draft decode s      1      L             L + s + 1              arange(0..B)                    1
EXTEND, no prefix   e      e             seq_lens = e           = cu_seqlens_k                  max_seq_len_k
EXTEND, prefix      e      prefix + e    seq_lens               [0, cumsum e]                   max e
TARGET_VERIFY       N      L             L + N                  arange(0, B*N + 1, N)           N
DRAFT_EXTEND (v1)   a      L + a         seq_lens = L + a       [0, cumsum a] (packed)          max a
DRAFT_EXTEND_V2     N      L + N         seq_lens = L + N       [0, cumsum extend] (uniform N)  max extend
IDLE                -      []            []                     [0]                             1
==================  =====  ============  =====================  ==============================  =============

Every mode: ``cu_seqlens_k = [0, cumsum K]`` (bookkeeping: SGLang passes it as
``cu_seqlens_k_new``, which FA3 ignores without new k/v, docs/fa3-contract.md),
``max_seq_len_k = max K`` from the CPU mirror (no device sync, MD-006; in the overlap loop from
its upper bound, :mod:`refspec.core.future_batch`), and
``page_table = req_to_token[r, 0:max_seq_len_k:P] // P`` (MD-007; plain slots when P = 1).

Worked example (P = 4, N = 4): two requests with committed L = [5, 9] in TARGET_VERIFY give
K = [9, 13], cu_seqlens_q = [0, 4, 8], max_seq_len_k = 13, page_table width ceil(13/4) = 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refspec.core.args import count
from refspec.core.batch import ForwardBatch


@dataclass
class FlashAttentionMetadata:
    """What ``flash_attn_with_kvcache`` is fed (SGLang ``FlashAttentionMetadata``).

    Shapes (B requests, or Bg padded graph rows): ``cache_seqlens_int32`` int32 [B] (K_b,
    tokens); ``cu_seqlens_q`` int32 [B+1] (rows); ``cu_seqlens_k`` int32 [B+1] (tokens);
    ``page_table`` int32 [B, M] (pages); ``max_seq_len_q`` / ``max_seq_len_k`` Python ints.
    """

    cache_seqlens_int32: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seq_len_q: int
    max_seq_len_k: int
    page_table: torch.Tensor


def cumsum0(x: torch.Tensor) -> torch.Tensor:
    """``[0, x0, x0+x1, ...]`` as int32 (``torch.nn.functional.pad(cumsum(x), (1, 0))``)."""
    return torch.nn.functional.pad(torch.cumsum(x, dim=0, dtype=torch.int32), (1, 0))


def strided_page_table(req_to_token, req_pool_indices, max_seq_len_k: int, page_size: int) -> torch.Tensor:
    """``req_to_token[r, 0:max_seq_len_k:P] // P``: int32 ``[B, ceil(max_seq_len_k / P)]`` (pages).

    MD-007: the first slot of each page, divided by P, is the page id.  Lossless only if
    every row is page-contiguous (INV-PAGE, PA-001), which the paged allocator guarantees.
    With P = 1 slots are page ids and this is the token-level table itself.
    Raises: ValueError if ``page_size`` is not an int >= 1 or ``max_seq_len_k`` not an int >= 0.
    """
    count("strided_page_table: page_size", page_size, 1)
    count("strided_page_table: max_seq_len_k", max_seq_len_k, 0)
    rows = req_to_token[req_pool_indices, :max_seq_len_k]
    table = rows if page_size == 1 else rows[:, ::page_size] // page_size
    # a fresh row-major copy: FA3 requires stride(-1) == 1, which .contiguous() does not
    # guarantee for a width-1 table (size-1 dims keep any stride)
    return torch.empty(table.shape, dtype=torch.int32, device=table.device).copy_(table)


def mode_delta(fb: ForwardBatch, speculative_step_id: int | None) -> int:
    """K_b - seq_lens_b for the modes whose K is ``seq_lens + delta`` (MD-003).

    TARGET_VERIFY: N (MD-011).  Draft decode step s: s + 1 (MD-010).  All other modes: 0; in
    particular DRAFT_EXTEND_V2, whose ``seq_lens`` already counts the N tokens (MD-008).
    """
    m = fb.forward_mode
    if m.is_target_verify():
        return fb.num_draft_tokens
    if m.is_decode() and speculative_step_id is not None:
        return speculative_step_id + 1
    return 0


def eager_cache_seqlens(fb: ForwardBatch, delta: int) -> tuple[torch.Tensor, int]:
    """``cache_seqlens = seq_lens + delta`` (int32 ``[B]``, tokens) and ``max_seq_len_k`` from
    the CPU mirror, ``max(seq_lens_cpu) + delta`` (no device sync, MD-006).

    The same formula in every mode; v1 draft extend's ``seq_lens`` is already L + a, so its
    keys stop at the last accepted token (MD-003).
    """
    return (fb.seq_lens + delta).to(torch.int32), int(fb.seq_lens_cpu.max()) + delta


def eager_query_layout(fb: ForwardBatch, cu_k: torch.Tensor, max_k: int) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens_q, max_seq_len_q)`` per mode (the module table, MD-002).

    DECODE (and draft decode): ``arange(B + 1)``, 1.  TARGET_VERIFY: ``arange(0, B*N + 1, N)``,
    N.  DRAFT_EXTEND (v1): ``[0, cumsum a]`` packed, ``max a`` (MD-009).  EXTEND and
    DRAFT_EXTEND_V2: ``[0, cumsum extend_seq_lens]``, ``max e``; an EXTEND with no prefix has
    q = K, so it reuses ``cu_seqlens_k`` / ``max_seq_len_k``.
    """
    m, B = fb.forward_mode, fb.batch_size
    i32 = dict(dtype=torch.int32, device=cu_k.device)
    if m.is_decode():
        return torch.arange(B + 1, **i32), 1
    if m.is_target_verify():
        N = fb.num_draft_tokens
        return torch.arange(0, B * N + 1, N, **i32), N
    if m.is_draft_extend():  # v1: packed by num_accept_tokens (a = n + 1)
        return cumsum0(fb.num_accept_tokens), max(fb.num_accept_tokens_cpu)
    ext_cpu = fb.extend_seq_lens_cpu  # EXTEND, DRAFT_EXTEND_V2: [0, cumsum extend_seq_lens]
    has_prefix = m.is_draft_extend_v2() or any(L != e for L, e in zip(fb.seq_lens_cpu.tolist(), ext_cpu))
    if has_prefix:
        return cumsum0(fb.extend_seq_lens), max(ext_cpu)
    return cu_k, max_k


def init_forward_metadata(fb: ForwardBatch, req_to_token: torch.Tensor, page_size: int,
                          speculative_step_id: int | None = None) -> FlashAttentionMetadata:
    """Eager metadata for ``fb`` (see the module table).

    Args: ``speculative_step_id`` is s for the draft-decode backend of step s, else None.
    Raises: nothing itself; ``refspec.fa3.validate`` checks the result against the batch.
    """
    m, dev, B = fb.forward_mode, req_to_token.device, fb.batch_size
    i32 = dict(dtype=torch.int32, device=dev)
    if m.is_idle() or B == 0:
        z = torch.zeros(0, **i32)
        return FlashAttentionMetadata(z, torch.zeros(1, **i32), torch.zeros(1, **i32), 1, 0,
                                      torch.zeros((0, 1), **i32))
    cache_seqlens, max_k = eager_cache_seqlens(fb, mode_delta(fb, speculative_step_id))
    cu_k = cumsum0(cache_seqlens)
    cu_q, max_q = eager_query_layout(fb, cu_k, max_k)
    page_table = strided_page_table(req_to_token, fb.req_pool_indices, max_k, page_size)
    return FlashAttentionMetadata(cache_seqlens, cu_q, cu_k, max_q, max_k, page_table)
