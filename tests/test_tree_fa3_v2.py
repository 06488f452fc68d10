"""The production v2 top-k > 1 round: lossless, equal to the oracle v2 tree loop, leak-free, its units.

fp32 on CPU, the FA3 emulator (and emulated CUDA graphs), shuffled physical pages.  Plain greedy
decoding is the reference (SD-002); the oracle tree loop with ``version="v2"`` must agree round
by round on the accept counts.  The page accounting is v2's: nothing is freed inside a round, so
the rejected branches' slots stay in the row's reserve until the request finishes.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.kv_cache import KVPool
from refspec.core.modes import ForwardMode
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.loop import greedy
from refspec.oracle.tree_loop import speculative_tree_greedy
from refspec.speculative.tree import kv as tree_kv
from refspec.speculative.api import generate
from refspec.audits.kv import audit_kv
from refspec.speculative.tree.engine import TreeEngine
from refspec.speculative.tree.v2 import compact_accept_to_front, move_accept_tokens_to_target_kvcache

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 3, 3]]
BUDGETS = [16, 11, 13]
_REF: dict = {}


@pytest.fixture(scope="module")
def model():
    return init_random_(LlamaModel(tiny_config()), seed=0).eval()


def _reference(model, draft, k, N, S=3):
    """Plain greedy and the oracle v2 tree loop per request (computed once per k, N, S)."""
    key = (k, N, S)
    if key not in _REF:
        _REF[key] = [(greedy(model, p, m).tokens,
                      speculative_tree_greedy(model, draft, p, num_steps=S, topk=k, num_draft_tokens=N,
                                              max_new_tokens=m, version="v2"))
                     for p, m in zip(PROMPTS, BUDGETS)]
    return _REF[key]


def _run(model, draft, P, k, N, S=3, **kw):
    eng = TreeEngine(model, draft, topk=k, num_draft_tokens=N, num_steps=S, page_size=P, max_context=64,
                     max_batch=3, provider="emulator", shuffle_pages=P, version="v2", capture_bs=(1, 2, 4), **kw)
    for i, (p, m) in enumerate(zip(PROMPTS, BUDGETS)):
        eng.add_request(i, p, m)
    eng.run()
    return eng, sorted(eng.done, key=lambda r: r.rid)


@pytest.mark.spec("TR-019", "TR-020", "TR-021", "TR-018", "SD-002", "KV-006")
@pytest.mark.parametrize("graphs", (False, True), ids=("eager", "graphs"))
@pytest.mark.parametrize("P", (1, 4, 16, 64))
@pytest.mark.parametrize("k,N", ((2, 5), (4, 8)))
def test_production_v2_tree_loop_is_lossless_and_equals_the_oracle_v2_tree_loop(model, P, k, N, graphs):
    draft = make_draft(model, model)  # the target as a (shifted) draft: real multi-token acceptance
    eng, done = _run(model, draft, P, k, N, graphs=graphs)
    for r, (g, o) in zip(done, _reference(model, draft, k, N)):
        assert r.output == g
        assert r.accepts == o.accepts and r.output == o.tokens
    assert max(a for r in done for a in r.accepts) >= 3, "acceptance never went past 2: compaction untested"
    assert min(a for r in done for a in r.accepts) == 1, "no round rejected every branch"
    if graphs:
        assert {ph for (ph, how), n in eng.runners.counts.items() if how == "graph" and n} == \
            {"tree_verify", "tree_draft", "draft_extend"}
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start  # KV-006


class HiddenScaledDraft:
    """The target as a (shifted) draft that reads the hidden state it is given: its logits are
    scaled per row by ``exp(2 tanh(mean(x)))`` and its output hidden is ``h + x`` (x = the input
    hidden).  The argmax stays the target's (high acceptance), but the softmax scores, and so
    every later tree, depend on every hidden row the draft was given."""

    uses_hidden = True

    def __init__(self, m):
        c = m.config
        self.m, self.num_layers, self.num_kv_heads = m, c.num_hidden_layers, c.num_key_value_heads
        self.head_dim, self.hidden_size = c.head_dim, c.hidden_size

    def forward(self, input_ids, hidden, fb, backend):
        logits, h = self.m.forward(input_ids, fb, backend)
        scale = torch.exp(2 * torch.tanh(hidden.float().mean(-1, keepdim=True))).to(logits.dtype)
        return logits * scale, h + hidden


@pytest.mark.spec("TR-021", "TR-019")
@pytest.mark.parametrize("P", (1, 4))
def test_v2_draft_extend_reads_the_compacted_hidden(model, P):
    """With a draft that reads the target hidden, the kept draft-extend row must see path node
    a-1's hidden (compacted to the front): production == the oracle v2 tree loop, graphed."""
    draft = HiddenScaledDraft(model)
    eng, done = _run(model, draft, P, 4, 8, graphs=True)
    for r, p, m in zip(done, PROMPTS, BUDGETS):
        o = speculative_tree_greedy(model, draft, p, num_steps=3, topk=4, num_draft_tokens=8, max_new_tokens=m,
                                    version="v2")
        assert r.output == greedy(model, p, m).tokens and r.accepts == o.accepts
    assert max(a for r in done for a in r.accepts) >= 3


