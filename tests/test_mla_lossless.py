"""Lossless speculative decoding of an MLA target with its MTP draft (SD-002): the DeepSeek-style
model and DeepSeek's MTP layer through ``generate()``, the oracle loops and the production loop
(paged latent pools, the FA3 emulator's ``qv`` path, emulated CUDA graphs), v1 / v2 / v2 under the
overlap schedule, P in {1, 4, 16, 64}, top-k 1 and > 1: every run equals plain greedy decoding
of the target bit for bit (fp32, TOL-001), and the production loop equals the oracle loop accept
count for accept count.

The oracle loops run DeepSeek's naive form over per-head K / V (:mod:`refspec.model.deepseek`);
the production loop runs SGLang's forms over the latent pool (MHA_ONE_SHOT prefills, everything
else absorbed): equal tokens are the absorption identity (ML-008) over whole generations.

``make test`` runs a representative subset (every page size, every loop version, eager and
graphed, chain and trees); ``make full-grid`` runs the rest of the grid (marker ``full_grid``)."""

from __future__ import annotations

import functools

import pytest
import torch

from mla_kit import BUDGETS, PROMPTS, accepting_mtp, baseline, draft, reference, target
from refspec.core.kv_cache import MLAKVPool
from refspec.model.deepseek import DeepseekModel, deepseek_v3_dims_config
from refspec.model.llama import init_random_
from refspec.speculative import generate, greedy_reference
from refspec.speculative.engine import Engine

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

#: production loops: name -> (version, overlap)
MODES = {"v1": ("v1", False), "v2": ("v2", False), "v2-overlap": ("v2", True)}
PAGE_SIZES = (1, 4, 16, 64)
TREES = ((2, 4), (4, 8))  # (topk k, num_draft_tokens N)

CHAIN = [(P, v, g) for P in PAGE_SIZES for v in MODES for g in (False, True)]
TREE = [(P, v, g, k, N) for P in PAGE_SIZES for v in MODES for g in (False, True) for k, N in TREES]
#: the subset make test runs: every P, every version, eager and graphed
CHAIN_DEFAULT = [(1, "v1", False), (1, "v2-overlap", True), (4, "v2", True), (4, "v1", True),
                 (16, "v2-overlap", False), (16, "v2", False), (64, "v1", True), (64, "v2-overlap", True)]
TREE_DEFAULT = [(1, "v1", False, 2, 4), (4, "v2", True, 4, 8), (16, "v2-overlap", True, 2, 4),
                (64, "v1", True, 4, 8), (64, "v2", False, 2, 4)]


def _params(cases, default, ids):
    return [pytest.param(*c, id=ids(c), marks=() if c in default else pytest.mark.full_grid) for c in cases]


def run(**kw) -> object:
    """One production run over all five prompts; the latent pools start as NaN (a row read before it
    is written would poison the output)."""
    version, overlap = MODES[kw.pop("mode")]
    return generate(target(), PROMPTS, draft=draft(), max_new_tokens=BUDGETS, reference=reference(),
                    version=version, overlap=overlap, pool_fill=float("nan"), **kw)


@functools.lru_cache(maxsize=None)
def oracle(version: str, topk: int = 1, num_draft_tokens: int | None = None):
    return generate(target(), PROMPTS, backend="oracle", draft=draft(), max_new_tokens=BUDGETS, version=version,
                    topk=topk, num_draft_tokens=num_draft_tokens)


def check_production(res, graphs: bool) -> None:
    """Lossless, leak-free, graphs replayed when asked, and multi-token acceptance happened (so the
    accepted runs, the tree's path compaction and the latent rows it moves, ML-012, ran)."""
    assert res.tokens == baseline(5), "speculative output differs from plain greedy (SD-002)"
    assert res.free_pages[0] == res.free_pages[1], f"pages leaked: {res.free_pages}"
    if graphs:
        assert any(t.graph for t in res.trace), "no round replayed a graph"
    assert max(a for req in res.accepts for a in req) >= 3, "acceptance never went past 2"


@pytest.mark.spec("SD-002", "TOL-001", "ML-008", "ML-009")
@pytest.mark.parametrize("mode", list(MODES))
def test_the_oracle_loops_are_lossless(mode):
    """The chain and the tree oracle loops (naive MLA over dense per-head K / V) equal plain greedy."""
    version = MODES[mode][0]
    for topk, N in ((1, None), *TREES):
        assert oracle(version, topk, N).tokens == baseline(5), f"oracle loop, topk {topk}"


