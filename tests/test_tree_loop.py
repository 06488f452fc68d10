"""The oracle top-k tree loop (``refspec.oracle.tree_loop``): lossless against plain greedy
(bitwise fp32 tokens), the chain loop at top-k = 1, and the attention rows it runs (every key
list recorded through the backend and checked against the rule written out here)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle import tree_loop
from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV
from refspec.oracle.loop import greedy, speculative_greedy
from refspec.oracle.tree_loop import _compact_to_front, speculative_tree_greedy

torch.set_num_threads(1)

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (3, 9, 14)]
BUDGET = 14


@functools.cache
def target() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0)


@functools.cache
def draft(name: str):
    return make_draft(name, target(), seed=1)


@functools.cache
def plain(i: int) -> list[int]:
    return greedy(target(), PROMPTS[i], BUDGET).tokens


@pytest.mark.spec("TR-009", "SD-002", "TOL-001")
@pytest.mark.parametrize("dname", ["eagle", "early-exit:1"])
@pytest.mark.parametrize("topk,num_steps,N", [(2, 3, 4), (2, 3, 6), (2, 2, 7), (4, 3, 6), (4, 3, 8), (4, 1, 5)])
def test_tree_loop_is_lossless(dname, topk, num_steps, N):
    for i, prompt in enumerate(PROMPTS):
        res = speculative_tree_greedy(target(), draft(dname), prompt, num_steps=num_steps, topk=topk,
                                      num_draft_tokens=N, max_new_tokens=BUDGET)
        assert res.tokens == plain(i), f"prompt {i}"
        assert sum(res.emitted) == BUDGET - 1  # the prefill token is not a verify-round token
        assert all(1 <= a <= min(N, num_steps + 1) for a in res.accepts)
        assert [len(d) for d in res.drafts] == [N - 1] * len(res.accepts)


@pytest.mark.spec("TR-007", "TR-009", "SD-006")
@pytest.mark.parametrize("dname", ["eagle", "early-exit:1"])
@pytest.mark.parametrize("topk,num_steps,N", [(2, 3, 6), (4, 3, 8), (4, 3, 3), (2, 4, 12)])
def test_v2_draft_extend_equals_v1(dname, topk, num_steps, N):
    """v2 runs all N rows with the path compacted to the front and keeps row a - 1: the same
    drafts, accepts and tokens as v1 (rows >= a cannot reach row a - 1), and lossless."""
    for i, prompt in enumerate(PROMPTS):
        kw = {"num_steps": num_steps, "topk": topk, "num_draft_tokens": N, "max_new_tokens": BUDGET}
        v1 = speculative_tree_greedy(target(), draft(dname), prompt, version="v1", **kw)
        v2 = speculative_tree_greedy(target(), draft(dname), prompt, version="v2", **kw)
        assert v2.tokens == v1.tokens == plain(i)
        assert v2.accepts == v1.accepts and v2.drafts == v1.drafts


@pytest.mark.spec("TR-009")
@pytest.mark.parametrize("dname", ["eagle", "early-exit:1"])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 5])
def test_topk_1_equals_the_chain_loop(dname, num_steps):
    for prompt in PROMPTS:
        chain = speculative_greedy(target(), draft(dname), prompt, num_steps=num_steps, max_new_tokens=BUDGET)
        tree = speculative_tree_greedy(target(), draft(dname), prompt, num_steps=num_steps, topk=1,
                                       num_draft_tokens=num_steps + 1, max_new_tokens=BUDGET)
        assert tree.tokens == chain.tokens and tree.accepts == chain.accepts and tree.drafts == chain.drafts


@pytest.mark.spec("TR-009")
def test_eos_stops_the_tree_loop():
    ref = plain(1)
    eos = ref[5]
    res = speculative_tree_greedy(target(), draft("early-exit:1"), PROMPTS[1], num_steps=3, topk=2,
                                  num_draft_tokens=6, max_new_tokens=BUDGET, eos=eos)
    assert res.tokens == ref[:ref.index(eos) + 1]


class Recorder:
    """Wraps ``SlotBackend.forward`` and records layer 0's (backend id, positions, out, keys)."""

    def __init__(self, monkeypatch):
        self.calls = []
        orig = tree_loop.SlotBackend.forward
        rec = self

        def forward(be, q, k, v, layer, fb):
            if layer.layer_id == 0:
                rec.calls.append((id(be), fb.positions.tolist(), list(fb.out_slots), [list(r) for r in fb.key_slots]))
            return orig(be, q, k, v, layer, fb)

        monkeypatch.setattr(tree_loop.SlotBackend, "forward", forward)


