"""The device tree builder and greedy tree acceptance equal the host ports bitwise (TR-016).

``refspec.speculative.tree.device`` is the production twin of ``build_tree`` /
``verify_tree_greedy`` in ``refspec.speculative.tree.build``: the trees here come from the
real expansion (``select_top_k_tokens_first`` / ``_later``, ``organize_draft_results``) over
random draft probabilities, quantized so that score ties (and so orphans, TR-003) happen.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refspec.speculative.tree.build import (
    build_tree,
    organize_draft_results,
    select_top_k_tokens_first,
    select_top_k_tokens_later,
    verify_tree_greedy,
)
from refspec.speculative.tree.device import (
    build_tree_device,
    child_lists,
    full_mask,
    verify_tree_greedy_device,
)

V = 50


def random_draft(B, k, S, seed, levels):
    """score_list / token_list / parents_list of a random S-step expansion over B requests;
    probabilities take one of ``levels`` values per row (fewer levels, more ties); ``levels = 0``:
    one-hot rows ``[1, 0, ..]``, so a child ties its parent's cumulative score (orphans, TR-003)."""
    g = torch.Generator().manual_seed(seed)

    def probs(rows):
        if levels == 0:
            return torch.eye(k)[0].repeat(rows, 1)
        q = torch.randint(1, levels + 1, (rows, k), generator=g).float()
        return torch.sort(q / q.sum(-1, keepdim=True) if levels > 1 else q / k, dim=-1, descending=True).values

    def toks(rows):
        return torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(rows)])

    _, _, scores, info = select_top_k_tokens_first(probs(B), toks(B), None, k)
    sl, tl, pl = [info[0]], [info[1]], [info[2]]
    for s in range(1, S):
        _, _, scores, info = select_top_k_tokens_later(s, probs(B * k), toks(B * k), None, scores, k)
        sl.append(info[0])
        tl.append(info[1])
        pl.append(info[2])
    return sl, tl, pl


def both_trees(B, k, S, N, Ls, seed, levels):
    sl, tl, pl = random_draft(B, k, S, seed, levels)
    parent_list, top, draft_tokens = organize_draft_results(sl, tl, pl, N)
    roots = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(seed + 1))
    L = torch.tensor(Ls)
    host = build_tree(roots, parent_list, top, draft_tokens, L, k, N)
    numel = sum(Ls) * N + B * N * N
    dev = build_tree_device(roots, parent_list, top, draft_tokens, L, k, N, numel)
    return host, dev


def assert_same_tree(host, dev):
    for f in ("draft_tokens", "positions", "custom_mask", "retrive_index", "retrive_next_token",
              "retrive_next_sibling"):
        assert host[f].dtype == dev[f].dtype and torch.equal(host[f], dev[f]), f
    assert dev["parents"].tolist() == host["parents"]


def target_along(host, N, seed, hit):
    """A target_predict [B*N] that follows a random path with probability ``hit`` per step."""
    rnd = random.Random(seed)
    tok = host["draft_tokens"].view(-1, N).tolist()
    tp = [rnd.randrange(V) for _ in range(len(tok) * N)]
    for b, par in enumerate(host["parents"]):
        for i in range(N):
            kids = [c for c in range(1, N) if par[c] == i]
            if kids and rnd.random() < hit:
                tp[b * N + i] = tok[b][rnd.choice(kids)]
    return torch.tensor(tp)


def assert_same_accept(host, N, S, tp):
    B = host["retrive_index"].shape[0]
    args = (host["draft_tokens"].view(B, N), host["retrive_index"], host["retrive_next_token"],
            host["retrive_next_sibling"], tp, S + 1)
    for h, d in zip(verify_tree_greedy(*args), verify_tree_greedy_device(*args)):
        assert h.dtype == d.dtype and torch.equal(h, d)


CASES = [(1, 2, 1, 2), (1, 2, 3, 5), (3, 2, 3, 6), (2, 3, 2, 7), (4, 4, 3, 16), (2, 2, 5, 9), (3, 3, 4, 20),
         (2, 4, 2, 21), (5, 2, 6, 12)]  # (B, k, S, N); N - 1 <= k + (S-1) k^2


@pytest.mark.spec("TR-016", "TR-003", "TR-004", "TR-005")
@pytest.mark.parametrize("B,k,S,N", CASES)
@pytest.mark.parametrize("levels", [0, 1, 2, 5, 1000])
def test_device_build_tree_equals_the_port(B, k, S, N, levels):
    for seed in range(12):
        Ls = [random.Random(seed * 7 + b).randrange(1, 40) for b in range(B)]
        host, dev = both_trees(B, k, S, N, Ls, seed, levels)
        assert_same_tree(host, dev)


@pytest.mark.spec("TR-016", "TR-003")
def test_the_random_trees_include_orphans():
    """The one-hot draws above do strand children (a parent -1 past node 0), so the orphan rule
    is compared, not only well-formed trees."""
    orphans = 0
    for B, k, S, N in CASES:
        for seed in range(12):
            host, dev = both_trees(B, k, S, N, [5] * B, seed, 0)
            assert_same_tree(host, dev)
            orphans += sum(p < 0 for par in host["parents"] for p in par[1:])
    assert orphans > 0


@pytest.mark.spec("TR-016", "TR-006")
@pytest.mark.parametrize("B,k,S,N", CASES)
@pytest.mark.parametrize("hit", [0.0, 0.6, 1.0])
def test_device_greedy_accept_equals_the_port(B, k, S, N, hit):
    for seed in range(12):
        Ls = [3 + b for b in range(B)]
        host, _ = both_trees(B, k, S, N, Ls, seed, (0, 2, 1000)[seed % 3])
        assert_same_accept(host, N, S, target_along(host, N, seed, hit))