@pytest.mark.spec("TR-020", "KV-002", "KV-006", "PA-001", "SD-008")
@pytest.mark.parametrize("P", (1, 4, 16))
def test_v2_rounds_keep_the_reserve_and_free_nothing_until_finish(model, P):
    """After each round: every running row holds exactly its reserve ``L_start + R`` (rejected
    branches not freed), the pages in use are exactly the union of the running rows'
    ``ceil(alloc_len / P)`` pages (no leak, none shared), committed KV is audited; at the end
    every page is free."""
    k, N, S = 4, 8, 3
    R = tree_kv.alloc_len_per_decode(k, S, N, P)
    starts, rounds = {}, []

    def observer(event, eng, **info):
        if event == "draft_decode":
            starts.update({r.rid: r.seq_len for r in info["reqs"]})
        if event != "round_end":
            return
        audit_kv(eng)  # PA-001, KV-002, KV-005, SD-008 (target KV == draft KV == L)
        used = set()
        for r in eng.running:
            assert r.alloc_len == starts[r.rid] + R > r.seq_len
            pages = eng.kv.row_pages(r.row, r.alloc_len)
            assert not used & set(pages)
            used |= set(pages)
        in_use = {p for p in range(1, eng.kv.allocator.num_pages) if eng.kv.allocator.is_in_use(p)}
        assert in_use == used
        rounds.append(len(eng.running))

    eng, done = _run(model, make_draft(model, model), P, k, N, S, observer=observer)
    assert rounds and max(rounds) == 3 and any(a < N for r in done for a in r.accepts)
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start


@pytest.mark.spec("TR-021", "SD-005")
def test_v2_draft_extend_covers_the_whole_window(model):
    """Every v2 draft extend runs DRAFT_EXTEND_V2 over N = num_draft_tokens rows per request (not
    the a accepted ones, not Sd + 1) at KV L..L+N-1 with seq_lens = L + N; seq_len then advances by a."""
    k, N, S, seen = 2, 6, 3, []

    def observer(event, eng, **info):
        if event == "draft_extend":
            fb, reqs = info["fb"], info["reqs"]
            L = [r.seq_len for r in reqs]
            assert fb.forward_mode == ForwardMode.DRAFT_EXTEND_V2 and fb.num_tokens == len(reqs) * N
            assert fb.positions.tolist() == [l + j for l in L for j in range(N)]
            assert fb.seq_lens.tolist() == [l + N for l in L]
            assert fb.out_cache_loc.tolist() == [int(eng.kv.req_to_token[r.row, l + j]) for r, l in zip(reqs, L)
                                                 for j in range(N)]
            seen.append({r.rid: r.seq_len for r in reqs})

    eng, done = _run(model, make_draft(model, model), 4, k, N, S, observer=observer)
    for r in done:
        L = [s[r.rid] for s in seen if r.rid in s]
        assert [b - a for a, b in zip(L, L[1:])] == r.accepts[:len(L) - 1]
    assert len(seen) == len(eng.trace)


@pytest.mark.spec("TR-020")
def test_alloc_len_per_decode_by_hand():
    """k = 4, S = 3, N = 8: P = 1 -> max(12, 8) = 12; P = 4 -> ceil(6 / 4) = 2 pages per branch,
    2*4*4 = 32; P = 16 -> 2*16*4 = 128; k = 2, S = 1, N = 3, P = 1 -> max(2, 3) = 3."""
    assert [tree_kv.alloc_len_per_decode(4, 3, 8, P) for P in (1, 4, 16)] == [12, 32, 128]
    assert tree_kv.alloc_len_per_decode(2, 1, 3, 1) == 3
    # the reserve covers the branch regions at every tail length lp = L mod P, and the verify window
    for P in (1, 2, 4, 16):
        for L in range(20, 20 + P):
            assert tree_kv.draft_alloc_len(L, 4, 3, P) <= L + tree_kv.alloc_len_per_decode(4, 3, 8, P)


