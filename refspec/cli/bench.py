"""``python -m refspec bench``: is the production path fast, and how close to the limit?

Sections (each figure is a ratio against a baseline measured in the same run):

1. ``kernel``: FA3 paged decode (Q = 1) and verify (Q = N) over page sizes, batch sizes and
   context lengths: achieved KV bytes/s as % of the device-to-device copy bandwidth measured
   in this run (``torch`` copy of a large buffer).
   ``scale``: the kernel, the emulator and the oracle on one small batch, for scale.
2. ``metadata``: time of the out-of-graph replay-metadata update (the page table in place; with
   validation also the lengths and the checks) per call vs the kernel time of the same batch,
   validation on and off.
3. ``loop``: one full spec round (Sd draft steps + verify + draft extend) of the production
   loop, v1 and v2, graphs vs eager, host syncs per round; and end-to-end tokens/s + accept
   length over page sizes (registered by :mod:`refspec.speculative` when the engine is present).

``--quick`` runs the smallest configuration (what ``make test`` runs on CPU to keep this
script working).  Results: a Markdown table on stdout and, with ``--out DIR``, ``bench.md``
and ``bench.png`` in DIR.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from refspec.cli._args import PROG, ArgumentParser, CLIError, choice_list, device_name, run
from refspec.graphs.capture import CudaGraph
from refspec.fa3.kernel import flash_attn_with_kvcache, select_provider
from refspec.core.modes import ForwardMode
from refspec.oracle.backend import OracleBackend
from refspec.harness.scenario import Scenario


def _timer(device):
    """``time(fn, reps) -> median seconds``: CUDA events on GPU, perf_counter on CPU."""
    def run(fn, reps=20, warmup=3):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); fn(); b.record(); torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
        return statistics.median(times)
    return run


def copy_bandwidth(device, nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes/s counting read + write) of one large buffer."""
    n = nbytes // 2 if device.type == "cuda" else (64 << 20) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = _timer(device)(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() * 2 / t


def _graph_timer(device, calls: int = 20):
    """``time(fn) -> median seconds per call``, ``fn`` replayed ``calls`` times inside one CUDA graph.

    A kernel's own time, without the ~0.2 ms of a Python call: what the production path pays,
    since every graphed forward launches its kernels from a replayed graph.  CPU: plain calls.
    """
    if device.type != "cuda":
        return lambda fn: _timer(device)(fn, reps=2, warmup=1)

    def run(fn):
        g = CudaGraph()  # the production capture recipe: side-stream warm-up, collector paused
        g.capture(lambda: [fn() for _ in range(calls)])
        return _timer(device)(g.replay, reps=10, warmup=2) / calls
    return run


def _kernel_case(device, P, B, ctx, Q, H=32, Hkv=8, D=128, provider=None, in_graph=True):
    """One paged batch of B requests with ctx keys each; returns (seconds per call, KV bytes read, ...).

    ``in_graph``: time the call replayed from a CUDA graph (:func:`_graph_timer`); else one eager
    Python call per timing (launch-bound for small batches).
    """
    mode = ForwardMode.DECODE if Q == 1 else ForwardMode.TARGET_VERIFY
    lens = [ctx] * B if Q == 1 else [ctx - Q] * B
    sc = Scenario(mode, P, lens, num_draft_tokens=max(Q, 1), num_heads=H, num_kv_heads=Hkv, head_dim=D,
                  dtype=torch.bfloat16, device=str(device), poison=False, shuffle_pages=False)
    built = sc.build()
    be = built.fa3_backend(provider=provider, validate=False)
    md = be.init_forward_metadata(built.fb)
    k_cache, v_cache = built.pool.get_kv_buffer(0)
    def call():
        flash_attn_with_kvcache(built.q, k_cache, v_cache, cache_seqlens=md.cache_seqlens_int32,
                                page_table=md.page_table, cu_seqlens_q=md.cu_seqlens_q,
                                max_seqlen_q=md.max_seq_len_q, causal=True, provider=provider)
    if in_graph and (provider or select_provider(device)) != "emulator":
        t = _graph_timer(device)(call)
    else:
        t = _timer(device)(call, reps=10 if device.type == "cuda" else 2, warmup=2 if device.type == "cuda" else 1)
    return t, 2 * B * ctx * Hkv * D * 2, md, built, be


