"""The EAGLE top-k tree rule (``refspec.oracle.tree``) on hand-worked numbers (docs/spec/tree.md).

The worked example (k = 2, Sd = 3, N = 7, L = 5), derived by hand:

* root children: 10 (p .6) and 11 (p .3) -> candidates 0, 1 with scores .6, .3;
* step 1: row 0 (token 10) proposes 20 (.5), 21 (.4); row 1 (token 11) proposes 22 (.9), 23 (.05)
  -> candidates 2..5 with scores .6*.5 = .3, .6*.4 = .24, .3*.9 = .27, .3*.05 = .015; the new
  frontier is the best two: candidate 2 (token 20, .3) then candidate 4 (token 22, .27);
* step 2: row 0 (token 20) proposes 30 (.7), 31 (.2); row 1 (token 22) proposes 32 (.6), 33 (.3)
  -> candidates 6..9 with scores .21, .06, .162, .081;
* all ten scores ``[.6 .3 | .3 .24 .27 .015 | .21 .06 .162 .081]``; the best N-1 = 6 are the
  candidates {0, 1, 2, 4, 3, 6}, sorted: [0, 1, 2, 3, 4, 6];
* nodes: 0 root, 1 = cand 0 (10), 2 = cand 1 (11), 3 = cand 2 (20, child of 10), 4 = cand 3 (21,
  child of 10), 5 = cand 4 (22, child of 11), 6 = cand 6 (30, child of 20);
* parents [-1, 0, 0, 1, 1, 2, 3], depths [0, 1, 1, 2, 2, 2, 3], positions 5 + depth.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.oracle.tree import (
    build_tree,
    expand,
    greedy_accept,
    max_drafts,
    root_children,
    select,
    verify_key_slots,
)
from refspec.core.args import tree_args

ROOT = 99  # the last verified token (the bonus of the previous round)


def worked_example():
    t = torch.tensor
    cands, front = root_children(t([0.6, 0.3]), t([10, 11]))
    front1 = expand(cands, front, 1, t([[0.5, 0.4], [0.9, 0.05]]), t([[20, 21], [22, 23]]))
    front2 = expand(cands, front1, 2, t([[0.7, 0.2], [0.6, 0.3]]), t([[30, 31], [32, 33]]))
    return cands, front1, front2


@pytest.mark.spec("TR-001")
def test_expansion_scores_parents_and_frontier():
    cands, front1, front2 = worked_example()
    torch.testing.assert_close(cands.scores, torch.tensor([.6, .3, .3, .24, .27, .015, .21, .06, .162, .081]))
    assert cands.tokens.tolist() == [10, 11, 20, 21, 22, 23, 30, 31, 32, 33]
    # candidate -> parent candidate: step 1 children of rows (0, 1) = cands (0, 1); step 2 of (2, 4)
    assert cands.parent == [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
    assert front1.cand == [2, 4] and front1.tokens.tolist() == [20, 22] and front1.parent_row == [0, 1]
    assert front2.cand == [6, 8] and front2.tokens.tolist() == [30, 32] and front2.parent_row == [0, 1]
    assert cands.scores.numel() == max_drafts(2, 3) == 2 + 2 * 4


@pytest.mark.spec("TR-001")
def test_hidden_follows_the_parent_row_when_one_row_wins_both_slots():
    """Row 0's children .9*.6 and .9*.3 beat row 1's (.1 * ...): both new rows take row 0's hidden."""
    t = torch.tensor
    cands, front = root_children(t([0.9, 0.1]), t([1, 2]))
    nxt = expand(cands, front, 1, t([[0.6, 0.3], [0.5, 0.5]]), t([[3, 4], [5, 6]]))
    assert nxt.parent_row == [0, 0] and nxt.cand == [2, 3] and nxt.tokens.tolist() == [3, 4]
    torch.testing.assert_close(nxt.scores, t([0.54, 0.27]))


