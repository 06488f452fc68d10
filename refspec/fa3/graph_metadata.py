"""FA3 metadata under CUDA graphs: preallocated buffers, capture, in-place replay (CG-001..CG-006).

What each graphed mode keeps static and what replay rewrites *in place* (never rebinding, CG-001):

===================  ==========================  ====================================================
mode                 static (frozen at capture)  rewritten at every replay (Bg rows, padded)
===================  ==========================  ====================================================
DECODE               cu_seqlens_q = arange,      cache_seqlens <- seq_lens; cu_seqlens_k;
                     max_seqlen_q = 1, width M   page_table[:, :m] <- req_to_token[r, :m*P:P] // P
draft decode step s  same (own buffers per s)    cache_seqlens <- seq_lens + s + 1; cu_k; page_table
TARGET_VERIFY        cu_seqlens_q = arange(0,    cache_seqlens <- seq_lens + N; cu_k; page_table
                     bs*N+1, N), max_q = N
DRAFT_EXTEND (v1)    max_seqlen_q = W = Sd + 1   cache_seqlens <- seq_lens (L + a); cu_k; page_table;
                                                 **cu_seqlens_q[1:] <- cumsum(num_accept_tokens)**
DRAFT_EXTEND_V2      max_seqlen_q = W = Sd + 1   cache_seqlens <- seq_lens (L + N); cu_k; page_table;
                                                 **cu_seqlens_q[1:] <- cumsum(extend_seq_lens)**
                                                 (= [0, W, 2W, ...], uniform)
===================  ==========================  ====================================================

**Where the rewrite runs.**  ``cache_seqlens`` and ``cu_seqlens_k`` depend only on the static
batch's device ``seq_lens``, so they are the captured graph's own first work
(:meth:`GraphMetadataMixin.init_forward_metadata_in_graph`, upstream 0.5.23's hook of that name):
no host launch per replay.  The page table (its width m comes from the CPU bound) and the draft
extend's ``cu_seqlens_q`` are written before the replay
(:meth:`GraphMetadataMixin.init_forward_metadata_replay_cuda_graph`); a validating replay runs the
in-graph writes there too, so that its checks see the values the kernel will read.

m = ceil(max K / P) from the CPU mirror; columns >= m keep stale values, which is harmless
because the kernel never reads page ``>= ceil(K_b / P)`` (PA-007).  The table width M is
``ceil(req_to_token.shape[1] / P)`` (CG-008; sizing it from the context length left no room
for L + N at the context wall: sglang #35985, #29665) and replay raises CG-008 when m > M
instead of letting the kernel run past it.
Capture for DRAFT_EXTEND and DRAFT_EXTEND_V2 is shared (``is_draft_extend(include_v2=True)``,
``160a06cab``, #15207); only replay differs (CG-003, CG-004).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refspec.core.batch import ForwardBatch
from refspec.fa3 import kernel
from refspec.fa3.metadata import FlashAttentionMetadata, cumsum0, mode_delta
from refspec.fa3.validate import validate_batch, validate_metadata
from refspec.core.invariants import InvariantError, require

_TENSORS = ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table")


@dataclass
class GraphState:
    """Buffers of ``init_cuda_graph_state`` (one set per backend): int32 on the pool's device.

    ``cache_seqlens`` [max_bs], ``cu_seqlens_k`` [max_bs+1], ``page_table`` [max_bs, M] (pages),
    ``cu_seqlens_q`` [max_num_tokens+1] (row offsets), ``strided_indices`` [M] (token columns).
    ``captured[(mode, bs)]`` holds the bound metadata and its tensors' addresses.
    """

    max_bs: int
    width: int
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    page_table: torch.Tensor
    strided_indices: torch.Tensor
    captured: dict = field(default_factory=dict)


def _mode_key(fb: ForwardBatch) -> str:
    m = fb.forward_mode
    return "draft_extend" if m.is_draft_extend(include_v2=True) else m.name.lower()


def _check_draft_extend_cu_q(md: FlashAttentionMetadata, fb: ForwardBatch, bs: int) -> None:
    """CG-003 / CG-004: replayed draft-extend ``cu_seqlens_q`` over all
    ``bs`` rows, padding included, equals the token layout the runner filled (CPU mirrors):
    v1 ``[0, cumsum(num_accept_tokens)]``, v2 ``[0, cumsum(extend_seq_lens)]`` = ``[0, W, 2W, ...]``."""
    m = fb.forward_mode
    if not m.is_draft_extend(include_v2=True):
        return
    inv, rows = ("CG-003", fb.num_accept_tokens_cpu) if m.is_draft_extend() else ("CG-004", fb.extend_seq_lens_cpu)
    want = cumsum0(torch.tensor(rows[:bs])).tolist()
    got = md.cu_seqlens_q[: bs + 1].tolist()
    require(got == want, inv, lambda: f"{m.name} replay: cu_seqlens_q {got}, the token layout is {want}")


class GraphMetadataMixin:
    """Graph hooks of :class:`~refspec.fa3.backend.FlashAttentionBackend`."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Preallocate the graph buffers; the page-table width M comes from ``req_to_token``."""
        P, R = self.page_size, self.kv.req_to_token
        kernel.check_graphable(R.device, self.provider)
        M = graph_table_width(R, P)
        i32 = dict(dtype=torch.int32, device=R.device)
        self.graph_state = GraphState(
            max_bs=max_bs, width=M,
            cache_seqlens=torch.zeros(max_bs, **i32),
            cu_seqlens_q=torch.zeros(max_num_tokens + 1, **i32),
            cu_seqlens_k=torch.zeros(max_bs + 1, **i32),
            page_table=torch.zeros((max_bs, M), **i32),
            strided_indices=torch.arange(0, M * P, P, device=R.device).clamp(max=R.shape[1] - 1),
        )

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, fb: ForwardBatch):
        """Bind this (mode, bs)'s metadata to buffer slices and freeze its scalars (CG-006).

        ``fb`` is the runner's static batch (dummy values).  Capture-time outputs are discarded.
        """
        gs = self.graph_state
        q = capture_query_rows(fb, bs, num_tokens)  # frozen as max_seqlen_q (CG-006)
        cu_q = gs.cu_seqlens_q[: bs + 1]
        cu_q.copy_(torch.arange(0, bs * q + 1, q, dtype=torch.int32))
        md = FlashAttentionMetadata(gs.cache_seqlens[:bs], cu_q, gs.cu_seqlens_k[: bs + 1], q, 0,
                                    gs.page_table[:bs, :])
        self._write_page_table(md, fb, bs)  # the dummy values, as every replay writes them
        gs.captured[(_mode_key(fb), bs)] = (md, {n: getattr(md, n) for n in _TENSORS})  # what the graph reads
        self.init_forward_metadata_in_graph(bs, fb)
        self.forward_metadata = md
        return md

    def init_forward_metadata_in_graph(self, bs: int, fb: ForwardBatch) -> None:
        """The part of the replay metadata the graph records as its own first work (upstream 0.5.23's
        ``init_forward_metadata_in_graph``): ``cache_seqlens <- seq_lens + delta`` and
        ``cu_seqlens_k`` (:func:`write_cache_seqlens`), in place (CG-001), from the static batch's
        device ``seq_lens``, so a replay launches no op for them.

        The page table and the draft extend's ``cu_seqlens_q`` stay out of the graph
        (:meth:`init_forward_metadata_replay_cuda_graph`): the table's live columns come from the
        CPU bound.  Upstream records its fused metadata kernel in the graph for DRAFT_EXTEND_V2
        (``draft_extend_set_metadata``) and launches it before the replay for the other modes
        (``normal_decode_set_metadata``),
        `flashattention_backend.py@v0.5.23
        <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L478>`_.
        Raises ValueError when nothing was captured for this mode and ``bs``.
        """
        md, _ = self._captured(fb, bs)
        write_cache_seqlens(md, fb.seq_lens[:bs], mode_delta(fb, self.speculative_step_id))

    def _captured(self, fb: ForwardBatch, bs: int):
        key = (_mode_key(fb), bs)
        if self.graph_state is None or key not in self.graph_state.captured:
            raise ValueError(f"no graph metadata captured for {key} (init_cuda_graph_state and the capture hook "
                             f"come first)")
        return self.graph_state.captured[key]

    def init_forward_metadata_replay_cuda_graph(self, bs: int, fb: ForwardBatch, num_real: int):
        """Rewrite the captured (mode, bs) metadata in place for the padded batch ``fb``, out of the graph:
        the page table over the CPU bound and the draft extend's ``cu_seqlens_q``; the lengths are
        the graph's own work (:meth:`init_forward_metadata_in_graph`), run here as well when
        ``validate`` is on, so that the checks see the values the kernel will read.

        ``fb`` holds ``bs`` rows (``num_real`` real, then padding) with CPU mirrors.
        Raises: ValueError (nothing captured for this mode and ``bs``), CG-008 (pages do not
        fit), and, with ``validate``: CG-001 (a captured tensor was rebound), the checks of
        :func:`refspec.fa3.validate.validate_batch` on the real rows, CG-003 / CG-004
        (draft-extend layout over all ``bs`` rows), CG-006 (the frozen ``max_seqlen_q`` is below a
        live request's query rows: named before PA-010, the kernel contract it then breaks) and every check of
        :mod:`refspec.fa3.validate` on the real rows.  Without ``validate`` a rebound tensor is
        silently stale, as on a real GPU.
        """
        md, bound = self._captured(fb, bs)
        if self.validate:
            self.count_validation()
            validate_batch(fb, self.kv.req_to_token, num_real=num_real)
            self.init_forward_metadata_in_graph(bs, fb)
        self._write_page_table(md, fb, bs)
        if fb.forward_mode.is_draft_extend(include_v2=True):  # the live token layout (CG-003 / CG-004)
            write_draft_extend_cu_q(md, draft_extend_rows(fb, bs))
        if self.validate:
            for name, t in bound.items():
                now = getattr(md, name)
                if now is not t or now.data_ptr() != t.data_ptr():
                    raise InvariantError("CG-001", f"{name} was rebound at replay (captured tensor at "
                                         f"{t.data_ptr():#x}, now {now.data_ptr():#x})")
            _check_draft_extend_cu_q(md, fb, bs)
            check_frozen_max_seqlen_q(md, fb, num_real)
            validate_metadata(md, fb, self.kv.req_to_token, self.page_size, num_real=num_real,
                              max_seqlen_q=md.max_seq_len_q)
        self.forward_metadata = md
        return md

    def _write_page_table(self, md: FlashAttentionMetadata, fb: ForwardBatch, bs: int) -> None:
        """The page table over the CPU bound ``max K = max(seq_lens_cpu) + delta`` (MD-006), after
        the CG-008 width check (:func:`check_table_width`), written by :func:`replay_page_table`."""
        gs, P = self.graph_state, self.page_size
        max_k = max(fb.seq_lens_cpu[:bs].tolist()) + mode_delta(fb, self.speculative_step_id)
        check_table_width(max_k, P, gs.width)
        replay_page_table(md, fb, self.kv.req_to_token, gs.strided_indices, max_k, P)


