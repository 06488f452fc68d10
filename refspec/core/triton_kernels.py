"""Where the fused GPU kernels come from (TR-012's merge, :mod:`refspec.fa3.merge_kernel`; TR-016's
tree acceptance, :mod:`refspec.speculative.tree.accept_kernel`): Triton, jitted once on first use,
and used only where it can run, a CUDA device with an importable Triton (CUDA builds of torch ship
it).  Elsewhere each has its torch rule.
"""

from __future__ import annotations

import functools

import torch


def triton_kernel(build):
    """Decorator: ``build(triton, tl)`` returns the jitted kernel(s); the decorated function, called
    with no argument, returns them (built once) or None where Triton cannot be imported."""
    @functools.lru_cache(maxsize=None)
    @functools.wraps(build)
    def get():
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)
    return get


def runs_on(device: torch.device, kernel) -> bool:
    """True where ``kernel`` (a :func:`triton_kernel`) runs: a CUDA device and an importable Triton."""
    return torch.device(device).type == "cuda" and kernel() is not None
