"""Where a graph-greedy step's time goes on the GPU (issue 24): kernels per step, GPU busy vs
wall, the top kernels, the peer's same figures, and the FA3 decode call's variants.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/diag_greedy.py > diag.txt

A diagnostic (its figures feed benchmarks/results/h200_peer.md), not part of the reference.
"""

from __future__ import annotations

import sys
import time

import torch

from refspec.cli._bench_peer import PeerGreedy
from refspec.cli._bench_profile import _gpu_busy_ms, _kernel_table, _workload
from refspec.model.fused import FusedLlama
from refspec.speculative.greedy import production_greedy

M = 64
OLD = "a544cec"  #: the commit whose graph greedy read each step's tokens before the next launch


def old_greedy():
    """``production_greedy`` as of :data:`OLD` (the non-overlapped loop), loaded from git."""
    import subprocess
    import types

    src = subprocess.run(["git", "show", f"{OLD}:refspec/speculative/greedy.py"], capture_output=True, text=True,
                         check=True).stdout
    mod = sys.modules["old_greedy"] = types.ModuleType("old_greedy")  # dataclasses look the module up
    exec(compile(src, f"{OLD}:refspec/speculative/greedy.py", "exec"), mod.__dict__)
    return mod.production_greedy


def prof(fn):
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as p:
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return out, p, wall


def show(name, p, steps, wall):
    busy, n = _gpu_busy_ms(p)
    print(f"## {name}: steps {steps}, kernels/step {n / steps:.1f}, busy ms/step {busy / steps:.3f}, "
          f"profiled wall ms/step {1e3 * wall / steps:.3f}")
    tab = sorted(_kernel_table(p).items(), key=lambda kv: -kv[1][1])[:25]
    for k, (c, us) in tab:
        print(f"  {c / steps:7.1f}/step {us / steps:8.1f} us/step  {k[:110]}")
    sys.stdout.flush()


def main():
    model, prompts, label = _workload(16)
    print(label, torch.__version__, torch.cuda.get_device_name())
    fast = FusedLlama(model)
    for B in (1, 16):
        ps = prompts[:B]
        cap = (B,)
        for _ in range(2):
            g = production_greedy(fast, ps, [M] * B, page_size=16, validate=False, capture_bs=cap)
        old = old_greedy()
        for _ in range(2):
            o = old(fast, ps, [M] * B, page_size=16, validate=False, capture_bs=cap)
        print(f"B={B} OLD (non-overlapped) graph greedy tok/s incl. prefill {B * M / o.seconds:.0f}; "
              f"new incl. prefill {B * M / g.seconds:.0f}")
        print(f"B={B} graph greedy decode tok/s {B * (M - 1) / g.decode_seconds:.0f} "
              f"(ms/step {1e3 * g.decode_seconds / g.steps:.3f})")
        g, p, wall = prof(lambda: production_greedy(fast, ps, [M] * B, page_size=16, validate=False,
                                                    capture_bs=cap))
        show(f"graph greedy B={B} (whole run incl. prefill)", p, g.steps, wall)
        S = -(-(max(map(len, ps)) + M) // 64) * 64
        peer = PeerGreedy(model, B, S)
        for _ in range(2):
            pr = peer.generate(ps, M)
        print(f"B={B} peer decode tok/s {B * (M - 1) / pr.decode_seconds:.0f} "
              f"(ms/step {1e3 * pr.decode_seconds / (M - 1):.3f})")
        pr, p, wall = prof(lambda: peer.generate(ps, M))
        show(f"peer B={B} (whole run incl. prefill)", p, M - 1, wall)
    fa3_variants()
    perfect(fast, prompts[:1])


def perfect(fast, ps):
    """Spec v2 with the perfect drafter (early-exit:1 forward, proposals = greedy), Sd = 3, 5, 7, B = 1."""
    from refspec.cli._bench_profile import profile_config
    g = production_greedy(fast, ps, [M + 16], page_size=16, validate=False, capture_bs=(1,))
    own = {0: list(ps[0]) + list(g.tokens[0])}
    for Sd in (3, 5, 7):
        r = profile_config(fast, ps, version="v2", draft="early-exit:1", drafter="perfect", reference=own,
                           num_steps=Sd, max_new=M)
        print(f"perfect drafter v2 Sd={Sd} B=1: accept {r['accept_length']:.2f}, {r['tok_per_s']:.0f} tok/s, "
              f"wall ms/round {r['wall_ms']:.3f}, phases draft {r['draft_decode_ms']:.3f} verify {r['verify_ms']:.3f} "
              f"extend {r['draft_extend_ms']:.3f}")
        r = profile_config(fast, ps, version="v2", draft="early-exit:1", drafter="perfect", reference=own,
                           num_steps=Sd, max_new=M, profiled=True)
        print(f"   profiled: busy ms/round {r['gpu_busy_ms']:.3f}, kernels/round {r['kernels_per_round']:.0f}")
        sys.stdout.flush()


def fa3_variants():
    """One FA3 decode call at SmolLM2 shapes (B = 1 and 16, K = 300, P = 16) in a graph: kernels
    per call and us per call, default vs num_splits = 1 vs a precomputed scheduler_metadata."""
    import flash_attn_interface as fi

    from refspec.cli.bench import _graph_timer
    dev = torch.device("cuda")
    for B in (1, 16):
        P, K, H, Hkv, D = 16, 300, 9, 3, 64
        npg = B * (-(-K // P)) + 1
        kc = torch.randn(npg, P, Hkv, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        pt = torch.arange(1, npg, device=dev, dtype=torch.int32).view(B, -1)
        cs = torch.full((B,), K, device=dev, dtype=torch.int32)
        cuq = torch.arange(B + 1, device=dev, dtype=torch.int32)
        sm = fi.get_scheduler_metadata(B, 1, K, H, Hkv, D, cs, torch.bfloat16, cu_seqlens_q=cuq, page_size=P,
                                       causal=True)
        variants = {
            "default (num_splits=0)": lambda: fi.flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=cs, page_table=pt, cu_seqlens_q=cuq, max_seqlen_q=1, causal=True),
            "num_splits=1": lambda: fi.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, page_table=pt,
                                                               cu_seqlens_q=cuq, max_seqlen_q=1, causal=True,
                                                               num_splits=1),
            "scheduler_metadata": lambda: fi.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, page_table=pt,
                                                                     cu_seqlens_q=cuq, max_seqlen_q=1, causal=True,
                                                                     scheduler_metadata=sm),
            "no cu_seqlens_q (batch layout)": lambda: fi.flash_attn_with_kvcache(
                q[:, None], kc, vc, cache_seqlens=cs, page_table=pt, causal=True),
            "no cu_seqlens_q, num_splits=1": lambda: fi.flash_attn_with_kvcache(
                q[:, None], kc, vc, cache_seqlens=cs, page_table=pt, causal=True, num_splits=1),
        }
        for name, fn in variants.items():
            try:
                t = _graph_timer(dev)(fn)
                _, p, _ = prof(lambda: [fn() for _ in range(10)])
                _, n = _gpu_busy_ms(p)
                names = sorted({k[:60] for k in _kernel_table(p)})
                print(f"FA3 B={B} {name}: {t * 1e6:.2f} us/call in a graph, {n / 10:.1f} kernels/call: {names}")
            except Exception as e:  # noqa: BLE001
                print(f"FA3 B={B} {name}: {type(e).__name__}: {e}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