# ---- the rules, one function each (what the module table says, and what reviews cite) ----

def graph_table_width(req_to_token: torch.Tensor, page_size: int) -> int:
    """Page-table columns of the graph buffers: ``ceil(req_to_token.shape[1] / P)`` (CG-008).

    ``req_to_token``'s width already includes the speculative headroom, so verify / draft
    extend near the context wall (K = L + N) still fit.  Sizing from the model's context length
    instead is the context-wall bug of sglang #35985 / #29665 (the table too narrow for L + N).
    """
    return -(-req_to_token.shape[1] // page_size)


def check_table_width(max_k: int, page_size: int, width: int) -> None:
    """CG-008 at replay: the ``ceil(max_k / P)`` pages the kernel reads fit the captured table's
    ``width`` columns (pages).  Raises: InvariantError CG-008."""
    m_pages = -(-max_k // page_size)
    require(m_pages <= width, "CG-008", f"max K {max_k} needs {m_pages} pages, graph table width {width}")


def check_frozen_max_seqlen_q(md: FlashAttentionMetadata, fb: ForwardBatch, num_real: int) -> None:
    """CG-006 at replay: the ``max_seqlen_q`` frozen at capture covers every live request's query rows.

    The same numbers also break PA-010 (the kernel contract :mod:`refspec.fa3.validate` checks
    next); the graph rule is the cause, so it is the ID raised.  Raises: InvariantError CG-006.
    """
    q = fb.q_lens_cpu()[:num_real]
    require(not q or max(q) <= md.max_seq_len_q, "CG-006",
            lambda: f"{fb.forward_mode.name} replay: query lens {q}, the graph froze max_seqlen_q = "
            f"{md.max_seq_len_q} at capture")


def capture_query_rows(fb: ForwardBatch, bs: int, num_tokens: int) -> int:
    """Query rows per request of the capture-time batch, frozen as ``max_seqlen_q`` (CG-006).

    DECODE (and draft decode): 1, one row per step whatever the runner's token layout.
    TARGET_VERIFY: N.  DRAFT_EXTEND / DRAFT_EXTEND_V2: W = ``num_tokens // bs`` = Sd + 1, the
    bound on live rows, never a (smaller) dummy batch's query length (transformers #45323: a
    frozen ``max_seqlen_q`` below the live rows, CG-006).
    Raises: ValueError for a mode that is not graphed.
    """
    m = fb.forward_mode
    if m.is_decode():
        return 1
    if m.is_target_verify():
        return fb.num_draft_tokens
    if m.is_draft_extend(include_v2=True):
        return num_tokens // bs
    raise ValueError(f"{m.name} is not a graphed mode")


def write_cache_seqlens(md: FlashAttentionMetadata, seq_lens: torch.Tensor, delta: int) -> None:
    """In place (CG-001): ``cache_seqlens <- K = seq_lens + delta`` and ``cu_seqlens_k[1:] <-
    cumsum K`` (MD-006), one op each, written into the buffers.

    ``seq_lens`` int32 ``[bs]`` (tokens), ``delta`` the mode's offset (:func:`mode_delta`).  The
    captured graph reads these buffers' addresses, so assigning new tensors would leave it
    reading the capture-time lengths (CG-001: the rebinding of sglang #4855 ``6ffb6bd47``, seen
    again in the review of #26019).
    """
    torch.add(seq_lens, delta, out=md.cache_seqlens_int32)
    torch.cumsum(md.cache_seqlens_int32, 0, dtype=torch.int32, out=md.cu_seqlens_k[1:])


def draft_extend_rows(fb: ForwardBatch, bs: int) -> torch.Tensor:
    """Query rows per request in a DRAFT_EXTEND(_V2) replay: int32 ``[bs]`` (rows).

    symbolic      v1: a = [a1, a2, ...] = num_accept_tokens (a = n + 1, packed, CG-003)
                  v2: [W, W, ...] = extend_seq_lens (uniform, CG-004)
    example       a = [2, 4, 1], W = 4, one padded row:  v1 [2, 4, 1, 4];  v2 [4, 4, 4, 4]
    Padded rows hold the runner's fill W in both fields.
    """
    if fb.forward_mode.is_draft_extend():
        return fb.num_accept_tokens[:bs]
    return fb.extend_seq_lens[:bs]


def write_draft_extend_cu_q(md: FlashAttentionMetadata, rows: torch.Tensor) -> None:
    """In place (CG-001): ``cu_seqlens_q[1:] <- cumsum(rows)``, the replayed token layout."""
    torch.cumsum(rows, 0, dtype=torch.int32, out=md.cu_seqlens_q[1:])


def replay_page_table(md: FlashAttentionMetadata, fb: ForwardBatch, req_to_token: torch.Tensor,
                      strided_indices: torch.Tensor, max_k: int, page_size: int) -> None:
    """In place (CG-001, MD-007): ``page_table[:, :m] <- req_to_token[r][:, strided[:m]] // P``.

    ``m = ceil(max_k / P)`` columns (pages); ``strided_indices [M]`` are the token columns
    ``0, P, 2P, ...`` (the first slot of each page), so each entry is a page id.  Columns
    ``>= m`` keep stale values, which the kernel never reads (PA-007).  Every graphed mode uses
    this one rule: upstream's pre-#5318 draft-decode and verify replays copied slots here (#5090).
    """
    m_pages = -(-max_k // page_size)
    r = fb.req_pool_indices[: md.page_table.shape[0]]
    first_slots = req_to_token[r[:, None], strided_indices[None, :m_pages]]  # one gather [bs, m]
    torch.floor_divide(first_slots, page_size, out=md.page_table[:, :m_pages])  # into the buffer
