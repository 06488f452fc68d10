"""Diagnose the GPU tree accept length (1.66 in the H200 demo vs 1.83 for the bf16 oracle tree and
for the same production loop on CPU in bf16): the production tree loop v1, P = 16, k = 4, N = 8
on the demo's 4 MT-Bench prompts, one variable changed at a time.

    python benchmarks/diag_tree_accept.py      (H200, real weights installed)
"""
import copy

import torch

from refspec.model.fused import FusedLlama
from refspec.real import EOS_ID
from refspec.real.run import chat_prompts, load_target, pick_questions
from refspec.speculative import generate

m32, _ = load_target(torch.float32)
m16 = copy.deepcopy(m32).to("cuda", torch.bfloat16).eval()
prompts = chat_prompts(pick_questions(4))
kw = dict(draft="early-exit:25", num_steps=3, max_new_tokens=[40, 32, 24, 16], eos=EOS_ID, validate=False)
tree = dict(kw, version="v1", topk=4, num_draft_tokens=8)
ora = generate(m16, prompts, backend="oracle", **tree)
print("oracle tree bf16", round(ora.accept_length, 3), ora.accepts, flush=True)
fused_eager = FusedLlama(m16, compile=False)
fused = FusedLlama(m16)
variants = [
    ("readable, FA3 eager", m16, dict(graphs=False)),
    ("readable, emulator eager", m16, dict(graphs=False, provider="emulator")),
    ("readable, FA3 graphs", m16, dict(graphs=True)),
    ("fused eager-math, FA3 graphs", fused_eager, dict(graphs=True)),
    ("fused compiled, FA3 eager", fused, dict(graphs=False)),
    ("fused compiled, FA3 graphs (demo)", fused, dict(graphs=True)),
]
for name, m, extra in variants:
    try:
        r = generate(m, prompts, backend="fa3", page_size=16, capture_bs=(1, 2, 4, 8), **tree, **extra)
        print(name, round(r.accept_length, 3), "tokens == oracle:", r.tokens == ora.tokens, r.accepts, flush=True)
    except Exception as e:
        print(name, "ERROR", type(e).__name__, str(e)[:300], flush=True)
r = generate(fused, prompts, backend="fa3", page_size=16, graphs=True, capture_bs=(1, 2, 4, 8), version="v1", **kw)
c = generate(m16, prompts, backend="oracle", version="v1", **kw)
print("chain v1 fused graphs", round(r.accept_length, 3), "oracle", round(c.accept_length, 3), flush=True)
