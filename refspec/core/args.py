"""Argument checks shared by the public entry points: a ValueError that names the argument.

Bad *values* of well-typed arguments are the invariants' business (an ``InvariantError`` naming
the rule); these helpers catch the *kind* of argument first (None, a bool or float where a
count goes, a list with junk in it, a tensor of the wrong rank), so that no entry point fails
with a TypeError / IndexError from deep inside PyTorch.  Bools are not counts.
"""

from __future__ import annotations

from numbers import Integral

import torch

from refspec.core.invariants import InvariantError


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


def tree_args(topk, num_steps, num_draft_tokens=None) -> int:
    """N, the tokens verified per request (root included), of k = ``topk`` branches per draft step
    and Sd = ``num_steps`` steps: the one check of the tree arguments (``generate``, the oracle
    tree loop, :class:`~refspec.speculative.tree.engine.TreeEngine`, the command line).

    k = 1 (a chain): N = Sd + 1; ``num_draft_tokens`` None or that (SD-010).
    k > 1 (a tree): N given, ``2 <= N <= 1 + k + (Sd-1) k^2`` (every draft a candidate, TR-002).
    Raises: ValueError naming ``topk`` / ``num_steps`` / ``num_draft_tokens`` (not an int >= 1);
    InvariantError SD-010 / TR-002 (a ValueError too) for an N the rule refuses.
    """
    k, S = count("topk (k)", topk, 1), count("num_steps (Sd)", num_steps, 1)
    if num_draft_tokens is not None and not is_int(num_draft_tokens):
        raise ValueError(f"num_draft_tokens (N) must be None or an int, got {num_draft_tokens!r}")
    if k == 1:
        if num_draft_tokens not in (None, S + 1):
            raise InvariantError("SD-010", f"topk = 1 verifies N = Sd + 1 = {S + 1} tokens, "
                                 f"got num_draft_tokens={num_draft_tokens!r}")
        return S + 1
    most = k + (S - 1) * k * k  # candidates Sd steps produce (refspec.oracle.tree.max_drafts)
    if num_draft_tokens is None:
        raise ValueError(f"topk = {k} > 1 needs num_draft_tokens (N, root included), 2 <= N <= 1 + k + (Sd-1) k^2 "
                         f"= {1 + most}")
    if not 2 <= num_draft_tokens <= most + 1:
        raise InvariantError("TR-002", f"num_draft_tokens N = {num_draft_tokens!r} must satisfy 2 <= N and "
                             f"N - 1 <= k + (Sd-1) k^2 = {k} + {S - 1}*{k}^2 = {most}")
    return int(num_draft_tokens)