@pytest.mark.spec("TR-001")
def test_expansion_rejects_bad_shapes():
    cands, front = root_children(torch.tensor([0.6, 0.3]), torch.tensor([10, 11]))
    with pytest.raises(InvariantError, match=r"\[TR-001\]"):
        expand(cands, front, 1, torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(InvariantError, match=r"\[TR-001\]"):
        root_children(torch.tensor([0.6, 0.3]), torch.tensor([10]))


@pytest.mark.spec("TR-002")
def test_selection_is_topk_then_sorted_by_candidate_id():
    cands, _, _ = worked_example()
    assert select(cands, 7) == [0, 1, 2, 3, 4, 6]
    assert select(cands, 4) == [0, 1, 2]  # .6, .3, .3 (the two .3 are both in)
    assert select(cands, 11) == list(range(10))  # every candidate
    for N in (1, 12):
        with pytest.raises(InvariantError, match=r"\[TR-002\]"):
            select(cands, N)


@pytest.mark.spec("TR-002")
def test_num_draft_tokens_bound_is_a_value_error():
    tree_args(4, 3, 1 + 4 + 2 * 16)  # N - 1 = 36 = k + (Sd-1) k^2: allowed
    with pytest.raises(ValueError, match=r"TR-002.*36"):
        tree_args(4, 3, 38)
    with pytest.raises(ValueError, match="topk"):
        tree_args(0, 3, 4)


@pytest.mark.spec("TR-003", "TR-005")
def test_worked_example_tree():
    cands, _, _ = worked_example()
    tree = build_tree(ROOT, cands, select(cands, 7), seq_len=5)
    assert tree.tokens == [ROOT, 10, 11, 20, 21, 22, 30]
    assert tree.parent == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depth == [0, 1, 1, 2, 2, 2, 3]
    assert tree.positions == [5, 6, 6, 7, 7, 7, 8]
    assert tree.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert tree.retrieve_next_token == [1, 3, 5, 6, -1, -1, -1]
    assert tree.retrieve_next_sibling == [-1, 2, -1, 4, -1, -1, -1]


@pytest.mark.spec("TR-004")
def test_worked_example_mask_and_verify_keys():
    cands, _, _ = worked_example()
    tree = build_tree(ROOT, cands, select(cands, 7), seq_len=5)
    rows = ["1000000", "1100000", "1010000", "1101000", "1100100", "1010010", "1101001"]
    assert ["".join(str(int(x)) for x in r) for r in tree.mask.tolist()] == rows
    keys = verify_key_slots(tree, prefix_slots=[0, 1, 2, 3, 4], node_slots=[5, 6, 7, 8, 9, 10, 11])
    assert keys[6] == [0, 1, 2, 3, 4, 5, 6, 8, 11]  # prefix, root, 10, 20, itself (30)
    assert keys[4] == [0, 1, 2, 3, 4, 5, 6, 9]  # 21 sees root and 10, not its sibling 20
    with pytest.raises(InvariantError, match=r"\[TR-004\]"):
        verify_key_slots(tree, [0], [5, 6])


@pytest.mark.spec("TR-004", "TR-005")
@pytest.mark.parametrize("seed", range(6))
def test_random_trees_mask_is_exactly_the_ancestor_relation(seed):
    """Random scores, k = 3, Sd = 4: mask row i = {i} + the parent chain, so no sibling or cousin
    is ever visible; row sums are depth + 1; positions are L + depth."""
    g = torch.Generator().manual_seed(seed)
    k, Sd, N, L = 3, 4, 12, 7
    cands, front = root_children(torch.sort(torch.rand(k, generator=g), descending=True).values, torch.arange(k))
    for s in range(1, Sd):
        p = torch.sort(torch.softmax(torch.randn(k, 16, generator=g), -1), descending=True).values[:, :k]
        front = expand(cands, front, s, p, torch.randint(0, 100, (k, k), generator=g))
    tree = build_tree(ROOT, cands, select(cands, N), L)
    for i in range(N):
        chain, j = {i}, i
        while tree.parent[j] != -1:
            j = tree.parent[j]
            chain.add(j)
        assert {j for j in range(N) if tree.mask[i, j]} == chain | {0}
        assert int(tree.mask[i].sum()) == tree.depth[i] + 1 and tree.positions[i] == L + tree.depth[i]
        for c in tree.children[i]:
            assert tree.parent[c] == i and tree.depth[c] == tree.depth[i] + 1
    for ch in tree.children:
        assert ch == sorted(ch)
        for a in ch:
            assert not any(tree.mask[a, b] for b in ch if b != a)  # siblings never see each other


@pytest.mark.spec("TR-003", "TR-004")
def test_orphan_on_a_score_tie_is_unlinked_and_sees_only_root_and_itself():
    """Root child 10 has p = 1.0, so its child 20 ties it at 1.0; if 20 is selected without 10
    (here passed by hand), it has no parent link, depth 1, and can never be accepted."""
    t = torch.tensor
    cands, front = root_children(t([1.0, 0.0]), t([10, 11]))
    expand(cands, front, 1, t([[1.0, 0.0], [1.0, 0.0]]), t([[20, 21], [22, 23]]))
    tree = build_tree(ROOT, cands, [2], seq_len=3)
    assert tree.parent == [-1, -1] and tree.depth == [0, 1] and tree.positions == [3, 4]
    assert tree.children == [[], []] and tree.mask.tolist() == [[True, False], [True, True]]
    assert greedy_accept(tree, [20, 5]).n == 0  # 20 equals the target argmax but is unreachable
    with pytest.raises(InvariantError, match=r"\[TR-003\]"):
        build_tree(ROOT, cands, [3, 2], seq_len=3)


@pytest.mark.spec("TR-006")
@pytest.mark.parametrize("predict,path,emitted", [
    ([10, 21, 0, 0, 99, 0, 0], [0, 1, 4], [10, 21, 99]),  # 10, then 21 (the second child of 10)
    ([10, 20, 0, 30, 0, 0, 7], [0, 1, 3, 6], [10, 20, 30, 7]),  # the deepest path, bonus at 30
    ([11, 0, 22, 0, 0, 5, 0], [0, 2, 5], [11, 22, 5]),
    ([12, 0, 0, 0, 0, 0, 0], [0], [12]),  # no root child matches: n = 0, only the bonus
    ([10, 22, 0, 0, 0, 0, 0], [0, 1], [10, 22]),  # 22 is a child of 11, not of 10: rejected
])
def test_greedy_tree_acceptance(predict, path, emitted):
    cands, _, _ = worked_example()
    tree = build_tree(ROOT, cands, select(cands, 7), seq_len=5)
    acc = greedy_accept(tree, predict)
    assert acc.path == path and acc.emitted == emitted
    assert acc.n == len(path) - 1 and acc.a == len(emitted) and acc.bonus == emitted[-1]
    with pytest.raises(InvariantError, match=r"\[TR-006\]"):
        greedy_accept(tree, predict[:-1])


@pytest.mark.spec("TR-003", "TR-006")
def test_topk_1_is_the_chain():
    """k = 1: one candidate per step, all selected; the tree is the chain and acceptance is SD-001."""
    t = torch.tensor
    cands, front = root_children(t([0.8]), t([7]))
    for s, (p, tok) in enumerate([(0.5, 3), (0.9, 9)], start=1):
        front = expand(cands, front, s, t([[p]]), t([[tok]]))
    tree = build_tree(ROOT, cands, select(cands, 4), seq_len=10)
    assert tree.tokens == [ROOT, 7, 3, 9] and tree.parent == [-1, 0, 1, 2]
    assert tree.mask.tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()
    assert greedy_accept(tree, [7, 3, 5, 2]).emitted == [7, 3, 5]  # SD-001's example: n = 2


@pytest.mark.spec("TR-006")
@pytest.mark.parametrize("seed", range(8))
def test_acceptance_is_the_deepest_node_whose_whole_path_matches(seed):
    """Brute force: node j is acceptable iff every node on its path equals the target argmax at its
    parent; siblings hold distinct tokens (one row's top-k), so the walk ends at the deepest one."""
    g = torch.Generator().manual_seed(100 + seed)
    k, Sd, N, V = 3, 4, 14, 6  # a small vocabulary: matches are frequent
    cands, front = root_children(torch.tensor([0.5, 0.3, 0.2]), torch.randperm(V, generator=g)[:k])
    for s in range(1, Sd):
        p = torch.sort(torch.rand(k, k, generator=g), descending=True).values
        toks = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(k)])
        front = expand(cands, front, s, p, toks)
    tree = build_tree(ROOT, cands, select(cands, N), seq_len=4)
    for trial in range(20):
        predict = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(trial)).tolist()
        ok = [False] * N
        ok[0] = True
        for j in range(1, N):  # parents come first in node order
            p = tree.parent[j]
            ok[j] = p != -1 and ok[p] and tree.tokens[j] == predict[p]
        deepest = max((j for j in range(N) if ok[j]), key=lambda j: tree.depth[j])
        acc = greedy_accept(tree, predict)
        assert acc.path[-1] == deepest and acc.n == tree.depth[deepest]
        assert acc.bonus == predict[deepest]
