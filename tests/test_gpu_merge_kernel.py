"""TR-012's fused merge (refspec.fa3.merge_kernel) against the torch rule and a float64 textbook softmax.

GPU tests (``@pytest.mark.gpu``) run the Triton kernel on CUDA: random outputs and LSEs with
empty sides (LSE +inf / -inf), FA3's ``[H, T]`` LSE passed as its ``.T`` view, fp32 / fp16 /
bf16.  The CPU tests pin where the kernel is not used: :func:`merge_state` on a CPU tensor is
the torch rule (bitwise), and the fused entry point refuses CPU tensors with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from refspec.fa3 import merge_kernel
from refspec.fa3.tree_attention import merge_state, merge_state_torch


def _inputs(T, H, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    o1, o2 = (torch.randn(T, H, D, generator=g).to(dtype).to(device) for _ in range(2))
    l1, l2 = ((torch.randn(H, T, generator=g) * 4).to(device) for _ in range(2))  # FA3's [H, T]
    l1[0, 0] = float("inf")      # an empty prefix side as FA3 may report it
    l2[1 % H, 1 % T] = float("-inf")  # an empty expand side (another row)
    return o1, l1, o2, l2


def _textbook(o1, l1, o2, l2):
    """float64 softmax over the union of the two key sets, from the partial results."""
    l1, l2 = (torch.where(torch.isinf(x.double()), float("-inf"), x.double()) for x in (l1, l2))
    w = torch.softmax(torch.stack([l1, l2]), dim=0)
    return w[0][..., None] * o1.double() + w[1][..., None] * o2.double(), torch.logaddexp(l1, l2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 9, 64), (8, 9, 64), (37, 3, 48), (5, 2, 4)])
def test_fused_merge_equals_torch_rule_and_textbook(shape, dtype):
    T, H, D = shape
    o1, l1, o2, l2 = _inputs(T, H, D, dtype, "cuda")
    assert merge_kernel.available(o1.device)
    out, lse = merge_kernel.merge_state_fused(o1, l1.T, o2, l2.T)
    ref, ref_lse = merge_state_torch(o1, l1.T, o2, l2.T)
    book, book_lse = _textbook(o1, l1.T, o2, l2.T)
    assert out.dtype == dtype and out.shape == (T, H, D) and lse.shape == (T, H)
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = book.abs().amax().item()
    assert (out.double() - ref.double()).abs().max().item() <= ulp * max(1.0, scale)
    assert (out.double() - book).abs().max().item() <= 2 * ulp * max(1.0, scale)
    assert torch.allclose(lse.double(), ref_lse.double(), atol=1e-5, rtol=1e-6)
    assert torch.allclose(lse.double(), book_lse, atol=1e-5, rtol=1e-6)
    # the empty side has weight 0: row (0, 0) is the expand output alone
    torch.testing.assert_close(out[0, 0].float(), o2[0, 0].float(), atol=ulp, rtol=0)


@pytest.mark.gpu
def test_merge_state_runs_the_fused_kernel_on_cuda(monkeypatch):
    calls = []
    real = merge_kernel.merge_state_fused
    monkeypatch.setattr(merge_kernel, "merge_state_fused", lambda *a: calls.append(1) or real(*a))
    o1, l1, o2, l2 = _inputs(4, 2, 64, torch.bfloat16, "cuda")
    merge_state(o1, l1.T, o2, l2.T)
    assert calls == [1]


@pytest.mark.gpu
def test_fused_merge_names_a_bad_argument():
    o1, l1, o2, l2 = _inputs(4, 2, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="lse2 must be fp32"):
        merge_kernel.merge_state_fused(o1, l1.T, o2, l2)  # [H, T], not [T, H]
    with pytest.raises(ValueError, match="lse1 is on cpu"):
        merge_kernel.merge_state_fused(o1, l1.T.cpu(), o2, l2.T)
    with pytest.raises(ValueError, match="contiguous last"):
        merge_kernel.merge_state_fused(o1.transpose(1, 2).contiguous().transpose(1, 2), l1.T, o2, l2.T)


def test_merge_state_on_cpu_is_the_torch_rule():
    o1, l1, o2, l2 = _inputs(6, 3, 16, torch.float32, "cpu")
    assert not merge_kernel.available(torch.device("cpu"))
    out, lse = merge_state(o1, l1.T, o2, l2.T)
    ref, ref_lse = merge_state_torch(o1, l1.T, o2, l2.T)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    book, _ = _textbook(o1, l1.T, o2, l2.T)
    assert (out.double() - book).abs().max().item() < 1e-5


def test_fused_merge_refuses_cpu_tensors():
    o1, l1, o2, l2 = _inputs(2, 2, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="CUDA tensor and Triton"):
        merge_kernel.merge_state_fused(o1, l1.T, o2, l2.T)
