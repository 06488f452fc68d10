"""Issue 25's reproduction check: a freshly trained EAGLE head against the committed one, in one process.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/compare_heads.py NEW.safetensors OUTDIR

For each head (the committed ``refspec/real/heads/smollm2-135m-eagle.safetensors``, its SHA-256
checked, and NEW, loaded with ``sha256=None``) on the same 16 MT-Bench prompts, 128 new tokens:

* the production loop's accept length (FA3, CUDA graphs, v2, P = 16, chain Sd = 3, B = 16 and
  B = 1), the figure of issue 25's bar and of ``bench --sections eagle`` (benchmarks/results/h200_eagle.md);
* the teacher-forced accept length (:func:`refspec.harness.teacher_forced.teacher_forced_accepts`)
  on the production path's own greedy text of the same prompts, so both heads are scored on
  identical tokens.

"Reproduced" (issue 25) means NEW's B = 16 production accept length within 0.1 of the committed
head's, measured here side by side.  Writes OUTDIR/compare.json and OUTDIR/compare.md.
An instrument, not part of the reference.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(new: str, out: Path) -> int:
    from refspec.cli._bench_eagle import EAGLE_NEW
    from refspec.cli._bench_profile import _workload, capture_sizes, profile_config
    from refspec.harness.teacher_forced import teacher_forced_accepts
    from refspec.model.fused import FusedLlama
    from refspec.real import missing_reason
    from refspec.real.eagle_head import HEAD_FILE, head_card, load_eagle_head
    from refspec.speculative.greedy import production_greedy

    if not torch.cuda.is_available():
        raise SystemExit("compare_heads.py needs a CUDA GPU (FA3 and CUDA graphs)")
    why = missing_reason()
    if why is not None:
        raise SystemExit(f"compare_heads.py needs the real weights: {why}")
    out.mkdir(parents=True, exist_ok=True)
    model, prompts, label = _workload(16)
    heads = {"committed": load_eagle_head(model), "new": load_eagle_head(model, new, sha256=None)}
    cards = {"committed": head_card(HEAD_FILE), "new": head_card(new)}
    fast = FusedLlama(model)
    g = production_greedy(fast, prompts, [EAGLE_NEW + 6] * 16, page_size=16, validate=False,
                          capture_bs=capture_sizes(16))
    ref = {i: list(p) + list(tk) for i, (p, tk) in enumerate(zip(prompts, g.tokens))}
    rows = []
    for name, head in heads.items():
        row = {"head": name, "sha256": cards[name].get("sha256"), "steps": cards[name].get("steps"),
               "train_s": cards[name].get("seconds", {}).get("train"),
               "heldout_top1": cards[name].get("metrics", {}).get("heldout_top1_per_step")}
        for B in (16, 1):
            r = profile_config(fast, prompts[:B], version="v2", draft=head, P=16, num_steps=3, max_new=EAGLE_NEW)
            row[f"accept_B{B}"] = r["accept_length"]
            row[f"tok_per_s_B{B}"] = r["tok_per_s"]
        t = time.perf_counter()
        per = [teacher_forced_accepts(model, head, p, ref[i], num_steps=3, max_new_tokens=EAGLE_NEW)
               for i, p in enumerate(prompts)]
        row["teacher_forced"] = statistics.fmean(a for x in per for a in x)
        row["teacher_forced_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(row, flush=True)
    diff = rows[1]["accept_B16"] - rows[0]["accept_B16"]
    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {label}; 16 prompts x {EAGLE_NEW} tokens"
    lines = [f"# Reproduction check ({env})", "",
             "| head | steps | train s | held-out top-1 (step 0/1/2) | accept B=16 | accept B=1 | teacher-forced | "
             "tok/s B=16 | tok/s B=1 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top1 = " / ".join(f"{x:.3f}" for x in r["heldout_top1"] or [])
        lines.append(f"| {r['head']} | {r['steps']} | {r['train_s']} | {top1} | {r['accept_B16']:.3f} | "
                     f"{r['accept_B1']:.3f} | {r['teacher_forced']:.3f} | {r['tok_per_s_B16']:.0f} | "
                     f"{r['tok_per_s_B1']:.0f} |")
    verdict = "reproduced" if abs(diff) <= 0.1 else "NOT reproduced"
    lines += ["", f"new - committed accept length (B = 16): {diff:+.3f} -> {verdict} (bar: within 0.1)"]
    (out / "compare.json").write_text(json.dumps({"env": env, "rows": rows, "diff_B16": diff}, indent=1))
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
