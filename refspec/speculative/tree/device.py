"""SGLang's EAGLE tree building and greedy tree acceptance as device tensor code (production).

The production twins of the host ports :func:`refspec.speculative.tree.build.build_tree` and
:func:`refspec.speculative.tree.build.verify_tree_greedy` (the readable side, one request and
one node at a time).  Same inputs, same outputs (bitwise, ``tests/test_tree_device.py``), but
pure torch tensor ops: no device -> host read, no Python loop over requests or nodes; the only
loops run a *static* count fixed by the shapes (``ceil(log2 N)`` pointer-doubling rounds, the
``num_speculative_tokens - 1`` path steps), so both are CUDA-graph capturable.

Upstream (sgl-project/sglang v0.5.23), one CUDA kernel each:

* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_utils.py#L138
  ``build_tree_kernel_efficient`` (the wrapper: ``draft_tokens = cat(verified_id, drafts)``, the
  flat ``tree_mask`` of ``seq_lens_sum * N + B * N * N`` entries, or a preallocated
  ``tree_mask_buf``), over the CUDA op ``build_tree_efficient`` (FULL_MASK);
* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/kernels/ops/speculative/spec_tree.py#L480
  ``verify_tree_greedy_func``, over the CUDA op ``VerifyTreeGreedy``;
* both ops: ``sgl-kernel/csrc/speculative/eagle_utils.cu`` (``build_tree_efficient``,
  ``VerifyTreeGreedy``), the kernels the host ports of :mod:`refspec.speculative.tree.build`
  follow line by line.

How the rules become tensor ops (B requests, N nodes; node 0 = the root):

* **parents** (TR-003): node i >= 1 is candidate ``s = top_scores_index[i-1]``, its frontier group
  ``q = s // k``; q = 0: parent 0; else the node whose candidate equals ``parent_list[q]``:
  one ``[B, N-1, N-1]`` equality, ``argmax`` + ``any``; no match = an orphan (-1);
* **children lists** (``retrive_next_token`` / ``retrive_next_sibling``, ascending node order,
  orphans linked nowhere): ``next_token[p]`` = the smallest i with parent p, ``next_sibling[i]``
  = the smallest j > i with the same parent: ``[B, N, N]`` ``where`` + ``min``;
* **ancestors** (TR-004 mask, TR-005 positions): an orphan's chain ends at the root (parent 0
  for the chain walk, as the host port); ``ceil(log2 N)`` rounds of pointer doubling over the
  ``[B, N, N]`` ancestor-or-self matrix; ``depth = row sum - 1``, ``positions = L + depth``;
* **FULL_MASK** (TR-004): the tree rows scattered into an all-True flat buffer at request b's
  block ``N*N*b + N*sum_{j<b} L_j`` (row i of length ``L_b + N``), the buffer's size given by the
  caller (host-known: the exact ``sum(L) * N + B * N * N`` when the host knows L, an upper bound
  under the overlap schedule -- upstream's ``tree_mask_buf``); the offsets come from the device
  ``seq_lens`` (a cumsum), never from the host;
* **greedy path** (TR-006 / TR-016): for every node u, the first child (in the list order of
  ``next_token`` / ``next_sibling``) whose token equals ``target_predict[u]``; the list order is
  computed by list ranking (pointer doubling on the reversed sibling links), so any well-formed
  child lists work, not only ascending ones; then ``num_speculative_tokens - 1`` steps along
  that choice from the root.
"""

from __future__ import annotations

import torch

from refspec.core.constants import const_arange  # noqa: F401 (the tree modules import it from here)
from refspec.core.invariants import require
from refspec.speculative.tree import accept_kernel, build_kernel


def _doubling_rounds(n: int) -> int:
    """Pointer-doubling rounds that cover a chain of ``n - 1`` hops: ``ceil(log2 n)`` (0 for n <= 1)."""
    return max(n - 1, 0).bit_length()


