"""TR-012's merge as ONE fused GPU kernel (Triton), the production path's ``merge_state_v2``.

Upstream's cascade attention merges the prefix and expand halves with ``sgl_kernel.merge_state_v2``,
a single CUDA kernel per layer.  The rule written in torch
(:func:`refspec.fa3.tree_attention.merge_state_torch`) is ~20 elementwise kernels per call; in a
30-layer TARGET_VERIFY graph that was ~600 launches per tree round; with this kernel the tree round's
GPU time on the H200 went from ~4.3 to 2.66 ms (benchmarks/results/h200_peer3.md).  This kernel
computes the same formula, per (token, head) row::

    l1, l2 := -inf where +-inf              (an empty side gets weight 0)
    m = max(l1, l2), 0 where -inf
    w1, w2 = exp(l1 - m), exp(l2 - m)
    o = (o1 w1 + o2 w2) / (w1 + w2)         (fp32, stored in o1.dtype)
    lse = m + log(w1 + w2)

It reads the LSE through its strides, so FA3's ``[H, T]`` LSE is passed as the ``.T`` view without
the copies upstream's ``lse.T.contiguous()`` makes (the CUDA kernel wants contiguous input).
Equal to the torch rule up to fp32 rounding of ``exp`` / ``log`` (``tests/test_gpu_merge_kernel.py``).

Available where Triton is (CUDA builds of torch ship it); :func:`available` says so, and
:func:`refspec.fa3.tree_attention.merge_state` falls back to the torch rule elsewhere.
Upstream: the FA3 backend calls ``sgl_kernel.merge_state_v2`` (a CUDA kernel) in
``python/sglang/srt/layers/attention/flashattention_backend.py``; SGLang's own Triton kernel of the same op,
its fallback where that CUDA kernel does not apply, is ``merge_state_triton`` in
``python/sglang/srt/layers/attention/triton_ops/merge_state.py`` (dispatch:
``python/sglang/srt/layers/attention/merge_state.py``).
"""

from __future__ import annotations

import torch

from refspec.core.triton_kernels import runs_on, triton_kernel


@triton_kernel
def _kernel(triton, tl):
    """The jitted merge kernel and ``triton.next_power_of_2``."""
    @triton.jit
    def merge(o1, o2, out, l1p, l2p, lse_out,
              s1t, s1h, s2t, s2h, sot, soh, sl1t, sl1h, sl2t, sl2h, H,
              D: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        l1 = tl.load(l1p + t * sl1t + h * sl1h).to(tl.float32)
        l2 = tl.load(l2p + t * sl2t + h * sl2h).to(tl.float32)
        neg = float("-inf")
        l1 = tl.where((l1 == float("inf")) | (l1 == neg), neg, l1)
        l2 = tl.where((l2 == float("inf")) | (l2 == neg), neg, l2)
        m = tl.maximum(l1, l2)
        m = tl.where(m == neg, 0.0, m)
        w1 = tl.exp(l1 - m)
        w2 = tl.exp(l2 - m)
        den = w1 + w2
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        a = tl.load(o1 + t * s1t + h * s1h + offs, mask=mask).to(tl.float32)
        b = tl.load(o2 + t * s2t + h * s2h + offs, mask=mask).to(tl.float32)
        r = (a * w1 + b * w2) / den
        tl.store(out + t * sot + h * soh + offs, r.to(out.dtype.element_ty), mask=mask)
        tl.store(lse_out + t * H + h, m + tl.log(den))

    return merge, triton.next_power_of_2


def available(device: torch.device) -> bool:
    """True where the fused kernel runs: a CUDA device and an importable Triton."""
    return runs_on(device, _kernel)


def merge_state_fused(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """TR-012 in one kernel: ``(o [T, H, D] in o1.dtype, lse [T, H] fp32)``.

    ``o1, o2 [T, H, D]`` on one CUDA device with a contiguous last dim; ``lse1, lse2 [T, H]``
    fp32, any strides (FA3's ``lse.T`` view), on the same device.  Raises ValueError naming the
    argument for other shapes, dtypes or devices, and RuntimeError where :func:`available` is False.

    Fused twin of the torch rule :func:`refspec.fa3.tree_attention.merge_state_torch`.
    """
    if not available(o1.device):
        raise RuntimeError("merge_state_fused needs a CUDA tensor and Triton (see merge_kernel.available)")
    merge, pow2 = _kernel()
    if o1.dim() != 3 or o2.shape != o1.shape:
        raise ValueError(f"merge_state_fused: o1 {tuple(o1.shape)} and o2 {tuple(o2.shape)} must both be [T, H, D]")
    T, H, D = o1.shape
    for name, lse in (("lse1", lse1), ("lse2", lse2)):
        if lse.shape != (T, H) or lse.dtype != torch.float32:
            raise ValueError(f"merge_state_fused: {name} must be fp32 [T, H] = [{T}, {H}], got "
                             f"{lse.dtype} {tuple(lse.shape)}")
    for name, x in (("o2", o2), ("lse1", lse1), ("lse2", lse2)):
        if x.device != o1.device:
            raise ValueError(f"merge_state_fused: {name} is on {x.device}, o1 on {o1.device}: all on one device")
    if o1.stride(2) != 1 or o2.stride(2) != 1:
        raise ValueError("merge_state_fused: o1 and o2 need a contiguous last (head_dim) dim")
    out = torch.empty_like(o1, memory_format=torch.contiguous_format)
    lse = torch.empty(T, H, dtype=torch.float32, device=o1.device)
    if T:
        merge[(T, H)](o1, o2, out, lse1, lse2, lse, o1.stride(0), o1.stride(1), o2.stride(0), o2.stride(1),
                      out.stride(0), out.stride(1), lse1.stride(0), lse1.stride(1), lse2.stride(0),
                      lse2.stride(1), H, D=D, BLOCK_D=pow2(D))
    return out, lse
