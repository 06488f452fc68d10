"""The EAGLE top-k tree, written plainly: expansion, selection, the tree, its mask, acceptance.

Symbols: k = ``topk``, Sd = ``num_steps`` (``speculative_num_steps``), N = ``num_draft_tokens``
(tree nodes, root included), L = committed length (tokens).  One request.  This is the rule of
SGLang's EAGLE worker (v1), re-derived from the code, not a port of its kernels:

1. **Expansion** (TR-001, ``spec_utils.select_top_k_tokens``).  Step 0: the k root children are
   the top-k of the draft-extend's last row (``topk_p``, ``topk_index``, probabilities of the
   draft softmax); they form the first frontier.  Step i >= 1: each of the k frontier rows r
   proposes its top-k children; child (r, c) scores ``score[r] * p[r, c]`` (a cumulative product
   of probabilities); the new frontier is the top-k of those k*k; each new frontier row takes the
   hidden state of its parent row.  Candidate ids: step 0 children are ``0 .. k-1``; child (r, c)
   of step i is ``k + k*k*(i-1) + r*k + c``.  In total ``k + (Sd-1) k^2`` candidates.
2. **Selection** (TR-002, ``eagle_utils.organize_draft_results``): the N-1 drafts are
   ``torch.topk`` over all candidate scores, then sorted ascending by candidate id.
3. **The tree** (TR-003, ``build_tree_kernel_efficient``): node 0 is the root (the last
   verified token, the bonus of the previous round), node i >= 1 is the i-th selected
   candidate.  Its parent is the root for a step-0 candidate, else the node holding its parent
   candidate; children are listed in ascending node order (``retrieve_next_token`` = first
   child, ``retrieve_next_sibling`` = next one, -1 = none).
4. **Mask and positions** (TR-004, TR-005): node i sees itself and its ancestors (the root
   included) and nothing else of the tree; it runs at RoPE position ``L + depth(i)``.
5. **Greedy acceptance** (TR-006, ``verify_tree_greedy``): from the root, take the child (in
   ascending node order) whose token equals the target's argmax at the current node, until none
   does; n accepted drafts, ``a = n + 1`` with the bonus (the argmax at the last accepted node).

Upstream (sgl-project/sglang, at the commits read):

* https://github.com/sgl-project/sglang/blob/00731f0bc9fa81c39802754fb4b62e9cce967582/python/sglang/srt/speculative/spec_utils.py
  ``_select_top_k_tokens_first``, ``_select_top_k_tokens_later`` (TR-001);
* https://github.com/sgl-project/sglang/blob/003ddbce039cd49b05c84568b7b357031366abf7/python/sglang/srt/speculative/eagle_utils.py
  ``organize_draft_results`` (TR-002), ``build_tree_kernel_efficient``, ``verify_tree_greedy_func``;
* https://github.com/sgl-project/sglang/blob/901307a06bace589e49447e759c4a7e97acf8ea3/python/sglang/kernels/ops/speculative/spec_tree.py
  ``sgl_build_tree_kernel_efficient_triton`` (TR-003..TR-005), ``verify_tree_greedy_kernel_triton`` (TR-006).

A selected candidate whose parent candidate was not selected (possible only on a score tie,
e.g. a child with probability 1.0) is an *orphan*, as in the upstream kernel: no parent link
(it can never be accepted), mask = root + itself, depth 1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from refspec.core.invariants import require


@dataclass
class Candidates:
    """All draft candidates of one round, in SGLang's candidate-id order.

    ``scores [C]`` fp32 cumulative products, ``tokens [C]`` int64, ``parent[c]`` the candidate
    id of c's parent (-1 = the root), C = k + (Sd-1) k^2 after Sd steps.
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parent: list[int]


@dataclass
class Frontier:
    """The k rows that run the next draft step: cumulative ``scores [k]``, ``cand[t]`` the
    candidate id row t holds, ``tokens [k]`` its token, ``parent_row[t]`` the previous step's
    row whose hidden state row t takes (``arange(k)`` at step 0: all share the root's)."""

    scores: torch.Tensor
    cand: list[int]
    tokens: torch.Tensor
    parent_row: list[int]


