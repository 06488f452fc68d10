"""The conformance cases and refspec's side of them (refspec's production FA3 wing, no oracle).

One *job* is one batch (eager) or one capture + one padded replay (graph) on one fresh
``req_to_token``; it yields one *result* per (phase, draft step).  The job carries the exact
inputs upstream is fed (plain tensors: ``req_to_token`` and every batch field), so both sides
build metadata from the same memory; refspec's metadata comes from
:class:`refspec.fa3.backend.FlashAttentionBackend` (eager ``init_forward_metadata``, graph
hooks driven by :class:`refspec.graphs.runner.GraphRunner`, whose padding fills are what both
sides then see).  Upstream never sees refspec's metadata, only its inputs.

Inputs per page size P (tokens): committed lengths at page boundaries +-1
(``P - 1, P, P + 1, 2P - 1, ...``), ``req_to_token`` rows ``context_len`` plus SGLang's
speculative headroom wide (:func:`headroom`; every case, as a server sizes them), rows of
``req_to_token`` in shuffled order and physical
pages shuffled by the allocator's seed, N = 4 draft tokens (Sd = 3, draft steps 0 and 1), and
two batch shapes: B = 3 live requests in a graph of 4, B = 5 in a graph of 8.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refspec.conformance.recorder import Recorder, installed
from refspec.core import batch as fbatch
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode
from refspec.fa3 import kernel as fa3_kernel
from refspec.fa3.backend import FlashAttentionBackend, FlashAttentionMultiStepBackend
from refspec.graphs.runner import GraphRunner

PAGE_SIZES = (1, 2, 4, 8, 16, 64)
N = 4  #: num_draft_tokens = Sd + 1
SD = 3  #: speculative_num_steps; draft decode steps 0 .. SD - 2
SHAPES = {"B3/bs4": (3, 4), "B5/bs8": (5, 8)}  #: live batch B, graph batch bs (> B: padded replay)
WIDTH = 320  #: req_to_token columns = upstream ``context_len`` (a multiple of every P)
MODES = {  # name -> (ForwardMode, captured in a CUDA graph?)
    "decode": (ForwardMode.DECODE, True),
    "extend": (ForwardMode.EXTEND, False),
    "extend_prefix": (ForwardMode.EXTEND, False),
    "verify": (ForwardMode.TARGET_VERIFY, True),
    "draft_decode": (ForwardMode.DECODE, True),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, True),
    "draft_extend_v2": (ForwardMode.DRAFT_EXTEND_V2, True),
    "idle": (ForwardMode.IDLE, False),
}
FIELDS = ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "max_seq_len_q", "max_seq_len_k", "page_table")
_BATCH = ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions", "extend_seq_lens",
          "extend_seq_lens_cpu", "num_accept_tokens", "num_accept_tokens_cpu")


@dataclass
class Job:
    """One upstream job: ``inputs`` is what the worker feeds upstream, ``refspec`` the results."""

    id: str
    mode: str
    page_size: int
    shape: str
    graphed: bool
    inputs: dict
    refspec: dict  #: (phase, step) -> {field: tensor | int}
    unreachable: str | None = None  #: why upstream's own runner never builds this batch (not run, not compared)


def lengths(page_size: int, B: int) -> list[int]:
    """Committed lengths L (tokens) at page boundaries +-1 for page size P (all >= 1)."""
    P = page_size
    return [max(1, x) for x in (P - 1, P + 1, 2 * P, 2 * P + 1, 3 * P - 1, 4 * P, 4 * P + 1, P)][:B]


def accepts(B: int, n: int = N) -> list[int]:
    """num_accept_tokens a = n + 1 per request (1 .. N, mixed; v1 draft extend only)."""
    return [min(x, n) for x in (1, 3, n, 2, 1, n, 2, 3)][:B]


SIZING = "python/sglang/srt/mem_cache/allocation_sizing.py"  #: 0.5.23's req_to_token row headroom


def headroom(page_size: int, num_draft_tokens: int, num_steps: int = SD, topk: int = 1) -> int:
    """``req_to_token`` columns past ``context_len`` (tokens), as SGLang 0.5.23 sizes them for EAGLE.

    ``get_req_to_token_extra_context_len`` (``allocation_sizing.py:96`` at v0.5.23:
    https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/allocation_sizing.py#L96)
    is ``4 + N``, and for ``P > 1`` at least ``get_alloc_reserve_per_decode() + P - 1``
    (``:115``): twice ``get_alloc_len_per_decode()`` (``:70``, ``:28``), which is
    ``max(num_steps * topk, N)`` for ``P = 1`` or top-k 1 (``:53``), else
    ``max(((P - 1) + num_steps + P - 1) // P * P * topk, N)`` (``:61``).  0.5.12.post1 adds
    ``4 + N`` at every page size (``model_runner_kv_cache_mixin.py:245``); the larger 0.5.23
    rows hold every K of both.  Returns an int >= 4 + N.
    """
    P, N, S, k = page_size, num_draft_tokens, num_steps, topk
    if P == 1 or k == 1:
        per_decode = max(S * k, N)
    else:  # spec v2 tree, page > 1: each branch's page-aligned footprint
        per_decode = max(((P - 1) + S + P - 1) // P * P * k, N)
    extra = 4 + N
    return max(extra, 2 * per_decode + P - 1) if P > 1 else extra


def _cache(page_size: int, B: int, seed: int, context_len: int = WIDTH, extra: int = 0):
    """``req_to_token`` of ``context_len + extra`` columns (``extra``: :func:`headroom`), pages
    shuffled, ``B`` rows in shuffled order."""
    width = context_len + extra
    kv = KVCache(max_reqs=12, max_context=context_len, extra=extra, num_pages=width * 10 // page_size + 2,
                 page_size=page_size, seed=seed)
    taken = [kv.alloc_req() for _ in range(11)]
    g = torch.Generator().manual_seed(seed)
    rows = [taken[i] for i in torch.randperm(len(taken), generator=g)[:B].tolist()]  # shuffled rows
    pool = KVPool(num_layers=1, num_pages=kv.allocator.num_free_pages + 1, page_size=page_size,
                  num_kv_heads=1, head_dim=8)
    return kv, pool, rows


def live_batch(mode: str, kv, rows, L, sd: int = SD) -> fbatch.ForwardBatch:
    """The refspec batch of ``mode`` on committed lengths ``L`` (``refspec.core.batch`` builders);
    ``sd`` = speculative_num_steps, N = sd + 1."""
    B, N = len(rows), sd + 1
    if mode == "decode":
        return fbatch.decode_batch(kv, rows, L)
    if mode == "extend":
        return fbatch.extend_batch(kv, rows, [0] * B, L)
    if mode == "extend_prefix":  # prefix L - e, e = 1..3 new tokens (one request with no prefix)
        e = [min(L[b], 1 + b % 3) if b else L[b] for b in range(B)]
        return fbatch.extend_batch(kv, rows, [x - y for x, y in zip(L, e)], e)
    if mode == "verify":
        return fbatch.verify_batch(kv, rows, L, N)
    if mode == "draft_decode":
        return fbatch.draft_decode_steps_batch(kv, rows, L, sd)
    if mode == "draft_extend":
        a = accepts(B, N)
        return fbatch.draft_extend_batch(kv, rows, [x + y for x, y in zip(L, a)], a, num_draft_tokens=N)
    if mode == "draft_extend_v2":
        return fbatch.draft_extend_v2_batch(kv, rows, [x + N for x in L], N)
    if mode == "idle":
        return fbatch.idle_batch(kv)
    raise ValueError(f"unknown conformance mode {mode!r}; known: {sorted(MODES)}")


def snapshot_batch(fb: fbatch.ForwardBatch) -> dict:
    """Plain copies of ``fb``'s fields (a live batch, or a graph runner's padded static batch)."""
    out = {"forward_mode": fb.forward_mode.name, "num_draft_tokens": fb.num_draft_tokens}
    for name in _BATCH:
        x = getattr(fb, name)
        out[name] = x.clone() if isinstance(x, torch.Tensor) else (None if x is None else [int(v) for v in x])
    return out


def snapshot_metadata(md) -> dict:
    """The metadata fields (copies: graph buffers are rewritten by the next hook)."""
    return {f: (getattr(md, f).clone() if isinstance(getattr(md, f), torch.Tensor) else int(getattr(md, f)))
            for f in FIELDS}


#: the key of a result's fields that carries its forward's kernel calls (the worker's ``upstream_common.KERNEL``)
KERNEL = "kernel_calls"
#: the modes whose forward runs for its kernel arguments (top-k = 1; IDLE runs no kernel)
KERNEL_MODES = ("decode", "extend", "extend_prefix", "verify", "draft_decode", "draft_extend", "draft_extend_v2")
#: the layer refspec's forward runs (upstream's side: ``upstream_common.layer``, the same constants):
#: one query head and one KV head of dimension 8 (the pools' ``num_kv_heads`` / ``head_dim``), the
#: default softmax scale, no softcap, no window
LAYER = AttentionLayer(layer_id=0, num_heads=1, num_kv_heads=1, head_dim=8)


def kernel_calls(be, fb) -> list[dict]:
    """refspec's kernel call for a forward of ``be`` on ``fb`` (:meth:`FlashAttentionBackend.forward`:
    ``kernel.attention``, recorded by a :class:`~refspec.conformance.recorder.Recorder` bound to
    FA3's ``flash_attn_with_kvcache`` signature, no new K/V), one query row per position of ``fb``;
    the :class:`~refspec.conformance.recorder.Call` objects (their tensor references kept)."""
    rec = Recorder("flash_attn_with_kvcache")
    q = torch.zeros(int(fb.positions.numel()), LAYER.num_heads, LAYER.head_dim)
    with installed(fa3_kernel, {"attention": rec}):
        be.forward(q, None, None, LAYER, fb)
    return rec.calls


def _plain(calls) -> list[dict]:
    return [c.plain() for c in calls]


def _backends(mode: str, kv, pool, sd: int):
    common = {"validate": False}  # conformance compares raw builders
    if mode == "draft_decode":
        return FlashAttentionMultiStepBackend(pool, kv, sd, **common).backends
    return [FlashAttentionBackend(pool, kv, **common)]


def _eager(mode: str, kv, pool, live, sd: int) -> dict:
    backends = _backends(mode, kv, pool, sd)
    if mode == "draft_decode":
        rows, L = live.req_pool_indices.tolist(), live.seq_lens_cpu.tolist()
        steps = [(s, be, fbatch.draft_decode_batch(kv, rows, L, s)) for s, be in enumerate(backends)]
    else:
        steps = [(None, backends[0], live)]
    out = {}
    for s, be, fb in steps:
        out[("eager", s)] = snapshot_metadata(be.init_forward_metadata(fb))
        if mode in KERNEL_MODES:
            out[("eager", s)][KERNEL] = _plain(kernel_calls(be, fb))
    return out


def _graph(mode: str, kv, pool, live, bs: int, staged: bool, sd: int) -> tuple[dict, dict, dict]:
    """Capture at ``bs`` then one padded replay of ``live``: (capture inputs, replay inputs, results)."""
    m, N = MODES[mode][0], sd + 1
    backends = _backends(mode, kv, pool, sd)
    W = {"decode": 1, "verify": N, "draft_decode": sd - 1}.get(mode, N)
    split = None
    if mode == "draft_decode":
        split = lambda fb: [fbatch.draft_step_view(fb, s, sd) for s in range(sd - 1)]
    runner = GraphRunner(m, backends, lambda fb, x: fb.positions.clone(), kv=kv, capture_bs=[bs],
                         tokens_per_req=W, num_draft_tokens=N, split=split)
    steps = list(range(sd - 1)) if mode == "draft_decode" else [None]
    res, captured = {}, {}
    static = runner.static[bs]
    cap_in = snapshot_batch(static)
    for s, be in zip(steps, backends):
        res[("capture", s)] = snapshot_metadata(be.forward_metadata)
        if mode in KERNEL_MODES:  # the call a graph captures: its buffers by reference, its scalars by value
            captured[s] = kernel_calls(be, static if s is None else fbatch.draft_step_view(static, s, sd))
            res[("capture", s)][KERNEL] = _plain(captured[s])
    runner.replay(live)
    rep_in = snapshot_batch(runner.static[bs])
    for s, be in zip(steps, backends):
        res[("replay", s)] = snapshot_metadata(be.forward_metadata)
        if s in captured:  # what the replayed graph hands the kernel: the captured call, its buffers read again
            res[("replay", s)][KERNEL] = _plain(c.reread() for c in captured[s])
    if staged and mode == "draft_extend_v2":  # upstream's second replay order: the same live values
        res[("replay-staged", None)] = res[("replay", None)]
    cap_in["num_tokens"] = rep_in["num_tokens"] = bs * W
    return cap_in, rep_in, res


def build_jobs(modes, page_sizes=PAGE_SIZES, shapes=tuple(SHAPES), seed: int = 0, staged: bool = False,
               num_steps: int = SD, context_len: int = WIDTH, extra: int | None = None, lens=None, tag: str = ""
               ) -> list[Job]:
    """Every job for ``modes`` x ``page_sizes`` x ``shapes`` (IDLE once per page size).

    ``staged``: also expect upstream's staged DRAFT_EXTEND_V2 replay (phase ``replay-staged``,
    compared with refspec's one replay rule; 0.5.23 only).  ``num_steps`` = speculative_num_steps
    Sd (N = Sd + 1 draft tokens); ``req_to_token`` has ``context_len + extra`` columns (``extra``
    None: SGLang's own headroom, :func:`headroom`, per page size) and upstream is given
    ``context_len``; ``lens`` (shape -> committed lengths) replaces :func:`lengths`;
    ``tag`` is appended to the job ids (``/tag``).
    """
    jobs, N = [], num_steps + 1
    for P in page_sizes:
        for si, shape in enumerate(shapes):
            B, bs = SHAPES[shape]
            for mode in modes:
                if mode == "idle" and si:
                    continue
                room = headroom(P, N, num_steps) if extra is None else extra
                kv, pool, rows = _cache(P, B, seed + 7 * P + si, context_len, room)
                L = list(lens[shape]) if lens else lengths(P, B)
                alloc = [x + N for x in L]  # room for every mode's K (L + N at most)
                kv.alloc_extend(rows, [0] * B, alloc)
                live = live_batch(mode, kv, rows, L, num_steps)
                graphed = MODES[mode][1]
                inputs = {"req_to_token": kv.req_to_token.clone(), "page_size": P, "context_len": context_len,
                          "num_draft_tokens": N, "num_steps": num_steps, "eager": snapshot_batch(live)}
                ref = _eager(mode, kv, pool, live, num_steps)
                if graphed:
                    inputs["capture"], inputs["replay"], g = _graph(mode, kv, pool, live, bs, staged, num_steps)
                    inputs["bs"] = bs
                    ref.update(g)
                jobs.append(Job(f"{mode}/P{P}/{shape}" + (f"/{tag}" if tag else ""), mode, P, shape, graphed,
                                inputs, ref))
    return jobs


#: the modes whose eager batch upstream's spec-v2 EAGLE worker builds without CPU mirrors where
#: the backends opt out (``install.Shape.cpu_mirrors`` False); the tag their jobs carry
NO_MIRROR_MODES = ("draft_extend_v2",)
NO_MIRROR_TAG = "no-cpu-mirrors"


def without_mirrors(jobs: list[Job]) -> list[Job]:
    """An eager-only copy of each job of :data:`NO_MIRROR_MODES` with the CPU mirrors
    ``seq_lens_cpu`` / ``extend_seq_lens_cpu`` None, compared with refspec's eager result for the
    same batch (refspec's rule does not depend on where its lengths live).

    That is the batch upstream's backend gets when the worker publishes no CPU mirror:
    ``resolve_seq_lens_cpu`` sets ``seq_lens_cpu = None`` (``managers/overlap_utils.py:436`` at
    v0.5.16), and the backend's eager DRAFT_EXTEND_V2 branch then takes
    ``speculative_num_draft_tokens`` for ``max_seq_len_q`` (``flashattention_backend.py:950-966``,
    whose comment names ``extend_seq_lens_cpu`` None on the GPU-only spec path).  Job ids end in
    ``/no-cpu-mirrors``."""
    out = []
    for j in jobs:
        if j.mode not in NO_MIRROR_MODES or ("eager", None) not in j.refspec:
            continue
        eager = dict(j.inputs["eager"], seq_lens_cpu=None, extend_seq_lens_cpu=None)
        out.append(eager_part(j, f"{j.id}/{NO_MIRROR_TAG}", eager))
    return out


def eager_part(j: Job, job_id: str, eager: dict | None = None) -> Job:
    """Job ``j`` without its graph phases (no ``capture`` / ``replay`` / ``bs`` inputs, refspec's
    eager result only), as ``job_id``; ``eager`` replaces its eager batch where given."""
    inputs = {k: v for k, v in j.inputs.items() if k not in ("capture", "replay", "bs")}
    if eager is not None:
        inputs["eager"] = eager
    return Job(job_id, j.mode, j.page_size, j.shape, False, inputs, {("eager", None): j.refspec[("eager", None)]})


def mark_unreachable(jobs: list[Job], idle_why: str | None) -> list[Job]:
    """``jobs`` with the empty IDLE batches marked unreachable (``Job.unreachable = idle_why``) where
    upstream's runner never builds metadata for one (``install.Shape.idle_unreachable``)."""
    if idle_why:
        for j in jobs:
            if j.mode == "idle":
                j.unreachable = f"an empty batch: {idle_why}"
    return jobs


def mark_graph_unreachable(jobs: list[Job], why: str | None, modes=("draft_extend_v2",)) -> list[Job]:
    """``jobs`` where the CUDA graph of ``modes`` is not reachable upstream (``why``,
    ``install.Shape.draft_extend_graph_unreachable``): each graphed job of those modes becomes its
    eager part (same id, run and compared) plus a job ``<id>/graphs`` marked unreachable (its
    capture and replay: not run, counted and named)."""
    if not why:
        return jobs
    out = []
    for j in jobs:
        if j.mode not in modes or not j.graphed:
            out.append(j)
            continue
        out.append(eager_part(j, j.id))
        out.append(Job(f"{j.id}/graphs", j.mode, j.page_size, j.shape, True, {}, {},
                       unreachable=f"its capture and replay: {why}"))
    return out


#: the context wall: upstream's ``context_len`` 64 with ``req_to_token`` rows SGLang's speculative
#: headroom wider (:func:`headroom`: 23 columns at P = 16, N = 4), P = 16 (a context-sized table
#: has 4 columns); committed lengths at
#: (64), just under (63) and near (61) the limit, so verify / draft extend / draft decode reach
#: K > 64: five live pages
WALL = {"context_len": 64, "page_size": 16, "lens": {"B3/bs4": [61, 20, 30], "B5/bs8": [64, 63, 61, 1, 17]}}
#: long draft chains: speculative_num_steps 6 (N = 7, draft steps 0 .. 4) at small pages, with
#: lengths past 4P + 1 (many pages per request) in a mixed batch
LONG = {"num_steps": 6, "page_sizes": (2, 8)}
EDGE_MODES = ("decode", "verify", "draft_decode", "draft_extend", "draft_extend_v2")


def long_lengths(page_size: int, B: int) -> list[int]:
    """Mixed committed lengths for the long-chain jobs: short, at a page boundary, and past 4P + 1."""
    P = page_size
    return [max(1, x) for x in (9 * P + 3, P - 1, 4 * P + 2, 1, 6 * P)][:B]


def edge_jobs(modes, page_sizes=PAGE_SIZES, seed: int = 0, staged: bool = False) -> list[Job]:
    """The jobs past the plain grid (:data:`WALL`, :data:`LONG`) for ``modes`` among
    :data:`EDGE_MODES`: the context wall where P = 16 is selected, the long chains at the
    selected page sizes of ``LONG``."""
    modes = [m for m in modes if m in EDGE_MODES]
    jobs = []
    if modes and WALL["page_size"] in page_sizes:
        jobs += build_jobs(modes, (WALL["page_size"],), seed=seed + 1000, staged=staged,
                           context_len=WALL["context_len"], lens=WALL["lens"], tag="wall")
    for P in LONG["page_sizes"]:
        if modes and P in page_sizes:
            Sd = LONG["num_steps"]
            jobs += build_jobs(modes, (P,), seed=seed + 2000, staged=staged, num_steps=Sd,
                               context_len=WIDTH, lens={sh: long_lengths(P, SHAPES[sh][0]) for sh in SHAPES},
                               tag=f"S{Sd}")
    return jobs

