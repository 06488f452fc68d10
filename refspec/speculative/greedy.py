"""Plain greedy decoding through the production path: the baseline speculation must beat.

The same paged KV cache, FA3 backend and CUDA-graph runner as the speculative engine, with one
token per request per step: prefill (EXTEND, eager), then DECODE steps replayed from a graph
captured per batch size (padded, CG-007), ``seq_lens`` = L + 1 including the token being decoded
(written at position L).  A request leaves the batch after ``max_new_tokens`` or right after
emitting ``eos``; its pages are freed (KV-006 holds at the end).

This is the number a user compares speculative decoding with: "graph greedy" in
``python -m refspec demo --device cuda``.  ``observer(event, run)`` sees ``prefill`` right after
the prefill forward is launched, as :class:`~refspec.speculative.engine.Engine`'s observer does
(so a timer can start both loops at the same point).

**Overlapped like SGLang's overlap scheduler.**  Step i + 1 is launched *before* the host
reads step i's tokens: its input ids are step i's device output, and its lengths and slots
follow from counts the host already has (one token per live request per step), so nothing
waits for the read.  The tokens of step i come back through a pinned, non-blocking copy
(:class:`~refspec.core.transfer.ResultCopy`), read after the next launch (one read per step,
counted in ``syncs``; the GPU is never idle for it).  A budget stop is known on the host before
the launch; an EOS is seen one step late, so a request that emitted EOS at step i has run step
i + 1 too: that token is dropped and its KV slot freed with the row.  SGLang:
``Scheduler.event_loop_overlap`` (the previous batch's result is processed after the next
batch is launched) and ``TpModelWorkerClient``'s ``copy_to_cpu`` / ``copy_done``
(`python/sglang/srt/managers/scheduler.py@v0.4.6 <https://github.com/sgl-project/sglang/blob/v0.4.6/python/sglang/srt/managers/scheduler.py>`_,
`tp_worker_overlap_thread.py@v0.4.6 <https://github.com/sgl-project/sglang/blob/v0.4.6/python/sglang/srt/managers/tp_worker_overlap_thread.py>`_).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from refspec.core.args import count
from refspec.core.batch import decode_batch, extend_batch
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.modes import ForwardMode
from refspec.core.transfer import ResultCopy, h2d
from refspec.fa3.backend import FlashAttentionBackend
from refspec.graphs.runner import GraphRunner


@dataclass
class GreedyRun:
    """``tokens[b]``: request b's output; ``steps``: decode steps run; ``syncs``: device -> host reads;
    ``free_pages``: (at start, at end) -- equal when every page came back (KV-006)."""

    tokens: list[list[int]]
    steps: int = 0
    syncs: int = 0
    free_pages: tuple[int, int] = (0, 0)
    graph_steps: int = 0
    eager_steps: int = 0
    seconds: float = 0.0  #: wall time from the prefill on (graph capture excluded; synchronized on CUDA)
    decode_seconds: float = 0.0  #: the decode steps' part of ``seconds`` (from the prefill's tokens read on)


@torch.no_grad()
def production_greedy(target, prompts: list[list[int]], max_new_tokens: list[int], *, page_size: int = 1,
                      eos: int | None = None, graphs: bool = True, capture_bs=(1, 2, 4, 8), provider=None,
                      validate: bool = True, observer=None) -> GreedyRun:
    """Greedy decoding of every prompt at once (module doc).

    Shapes: ``prompts`` B lists of token ids; ``max_new_tokens`` B budgets (tokens).
    Returns: :class:`GreedyRun`.  Raises: ValueError for empty prompts, budgets < 1 or a
    ``page_size`` that is not an int >= 1; InvariantError from the FA3 validation (``validate``)
    or the allocator (KV-003).
    """
    if not prompts or any(not p for p in prompts) or len(max_new_tokens) != len(prompts) \
            or any(m < 1 for m in max_new_tokens):
        raise ValueError("production_greedy needs non-empty prompts and one budget >= 1 per prompt")
    count("page_size", page_size, 1)
    p0 = next(target.parameters())
    c, B, P = target.config, len(prompts), page_size
    ctx = max(len(p) + m for p, m in zip(prompts, max_new_tokens))
    num_pages = 1 + B * (-(-ctx // P) + 1)
    kv = KVCache(B + 1, ctx, num_pages, P, device=p0.device)
    pool = KVPool(c.num_hidden_layers, num_pages, P, c.num_key_value_heads, c.head_dim, dtype=p0.dtype,
                  device=p0.device)
    be = FlashAttentionBackend(pool, kv, validate=validate, provider=provider)
    start_free = kv.allocator.num_free_pages

    def step_fn(fb, x):  # the closure holds the model and the backend, not the runner
        return target.forward(x["ids"], fb, be)[0].argmax(-1)

    runner = None
    if graphs:
        runner = GraphRunner(ForwardMode.DECODE, [be], step_fn, kv=kv, capture_bs=capture_bs, tokens_per_req=1,
                             inputs={"ids": ((), torch.long)})
    sync = torch.cuda.synchronize if p0.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    rows = [kv.alloc_req() for _ in range(B)]
    lens = [len(p) for p in prompts]
    kv.alloc_extend(rows, [0] * B, lens)
    fb = extend_batch(kv, rows, [0] * B, lens)
    be.init_forward_metadata(fb)
    ids = h2d([t for p in prompts for t in p], p0.device)
    last = h2d([sum(lens[:b + 1]) - 1 for b in range(B)], p0.device)
    nxt = target.forward(ids, fb, be)[0][last].argmax(-1)
    run = GreedyRun([[] for _ in range(B)])
    if observer is not None:
        observer("prefill", run)
    fed = [0] * B  # generated tokens of request b whose KV is written (fed back as inputs)
    done: set[int] = set()
    pending = (list(range(B)), ResultCopy(nxt))  # the last launched step's rows and tokens, not yet read
    t_dec = None
    while pending is not None:
        # launch the next step before reading the last one's tokens: inputs stay on the device
        # and a request's budget is known on the host; only an EOS is seen one step late
        prev_rows, copy = pending
        nxt_rows = [b for b in prev_rows if b not in done and fed[b] + 1 < max_new_tokens[b]]
        pending = None
        if nxt_rows:
            if len(nxt_rows) != len(prev_rows):
                keep = {b: i for i, b in enumerate(prev_rows)}
                nxt = nxt[h2d([keep[b] for b in nxt_rows], p0.device)]
            L = [lens[b] + fed[b] + 1 for b in nxt_rows]  # includes the token decoded now
            r = [rows[b] for b in nxt_rows]
            kv.alloc_extend(r, [x - 1 for x in L], L)
            fb = decode_batch(kv, r, L)
            for b in nxt_rows:
                fed[b] += 1
            run.steps += 1
            if runner is not None and runner.can_run(fb):
                run.graph_steps += 1
                nxt = runner.replay(fb, {"ids": nxt})
            else:
                run.eager_steps += 1
                be.init_forward_metadata(fb)
                nxt = step_fn(fb, {"ids": nxt})
            pending = (nxt_rows, ResultCopy(nxt))
        run.syncs += 1
        for b, t in zip(prev_rows, copy.wait()):
            if b in done:
                continue  # a step launched before this request's EOS was read: its token is dropped
            run.tokens[b].append(t)
            if len(run.tokens[b]) >= max_new_tokens[b] or t == eos:
                done.add(b)
                kv.free_req(rows[b], lens[b] + fed[b])  # every fed token has KV (the last one has none)
        if t_dec is None:
            t_dec = time.perf_counter()  # the prefill's tokens are read: decode starts
    sync()
    t1 = time.perf_counter()
    run.seconds, run.decode_seconds = t1 - t0, t1 - t_dec
    run.free_pages = (start_free, kv.allocator.num_free_pages)
    return run
