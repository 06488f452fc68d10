"""Issue 24 diagnostic (not part of the reference): torch.profiler tables of spec v2 rounds at B = 1 on
CUDA -- where the host's time goes per round (CUDA runtime calls, aten ops) and the GPU's (kernels).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/diag_profile.py OUTDIR

Configurations as ``bench --sections peer`` runs them: the perfect drafter Sd = 3, the trained
EAGLE head Sd = 3 (chain) and its tree (k = 4, N = 8, overlapped).  For each: an unprofiled run
(wall / host / wait ms per round), then a profiled one; OUTDIR/<name>.txt gets the tables,
OUTDIR/<name>.json.gz a Chrome trace of the first config.
"""
import gzip
import os
import shutil
import sys
from pathlib import Path

import torch.profiler as tp

from refspec.cli._bench_eagle import _head
from refspec.cli._bench_peer import PEER_NEW as _NEW
from refspec.cli._bench_profile import _workload, profile_config
from refspec.model.fused import FusedLlama
from refspec.speculative.greedy import production_greedy

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
held = []
_orig = tp.profile


class _Held(_orig):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        held.append(self)


tp.profile = _Held
PEER_NEW = int(os.environ.get("DIAG_NEW", _NEW))
model, prompts, label = _workload(1)
fast = FusedLlama(model)
g = production_greedy(fast, prompts, [PEER_NEW], page_size=16, validate=False, capture_bs=(1,))
own = {0: list(prompts[0]) + list(g.tokens[0])}
head, why = _head(model)
configs = [("perfect_sd3", "early-exit:1", "perfect", {"reference": own})]
if head is not None:
    configs += [("head_sd3", head, None, {}), ("head_tree", head, None, dict(topk=4, num_draft_tokens=8, overlap=True))]
else:
    print("no head:", why)
for i, (name, draft, drafter, kw) in enumerate(configs):
    for profiled in (False, False, True):
        r = profile_config(fast, prompts, version="v2", draft=draft, drafter=drafter, num_steps=3,
                           max_new=PEER_NEW - 1, profiled=profiled, **kw)
        keep = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k not in ("text", "kernels")}
        print(name, "profiled" if profiled else "plain", keep, flush=True)
    if not held:
        print("no profiler ran (CUDA only)")
        continue
    p = held[-1]
    ka = p.key_averages()
    with open(out / f"{name}.txt", "w") as f:
        f.write(f"{name}: {keep}\n\n## by self CPU time\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=45))
        f.write("\n\n## by self CUDA time\n")
        f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30))
    if i == 0:
        p.export_chrome_trace(str(out / f"{name}.json"))
        with open(out / f"{name}.json", "rb") as a, gzip.open(out / f"{name}.json.gz", "wb") as b:
            shutil.copyfileobj(a, b)
        (out / f"{name}.json").unlink()
    print((out / f"{name}.txt").read_text()[:6000], flush=True)
