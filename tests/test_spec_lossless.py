"""Lossless speculative decoding (SD-002): every drafter x page size x v1/v2/v2-overlap x
eager/graph equals plain greedy decoding of the target bit for bit (fp32, TOL-001), and the
production loop equals the oracle loop token for token and accept count for accept count.

"v2-overlap" is v2 under the overlap loop (``overlap=True``: round k+1 launched before round
k's results are read, :mod:`refspec.speculative.overlap`); its oracle is the v2 oracle loop."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative import generate, greedy_reference

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

PROMPT_LENS = [3, 9, 14, 5, 17]  # crosses page boundaries for P = 2, 4, 16
BUDGETS = [14, 9, 16, 11, 13]  # different lengths: requests leave the batch mid-run
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def target() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0)


@functools.lru_cache(maxsize=None)
def small_lm() -> LlamaModel:
    cfg = tiny_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)
    return init_random_(LlamaModel(cfg), seed=5)


@functools.lru_cache(maxsize=None)
def reference() -> dict[int, list[int]]:
    return greedy_reference(target(), PROMPTS, [b + 8 for b in BUDGETS])  # + N: last-round drafts


def baseline(bs: int) -> list[list[int]]:
    return [reference()[i][len(PROMPTS[i]):len(PROMPTS[i]) + BUDGETS[i]] for i in range(bs)]


#: name -> (draft model, token drafter)
DRAFTERS = {
    "perfect": ("eagle", "perfect"),
    "adversarial": ("eagle", "adversarial"),
    "random": ("eagle", "random"),
    "eagle": ("eagle", None),
    "early-exit": ("early-exit:1", None),
    "small-lm": ("small-lm", None),
}


#: production loops: version name -> (version, overlap)
MODES = {"v1": ("v1", False), "v2": ("v2", False), "v2-overlap": ("v2", True)}


def run(name, bs, **kw):
    if kw.get("version") in MODES:
        kw["version"], kw["overlap"] = MODES[kw["version"]]
    draft, drafter = DRAFTERS[name]
    draft = small_lm() if draft == "small-lm" else draft
    kw.setdefault("max_new_tokens", BUDGETS[:bs])
    return generate(target(), PROMPTS[:bs], draft=draft, drafter=drafter, reference=reference(), **kw)


@functools.lru_cache(maxsize=None)
def oracle(name, version):
    return run(name, 5, backend="oracle", version=MODES[version][0])


CASES = [(d, P, v, g) for d in DRAFTERS for P in (1, 2, 4, 16, 64) for v in MODES for g in (False, True)]


@pytest.mark.spec("SD-002", "TOL-001", "KV-006")
@pytest.mark.parametrize("name,page_size,version,graphs", CASES,
                         ids=[f"{d}-P{P}-{v}-{'graph' if g else 'eager'}" for d, P, v, g in CASES])
def test_lossless_and_equal_to_oracle_loop(name, page_size, version, graphs):
    bs = 1 + CASES.index((name, page_size, version, graphs)) % 5  # batch sizes 1..5 across the matrix
    res = run(name, bs, backend="fa3", version=version, page_size=page_size, graphs=graphs)
    assert res.tokens == baseline(bs), "speculative output differs from plain greedy (SD-002)"
    ora = oracle(name, version)
    assert ora.tokens[:bs] == baseline(bs), "oracle loop is not lossless"
    assert res.accepts == ora.accepts[:bs], "production accept counts differ from the oracle loop"
    assert res.drafts == ora.drafts[:bs], "production draft tokens differ from the oracle loop"
    assert res.free_pages[0] == res.free_pages[1], f"pages leaked: {res.free_pages}"
    if graphs:
        assert any(t.graph for t in res.trace), "no round replayed a graph"


@pytest.mark.spec("SD-002")
@pytest.mark.parametrize("version", list(MODES))
def test_paged_oracle_attention_loop_is_lossless(version):
    res = run("random", 5, backend="paged-oracle", version=version, page_size=4)
    assert res.tokens == baseline(5)
    assert res.accepts == oracle("random", version).accepts


@pytest.mark.spec("SD-002", "SD-010")
@pytest.mark.parametrize("num_steps", [1, 2, 5])
@pytest.mark.parametrize("version", list(MODES))
def test_lossless_for_other_draft_lengths(num_steps, version):
    """Sd = 1 (no draft-decode forward at all), 2, 5: N = Sd + 1 tokens verified per round."""
    res = run("random", 3, backend="fa3", version=version, page_size=4, graphs=True, num_steps=num_steps)
    assert res.tokens == baseline(3)
    assert all(1 <= a <= num_steps + 1 for t in res.trace for a in t.num_accept_tokens)
    ora = run("random", 3, backend="oracle", version=MODES[version][0], num_steps=num_steps)
    assert res.accepts == ora.accepts


@pytest.mark.spec("SD-002", "CG-007")
@pytest.mark.parametrize("version", list(MODES))
def test_batches_above_the_largest_graph_run_eagerly(version):
    """5 requests, graphs captured for 1 and 2: eager rounds while > 2 run, graphs afterwards
    (a round's batch: its rids and, under overlap, the rows it ran for requests already finished)."""
    res = run("random", 5, backend="fa3", version=version, page_size=2, graphs=True, capture_bs=(1, 2))
    assert res.tokens == baseline(5)
    sizes_graphed = {len(t.rids) + len(t.discarded) for t in res.trace if t.graph}
    sizes_eager = {len(t.rids) + len(t.discarded) for t in res.trace if not t.graph}
    assert sizes_graphed and max(sizes_graphed) <= 2
    assert sizes_eager and min(sizes_eager) > 2


@pytest.mark.spec("SD-002", "SD-009")
@pytest.mark.parametrize("version", list(MODES))
def test_requests_join_and_leave_mid_run(version):
    """At most 2 running; later arrivals are prefilled (EXTEND) while others are mid-decode."""
    res = run("random", 5, backend="fa3", version=version, page_size=4, graphs=True, max_batch=2,
              arrivals=[0, 0, 2, 3, 3])
    assert res.tokens == baseline(5)
    assert res.accepts == oracle("random", version).accepts
    joins = [t for t in res.trace if t.joined and t.index > 0]
    assert joins and all(len(t.rids) <= 2 for t in res.trace)
    assert any(set(t.rids) - set(t.joined) for t in joins), "nobody joined a running batch"


@pytest.mark.spec("SD-002")
@pytest.mark.parametrize("version", list(MODES))
def test_eos_stops_inside_an_accepted_run(version):
    """An EOS among the accepted tokens ends the request there (it is emitted, nothing after)."""
    eos = reference()[0][len(PROMPTS[0]) + 5]  # request 0's 6th greedy token
    ref = greedy_reference(target(), PROMPTS, BUDGETS, eos=eos)
    v, overlap = MODES[version]
    res = generate(target(), PROMPTS, draft="eagle", drafter="perfect", reference=ref, max_new_tokens=BUDGETS,
                   eos=eos, version=v, page_size=4, overlap=overlap)
    assert res.tokens == [ref[i][len(p):] for i, p in enumerate(PROMPTS)]
    assert res.requests[0].finish_reason == "eos" and res.tokens[0][-1] == eos
    assert len(res.tokens[0]) <= 6
    if overlap:  # the EOS is read one round late: request 0 ran one more round, dropped
        assert any(0 in t.discarded for t in res.trace)
    assert res.free_pages[0] == res.free_pages[1]


@pytest.mark.spec("SD-006")
@pytest.mark.parametrize("backend", ["oracle", "fa3"])
def test_v1_and_v2_draft_extend_give_the_same_drafts(backend):
    """With the draft's own argmax, v1 (a packed rows) and v2 (N rows, row a-1 kept) propose the
    same drafts every round: the kept row sees the same tokens, hidden states and keys."""
    kw = dict(backend=backend, page_size=4)
    v1, v2 = run("eagle", 5, version="v1", **kw), run("early-exit", 5, version="v1", **kw)
    w1, w2 = run("eagle", 5, version="v2", **kw), run("early-exit", 5, version="v2", **kw)
    assert v1.accepts == w1.accepts and v2.accepts == w2.accepts
    assert v1.drafts == w1.drafts and v2.drafts == w2.drafts
    if backend == "fa3":
        assert [t.drafts for t in v1.trace] == [t.drafts for t in w1.trace]
        assert [t.drafts for t in v2.trace] == [t.drafts for t in w2.trace]
        o1, o2 = run("eagle", 5, version="v2-overlap", **kw), run("early-exit", 5, version="v2-overlap", **kw)
        assert o1.accepts == v1.accepts and o1.drafts == v1.drafts
        assert o2.accepts == v2.accepts and o2.drafts == v2.drafts