def tree_parents_device(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int) -> torch.Tensor:
    """TR-003: the parent node of every node, int64 ``[B, N]`` (node 0 and orphans: -1).

    ``parent_list`` int64 ``[B, 1 + (S-1) k]`` (``[B, 0]`` at S = 1), ``top_scores_index`` int64
    ``[B, N-1]`` (sorted ascending, distinct).  The rule of
    :func:`refspec.speculative.tree.build.tree_parents`, for all requests at once.
    """
    B, M = top_scores_index.shape
    dev = top_scores_index.device
    top = top_scores_index.long()
    q = top // topk  # [B, N-1]: the frontier group; 0 = the root's children
    if parent_list.shape[1] == 0:  # S = 1: every candidate is a root child
        par = torch.zeros_like(q)
    else:
        want = parent_list.long().gather(1, q.clamp(max=parent_list.shape[1] - 1))  # score index of the parent
        eq = top[:, None, :] == want[:, :, None]  # [B, N-1 (child), N-1 (candidate)]
        par = torch.where(eq.any(-1), eq.long().argmax(-1) + 1, torch.full_like(q, -1))
        par = torch.where(q == 0, torch.zeros_like(par), par)
    return torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), par], dim=1)


def child_lists(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(retrive_next_token, retrive_next_sibling)`` int64 ``[B, N]`` from ``parents [B, N]``.

    ``next_token[p]`` = the smallest child of p, ``next_sibling[i]`` = the next larger child of
    i's parent; -1 = none.  Orphans (parent -1) are nobody's child and have no sibling.
    """
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    none = torch.full((), N, dtype=torch.long, device=parents.device)
    is_child = parents[:, None, :] == idx[None, :, None]  # [B, p, i]: i is a child of p
    first = torch.where(is_child, idx, none).amin(-1)
    same = (parents[:, None, :] == parents[:, :, None]) & (parents[:, :, None] >= 0) & (idx[None, :] > idx[:, None])
    nxt_sib = torch.where(same, idx, none).amin(-1)  # [B, i]: smallest j > i with parent_j == parent_i
    return (torch.where(first == N, -1, first), torch.where(nxt_sib == N, -1, nxt_sib))


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """TR-004: bool ``[B, N, N]``, row i = the root, i's ancestors and i itself.

    An orphan's chain ends at the root (its walk parent is 0), as in the host port.
    """
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    up = torch.where(parents >= 0, parents, torch.zeros_like(parents))  # the root is its own parent
    up[:, 0] = 0
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    anc = eye | (up[:, :, None] == idx)  # self and the parent
    ptr = up
    for _ in range(_doubling_rounds(N)):  # anc(i) |= anc(ptr(i)); ptr(i) = ptr(ptr(i))
        anc = anc | anc.gather(1, ptr[:, :, None].expand(B, N, N))
        ptr = ptr.gather(1, ptr)
    anc[:, :, 0] = True
    return anc


def full_mask(tree_mask: torch.Tensor, seq_lens: torch.Tensor, numel: int) -> torch.Tensor:
    """TR-004, the flat FULL_MASK: bool ``[numel]``, all True except the tree columns.

    ``tree_mask`` bool ``[B, N, N]``; ``seq_lens`` ``[B]`` (device L).  Request b's block starts
    at ``N*N*b + N*sum_{j<b} L_j``, node i's row at ``+ i*(L_b + N)``, its tree columns at
    ``+ L_b``.  ``numel`` (host int) must be at least ``sum(L)*N + B*N*N``; entries past the last
    block stay True (an unused tail, upstream's ``tree_mask_buf``).  The size is the caller's,
    the offsets the device's: no host read.
    """
    B, N, _ = tree_mask.shape
    L = seq_lens.long()
    row = L + N  # a row's length, L_b + N
    blk = N * (torch.cumsum(row, 0) - row)  # N * sum_{j<b} (L_j + N) = N*N*b + N*sum_{j<b} L_j
    i = const_arange(N, L.device)
    idx = (blk + L)[:, None, None] + i[None, :, None] * row[:, None, None] + i[None, None, :]
    out = torch.ones(numel, dtype=torch.bool, device=tree_mask.device)
    out[idx.flatten()] = tree_mask.flatten()
    return out


def tree_structure(parent_list, top_scores_index, topk: int):
    """The request-length-free part of ``build_tree_efficient``: ``(parents, retrive_next_token,
    retrive_next_sibling, ancestors, depth)``, int64 ``[B, N]`` x 3, bool ``[B, N, N]``, int64
    ``[B, N]``, from ``parent_list`` / ``top_scores_index`` alone (TR-003, TR-004, TR-005).

    Static shapes and no host read: the production draft forward returns it from inside its
    CUDA graph (:meth:`refspec.speculative.tree.runners.TreeRunners._tree_draft_fn`).  On CUDA
    with Triton one fused kernel builds it as upstream's ``build_tree_kernel_efficient`` does
    (:func:`refspec.speculative.tree.build_kernel.tree_structure_fused`); elsewhere the tensor
    rule :func:`tree_structure_torch`.
    """
    if build_kernel.available(top_scores_index.device):
        return build_kernel.tree_structure_fused(parent_list.long().contiguous(),
                                                 top_scores_index.long().contiguous(), topk)
    return tree_structure_torch(parent_list, top_scores_index, topk)


def tree_structure_torch(parent_list, top_scores_index, topk: int):
    """:func:`tree_structure` as tensor code: the parents (:func:`tree_parents_device`), the child
    lists (:func:`child_lists`), the ancestors by pointer doubling (:func:`ancestor_mask`) and
    the depths (row sums).  Same arguments and results.

    The rule of the fused kernel :func:`refspec.speculative.tree.build_kernel.tree_structure_fused`
    (what a CUDA device runs; equal on random trees, ``tests/test_triton_interpret.py``)."""
    parents = tree_parents_device(parent_list, top_scores_index, topk)
    nxt, sib = child_lists(parents)
    anc = ancestor_mask(parents)
    return parents, nxt, sib, anc, anc.sum(-1) - 1


def assemble_tree(verified_id, draft_tokens, structure, seq_lens, mask_numel: int) -> dict:
    """The rest of ``build_tree_kernel_efficient`` once L is known: :func:`build_tree_device`'s
    dict from the roots ``[B]``, ``draft_tokens [B, N-1]``, :func:`tree_structure`'s tuple and
    ``seq_lens [B]`` (device): positions ``L + depth``, the flat FULL_MASK (:func:`full_mask`).
    Raises: InvariantError TR-004 if ``mask_numel < B*N*N``."""
    parents, nxt, sib, anc, depth = structure
    B, N = parents.shape
    require(mask_numel >= B * N * N, "TR-004", f"custom_mask needs >= sum(L)*N + B*N*N entries, got {mask_numel}")
    return dict(draft_tokens=torch.cat([verified_id[:, None], draft_tokens], dim=1).flatten(),
                positions=(seq_lens.long()[:, None] + depth).flatten(),
                custom_mask=full_mask(anc, seq_lens, mask_numel),
                retrive_index=const_arange(B * N, parents.device).view(B, N),
                retrive_next_token=nxt, retrive_next_sibling=sib, parents=parents,
                tree_mask=anc.reshape(B * N, N))


def build_tree_device(verified_id, parent_list, top_scores_index, draft_tokens, seq_lens, topk: int,
                      num_draft_tokens: int, mask_numel: int) -> dict:
    """``build_tree_kernel_efficient`` (FULL_MASK) on the device: the twin of
    :func:`refspec.speculative.tree.build.build_tree` (:func:`tree_structure`, then
    :func:`assemble_tree`).

    Args: ``verified_id`` int64 ``[B]`` (the roots), ``parent_list`` ``[B, 1 + (S-1) k]``,
    ``top_scores_index`` / ``draft_tokens`` ``[B, N-1]``
    (:func:`~refspec.speculative.tree.build.organize_draft_results`),
    ``seq_lens`` ``[B]`` on the device (L), ``mask_numel`` (host int, :func:`full_mask`).
    Returns the port's dict, every entry a device tensor: ``draft_tokens`` / ``positions`` int64
    ``[B*N]``, ``custom_mask`` bool ``[mask_numel]``, ``retrive_index`` / ``retrive_next_token`` /
    ``retrive_next_sibling`` int64 ``[B, N]``, ``parents`` int64 ``[B, N]`` (the port: host lists),
    plus ``tree_mask`` bool ``[B*N, N]`` (the tree columns of ``custom_mask``, TR-011's rows).
    Raises: InvariantError TR-004 if ``mask_numel`` is below a host-known lower bound
    ``B*N*N`` (the exact bound needs L, which stays on the device).
    """
    require(top_scores_index.shape[1] == num_draft_tokens - 1, "TR-002",
            f"top_scores_index has {top_scores_index.shape[1]} columns, N - 1 = {num_draft_tokens - 1}")
    return assemble_tree(verified_id, draft_tokens, tree_structure(parent_list, top_scores_index, topk), seq_lens,
                         mask_numel)


def _list_order(nxt: torch.Tensor, sib: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node, ``(owner, rank)`` int64 ``[B, N]``: the node whose child list holds it (-1: none)
    and its 0-based place in that list, by list ranking on the reversed sibling links."""
    B, N = nxt.shape
    dev = nxt.device
    idx = torch.arange(N, device=dev).expand(B, N)
    dump = torch.full((B, 1), -1, dtype=torch.long, device=dev)
    head_of = torch.cat([torch.full((B, N), -1, dtype=torch.long, device=dev), dump], 1)
    head_of.scatter_(1, torch.where(nxt >= 0, nxt, N), idx)  # head_of[c] = u when c = next_token[u]
    prev = torch.cat([torch.full((B, N), -1, dtype=torch.long, device=dev), dump], 1)
    prev.scatter_(1, torch.where(sib >= 0, sib, N), idx)  # prev[j] = i when j = next_sibling[i]
    prev = prev[:, :N]
    ptr = torch.where(prev >= 0, prev, idx)  # a list head points to itself
    rank = (prev >= 0).long()
    for _ in range(_doubling_rounds(N)):
        rank = rank + rank.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    return head_of[:, :N].gather(1, ptr), rank


def verify_tree_greedy_device(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
                              num_speculative_tokens: int):
    """TR-016 (the rule: TR-006), ``VerifyTreeGreedy`` on the device: the twin of
    :func:`refspec.speculative.tree.build.verify_tree_greedy` (same arguments, same results).

    Shapes: ``candidates``, ``retrive_*`` int64 ``[B, N]``; ``target_predict`` int64 ``[B*N]``.
    Returns ``predicts`` int64 ``[B*N]`` (the target's token at every path node, 0 elsewhere),
    ``accept_index`` int64 ``[B, num_speculative_tokens]`` (flat node ids of the path, -1
    padded) and ``accept_token_num`` int64 ``[B]`` (n).  On CUDA with Triton one fused kernel
    walks the tree as upstream's ``verify_tree_greedy`` does
    (:func:`refspec.speculative.tree.accept_kernel.verify_tree_greedy_fused`); elsewhere the
    tensor rule :func:`verify_tree_greedy_torch`.
    """
    if accept_kernel.available(candidates.device):
        return accept_kernel.verify_tree_greedy_fused(candidates, retrive_index, retrive_next_token,
                                                      retrive_next_sibling, target_predict, num_speculative_tokens)
    return verify_tree_greedy_torch(candidates, retrive_index, retrive_next_token, retrive_next_sibling,
                                    target_predict, num_speculative_tokens)


def verify_tree_greedy_torch(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
                             num_speculative_tokens: int):
    """:func:`verify_tree_greedy_device` as tensor code, every request at once, no host loop: per
    node its owner and place in its child list (list ranking), then one gather per level along
    the path.  Same arguments and results.

    The rule of the fused kernel :func:`refspec.speculative.tree.accept_kernel.verify_tree_greedy_fused`
    (what a CUDA device runs; equal on random trees, ``tests/test_triton_interpret.py``)."""
    B, N = candidates.shape
    dev = candidates.device
    ridx = retrive_index.long()
    tp = target_predict.long()[ridx.flatten()].view(B, N)  # the target's argmax at each local node
    owner, rank = _list_order(retrive_next_token.long(), retrive_next_sibling.long())
    # choice[u] = the lowest-ranked child v of u with candidates[v] == tp[u], else -1
    ok = (owner[:, None, :] == torch.arange(N, device=dev)[None, :, None]) & (candidates[:, None, :] == tp[:, :, None])
    key = torch.where(ok, rank[:, None, :], torch.full((), N, dtype=torch.long, device=dev))
    best = key.argmin(-1)
    choice = torch.where(ok.any(-1), best, -1)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    cols = [ridx[:, 0]]
    for _ in range(1, num_speculative_tokens):
        step = choice.gather(1, cur[:, None])[:, 0]
        alive = alive & (step >= 0)
        cur = torch.where(alive, step, cur)
        cols.append(torch.where(alive, ridx.gather(1, cur[:, None])[:, 0], -1))
    accept_index = torch.stack(cols, dim=1)
    n = (accept_index >= 0).sum(1) - 1
    flat = accept_index.flatten()
    valid = flat >= 0
    predicts = torch.zeros(B * N + 1, dtype=torch.long, device=dev)
    predicts[torch.where(valid, flat, B * N)] = torch.where(valid, target_predict.long()[flat.clamp(min=0)], 0)
    return predicts[:B * N], accept_index, n
