"""Reference paged attention: gather each request's keys *by slot* through ``req_to_token``.

The oracle never reads a page table: key ``p`` of request ``b`` is the flat slot
``req_to_token[r_b, p]``, so the FA3 wing's page table (PA-002) is checked independently of it.

Two entry points, one rule:

* :func:`attention_by_position`, the paged oracle's: request b owns query rows
  ``cu_q[b] .. cu_q[b+1]-1``; the row at position t sees the request's keys ``p = 0 .. t``
  (and ``p >= t - w`` with a left window w);
* :func:`attention_by_slot`, the kernel-shaped form (FA docstring "aligned bottom-right"): with
  K_b keys, row i sees key p iff ``p <= i + K_b - q_b`` (PA-004), i.e. row i sits at position
  ``K_b - q_b + i``, and, with a left window w, ``p >= i + K_b - q_b - w``.

Both then apply the same three rules:

* a row that sees no key outputs exactly 0 (PA-005);
* query head h reads KV head ``h // (H / Hkv)`` (PA-006);
* scores ``s = scale * q.k``, softcap ``c * tanh(s / c)`` when ``c > 0``, softmax, weighted V.

**First reading:** the two functions' bodies; skip ``_check_kernel_args`` (the argument contract,
PA-011) and, on a first pass, the window and softcap options (only sliding-window and softcapped
layers set them: tests/test_window.py).
"""

from __future__ import annotations

import torch
from einops import einsum, repeat

from refspec.core.args import int_list
from refspec.core.invariants import InvariantError, require


