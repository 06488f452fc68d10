"""CPU: the torch ops *inside* the CUDA graphs of one spec v2 round, by call site (a diagnostic for
issue 24's tree target, not part of the reference).

``python benchmarks/diag_graph_ops.py [chain|tree]``: runs the overlap loop on SmolLM2's shapes
(random weights, 2 target layers so it is quick; ``--layers`` for more) and counts every aten op
dispatched while an emulated graph replays, per round, by the innermost refspec frame.  On a GPU
each of these is (at least) one kernel of the graph, except the attention kernel itself: every op
under ``fa3/emulator.py`` (the CPU stand-in for one FA3 launch) is counted as one ``fa3 kernel``.
So the table says which rule's tensor arithmetic puts the most kernels into a round.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refspec.audits.launch import _FREE, _site
from refspec.graphs import capture
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaConfig, LlamaModel, init_random_


class _Inside(TorchDispatchMode):
    def __init__(self, seen: Counter):
        super().__init__()
        self.seen, self.on = seen, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func._schema.name not in _FREE:
            path, fn = _site(sys._getframe(1))
            if path == "fa3/emulator.py":
                if not self.in_kernel:
                    self.in_kernel = True
                    self.seen[("fa3 kernel", "")] += 1
            else:
                self.in_kernel = False
                self.seen[(f"{path}:{fn}", func._schema.name.removeprefix("aten::"))] += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", nargs="?", default="tree", choices=("chain", "tree"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ns = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=ns.layers, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    model = init_random_(LlamaModel(cfg), seed=0).eval()
    kw = dict(version="v2", num_steps=3, page_size=16, max_context=160, max_batch=1, graphs=True, capture_bs=[1],
              validate=False, overlap=True)
    if ns.kind == "tree":
        from refspec.speculative.tree.engine import TreeEngine
        eng = TreeEngine(model, make_draft("eagle", model), topk=4, num_draft_tokens=8, **kw)
    else:
        from refspec.speculative.engine import Engine
        eng = Engine(model, make_draft("eagle", model), **kw)
    eng.add_request(0, list(range(5, 69)), 48)
    seen: Counter = Counter()
    mode = _Inside(seen)
    saved = capture.EmulatedGraph.replay

    def replay(self):
        mode.on, mode.in_kernel = True, False
        try:
            return saved(self)
        finally:
            mode.on = False

    capture.EmulatedGraph.replay = replay
    try:
        with torch.no_grad(), mode:
            eng.run()
    finally:
        capture.EmulatedGraph.replay = saved
    n = eng.rounds_launched
    total = sum(seen.values()) / n
    print(f"{ns.kind}, {ns.layers} target layers: {n} rounds, {total:.1f} ops inside the graphs per round "
          f"(FA3 launches counted once each)")
    by_site: Counter = Counter()
    for (site, _op), c in seen.items():
        by_site[site] += c
    print("\nby site (ops per round):")
    for site, c in by_site.most_common(ns.top):
        print(f"  {c / n:7.2f}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