def bench_kernel(device, quick):
    bw = copy_bandwidth(device)
    rows = [dict(section="kernel", what="copy bandwidth", value=f"{bw / 1e9:.0f} GB/s")]
    if quick:
        grid = [(P, 1, 64, Q) for P in (1, 16) for Q in (1, 4)]
    else:
        grid = [(P, B, ctx, Q) for P in (1, 4, 16, 64, 128, 256) for B in (1, 8, 32, 128)
                for ctx in (512, 4096, 16384) for Q in (1, 4)]
    timing = "in a CUDA graph, 20 calls" if device.type == "cuda" else "one eager call (CPU: no GPU claim)"
    rows[0]["timing"] = timing
    for P, B, ctx, Q in tqdm(grid, desc="kernel", leave=False):
        t, nbytes, *_ = _kernel_case(device, P, B, ctx, Q)
        rows.append(dict(section="kernel", P=P, B=B, ctx=ctx, Q=Q, us=t * 1e6,
                         pct_bw=100 * nbytes / t / bw, provider=select_provider(device)))
    return rows


def bench_scale(device, quick):
    """For scale: the real kernel, the emulator and the oracle on one small verify batch."""
    P, B, ctx, Q = 16, 4, 512, 4
    rows = []
    for prov in dict.fromkeys([select_provider(device), "emulator"]):
        t, nbytes, *_ = _kernel_case(device, P, B, ctx, Q, provider=prov, in_graph=False)
        rows.append(dict(section="scale", what=f"kernel provider {prov}", P=P, B=B, ctx=ctx, Q=Q, us=t * 1e6))
    _, _, md, built, _ = _kernel_case(device, P, B, ctx, Q)
    oracle = OracleBackend(built.pool, built.kv)
    oracle.init_forward_metadata(built.fb)
    t = _timer(device)(lambda: oracle.forward(built.q, None, None, built.layer, built.fb),
                       reps=3 if device.type == "cuda" else 1, warmup=1)
    rows.append(dict(section="scale", what="oracle (fp32, gather by slot)", P=P, B=B, ctx=ctx, Q=Q, us=t * 1e6))
    base = rows[0]["us"]
    for r in rows:
        r["x_kernel"] = r["us"] / base
    return rows


def bench_metadata(device, quick):
    """Replay-metadata update vs kernel time for verify batches (validation on and off): the
    out-of-graph replay hook, i.e. the page table and its checks (the lengths are the graph's own
    work, ``init_forward_metadata_in_graph``; a validating replay writes them here too)."""
    rows = []
    for B in ((1, 4) if quick else (1, 8, 32, 128)):
        t_kernel, _, _, built, _ = _kernel_case(device, 16, B, 512 if quick else 4096, 4, in_graph=False)
        for validate in (False, True):
            runner = built.graph_runner(capture_bs=(B,), validate=validate)
            be = runner.backend
            fb = runner.static[B]
            runner._fill(fb, built.fb, B, dict(q=built.q, k=built.k, v=built.v))
            t = _timer(device)(lambda: be.init_forward_metadata_replay_cuda_graph(B, fb, num_real=B),
                               reps=10 if device.type == "cuda" else 3)
            rows.append(dict(section="metadata", B=B, validate=validate, us=t * 1e6, kernel_us=t_kernel * 1e6,
                             ratio=t / t_kernel))
    return rows


def bench_loop(device, quick):
    """Whole spec rounds of the production loop (:mod:`refspec.cli._bench_loop`)."""
    from refspec.cli._bench_loop import bench_loop as run

    return run(device, quick)


def bench_profile(device, quick):
    """Where a round's time goes: wall vs GPU-busy, kernels per layer, phases (:mod:`refspec.cli._bench_profile`)."""
    from refspec.cli._bench_profile import bench_profile as run

    return run(device, quick)


def bench_seed(device, quick):
    """The seed's comparisons (P = 4 vs 1, v2 vs v1) on the real model (:mod:`refspec.cli._bench_profile`)."""
    from refspec.cli._bench_profile import bench_seed as run

    return run(device, quick)


def bench_drafts(device, quick):
    """Draft cost vs acceptance against graph greedy at B = 1 (:mod:`refspec.cli._bench_profile`)."""
    from refspec.cli._bench_profile import bench_drafts as run

    return run(device, quick)


def bench_host(device, quick):
    """Issue 14's round targets: GPU-busy, wall / busy, launches per round (:mod:`refspec.cli._bench_host`)."""
    from refspec.cli._bench_host import bench_host as run

    return run(device, quick)


def bench_eagle(device, quick):
    """The trained EAGLE head vs graph greedy: accept length and tokens/s (:mod:`refspec.cli._bench_eagle`)."""
    from refspec.cli._bench_eagle import bench_eagle as run

    return run(device, quick)


def bench_teacher_forced(device, quick):
    """Teacher-forced accept lengths of several drafts on one fixed text (:mod:`refspec.cli._bench_eagle`)."""
    from refspec.cli._bench_eagle import bench_teacher_forced as run

    return run(device, quick)


def bench_peer(device, quick):
    """Graph greedy vs a compiled static-cache greedy loop, B = 1, 4, 16 (:mod:`refspec.cli._bench_peer`)."""
    from refspec.cli._bench_peer import bench_peer as run

    return run(device, quick)


