"""The production top-k > 1 loop: lossless, equal to the oracle tree loop, leak-free, the rules' units.

fp32 on CPU, the FA3 emulator, shuffled physical pages.  Plain greedy decoding of the target is
the reference (SD-002); the oracle tree loop (``refspec.oracle.tree_loop``) must agree round by
round on the accept counts (same drafts, same tree, same acceptance).
"""

from __future__ import annotations

import pytest
import torch

from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.loop import greedy
from refspec.oracle.tree_loop import speculative_tree_greedy
from refspec.speculative.tree import build as tree_build, kv as tree_kv
from refspec.speculative.api import generate
from refspec.audits.kv import audit_kv
from refspec.speculative.tree.engine import TreeEngine

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 3, 3]]
BUDGETS = [18, 12, 15]


@pytest.fixture(scope="module")
def model():
    return init_random_(LlamaModel(tiny_config()), seed=0).eval()


def _run(model, draft, P, k, N, S=3, **kw):
    eng = TreeEngine(model, draft, topk=k, num_draft_tokens=N, num_steps=S, page_size=P, max_context=64,
                     max_batch=3, provider="emulator", shuffle_pages=P, **kw)
    for i, (p, m) in enumerate(zip(PROMPTS, BUDGETS)):
        eng.add_request(i, p, m)
    eng.run()
    return eng, sorted(eng.done, key=lambda r: r.rid)


@pytest.mark.spec("TR-019", "TR-017", "SD-002")
@pytest.mark.parametrize("P", (1, 4, 16, 64))
@pytest.mark.parametrize("k,N", ((2, 5), (4, 8)))
def test_production_tree_loop_is_lossless_and_equals_the_oracle_tree_loop(model, P, k, N):
    draft = make_draft(model, model)  # the target as a (shifted) draft: real multi-token acceptance
    eng, done = _run(model, draft, P, k, N)
    for r, p, m in zip(done, PROMPTS, BUDGETS):
        assert r.output == greedy(model, p, m).tokens
        o = speculative_tree_greedy(model, draft, p, num_steps=3, topk=k, num_draft_tokens=N, max_new_tokens=m)
        assert r.accepts == o.accepts and r.output == o.tokens
    assert max(a for r in done for a in r.accepts) >= 3, "acceptance never went past 2: compaction untested"
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start  # KV-006


@pytest.mark.spec("TR-019", "KV-006")
@pytest.mark.parametrize("P", (1, 16))
def test_generate_topk_eagle_draft_lossless(model, P):
    res = generate(model, PROMPTS, backend="fa3", topk=2, num_draft_tokens=4, num_steps=3, page_size=P,
                   max_new_tokens=BUDGETS, provider="emulator")
    for r, p, m in zip(res.requests, PROMPTS, BUDGETS):
        assert r.tokens == greedy(model, p, m).tokens
    assert res.free_pages[0] == res.free_pages[1]


@pytest.mark.spec("TR-017", "PA-001", "KV-002", "SD-008")
@pytest.mark.parametrize("P", (4, 16))
def test_every_round_keeps_rows_page_contiguous_and_pages_exact(model, P):
    """After each round: each row page-contiguous over its committed length, and the pages in use
    are exactly the union of the running rows' ceil(L / P) pages (nothing leaked, nothing shared)."""
    seen = []

    def observer(event, eng, **info):
        if event != "round_end":
            return
        audit_kv(eng)  # PA-001, KV-002, KV-004, SD-008 (target KV == draft KV == L)
        used = set()
        for r in eng.running:
            eng.kv.check_page_contiguous(r.row, r.seq_len)
            pages = eng.kv.row_pages(r.row, r.alloc_len)
            assert not used & set(pages)
            used |= set(pages)
        in_use = {p for p in range(1, eng.kv.allocator.num_pages) if eng.kv.allocator.is_in_use(p)}
        assert in_use == used
        seen.append(len(eng.running))

    _run(model, make_draft(model, model), P, 4, 8, observer=observer)
    assert seen and max(seen) == 3