def _check_kernel_args(q, k_flat, v_flat, req_to_token, req_pool_indices, cache_seqlens, cu_seqlens_q):
    """The kernel's argument contract (PA-011) for :func:`attention_by_slot`; returns the rows,
    the key counts K_b and ``cu_seqlens_q`` as Python int lists."""
    for name, t in (("q", q), ("k_flat", k_flat), ("v_flat", v_flat), ("req_to_token", req_to_token)):
        require(isinstance(t, torch.Tensor), "PA-011", lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(q.is_floating_point() and k_flat.is_floating_point() and v_flat.is_floating_point(), "PA-011",
            lambda: f"q, k_flat, v_flat must be floating tensors, got {q.dtype}, {k_flat.dtype}, {v_flat.dtype}")
    require(req_to_token.dim() == 2 and not req_to_token.is_floating_point(), "PA-011",
            lambda: f"req_to_token must be an integer [max_reqs, ctx] tensor, got {req_to_token.dtype} "
            f"{tuple(req_to_token.shape)}")
    require(q.dim() == 3 and k_flat.dim() == 3 and tuple(v_flat.shape) == tuple(k_flat.shape), "PA-011",
            lambda: f"q {tuple(q.shape)} must be [T, H, D], k_flat {tuple(k_flat.shape)} and v_flat "
            f"{tuple(v_flat.shape)} the same [NS, Hkv, D]")
    T, H, D = q.shape
    Hkv = k_flat.shape[1]
    require(k_flat.shape[2] == D and Hkv > 0 and H % Hkv == 0, "PA-011",
            f"q {tuple(q.shape)} vs k_flat {tuple(k_flat.shape)}: head dims differ or H is not a multiple of Hkv")
    try:
        cu = int_list("cu_seqlens_q", cu_seqlens_q)
        rows, K_all = int_list("req_pool_indices", req_pool_indices), int_list("cache_seqlens", cache_seqlens)
    except ValueError as e:  # the kernel's argument contract: name it
        raise InvariantError("PA-011", str(e)) from None
    require(len(cu) > 0, "PA-011", "cu_seqlens_q is empty (need B+1 entries from 0)")
    require(len(rows) == len(K_all) and len(cu) == len(rows) + 1 and cu[0] == 0
            and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= T, "PA-011",
            f"B = {len(rows)} rows, {len(K_all)} lengths, cu_seqlens_q {cu} (need B+1 entries from 0, "
            f"non-decreasing, ending <= T = {T})")
    R, W = req_to_token.shape
    require(all(0 <= r < R for r in rows) and all(0 <= k <= W for k in K_all), "PA-011",
            f"rows {rows} must lie in [0, {R}) and cache_seqlens {K_all} in [0, {W}]")
    return rows, K_all, cu


def attention_by_slot(q, k_flat, v_flat, req_to_token, req_pool_indices, cache_seqlens, cu_seqlens_q,
                      *, softmax_scale=None, window_left=-1, softcap=0.0, upcast=True, out_dtype=None):
    """Attention for a batch of requests over a paged pool, keys gathered by slot.

    Shapes:
        q: ``[T, H, D]``; k_flat, v_flat: ``[NP*P, Hkv, D]`` (the pool's slot view);
        req_to_token: ``[max_reqs, ctx]`` int32 (tokens -> slots).
        req_pool_indices, cache_seqlens (K_b, tokens): length-B sequences of ints;
        cu_seqlens_q: length B+1 ints (rows).
        returns ``[T, H, D]`` in ``out_dtype`` (default ``q.dtype``; pass ``torch.float32``
        to keep the unrounded truth); rows outside ``cu_seqlens_q`` are 0.
    Args:
        softmax_scale: default ``D ** -0.5``.  window_left: w (tokens) or -1.
        softcap: c, 0 disables.
        upcast: compute in fp32 (the truth).  ``False`` computes in ``q.dtype``: the error that
            this low-precision run makes is the budget unit of tolerance tier T1 (TOL-002).
    Raises: InvariantError PA-011 (the same argument contract as the kernel's: shapes, GQA
    ratio, ``cu_seqlens_q`` of length B+1 from 0 non-decreasing to ``<= T``, ``0 <= K_b <=``
    the ``req_to_token`` width, rows inside ``req_to_token``).
    """
    rows, K_all, cu = _check_kernel_args(q, k_flat, v_flat, req_to_token, req_pool_indices, cache_seqlens,
                                         cu_seqlens_q)
    T = q.shape[0]
    # bottom-right alignment = row i of request b sits at position K_b - q_b + i
    positions = [K - (cu[b + 1] - cu[b]) + i for b, K in enumerate(K_all) for i in range(cu[b + 1] - cu[b])]
    positions += [-1] * (T - len(positions))  # rows outside cu_seqlens_q see nothing: 0
    return attention_by_position(q, k_flat, v_flat, req_to_token, rows, cu, positions, softmax_scale=softmax_scale,
                                 window_left=window_left, softcap=softcap, upcast=upcast, out_dtype=out_dtype)


def attention_by_position(q, k_flat, v_flat, req_to_token, req_pool_indices, cu_seqlens_q, positions,
                          *, softmax_scale=None, window_left=-1, softcap=0.0, upcast=True, out_dtype=None):
    """Attention where each query row's own position says what it sees (the paged oracle's rule).

    Request b owns rows ``cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1``; row i, at position
    ``t = positions[i]`` (tokens), sees its request's keys ``p = 0 .. t`` (and ``p >= t - w``
    with a left window w), key p being the slot ``req_to_token[r_b, p]``.  No key count, no
    page table: a row at a negative position sees nothing and outputs 0 (PA-005).

    Shapes: q ``[T, H, D]``; k_flat ``[NS, Hkv, D]``; v_flat ``[NS, Hkv, Dv]`` (Dv = D but for MLA,
    :mod:`refspec.oracle.mla`); req_to_token ``[R, ctx]`` int32; req_pool_indices B ints;
    cu_seqlens_q B+1 ints; positions T ints.  Returns ``[T, H, Dv]``.
    Raises: InvariantError PA-011 (q / k head dims that differ, k / v of other slots or heads, H
    not a multiple of Hkv, ``cu_seqlens_q`` not B + 1 offsets from 0 to T, a position past the
    ``req_to_token`` width, a row outside it, or ``positions`` not of length T).
    """
    T, H, D = q.shape
    Hkv, Dv = k_flat.shape[1], v_flat.shape[-1]
    require(k_flat.shape[2] == D and tuple(v_flat.shape[:2]) == tuple(k_flat.shape[:2]) and Hkv > 0
            and H % Hkv == 0, "PA-011", f"q {tuple(q.shape)} vs k_flat {tuple(k_flat.shape)}, v_flat "
            f"{tuple(v_flat.shape)}: q / k head dims differ, k / v differ in slots or heads, or H is not a "
            "multiple of Hkv")
    cu, rows, pos = [int(x) for x in cu_seqlens_q], [int(r) for r in req_pool_indices], [int(t) for t in positions]
    R, W = req_to_token.shape
    require(len(cu) == len(rows) + 1 and cu[0] == 0 and cu[-1] == T and all(a <= b for a, b in zip(cu, cu[1:])),
            "PA-011", lambda: f"cu_seqlens_q {cu} must be B + 1 = {len(rows) + 1} non-decreasing offsets "
            f"from 0 to T = {T}")
    require(len(pos) == T and all(t < W for t in pos) and all(0 <= r < R for r in rows), "PA-011",
            lambda: f"{len(pos)} positions for T = {T} rows (max {max(pos, default=-1)}, req_to_token width {W}); "
            f"rows {rows} in [0, {R})")
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    cdt = torch.float32 if upcast else q.dtype
    out = torch.zeros((T, H, Dv), dtype=cdt, device=q.device)
    for b, r in enumerate(rows):
        t = torch.as_tensor(pos[cu[b]:cu[b + 1]], device=q.device)[:, None]  # [Q, 1] each row's position
        K = int(t.max()) + 1 if t.numel() else 0
        if K <= 0:
            continue
        slots = req_to_token[r, :K].long()  # the request's keys 0 .. max t, by slot
        k = repeat(k_flat[slots].to(cdt), "k hkv d -> k (hkv g) d", g=H // Hkv)
        v = repeat(v_flat[slots].to(cdt), "k hkv d -> k (hkv g) d", g=H // Hkv)
        qb = q[cu[b]:cu[b + 1]].to(cdt)
        s = einsum(qb, k, "i h d, p h d -> h i p") * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        p = torch.arange(K, device=q.device)[None, :]
        visible = p <= t  # row at position t sees keys 0..t of its own request
        if window_left >= 0:
            visible &= p >= t - window_left
        s = s.masked_fill(~visible, float("-inf"))
        prob = torch.softmax(s, dim=-1)
        prob = torch.where(visible, prob, torch.zeros((), dtype=cdt, device=q.device))  # empty rows -> 0
        out[cu[b]:cu[b + 1]] = einsum(prob, v, "h i p, p h d -> i h d")
    return out.to(out_dtype or q.dtype)
