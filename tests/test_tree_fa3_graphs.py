"""CUDA graphs of the top-k > 1 loop (emulated on CPU, same freezing rules): replay == eager (TR-018).

Loop level: the graphed loop (tree verify, tree draft decode, draft extend replayed on padded
batches, capture sizes 1, 2, 4 with 3 live requests) emits the eager loop's tokens and accept
counts exactly.  Metadata level: the draft expand table replay writes in place, sliced to the
step's s + 1 columns, equals the eager rule on every real row.
"""

from __future__ import annotations

import pytest
import torch

from refspec.fa3 import tree_metadata as tm
from refspec.harness.tree_scenario import draft_setup
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative.tree.engine import TreeEngine
from refspec.speculative.tree.graphs import replay_draft_expand_table

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 3, 3]]


@pytest.fixture(scope="module")
def model():
    return init_random_(LlamaModel(tiny_config()), seed=0).eval()


def _run(model, P, k, N, graphs):
    eng = TreeEngine(model, make_draft(model, model), topk=k, num_draft_tokens=N, num_steps=3, page_size=P,
                     max_context=64, max_batch=3, provider="emulator", shuffle_pages=2, graphs=graphs,
                     capture_bs=(1, 2, 4))
    for i, p in enumerate(PROMPTS):
        eng.add_request(i, p, 14 - 2 * i)
    eng.run()
    done = sorted(eng.done, key=lambda r: r.rid)
    return [r.output for r in done], [r.accepts for r in done], eng


@pytest.mark.spec("TR-018", "CG-002", "CG-009")
@pytest.mark.parametrize("P", (1, 4, 16, 64))
@pytest.mark.parametrize("k,N", ((2, 5), (4, 8)))
def test_graphed_tree_loop_equals_eager(model, P, k, N):
    eager = _run(model, P, k, N, graphs=False)
    graphed = _run(model, P, k, N, graphs=True)
    assert graphed[:2] == eager[:2]
    counts = graphed[2].runners.counts
    assert counts[("tree_verify", "graph")] > 0 and counts[("tree_draft", "graph")] > 0
    assert counts[("tree_verify", "eager")] == 0 and counts[("tree_draft", "eager")] == 0
    assert graphed[2].kv.allocator.num_free_pages == graphed[2].free_pages_at_start


@pytest.mark.spec("TR-018", "TR-014")
@pytest.mark.parametrize("P", (1, 4, 16, 64))
def test_draft_expand_replay_in_place_equals_eager(P):
    k, S = 4, 4
    Ls = [5, 67, 130]
    _, _, fb, _, loc = draft_setup(P, Ls, k, S, seed=5)
    for s in range(S - 1):
        eager = tm.draft_expand_metadata(loc, fb.seq_lens, s, k, S, P)
        table = torch.full((len(Ls) * k, s + 2), -7, dtype=torch.int32)  # the s + 2 wide graph buffer, stale
        K = torch.zeros(len(Ls) * k, dtype=torch.int32)
        ptr = table.data_ptr()
        replay_draft_expand_table(table, K, loc, fb.seq_lens, s, k, S, P)
        assert table.data_ptr() == ptr  # written in place (CG-001)
        assert torch.equal(K, eager.cache_seqlens_int32)
        for t in range(len(Ls) * k):  # the columns the kernel reads: ceil(K / P)
            n = -(-int(K[t]) // P)
            assert torch.equal(table[t, :n], eager.page_table[t, :n])
