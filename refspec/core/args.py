"""Argument checks shared by the public entry points: a ValueError that names the argument.

Bad *values* of well-typed arguments are the invariants' business (an ``InvariantError`` naming
the rule); these helpers catch the *kind* of argument first (None, a bool or float where a
count goes, a list with junk in it, a tensor of the wrong rank), so that no entry point fails
with a TypeError / IndexError from deep inside PyTorch.  Bools are not counts.
"""

from __future__ import annotations

from numbers import Integral

import torch


def is_int(n) -> bool:
    """A Python / numpy integer (not a bool), or a 0-d integer tensor is *not* one (use .item())."""
    return type(n) is int or (isinstance(n, Integral) and not isinstance(n, bool))  # the common case first


def count(name: str, n, least: int = 0) -> int:
    """``n`` as an int >= ``least``; ValueError naming ``name`` otherwise."""
    if not is_int(n) or n < least:
        raise ValueError(f"{name} must be an int >= {least}, got {n!r}")
    return int(n)


def int_list(name: str, xs, length: int | None = None, least: int | None = None) -> list[int]:
    """``xs`` (a list / tuple of ints, or a 1-D integer tensor) as a list of Python ints.

    ValueError naming ``name``: not a sequence, an item that is not an int (or a bool), a length
    other than ``length``, an item below ``least``.
    """
    if isinstance(xs, torch.Tensor):
        if xs.dim() != 1 or xs.is_floating_point() or xs.is_complex() or xs.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints, got {xs.dtype} "
                             f"shape {tuple(xs.shape)}")
        out = xs.tolist()
    elif isinstance(xs, (list, tuple)):
        bad = [x for x in xs if not is_int(x)]
        if bad:
            raise ValueError(f"{name} must hold ints, got {bad[0]!r} in {list(xs)!r}")
        out = [int(x) for x in xs]
    else:
        raise ValueError(f"{name} must be a list of ints, got {type(xs).__name__} {xs!r}")
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length}")
    if least is not None and any(x < least for x in out):
        raise ValueError(f"{name} entries must be >= {least}, got {out}")
    return out


def tensor(name: str, t, dim: int | None = None, integer: bool | None = None) -> torch.Tensor:
    """``t`` if it is a tensor of rank ``dim`` (and integer / floating as asked); ValueError otherwise."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(t.shape)}")
    if integer is not None:
        is_integer = not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool
        if is_integer != integer:
            raise ValueError(f"{name} must be {'an integer' if integer else 'a floating'} tensor, got {t.dtype}")
    return t


def allocate(what: str, make):
    """``make()`` (a tensor allocation); ValueError naming ``what`` (the sizes) if it cannot be had."""
    try:
        return make()
    except (RuntimeError, MemoryError) as e:  # torch reports an impossible allocation as RuntimeError
        raise ValueError(f"{what}: cannot allocate ({str(e).splitlines()[0][:120]})") from None