@pytest.mark.spec("TR-008", "SD-007")
def test_draft_decode_rows_attend_prefix_plus_their_own_row_history(monkeypatch):
    """Draft decode forwards (k rows, all at one position L + s): row t's keys are the prefix
    0..L-1 and exactly the slots row t wrote at steps 0..s of this round, its own included."""
    k, Sd, N = 3, 4, 9
    rec = Recorder(monkeypatch)
    res = speculative_tree_greedy(target(), draft("eagle"), PROMPTS[1], num_steps=Sd, topk=k, num_draft_tokens=N,
                                  max_new_tokens=BUDGET)
    draft_be = rec.calls[1][0]  # call 0: target prefill, call 1: draft prefill
    decode = [c for c in rec.calls if c[0] == draft_be and len(set(c[1])) == 1 and len(c[1]) == k]
    assert len(decode) == (Sd - 1) * len(res.accepts)
    L = len(PROMPTS[1])
    for r, a in enumerate(res.accepts):
        history = [[] for _ in range(k)]
        for s in range(Sd - 1):
            _, pos, out, keys = decode[r * (Sd - 1) + s]
            assert pos == [L + s] * k  # SD-007: step s runs at KV index / position L + s
            assert len(set(out)) == k and min(out) >= len(PROMPTS[1]) + BUDGET + N  # scratch: above committed
            for t in range(k):
                history[t].append(out[t])
                assert keys[t] == list(range(L)) + history[t]
        L += a


@pytest.mark.spec("TR-004", "TR-005")
def test_verify_rows_attend_prefix_ancestors_and_self(monkeypatch):
    k, Sd, N = 2, 3, 7
    rec = Recorder(monkeypatch)
    res = speculative_tree_greedy(target(), draft("early-exit:1"), PROMPTS[0], num_steps=Sd, topk=k,
                                  num_draft_tokens=N, max_new_tokens=BUDGET)
    target_be = rec.calls[0][0]
    verify = [c for c in rec.calls if c[0] == target_be and len(c[1]) == N][: len(res.trees)]
    L = len(PROMPTS[0])
    for tree, a, (_, pos, out, keys) in zip(res.trees, res.accepts, verify):
        assert out == [L + i for i in range(N)]
        for i in range(N):
            chain, j = [i], i
            while tree.parent[j] != -1:
                j = tree.parent[j]
                chain.append(j)
            seen = sorted(set(chain) | {0})
            assert pos[i] == L + len(seen) - 1  # L + depth
            assert keys[i] == list(range(L)) + [L + j for j in seen]
        L += a


