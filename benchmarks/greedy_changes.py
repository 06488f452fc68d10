"""Issue 24's change table for graph greedy: the step loop at a544cec (host read of each step's
tokens before the next launch; loaded from git by ``diag_greedy.old_greedy``) vs the overlapped
loop of this commit, in one
process, same prompts and budgets, decode tok/s (prefill excluded from the new loop's figure;
the old loop only reports the whole run, so both whole-run figures are given too).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/greedy_changes.py
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, "benchmarks")

from diag_greedy import old_greedy  # noqa: E402

from refspec.cli._bench_profile import _workload  # noqa: E402
from refspec.model.fused import FusedLlama  # noqa: E402
from refspec.speculative.greedy import production_greedy as new  # noqa: E402

M = 128
old = old_greedy()
model, prompts, label = _workload(16)
fast = FusedLlama(model)
print(label)
print("| B | a544cec whole run tok/s | this commit whole run tok/s | this commit decode tok/s | whole-run ratio |")
print("|---|---|---|---|---|")
for B in (1, 4, 16):
    ps, cap = prompts[:B], (B,)
    o_t, n_t, n_d = [], [], []
    for i in range(4):  # alternate; the first pair warms up (compile, capture)
        o = old(fast, ps, [M] * B, page_size=16, validate=False, capture_bs=cap)
        n = new(fast, ps, [M] * B, page_size=16, validate=False, capture_bs=cap)
        assert o.tokens == n.tokens, f"B={B}: the two loops decoded different tokens"
        if i:
            o_t.append(B * M / o.seconds)
            n_t.append(B * M / n.seconds)
            n_d.append(B * (M - 1) / n.decode_seconds)
    mo, mn = statistics.median(o_t), statistics.median(n_t)
    print(f"| {B} | {mo:.0f} | {mn:.0f} | {statistics.median(n_d):.0f} | {mn / mo:.2f}x |", flush=True)
