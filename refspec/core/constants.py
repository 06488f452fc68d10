"""Index constants of a round's tensor arithmetic, made once per shape and device and shared.

On a GPU every ``torch.arange`` / ``torch.full`` is a host launch; the rounds use the same few
constants every time (``0..N-1`` for a window, ``b * N`` for the kept rows, ``[N] * B`` for the
v2 draft extend's query rows), so they are built once and never written.
"""

from __future__ import annotations

import torch

_CONSTS: dict = {}


def const_arange(n: int, device, start: int = 0, step: int = 1) -> torch.Tensor:
    """``torch.arange(start, start + n * step, step)`` int64 ``[n]`` on ``device``, made once per
    shape and shared (never written)."""
    key = ("arange", torch.device(device), n, start, step)
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.arange(start, start + n * step, step, dtype=torch.long, device=device)
    return t


def const_full(n: int, value: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.full((n,), value, dtype=dtype)`` on ``device``, made once per (n, value, dtype) and
    shared (never written)."""
    key = ("full", torch.device(device), n, value, dtype)
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.full((n,), value, dtype=dtype, device=device)
    return t