def root_children(topk_p: torch.Tensor, topk_index: torch.Tensor) -> tuple[Candidates, Frontier]:
    """Step 0 (TR-001): ``topk_p, topk_index [k]`` of the draft-extend's last row -> candidates
    ``0 .. k-1`` (parent: root) and the first frontier (row t = candidate t).
    Raises: InvariantError TR-001 unless both are 1-D of the same length k >= 1."""
    require(topk_p.dim() == 1 and topk_p.shape == topk_index.shape and topk_p.numel() >= 1, "TR-001",
            f"topk_p {tuple(topk_p.shape)} and topk_index {tuple(topk_index.shape)} must both be [k], k >= 1")
    k = topk_p.numel()
    cands = Candidates(topk_p.float().clone(), topk_index.long().clone(), [-1] * k)
    return cands, Frontier(cands.scores.clone(), list(range(k)), cands.tokens.clone(), list(range(k)))


def expand(cands: Candidates, front: Frontier, step: int, child_p: torch.Tensor,
           child_index: torch.Tensor) -> Frontier:
    """Step ``step`` >= 1 (TR-001): frontier row r proposes ``child_p[r], child_index[r]`` ([k, k],
    its draft softmax top-k); appends the k^2 children (ids ``k + k^2 (step-1) + r k + c``,
    score ``front.scores[r] * child_p[r, c]``) to ``cands`` in place and returns the new
    frontier: the top-k of the k^2 (``torch.topk``), each row remembering its parent row.
    Raises: InvariantError TR-001 on shapes other than [k, k]."""
    k = len(front.cand)
    require(step >= 1 and child_p.shape == (k, k) and child_index.shape == (k, k), "TR-001",
            f"step {step} needs child_p / child_index [k, k] = [{k}, {k}], got "
            f"{tuple(child_p.shape)} / {tuple(child_index.shape)}")
    base = k + k * k * (step - 1)
    require(cands.scores.numel() == base, "TR-001",
            f"step {step} expects {base} earlier candidates, got {cands.scores.numel()}")
    scores = (front.scores[:, None] * child_p.float()).flatten()  # [k*k], id base + r*k + c
    tokens = child_index.long().flatten()
    cands.scores = torch.cat([cands.scores, scores])
    cands.tokens = torch.cat([cands.tokens, tokens])
    cands.parent += [front.cand[j // k] for j in range(k * k)]
    best = torch.topk(scores, k).indices.tolist()  # the new frontier, best first
    return Frontier(scores[best], [base + j for j in best], tokens[best], [j // k for j in best])


def max_drafts(topk: int, num_steps: int) -> int:
    """How many candidates Sd steps produce: ``k + (Sd - 1) k^2`` (the bound on N - 1)."""
    return topk + (num_steps - 1) * topk * topk


def select(cands: Candidates, num_draft_tokens: int) -> list[int]:
    """TR-002: the N-1 draft candidate ids, ``torch.topk`` of the scores, sorted ascending.
    Raises: InvariantError TR-002 unless ``1 <= N - 1 <= len(scores)``."""
    C = cands.scores.numel()
    require(1 <= num_draft_tokens - 1 <= C, "TR-002",
            f"num_draft_tokens N = {num_draft_tokens}: need 1 <= N - 1 <= k + (Sd-1) k^2 = {C}")
    return sorted(torch.topk(cands.scores, num_draft_tokens - 1).indices.tolist())


@dataclass
class Tree:
    """The verify tree of one request (node 0 = root).  Lists have N entries.

    ``tokens``: node tokens (``[root, drafts...]``); ``cand``: candidate id (-1 for the root);
    ``parent``: parent node (-1 for the root and orphans); ``depth`` (root 0, orphan 1);
    ``positions``: ``L + depth`` (tokens); ``mask [N, N]`` bool, ``mask[i, j]`` = node i sees
    node j; ``children[i]`` ascending; ``retrieve_next_token`` / ``retrieve_next_sibling``: the
    same links in SGLang's linked-list form (-1 = none).
    """

    tokens: list[int]
    cand: list[int]
    parent: list[int]
    depth: list[int]
    positions: list[int]
    mask: torch.Tensor
    children: list[list[int]]
    retrieve_next_token: list[int]
    retrieve_next_sibling: list[int]

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def ancestors(self, i: int) -> list[int]:
        """Node i's ancestors, nearest first, ending at the root (empty for the root)."""
        if i == 0:
            return []
        out = []
        while self.parent[i] != -1:
            i = self.parent[i]
            out.append(i)
        return out if out and out[-1] == 0 else out + [0]  # an orphan still sees the root


def build_tree(root_token: int, cands: Candidates, selected: list[int], seq_len: int) -> Tree:
    """TR-003 / TR-004 / TR-005: the tree over ``[root_token] + tokens[selected]``.

    Args: ``selected``: ascending distinct candidate ids (from :func:`select`); ``seq_len``: L.
    Raises: InvariantError TR-003 if ``selected`` is not ascending, distinct and in range.
    """
    C = cands.scores.numel()
    require(all(0 <= c < C for c in selected) and all(a < b for a, b in itertools.pairwise(selected)),
            "TR-003", f"selected candidates {selected} must be ascending, distinct, in [0, {C})")
    N = len(selected) + 1
    node_of = {c: i + 1 for i, c in enumerate(selected)}
    cand = [-1] + list(selected)
    tokens = [int(root_token)] + [int(cands.tokens[c]) for c in selected]
    parent, depth = [-1] * N, [0] * N
    for i in range(1, N):  # ascending: a parent candidate id is smaller than its child's
        pc = cands.parent[cand[i]]
        if pc == -1:
            parent[i], depth[i] = 0, 1
        elif pc in node_of:
            parent[i], depth[i] = node_of[pc], depth[node_of[pc]] + 1
        else:
            parent[i], depth[i] = -1, 1  # orphan (score tie): unlinked
    children = [[] for _ in range(N)]
    for i in range(1, N):
        if parent[i] != -1:
            children[parent[i]].append(i)
    next_token = [ch[0] if ch else -1 for ch in children]
    next_sibling = [-1] * N
    for ch in children:
        for a, b in itertools.pairwise(ch):
            next_sibling[a] = b
    tree = Tree(tokens, cand, parent, depth, [seq_len + d for d in depth], torch.zeros((N, N), dtype=torch.bool),
                children, next_token, next_sibling)
    for i in range(N):
        tree.mask[i, [i] + tree.ancestors(i)] = True
    return tree


@dataclass
class Acceptance:
    """TR-006: ``path`` = accepted nodes from the root (``[0, ...]``, n + 1 entries), ``n``
    accepted drafts, ``a = n + 1``, ``bonus`` = the target's argmax at the last path node,
    ``emitted`` = the accepted drafts' tokens + the bonus (a tokens)."""

    path: list[int]
    n: int
    bonus: int
    emitted: list[int]

    @property
    def a(self) -> int:
        return self.n + 1


def greedy_accept(tree: Tree, target_predict: list[int]) -> Acceptance:
    """TR-006: walk from the root; at node ``cur`` take the first child (ascending) whose token
    equals ``target_predict[cur]`` (the target's argmax at node cur); stop when none does.
    Raises: InvariantError TR-006 unless ``target_predict`` has one entry per node."""
    require(len(target_predict) == tree.num_nodes, "TR-006",
            f"target_predict has {len(target_predict)} entries for {tree.num_nodes} nodes")
    path = [0]
    while True:
        cur = path[-1]
        nxt = next((c for c in tree.children[cur] if tree.tokens[c] == int(target_predict[cur])), None)
        if nxt is None:
            break
        path.append(nxt)
    bonus = int(target_predict[path[-1]])
    return Acceptance(path, len(path) - 1, bonus, [tree.tokens[i] for i in path[1:]] + [bonus])


def verify_key_slots(tree: Tree, prefix_slots: list[int], node_slots: list[int]) -> list[list[int]]:
    """TR-004: the keys of each verify row: the committed prefix (L slots), then the slots of the
    nodes its mask row allows (itself and its ancestors, ascending node order)."""
    require(len(node_slots) == tree.num_nodes, "TR-004",
            f"{len(node_slots)} node slots for {tree.num_nodes} nodes")
    return [list(prefix_slots) + [node_slots[j] for j in range(tree.num_nodes) if tree.mask[i, j]]
            for i in range(tree.num_nodes)]