@pytest.mark.spec("TR-017")
def test_compaction_keep_len_and_freed_pages_by_hand():
    """L = 6, P = 4, N = 8 (positions 6..13), path = nodes [0, 3, 5] (n = 2, a = 3).

    keep = min(ceil_4(6 + 3), 14) = 12: positions 12, 13 (one page) are freed; src = verify slots
    of nodes 0, 3, 5; tgt = those of nodes 0, 1, 2.
    """
    L, N = torch.tensor([6]), 8
    loc = torch.arange(100, 108)
    acc = torch.tensor([[0, 3, 5, -1]])
    src, keep, nfree = tree_kv.get_src_tgt_cache_loc(L, loc, acc, torch.tensor([2]), N, 4)
    assert src.tolist() == [100, 103, 105] and keep.tolist() == [12] and nfree.tolist() == [2]
    tgt, free = tree_kv.get_target_cache_loc(loc, torch.tensor([2]), nfree, N)
    assert tgt.tolist() == [100, 101, 102] and free.tolist() == [106, 107]


@pytest.mark.spec("TR-016", "TR-002", "TR-003", "TR-004", "TR-005")
def test_production_tree_worked_example():
    """k = 2, S = 3, N = 7, L = 5.  Root children 10 (.6), 11 (.3); step-1 rows [10, 11] propose
    [20 (.5), 21 (.4)] and [22 (.9), 23 (.05)]; step-2 rows [20, 22] propose [30 (.7), 31 (.2)],
    [32 (.6), 33 (.3)].  Scores [.6 .3 | .3 .24 .27 .015 | .21 .06 .162 .081]; the 6 best are
    indices 0, 1, 2, 3, 4, 6 -> tokens [10, 11, 20, 21, 22, 30]; parents: 10, 11 <- root,
    20, 21 <- 10, 22 <- 11, 30 <- 20."""
    ids, h, scores, info = tree_build.select_top_k_tokens_first(torch.tensor([[.6, .3]]), torch.tensor([[10, 11]]),
                                                               None, 2)
    S_, T_, P_ = [info[0]], [info[1]], [info[2]]
    p1, i1 = torch.tensor([[.5, .4], [.9, .05]]), torch.tensor([[20, 21], [22, 23]])
    ids, h, scores, info = tree_build.select_top_k_tokens_later(1, p1, i1, None, scores, 2)
    assert ids.tolist() == [20, 22]
    S_.append(info[0]), T_.append(info[1]), P_.append(info[2])
    p2, i2 = torch.tensor([[.7, .2], [.6, .3]]), torch.tensor([[30, 31], [32, 33]])
    ids, _h, scores, info = tree_build.select_top_k_tokens_later(2, p2, i2, None, scores, 2)
    S_.append(info[0]), T_.append(info[1]), P_.append(info[2])
    parent_list, top, toks = tree_build.organize_draft_results(S_, T_, P_, 7)
    assert top.tolist() == [[0, 1, 2, 3, 4, 6]] and toks.tolist() == [[10, 11, 20, 21, 22, 30]]
    assert parent_list.tolist() == [[-1, 0, 1, 2, 4]]
    t = tree_build.build_tree(torch.tensor([99]), parent_list, top, toks, torch.tensor([5]), 2, 7)
    assert t["parents"] == [[-1, 0, 0, 1, 1, 2, 3]]
    assert t["positions"].tolist() == [5, 6, 6, 7, 7, 7, 8]
    assert t["retrive_next_token"].tolist() == [[1, 3, 5, 6, -1, -1, -1]]
    assert t["retrive_next_sibling"].tolist() == [[-1, 2, -1, 4, -1, -1, -1]]
    tree_rows = t["custom_mask"].view(7, 12)[:, 5:].int().tolist()
    assert tree_rows == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 0, 1, 0, 0], [1, 0, 1, 0, 0, 1, 0], [1, 1, 0, 1, 0, 0, 1]]
    assert bool(t["custom_mask"].view(7, 12)[:, :5].all())
    # acceptance: target says root -> 11, 11 -> 22, 22 -> 7: path [0, 2, 5], n = 2, bonus 7
    target = torch.tensor([11, 0, 22, 0, 0, 7, 0])
    pred, acc, n = tree_build.verify_tree_greedy(t["draft_tokens"].view(1, 7), t["retrive_index"],
                                                 t["retrive_next_token"], t["retrive_next_sibling"], target, 4)
    assert acc.tolist() == [[0, 2, 5, -1]] and n.tolist() == [2] and pred[acc[0, :3]].tolist() == [11, 22, 7]