@pytest.mark.spec("TR-016", "TR-003")
@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), k=st.integers(2, 4), S=st.integers(1, 5), frac=st.floats(0, 1),
       levels=st.sampled_from([0, 1, 2, 3, 100]), seed=st.integers(0, 10_000),
       Ls=st.lists(st.integers(1, 64), min_size=4, max_size=4))
def test_device_tree_and_accept_equal_the_ports_on_random_trees(B, k, S, frac, levels, seed, Ls):
    C = k + (S - 1) * k * k
    N = 2 + int(frac * (C - 1))
    host, dev = both_trees(B, k, S, N, Ls[:B], seed, levels)
    assert_same_tree(host, dev)
    assert_same_accept(host, N, S, target_along(host, N, seed, 0.7))


@pytest.mark.spec("TR-006")
def test_device_accept_follows_the_list_order_not_the_node_order():
    """Children listed 2 before 1 (next_token[0] = 2, next_sibling[2] = 1) with equal tokens:
    the walk takes the first in the list, as VerifyTreeGreedy does."""
    cand = torch.tensor([[9, 5, 5]])
    ridx = torch.arange(3)[None]
    nxt, sib = torch.tensor([[2, -1, -1]]), torch.tensor([[-1, -1, 1]])
    tp = torch.tensor([5, 7, 8])
    pred, acc, n = verify_tree_greedy_device(cand, ridx, nxt, sib, tp, 3)
    assert acc.tolist() == [[0, 2, -1]] and n.tolist() == [1] and pred.tolist() == [5, 0, 8]
    assert [t.tolist() for t in verify_tree_greedy(cand, ridx, nxt, sib, tp, 3)] == [[5, 0, 8], [[0, 2, -1]], [1]]


@pytest.mark.spec("TR-003")
def test_child_lists_skip_orphans():
    nxt, sib = child_lists(torch.tensor([[-1, 0, -1, 1, 0, 1]]))
    assert nxt.tolist() == [[1, 3, -1, -1, -1, -1]] and sib.tolist() == [[-1, 4, -1, 5, -1, -1]]


@pytest.mark.spec("TR-004")
def test_full_mask_with_a_larger_buffer_keeps_the_blocks_and_a_true_tail():
    host, dev = both_trees(3, 2, 3, 6, [4, 9, 2], 5, 3)
    n = host["custom_mask"].numel()
    big = full_mask(dev["tree_mask"].view(3, 6, 6), torch.tensor([4, 9, 2]), n + 40)
    assert torch.equal(big[:n], host["custom_mask"]) and bool(big[n:].all())


@pytest.mark.spec("TR-016")
def test_device_twins_read_no_tensor_value():
    """No ``tolist`` / ``item`` / ``int()`` / ``bool()`` of any tensor inside the twins (on a GPU
    each would be a sync, and would break a CUDA-graph capture)."""
    from refspec.audits.sync import host_reads

    sl, tl, pl = random_draft(3, 3, 4, 0, 0)
    organized = organize_draft_results(sl, tl, pl, 12)
    roots, L = torch.tensor([4, 5, 6]), torch.tensor([7, 30, 2])
    with host_reads() as reads:
        dev = build_tree_device(roots, *organized, L, 3, 12, 64 * 12 + 3 * 144)
        verify_tree_greedy_device(dev["draft_tokens"].view(3, 12), dev["retrive_index"], dev["retrive_next_token"],
                                  dev["retrive_next_sibling"], torch.zeros(36, dtype=torch.long), 5)
    assert not reads, f"value reads: {dict(reads)}"


@pytest.mark.spec("TR-015", "TR-013")
@pytest.mark.parametrize("P", (1, 2, 4, 16, 64))
@pytest.mark.parametrize("k,S", ((2, 1), (2, 3), (4, 5), (3, 2)))
def test_device_branch_slots_and_tail_copies_equal_the_host_rule(P, k, S):
    """The rounds' device forms (lengths on the device) give the host rule's branch slots, and
    the host rule's tail-copy pairs plus only slot 0 -> 0 no-ops, for L on and off page edges."""
    from refspec.harness.tree_scenario import make_cache
    from refspec.speculative.tree import kv as tree_kv

    Ls = [1, P, P + 1, 3 * P - 1, 37]
    width = max(tree_kv.draft_alloc_len(L, k, S, P) for L in Ls)
    kv, _ = make_cache(P, len(Ls), width, seed=P + k)
    rows = [kv.alloc_req() for _ in Ls]
    kv.alloc_extend(rows, [0] * len(Ls), [tree_kv.draft_alloc_len(L, k, S, P) for L in Ls])
    rows_dev, L_dev = torch.tensor(rows), torch.tensor(Ls)
    assert torch.equal(tree_kv.assign_draft_cache_locs_device(kv, rows_dev, L_dev, k, S),
                       tree_kv.assign_draft_cache_locs(kv, rows, Ls, k, S))
    for b, L in enumerate(Ls):
        assert torch.equal(tree_kv.branch_step_positions_device(L_dev, k, S, P)[b],
                           tree_kv.branch_step_positions(L, k, S, P))
    src, tgt = tree_kv.tail_copy_slots(kv, rows, Ls, k, S)
    dsrc, dtgt = tree_kv.tail_copy_slots(kv, rows_dev, L_dev, k, S)
    real = (dsrc != 0) | (dtgt != 0)
    assert sorted(zip(dtgt[real].tolist(), dsrc[real].tolist())) == sorted(zip(tgt.tolist(), src.tolist()))
    assert dsrc.numel() == (0 if P == 1 else len(Ls) * (k - 1) * (P - 1))
