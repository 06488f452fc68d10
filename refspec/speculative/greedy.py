"""Plain greedy decoding through the production path: the baseline speculation must beat.

The same paged KV cache, FA3 backend and CUDA-graph runner as the speculative engine, with one
token per request per step: prefill (EXTEND, eager), then DECODE steps replayed from a graph
captured per batch size (padded, CG-007), ``seq_lens`` L including the token being decoded
(written at position L - 1).  A request leaves the batch after ``max_new_tokens`` or right after
emitting ``eos``; its pages are freed (KV-006 holds at the end).

This is the number a user compares speculative decoding with: "graph greedy" in
``python -m refspec demo --device cuda``.  The host reads each step's tokens once (one
device -> host read per step, counted in ``syncs``), as a non-overlapped server does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from refspec.core.batch import decode_batch, extend_batch
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.modes import ForwardMode
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


@torch.no_grad()
def production_greedy(target, prompts: list[list[int]], max_new_tokens: list[int], *, page_size: int = 1,
                      eos: int | None = None, graphs: bool = True, capture_bs=(1, 2, 4, 8), provider=None,
                      validate: bool = True) -> GreedyRun:
    """Greedy decoding of every prompt at once (module doc).

    Shapes: ``prompts`` B lists of token ids; ``max_new_tokens`` B budgets (tokens).
    Returns: :class:`GreedyRun`.  Raises: ValueError for empty prompts or budgets < 1;
    InvariantError from the FA3 validation (``validate``) or the allocator (KV-003).
    """
    if not prompts or any(not p for p in prompts) or len(max_new_tokens) != len(prompts) \
            or any(m < 1 for m in max_new_tokens):
        raise ValueError("production_greedy needs non-empty prompts and one budget >= 1 per prompt")
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
    if p0.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rows = [kv.alloc_req() for _ in range(B)]
    lens = [len(p) for p in prompts]
    kv.alloc_extend(rows, [0] * B, lens)
    fb = extend_batch(kv, rows, [0] * B, lens)
    be.init_forward_metadata(fb)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=p0.device)
    last = torch.tensor([sum(lens[:b + 1]) - 1 for b in range(B)], device=p0.device)
    nxt = target.forward(ids, fb, be)[0][last].argmax(-1)
    run = GreedyRun([[] for _ in range(B)])
    live = list(range(B))
    while True:
        run.syncs += 1
        for b, t in zip(live, nxt.tolist()):
            run.tokens[b].append(t)
        done = [b for b in live if len(run.tokens[b]) >= max_new_tokens[b] or run.tokens[b][-1] == eos]
        for b in done:
            kv.free_req(rows[b], lens[b] + len(run.tokens[b]) - 1)  # the last token has no KV yet
        keep = [i for i, b in enumerate(live) if b not in done]
        live = [live[i] for i in keep]
        if not live:
            break
        nxt = nxt[torch.tensor(keep, device=p0.device)] if len(keep) != len(nxt) else nxt
        L = [lens[b] + len(run.tokens[b]) for b in live]  # includes the token decoded now
        r = [rows[b] for b in live]
        kv.alloc_extend(r, [x - 1 for x in L], L)
        fb = decode_batch(kv, r, L)
        run.steps += 1
        if runner is not None and runner.can_run(fb):
            run.graph_steps += 1
            nxt = runner.replay(fb, {"ids": nxt})
        else:
            run.eager_steps += 1
            be.init_forward_metadata(fb)
            nxt = step_fn(fb, {"ids": nxt})
    if p0.device.type == "cuda":
        torch.cuda.synchronize()
    run.seconds = time.perf_counter() - t0
    run.free_pages = (start_free, kv.allocator.num_free_pages)
    return run