SECTIONS = {"kernel": bench_kernel, "scale": bench_scale, "metadata": bench_metadata, "loop": bench_loop,
            "profile": bench_profile, "seed": bench_seed, "drafts": bench_drafts, "host": bench_host,
            "eagle": bench_eagle, "teacher-forced": bench_teacher_forced, "peer": bench_peer}


def to_markdown(rows) -> str:
    out = []
    for section in dict.fromkeys(r["section"] for r in rows):
        rs = [r for r in rows if r["section"] == section]
        keys = list(dict.fromkeys(k for r in rs for k in r if k != "section"))
        out += [f"### {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in rs:
            out.append("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                                         for k in keys) + " |")
        out.append("")
    return "\n".join(out)


def plot_rows(rows) -> list[dict]:
    """The kernel rows the plot draws: real-kernel bandwidth (the emulator's would mean nothing)."""
    return [r for r in rows if r["section"] == "kernel" and "pct_bw" in r and r.get("provider") != "emulator"]


def plot(rows, path: Path) -> bool:
    """Draw ``bench.png`` (KV bandwidth vs page size, Q = 1 and Q = 4); False, drawing nothing,
    when there are no real-kernel rows (an empty figure says nothing)."""
    ks = plot_rows(rows)
    if not ks:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, Q in zip(axes, (1, 4)):
        for ctx in sorted({r["ctx"] for r in ks}):
            for B in sorted({r["B"] for r in ks}):
                pts = sorted((r["P"], r["pct_bw"]) for r in ks if r["Q"] == Q and r["ctx"] == ctx and r["B"] == B)
                if pts and B == max(r["B"] for r in ks):
                    ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=f"ctx {ctx}, B {B}")
        ax.set_xscale("log", base=2); ax.set_xlabel("page size P"); ax.set_title(f"Q = {Q}")
    axes[0].set_ylabel("KV bytes/s, % of copy bandwidth")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.tight_layout(); fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


#: printed with every CPU run: the numbers are for keeping the script working, not for claims
CPU_CAVEAT = ("note: CPU run (provider: the emulator). These timings are noise for the GPU claims "
              "(kernel bandwidth, graph speed-ups): run 'python -m refspec bench --device cuda' on a Hopper GPU.")
NO_PLOT = "no plot: it shows the real FA3 kernel's bandwidth, and this run has no real-kernel rows"


def main(argv=None) -> int:
    """Run the sections; print Markdown (and write files with ``--out``); 0, or 2 on a usage error."""
    return run(_main, argv, f"{PROG} bench")


def _main(argv) -> int:
    ap = ArgumentParser(prog=f"{PROG} bench", description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--quick", action="store_true", help="smallest configuration (a CPU smoke test)")
    ap.add_argument("--sections", type=choice_list(list(SECTIONS), "sections"), default=list(SECTIONS),
                    metavar="NAME[,NAME...]",
                    help=f"which parts to run, comma-separated, from {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--out", type=Path, metavar="DIR", help="write bench.md, bench.json (+ bench.png) in this folder")
    ap.add_argument("--plot", type=Path, metavar="BENCH_JSON",
                    help="only draw bench.png next to an earlier run's bench.json (e.g. from a GPU machine "
                         "without matplotlib)")
    args = ap.parse_args(argv)
    if args.plot:
        try:
            rows = json.loads(args.plot.read_text(encoding="utf-8"))["rows"]
        except FileNotFoundError:
            raise CLIError(f"--plot {args.plot}: no such file (a bench.json written by --out DIR)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CLIError(f"--plot {args.plot}: not a bench.json written by --out DIR "
                           f"({type(e).__name__}: {e})") from e
        if not plot(rows, args.plot.with_suffix(".png")):
            raise CLIError(f"--plot {args.plot}: {NO_PLOT}")
        return 0
    if args.out and args.out.exists() and not args.out.is_dir():
        raise CLIError(f"--out {args.out} is a file; give a folder (bench.md, bench.json, bench.png go there)")
    device = torch.device(args.device)
    if device.type == "cpu":
        print(CPU_CAVEAT, flush=True)
    rows = []
    for name in args.sections:
        rows += SECTIONS[name](device, args.quick)
    env = (f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor() or 'cpu'}, "
           f"torch {torch.__version__}, provider {select_provider(device)}")
    md = f"{env}\n\n" + (f"{CPU_CAVEAT}\n\n" if device.type == "cpu" else "") + to_markdown(rows)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.md").write_text(md)
        (args.out / "bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        if not plot_rows(rows):
            print(NO_PLOT)
        else:
            try:
                plot(rows, args.out / "bench.png")
            except ImportError:
                print("matplotlib missing: draw later with --plot bench.json")
    return 0