@pytest.mark.spec("TR-007", "SD-008")
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_committed_kv_equals_a_fresh_prefill_of_the_committed_tokens(monkeypatch, version):
    """After the run, target slots 0..L-1 hold the K/V a plain prefill of t_0..t_(L-1) computes,
    and draft slots 0..L-1 the draft prefill of t_1..t_L on that prefill's hidden states (the EAGLE
    shift): the accepted paths were moved to L..L+a-1 and the draft extend ran exactly them."""
    stores = []

    class Spy(tree_loop.SlotKV):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            stores.append(self)

    monkeypatch.setattr(tree_loop, "SlotKV", Spy)
    t = target()
    d = make_draft(t, t)  # the target as a small-LM draft (EAGLE-shifted): accepts often
    prompt = PROMPTS[2]
    res = speculative_tree_greedy(t, d, prompt, num_steps=3, topk=4, num_draft_tokens=8, max_new_tokens=BUDGET,
                                  version=version)
    assert any(p != list(range(len(p))) for p in res.paths)  # some path was moved, not copied in place
    tkv, dkv = stores
    L = len(prompt) + sum(res.accepts)
    seq = prompt + greedy(t, prompt, L + 1 - len(prompt)).tokens  # lossless: committed == greedy
    ref_t = DenseKV(t.config.num_hidden_layers, L, t.config.num_key_value_heads, t.config.head_dim)
    _, h = t(torch.tensor(seq[:L]), DenseBatch.span(0, L), DenseBackend(ref_t))
    ref_d = DenseKV(d.num_layers, L, d.num_kv_heads, d.head_dim)
    d.forward(torch.tensor(seq[1:L + 1]), h, DenseBatch.span(0, L), DenseBackend(ref_d))
    for got, ref in ((tkv, ref_t), (dkv, ref_d)):
        for layer in range(len(ref.k)):
            torch.testing.assert_close(got.k[layer][:L], ref.k[layer], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.v[layer][:L], ref.v[layer], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- generate(..., topk=k, num_draft_tokens=N)
@pytest.mark.spec("TR-009", "SD-002")
def test_generate_oracle_topk_is_lossless_and_reports_accepts_per_round():
    from refspec.speculative import generate

    res = generate(target(), PROMPTS, backend="oracle", draft="early-exit:1", num_steps=3, topk=4,
                   num_draft_tokens=8, max_new_tokens=BUDGET)
    assert res.tokens == [plain(i) for i in range(len(PROMPTS))]
    for r in res.requests:
        assert len(r.accepts) == len(r.emitted) == len(r.drafts) >= 1 and all(len(d) == 7 for d in r.drafts)
        assert sum(r.emitted) == BUDGET - 1 and 1 <= r.accept_length <= 4
    default = generate(target(), PROMPTS[:1], backend="oracle", draft="eagle", num_steps=3, max_new_tokens=BUDGET)
    explicit = generate(target(), PROMPTS[:1], backend="oracle", draft="eagle", num_steps=3, max_new_tokens=BUDGET,
                        topk=1, num_draft_tokens=4)
    assert default.tokens == explicit.tokens and default.accepts == explicit.accepts  # k = 1: the chain loop


@pytest.mark.spec("TR-002", "SD-010", "TR-001")
@pytest.mark.parametrize("kw,match", [
    ({"topk": 2, "num_draft_tokens": 12}, r"TR-002.*N - 1 <= k \+ \(Sd-1\) k\^2 = 2 \+ 2\*2\^2 = 10"),
    ({"topk": 2}, "needs num_draft_tokens"),
    ({"topk": 1, "num_draft_tokens": 3}, r"SD-010"),
    ({"topk": 0}, "topk"),
    ({"topk": 2, "num_draft_tokens": 6, "backend": "paged-oracle"}, "backend 'oracle' or 'fa3'"),
    ({"topk": 2, "num_draft_tokens": 6, "backend": "fa3", "version": "v1", "overlap": True}, "overlap"),
    ({"topk": 2, "num_draft_tokens": 6, "version": "v3"}, "version"),
    ({"topk": 2, "num_draft_tokens": 6, "drafter": "perfect"}, "drafter"),
    ({"topk": 129, "num_draft_tokens": 6}, r"vocab_size V = 128.*TR-001"),
    ({"topk": 2, "num_draft_tokens": 4, "backend": "fa3", "graphs": True, "capture_bs": ()},
     "capture_bs must be a non-empty"),
    ({"topk": 10**6, "num_draft_tokens": 6, "backend": "fa3"}, r"vocab_size V = 128.*TR-001"),
])
def test_generate_rejects_bad_tree_arguments(kw, match):
    from refspec.speculative import generate

    kw = {"backend": "oracle", **kw}
    with pytest.raises(ValueError, match=match):
        generate(target(), PROMPTS[:1], num_steps=3, max_new_tokens=4, **kw)


@pytest.mark.spec("TR-007")
def test_v2_rows_put_the_path_first():
    """Path [0, 1, 5] (a = 3) of an N = 8 tree, Sd = 3: rows 0..2 are the emitted tokens with the
    hidden states of nodes 0, 1, 5; row 3 (the padded 4th accept entry) repeats node 0; rows
    4..7 keep nodes 4..7 with their target argmax."""
    predict = [50, 51, 52, 53, 54, 55, 56, 57]
    tokens, nodes = _compact_to_front([10, 22, 7], [0, 1, 5], predict, Sd=3, N=8)
    assert nodes == [0, 1, 5, 0, 4, 5, 6, 7]
    assert tokens == [10, 22, 7, 50, 54, 55, 56, 57]
    assert _compact_to_front([10], [0], predict[:3], Sd=3, N=3) == ([10, 50, 50], [0, 0, 0])  # N < Sd + 1


def _sibling_visible(tree, prefix, node_slots):
    """Wrong TR-004: every row sees all nodes up to itself in node order (a chain mask)."""
    return [list(prefix) + node_slots[:i + 1] for i in range(tree.num_nodes)]


def _node_index_positions(build):
    """Wrong TR-005: node i at position L + i instead of L + depth(i)."""
    def wrapped(*a, **kw):
        tree = build(*a, **kw)
        tree.positions = [tree.positions[0] + i for i in range(tree.num_nodes)]
        return tree
    return wrapped


@pytest.mark.spec("TR-004", "TR-005", "TR-007", "TR-009")
@pytest.mark.parametrize("wrong", ["sibling visible", "node-index positions", "path KV not moved"])
def test_each_wrong_rule_breaks_losslessness(monkeypatch, wrong):
    """The lossless check has teeth: with any one tree rule broken, some prompt's tokens differ
    from plain greedy (the target as its own EAGLE-shifted draft, k = 4, N = 8: deep trees)."""
    if wrong == "sibling visible":
        monkeypatch.setattr(tree_loop, "verify_key_slots", _sibling_visible)
    elif wrong == "node-index positions":
        monkeypatch.setattr(tree_loop, "build_tree", _node_index_positions(tree_loop.build_tree))
    else:
        monkeypatch.setattr(tree_loop.SlotKV, "move", lambda self, src, dst: None)
    t = target()
    d = make_draft(t, t)
    same = [speculative_tree_greedy(t, d, p, num_steps=3, topk=4, num_draft_tokens=8,
                                    max_new_tokens=BUDGET).tokens == plain(i) for i, p in enumerate(PROMPTS)]
    assert not all(same), f"{wrong}: every prompt still matched greedy"
