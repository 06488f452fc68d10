"""The ``profile`` section of ``python -m refspec bench``: where one speculative round's time goes.

Workload: SmolLM2-135M-Instruct on MT-Bench first turns when the real weights are installed
(``refspec.real``), else a random-init model of the same config on the committed trace's prompts
(same shapes, so the same speed; accept lengths then mean nothing).  bf16 + the fused model
(:class:`~refspec.model.fused.FusedLlama`, compiled) on CUDA; fp32, readable model on CPU.
Graphs on, validation off, Sd = 3, ``max_new_tokens`` 48 per request.

Per configuration (draft, version, B):

* ``wall_ms``: wall time per round over the decode window of :mod:`refspec.cli._timing` (from
  the first prefill to the end, one device synchronize at each end only, so an overlapped engine
  keeps overlapping; prefill and capture excluded), the window every "x graph greedy" uses;
* ``gpu_busy_ms``: per round, the union of the GPU kernel intervals the CUDA profiler saw over
  the same rounds of a second, profiled run (the profiler inflates wall time, not kernel time);
  ``wall/busy`` is the ratio the issue targets (<= 1.2);
* ``kernels_per_layer``: kernels per round / layer forwards per round (verify: all layers;
  each draft forward: the draft's layers), LM heads and metadata kernels included;
* ``launches_per_round``: the host's CUDA runtime launch calls per round in the profiled run
  (:data:`LAUNCH_CALLS`: kernels and async copies / memsets, outside graphs), and
  ``graph_launches_per_round`` (``cudaGraphLaunch``), with their host microseconds
  (``launch_us_per_round``, ``graph_launch_us_per_round``);
* ``host_ops_per_round`` (``count_ops=True``): torch ops the host dispatches per round outside
  the graphs, :func:`refspec.audits.launch.host_ops` (a third run);
* ``draft/verify/extend_ms``: per-phase GPU time between CUDA events recorded at the engine's
  phase events (idle GPU time inside a phase included);
* ``tok_per_s`` (the window's, :class:`~refspec.cli._timing.Timed`; the row keeps it as ``timed``
  for :func:`~refspec.cli._timing.speedup`) and ``accept_length``; and two greedy baselines
  measured in the same run:
  graph greedy (:func:`~refspec.speculative.greedy.production_greedy`: paged KV, FA3 DECODE
  replayed from a CUDA graph, the same fused model) and eager greedy (the dense oracle loop).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from refspec.cli import _timing
from refspec.cli._timing import DecodeWindow, time_greedy
from refspec.speculative import generate

MAX_NEW = 48
PHASES = ("draft_decode", "verify", "draft_extend")
#: CUDA runtime / driver calls that launch work on the stream (counted on the profiler's CPU side)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaMemcpyAsync", "cudaMemsetAsync")


def capture_sizes(B: int) -> tuple[int, ...]:
    """The graph batch sizes the bench captures for B requests: 1, 2, 4, ... below 2B (B and
    every smaller batch left as requests finish replay a graph)."""
    return tuple(b for b in (1, 2, 4, 8, 16, 32) if b < 2 * B)


def _workload(B: int):
    """(readable bf16/fp32 model, prompts [B], label) on the current device."""
    from refspec.real import missing_reason
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if missing_reason() is None:
        from refspec.real.run import chat_prompts, load_target, pick_questions
        model, _ = load_target(torch.float32)
        prompts = chat_prompts(pick_questions(min(B, 80)))
        label = "SmolLM2-135M-Instruct (real weights), MT-Bench"
    else:
        from refspec.cli._bench_loop import TRACE
        from refspec.traces.replay import random_target
        from refspec.traces.chain import load_trace
        trace = load_trace(TRACE)
        model = random_target(trace["config"]["model_config"], seed=0, device=dev)
        prompts = [r["prompt_ids"] for r in trace["requests"]]
        label = "random-init SmolLM2-135M config (real weights not installed), trace prompts"
    prompts = [prompts[i % len(prompts)] for i in range(B)]
    return model.to(dev, dtype).eval(), prompts, label


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _gpu_busy_ms(prof) -> tuple[float, int]:
    """Union of the CUDA kernel intervals (ms) and the kernel count in a finished profiler."""
    iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for a, b in iv:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e3, len(iv)


def _kernel_table(prof) -> dict:
    """Kernel name -> [count, total us] of the CUDA kernels in a finished profiler."""
    table: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            row = table.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.time_range.end - e.time_range.start
    return table


def _launches(prof) -> dict:
    """The host's launch calls in a finished profiler: counts and host microseconds of the
    :data:`LAUNCH_CALLS` (``launches``, ``launch_us``) and of ``cudaGraphLaunch`` (``graph_launches``,
    ``graph_launch_us``: its host cost grows with the graph's node count)."""
    out = dict(launches=0, launch_us=0.0, graph_launches=0, graph_launch_us=0.0)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        kind = "launch" if e.name in LAUNCH_CALLS else "graph_launch" if e.name == "cudaGraphLaunch" else None
        if kind:
            out[kind + "es"] += 1
            out[kind + "_us"] += e.time_range.end - e.time_range.start
    return out


class HostTimers:
    """Host seconds inside ``torch.cuda.CUDAGraph.replay`` (``replay``: the ``cudaGraphLaunch``
    calls, whose cost grows with the graphs' nodes) and inside
    :meth:`~refspec.core.transfer.ResultCopy.wait` (``wait``: the host blocked on a round's
    results, i.e. idle because the GPU is behind), measured with ``time.perf_counter`` and no
    profiler (CUPTI inflates the host cost of a graph launch).  A context manager that wraps the
    two methods for its duration."""

    def __init__(self):
        self.replay = self.wait = 0.0

    def __enter__(self):
        from refspec.core.transfer import ResultCopy
        self._orig = [(cls, name, getattr(cls, name)) for cls, name in ((torch.cuda.CUDAGraph, "replay"),
                                                                        (ResultCopy, "wait"))]
        for cls, name, fn in self._orig:
            setattr(cls, name, self._timed(fn, name))
        return self

    def _timed(self, fn, name):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, name, getattr(self, name) + time.perf_counter() - t)
        return timed

    def __exit__(self, *exc):
        for cls, name, fn in self._orig:
            setattr(cls, name, fn)


