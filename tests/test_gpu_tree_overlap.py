"""GPU: the v2 tree round under the overlap schedule with the real FA3 kernel and CUDA graphs.

bf16 production (``TreeEngine(version="v2", overlap=True)``, FA3, graphs) vs fp32 plain greedy
under T2 (TOL-003, docs/tolerance-policy.md), the fp32 oracle tree loop lossless beside it; and
the launch of every round free of synchronizing CUDA calls (torch's sync debug mode), the one
result read per round after the next launch.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from refspec.audits.sync import cuda_syncs
from refspec.core.tolerance import T2_DELTA, t2
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaConfig, LlamaModel, init_random_
from refspec.oracle.loop import greedy
from refspec.speculative.api import generate
from refspec.speculative.tree.engine import TreeEngine

pytestmark = pytest.mark.gpu

SMALL = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024)


def _pair(seed=0):
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baseline must be fp32
    m32 = init_random_(LlamaModel(SMALL), seed=seed).cuda().eval()
    return m32, copy.deepcopy(m32).to(torch.bfloat16)


def _prompts(lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(SMALL.vocab_size) for _ in range(n)] for n in lens]


@pytest.mark.spec("TR-019", "TR-020", "TR-021", "TOL-003", "KV-006")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("k,N", [(2, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("P", (1, 16, 64), ids=lambda P: f"P{P}")
def test_gpu_tree_v2_overlap_matches_greedy_t2(P, k, N, graphs):
    """As test_gpu_spec's _check_t2 (delta = max(T2_DELTA, 2 x the teacher-forced bf16 error)),
    with the tree engine under the overlap schedule."""
    from test_gpu_spec import _teacher_forced_err

    m32, m16 = _pair()
    prompts, budgets = _prompts([5, 17, 33, 64]), [20, 16, 24, 12]
    base = [greedy(m32, p, b) for p, b in zip(prompts, budgets)]
    ref = {i: p + g.tokens for i, (p, g) in enumerate(zip(prompts, base))}
    kw = dict(version="v2", page_size=P, graphs=graphs, draft="eagle", num_steps=3, topk=k, num_draft_tokens=N,
              max_new_tokens=budgets, reference=ref)
    ora = generate(m32, prompts, backend="oracle", **kw)
    assert ora.tokens == [g.tokens for g in base], "fp32 oracle tree loop is not lossless"
    prod = generate(m16, prompts, backend="fa3", provider="fa3", overlap=True, validate=False, **kw)
    delta = max(T2_DELTA, 2 * max(_teacher_forced_err(m32, m16, ref[i]) for i in range(len(prompts))))
    for i, g in enumerate(base):
        ok, why = t2(prod.tokens[i], g.tokens, g.margins, delta=delta)
        assert ok, f"request {i}: {why} (delta {delta:.3g})"
    assert prod.free_pages[0] == prod.free_pages[1]
    assert prod.host_syncs.get("in_round", 0) == 0 and prod.host_syncs["post_round"] == len(prod.trace)
    if graphs:
        assert prod.forwards.get(("tree_verify", "graph"), 0) > 0
        assert prod.forwards.get(("tree_draft", "graph"), 0) > 0


@pytest.mark.spec("TR-020", "KV-006")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_gpu_tree_overlap_launches_rounds_without_a_sync(graphs):
    """No synchronizing CUDA call while a tree round is built and launched (the tree is built and
    accepted on the device); one counted read per round, after the next launch."""
    model = init_random_(LlamaModel(SMALL), seed=0).cuda().to(torch.bfloat16).eval()
    rng = random.Random(0)
    eng = TreeEngine(model, make_draft("eagle", model), topk=4, num_draft_tokens=8, num_steps=3, version="v2",
                     overlap=True, page_size=16, max_context=192, max_batch=4, graphs=graphs, capture_bs=(1, 2, 4),
                     validate=False)
    for i, n in enumerate((9, 40, 17, 3, 25)):
        eng.add_request(i, [rng.randrange(SMALL.vocab_size) for _ in range(n)], 32, arrival=2 * i)
    seen = cuda_syncs(eng)
    in_launch = {key: n for key, n in seen.items() if key[0].startswith("launch")}
    assert not in_launch, f"synchronizing CUDA calls while building / launching a tree round: {in_launch}"
    assert eng.syncs["post_round"] == eng.rounds_launched > 10 and eng.syncs["in_round"] == 0
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start
