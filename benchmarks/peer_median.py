"""Issue 24's acceptance run: ``bench --sections peer`` in 3 fresh processes, then the median of
each figure per row (tokens/s, ratios), as one Markdown table.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/peer_median.py OUTDIR [I ...]

Runs process I (default: 0 1 2) into OUTDIR/run{I}/bench.json, then, once OUTDIR holds all
three, writes the medians to OUTDIR/median.md (and stdout): the runs may be split over calls.
``PIN=K`` runs each process on CPU core K only (``os.sched_setaffinity``; the peer and refspec rows
share the process, so both are pinned): the chain spec rows are host-bound, and unpinned runs on the
H200 host took a B = 1 round in either ~2 or ~3 ms (benchmarks/results/h200_peer2.md).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

KEYS = ("peer_tok_per_s", "graph_greedy_tok_per_s", "x_peer", "accept_length", "wall_ms_per_round", "host_ms",
        "wait_ms", "tok_per_s", "x_chain", "launch_us", "python_loop_ns")


def main(out: Path, which: list[int], runs: int = 3) -> None:
    if os.environ.get("PIN"):
        os.sched_setaffinity(0, {int(os.environ["PIN"])})  # inherited by the bench processes
        print("pinned to CPU", sorted(os.sched_getaffinity(0)))
    for i in which:
        subprocess.run([sys.executable, "-m", "refspec", "bench", "--device", "cuda", "--sections", "peer",
                        "--out", str(out / f"run{i}")], check=True)
    paths = [out / f"run{i}" / "bench.json" for i in range(runs)]
    if not all(p.exists() for p in paths):
        print(f"{sum(p.exists() for p in paths)} of {runs} runs in {out}: no medians yet")
        return
    tables = [json.loads(p.read_text()) for p in paths]
    env = tables[0]["env"]
    lines = [f"{env}; median of {runs} fresh processes", ""]
    rows0 = tables[0]["rows"]
    for section in dict.fromkeys(r["section"] for r in rows0):
        idx = [j for j, r in enumerate(rows0) if r["section"] == section]
        cols = [k for k in dict.fromkeys(k for j in idx for k in rows0[j]) if k not in ("section", "workload")]
        lines += [f"### {section}", "", "| " + " | ".join(cols) + " | per run |", "|" + "---|" * (len(cols) + 1)]
        for j in idx:
            same = [t["rows"][j] for t in tables]
            cells, per_run = [], []
            for k in cols:
                vals = [r.get(k) for r in same]
                if k in KEYS and all(isinstance(v, (int, float)) for v in vals):
                    cells.append(f"{statistics.median(vals):.3g}")
                    if k in ("x_peer", "x_chain", "launch_us"):
                        per_run.append(", ".join(f"{v:.3g}" for v in vals))
                else:
                    cells.append(" / ".join(dict.fromkeys(str(v) for v in vals if v is not None)))
            lines.append("| " + " | ".join(cells) + f" | {'; '.join(per_run)} |")
        lines.append("")
    text = "\n".join(lines)
    (out / "median.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(x) for x in sys.argv[2:]] or [0, 1, 2])