@pytest.mark.spec("TR-020")
def test_move_accept_tokens_by_hand():
    """B = 2, N = 4, S + 1 = 3; windows [10..13], [20..23]; paths [0, 2] and [4, 5, 7] (flat).
    Request 0: slot 12 -> 11 (10 stays); request 1: 20 -> 20, 21 -> 21, 23 -> 22; the padded
    entry moves slot 0 -> 0.  The pool's slot values show the moves."""
    pool = KVPool(1, 8, 4, 1, 1, dtype=torch.float32)
    k, v = pool.get_flat_kv(0)
    k[:, 0, 0] = torch.arange(k.shape[0], dtype=torch.float32)
    loc = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23])
    acc = torch.tensor([[0, 2, -1], [4, 5, 7]])
    tgt, src = move_accept_tokens_to_target_kvcache(pool, loc, acc, 4)
    assert tgt.tolist() == [10, 11, 0, 20, 21, 22] and src.tolist() == [10, 12, 0, 20, 21, 23]
    assert k[[10, 11, 20, 21, 22], 0, 0].tolist() == [10, 12, 20, 21, 23]
    assert k[[0, 12, 13, 23], 0, 0].tolist() == [0, 12, 13, 23]  # sources and the rest untouched


@pytest.mark.spec("TR-021", "TR-007")
def test_compact_accept_to_front_by_hand():
    """Upstream ``_compact_accept_to_front`` on predict [2 requests x N = 4], S + 1 = 3:
    request 0 path [0, 2] -> rows [x0, x2, x0 (padded: flat row 0), x3]; request 1 path [4, 7]
    -> rows [x4, x7, x0 (padded: flat row 0, request 0's root), x7]."""
    x = torch.tensor([100, 101, 102, 103, 104, 105, 106, 107])
    out = compact_accept_to_front(x, torch.tensor([[0, 2, -1], [4, 7, -1]]), 4)
    assert out.tolist() == [100, 102, 100, 103, 104, 107, 100, 107]
    assert x.tolist() == [100, 101, 102, 103, 104, 105, 106, 107]  # not modified
    h = torch.arange(16.).view(8, 2)
    assert compact_accept_to_front(h, torch.tensor([[1, -1, -1], [5, 6, -1]]), 4)[4:7].tolist() == \
        [[10., 11.], [12., 13.], [0., 1.]]


@pytest.mark.spec("TR-019", "TR-021", "KV-006")
@pytest.mark.parametrize("P", (1, 16))
def test_generate_topk_v2_eagle_draft_lossless(model, P):
    """``generate(version="v2", topk=..)`` on the production path, an EAGLE draft (rejections)."""
    res = generate(model, PROMPTS, backend="fa3", version="v2", topk=2, num_draft_tokens=4, num_steps=3,
                   page_size=P, max_new_tokens=BUDGETS, provider="emulator", graphs=True, capture_bs=(1, 2, 4))
    ora = generate(model, PROMPTS, backend="oracle", version="v2", topk=2, num_draft_tokens=4, num_steps=3,
                   max_new_tokens=BUDGETS)
    for r, p, m in zip(res.requests, PROMPTS, BUDGETS):
        assert r.tokens == greedy(model, p, m).tokens
    assert res.accepts == ora.accepts and res.free_pages[0] == res.free_pages[1]
    assert res.host_syncs.get("post_round") == len(res.trace) and not res.host_syncs.get("in_round")


@pytest.mark.spec("TR-021", "TR-020")
def test_v2_tree_with_fewer_nodes_than_steps(model):
    """N = 3 < S + 1 = 6 (k = 2, S = 5): a path has at most N nodes; the round compacts
    ``accept_index[:, :N]`` and stays lossless, pages all freed."""
    draft = make_draft(model, model)
    eng, done = _run(model, draft, 4, 2, 3, S=5)
    for r, p, m in zip(done, PROMPTS, BUDGETS):
        o = speculative_tree_greedy(model, draft, p, num_steps=5, topk=2, num_draft_tokens=3, max_new_tokens=m,
                                    version="v2")
        assert r.output == greedy(model, p, m).tokens and r.accepts == o.accepts
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start


def test_tree_engine_refuses_v1_overlap_and_unknown_versions(model):
    with pytest.raises(ValueError, match="overlap schedule needs version 'v2'"):
        TreeEngine(model, make_draft("eagle", model), topk=2, num_draft_tokens=4, version="v1", overlap=True)
    with pytest.raises(ValueError, match="'v1' or 'v2'"):
        TreeEngine(model, make_draft("eagle", model), topk=2, num_draft_tokens=4, version="v3")
    with pytest.raises(ValueError, match="overlap schedule needs version 'v2'"):
        generate(model, PROMPTS, backend="fa3", version="v1", topk=2, num_draft_tokens=4, overlap=True)
    assert TreeEngine(model, make_draft("eagle", model), topk=2, num_draft_tokens=4, version="v2",
                      overlap=True).overlap is True
    assert TreeEngine(model, make_draft("eagle", model), topk=2, num_draft_tokens=4, version="v2").overlap is False
