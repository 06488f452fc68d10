"""TR-016's fused greedy tree acceptance (refspec.speculative.tree.accept_kernel) against the torch
rule and the host port, on random trees.

GPU tests (``@pytest.mark.gpu``) run the Triton kernel on CUDA: random trees of every shape of
``tests/test_tree_device.py`` (top-k 2-4, depth 1-6, N up to 21, ties and orphans), targets that
follow a random path with probability 0, 0.5, 0.9 and 1 per level; the fused kernel, the tensor
rule on the same CUDA tensors and the host port give the same integers.  The CPU tests pin where
the kernel is not used: on a CPU tensor ``verify_tree_greedy_device`` is the tensor rule, and the
fused entry point refuses CPU tensors with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from test_tree_device import CASES, both_trees, target_along

from refspec.speculative.tree import accept_kernel
from refspec.speculative.tree.build import verify_tree_greedy
from refspec.speculative.tree.device import verify_tree_greedy_device, verify_tree_greedy_torch


def _args(host, N, S, tp, device):
    B = host["retrive_index"].shape[0]
    return tuple(x.to(device).contiguous() for x in (host["draft_tokens"].view(B, N), host["retrive_index"],
                                                     host["retrive_next_token"], host["retrive_next_sibling"], tp)) \
        + (S + 1,)


@pytest.mark.gpu
@pytest.mark.spec("TR-016", "TR-006")
@pytest.mark.parametrize("B,k,S,N", CASES)
def test_fused_accept_equals_the_torch_rule_and_the_host_port(B, k, S, N):
    for seed in range(3):
        host, _ = both_trees(B, k, S, N, [5 + 3 * b for b in range(B)], seed, (3, 0)[seed % 2])
        for hit in (0.0, 0.5, 0.9, 1.0):
            tp = target_along(host, N, seed, hit)
            want = verify_tree_greedy(*_args(host, N, S, tp, "cpu"))
            cuda = _args(host, N, S, tp, "cuda")
            fused = accept_kernel.verify_tree_greedy_fused(*cuda)
            rule = verify_tree_greedy_torch(*cuda)
            for w, f, r in zip(want, fused, rule):
                assert f.dtype == w.dtype and torch.equal(f.cpu(), w), (seed, hit)
                assert torch.equal(r.cpu(), w), (seed, hit)


@pytest.mark.gpu
def test_the_device_accept_runs_the_fused_kernel_on_cuda(monkeypatch):
    host, _ = both_trees(2, 4, 3, 8, [5, 9], 0, 3)
    args = _args(host, 8, 3, target_along(host, 8, 0, 0.9), "cuda")
    calls = []
    real = accept_kernel.verify_tree_greedy_fused
    monkeypatch.setattr(accept_kernel, "verify_tree_greedy_fused", lambda *a: calls.append(1) or real(*a))
    verify_tree_greedy_device(*args)
    assert calls == [1]


@pytest.mark.gpu
def test_fused_accept_names_a_bad_argument():
    host, _ = both_trees(2, 4, 3, 8, [5, 9], 0, 3)
    cand, ridx, nxt, sib, tp, S = _args(host, 8, 3, target_along(host, 8, 0, 0.5), "cuda")
    with pytest.raises(ValueError, match="target_predict must be a contiguous int64"):
        accept_kernel.verify_tree_greedy_fused(cand, ridx, nxt, sib, tp[:-1], S)
    with pytest.raises(ValueError, match="retrive_next_sibling must be a contiguous int64"):
        accept_kernel.verify_tree_greedy_fused(cand, ridx, nxt, sib.int(), tp, S)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        accept_kernel.verify_tree_greedy_fused(cand, ridx, nxt, sib, tp, 0)


def test_the_device_accept_on_cpu_is_the_torch_rule():
    host, _ = both_trees(3, 3, 4, 20, [5, 8, 11], 1, 0)
    args = _args(host, 20, 4, target_along(host, 20, 1, 0.9), "cpu")
    for d, r in zip(verify_tree_greedy_device(*args), verify_tree_greedy_torch(*args)):
        assert torch.equal(d, r)


def test_fused_accept_refuses_cpu_tensors():
    host, _ = both_trees(1, 2, 1, 2, [5], 0, 3)
    with pytest.raises(RuntimeError, match="needs a CUDA tensor and Triton"):
        accept_kernel.verify_tree_greedy_fused(*_args(host, 2, 1, target_along(host, 2, 0, 1.0), "cpu"))