@pytest.mark.spec("TR-002")
def test_tree_engine_refuses_bad_arguments(model):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        TreeEngine(model, make_draft("eagle", model), topk=2, num_draft_tokens=8, num_steps=2)  # 1 + 2 + 4 = 7
    with pytest.raises(ValueError, match="'v1' or 'v2'"):
        TreeEngine(model, make_draft("eagle", model), topk=2, num_draft_tokens=4, version="v3")


@pytest.mark.spec("TR-019", "TR-020")
def test_demo_matrix_topk_rows(model):
    """``demo --topk``'s matrix on the tiny model: per version an oracle tree row and a production
    tree row per page size, all lossless, production == oracle (same version), pages all freed."""
    from refspec.cli.demo import run_matrix

    res = run_matrix(model, PROMPTS, BUDGETS, page_sizes=(1, 16), versions=("v1", "v2"), draft="eagle",
                     num_steps=3, topk=2, num_draft_tokens=4)
    tree = [r for r in res.rows if "tree" in r.path]
    assert [(r.path, r.page_size, r.version.split()[0]) for r in tree] == [
        (path, P, v) for v in ("v1", "v2") for path, P in (("oracle tree", None), ("production tree", 1),
                                                          ("production tree", 16))]
    assert all(r.spec_eq_greedy for r in tree) and all(r.prod_eq_oracle for r in tree if r.page_size) and res.ok


@pytest.mark.spec("TR-016", "TR-001", "TR-002", "TR-003", "TR-004", "TR-005", "TR-006")
@pytest.mark.parametrize("seed", range(12))
def test_production_tree_equals_the_oracle_tree_rule(seed):
    """Random draft outputs (k = 3, S = 4, N = 12, L = 9): the production port (SGLang's layout)
    and the oracle's plain tree agree on nodes, parents, positions, the mask and the acceptance."""
    from refspec.oracle import tree as otree

    g = torch.Generator().manual_seed(seed)
    k, S, N, L, V = 3, 4, 12, 9, 50
    probs = lambda n: torch.softmax(torch.randn(n, V, generator=g) * 3, -1)
    p0, i0 = torch.topk(probs(1), k)
    cands, front = otree.root_children(p0[0], i0[0])
    ids, _, scores, info = tree_build.select_top_k_tokens_first(p0, i0, None, k)
    lists = [[info[0]], [info[1]], [info[2]]]
    for step in range(1, S):
        cp, ci = torch.topk(probs(k), k)
        front = otree.expand(cands, front, step, cp, ci)
        ids, _, scores, info = tree_build.select_top_k_tokens_later(step, cp, ci, None, scores, k)
        assert ids.tolist() == front.tokens.tolist()
        for lst, x in zip(lists, info):
            lst.append(x)
    ref = otree.build_tree(7, cands, otree.select(cands, N), L)
    parent_list, top, toks = tree_build.organize_draft_results(*lists, N)
    t = tree_build.build_tree(torch.tensor([7]), parent_list, top, toks, torch.tensor([L]), k, N)
    assert t["draft_tokens"].tolist() == ref.tokens
    assert t["parents"][0] == ref.parent and t["positions"].tolist() == ref.positions
    assert torch.equal(t["custom_mask"].view(N, L + N)[:, L:], ref.mask)
    assert t["retrive_next_token"][0].tolist() == ref.retrieve_next_token
    assert t["retrive_next_sibling"][0].tolist() == ref.retrieve_next_sibling
    target = torch.tensor([ref.tokens[c[0]] if c else 3 for c in ref.children])  # accept the first child
    acc = otree.greedy_accept(ref, target.tolist())
    pred, ai, n = tree_build.verify_tree_greedy(t["draft_tokens"].view(1, N), t["retrive_index"],
                                                t["retrive_next_token"], t["retrive_next_sibling"], target, S + 1)
    assert ai[0, :acc.a].tolist() == acc.path and int(n) == acc.n and pred[ai[0, :acc.a]].tolist() == acc.emitted
