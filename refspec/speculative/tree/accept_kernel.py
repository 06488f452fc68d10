"""TR-016's greedy tree acceptance as ONE fused GPU kernel (Triton), as upstream runs it.

Upstream's verify calls ``verify_tree_greedy`` (a CUDA kernel in ``sgl_kernel``; its Triton
twin ``verify_tree_greedy_triton`` in ``python/sglang/kernels/ops/speculative/spec_tree.py`` at
v0.5.23): one program per request walks the tree from the root, at each level along the child
list (``retrive_next_token``, then ``retrive_next_sibling``) to the first child whose token is
the target's argmax at the last accepted node.  The rule written in torch
(:func:`refspec.speculative.tree.device.verify_tree_greedy_device`, list ranking by pointer
doubling) is ~75 small kernels per call inside the verify graph (CPU count,
``benchmarks/diag_graph_ops.py tree``); this is one, plus the three fills of its outputs.  Same
integer results, which ``tests/test_gpu_tree_accept_kernel.py`` checks against the torch rule and
the host port :func:`refspec.speculative.tree.build.verify_tree_greedy` on random trees.

Available where Triton is (CUDA builds of torch ship it); :func:`available` says so, and
``verify_tree_greedy_device`` keeps the torch rule elsewhere.
"""

from __future__ import annotations

import torch

from refspec.core.triton_kernels import runs_on, triton_kernel


@triton_kernel
def _kernel(triton, tl):
    """The jitted acceptance kernel."""
    @triton.jit
    def verify(predicts, accept_index, accept_num, cand, ridx, nxt, sib, tp,
               S: tl.constexpr, N: tl.constexpr):
        b = tl.program_id(0)
        last = tl.load(ridx + b * N)  # the root: always accepted
        tl.store(accept_index + b * S, last)
        n = last * 0
        cur = last * 0
        go = 1
        for _level in range(1, S):
            if go:
                cur = tl.load(nxt + b * N + cur)  # the first child of the last accepted node
                target = tl.load(tp + last)
                found = 0
                for _sib in range(N):  # along the child list, at most N nodes
                    if found == 0:
                        valid = cur != -1
                        safe = b * N + cur * valid  # a harmless address when the list ended
                        node = tl.load(ridx + safe)
                        match = valid & (tl.load(cand + safe) == target)
                        tl.store(predicts + last, target, mask=match)
                        tl.store(accept_index + b * S + n + 1, node, mask=match)
                        n = n + match
                        last = tl.where(match, node, last)
                        found = match * 1 + (~valid) * (-1)
                        cur = tl.load(sib + safe, mask=(~match) & valid, other=cur)
                if found != 1:
                    go = 0
        tl.store(accept_num + b, n)
        tl.store(predicts + last, tl.load(tp + last))  # the bonus, the target's token after the path

    return verify


def available(device: torch.device) -> bool:
    """True where the fused kernel runs: a CUDA device and an importable Triton."""
    return runs_on(device, _kernel)


def verify_tree_greedy_fused(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
                             num_speculative_tokens: int):
    """TR-016 in one kernel: the arguments and results of
    :func:`refspec.speculative.tree.device.verify_tree_greedy_device`.

    ``candidates``, ``retrive_*`` int64 ``[B, N]``, ``target_predict`` int64 ``[B*N]`` (flat node
    ids index it), all contiguous on one CUDA device.  Returns ``predicts [B*N]``,
    ``accept_index [B, num_speculative_tokens]`` (-1 padded), ``accept_token_num [B]``, int64.
    Raises ValueError naming the argument for other shapes, dtypes, devices or layouts, and
    RuntimeError where :func:`available` is False.

    Fused twin of the torch rule :func:`refspec.speculative.tree.device.verify_tree_greedy_torch`.
    """
    if not available(candidates.device):
        raise RuntimeError("verify_tree_greedy_fused needs a CUDA tensor and Triton (see accept_kernel.available)")
    if candidates.dim() != 2:
        raise ValueError(f"verify_tree_greedy_fused: candidates must be [B, N], got {tuple(candidates.shape)}")
    B, N = candidates.shape
    S = int(num_speculative_tokens)
    if S < 1:
        raise ValueError(f"verify_tree_greedy_fused: num_speculative_tokens must be >= 1, got {S}")
    args = {"candidates": (candidates, (B, N)), "retrive_index": (retrive_index, (B, N)),
            "retrive_next_token": (retrive_next_token, (B, N)), "retrive_next_sibling": (retrive_next_sibling, (B, N)),
            "target_predict": (target_predict, (B * N,))}
    for name, (x, shape) in args.items():
        if tuple(x.shape) != shape or x.dtype != torch.long or x.device != candidates.device or not x.is_contiguous():
            raise ValueError(f"verify_tree_greedy_fused: {name} must be a contiguous int64 {list(shape)} on "
                             f"{candidates.device}, got {x.dtype} {tuple(x.shape)} on {x.device}")
    dev = candidates.device
    predicts = torch.zeros(B * N, dtype=torch.long, device=dev)
    accept_index = torch.full((B, S), -1, dtype=torch.long, device=dev)
    accept_num = torch.zeros(B, dtype=torch.long, device=dev)
    if B:
        _kernel()[(B,)](predicts, accept_index, accept_num, candidates, retrive_index, retrive_next_token,
                        retrive_next_sibling, target_predict, S=S, N=N)
    return predicts, accept_index, accept_num
