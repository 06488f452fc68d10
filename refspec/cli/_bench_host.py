"""The ``host`` section of ``python -m refspec bench``: issue 14's round-time targets in one table.

Configuration: the profile section's (:mod:`refspec.cli._bench_profile`: SmolLM2-135M-Instruct
on MT-Bench when the real weights are installed, bf16, the fused compiled model, graphs on,
validation off, early-exit:25, Sd = 3, P = 16), spec v2 with overlap (the CUDA default), B = 1
and B = 16.  Per B, three runs of :func:`~refspec.cli._bench_profile.profile_config`:

1. plain: ``wall_ms`` per round (steady state, no profiler);
2. profiled (CUDA + CPU activities): ``gpu_busy_ms`` per round (union of kernel intervals),
   ``kernels_per_round``, and the host's launch calls per round with their host microseconds
   (``launches_per_round`` / ``launch_us_per_round``: kernel launches and async copies outside
   graphs; ``graph_launches_per_round`` / ``graph_launch_us_per_round``: ``cudaGraphLaunch``, 3
   per round: draft decode, verify, draft extend, whose host cost grows with the graphs' nodes);
3. under :func:`refspec.speculative.launch_audit.host_ops`: ``host_ops_per_round``, every torch
   op the host dispatches per round outside the graphs (``tests/test_launch_audit.py`` pins the
   same count on CPU: <= 83 at B = 1 for Sd = 3).

Targets (issue 14): ``gpu_busy_ms <= 4`` at B = 1; ``wall / busy <= 1.2`` at B = 1 and 16.
The ``pass`` column says which hold.  A second table (``host kernels``) lists, per B, the
:data:`TOP` kernels by GPU time per round (name, count and microseconds per round): where the
next cut of GPU-busy has to come from.
"""

from __future__ import annotations

import torch

from refspec.cli._bench_profile import _workload, profile_config

DRAFT = "early-exit:25"
TOP = 15
TARGET_BUSY_MS, TARGET_RATIO = 4.0, 1.2


def bench_host(device, quick):
    if device.type != "cuda" or quick:
        return [dict(section="host", what="skipped: needs a CUDA GPU (GPU kernel time per round)")]
    from refspec.model.fused import FusedLlama
    from refspec.speculative.greedy import production_greedy
    rows = []
    for B in (1, 16):
        model, prompts, label = _workload(B)
        fast = FusedLlama(model)
        production_greedy(fast, prompts[:1], [4], page_size=16)  # compile once, outside the timings
        plain = profile_config(fast, prompts, version="v2", draft=DRAFT)
        prof = profile_config(fast, prompts, version="v2", draft=DRAFT, profiled=True)
        ops = profile_config(fast, prompts, version="v2", draft=DRAFT, count_ops=True)
        busy = prof.get("gpu_busy_ms")
        ratio = plain["wall_ms"] / busy if busy else None
        ok = [ratio is not None and ratio <= TARGET_RATIO] + ([busy is not None and busy <= TARGET_BUSY_MS]
                                                              if B == 1 else [])
        rows.append(dict(section="host", workload=label, B=B, draft=DRAFT, version="v2 (overlap)",
                         rounds=plain["rounds"], accept_length=plain["accept_length"],
                         tok_per_s=plain["tok_per_s"], wall_ms=plain["wall_ms"], gpu_busy_ms=busy,
                         **{"wall/busy": ratio}, kernels_per_round=prof.get("kernels_per_round"),
                         **{k: prof.get(k) for k in ("launches_per_round", "launch_us_per_round",
                                                     "graph_launches_per_round", "graph_launch_us_per_round")},
                         host_ops_per_round=ops.get("host_ops_per_round"),
                         targets=(f"busy <= {TARGET_BUSY_MS} ms, " if B == 1 else "") + f"wall/busy <= {TARGET_RATIO}",
                         **{"pass": "yes" if all(ok) else "no"}))
        for name, (n, us) in sorted(prof.get("kernels", {}).items(), key=lambda kv: -kv[1][1])[:TOP]:
            rows.append(dict(section="host kernels", B=B, kernel=name[:90].replace("|", "/"),
                             per_round=n / prof["rounds"], us_per_round=us / prof["rounds"]))
        del fast, model
        torch.cuda.empty_cache()
    return rows