def profile_config(model, prompts, *, version, draft, drafter=None, P=16, profiled=False, count_ops=False,
                   num_steps=3, max_new=MAX_NEW, **kw) -> dict:
    """One measurement over the decode window (module doc); ``profiled`` runs under the CUDA profiler
    (CPU + CUDA activities), ``count_ops`` under :func:`~refspec.audits.launch.host_ops`.
    An unprofiled run also reports :class:`HostTimers` per round: ``replay_host_ms`` and
    ``wait_ms`` (``host_ms`` = ``wall_ms - wait_ms``: the host's own time per round).  The row's
    ``timed`` is the window (:class:`~refspec.cli._timing.Timed`; not JSON: pop it before saving)."""
    from refspec.audits.launch import host_ops
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    st = dict(t0=None, r0=0, r1=0, ev=[], prof=None, ops=None, timers=None, h0=(0.0, 0.0))
    timers = HostTimers() if cuda and not profiled and not count_ops else None
    window = DecodeWindow(dev)

    def observer(event, eng, **info):
        if event == "prefill" and st["t0"] is None:
            window.observer(event, eng)  # synchronizes, then starts the clock
            st["t0"], st["r0"] = window.t0, len(eng.trace)
            if timers is not None:
                st["h0"] = (timers.replay, timers.wait)
            if profiled and cuda:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                st["prof"] = torch.profiler.profile(activities=acts)
                st["prof"].start()
            if count_ops:  # after capture and compilation: only the steady-state rounds
                st["ops"] = host_ops()
                st["seen"] = st["ops"].__enter__()
        if st["t0"] is not None and cuda and event in (*PHASES, "round_end"):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            st["ev"].append((event, e))
        if event == "round_end":
            st["r1"] = len(eng.trace)

    with timers or contextlib.nullcontext():
        res = generate(model, prompts, backend="fa3", version=version, page_size=P, graphs=True, draft=draft,
                       drafter=drafter, num_steps=num_steps, max_new_tokens=max_new, validate=False, observer=observer,
                       capture_bs=capture_sizes(len(prompts)), **kw)
        if st["ops"] is not None:
            st["ops"].__exit__(None, None, None)
        timed = window.stop(res.tokens)
    rounds = max(st["r1"] - st["r0"], 1)
    row = dict(rounds=rounds, wall_ms=1e3 * timed.seconds / rounds, accept_length=res.accept_length)
    if timers is not None and st["t0"]:
        row["replay_host_ms"] = 1e3 * (timers.replay - st["h0"][0]) / rounds
        row["wait_ms"] = 1e3 * (timers.wait - st["h0"][1]) / rounds
        row["host_ms"] = row["wall_ms"] - row["wait_ms"]
    row["tok_per_s"], row["timed"] = timed.tok_per_s, timed
    if st["prof"] is not None:
        st["prof"].stop()
        busy, n = _gpu_busy_ms(st["prof"])
        row.update(gpu_busy_ms=busy / rounds, kernels_per_round=n / rounds, kernels=_kernel_table(st["prof"]),
                   **{k + "_per_round": v / rounds for k, v in _launches(st["prof"]).items()})
    if st["ops"] is not None:
        row["host_ops_per_round"] = sum(st["seen"].values()) / rounds
    ph = {p: [] for p in PHASES}
    ev = st["ev"]
    for (_, a), (name, b) in zip(ev, ev[1:]):
        if name in ph:
            ph[name].append(a.elapsed_time(b))
    for p, xs in ph.items():
        row[f"{p}_ms"] = statistics.median(xs) if xs else float("nan")
    row["text"] = res.tokens
    return row


