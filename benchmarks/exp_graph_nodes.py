"""Which graph nodes cost the round's host time (issue 14, B = 16 wall/busy): an A/B/C run.

    python benchmarks/exp_graph_nodes.py [--batches 1,16]

Variants, each on the ``host`` section's workload (v2 overlap, early-exit:25, Sd = 3, P = 16,
bf16, fused compiled model, graphs, validation off):

* ``addmm``: inductor's pattern matcher on (round 3's build: each residual add becomes a cuBLAS
  addmm, whose output is first filled by a device copy of the residual);
* ``main``: refspec's build (``refspec.model.fused.COMPILE_OPTIONS``: pattern matcher off);
* ``main+sched``: ``main`` plus FA3's ``scheduler_metadata`` computed once per forward
  (``get_scheduler_metadata``) and passed to every layer's call, so the per-layer
  ``prepare_varlen_num_blocks`` kernel is gone.  SGLang's FA3 backend does not do this; the
  variant only measures what those nodes cost.

Per variant and B: wall ms / round, host ms / round (wall minus the time blocked on results),
host ms inside ``CUDAGraph.replay``, GPU-busy ms / round and kernels / round (profiled run), and
whether the generated tokens equal ``main``'s (``main+sched`` must: same kernel, same schedule).
"""

from __future__ import annotations

import argparse

import torch


def sched_patch():
    """Wrap ``flash_attn_interface.flash_attn_with_kvcache``: one scheduler_metadata per forward."""
    import flash_attn_interface as fai

    from refspec.model import fused

    orig, gen, cache = fai.flash_attn_with_kvcache, [0], {}
    fwd = fused.FusedLlama.forward

    def forward(self, *a, **k):
        gen[0] += 1
        cache.clear()
        return fwd(self, *a, **k)

    def fa(q, k_cache, v_cache, *, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q, softmax_scale=None,
           causal=True, window_size=(-1, -1), return_softmax_lse=False, **kw):
        key = (cache_seqlens.data_ptr(), cu_seqlens_q.data_ptr(), page_table.data_ptr(), q.shape[0], max_seqlen_q)
        sm = cache.get(key)
        if sm is None:
            sm = cache[key] = fai.get_scheduler_metadata(
                cache_seqlens.shape[0], max_seqlen_q, page_table.shape[1] * k_cache.shape[1], q.shape[1],
                k_cache.shape[2], q.shape[2], cache_seqlens, qkv_dtype=q.dtype, cu_seqlens_q=cu_seqlens_q,
                page_size=k_cache.shape[1], causal=causal, window_size=window_size)
        return orig(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                    cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale,
                    causal=causal, window_size=window_size, return_softmax_lse=return_softmax_lse,
                    scheduler_metadata=sm, **kw)

    fai.flash_attn_with_kvcache = fa
    fused.FusedLlama.forward = forward
    from refspec.fa3 import kernel
    kernel._real_kernel.cache_clear()


def phase_timers():
    """Host seconds per function of the overlap loop, and in the cyclic GC (gc.callbacks)."""
    import gc
    import time

    from refspec.speculative import engine, overlap, rounds
    acc = {}

    def wrap(owner, name, key):
        fn = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc.setdefault(key, []).append(time.perf_counter() - t)
        setattr(owner, name, timed)

    wrap(overlap, "launch", "launch")
    wrap(overlap, "finish", "finish")
    wrap(overlap, "prepare", "prepare")
    wrap(rounds, "round_v2", "round_v2")
    wrap(engine.Engine, "commit", "commit")
    wrap(engine.Engine, "_admit", "admit")
    t0 = [0.0]

    def cb(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            acc.setdefault("gc", []).append(time.perf_counter() - t0[0])
    gc.callbacks.append(cb)
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--variants", default="addmm,main,main+sched")
    ns = ap.parse_args()
    from refspec.cli._bench_profile import _workload, profile_config
    from refspec.model import fused
    from refspec.speculative.greedy import production_greedy

    main_opts = dict(fused.COMPILE_OPTIONS)
    acc = phase_timers()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| variant | B | wall ms | host ms | replay host ms | wait ms | GPU-busy ms | wall/busy | kernels/round "
          "| tokens == main |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    text = {}
    for variant in ns.variants.split(","):
        fused.COMPILE_OPTIONS = {} if variant == "addmm" else main_opts
        if variant == "main+sched":
            sched_patch()
        torch._dynamo.reset()
        for B in map(int, ns.batches.split(",")):
            model, prompts, label = _workload(B)
            fast = fused.FusedLlama(model)
            production_greedy(fast, prompts[:1], [4], page_size=16)
            plain = profile_config(fast, prompts, version="v2", draft="early-exit:25")
            acc.clear()
            plain2 = profile_config(fast, prompts, version="v2", draft="early-exit:25")
            n = plain2["rounds"]
            import statistics
            print("    run 2, ms per call: median / max / calls: " + ", ".join(
                f"{k} {statistics.median(v) * 1e3:.3f} / {max(v) * 1e3:.2f} / {len(v)}" for k, v in sorted(acc.items()))
                + f" (gc: all of the run; sum {sum(acc.get('gc', [])) * 1e3:.1f}); steady rounds {n}", flush=True)
            prof = profile_config(fast, prompts, version="v2", draft="early-exit:25", profiled=True)
            if variant == "main":
                text[B] = plain["text"]
            same = "-" if B not in text else ("yes" if plain["text"] == text[B] else "NO")
            busy = prof["gpu_busy_ms"]
            for p in (plain, plain2):
                print(f"| {variant} | {B} | {p['wall_ms']:.2f} | {p['host_ms']:.2f} | {p['replay_host_ms']:.2f} | "
                      f"{p['wait_ms']:.2f} | {busy:.2f} | {p['wall_ms'] / busy:.2f} | {prof['kernels_per_round']:.0f} "
                      f"| {same} |", flush=True)
            top = sorted(prof["kernels"].items(), key=lambda kv: -kv[1][0])[:16]
            print("    " + "; ".join(f"{n[:40]} {c / prof['rounds']:.0f}" for n, (c, _) in top), flush=True)
            del fast, model
            torch.cuda.empty_cache()
    print(f"workload: {label}")


if __name__ == "__main__":
    main()
