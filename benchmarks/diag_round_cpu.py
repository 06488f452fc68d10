"""CPU: where the host's time goes in a spec v2 overlap round outside graph replays (tiny model, graphs on,
validation off).  ``python benchmarks/diag_round_cpu.py [chain|tree] [N]``: host ms per round
(refspec.audits.launch.host_time) and a cProfile of the loop with graph replays stubbed out of the
profile (a diagnostic for issue 24, not part of the reference)."""
import cProfile
import pstats
import sys

import torch

from refspec.audits.launch import host_time
from refspec.audits.sync import audit_workload
from refspec.graphs import capture
from refspec.model.drafts import make_draft
from refspec.speculative.engine import Engine

kind = sys.argv[1] if len(sys.argv) > 1 else "chain"
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
torch.manual_seed(0)
model, prompts = audit_workload(torch.device("cpu"), True, 1)


def engine():
    if kind == "tree":
        from refspec.speculative.tree.engine import TreeEngine
        eng = TreeEngine(model, make_draft("early-exit:1", model), version="v2", num_steps=3, topk=4,
                         num_draft_tokens=8, page_size=16, max_context=200, max_batch=1, graphs=True,
                         capture_bs=[1], validate=False, overlap=True)
    else:
        eng = Engine(model, make_draft("early-exit:1", model), version="v2", num_steps=3, page_size=16,
                     max_context=200, max_batch=1, graphs=True, capture_bs=[1], validate=False, overlap=True)
    eng.add_request(0, prompts[0], 120)
    return eng


for _ in range(2):
    eng = engine()
    with host_time() as hs:
        eng.run()
    n = eng.rounds_launched
    ms = {k: f"{1e3 * v / n:.3f}" for k, v in hs.items()}
    print(f"{kind}: rounds {n}, host ms per round: {ms}")
pr = cProfile.Profile()
saved = capture.EmulatedGraph.replay


def quiet(self):
    pr.disable()
    try:
        return saved(self)
    finally:
        pr.enable()


capture.EmulatedGraph.replay = quiet
eng = engine()
pr.enable()
eng.run()
pr.disable()
capture.EmulatedGraph.replay = saved
print("rounds", eng.rounds_launched)
pstats.Stats(pr).sort_stats(sys.argv[3] if len(sys.argv) > 3 else "tottime").print_stats(top)