def bench_profile(device, quick):
    if device.type != "cuda" or quick:
        return [dict(section="profile", what="skipped: needs a CUDA GPU (GPU kernel time per round)")]
    from refspec.model.fused import FusedLlama
    from refspec.oracle.loop import greedy
    rows = []
    for B in (1, 16):
        model, prompts, label = _workload(B)
        fast = FusedLlama(model)
        budgets = [MAX_NEW] * B
        # graph greedy over the decode window (refspec.cli._timing, its second run timed); eager
        # greedy (the dense oracle loop, one request at a time) over its whole run
        _, g_time = time_greedy(fast, prompts, budgets, page_size=16, capture_bs=(B,))
        rows.append(dict(section="profile baselines", workload=label, B=B, what="graph greedy",
                         tok_per_s=g_time.tok_per_s))
        _sync(device)
        t = time.perf_counter()
        toks = sum(len(greedy(model, p, MAX_NEW).tokens) for p in prompts)
        _sync(device)
        rows.append(dict(section="profile baselines", workload=label, B=B, what="eager greedy (whole run)",
                         tok_per_s=toks / (time.perf_counter() - t)))
        for draft, drafter in (("early-exit:25", None),):  # the configuration; other drafts: bench_drafts
            for version in ("v1", "v2"):
                for profiled in (False, True):
                    r = profile_config(fast, prompts, version=version, draft=draft, drafter=drafter,
                                       profiled=profiled)
                    r.pop("text")
                    r.pop("timed")
                    r.pop("kernels", None)
                    if not profiled:
                        base = dict(section="profile", workload=label, B=B,
                                    draft=draft + (f" +{drafter} drafter" if drafter else ""),
                                    version=version, **r)
                    else:
                        base.update({k: r.get(k) for k in ("gpu_busy_ms", "kernels_per_round", "launches_per_round")})
                k = int(draft.split(":")[1])
                layer_fwds = model.config.num_hidden_layers + 3 * k  # verify + 2 draft steps + draft extend
                base["kernels_per_layer"] = (base["kernels_per_round"] / layer_fwds
                                             if base.get("kernels_per_round") else None)
                base["wall/busy"] = base["wall_ms"] / base["gpu_busy_ms"] if base.get("gpu_busy_ms") else None
                rows.append(base)
    return rows


