"""The overlap loop (v2): launch round k+1 before reading round k's results, as SGLang does.

SGLang's ``event_loop_overlap`` (``python/sglang/srt/managers/scheduler.py``) builds and runs
batch k+1, *then* processes batch k's result, so the host prepares the next round while the GPU
still runs this one.  Its single host wait per step is the event of the previous round's result
copy.  This module is that loop for refspec's engine (``Engine(..., overlap=True)``):

1. admit and prefill newcomers; build round k+1 from what the host knows (below);
2. launch round k+1 (:func:`launch`), whose inputs come from the device (the future map);
3. read the first tokens of the prefills of step 1 (:func:`read_prefills`), then round k's
   results (ONE device -> host copy, started when round k was launched: pinned buffer,
   ``non_blocking``, an event, :class:`~refspec.core.transfer.ResultCopy`) and commit them:
   emission, finishes, frees, the trace entry (:func:`finish`).

**What the host knows when it builds round k+1.**  Round k is in flight, so a request's
committed length at round k+1 is known only on the device.  The host keeps L, the start
length of round k (exact: round k-1 has been read), and works with bounds::

    symbolic    host L = start of round k (in flight)      a_k in [1, N], unknown to the host
                device L' = L + a_k  (future.seq_lens[r])   L' in [L + 1, L + N]
                bound      L_hi = L + N   (L_hi = L for a newcomer: nothing in flight)
                round k+1 writes KV L' .. L' + N - 1 <= L + 2N - 1
                allocate_len = ceil((L + 2N) / P) * P        (KV-005: the 2 x ALLOC reserve)
    example     L = 5, N = 4, P = 4:  L' in [6, 9],  L_hi = 9,  writes <= 12,
                allocate_len = ceil(13 / 4) * 4 = 16  (positions 0..15: 4 pages)

* lengths: ``seq_lens`` is the future map's device tensor; ``seq_lens_cpu`` holds L_hi
  (``seq_lens_cpu_is_bound``), from which ``max_seqlen_k`` and the page-table slice width come
  (MD-006); the kernel reads the exact ``cache_seqlens`` (:mod:`refspec.core.future_batch`).
  SGLang: FA3 sets ``needs_cpu_seq_lens = False`` (``layers/attention/flashattention_backend.py``)
  and ``FutureMap.resolve_seq_lens_cpu`` then skips its host copy (``managers/overlap_utils.py``,
  sgl-project/sglang#25879).
* allocation: ``allocate_len = max(allocate_len, ceil((L + 2 ALLOC) / P) P)`` with ALLOC =
  ``max(Sd * topk, N)`` = N for top-k 1 (``page_aligned_decode_alloc_lens`` and
  ``get_alloc_reserve_per_decode`` in ``mem_cache/allocation_sizing.py``, #13478: "a double
  buffer that absorbs the kv_committed_len lag in overlap mode").  ``req_to_token`` rows get
  ``ceil((max_context + 2N) / P) * P`` columns (:func:`row_width`) so every reserve fits.
* the next round's inputs (L', root, d_1, draft hidden) never leave the device: the future map
  indexed by ``req_to_token`` row (:mod:`refspec.speculative.future`; #25862).
* test drafters: the host has no tokens for L', so a ``position_only`` drafter's
  ``propose_at(rid, L)`` is tabulated per (row, L) at admission and looked up on the device.

**Finishes, one round late.**  A request that round k finishes (EOS, or its budget inside an
accepted run) is already in round k+1.  When round k+1's results arrive its row is dropped
(``RoundTrace.discarded``; SGLang skips ``req.finished()`` in overlap mode,
``batch_result_processor.py``); its pages were freed when round k was committed: later
forwards that reuse them are queued behind round k+1 on the same stream.  A request whose round
in flight is *sure* to finish it by length (one token left: every round emits >= 1) is left
out of round k+1 (SGLang's ``_reqs_finishing_inflight``, ``Req.next_output_finishes_by_length``).
A freed batch slot is therefore reused one round later than without overlap: the schedule
(``RoundTrace`` rids / joins) can differ from the non-overlap loop's, the tokens cannot (SD-009).

**Syncs.**  Per round: 0 model-result reads while it is built and launched, 1 (``"post_round"``)
after the next round was launched, counted in ``Engine.syncs``.  A prefill's first tokens are
read the same way (``"prefill"``, one per prefill): after the round that follows it (its
newcomers' first round) was launched; a newcomer with ``max_new_tokens = 1`` is left out of
that round, one whose first token is EOS runs it and its row is dropped.  With
``validate=True`` every metadata check reads the device values it checks (exact lengths, so
every check of :mod:`refspec.fa3.validate` still runs, MD-006 as ``seq_lens <= seq_lens_cpu``):
counted as ``"validation"``, never as result reads, and on a GPU they serialize the loop: use
``validate=False`` to measure overlap.

**Sources** (sgl-project/sglang v0.5.23, paths under ``python/sglang/srt/``):
`managers/scheduler.py <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/managers/scheduler.py#L2061>`_
(``event_loop_overlap``, ``_reqs_finishing_inflight``);
`managers/overlap_utils.py <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/managers/overlap_utils.py#L281>`_
(``FutureMap``; indexed by ``req_pool_indices`` in `#25862 <https://github.com/sgl-project/sglang/pull/25862>`_,
seq_lens through it in `#25879 <https://github.com/sgl-project/sglang/pull/25879>`_);
`mem_cache/allocation_sizing.py <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/allocation_sizing.py#L64>`_
(`#13478 <https://github.com/sgl-project/sglang/pull/13478>`_);
`layers/attention/flashattention_backend.py <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L202>`_
(``needs_cpu_seq_lens = False``); spec v2 overlap itself: `#11398 <https://github.com/sgl-project/sglang/pull/11398>`_.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from refspec.core.future_batch import (
    draft_decode_steps_batch_future,
    draft_extend_v2_batch_future,
    round_window,
    verify_batch_future,
)
from refspec.core.invariants import require
from refspec.core.transfer import ResultCopy, h2d
from refspec.speculative.drafters import Drafter
from refspec.speculative.round_row import unpack


def resolve(overlap: bool | None, version: str, device: torch.device, drafter) -> bool:
    """``Engine(overlap=...)``: None = on for v2 on CUDA.  Raises ValueError for v1 (its round
    reads the accept counts inside it) or a drafter that proposes from tokens, not from L."""
    overlap = (version == "v2" and torch.device(device).type == "cuda") if overlap is None else bool(overlap)
    if overlap and version != "v2":
        raise ValueError("overlap needs version 'v2' (v1 reads the accept counts inside the round)")
    if overlap and type(drafter) is not Drafter and not drafter.position_only:
        raise ValueError(f"overlap needs a position_only drafter (propose_at); {drafter.name!r} is not")
    return overlap


def reserve_len(L: int, N: int, P: int) -> int:
    """``ceil((L + 2N) / P) * P``: slots a row holds before a round launched at host-known L."""
    return -(-(L + 2 * N) // P) * P


def row_width(max_context: int, N: int, P: int) -> int:
    """``req_to_token`` columns for the overlap loop: the largest reserve, ``reserve_len(max_context, N, P)``
    (N: the positions one round may give slots past L; a tree passes its ALLOC, TR-020)."""
    return reserve_len(max_context, N, P)


@dataclass
class InFlight:
    """A launched round whose results have not been read: its requests (batch order), the
    result copy under way, the newcomers prefilled before it, and the graphs it replayed."""

    reqs: list
    copy: ResultCopy
    joined: list[int]
    graph: list[str]
    in_round: int


def tabulate_drafts(eng, reqs) -> None:
    """Fill ``eng.draft_table[row, L] = propose_at(rid, L)`` for L = prompt .. width - 1."""
    if type(eng.drafter) is Drafter:
        return
    R, W = eng.kv.req_to_token.shape
    if eng.draft_table is None:
        eng.draft_table = torch.full((R, W, eng.Sd), -1, dtype=torch.long, device=eng.device)
    for r in reqs:
        p = len(r.prompt)
        eng.draft_table[r.row, p:] = h2d([eng.drafter.propose_at(r.rid, L, eng.Sd) for L in range(p, W)], eng.device)


def prepare(eng, reqs) -> None:
    """Top each row up to ``reserve_len(L)`` (KV-005, overlap): page-aligned, only the difference."""
    want = [reserve_len(r.seq_len, eng.N, eng.P) for r in reqs]
    need = [(r, w) for r, w in zip(reqs, want) if r.alloc_len < w]
    if need:
        eng.kv.alloc_extend([r.row for r, _ in need], [r.alloc_len for r, _ in need], [w for _, w in need])
    for r, w in need:
        r.alloc_len = w


def launch(eng, reqs, joined: list[int]) -> InFlight:
    """Allocate, build from bounds and run one v2 round; start its result copy; read nothing."""
    prev = {id(r) for r in eng.in_flight.reqs} if eng.in_flight else set()
    hi = [r.seq_len + (eng.N if id(r) in prev else 0) for r in reqs]  # L_hi

    def batches(eng, reqs, rows_dev, L_dev):  # one window L..L+N-1 for all three forwards
        kv, N, rows = eng.kv, eng.N, [r.row for r in reqs]
        L32 = L_dev.to(torch.int32)  # the batches' seq_lens dtype, converted once for all three
        win = round_window(kv, rows, rows_dev, L32, hi, N)
        steps = draft_decode_steps_batch_future(kv, rows, rows_dev, L32, hi, eng.Sd, win) if eng.Sd > 1 else None
        return (steps, verify_batch_future(kv, rows, rows_dev, L32, hi, N, win),
                draft_extend_v2_batch_future(kv, rows, rows_dev, L32, hi, N, win))

    before, counts = eng.syncs["in_round"], Counter(eng.runners.counts)
    out = eng._overlap_round(reqs, hi, batches)  # prepare (the 2x reserve) + round_v2; trees: their own
    for r in reqs:
        r.launched += 1
    eng.rounds_launched += 1
    return InFlight(list(reqs), ResultCopy(out), joined, eng.graphs_used(counts), eng.syncs["in_round"] - before)


def finish(eng, fl: InFlight) -> None:
    """Read ``fl``'s results (the one counted read), drop the rows of requests an earlier
    round finished, commit the rest.  Raises SD-008 if the host's L disagrees with the device's."""
    rows = [unpack(row, eng.N, eng.Sd) for row in eng.host("post_round", fl.copy)]
    keep = [(r, row) for r, row in zip(fl.reqs, rows) if not r.finished]
    for r, row in keep:
        require(row.seq_len == r.seq_len, "SD-008", f"request {r.rid}: host L {r.seq_len}, device L {row.seq_len}")
    eng.commit([r for r, _ in keep], [r.seq_len for r, _ in keep], [row for _, row in keep], fl.joined,
               fl.in_round, fl.graph, discarded=[r.rid for r in fl.reqs if r.finished])


def read_prefills(eng) -> None:
    """Read the first tokens of the prefills launched before the current round; emit them."""
    for reqs, copy in eng.prefills:
        eng.emit_first(reqs, eng.host("prefill", copy))
    eng.prefills = []


def run(eng) -> list:
    """The overlap loop (module doc) until every request finished; completion order."""
    step = 0
    with torch.no_grad():
        while eng.waiting or eng.running or eng.in_flight:
            if not eng.running and eng.waiting:
                step = max(step, min(r.arrival for r in eng.waiting))
            joined = eng._admit(step)
            if joined:
                eng._prefill(joined)
            prev = eng.in_flight  # every unread result (a round, a prefill) emits >= 1 token:
            unread = {id(r) for r in prev.reqs} if prev else set()
            unread |= {id(r) for reqs, _ in eng.prefills for r in reqs}
            batch = [r for r in eng.running if not (id(r) in unread and len(r.output) + 1 >= r.max_new_tokens)]
            eng.in_flight = launch(eng, batch, [r.rid for r in joined]) if batch else None
            read_prefills(eng)
            if prev is not None:
                finish(eng, prev)  # observers of its round_end see the next round in flight
            step += 1
    return eng.done