@pytest.mark.spec("SD-002", "TOL-001", "KV-006", "ML-005", "ML-009")
@pytest.mark.parametrize("page_size,mode,graphs",
                         _params(CHAIN, CHAIN_DEFAULT, lambda c: f"P{c[0]}-{c[1]}-{'graph' if c[2] else 'eager'}"))
def test_chain_is_lossless_and_equal_to_the_oracle_loop(page_size, mode, graphs):
    res = run(backend="fa3", mode=mode, page_size=page_size, graphs=graphs, shuffle_pages=page_size)
    check_production(res, graphs)
    ora = oracle(MODES[mode][0])
    assert res.accepts == ora.accepts, "production accept counts differ from the oracle loop"
    assert res.drafts == ora.drafts, "production draft tokens differ from the oracle loop"


@pytest.mark.spec("SD-002", "TR-019", "ML-011", "ML-012")
@pytest.mark.parametrize("page_size,mode,graphs,topk,num_draft_tokens",
                         _params(TREE, TREE_DEFAULT,
                                 lambda c: f"P{c[0]}-{c[1]}-{'graph' if c[2] else 'eager'}-k{c[3]}N{c[4]}"))
def test_tree_is_lossless_and_equal_to_the_oracle_tree_loop(page_size, mode, graphs, topk, num_draft_tokens):
    res = run(backend="fa3", mode=mode, page_size=page_size, graphs=graphs, shuffle_pages=page_size, topk=topk,
              num_draft_tokens=num_draft_tokens)
    check_production(res, graphs)
    assert res.accepts == oracle(MODES[mode][0], topk, num_draft_tokens).accepts


@pytest.mark.spec("SD-002")
@pytest.mark.parametrize("drafter,page_size,mode", [("perfect", 16, "v2"), ("adversarial", 4, "v1"),
                                                    ("random", 64, "v2-overlap")])
def test_forced_drafts_every_accept_length(drafter, page_size, mode):
    """The drafters that override the MTP's tokens: every draft right (a = N), every draft wrong
    (a = 1), random: still lossless, through graphs."""
    res = run(backend="fa3", mode=mode, page_size=page_size, graphs=True, drafter=drafter)
    assert res.tokens == baseline(5)
    accepts = {a for req in res.accepts for a in req}
    assert accepts == {1} if drafter == "adversarial" else max(accepts) == 4


@pytest.mark.spec("SD-002", "ML-010")
def test_the_paged_oracle_wing_in_the_production_loop():
    """The production loop with the paged oracle backend on the latent pools (absorbed form by slot,
    the MHA pass on ragged keys): lossless, the oracle loop's acceptance."""
    res = run(backend="paged-oracle", mode="v2", page_size=4)
    assert res.tokens == baseline(5)
    assert res.accepts == oracle("v2").accepts


@pytest.mark.spec("SD-002", "ML-006", "ML-007")
def test_deepseek_v3_attention_dims_are_lossless():
    """DeepSeek-V3's attention dims (a 576-wide latent row, YaRN scale 0.1352; the 64 / 512 qv call
    and the 192 / 128 prefill): a chain under the overlap schedule with graphs, and a tree."""
    m = init_random_(DeepseekModel(deepseek_v3_dims_config()), seed=0).eval()
    prompts, budget = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8, 1, 8, 2]], 8
    ref = greedy_reference(m, prompts, budget)
    d = accepting_mtp(m)
    for kw in (dict(version="v2", overlap=True, graphs=True, page_size=16),
               dict(version="v1", page_size=64, topk=2, num_draft_tokens=4)):
        res = generate(m, prompts, backend="fa3", draft=d, max_new_tokens=budget, **kw)
        assert [p + t for p, t in zip(prompts, res.tokens)] == [ref[0], ref[1]], kw
    assert generate(m, prompts, backend="oracle", draft=d, max_new_tokens=budget).tokens == res.tokens
    eng = Engine(m, d, max_context=32, max_batch=1)
    assert isinstance(eng.draft_pool, MLAKVPool) and eng.target_pool.kv_cache_dim == eng.draft_pool.kv_cache_dim == 576