#: the seed's reported end-to-end gains (the task's source PRs, full SGLang server): page size 4
#: over page size 1 with top-k = 1 (+4.7 %), and overlap spec v2 over v1 with FA3 (+13.7 %)
SEED = {"P4/P1": 1.047, "v2/v1": 1.137}


def bench_seed(device, quick):
    """The seed's two comparisons on this engine: P = 4 vs 1 and v2 vs v1, B = 1 and 4 (module doc's workload)."""
    if device.type != "cuda" or quick:
        return [{"section": "seed", "what": "skipped: needs a CUDA GPU"}]
    from refspec.model.fused import FusedLlama
    rows = []
    for B in (1, 4):
        model, prompts, label = _workload(B)
        fast = FusedLlama(model)
        res = {}
        for P in (1, 4):
            for v in ("v1", "v2"):
                r = profile_config(fast, prompts, version=v, draft="early-exit:25", P=P)
                r.pop("text")
                r.pop("timed")
                res[(P, v)] = r
                rows.append({"section": "seed", "workload": label, "B": B, "P": P, "version": v,
                             "tok_per_s": r["tok_per_s"], "accept_length": r["accept_length"],
                             "wall_ms": r["wall_ms"]})
        for v in ("v1", "v2"):
            rows.append({"section": "seed ratios", "B": B, "what": f"P4/P1 tokens/s, {v}",
                         "refspec": res[(4, v)]["tok_per_s"] / res[(1, v)]["tok_per_s"], "seed": SEED["P4/P1"]})
        for P in (1, 4):
            rows.append({"section": "seed ratios", "B": B, "what": f"v2/v1 tokens/s, P={P}",
                         "refspec": res[(P, "v2")]["tok_per_s"] / res[(P, "v1")]["tok_per_s"], "seed": SEED["v2/v1"]})
    return rows


def bench_drafts(device, quick):
    """Why (or when) speculation beats graph greedy at B = 1: draft cost vs acceptance.

    Real early-exit drafts (the first k of the target's layers: a draft step costs about k / L of
    a target step) and, as the engine's ceiling, a 1-layer draft forward whose proposals are
    scripted to the target's own greedy tokens ("perfect": accept length -> N), i.e. what a cheap
    draft that is always right would give.  The perfect drafter reads graph greedy's tokens from
    the same run (the production path's own bf16 greedy), not the dense model's.  v2, P = 16, Sd = 3.
    """
    if device.type != "cuda" or quick:
        return [{"section": "drafts", "what": "skipped: needs a CUDA GPU"}]
    from refspec.model.fused import FusedLlama
    model, prompts, label = _workload(1)
    fast = FusedLlama(model)
    g, g_time = time_greedy(fast, prompts, [MAX_NEW], page_size=16, capture_bs=(1,))
    # the perfect drafter's reference is this path's own greedy text: the dense readable model's
    # bf16 greedy leaves it after a few tokens, and proposals scripted from that stop matching
    own = {i: list(p) + list(t) for i, (p, t) in enumerate(zip(prompts, g.tokens))}
    rows = [{"section": "drafts", "workload": label, "draft": "(graph greedy, no speculation)", "accept_length": 1.0,
             "tok_per_s": g_time.tok_per_s, "x_graph_greedy": 1.0}]
    L = model.config.num_hidden_layers
    for draft, drafter in [(f"early-exit:{k}", None) for k in (4, 10, 16, 25) if k < L] + [("early-exit:1", "perfect")]:
        r = profile_config(fast, prompts, version="v2", draft=draft, drafter=drafter,
                           **({"reference": own} if drafter else {}))
        rows.append({"section": "drafts", "workload": label, "draft": draft + (" +perfect drafter" if drafter else ""),
                     "accept_length": r["accept_length"], "wall_ms": r["wall_ms"], "tok_per_s": r["tok_per_s"],
                     "x_graph_greedy": _timing.speedup(r["timed"], g_time)})
    return rows
