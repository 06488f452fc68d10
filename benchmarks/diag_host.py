"""Host-side cProfile of graph greedy (B = 16) and the spec v2 overlap round (B = 1, perfect
drafter, Sd = 3) on the GPU machine: where the host's time per step / round goes (issue 24).
A diagnostic, not part of the reference."""
import cProfile
import pstats
import sys
import time

import torch

from refspec.cli._bench_profile import _workload
from refspec.model.fused import FusedLlama
from refspec.speculative import generate
from refspec.speculative.greedy import production_greedy

M = 64
model, prompts, label = _workload(16)
fast = FusedLlama(model)
for B in (16, 1):
    ps = prompts[:B]
    for _ in range(2):
        g = production_greedy(fast, ps, [M] * B, page_size=16, validate=False, capture_bs=(B,))
    pr = cProfile.Profile()
    pr.enable()
    g = production_greedy(fast, ps, [M] * B, page_size=16, validate=False, capture_bs=(B,))
    pr.disable()
    print(f"## greedy B={B}: ms/step {1e3 * g.decode_seconds / g.steps:.3f}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(35)
    sys.stdout.flush()
ps = prompts[:1]
g = production_greedy(fast, ps, [M + 16], page_size=16, validate=False, capture_bs=(1,))
own = {0: list(ps[0]) + list(g.tokens[0])}
kw = dict(backend="fa3", version="v2", page_size=16, graphs=True, draft="early-exit:1", drafter="perfect",
          reference=own, num_steps=3, validate=False, capture_bs=(1,))
generate(fast, ps, max_new_tokens=[M], **kw)
pr = cProfile.Profile()
st = {"n": 0, "t": None}


def observer(event, eng, **info):
    if event == "round_end":
        if st["t"] is None:
            torch.cuda.synchronize()
            st["t"] = time.perf_counter()
            pr.enable()
        else:
            st["n"] += 1


res = generate(fast, ps, max_new_tokens=[M], observer=observer, **kw)
torch.cuda.synchronize()
pr.disable()
dt = time.perf_counter() - st["t"]
print(f"## spec v2 overlap perfect Sd=3 B=1: steady rounds {st['n']}, ms/round {1e3 * dt / st['n']:.3f}")
stats = pstats.Stats(pr)
stats.sort_stats("tottime").print_stats(45)
stats.sort_stats("cumtime").print_stats(70)
