"""Each named wrong variant of the FA3 tree path (refspec.mutants.tree_variants) is caught.

A probe is a check of the suite (the same assertions as the tests citing the invariant); it
passes on the production rule and must fail with the variant applied.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.harness.tree_scenario import LAYER, draft_setup, verify_setup
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.mutants.checks import Env
from refspec.mutants.tree_probes import verify_graph_probe
from refspec.mutants.tree_variants import TREE_VARIANTS, apply_variant
from refspec.oracle.loop import greedy
from refspec.oracle.slots import attention_over_slots
from refspec.oracle.tree_loop import speculative_tree_greedy
from refspec.speculative.tree import graphs as tree_graphs
from refspec.speculative.tree.engine import TreeEngine

CAUGHT = (AssertionError, InvariantError, RuntimeError)


def probe_verify_attention():
    kv, pool, fb, q, slots, _ = verify_setup(4, [5, 67, 130], 8, seed=11)
    be = FlashAttentionTreeBackend(pool, kv, topk=4, num_draft_tokens=8, provider="emulator")
    be.init_forward_metadata(fb)
    k, v = pool.get_flat_kv(0)
    torch.testing.assert_close(be.forward(q, None, None, LAYER, fb), attention_over_slots(q, k, v, slots),
                               rtol=1e-5, atol=1e-5)


def probe_verify_graph():
    """The graphed tree verify (its expand metadata built inside the captured graph) vs the parents."""
    found = []
    verify_graph_probe(Env(), found, True)
    assert not found, found


def probe_draft_attention():
    Ls, k, S = [5, 67, 130], 2, 3
    kv, pool, fb, rows, loc = draft_setup(4, Ls, k, S, seed=3)
    kf, vf = pool.get_flat_kv(0)
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=k, num_steps=S, speculative_step_id=s, provider="emulator")
        be.init_forward_metadata(fb)
        q = torch.randn((len(Ls) * k, 4, 16), generator=torch.Generator().manual_seed(s))
        slots = [kv.req_to_token[rows[i // k], :Ls[i // k]].tolist() + loc.view(-1, S)[i, :s + 1].tolist()
                 for i in range(len(Ls) * k)]
        out = be.forward(q, None, None, LAYER, draft_step_batch(fb, s))
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, attention_over_slots(q, kf, vf, slots), rtol=1e-5, atol=1e-5)


def probe_loop():
    m = init_random_(LlamaModel(tiny_config()), seed=0).eval()
    d = make_draft(m, m)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
    eng = TreeEngine(m, d, topk=2, num_draft_tokens=5, num_steps=3, page_size=4, max_context=48, max_batch=2,
                     provider="emulator", shuffle_pages=1, pool_fill=float("nan"))
    for i, p in enumerate(prompts):
        eng.add_request(i, p, 12)
    eng.run()
    for r in sorted(eng.done, key=lambda r: r.rid):
        o = speculative_tree_greedy(m, d, r.prompt, num_steps=3, topk=2, num_draft_tokens=5, max_new_tokens=12)
        assert r.output == greedy(m, r.prompt, 12).tokens and r.accepts == o.accepts


def probe_draft_expand_replay():
    """P = 2, S = 6: a branch's steps span 4 pages, more than the s + 2 columns at s = 0."""
    k, S, P = 2, 6, 2
    _, _, fb, _, loc = draft_setup(P, [5, 8], k, S, seed=2)
    for s in range(S - 1):
        eager = tm.draft_expand_metadata(loc, fb.seq_lens, s, k, S, P)
        table = torch.zeros((2 * k, s + 2), dtype=torch.int32)
        K = torch.zeros(2 * k, dtype=torch.int32)
        tree_graphs.replay_draft_expand_table(table, K, loc, fb.seq_lens, s, k, S, P)
        for t in range(2 * k):
            n = -(-int(K[t]) // P)
            assert torch.equal(table[t, :n], eager.page_table[t, :n])


PROBES = {
    "tree-mask-sibling-visible": probe_verify_attention,
    "expand-reads-prefix-twice": probe_verify_attention,
    "lse-merge-no-rescale": probe_verify_attention,
    "branch-no-tail-copy": probe_draft_attention,
    "draft-expand-unsliced-cache-loc": probe_draft_expand_replay,
    "graph-mask-sibling-visible": probe_verify_graph,
    "expand-seqlens-all-nodes": probe_verify_graph,
    "expand-table-from-row-start": probe_verify_graph,
}


def test_every_variant_has_a_probe_and_a_known_seam():
    assert set(PROBES) == set(TREE_VARIANTS) and len(TREE_VARIANTS) >= 4
    for v in TREE_VARIANTS.values():
        assert callable(v.target) and v.seam.startswith("refspec.") and v.caught_by and v.source and v.changes


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_passes_on_the_production_rule(name):
    PROBES[name]()


@pytest.mark.spec("TR-011", "TR-012", "TR-015", "TR-018")
@pytest.mark.parametrize("name", sorted(TREE_VARIANTS))
def test_variant_is_caught(name):
    with apply_variant(name), pytest.raises(CAUGHT):
        PROBES[name]()
    PROBES[name]()  # restored


@pytest.mark.spec("TR-019", "TR-015")
@pytest.mark.parametrize("name", ["branch-no-tail-copy", "tree-mask-sibling-visible"])
def test_variant_is_caught_by_the_loop(name):
    probe_loop()
    with apply_variant(name), pytest.raises(CAUGHT):
        probe_loop()
