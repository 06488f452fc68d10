"""The tree's structure (TR-003 parents and child lists, TR-004 ancestors, TR-005 depths) as ONE
fused GPU kernel (Triton), as upstream builds it.

Upstream's ``build_tree_kernel_efficient`` runs one CUDA kernel (``build_tree_efficient`` in
``sgl_kernel``; its Triton twin ``sgl_build_tree_kernel_efficient_triton``,
https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/kernels/ops/speculative/spec_tree.py#L53):
one program per request links
every node to its parent (the node whose candidate is ``parent_list[top_scores_index[i-1] // k]``,
searched in the selected candidates; the root's children when that group is 0), from the last
node down, so each child list ends up in ascending node order, then walks each node up to the root
to write its row of the tree mask and its depth.  This kernel is that program with the tree mask
in the QLEN_ONLY layout (``[B, N, N]``, the tree columns only: refspec places them in the flat
FULL_MASK afterwards, :func:`refspec.speculative.tree.device.full_mask`) and depths instead of
positions (the positions are ``L + depth``).  The rule written in torch
(:func:`refspec.speculative.tree.device.tree_structure_torch`: an equality matrix, ``where`` +
``min`` for the lists, pointer doubling for the ancestors) is ~55 small kernels inside the draft
graph (CPU count, ``benchmarks/diag_graph_ops.py tree``); this is one, plus two fills.  Same
results, which ``tests/test_gpu_tree_build_kernel.py`` checks against the torch rule and the host
port :func:`refspec.speculative.tree.build.build_tree` on random trees (orphans and ties included).

Available where Triton is (CUDA builds of torch ship it); :func:`available` says so, and
``tree_structure`` keeps the torch rule elsewhere.
"""

from __future__ import annotations

import torch

from refspec.core.triton_kernels import runs_on, triton_kernel


@triton_kernel
def _kernel(triton, tl):
    """The jitted structure kernel."""
    @triton.jit
    def build(links, anc, depth, plist, top,
              K: tl.constexpr, S: tl.constexpr, N: tl.constexpr, PL: tl.constexpr):
        # links: int64 [3, B, N] (parents, next_token, next_sibling), all -1 on entry; anc: uint8
        # [B, N, N], all 0 on entry; depth: int64 [B, N]; plist [B, PL]; top [B, N - 1].
        b = tl.program_id(0)
        B = tl.num_programs(0)
        par = links
        nxt = links + B * N
        sib = links + 2 * B * N
        for r in range(1, N):  # TR-003: parents and child lists, node N - 1 down to 1
            i = N - r
            q = tl.load(top + b * (N - 1) + i - 1) // K  # the frontier group of node i's candidate
            pos = q * 0
            found = q == 0
            if PL > 0:
                want = tl.load(plist + b * PL + tl.minimum(q, PL - 1))  # the parent's score index
                for pp in range(N - 1):
                    hit = (~found) & (tl.load(top + b * (N - 1) + pp) == want)
                    pos = tl.where(hit, pp + 1, pos)
                    found = found | hit
            else:
                found = q == q  # S = 1: every candidate is a root child
            if found:
                tl.store(par + b * N + i, pos)
                old = tl.load(nxt + b * N + pos)
                tl.store(nxt + b * N + pos, i)
                tl.store(sib + b * N + i, old)  # -1 when i is pos's first child so far
        for x in range(N):  # TR-004 / TR-005: the mask row (root, ancestors, self) and the depth
            row = anc + (b * N + x) * N
            tl.store(row, 1)
            d = x * 0
            cur = x
            go = x > 0
            for _step in range(S):
                if go:
                    tl.store(row + cur, 1)
                    d = d + 1
                    q = tl.load(top + b * (N - 1) + cur - 1) // K
                    if q == 0:
                        go = q != q
                    else:
                        nxtcur = cur * 0
                        found = q != q
                        if PL > 0:
                            want = tl.load(plist + b * PL + tl.minimum(q, PL - 1))
                            for pp in range(N - 1):
                                hit = (~found) & (tl.load(top + b * (N - 1) + pp) == want)
                                nxtcur = tl.where(hit, pp + 1, nxtcur)
                                found = found | hit
                        cur = nxtcur
                        go = found  # an orphan's chain ends at the root
            tl.store(depth + b * N + x, d)

    return build


def available(device: torch.device) -> bool:
    """True where the fused kernel runs: a CUDA device and an importable Triton."""
    return runs_on(device, _kernel)


def tree_structure_fused(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int):
    """TR-003 / TR-004 / TR-005 in one kernel: the arguments and results of
    :func:`refspec.speculative.tree.device.tree_structure`.  The draft steps S, which bound the
    walk to the root as upstream's ``depth`` does, follow from ``parent_list``'s width.

    ``parent_list`` int64 ``[B, 1 + (S-1) k]`` (``[B, 0]`` at S = 1), ``top_scores_index`` int64
    ``[B, N-1]``, contiguous on one CUDA device.  Returns ``(parents, retrive_next_token,
    retrive_next_sibling, ancestors, depth)``: int64 ``[B, N]`` x 3, bool ``[B, N, N]``, int64
    ``[B, N]``.  Raises ValueError naming the argument for other shapes, dtypes, devices or
    layouts, and RuntimeError where :func:`available` is False.

    Fused twin of the torch rule :func:`refspec.speculative.tree.device.tree_structure_torch`.
    """
    dev = top_scores_index.device
    if not available(dev):
        raise RuntimeError("tree_structure_fused needs a CUDA tensor and Triton (see build_kernel.available)")
    if top_scores_index.dim() != 2 or parent_list.dim() != 2 or parent_list.shape[0] != top_scores_index.shape[0]:
        raise ValueError(f"tree_structure_fused: parent_list [B, P] and top_scores_index [B, N-1], got "
                         f"{tuple(parent_list.shape)} and {tuple(top_scores_index.shape)}")
    B, M = top_scores_index.shape
    N, K, PL = M + 1, int(topk), parent_list.shape[1]
    if K < 1 or (PL and (PL - 1) % K):
        raise ValueError(f"tree_structure_fused: parent_list must have 0 or 1 + (S-1) k columns for k = {K}, "
                         f"got {PL}")
    S = 1 if PL == 0 else 1 + (PL - 1) // K
    for name, x in (("parent_list", parent_list), ("top_scores_index", top_scores_index)):
        if x.dtype != torch.long or x.device != dev or not x.is_contiguous():
            raise ValueError(f"tree_structure_fused: {name} must be a contiguous int64 tensor on {dev}, "
                             f"got {x.dtype} on {x.device}")
    links = torch.full((3, B, N), -1, dtype=torch.long, device=dev)
    anc = torch.zeros((B, N, N), dtype=torch.uint8, device=dev)
    depth = torch.empty((B, N), dtype=torch.long, device=dev)
    if B:
        # one warp: the program is scalar, and the child-list links read back what it stored (as upstream's)
        _kernel()[(B,)](links, anc, depth, parent_list, top_scores_index, K=K, S=S, N=N, PL=PL, num_warps=1)
    return links[0], links[1], links[2], anc.view(torch.bool), depth
