"""SGLang's EAGLE tree, production side: per-step top-k expansion, node selection, tree, greedy accept.

A readable port of (sgl-project/sglang):

* ``speculative/spec_utils.py`` ``select_top_k_tokens`` (``_first`` / ``_later``): step 0 takes
  the k children of the root from the draft extend; step i >= 1 scores the k*k children of the
  frontier by *cumulative probability product* and keeps the best k as the next frontier;
* ``speculative/eagle_utils.py`` ``organize_draft_results``: the N - 1 best of all
  ``k + (S-1)*k*k`` candidates by cumulative score, their indices **sorted ascending** (so a
  parent always precedes its children), plus the parent list;
* ``sgl-kernel/csrc/speculative/eagle_utils.cu`` ``build_tree_efficient`` (FULL_MASK): node 0 is
  the root (the last verified token), node i >= 1 the i-th selected draft; parents,
  ``retrive_next_token`` / ``retrive_next_sibling`` child lists, ``positions = L + depth`` and the
  flat bool ``custom_mask`` (row = committed prefix + root + ancestors + self);
* the same file's ``VerifyTreeGreedy``: from the root, follow the child that equals the
  target's argmax at the last accepted node; ``predicts[last] = bonus``.

Shapes: B requests, k = topk, S = num_steps, N = num_draft_tokens.  Scores fp32, tokens int64.

``build_tree``, ``tree_parents`` and ``verify_tree_greedy`` loop over requests and nodes on the
host: the readable side.  The production rounds run their device twins,
:mod:`refspec.speculative.tree.device` (same outputs, bitwise: ``tests/test_tree_device.py``,
``tests/test_twins.py``); no round calls these three (their callers are the conformance tree
cases, the tests and the tutorials): they are the rule, not a path.  The expansion and selection
functions above them are what the rounds run (inside the draft graph when replayed).
"""

from __future__ import annotations

import torch

from refspec.core.invariants import require


def select_top_k_tokens_first(topk_p, topk_index, hidden, topk: int):
    """Step 0: the root's k children.  ``topk_p`` / ``topk_index`` [B, k] from the draft extend.

    Returns ``(input_ids [B*k], hidden [B*k, E] | None, scores [B, k], tree_info)`` with
    ``tree_info = (scores [B, 1, k], tokens [B, k], parents [B, k + 1] = [-1, 0, .., k-1])``.
    """
    B = topk_p.shape[0]
    parents = torch.arange(-1, topk, device=topk_p.device).repeat(B, 1)
    h = None if hidden is None else hidden.repeat_interleave(topk, dim=0)
    return topk_index.flatten(), h, topk_p, (topk_p[:, None, :], topk_index, parents)


def select_top_k_tokens_later(step: int, topk_p, topk_index, hidden, scores, topk: int):
    """Step ``i >= 1``: the best k of the k*k children of the frontier, by cumulative score.

    ``topk_p`` / ``topk_index`` [B*k, k] (each frontier row's k children), ``scores`` [B, k] (the
    frontier's cumulative scores), ``hidden`` [B*k, E] (the frontier rows' draft hidden).
    Returns ``(input_ids [B*k], hidden [B*k, E] | None, scores [B, k], tree_info)`` with
    ``tree_info = (expand_scores [B, k, k], tokens [B, k*k], parents [B, k])``; a parent is the
    frontier node's index in the flattened score list: ``cs_index + k*k*(i-1) + k``.
    """
    k = topk
    B = scores.shape[0]
    expand_scores = scores[:, :, None] * topk_p.view(B, k, k)
    cs_p, cs_index = torch.topk(expand_scores.flatten(1), k, dim=-1)
    tokens = topk_index.view(B, k * k)
    input_ids = torch.gather(tokens, 1, cs_index).flatten()
    rows = cs_index.flatten() // k + torch.arange(0, B * k, k, device=cs_index.device).repeat_interleave(k)
    h = None if hidden is None else hidden[rows]
    return input_ids, h, cs_p, (expand_scores, tokens, cs_index + (k * k * (step - 1) + k))


def draft_topk(logits: torch.Tensor, topk: int):
    """The draft's k children of each row: ``softmax`` then ``topk`` -> (p [R, k] fp32, ids [R, k])."""
    return torch.topk(torch.softmax(logits.float(), dim=-1), topk, dim=-1)


def organize_draft_results(score_list, token_list, parents_list, num_draft_tokens: int):
    """The N - 1 verify drafts: top by cumulative score, indices sorted ascending.

    Returns ``(parent_list [B, 1 + (S-1)*k], top_scores_index [B, N-1], draft_tokens [B, N-1])``.
    Raises: InvariantError TR-002 if N - 1 exceeds the ``k + (S-1)*k*k`` candidates.
    """
    scores = torch.cat(score_list, dim=1).flatten(1)
    tokens = torch.cat(token_list, dim=1)
    require(1 <= num_draft_tokens - 1 <= scores.shape[1], "TR-002",
            f"num_draft_tokens - 1 = {num_draft_tokens - 1} > {scores.shape[1]} draft candidates "
            "(k + (S-1) k^2)")
    top = torch.topk(scores, num_draft_tokens - 1, dim=-1).indices
    top = torch.sort(top, dim=-1).values
    draft_tokens = torch.gather(tokens, 1, top)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    return parent_list, top, draft_tokens


