"""A freshly trained head (EAGLE or EAGLE-3) against the committed one, in one process.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/compare_heads.py NEW.safetensors OUTDIR [--sections accept,speed]
    PYTHONPATH=/tmp/site:$PWD python benchmarks/compare_heads.py --median OUTDIR RUN_DIR [RUN_DIR ...]

NEW is any head ``train-draft`` wrote (``--kind eagle`` or ``eagle3``; the file's metadata names the
kind, :func:`refspec.real.eagle_head.load_head`, its SHA-256 checked against its card); the committed
head is ``refspec/real/heads/smollm2-135m-eagle.safetensors`` (its SHA-256 checked).  The same 16
MT-Bench prompts, 128 new tokens, the fused bf16 target, FA3, CUDA graphs, v2, P = 16, chain Sd = 3.

* ``accept``: the production loop's accept length at B = 16 and B = 1 (issue 25's and issue 41's
  figure, ``bench --sections eagle``'s) and the teacher-forced accept length
  (:func:`refspec.harness.teacher_forced.teacher_forced_accepts`) on the production path's own
  greedy text, so both heads are scored on identical tokens.
* ``speed``: spec v2 against graph greedy at B = 1 and 16, the bench's and the demo's timing
  (:mod:`refspec.cli._timing`: the decode window; graph greedy timed on its second run):
  ``x_graph_greedy`` of each head, the median of ``--repeats`` measurements in this process.
  Issue 41 asks >= 1.3x at B = 1 as the median of three *processes*: run this three times
  (fresh processes) into three folders, then ``--median``.

Writes OUTDIR/compare.json and OUTDIR/compare.md.  ``--median`` reads RUN_DIR/compare.json of
each run and writes OUTDIR/median.md (the median of every figure, and each run's).
An instrument, not part of the reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SD = 3


def _heads(model, new: str):
    from refspec.real.eagle_head import HEAD_FILE, head_card, head_kind, load_eagle_head, load_head

    heads = {"committed": load_eagle_head(model), "new": load_head(model, new)}
    cards = {"committed": head_card(HEAD_FILE), "new": head_card(new)}
    kinds = {"committed": "eagle", "new": head_kind(new)[0]}
    return heads, cards, kinds


def main(new: str, out: Path, sections: list[str], repeats: int) -> int:
    from refspec.cli import _timing
    from refspec.cli._bench_eagle import EAGLE_NEW
    from refspec.cli._bench_profile import _workload, capture_sizes, profile_config
    from refspec.harness.teacher_forced import teacher_forced_accepts
    from refspec.model.fused import FusedLlama
    from refspec.real import missing_reason
    from refspec.speculative.greedy import production_greedy

    if not torch.cuda.is_available():
        raise SystemExit("compare_heads.py needs a CUDA GPU (FA3 and CUDA graphs)")
    why = missing_reason()
    if why is not None:
        raise SystemExit(f"compare_heads.py needs the real weights: {why}")
    out.mkdir(parents=True, exist_ok=True)
    model, prompts, label = _workload(16)
    heads, cards, kinds = _heads(model, new)
    fast = FusedLlama(model)
    # the reference text: the production path's own greedy, Sd + 3 tokens past the budget (the last
    # round's drafts are compared too); graph greedy's speed on exactly the spec rows' workload
    g = production_greedy(fast, prompts, [EAGLE_NEW + 6] * len(prompts), page_size=16, validate=False,
                          capture_bs=capture_sizes(16))
    ref = {i: list(p) + list(tk) for i, (p, tk) in enumerate(zip(prompts, g.tokens))}
    greedy_time = {B: _timing.time_greedy(fast, prompts[:B], [EAGLE_NEW] * len(prompts[:B]), page_size=16,
                                          capture_bs=capture_sizes(B))[1] for B in (16, 1)}
    rows = []
    for name, head in heads.items():
        card = cards[name]
        row = {"head": name, "kind": kinds[name], "sha256": card.get("sha256"), "steps": card.get("steps"),
               "train_s": card.get("seconds", {}).get("train"),
               "heldout_top1": card.get("metrics", {}).get("heldout_top1_per_step"),
               "aux_layers": card.get("recipe", {}).get("aux_layers")}
        for B in (16, 1):
            reps = [profile_config(fast, prompts[:B], version="v2", draft=head, P=16, num_steps=SD, max_new=EAGLE_NEW)
                    for _ in range(repeats if "speed" in sections else 1)]
            row[f"accept_B{B}"] = reps[0]["accept_length"]
            if "speed" in sections:
                xs = sorted(_timing.speedup(r["timed"], greedy_time[B]) for r in reps)
                row[f"x_graph_greedy_B{B}"] = xs[len(xs) // 2]
                row[f"x_graph_greedy_B{B}_repeats"] = xs
                row[f"tok_per_s_B{B}"] = statistics.median(r["tok_per_s"] for r in reps)
                row[f"graph_greedy_tok_per_s_B{B}"] = greedy_time[B].tok_per_s
        if "accept" in sections:
            t = time.perf_counter()
            per = [teacher_forced_accepts(model, head, p, ref[i], num_steps=SD, max_new_tokens=EAGLE_NEW)
                   for i, p in enumerate(prompts)]
            row["teacher_forced"] = statistics.fmean(a for x in per for a in x)
            row["teacher_forced_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(row, flush=True)
    env = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {label}; 16 prompts x {EAGLE_NEW} tokens, "
           f"v2, P = 16, Sd = {SD}")
    lines = [f"# New head vs committed head ({env})", "",
             "| head | kind | steps | train s | held-out top-1 (per step) | accept B=16 | accept B=1 | teacher-forced "
             "| x graph greedy B=1 | x graph greedy B=16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        top1 = " / ".join(f"{x:.3f}" for x in r["heldout_top1"] or [])
        lines.append(f"| {r['head']} | {r['kind']} | {r['steps']} | {r['train_s']} | {top1} | {fmt(r['accept_B16'])} | "
                     f"{fmt(r['accept_B1'])} | {fmt(r.get('teacher_forced'))} | {fmt(r.get('x_graph_greedy_B1'))} | "
                     f"{fmt(r.get('x_graph_greedy_B16'))} |")
    diff = rows[1]["accept_B16"] - rows[0]["accept_B16"]
    lines += ["", f"new - committed accept length (B = 16): {diff:+.3f}; issue 41's bar: >= 2.0 at Sd = 3 "
              f"(new: {rows[1]['accept_B16']:.3f})"]
    if "speed" in sections:
        lines.append(f"spec v2 / graph greedy at B = 1 (median of {repeats} in this process): new "
                     f"{rows[1]['x_graph_greedy_B1']:.3f}x, committed {rows[0]['x_graph_greedy_B1']:.3f}x; "
                     f"issue 41's bar: >= 1.3x as the median of three processes (--median)")
    (out / "compare.json").write_text(json.dumps({"env": env, "rows": rows, "diff_B16": diff}, indent=1))
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


MEDIAN_KEYS = ("accept_B16", "accept_B1", "teacher_forced", "x_graph_greedy_B1", "x_graph_greedy_B16",
               "tok_per_s_B1", "tok_per_s_B16", "graph_greedy_tok_per_s_B1", "graph_greedy_tok_per_s_B16")


def median(out: Path, runs: list[Path]) -> int:
    """The median over runs (fresh processes) of every figure, per head (module doc)."""
    tables = [json.loads((r / "compare.json").read_text()) for r in runs]
    lines = [f"# Median of {len(runs)} processes ({tables[0]['env']})", "",
             "| head | figure | median | per run |", "|---|---|---|---|"]
    for j, row in enumerate(tables[0]["rows"]):
        for k in MEDIAN_KEYS:
            vals = [t["rows"][j].get(k) for t in tables]
            if all(isinstance(v, (int, float)) for v in vals):
                lines.append(f"| {row['head']} ({row['kind']}) | {k} | {statistics.median(vals):.3f} | "
                             f"{', '.join(f'{v:.3f}' for v in vals)} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "median.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="NEW.safetensors OUTDIR, or with --median: OUTDIR RUN_DIR...")
    ap.add_argument("--sections", default="accept,speed", help="accept, speed, or both (default)")
    ap.add_argument("--repeats", type=int, default=3, help="speed: measurements per head in this process")
    ap.add_argument("--median", action="store_true", help="merge earlier runs' compare.json into OUTDIR/median.md")
    ns = ap.parse_args()
    if ns.median:
        sys.exit(median(Path(ns.paths[0]), [Path(p) for p in ns.paths[1:]]))
    if len(ns.paths) != 2:
        sys.exit(__doc__)
    sys.exit(main(ns.paths[0], Path(ns.paths[1]), ns.sections.split(","), ns.repeats))
