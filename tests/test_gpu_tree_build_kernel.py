"""The tree's structure as one fused kernel (refspec.speculative.tree.build_kernel: TR-003 parents
and child lists, TR-004 ancestors, TR-005 depths) against the torch rule and the host port, on
random trees.

GPU tests (``@pytest.mark.gpu``) run the Triton kernel on CUDA: random S-step expansions of every
shape of ``tests/test_tree_device.py`` (top-k 2-4, S 1-6, N up to 21) with five tie levels, the
one-hot level making orphans (TR-003); the fused kernel, the tensor rule on the same CUDA tensors
and the host port :func:`refspec.speculative.tree.build.build_tree` give the same parents, child
lists, ancestor rows and depths.  The CPU tests pin where the kernel is not used: on a CPU tensor
``tree_structure`` is the tensor rule, and the fused entry point refuses CPU tensors with a clear
error.  (Before the GPU: the same comparison under Triton's interpreter, ``TRITON_INTERPRET=1``,
180 random trees, ``benchmarks/results/h200_peer5.md``; on every ``make triton-check`` now:
``tests/test_triton_interpret.py``.)
"""

from __future__ import annotations

import random

import pytest
import torch
from test_tree_device import CASES, random_draft

from refspec.speculative.tree import build_kernel
from refspec.speculative.tree.build import build_tree, organize_draft_results
from refspec.speculative.tree.device import tree_structure, tree_structure_torch

NAMES = ("parents", "retrive_next_token", "retrive_next_sibling", "ancestors", "depth")


def _inputs(B, k, S, N, seed, levels, device):
    sl, tl, pl = random_draft(B, k, S, seed, levels)
    parent_list, top, draft_tokens = organize_draft_results(sl, tl, pl, N)
    return parent_list.long().to(device).contiguous(), top.long().to(device).contiguous(), draft_tokens


@pytest.mark.gpu
@pytest.mark.spec("TR-003", "TR-004", "TR-005")
@pytest.mark.parametrize("B,k,S,N", CASES)
@pytest.mark.parametrize("levels", [0, 1, 2, 5, 1000])
def test_fused_structure_equals_the_torch_rule_and_the_host_port(B, k, S, N, levels):
    for seed in range(4):
        parent_list, top, draft_tokens = _inputs(B, k, S, N, seed, levels, "cuda")
        fused = build_kernel.tree_structure_fused(parent_list, top, k)
        rule = tree_structure_torch(parent_list, top, k)
        for name, f, r in zip(NAMES, fused, rule):
            assert f.dtype == r.dtype and f.shape == r.shape and torch.equal(f.cpu(), r.cpu()), (seed, name)
        Ls = [random.Random(seed * 7 + b).randrange(1, 40) for b in range(B)]
        host = build_tree(torch.zeros(B, dtype=torch.long), parent_list.cpu(), top.cpu(), draft_tokens,
                          torch.tensor(Ls), k, N)
        assert fused[0].tolist() == host["parents"]
        assert torch.equal(fused[1].cpu(), host["retrive_next_token"])
        assert torch.equal(fused[2].cpu(), host["retrive_next_sibling"])
        want_pos = torch.tensor(Ls)[:, None] + fused[4].cpu()
        assert torch.equal(want_pos.flatten(), host["positions"]), seed


@pytest.mark.gpu
def test_the_device_structure_runs_the_fused_kernel_on_cuda(monkeypatch):
    parent_list, top, _ = _inputs(2, 4, 3, 8, 0, 3, "cuda")
    calls = []
    real = build_kernel.tree_structure_fused
    monkeypatch.setattr(build_kernel, "tree_structure_fused", lambda *a: calls.append(1) or real(*a))
    tree_structure(parent_list, top, 4)
    assert calls == [1]


@pytest.mark.gpu
def test_fused_structure_names_a_bad_argument():
    parent_list, top, _ = _inputs(2, 4, 3, 8, 0, 3, "cuda")
    with pytest.raises(ValueError, match="top_scores_index must be a contiguous int64"):
        build_kernel.tree_structure_fused(parent_list, top.int(), 4)
    with pytest.raises(ValueError, match=r"parent_list must have 0 or 1 \+ \(S-1\) k columns"):
        build_kernel.tree_structure_fused(parent_list[:, :-1].contiguous(), top, 4)
    with pytest.raises(ValueError, match=r"parent_list \[B, P\] and top_scores_index \[B, N-1\]"):
        build_kernel.tree_structure_fused(parent_list[:1], top, 4)


def test_the_device_structure_on_cpu_is_the_torch_rule():
    parent_list, top, _ = _inputs(3, 3, 4, 20, 1, 0, "cpu")
    for d, r in zip(tree_structure(parent_list, top, 3), tree_structure_torch(parent_list, top, 3)):
        assert torch.equal(d, r)


def test_fused_structure_refuses_cpu_tensors():
    parent_list, top, _ = _inputs(1, 2, 1, 2, 0, 3, "cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA tensor and Triton"):
        build_kernel.tree_structure_fused(parent_list, top, 2)
