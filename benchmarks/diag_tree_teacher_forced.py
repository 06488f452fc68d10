"""Tree acceptance with the trained head (issue 25): is the H200 tree's 1.90 (k = 4, N = 8, Sd = 3,
B = 1) the tree's own, or does the production tree loop lose acceptance?

On one fixed text per prompt (the target's fp32 greedy continuation), CPU fp32, the real
SmolLM2-135M-Instruct and the committed head:

* chain Sd = 3 teacher-forced accepts (``teacher_forced_accepts``);
* tree k = 4, N = 8 teacher-forced accepts (``teacher_forced_tree_accepts``), and per round
  whether the tree holds the chain's own draft path (``tests/test_teacher_forced_tree.py``'s
  condition), and how the tree's n compares with the chain's at the same committed length;
* the production tree loop on the FA3 emulator (``generate(backend="fa3", version="v2", ...)``):
  its accepts and whether its text is the greedy text.

    nice python benchmarks/diag_tree_teacher_forced.py [--prompts 4] [--tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from refspec.harness.teacher_forced import round_lengths, teacher_forced_accepts, teacher_forced_tree_accepts, \
    tree_rounds
from refspec.real.eagle_head import load_eagle_head
from refspec.real.run import chat_prompts, load_target, pick_questions
from refspec.speculative import generate
from refspec.speculative.api import greedy_reference

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--prompts", type=int, default=4, help="MT-Bench prompts (round-robin over categories)")
ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
ap.add_argument("--no-loop", action="store_true", help="skip the production tree loop (the slow part)")
args = ap.parse_args()
torch.set_grad_enabled(False)
k, N, Sd, M = 4, 8, 3, args.tokens
model, _ = load_target(torch.float32)
model.eval()
head = load_eagle_head(model)
prompts = chat_prompts(pick_questions(args.prompts))
t = time.perf_counter()
ref = greedy_reference(model, prompts, [M + Sd + 3] * len(prompts))
print(f"reference: {len(prompts)} prompts x {M + Sd + 3} tokens, {time.perf_counter() - t:.0f} s", flush=True)


def held(rnd) -> bool:  # tests/test_teacher_forced_tree.py::_holds_the_chain
    sc = rnd.cands.scores
    ids = [0] + [k + k * k * (s - 1) for s in range(1, Sd)]
    if not sc[0] > sc[1:k].max():
        return False
    if any(not sc[ids[s]] > sc[ids[s] + 1:ids[s] + k * k].max() for s in range(1, Sd - 1)):
        return False
    return set(ids) <= set(rnd.tree.cand[1:])


tot = {"chain": [], "tree": [], "loop": []}
for i, p in enumerate(prompts):
    chain = teacher_forced_accepts(model, head, p, ref[i], num_steps=Sd, max_new_tokens=M)
    tree = teacher_forced_tree_accepts(model, head, p, ref[i], topk=k, num_steps=Sd, num_draft_tokens=N,
                                       max_new_tokens=M)
    nc = round_lengths(model, head, ref[i], len(p), Sd)
    tr = tree_rounds(model, head, ref[i], len(p), topk=k, num_steps=Sd, num_draft_tokens=N)
    h = [held(r) for r in tr]
    better = sum(r.acc.n > c for r, c in zip(tr, nc))
    worse = sum(r.acc.n < c for r, c in zip(tr, nc))
    tot["chain"] += chain
    tot["tree"] += tree
    print(f"prompt {i}: chain Sd=3 {statistics.fmean(chain):.3f} ({len(chain)} rounds), tree k=4 N=8 "
          f"{statistics.fmean(tree):.3f} ({len(tree)} rounds); per committed length L ({len(nc)}): tree n > chain n "
          f"{better}, < {worse}, tree holds the chain's path {sum(h)}, mean n chain {statistics.fmean(nc):.3f} "
          f"tree {statistics.fmean(r.acc.n for r in tr):.3f}", flush=True)
    if not args.no_loop:
        t = time.perf_counter()
        res = generate(model, [p], backend="fa3", version="v2", draft=head, topk=k, num_draft_tokens=N, num_steps=Sd,
                       max_new_tokens=M, page_size=16, provider="emulator", validate=False)
        r = res.requests[0]
        tot["loop"] += r.accepts
        print(f"  production tree loop (FA3 emulator, v2, P=16): {statistics.fmean(r.accepts):.3f} "
              f"({len(r.accepts)} rounds), accepts == teacher-forced: {r.accepts == tree}, text == greedy: "
              f"{r.tokens == ref[i][len(p):len(p) + M]}, {time.perf_counter() - t:.0f} s", flush=True)
for name, a in tot.items():
    if a:
        print(f"all prompts, {name}: {statistics.fmean(a):.3f} over {len(a)} rounds")
