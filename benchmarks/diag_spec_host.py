"""Spec v2 round host time at B = 1 under repeated runs in one process, plain and after gc.freeze()
(a diagnostic for issue 24, not part of the reference)."""
import gc
import time
from refspec.cli._bench_profile import _workload, profile_config
from refspec.model.fused import FusedLlama
from refspec.speculative.greedy import production_greedy

model, prompts, label = _workload(16)
fast = FusedLlama(model)
ps = prompts[:1]
g = production_greedy(fast, ps, [128], page_size=16, validate=False, capture_bs=(1,))
own = {0: list(ps[0]) + list(g.tokens[0])}
def one(tag, max_new=127):
    r = profile_config(fast, ps, version="v2", draft="early-exit:1", drafter="perfect", num_steps=3,
                       max_new=max_new, reference=own)
    print(f"{tag:28s} rounds {r['rounds']:3d} wall {r['wall_ms']:.3f} host {r['host_ms']:.3f} "
          f"replay_host {r['replay_host_ms']:.3f} wait {r['wait_ms']:.3f} gc_count {gc.get_count()}", flush=True)
for i in range(3):
    one(f"plain {i}")
cb = []
gc.callbacks.append(lambda ph, info: cb.append((ph, info["generation"], time.perf_counter())))
one("plain, gc callbacks")
st = [t for ph, gen, t in cb if ph == "start"]
print("gc collections during that run:", len(st), "gen2:", sum(1 for ph, gen, t in cb if ph == "start" and gen == 2))
gc.callbacks.clear()
gc.collect(); gc.freeze()
for i in range(3):
    one(f"after gc.freeze {i}")
gc.disable()
for i in range(2):
    one(f"gc disabled {i}")
gc.enable()
one("plain, 255 tokens", 255)