def tree_parents(parent_list: list[int], top_scores_index: list[int], topk: int) -> list[int]:
    """Parent node of every node of one request (node 0 = root: -1), as ``build_tree_efficient``.

    Node i >= 1 is the selected candidate ``top_scores_index[i-1]``; ``q = index // k`` names
    its frontier group: q = 0 is the root, else its parent is the node holding score index
    ``parent_list[q]``.  A node whose parent candidate was not selected (possible only on a
    score tie) is an *orphan*: parent -1.  Upstream's kernel prints "invalid eagle tree" and
    links nothing for it; its mask loop then searches past the row (undefined), so refspec gives
    an orphan the root and itself (depth 1), as the oracle does (TR-003).

    Readable twin of :func:`refspec.speculative.tree.device.tree_parents_device` (every request at
    once, on the device), which the rounds run.
    """
    where = {s: i + 1 for i, s in enumerate(top_scores_index)}
    parents = [-1]
    for s in top_scores_index:
        q = s // topk
        parents.append(0 if q == 0 else where.get(parent_list[q], -1))
    return parents


def build_tree(verified_id, parent_list, top_scores_index, draft_tokens, seq_lens_cpu, topk: int,
               num_draft_tokens: int):
    """``build_tree_kernel_efficient`` (FULL_MASK) for B requests.

    Returns a dict: ``draft_tokens`` int64 [B*N] (``[root, drafts..]`` per request),
    ``positions`` int64 [B*N] (L + depth), ``custom_mask`` flat bool
    [sum(L)*N + B*N*N] (request b's block at ``N*N*b + N*sum_{j<b} L_j``, node i's row of length
    ``L_b + N``: prefix True, tree columns True at the root, the ancestors and itself),
    ``retrive_index`` / ``retrive_next_token`` / ``retrive_next_sibling`` int64 [B, N] (-1 =
    none; children listed in ascending node order), ``parents`` (host lists).

    Readable twin of :func:`refspec.speculative.tree.device.build_tree_device`, which the rounds
    run (same entries, bitwise).
    """
    N, dev = num_draft_tokens, verified_id.device
    Ls = [int(x) for x in seq_lens_cpu.tolist()]
    B = len(Ls)
    mask = torch.ones(sum(Ls) * N + B * N * N, dtype=torch.bool)  # built on the host, moved once
    positions = torch.empty(B * N, dtype=torch.long)
    nxt = torch.full((B, N), -1, dtype=torch.long)
    sib = torch.full((B, N), -1, dtype=torch.long)
    all_parents = []
    pl, ts = parent_list.tolist(), top_scores_index.tolist()
    start = 0
    for b, L in enumerate(Ls):
        parents = tree_parents(pl[b], ts[b], topk)
        all_parents.append(parents)
        for i in range(N - 1, 0, -1):  # reverse insertion: children end up in ascending order
            p = parents[i]
            if p < 0:
                continue  # orphan: no link
            sib[b, i] = nxt[b, p]
            nxt[b, p] = i
        for i in range(N):
            row = start + i * (L + N) + L
            mask[row + 1:row + N] = False  # tree columns except the root's
            depth, j = 0, i
            while j > 0:
                mask[row + j] = True
                j, depth = max(parents[j], 0), depth + 1  # an orphan's chain ends at the root
            positions[b * N + i] = L + depth
        start += N * (L + N)
    retrive_index = torch.arange(B * N, dtype=torch.long).view(B, N)
    tokens = torch.cat([verified_id[:, None], draft_tokens], dim=1).flatten()
    return dict(draft_tokens=tokens, positions=positions.to(dev), custom_mask=mask.to(dev),
                retrive_index=retrive_index.to(dev), retrive_next_token=nxt.to(dev),
                retrive_next_sibling=sib.to(dev), parents=all_parents)


def verify_tree_greedy(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
                       num_speculative_tokens: int):
    """TR-016 (the rule: TR-006), ``VerifyTreeGreedy``: greedy acceptance along the tree.

    From the root, repeatedly take the first child (in ``next_token`` / ``next_sibling`` order)
    whose token equals the target's argmax at the last accepted node.  Shapes: candidates,
    retrive_* int64 [B, N]; target_predict int64 [B*N] (flat node ids).  Returns ``predicts``
    [B*N] (``predicts[node]`` = the token after ``node`` on the path, the bonus at the last),
    ``accept_index`` [B, S+1] (flat node ids of the path, -1 padded) and ``accept_token_num`` [B]
    (n, accepted drafts).

    Readable twin of :func:`refspec.speculative.tree.device.verify_tree_greedy_device`, which the
    rounds run (same results, bitwise).
    """
    B, N = candidates.shape
    cand, nxt, sib = candidates.tolist(), retrive_next_token.tolist(), retrive_next_sibling.tolist()
    ridx, tp = retrive_index.tolist(), target_predict.tolist()
    predicts = [0] * (B * N)
    accept = [[-1] * num_speculative_tokens for _ in range(B)]
    n_acc = [0] * B
    for b in range(B):
        last = ridx[b][0]
        accept[b][0] = last
        cur = 0
        for _ in range(1, num_speculative_tokens):
            cur = nxt[b][cur]
            while cur != -1:
                if cand[b][cur] == tp[last]:
                    predicts[last] = tp[last]
                    n_acc[b] += 1
                    accept[b][n_acc[b]] = ridx[b][cur]
                    last = ridx[b][cur]
                    break
                cur = sib[b][cur]
            if cur == -1:
                break
        predicts[last] = tp[last]
    dev = candidates.device
    return (torch.tensor(predicts, dtype=torch.long, device=dev), torch.tensor(accept, dtype=torch.long, device=dev),
            torch.tensor(n_acc, dtype=torch.long, device=dev))
