"""GPU: the overlap loop launches every round without a host sync (torch's sync debug mode),
reads each round's results once, and stays lossless (bf16 production vs fp32 greedy, T2)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaConfig, LlamaModel, init_random_
from refspec.speculative.engine import Engine
from refspec.audits.sync import cuda_syncs

pytestmark = pytest.mark.gpu

SMALL = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024)


@pytest.mark.spec("KV-005", "KV-006", "KV-007")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_gpu_overlap_launches_rounds_without_a_sync(graphs):
    model = copy.deepcopy(init_random_(LlamaModel(SMALL), seed=0)).cuda().to(torch.bfloat16).eval()
    rng = random.Random(0)
    eng = Engine(model, make_draft("early-exit:3", model), version="v2", page_size=16, max_context=160, max_batch=4,
                 graphs=graphs, capture_bs=(1, 2, 4), validate=False)
    assert eng.overlap  # the default for v2 on CUDA
    for i, n in enumerate((9, 40, 17, 3, 25)):
        eng.add_request(i, [rng.randrange(SMALL.vocab_size) for _ in range(n)], 32, arrival=2 * i)
    seen = cuda_syncs(eng)
    in_launch = {k: n for k, n in seen.items() if k[0].startswith("launch")}
    assert not in_launch, f"synchronizing CUDA calls while building / launching a round: {in_launch}"
    assert eng.syncs["post_round"] == eng.rounds_launched > 10 and eng.syncs["in_round"] == 0
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start
