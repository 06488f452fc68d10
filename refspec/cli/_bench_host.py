"""The ``host`` section of ``python -m refspec bench``: issue 14's round-time targets in one table.

Configuration: the profile section's (:mod:`refspec.cli._bench_profile`: SmolLM2-135M-Instruct
on MT-Bench when the real weights are installed, bf16, the fused compiled model, graphs on,
validation off, early-exit:25, Sd = 3, P = 16), spec v2 with overlap (the CUDA default), B = 1
and B = 16.  **Each B runs in a fresh Python process** (``python -m refspec.cli._bench_host B``,
one JSON row per line), as a server runs one configuration: in one process the second
configuration's host time was measured 1-3 ms per round higher than the same configuration
in a fresh process (benchmarks/results/h200_round4.md).  Per B, after one compile warm-up,
runs of :func:`~refspec.cli._bench_profile.profile_config`:

1. plain, :data:`PLAIN_RUNS` times: ``wall_ms`` per round (steady state, no profiler), the
   median run's, with the spread (``wall_ms_min`` / ``wall_ms_max``); the same runs time the
   host without a profiler (:class:`~refspec.cli._bench_profile.HostTimers`): ``host_ms``
   (wall minus ``wait_ms``, the time the host blocked on round results: > 0 means the GPU was
   behind) and ``replay_host_ms`` (inside ``CUDAGraph.replay``);
2. profiled (CUDA + CPU activities): ``gpu_busy_ms`` per round (union of kernel intervals),
   ``kernels_per_round``, and the host's launch calls per round with their host microseconds
   (``launches_per_round`` / ``launch_us_per_round``: kernel launches and async copies outside
   graphs; ``graph_launches_per_round`` / ``graph_launch_us_per_round``: ``cudaGraphLaunch``, 3
   per round; CUPTI inflates these host times, compare ``replay_host_ms``);
3. under :func:`refspec.audits.launch.host_ops`: ``host_ops_per_round``, every torch
   op the host dispatches per round outside the graphs (``tests/test_launch_audit.py`` pins the
   same count on CPU: <= 83 at B = 1 for Sd = 3).

Targets (issue 14): ``gpu_busy_ms <= 4`` at B = 1; ``wall / busy <= 1.2`` at B = 1 and 16
(``wall/busy`` from the median plain run; ``wall/busy max`` from the slowest).  The ``pass``
column says which hold.  A second table (``host kernels``) lists, per B, the :data:`TOP`
kernels by GPU time per round (name, count and microseconds per round).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from refspec.cli._bench_profile import _workload, profile_config

DRAFT = "early-exit:25"
TOP = 15
TARGET_BUSY_MS, TARGET_RATIO = 4.0, 1.2


PLAIN_RUNS = 3


def bench_host(device, quick):
    """One fresh process per B (module doc); its rows, in order."""
    if device.type != "cuda" or quick:
        return [dict(section="host", what="skipped: needs a CUDA GPU (GPU kernel time per round)")]
    rows = []
    for B in (1, 16):
        out = subprocess.run([sys.executable, "-m", "refspec.cli._bench_host", str(B)], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        if out.returncode:
            raise RuntimeError(f"bench host B = {B}: exit {out.returncode}\n{out.stderr[-3000:]}")
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return rows


def host_rows(B: int) -> list[dict]:
    """The ``host`` and ``host kernels`` rows of one B, measured in this process."""
    from refspec.model.fused import FusedLlama
    from refspec.speculative.greedy import production_greedy
    model, prompts, label = _workload(B)
    fast = FusedLlama(model)
    production_greedy(fast, prompts[:1], [4], page_size=16)  # compile once, outside the timings
    plains = sorted((profile_config(fast, prompts, version="v2", draft=DRAFT) for _ in range(PLAIN_RUNS)),
                    key=lambda r: r["wall_ms"])
    plain = plains[len(plains) // 2]
    prof = profile_config(fast, prompts, version="v2", draft=DRAFT, profiled=True)
    ops = profile_config(fast, prompts, version="v2", draft=DRAFT, count_ops=True)
    busy = prof.get("gpu_busy_ms")
    ratio = plain["wall_ms"] / busy if busy else None
    ok = [ratio is not None and ratio <= TARGET_RATIO] + ([busy is not None and busy <= TARGET_BUSY_MS]
                                                          if B == 1 else [])
    rows = [dict(section="host", workload=label, B=B, draft=DRAFT, version="v2 (overlap)",
                 rounds=plain["rounds"], accept_length=plain["accept_length"], tok_per_s=plain["tok_per_s"],
                 wall_ms=plain["wall_ms"], wall_ms_min=plains[0]["wall_ms"], wall_ms_max=plains[-1]["wall_ms"],
                 gpu_busy_ms=busy, **{"wall/busy": ratio,
                                      "wall/busy max": plains[-1]["wall_ms"] / busy if busy else None},
                 host_ms=plain.get("host_ms"), wait_ms=plain.get("wait_ms"),
                 replay_host_ms=plain.get("replay_host_ms"), kernels_per_round=prof.get("kernels_per_round"),
                 **{k: prof.get(k) for k in ("launches_per_round", "launch_us_per_round",
                                             "graph_launches_per_round", "graph_launch_us_per_round")},
                 host_ops_per_round=ops.get("host_ops_per_round"),
                 targets=(f"busy <= {TARGET_BUSY_MS} ms, " if B == 1 else "") + f"wall/busy <= {TARGET_RATIO}",
                 **{"pass": "yes" if all(ok) else "no"})]
    for name, (n, us) in sorted(prof.get("kernels", {}).items(), key=lambda kv: -kv[1][1])[:TOP]:
        rows.append(dict(section="host kernels", B=B, kernel=name[:90].replace("|", "/"),
                         per_round=n / prof["rounds"], us_per_round=us / prof["rounds"]))
    return rows


if __name__ == "__main__":  # one B per process: python -m refspec.cli._bench_host B
    for row in host_rows(int(sys.argv[1])):
        print(json.dumps(row))
