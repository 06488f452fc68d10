"""The ``loop`` section of ``python -m refspec bench``: whole speculative rounds of the
production loop.

Workload: the committed MT-Bench trace (``benchmarks/traces/mtbench_smollm2.json``): its real
prompt token ids and its real per-request accept counts, forced with scripted acceptance, so every
configuration runs the same realistic schedule (accept length ~1.5 with the early-exit:25 draft).
The model is a random-init network with SmolLM2-135M's config (the real weights do not travel to
the GPU machine), bf16 on CUDA; ``--quick`` uses a 2-layer body on CPU.  Batches larger than the
trace cycle its requests.  Validation is off (it is a host-side check, see the metadata section).

Per configuration (version, graphs, page size P, batch B): median ms per round (a round = Sd - 1
draft-decode steps + verify + draft extend, timed between the engine's round events with a device
synchronize, prefill and capture excluded), tokens/s over the rounds, accept length, and host
syncs per round inside the round.  Then the ratios: graphs / eager and v2 / v1.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from refspec.traces.replay import TINY, random_target
from refspec.speculative import generate
from refspec.traces.chain import accept_table, load_trace, replay_budgets

TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "mtbench_smollm2.json"


def _workload(trace, B):
    """B requests cycling the trace's: prompts, budgets, accept lists (request ids 0..B-1)."""
    n = len(trace["requests"])
    prompts = [trace["requests"][i % n]["prompt_ids"] for i in range(B)]
    budgets, table = replay_budgets(trace), accept_table(trace)
    return prompts, [budgets[i % n] for i in range(B)], {i: table[i % n] for i in range(B)}


def run_config(model, trace, *, version, graphs, P, B, draft, capture_bs):
    """One generate() run of B requests; returns the row (see module doc)."""
    prompts, budgets, table = _workload(trace, B)
    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    marks, times = {"last": None}, []

    def observer(event, engine, **info):
        if event in ("prefill", "round_end"):
            sync()
            now = time.perf_counter()
            if event == "round_end" and marks["last"] is not None and not info["trace"].joined:
                times.append(now - marks["last"])
            marks["last"] = now

    res = generate(model, prompts, backend="fa3", version=version, page_size=P, graphs=graphs, draft=draft,
                   num_steps=trace["config"]["num_steps"], max_new_tokens=budgets, accept=table,
                   max_batch=B, capture_bs=capture_bs, validate=False, observer=observer)
    rounds = len(res.trace)
    emitted = sum(sum(r.emitted) for r in res.requests)
    return dict(section="loop", version=version, graphs=graphs, P=P, B=B, rounds=rounds,
                ms_per_round=1e3 * statistics.median(times) if times else float("nan"),
                tok_per_s=emitted / sum(times) if times else float("nan"),
                accept_length=res.accept_length, syncs_per_round=res.host_syncs.get("in_round", 0) / max(rounds, 1))


def bench_loop(device, quick):
    trace = load_trace(TRACE)
    cuda = device.type == "cuda"
    m32 = random_target(trace["config"]["model_config"], seed=0, device=device, overrides=TINY if quick else None)
    model = copy.deepcopy(m32).to(torch.bfloat16) if cuda else m32
    draft = "early-exit:1" if quick else trace["config"]["draft"]
    if quick:
        grid = [(v, g, P, B) for v in ("v1", "v2") for g in (False, True) for P in (1, 4) for B in (1, 2)]
        capture_bs = (1, 2)
    else:
        grid = sorted({(v, g, 16, B) for v in ("v1", "v2") for g in (False, True) for B in (1, 8, 32)} |
                      {(v, True, P, B) for v in ("v1", "v2") for P in (1, 4, 16, 64) for B in (1, 4)})
        capture_bs = (1, 2, 4, 8, 16, 32)
    rows = []
    with torch.no_grad():
        for v, g, P, B in tqdm(grid, desc="loop", leave=False):
            rows.append(run_config(model, trace, version=v, graphs=g, P=P, B=B, draft=draft, capture_bs=capture_bs))
    return rows + _ratios(rows)


def _ratios(rows):
    """graphs / eager (ms per round) and v2 / v1 (tokens/s) for each matching pair."""
    key = {(r["version"], r["graphs"], r["P"], r["B"]): r for r in rows}
    out = []
    for (v, g, P, B), r in key.items():
        if g and (v, False, P, B) in key:
            out.append(dict(section="loop ratios", what=f"graphs/eager ms per round, {v} P={P} B={B}",
                            ratio=r["ms_per_round"] / key[(v, False, P, B)]["ms_per_round"]))
        if v == "v2" and ("v1", g, P, B) in key:
            out.append(dict(section="loop ratios", what=f"v2/v1 tokens/s, graphs={g} P={P} B={B}",
                            ratio=r["tok_per_s"] / key[("v1", g, P, B)]["tok_per_s"]))
    return out
