"""The MLA forward path against SGLang's own: the jobs, refspec's side of them, and the comparison.

The metadata of an MLA backend is the MHA metadata (ML-004); what MLA changes is the forward
(docs/mla.md).  An *MLA job* (mode ``mla_<mode>``) is one batch of ``<mode>`` on a fresh
``req_to_token`` and a latent pool of random rows (:class:`~refspec.core.kv_cache.MLAKVPool`,
DeepSeek's row layout at the small dims of :data:`DIMS`), with the inputs DeepSeek's model hands
the backend: on the absorbed path ``q`` (the absorbed ``q_nope``, ``[T, H, R]``), ``q_rope``,
``k`` (the latent, ``[T, 1, R]``) and ``k_rope``; on the prefix-free prefill (``mla_extend``, the
non-absorbed MHA_ONE_SHOT pass) ``q [T, H, Dn + Dr]``, ``k [T, H, Dn + Dr]``, ``v [T, H, Dv]``.
Both sides start every phase from the same rows; refspec's side is its production FA3 backend
with an MLA pool (:mod:`refspec.fa3.mla`, :mod:`refspec.fa3.tree_attention` for top-k > 1),
eager and through its graph runners (capture, then a padded replay), the kernel entry points
recorded (:class:`~refspec.conformance.recorder.Recorder`); upstream's side is
:mod:`refspec.conformance.upstream_mla` in the worker.

Per result (a phase and draft step) the comparison (:func:`diffs`) reads:

* the metadata, as every other job (:func:`refspec.conformance.compare.compare`, its rules; for
  MLA they are ML-004's claim that nothing changes);
* **the kernel calls** (``kernel:<argument>``): their number and kind (``flash_attn_with_kvcache``,
  ``flash_attn_varlen_func``, ``merge_state_v2``); per paged call everything
  :func:`refspec.conformance.compare.kernel_diffs` compares (``cache_seqlens``, ``cu_seqlens_q``,
  ``max_seqlen_q``, the live ``page_table`` under the call's own page size -- 1 for the verify
  expand call, whose table holds token slots --, ``causal``, ``softmax_scale``, ``softcap``,
  ``num_splits``), plus which tensor goes as ``q`` and ``qv`` (shape and values: ``q_rope`` and the
  absorbed ``q_nope``), the geometry of ``k_cache`` / ``v_cache`` as views of the pool (shape,
  strides, offset into the pool's row storage: ML-003's two strided views, ML-011's page-size-1
  views), ``return_softmax_lse`` (the cascade's calls: the merge needs both LSEs); per varlen call
  its ragged ``q`` / ``k`` / ``v``, ``cu_seqlens_q`` / ``cu_seqlens_k``, ``max_seqlen_q`` /
  ``max_seqlen_k``, ``causal``, the scale (ML-010); per merge the LSE layout ``[T, H]``;
* **the output** ``[T, H, Dv]`` (``mla:out``; fp32, the same emulator on both sides);
* **the store** (``mla:store``: the rows written at ``out_cache_loc``; ``mla:slot0``: the padding
  slot, which ML-002 says is never written) and, for top-k > 1 draft decode, the prefix tail
  copied into the branches before the first draft step (``mla:move``, ML-012).

The grid (:data:`PAGE_SIZES`, :data:`TOPK`): every mode at P = 1, 4, 16; B = 3 live requests in a
graph of 4 (padded replay); top-k 1 and 2; :data:`FULL` adds P = 2, 64 and the B = 5 batch in a
graph of 8 (``--mla-grid full``).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import replace

import torch

from refspec.conformance import cases, tree_cases
from refspec.conformance.compare import MISSING, Diff, _call_diffs, _show, compare, compare_parts
from refspec.conformance.recorder import Call, Recorder, installed
from refspec.core import batch as fbatch
from refspec.core.kv_cache import MLAKVPool
from refspec.core.mla import mla_attention_layers, mla_softmax_scale
from refspec.fa3 import kernel as fa3_kernel
from refspec.fa3 import tree_attention
from refspec.fa3.backend import FlashAttentionBackend, FlashAttentionMultiStepBackend
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.graphs.runner import GraphRunner
from refspec.harness.mla_scenario import TINY_DIMS
from refspec.oracle.backend import OracleBackend
from refspec.speculative.tree import build as tree_build
from refspec.speculative.tree import kv as tree_kv
from refspec.speculative.tree.graphs import TreeGraphRunner
from refspec.speculative.tree.runners import tree_draft_batch, tree_verify_batch

PREFIX = "mla_"  #: an MLA mode's prefix (``upstream_common.MLA_PREFIX``)
FA = "sglang/srt/layers/attention/flashattention_backend.py"  #: the backend file, relative to a code's site
#: the MLA modes and the base mode whose batch each runs; ``mla_extend`` is the prefix-free prefill
#: (the non-absorbed pass, ML-009 / ML-010), ``mla_extend_prefix`` the absorbed extend of a prefix
FLAT = ("decode", "extend", "extend_prefix", "verify", "draft_decode", "draft_extend", "draft_extend_v2")
TREE = ("tree_verify", "tree_draft_decode")
MODES = tuple(PREFIX + m for m in FLAT + TREE)
PAGE_SIZES = (1, 4, 16)  #: the default grid's page sizes
TOPK = 2  #: the top-k of the tree modes
SHAPE = "B3/bs4"  #: the default grid's batch: 3 live requests, a graph of 4 (padded replay)
#: ``--mla-grid full``: more page sizes and the second batch shape
FULL = {"page_sizes": (1, 2, 4, 16, 64), "shapes": tuple(cases.SHAPES)}
#: upstream ``context_len`` of the flat jobs (tokens; a multiple of every P), or the next multiple that holds L + N
CONTEXT = 64
HEADS = 2  #: query heads H
DIMS = TINY_DIMS  #: R = 256, Dr = 16, Dn = 16, Dv = 16: inside FA3's qv kernel dims (ML-006), small rows
SCALE = mla_softmax_scale(DIMS)  #: (Dn + Dr)^-0.5 (no YaRN): ML-007's explicit scale
KERNEL = cases.KERNEL  #: the key of a result's kernel calls
MLA = "mla"  #: the key of a result's MLA part (``upstream_mla.MLA``)
#: the kernel globals SGLang's backend module calls on the MLA path; refspec's entry points recorded under them
KERNELS = ("flash_attn_with_kvcache", "flash_attn_varlen_func", "merge_state_v2")
#: an output agrees when every element is within this of the other side's (fp32, the same emulator)
ATOL = 1e-5


def base_mode(mode: str) -> str:
    """``mla_verify`` -> ``verify`` (any other mode as it is)."""
    return mode.removeprefix(PREFIX)


def is_mla(mode: str) -> bool:
    return mode.startswith(PREFIX)


#: what the backend file must hold for its MLA forward path to be driven: the ``use_mla`` switch and the
#: absorbed call with ``qv`` (``flash_attn_with_kvcache(q=q_rope, ..., qv=q_nope, ...)``)
MLA_MARKS = ("self.use_mla", "qv=q_nope")


@functools.lru_cache(maxsize=32)
def has_mla_path(site: str) -> bool:
    """Whether the code under ``site`` (the folder holding ``sglang/``) has the MLA forward path
    this comparison drives (:data:`MLA_MARKS` in its FA3 backend file, read, not imported)."""
    path = os.path.join(site, FA)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    return all(m in text for m in MLA_MARKS)


def modes_for(target) -> list[str]:
    """The MLA modes of ``target`` (an :class:`~refspec.conformance.install.Target`): each of its
    (MHA) modes the MLA forward path runs, where its backend has that path (:func:`has_mla_path`)."""
    if not has_mla_path(target.site):
        return []
    return [PREFIX + m for m in FLAT + TREE if m in target.shape.modes]


# ---- refspec's side ----

def _fa3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, return_softmax_lse=False, **extra):
    """FA3's ``flash_attn_varlen_func`` signature (the arguments compared), for binding refspec's call."""


class _Through(Recorder):
    """A recorder that records a call bound to FA3's signature (``sig``), then calls the entry
    point ``fn`` it stands in for with the arguments as passed (refspec's side)."""

    def __init__(self, name: str, fn, sig=None):
        super().__init__(name, original=sig)
        self.fn = fn

    def __call__(self, *args, **kwargs):
        bound = self.bind(args, kwargs)
        refs = {n: x for n, x in bound.items() if isinstance(x, torch.Tensor)}
        from refspec.conformance.recorder import _ORDER, _caller, snapshot
        self.calls.append(Call(self.name, {n: snapshot(x) for n, x in bound.items()}, _caller(), refs, next(_ORDER)))
        return self.fn(*args, **kwargs)


def refspec_forward(be, fb, layer, x: dict, pool: MLAKVPool, mha: bool):
    """refspec's forward of ``be`` on ``fb`` with the inputs ``x``, its kernel entry points
    recorded: ``(calls, output [T, H, Dv], rows written)``."""
    from refspec.conformance.upstream_mla import written

    buf = pool.get_key_buffer(0)
    before = buf.clone()
    att = _Through("flash_attn_with_kvcache", fa3_kernel.attention)
    var = _Through("flash_attn_varlen_func", fa3_kernel.attention_varlen, _fa3_varlen)
    merge = _Through("merge_state_v2", tree_attention.merge_state)
    with installed(fa3_kernel, {"attention": att, "attention_varlen": var}), \
            installed(tree_attention, {"merge_state": merge}):
        if mha:
            o = be.forward(x["q"], x["k"], x["v"], layer, fb)
        else:
            o = be.forward(x["q"], x["k"], x["k"], layer, fb, q_rope=x["q_rope"], k_rope=x["k_rope"])
    calls = sorted(att.calls + var.calls + merge.calls, key=lambda c: c.order)
    return calls, o.clone(), written(before, buf)


def _result(md: dict, calls, out, rows, buf, extra: dict | None = None) -> dict:
    from refspec.conformance.upstream_mla import plain_calls

    return dict(md, **{KERNEL: plain_calls(calls, buf), MLA: dict({"out": out, "written": rows}, **(extra or {}))})


def _inputs(rows: int, mha: bool, g: torch.Generator) -> dict:
    """Random inputs of ``rows`` query tokens (module doc)."""
    d, H = DIMS, HEADS
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if mha:
        return {"q": r(rows, H, d.qk_head_dim), "k": r(rows, H, d.qk_head_dim), "v": r(rows, H, d.v_head_dim)}
    return {"q": r(rows, H, d.kv_lora_rank), "q_rope": r(rows, H, d.qk_rope_head_dim),
            "k": r(rows, 1, d.kv_lora_rank), "k_rope": r(rows, 1, d.qk_rope_head_dim)}


def _oracle(pool, kv, layer, fb, x) -> torch.Tensor:
    """The MLA oracle (absorbed MLA over the latent rows, keys gathered by slot through
    ``req_to_token``) on the pool as it stands after this forward's store."""
    be = OracleBackend(pool, kv, upcast=True, out_dtype=torch.float32)
    be.init_forward_metadata(fb)
    return be.forward(x["q"], None, None, layer, fb, q_rope=x["q_rope"], k_rope=None)


def _mla_header(pool0: torch.Tensor) -> dict:
    d = DIMS
    return {"R": d.kv_lora_rank, "Dr": d.qk_rope_head_dim, "Dn": d.qk_nope_head_dim, "Dv": d.v_head_dim, "H": HEADS,
            "scaling": SCALE, "pool0": pool0}


def _graph_forwards(phase, steps, pool, pool0, layer, mha, static, step_fb, inputs, res, captured=None,
                    oracle=None):
    """refspec's forwards of one graph phase on the runner's static batch (module doc of
    :mod:`refspec.conformance.upstream_mla`: the same order upstream's are run in)."""
    buf = pool.get_key_buffer(0)
    buf.copy_(pool0)
    for s, be in steps:
        x = inputs[0 if s is None else s]
        bufs = static.setdefault(s, {n: t.clone() for n, t in x.items()})
        for n, t in x.items():
            bufs[n].copy_(t)
        calls, o, w = refspec_forward(be, step_fb(s), layer, bufs, pool, mha)
        shown = calls
        if phase == "capture":
            captured[s] = calls
        elif captured is not None and s in captured:
            shown = [c.reread() for c in captured[s]]  # refspec's replay rewrites its captured buffers in place
        res[(phase, s)] = _result(cases.snapshot_metadata(be.forward_metadata), shown, o, w, buf)


def flat_job(mode: str, P: int, shape: str = SHAPE, seed: int = 0) -> cases.Job:
    """One top-k = 1 MLA job of ``mode`` (``mla_decode`` ...) at page size ``P`` (module doc)."""
    base = base_mode(mode)
    N, Sd = cases.N, cases.SD
    B, bs = cases.SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    L = cases.lengths(P, B)
    context = max(CONTEXT, -(-(max(L) + N) // CONTEXT) * CONTEXT)  # B = 5 at P = 64 reaches L = 3P - 1
    kv, _, rows = cases._cache(P, B, seed, context, cases.headroom(P, N))
    kv.alloc_extend(rows, [0] * B, [x + N for x in L])
    live = cases.live_batch(base, kv, rows, L)
    pool = MLAKVPool(1, kv.allocator.num_pages, P, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim)
    pool0 = torch.randn(pool.get_key_buffer(0).shape, generator=g)
    absorbed, mha_layer = mla_attention_layers(0, HEADS, DIMS, SCALE)
    mha = base == "extend"
    layer = mha_layer if mha else absorbed
    if mha:
        live = live.replace(attn_attend_prefix_cache=False)  # the model's choice for a prefix-free prefill (ML-009)
    inputs = {"req_to_token": kv.req_to_token.clone(), "page_size": P, "context_len": context, "num_draft_tokens": N,
              "num_steps": Sd, "eager": cases.snapshot_batch(live)}
    mla = _mla_header(pool0)
    mla["inputs"] = {}
    ref: dict = {}
    # eager: each step of draft decode on its own batch (K = L + s + 1), the others one forward
    if base == "draft_decode":
        backends = FlashAttentionMultiStepBackend(pool, kv, Sd, validate=False).backends
        steps = [(s, be, fbatch.draft_decode_batch(kv, rows, L, s)) for s, be in enumerate(backends)]
    else:
        steps = [(None, FlashAttentionBackend(pool, kv, validate=False), live)]
    buf = pool.get_key_buffer(0)
    buf.copy_(pool0)
    mla["inputs"]["eager"] = []
    for s, be, fb in steps:
        x = _inputs(int(fb.positions.numel()), mha, g)
        mla["inputs"]["eager"].append(x)
        md = cases.snapshot_metadata(be.init_forward_metadata(fb))
        calls, o, w = refspec_forward(be, fb, layer, x, pool, mha)
        extra = None if mha else {"oracle": _oracle(pool, kv, layer, fb, x)}
        ref[("eager", s)] = _result(md, calls, o, w, buf, extra)
    graphed = cases.MODES[base][1]
    if graphed:
        m = cases.MODES[base][0]
        backends = [be for _, be, _ in steps] if base == "draft_decode" else \
            [FlashAttentionBackend(pool, kv, validate=False)]
        W = {"decode": 1, "verify": N, "draft_decode": Sd - 1}.get(base, N)
        split = (lambda fb: [fbatch.draft_step_view(fb, s, Sd) for s in range(Sd - 1)]) \
            if base == "draft_decode" else None
        runner = GraphRunner(m, backends, lambda fb, x: fb.positions.clone(), kv=kv, capture_bs=[bs],
                             tokens_per_req=W, num_draft_tokens=N, split=split)
        gsteps = list(zip([s for s, _, _ in steps], backends))
        static = runner.static[bs]

        def step_fb(s):
            return static if s is None else fbatch.draft_step_view(static, s, Sd)

        rows_per = bs if base == "draft_decode" else bs * W
        captured, sbufs = {}, {}
        inputs["capture"] = cases.snapshot_batch(static)
        mla["inputs"]["capture"] = [_inputs(rows_per, mha, g) for _ in gsteps]
        _graph_forwards("capture", gsteps, pool, pool0, layer, mha, sbufs, step_fb, mla["inputs"]["capture"], ref,
                        captured)
        runner.replay(live)
        inputs["replay"] = cases.snapshot_batch(runner.static[bs])
        mla["inputs"]["replay"] = [_inputs(rows_per, mha, g) for _ in gsteps]
        _graph_forwards("replay", gsteps, pool, pool0, layer, mha, sbufs, step_fb, mla["inputs"]["replay"], ref,
                        captured)
        inputs["capture"]["num_tokens"] = inputs["replay"]["num_tokens"] = bs * W
        inputs["bs"] = bs
    inputs["mla"] = mla
    return cases.Job(f"{mode}/P{P}/{shape}", mode, P, shape, graphed, inputs, ref)


def tree_job(mode: str, P: int, seed: int = 0, k: int = TOPK, graphs: bool = True) -> cases.Job:
    """One top-k = ``k`` MLA job (``mla_tree_verify`` / ``mla_tree_draft_decode``) at page size
    ``P``: the cascade of :func:`refspec.fa3.tree_attention.mla_cascade_attention` (module doc);
    ``graphs`` False: its eager part only (job id ending ``/eager``)."""
    base = base_mode(mode)
    verify = base == "tree_verify"
    N, S, (B, BS) = tree_cases.num_draft_tokens(k), tree_cases.S, (tree_cases.B, tree_cases.BS)
    g = torch.Generator().manual_seed(seed)
    Ls = cases.lengths(P, B)
    width = tree_cases._width(base, Ls, k, P, S)
    kv, _, rows = tree_cases._cache(width, P, seed, cases.headroom(P, N, S, k), B)
    kv.alloc_extend(rows, [0] * B, Ls)
    pool = MLAKVPool(1, kv.allocator.num_pages, P, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim)
    pool0 = torch.randn(pool.get_key_buffer(0).shape, generator=g)
    buf = pool.get_key_buffer(0)
    buf.copy_(pool0)
    layer, _ = mla_attention_layers(0, HEADS, DIMS, SCALE)
    inputs = {"page_size": P, "context_len": width, "topk": k, "num_steps": S, "num_draft_tokens": N, "bs": BS}
    mla = _mla_header(pool0)
    mla["inputs"] = {}
    ref: dict = {}
    if verify:
        kv.alloc_extend(rows, Ls, [L + N for L in Ls])
        tree = tree_cases.draw_tree(k, seed, S, B)
        organized = tree_build.organize_draft_results(tree["score_list"], tree["token_list"], tree["parents_list"], N)
        built = tree_build.build_tree(tree["verified_id"], *organized, torch.tensor(Ls), k, N)
        live = tree_verify_batch(kv, rows, Ls, N, k, built["positions"], built["custom_mask"])
        backends = [FlashAttentionTreeBackend(pool, kv, topk=k, num_draft_tokens=N, validate=False)]
        steps = [None]
        x_graph = {"ids": torch.zeros(B * N, dtype=torch.long)}
        per = N
    else:
        kv.alloc_extend(rows, Ls, [tree_kv.draft_alloc_len(L, k, S, P) for L in Ls])
        loc = tree_kv.assign_draft_cache_locs(kv, rows, Ls, k, S)
        live = tree_draft_batch(kv, rows, Ls, k, S, loc)
        backends = [FlashAttentionTreeBackend(pool, kv, topk=k, num_steps=S, speculative_step_id=s, validate=False)
                    for s in range(S - 1)]
        steps = list(range(S - 1))
        x_graph = {"topk_p": torch.zeros(B, k), "topk_index": torch.zeros(B, k, dtype=torch.long)}
        per = k
    inputs["req_to_token"] = kv.req_to_token.clone()
    inputs["eager"] = tree_cases.snapshot_batch(live)
    move = None
    if not verify:  # the prefix tail into the branches t >= 1 (TR-015), before the first draft forward (ML-012)
        src, tgt = tree_kv.tail_copy_slots(kv, rows, Ls, k, S)
        from refspec.conformance.upstream_mla import written

        tree_kv.move_kv_cache(pool, tgt, src)
        move = written(pool0, buf)
        mla["pool_moved"] = buf.clone()
    moved = buf.clone()
    mla["inputs"]["eager"] = []
    for s, be in zip(steps, backends):
        fb = live if s is None else draft_step_batch(live, s)
        x = _inputs(B * per, False, g)
        mla["inputs"]["eager"].append(x)
        be.init_forward_metadata(live)
        parts = tree_cases.snapshot(be)
        calls, o, w = refspec_forward(be, fb, layer, x, pool, False)
        extra = {"moved": move} if move is not None and s == steps[0] else {}
        if verify:
            extra["oracle"] = _tree_oracle(kv, rows, Ls, N, built["custom_mask"], buf, x, layer)
        ref[("eager", s)] = _result(parts, calls, o, w, buf, extra)
    if not graphs:
        inputs.pop("bs")
        inputs["mla"] = mla
        return cases.Job(f"{mode}/k{k}/P{P}/eager", mode, P, f"k{k}", False, inputs, ref)
    runner = TreeGraphRunner(tree_cases._Runners(kv, k, N, backends, verify, S), "verify" if verify else "draft",
                             [BS], torch.float32)
    static = runner.static[BS][0]
    inputs["capture"] = tree_cases.snapshot_batch(static)
    gsteps = list(zip(steps, backends))
    captured, sbufs = {}, {}

    def step_fb(s):
        return static if s is None else draft_step_batch(static, s)

    def snap(phase):
        buf.copy_(moved)
        for s, be in gsteps:
            x = mla["inputs"][phase][0 if s is None else s]
            bufs = sbufs.setdefault(s, {n: t.clone() for n, t in x.items()})
            for n, t in x.items():
                bufs[n].copy_(t)
            calls, o, w = refspec_forward(be, step_fb(s), layer, bufs, pool, False)
            shown = calls
            if phase == "capture":
                captured[s] = calls
            elif s in captured:
                shown = [c.reread() for c in captured[s]]
            ref[(phase, s)] = _result(tree_cases.snapshot(be), shown, o, w, buf)

    mla["inputs"]["capture"] = [_inputs(BS * per, False, g) for _ in gsteps]
    snap("capture")
    runner.replay(live, x_graph)
    inputs["replay"] = tree_cases.snapshot_batch(runner.static[BS][0])
    mla["inputs"]["replay"] = [_inputs(BS * per, False, g) for _ in gsteps]
    snap("replay")
    inputs["mla"] = mla
    return cases.Job(f"{mode}/k{k}/P{P}", mode, P, f"k{k}", True, inputs, ref)


def _tree_oracle(kv, rows, Ls, N, custom_mask, buf, x, layer) -> torch.Tensor:
    """The verify oracle, dense: row i of request b attends the committed slots
    ``req_to_token[r_b, :L_b]`` and the slots of the tree nodes its FULL_MASK row allows, in fp32
    (absorbed MLA over the latent rows, TR-004 / ML-005)."""
    R, scale = DIMS.kv_lora_rank, layer.softmax_scale
    out = torch.empty(len(rows) * N, HEADS, R)
    off = 0
    for b, (r, L) in enumerate(zip(rows, Ls)):
        K = L + N
        mask = custom_mask[off:off + N * K].view(N, K)
        off += N * K
        slots = kv.req_to_token[r, :K].long()
        for i in range(N):
            sel = slots[mask[i]]
            row = buf[sel, 0].double()
            t = b * N + i
            s = (x["q"][t].double() @ row[:, :R].T + x["q_rope"][t].double() @ row[:, R:].T) * scale
            out[t] = (torch.softmax(s, -1) @ row[:, :R]).float()
    return out


#: the grids of ``--mla-grid``
GRIDS = ("default", "full", "off")


def grid(name: str, page_sizes=None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(page sizes, batch shapes)`` of the MLA grid ``name`` (:data:`GRIDS`): ``default`` P = 1, 4,
    16 and B = 3 in a graph of 4, what CI runs; ``full`` adds P = 2, 64 and B = 5 in a graph of 8
    (:data:`FULL`); each restricted to ``page_sizes`` where given.  ValueError for another name."""
    if name not in GRIDS:
        raise ValueError(f"MLA grid {name!r}: one of {', '.join(GRIDS)}")
    pages, shapes = (FULL["page_sizes"], FULL["shapes"]) if name == "full" else (PAGE_SIZES, (SHAPE,))
    if name == "off":
        pages = ()
    return tuple(P for P in pages if page_sizes is None or P in page_sizes), shapes


def build_jobs(page_sizes=PAGE_SIZES, shapes=(SHAPE,), modes=MODES, seed: int = 0) -> list[cases.Job]:
    """Every MLA job of ``modes`` at ``page_sizes`` (flat modes for each of ``shapes``)."""
    jobs = []
    for P in page_sizes:
        for mode in modes:
            if base_mode(mode) in TREE:
                if P in tree_cases.PAGE_SIZES:
                    jobs.append(tree_job(mode, P, seed + 7 * P + 3))
            else:
                jobs += [flat_job(mode, P, shape, seed + 7 * P + i) for i, shape in enumerate(shapes)]
    return jobs


# ---- the comparison ----

def _t(x):
    return x["tensor"] if isinstance(x, dict) and "tensor" in x else None


#: ``file:line`` of an upstream exception's text (``upstream_common.describe``)
_AT = re.compile(r" at ((?:\S*/)?sglang/\S+?\.py):(\d+)")


def _view(x) -> str:
    """A recorded ``k_cache`` / ``v_cache``: its geometry as a view of the pool, or what it is."""
    if isinstance(x, dict) and x.get("pool_view"):
        return f"view {list(x['shape'])} strides {list(x['stride'])} at offset {x['offset']}"
    if isinstance(x, dict) and "shape" in x:
        return f"not a view of the pool: {list(x['shape'])} strides {list(x['stride'])}"
    return MISSING if x is None else str(x)


def _same_tensor(a, b) -> tuple[bool, str]:
    ta, tb = _t(a), _t(b)
    if ta is None or tb is None:
        return (ta is None and tb is None), ""
    if tuple(ta.shape) != tuple(tb.shape):
        return False, f"shape {list(ta.shape)} | {list(tb.shape)}"
    if not torch.equal(ta, tb):
        return False, f"values differ (max |d| {(ta.double() - tb.double()).abs().nan_to_num(math.inf).max():.3g})"
    return True, ""


def _kvcache_diffs(a: dict, b: dict, P: int, part: str) -> list[Diff]:
    """One pair of ``flash_attn_with_kvcache`` calls; ``part`` names the cascade call (``prefix`` /
    ``expand``: field ``kernel:<part>.<argument>``), '' for the one call of top-k = 1."""
    out = [Diff(d.field, d.ours, d.theirs) for d in _call_diffs(a, b, P, [], None) if d.field != "kernel:k_cache"]
    for name, role in (("q", "q_rope"), ("qv", "q_nope (absorbed)")):
        ok, why = _same_tensor(a.get(name), b.get(name))
        if not ok:
            out.append(Diff(f"kernel:{name}", f"{role} {_show_shape(a.get(name))}",
                            f"{_show_shape(b.get(name))}" + (f": {why}" if why else "")))
    for name in ("k_cache", "v_cache"):
        va, vb = a.get(name), b.get(name)
        if _view(va) != _view(vb):
            refused = f"; refspec's emulator refuses upstream's call: {b['refused']}" if b.get("refused") else ""
            out.append(Diff(f"kernel:{name}", _view(va), _view(vb) + refused))
    if part and bool(a.get("return_softmax_lse")) != bool(b.get("return_softmax_lse")):  # the merge needs both LSEs
        out.append(Diff("kernel:return_softmax_lse", str(bool(a.get("return_softmax_lse"))),
                        str(bool(b.get("return_softmax_lse")))))
    if b.get("refused") and not any(d.field in ("kernel:k_cache", "kernel:v_cache") for d in out):
        out.append(Diff("kernel:read", "the call reads inside the pool and the table",
                        f"refspec's emulator refuses upstream's call: {b['refused']}"))
    if not part:
        return out
    return [Diff(f"kernel:{part}.{d.field.removeprefix('kernel:')}", d.ours, d.theirs) for d in out]


def _show_shape(x) -> str:
    t = _t(x)
    return MISSING if t is None else str(list(t.shape))


def _varlen_diffs(a: dict, b: dict) -> list[Diff]:
    out = []
    for name in ("q", "k", "v"):
        ok, why = _same_tensor(a.get(name), b.get(name))
        if not ok:
            out.append(Diff(f"kernel:varlen.{name}", _show_shape(a.get(name)), f"{_show_shape(b.get(name))}: {why}"))
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        ta, tb = _t(a.get(name)), _t(b.get(name))
        if ta is None or tb is None or ta.tolist() != tb.tolist():
            out.append(Diff(f"kernel:varlen.{name}", _show(ta) if ta is not None else MISSING,
                            _show(tb) if tb is not None else MISSING))
    for name, norm in (("max_seqlen_q", int), ("max_seqlen_k", int), ("causal", bool), ("softmax_scale", float)):
        va, vb = a.get(name), b.get(name)
        va, vb = (None if va is None else norm(va)), (None if vb is None else norm(vb))
        if va != vb:
            out.append(Diff(f"kernel:varlen.{name}", str(va), str(vb)))
    return out


def _merge_diffs(a: dict, b: dict) -> list[Diff]:
    out = []
    for name in ("s_a", "s_b"):
        sa, sb = _show_shape(a.get(name)), _show_shape(b.get(name))
        if sa != sb:
            out.append(Diff(f"kernel:merge.{name}", f"LSE {sa} [T, H]", f"LSE {sb}"))
    return out


def kernel_diffs(mode: str, ours: list, theirs, page_size: int) -> list[Diff]:
    """The ``kernel:`` diffs of one MLA result (module doc); ``theirs`` a list of plain calls, or the
    text of what upstream's forward raised."""
    if isinstance(theirs, str):
        m = _AT.search(theirs)
        at = (m.group(1), int(m.group(2))) if m else None
        return [Diff("kernel:calls", "the forward's calls", f"upstream's forward raised: {theirs}", at=at)]
    names = lambda cs: [c["name"] for c in cs]  # noqa: E731
    if names(ours) != names(theirs):
        show = lambda cs: ", ".join(names(cs)) or "no kernel call"  # noqa: E731
        return [Diff("kernel:calls", show(ours), show(theirs))]
    out, paged = [], 0
    base = base_mode(mode)
    for a, b in zip(ours, theirs):
        at = tuple(b["where"]) if b.get("where") else None
        if a["name"] == "flash_attn_with_kvcache":
            # the cascade's second call reads the expand metadata: the verify expand table holds token slots
            part = ("expand" if paged else "prefix") if base in TREE else ""
            P = 1 if part == "expand" and base == "tree_verify" else page_size
            ds = _kvcache_diffs(a["args"], b["args"], P, part)
            paged += 1
        elif a["name"] == "flash_attn_varlen_func":
            ds = _varlen_diffs(a["args"], b["args"])
        else:
            ds = _merge_diffs(a["args"], b["args"])
        out += [Diff(d.field, d.ours, d.theirs, at=at) for d in ds]
    return out


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows (dim 0) of two equal-shape float tensors that differ beyond :data:`ATOL` (NaN differs)."""
    n = a.shape[0]
    d = (a.double() - b.double()).abs().reshape(n, -1).nan_to_num(math.inf)
    return (d > ATOL).any(1) | (a.reshape(n, -1).isnan() != b.reshape(n, -1).isnan()).any(1)


def _at(x) -> tuple[str, int] | None:
    return tuple(x) if x else None


def mla_diffs(ours: dict, theirs: dict, real: int | None, out_at=None) -> list[Diff]:
    """The ``mla:`` diffs: the output (``real``: the rows of real requests' tokens, the rest a
    graph's padding, each part its own field: ``mla:out`` the live rows, ``mla:out[padded]`` the
    padded ones; ``out_at`` the upstream line of the call that made it), the rows stored and
    slot 0 (at the line that called the store), the tail copy (at the line that called the move)."""
    out = []
    a, b = ours.get("out"), theirs.get("out")
    if a is None or b is None or a.shape != b.shape:
        out.append(Diff("mla:out", MISSING if a is None else str(list(a.shape)),
                        MISSING if b is None else str(list(b.shape))))
    else:
        bad = _rows_differ(a, b).nonzero().flatten().tolist()
        real_bad = [r for r in bad if real is None or r < real]
        # the live rows and a graph's padded rows apart: what a padded row reads (slot 0, ML-002) is its own
        # field, so a fix of the live rows' cause leaves the padded rows' difference as it was, not renamed
        for field, rows_ in (("mla:out", real_bad), ("mla:out[padded]", [r for r in bad if r not in real_bad])):
            if not rows_:
                continue
            r = rows_[0]
            err = (a[r].double() - b[r].double()).abs().nan_to_num(math.inf).max().item()
            oracle = ours.get("oracle")
            vs = ""
            if oracle is not None:
                e_ours = (a[r].double() - oracle[r].double()).abs().max().item()
                e_up = (b[r].double() - oracle[r].double()).abs().nan_to_num(math.inf).max().item()
                vs = f"; against the MLA oracle: refspec {e_ours:.2g}, upstream {e_up:.3g}"
            nan = " (NaN: undefined, the kernel reads outside the pool)" if bool(b[r].isnan().any()) else ""
            out.append(Diff(field, f"rows {_rowlist(rows_)} of {a.shape[0]}: refspec row {r} {_show(a[r, 0, :4])}",
                            f"row {r} {_show(b[r, 0, :4])}{nan}, max |d| {err:.3g}{vs}",
                            padded=field == "mla:out[padded]", at=_at(out_at)))
    wa, wb = ours.get("written"), theirs.get("written")
    if wa is not None and wb is not None:
        sa, sb = wa["slots"].tolist(), wb["slots"].tolist()
        at = _at(wb.get("at"))
        if (0 in sb) != (0 in sa):
            out.append(Diff("mla:slot0", "slot 0 (the padding slot) kept" if 0 not in sa else "slot 0 written",
                            "slot 0 written (by a padded row, out_cache_loc 0)" if 0 in sb else "slot 0 kept", at=at))
        ra = dict(zip(sa, wa["rows"]))
        rb = dict(zip(sb, wb["rows"]))
        keys = sorted((set(sa) | set(sb)) - {0})
        bad = [s for s in keys if s not in ra or s not in rb or not torch.equal(ra[s], rb[s])]
        if bad:
            out.append(Diff("mla:store", f"{len([s for s in sa if s])} rows written; differing slots {bad[:8]}",
                            f"{len([s for s in sb if s])} rows written" + _row_note(bad[0], ra, rb), at=at))
    ma, mb = ours.get("moved"), theirs.get("moved")
    if ma is not None or mb is not None:
        if ma is None or mb is None or ma["slots"].tolist() != mb["slots"].tolist() or \
                not torch.equal(ma["rows"], mb["rows"]):
            out.append(Diff("mla:move", _moved(ma), _moved(mb), at=_at((mb or {}).get("at"))))
    return out


def _moved(m) -> str:
    if m is None:
        return MISSING
    s = m["slots"].tolist()
    return f"{len(s)} rows copied into slots {s[:8]}" + (" ..." if len(s) > 8 else "")


def _row_note(s: int, ra: dict, rb: dict) -> str:
    if s not in ra:
        return f"; slot {s} written by upstream only"
    if s not in rb:
        return f"; slot {s} not written by upstream"
    return f"; slot {s}: {_show(rb[s][0, :4])} where refspec has {_show(ra[s][0, :4])}"


def _rowlist(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:6])) + (f" ... ({len(rows)} rows)" if len(rows) > 6 else "")


def real_rows(job: cases.Job, phase: str) -> int | None:
    """Query rows of real requests in ``phase``'s batch (the rest are a graph's padding)."""
    d = job.inputs.get("eager")
    if d is None:
        return None
    if phase == "capture":  # the capture's static batch is all padding
        return 0
    base = base_mode(job.mode)
    B = int(d["req_pool_indices"].numel())
    if base == "tree_verify":
        return B * job.inputs["num_draft_tokens"]
    if base == "tree_draft_decode":
        return B * job.inputs["topk"]
    if base == "draft_decode":
        return B
    return int(d["positions"].numel())  # the live batch's tokens: a graph's static batch holds them first


def diffs(job: cases.Job, phase: str, ours: dict, theirs: dict, real_batch: int | None) -> list[Diff]:
    """Every raw difference of one MLA result (``documented`` unset): metadata, kernel calls, the MLA part."""
    base, P = base_mode(job.mode), job.page_size
    if base in TREE:
        k, N = job.inputs["topk"], job.inputs["num_draft_tokens"]
        B = real_batch
        real = None if B is None else {"prefix": B, "expand": B * N} if base == "tree_verify" else \
            {"prefix": B * k, "expand": B * k}
        raw = compare_parts({p: ours[p] for p in ("prefix", "expand")}, theirs, P,
                            1 if base == "tree_verify" else P, real)
    else:
        raw = compare(ours, theirs, P, real=real_batch)
    seen = {(d.field, d.ours, d.theirs) for d in raw}
    differing = {d.field for d in raw}
    for d in kernel_diffs(job.mode, ours[KERNEL], theirs.get(KERNEL, "no kernel calls came back"), P):
        part, _, arg = d.field.removeprefix("kernel:").rpartition(".")
        field = KERNEL_FIELD.get(arg)
        own = None if field is None else (f"{part}:" if part else "") + field
        if own is not None and (own, d.ours, d.theirs) in seen:
            continue  # the same values as the metadata field's difference: one finding (the metadata's)
        if own is not None and field != "max_seq_len_q" and own not in differing and phase.startswith("replay"):
            # the metadata is right, the captured buffer the replayed call reads is not: CG-001, cited where the
            # replay wrote the field (the line that rebinds it: at None, found in the replay's trace)
            d = replace(d, stale=True, at=None)
        raw.append(d)
    if isinstance(theirs.get(MLA), dict):
        calls = theirs.get(KERNEL)
        last = calls[-1].get("where") if isinstance(calls, list) and calls else None
        found = mla_diffs(ours[MLA], theirs[MLA], real_rows(job, phase), last)
        # a capture's output is discarded (a graph records its launches); its store is real (the warm-up
        # and capture runs write the padded rows' slots)
        raw += [d for d in found if not (phase == "capture" and d.field.startswith("mla:out"))]
    return raw


# ---- the rules ----

#: the rule of each ``mla:`` field and of each kernel argument MLA passes (docs/spec/mla.md); the
#: arguments read from a metadata field take that field's rule (:data:`KERNEL_FIELD`)
FIELD_RULE = {"mla:slot0": "ML-002", "mla:store": "ML-002", "mla:move": "ML-012", "q": "ML-005", "qv": "ML-005",
              "k_cache": "ML-003", "v_cache": "ML-003", "read": "PA-011", "softmax_scale": "ML-007",
              "return_softmax_lse": "ML-011", "merge.s_a": "TR-012", "merge.s_b": "TR-012",
              "varlen.softmax_scale": "ML-007", "causal": "PA-004", "softcap": "PA-012", "num_splits": "PA-012",
              "window_size": "PA-012", "attention_chunk": "PA-012", "new_kv": "PA-009"}
#: a kernel argument read from a metadata field: that field
KERNEL_FIELD = {"cache_seqlens": "cache_seqlens_int32", "cu_seqlens_q": "cu_seqlens_q", "max_seqlen_q": "max_seq_len_q",
                "page_table[live]": "page_table[live]"}


def rule_for(mode: str, phase: str, field: str | None, error: str | None = None, base_rule=None,
             stale: bool = False) -> str:
    """The rule of a difference of an MLA result: ``field`` (``mla:...``, ``kernel:[part.]arg``, a
    metadata field), or, ``field`` None, an upstream error (``error`` its text).  ``base_rule``:
    the base mode's mapping (``refspec.conformance.rules.rule_for``) for the metadata fields and
    the kernel arguments read from them; ``stale`` (``Diff.stale``: a replayed call reads a
    captured buffer the replay did not rewrite, its metadata field right) goes to it as the
    kernel argument it is (CG-001, the MHA path's route).

    The view of the top-k > 1 verify *expand* call (its table holds token slots) is ML-011's;
    the output is ML-005's (absorbed), ML-010's (the prefill) or ML-011's (the cascade) until
    :func:`attribute` names its cause; an error of the tail copy's ``move_kv_cache`` ML-012's; any
    other upstream error the call's rule."""
    base = base_mode(mode)
    tree = base in TREE
    if field is None:
        if error and "move_kv_cache" in error:
            return "ML-012"
        return "ML-011" if tree else "ML-010" if base == "extend" else "ML-005"
    if field in FIELD_RULE:
        return FIELD_RULE[field]
    if field in ("mla:out", "mla:out[padded]", "kernel:calls"):
        return "ML-010" if base == "extend" else "ML-011" if tree else "ML-005"
    if not field.startswith("kernel:"):
        return base_rule(base, phase, field)
    arg = field.removeprefix("kernel:")
    part, _, arg = arg.rpartition(".") if arg.startswith(("prefix.", "expand.")) else ("", "", arg)
    if arg.startswith("varlen.") or field.startswith("kernel:varlen."):
        return FIELD_RULE.get(field.removeprefix("kernel:"), "ML-010")
    if part == "expand" and base == "tree_verify" and arg in ("k_cache", "v_cache", "read"):
        return "ML-011"
    if arg in KERNEL_FIELD:
        if stale:
            return base_rule(base, phase, f"kernel:{arg}")
        return base_rule(base, phase, (f"{part}:" if part else "") + KERNEL_FIELD[arg])
    return FIELD_RULE.get(arg, "ML-005")


#: the output's fields (:func:`mla_diffs`): what the forward computed, a consequence of the row's other fields
OUT_FIELDS = ("mla:out", "mla:out[padded]")


def attribute(row) -> None:
    """Name each output finding (``mla:out`` / ``mla:out[padded]``) of an MLA ``row`` (a
    :class:`refspec.conformance.report.Row` after ``report.find``) by the rule of its cause, where
    the row shows one, and cite that finding's upstream line:

    * padded rows only, with ``mla:slot0`` differing: ML-002 (a padded row's store wrote slot 0,
      which the padded rows then read);
    * else the first (``rules.by_cause``) rule of the row's other findings of the call or its
      metadata -- a table or length (``expand:page_table[live]`` TR-018, ``cache_seqlens_int32``
      MD-003, a stale replayed buffer CG-001, ...) or an argument (``k_cache`` ML-003, ...);
    * else ``mla:slot0`` (ML-002);
    * else the output's own rule (:func:`rule_for`), never ML-011 at P = 1 (the P-paged views
      are the page-size-1 views there: ML-005, the ``qv`` call).

    Upstream exceptions and adapter gaps are left as they are."""
    from dataclasses import replace as _replace

    from refspec.conformance import rules

    if not is_mla(row.mode):
        return
    causes = [f for f in row.findings if f.field and f.field not in OUT_FIELDS and f.field != "mla:slot0" and
              not f.field.startswith("mla:")]
    slot0 = next((f for f in row.findings if f.field == "mla:slot0"), None)
    first = None
    if causes:
        rank = rules.by_cause([f.rule for f in causes])[0]
        first = next(f for f in causes if f.rule == rank)
    out = []
    for f in row.findings:
        if f.field in OUT_FIELDS:
            cause = slot0 if f.field == "mla:out[padded]" and slot0 is not None else first or slot0
            if cause is not None:
                f = _replace(f, rule=cause.rule, level=cause.level, where=cause.where, url=cause.url, how=cause.how,
                             via=cause.via, via_url=cause.via_url)
            elif f.rule == "ML-011" and row.page_size == 1:
                f = _replace(f, rule="ML-005", level=rules.level("ML-005"))
        out.append(f)
    row.findings[:] = out


# ---- the console ----

#: what is compared for MLA, as the console line and the docs say it
COMPARED = ("the kernel calls (which tensor goes as q / qv / k_cache / v_cache: values, shapes, strides and the "
            "offset into the pool's row; softmax_scale, causal, page_table, cache_seqlens, cu_seqlens_q, "
            "max_seqlen_q, num_splits, the cascade's return_softmax_lse; the prefill's flash_attn_varlen_func "
            "q / k / v, cu_seqlens_k, max_seqlen_k; merge_state_v2's LSE layout), the output, the rows stored "
            "(slot 0 too), the top-k > 1 tail copy")


def console_lines(out, side: str = "") -> list[str]:
    """One line per target with MLA rows: what ran (modes, page sizes, top-k, phases), what is
    compared (:data:`COMPARED`) and the outcome counts; ``out`` a
    :class:`refspec.conformance.run.Outcome`."""
    lines = []
    for label in dict.fromkeys(r.pin for r in out.rows):
        mine = [r for r in out.rows if r.pin == label and is_mla(r.mode)]
        if not mine:
            continue
        jobs = {r.job for r in mine}
        pages = sorted({r.page_size for r in mine})
        ks = sorted({r.topk for r in mine})
        same = sum(r.ok and not r.diffs for r in mine)
        doc = sum(r.ok and bool(r.diffs) for r in mine)
        bad = [r for r in mine if r.broken]
        known = sum(bool(r.bug) for r in bad)
        gaps = sum(bool(r.gap) and not r.broken for r in mine)
        full = pages != list(PAGE_SIZES) or any(r.batch == 8 for r in mine)
        grid_said = "--mla-grid full" if full else "the default grid; --mla-grid full adds P = 2, 64 and B = 5 in a " \
                                                   "graph of 8"
        lines.append(f"== {side}MLA forward path: sglang {label}: {len(jobs)} jobs, {len(mine)} results "
                     f"({', '.join(dict.fromkeys(r.mode for r in mine))}; P = {', '.join(map(str, pages))}; top-k "
                     f"{' and '.join(map(str, ks))}; eager, capture, padded replay; {grid_said}): upstream's own "
                     f"MLA forward on its MLATokenToKVPool against refspec's MLA backend, compared: {COMPARED}; "
                     f"{same} identical, {doc} with only documented (metadata) differences, {len(bad)} failing"
                     + (f" ({known} on known upstream bugs)" if known else "")
                     + (f", {gaps} adapter gaps" if gaps else ""))
    return lines
