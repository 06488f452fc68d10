"""A pure-PyTorch emulator of the FA3 paged-KV kernel contract (``flash_attn_with_kvcache``).

It computes the way the kernel does, not the way the oracle does: keys are read *through the
page table*, in tiles, with an online (running max / running sum) softmax, and GQA is handled by
packing the query heads of one KV head together (FA3's pack-GQA), so its code shares nothing
with ``refspec.oracle`` beyond the rule it must reproduce.

What it reads (PA-007): for request b only page-table columns ``< ceil(K_b / P)`` and only keys
``< K_b``.  What it refuses (the real kernel's result is undefined there, so the emulator raises
an :class:`~refspec.core.invariants.InvariantError` naming the contract rule):

* a request with more query rows than ``max_seqlen_q`` (PA-010);
* a page table narrower than ``ceil(K_b / P)`` (PA-003);
* an argument that is not a tensor (e.g. ``cache_seqlens`` as a Python int), operands on
  different devices, wrong dtypes/shapes (q / k_cache / v_cache of different dtypes or shapes too), a negative
  ``cache_seqlens``, a read page id outside ``[0, NP)``, ``cu_seqlens_q`` not starting at 0 /
  decreasing / past ``T`` (PA-011).

Output rows not covered by ``cu_seqlens_q`` are NaN: the kernel never writes them, so they hold
whatever the output buffer held ("garbage"); NaN makes any use of them visible.

**MLA** (docs/mla.md).  ``qv [T, H, Dv]`` adds ``qv . v`` to every score (ML-005), so a value
cache of another head dim Dv (512) than the keys (64) is read both as V and as the second half
of the key; the output is Dv wide.  :func:`emulate_flash_attn_varlen_func` is the non-paged,
ragged ``flash_attn_varlen_func`` of the MLA prefill (ML-010), run here as a page-size-1 cache
over the ragged k / v.  Head dims D != Dv, or a ``qv`` call, must be a pair FA3 has a kernel for
(ML-006, :func:`fa3_dims_problem`): the emulator refuses the others, as :mod:`refspec.fa3.kernel`
does before a real kernel runs (where some of them would compute silently in a kernel of other
dims).  It takes fp32, which the real kernel does not.
"""

from __future__ import annotations

import torch

from refspec.core.invariants import InvariantError, require

TILE = 128  #: keys per tile of the online softmax (the kernel's n-block)


def _check_args(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q, qv=None):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                    ("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q)):
        require(isinstance(t, torch.Tensor), "PA-011",
                lambda: f"{name} must be a torch.Tensor (the kernel takes no Python numbers), got {type(t).__name__}")
    require(isinstance(max_seqlen_q, int) and not isinstance(max_seqlen_q, bool), "PA-011",
            lambda: f"max_seqlen_q must be a Python int, got {type(max_seqlen_q).__name__}")
    require(all(t.device == q.device for t in (k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q))
            and (qv is None or not isinstance(qv, torch.Tensor) or qv.device == q.device), "PA-011",
            lambda: "q, k_cache, v_cache, qv, cache_seqlens, page_table, cu_seqlens_q must share one device, got "
            + ", ".join(str(t.device) for t in (q, k_cache, v_cache, qv, cache_seqlens, page_table, cu_seqlens_q)
                        if isinstance(t, torch.Tensor)))
    require(q.dim() == 3 and k_cache.dim() == 4 and v_cache.dim() == 4
            and tuple(v_cache.shape[:3]) == tuple(k_cache.shape[:3]), "PA-011",
            lambda: f"q {tuple(q.shape)} must be [T, H, D], k_cache {tuple(k_cache.shape)} [NP, P, Hkv, D] and "
            f"v_cache {tuple(v_cache.shape)} [NP, P, Hkv, Dv] (the same pages and heads)")
    require(all(t.stride(-1) == 1 for t in (q, k_cache, v_cache)), "PA-011",
            f"q, k_cache, v_cache need a contiguous last dimension (FA3), strides {q.stride()}, "
            f"{k_cache.stride()}, {v_cache.stride()}")
    if qv is not None or v_cache.shape[-1] != q.shape[-1]:  # ML-006: FA3's kernels for D != Dv and qv
        dims = fa3_dims_problem(q.shape[-1], v_cache.shape[-1], qv is not None)
        require(dims is None, "ML-006", lambda: dims)
    if qv is not None:  # ML-005: qv is q's rows and heads, V's head dim, q's dtype (flash_api_stable.cpp)
        require(isinstance(qv, torch.Tensor) and tuple(qv.shape) == (*q.shape[:2], v_cache.shape[-1])
                and qv.dtype == q.dtype and qv.stride(-1) == 1, "ML-005",
                lambda: f"qv {tuple(qv.shape) if isinstance(qv, torch.Tensor) else type(qv).__name__} must be "
                f"[T, H, Dv] = {[*q.shape[:2], v_cache.shape[-1]]} in q's dtype {q.dtype}, last dim contiguous")
    require(q.is_floating_point() and q.dtype == k_cache.dtype == v_cache.dtype, "PA-011",
            f"q, k_cache, v_cache must share one floating dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    T, H, D = q.shape
    NP, P, Hkv, Dk = k_cache.shape
    require(Dk == D and Hkv > 0 and H % Hkv == 0, "PA-011", lambda: f"q {tuple(q.shape)} [T, H, D] vs k_cache "
            f"{tuple(k_cache.shape)} [NP, P, Hkv, D]: head_dim must match (D = {D}, {Dk}) and num_heads must be a "
            f"multiple of num_kv_heads (H = {H}, Hkv = {Hkv}; GQA)")
    require(cache_seqlens.dim() == 1, "PA-011", f"cache_seqlens must be [B], got {tuple(cache_seqlens.shape)}")
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q)):
        require(t.dtype == torch.int32, "PA-011", f"{name} must be int32, got {t.dtype}")
    require(page_table.numel() == 0 or page_table.stride(-1) == 1, "PA-011",
            f"page_table must have a contiguous last dimension, strides {page_table.stride()}")
    B = cache_seqlens.shape[0]
    require(page_table.dim() == 2 and page_table.shape[0] == B and cu_seqlens_q.shape[0] == B + 1, "PA-011",
            f"B={B}: page_table {tuple(page_table.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)}")
    cu = cu_seqlens_q.tolist()
    require(cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= T, "PA-011",
            f"cu_seqlens_q {cu} must start at 0, not decrease and end <= T={T}")
    K = cache_seqlens.tolist()
    require(all(k >= 0 for k in K), "PA-011", f"cache_seqlens {K} must be >= 0")
    return cu, K, P, NP


def fa3_dims_problem(head_dim: int, v_head_dim: int, qv: bool) -> str | None:
    """ML-006: None if FA3 has a kernel for q / k head dim D = ``head_dim`` and V head dim Dv =
    ``v_head_dim`` (with ``qv`` or without), else why not.

    D == Dv: any D <= 256.  D != Dv: only (D <= 64, Dv <= 512) or (128 < D <= 192, 96 < Dv <= 128)
    (``mha_fwd``'s host check, hopper/flash_api_stable.cpp L850); with ``qv``: D <= 64 and
    Dv >= 256 (L1095), the one kernel being hdim 64 / 512 (``run_mha_fwd_constexpr``, L321).
    DeepSeek: the qv call (64, 512) and the prefill (192, 128) pass; so do refspec's tiny test
    config's (16, 256) and (32, 16); a qv call at (16, 32) does not."""
    D, Dv = head_dim, v_head_dim
    if qv:
        ok = D <= 64 and 256 <= Dv <= 512
        need = "with qv, D <= 64 and 256 <= Dv <= 512"
    elif D == Dv:
        ok, need = D <= 256, "D <= 256"
    else:
        ok = (D <= 64 and Dv <= 512) or (128 < D <= 192 and 96 < Dv <= 128)
        need = "(D <= 64, Dv <= 512) or (128 < D <= 192, 96 < Dv <= 128)"
    return None if ok else f"FA3 has no kernel for head dims (D, Dv) = ({D}, {Dv}){' with qv' if qv else ''}: {need}"


def visible_keys(p: torch.Tensor, row: torch.Tensor, K, Q, left: int) -> torch.Tensor:
    """Bool ``[..., Q, n]``: which keys ``p [n]`` each query row ``row [..., Q, 1]`` sees (FA3's mask).

    Bottom-right causal (PA-004): row i sees key p iff ``p <= i + K - Q``; with a left window
    ``left = w >= 0`` also ``p >= i + K - Q - w``, so a row sees at most w + 1 keys (FA3's
    ``window_size = (w, 0)``, both edges inclusive, ``hopper/flash_attn_interface.py``).
    ``K`` / ``Q`` (keys, query rows: tokens) are ints, or tensors broadcasting against ``row``
    (one value per request: ``[B, 1, 1]``).
    """
    last = row + K - Q
    vis = p[None, :] <= last
    if left >= 0:
        vis &= p[None, :] >= last - left
    return vis


def _check_requests(cu, K_list, P, page_table, max_seqlen_q) -> None:
    """PA-010 / PA-003 of every request with query rows, in request order (module doc)."""
    for b, K in enumerate(K_list):
        Q, n_pages = cu[b + 1] - cu[b], -(-K // P)
        if Q == 0:
            continue
        require(Q <= max_seqlen_q, "PA-010", f"request {b} has {Q} query rows, max_seqlen_q={max_seqlen_q}")
        require(n_pages <= page_table.shape[1], "PA-003",
                f"request {b}: K={K} needs {n_pages} pages of {P}, page_table has {page_table.shape[1]} columns")


def emulate_flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, cu_seqlens_q,
                                    max_seqlen_q, softmax_scale=None, causal=True, window_size=(-1, -1),
                                    softcap=0.0, return_softmax_lse=False, qv=None):
    """Emulate ``flash_attn_interface.flash_attn_with_kvcache`` as SGLang calls it (no new k/v).

    Shapes: q ``[T, H, D]``; k_cache ``[NP, P, Hkv, D]``, v_cache ``[NP, P, Hkv, Dv]`` (Dv = D
    but for MLA; any strides with a contiguous last dim: MLA's two views of one row, ML-003);
    cache_seqlens int32 ``[B]`` (K_b, tokens); page_table int32 ``[B, M]`` (pages); cu_seqlens_q
    int32 ``[B+1]`` (rows); max_seqlen_q a Python int (frozen under CUDA graphs); qv ``[T, H, Dv]``
    or None (ML-005: the score of key p becomes ``scale * (q . k_p + qv . v_p)``).  Returns
    ``[T, H, Dv]`` in q.dtype, and the LSE ``[H, T]`` (fp32) if ``return_softmax_lse``.
    ``softmax_scale`` None is FA3's default ``(D + Dv)^-0.5`` with qv, ``D^-0.5`` without
    (``flash_attn_interface.py``; MLA never relies on it, ML-007).
    Raises: InvariantError PA-003, PA-010, PA-011, ML-005, ML-006 (see module doc).

    The requests run side by side, as the kernel's thread blocks do: request b's query rows are
    padded to the batch's longest query and masked.  Key tile j is ``TILE`` keys wide, keys
    ``TILE j .. TILE j + TILE - 1`` of every request, like the kernel's n-block: only keys
    ``p < K_b`` are gathered, through columns ``p // P < ceil(K_b / P)`` of b's page table
    (PA-007); the rest of the tile is zeros that the mask hides.  The tile width never depends
    on the other requests, so neither does a request's output (graph padding vs eager is T0;
    ``tests/test_emulator.py`` checks it).
    """
    cu, K_list, P, NP = _check_args(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q, qv)
    _check_requests(cu, K_list, P, page_table, max_seqlen_q)
    T, H, D = q.shape
    Hkv, Dv = k_cache.shape[2], v_cache.shape[-1]
    G = H // Hkv
    scale = (D + (Dv if qv is not None else 0)) ** -0.5 if softmax_scale is None else softmax_scale
    left = window_size[0]
    dev = q.device
    out = torch.full((T, H, Dv), float("nan"), dtype=torch.float32, device=dev)
    lse = torch.full((H, T), float("nan"), dtype=torch.float32, device=dev) if return_softmax_lse else None
    live = [b for b in range(len(K_list)) if cu[b + 1] > cu[b]]  # requests with query rows
    if not live:
        return (out.to(q.dtype), lse) if return_softmax_lse else out.to(q.dtype)
    Qs, Ks = [cu[b + 1] - cu[b] for b in live], [K_list[b] for b in live]
    Bl, Qm, n_tiles = len(live), max(Qs), -(-max(Ks) // TILE)
    Q_t = torch.tensor(Qs, device=dev)[:, None]  # [Bl, 1]
    K_t = torch.tensor(Ks, device=dev)[:, None]
    i = torch.arange(Qm, device=dev)[None, :]
    q_ok = i < Q_t  # [Bl, Qm]: a real query row
    qrows = (torch.tensor([cu[b] for b in live], device=dev)[:, None] + i)[q_ok]  # their rows of q / out
    # pack GQA: per (request, kv head) the query rows x group, [Bl, Hkv, Qm * G, D]
    q_at = q_ok.flatten().nonzero()[:, 0]  # their places in the padded [Bl * Qm] rows

    def pack(x):  # [T, H, d] -> [Bl, Hkv, Qm * G, d], the query rows of each (request, kv head)
        d = x.shape[-1]
        xb = torch.zeros((Bl * Qm, H, d), device=dev).index_copy_(0, q_at, x.index_select(0, qrows).float())
        return xb.view(Bl, Qm, Hkv, G, d).transpose(1, 2).reshape(Bl, Hkv, Qm * G, d)
    qb = pack(q)
    qvb = None if qv is None else pack(qv)  # ML-005: qv rows packed as q's
    # keys 0 .. n_keys - 1 of every request; only keys p < K_b are read, through the page
    # table (PA-007); the others stay zero and are masked
    n_keys = n_tiles * TILE
    p = torch.arange(n_keys, device=dev)
    k_ok = p[None, :] < K_t  # [Bl, n_keys]
    rb, kp = k_ok.nonzero(as_tuple=True)  # (request, key) of every key read
    pages = page_table[live].long()[rb, kp // P]  # columns < ceil(K_b / P) only
    bad = (pages < 0) | (pages >= NP)
    if bool(bad.any()):
        b = live[int(rb[bad.nonzero()[0, 0]])]
        raise InvariantError("PA-011", f"request {b}: page id outside [0, {NP}) in "
                             f"{page_table[b, :-(-K_list[b] // P)].tolist()}")
    slots = pages * P + kp % P  # slot = page * P + offset

    def gather(cache):  # [Bl, Hkv, n_keys, d]; zeros at p >= K_b
        d = cache.shape[-1]  # reshape: a view of the pool (MLA's strided views too: page stride = P x slot stride)
        flat = torch.zeros((Bl * n_keys, Hkv, d), device=dev)
        flat.index_copy_(0, rb * n_keys + kp, cache.reshape(-1, Hkv, d).index_select(0, slots).float())
        return flat.view(Bl, n_keys, Hkv, d).transpose(1, 2)

    keys, vals = gather(k_cache), gather(v_cache)
    m = torch.full((Bl, Hkv, Qm, G), float("-inf"), device=dev)
    l = torch.zeros((Bl, Hkv, Qm, G), device=dev)
    acc = torch.zeros((Bl, Hkv, Qm, G, Dv), device=dev)
    row, Kr, Qr = i[..., None], K_t[..., None], Q_t[..., None]  # [1, Qm, 1], [Bl, 1, 1], [Bl, 1, 1]
    for j in range(n_tiles):  # the online softmax over key tiles
        t = slice(j * TILE, (j + 1) * TILE)
        s = torch.matmul(qb, keys[:, :, t].transpose(-1, -2))
        if qvb is not None:  # ML-005: the value rows are the second half of the key
            s = s + torch.matmul(qvb, vals[:, :, t].transpose(-1, -2))
        s = s.view(Bl, Hkv, Qm, G, TILE) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        vis = k_ok[:, None, t]  # [Bl, 1, TILE] -> [Bl, Qm, TILE]
        if causal:
            vis = vis & visible_keys(p[t], row, Kr, Qr, left)
        s = s.masked_fill(~vis[:, None, :, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        w = torch.exp(s - safe[..., None])
        corr = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m - safe))
        l = l * corr + w.sum(-1)
        pv = torch.matmul(w.view(Bl, Hkv, Qm * G, TILE), vals[:, :, t]).view(Bl, Hkv, Qm, G, Dv)
        acc = acc * corr[..., None] + pv
        m = m_new
    # l == 0 only for rows with no visible key (PA-005); a NaN read keeps l NaN and shows
    o = torch.where(l[..., None] == 0, torch.zeros_like(acc), acc / l[..., None])
    out.index_copy_(0, qrows, o.transpose(1, 2).reshape(Bl * Qm, H, Dv).index_select(0, q_at))
    out = out.to(q.dtype)
    if not return_softmax_lse:
        return out
    row_lse = torch.where(l != 0, m + torch.log(l), torch.full_like(l, float("-inf")))
    lse.index_copy_(1, qrows, row_lse.transpose(1, 2).reshape(Bl * Qm, H).index_select(0, q_at).T)
    return out, lse


def emulate_flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                   return_softmax_lse=False):
    """Emulate FA3's ``flash_attn_varlen_func``: ragged, non-paged q / k / v (the MLA prefill, ML-010).

    Shapes: q ``[Tq, H, D]``; k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]``; cu_seqlens_q, cu_seqlens_k
    int32 ``[B+1]`` (row offsets: request b's queries are q rows ``cu_q[b]..cu_q[b+1]-1``, its keys
    k / v rows ``cu_k[b]..cu_k[b+1]-1``); max_seqlen_q, max_seqlen_k Python ints bounding every
    request's rows.  ``causal`` is bottom-right per request, as the paged call (PA-004): query i of
    a request with Q_b queries and K_b keys sees key p iff ``p <= i + K_b - Q_b``.  Returns
    ``[Tq, H, Dv]`` in q.dtype, and the LSE ``[H, Tq]`` (fp32) if ``return_softmax_lse``
    (SGLang transposes it to ``[Tq, H]``).

    The same kernel as :func:`emulate_flash_attn_with_kvcache`: k / v seen as a page-size-1 cache
    ``[Tk, 1, Hkv, d]`` whose page table row b is ``cu_k[b], cu_k[b] + 1, ...`` and whose
    ``cache_seqlens`` are ``diff(cu_k)``.
    Raises: InvariantError PA-011 (not tensors, int32 offsets of length B + 1 from 0, non-decreasing,
    inside q / k; k / v of other rows or heads; operands on different devices; ``max_seqlen_k``
    not a Python int), PA-010 (a request longer than ``max_seqlen_q`` or
    ``max_seqlen_k``), and the paged call's checks.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        require(isinstance(t, torch.Tensor), "PA-011", lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(k.dim() == 3 and v.dim() == 3 and tuple(v.shape[:2]) == tuple(k.shape[:2]), "PA-011",
            lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [Tk, Hkv, D] and [Tk, Hkv, Dv]")
    require(cu_seqlens_q.dtype == torch.int32 == cu_seqlens_k.dtype and cu_seqlens_q.dim() == 1
            and cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.shape[0] >= 1, "PA-011",
            lambda: f"cu_seqlens_q {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
            f"{cu_seqlens_k.dtype} {tuple(cu_seqlens_k.shape)} must be int32 [B + 1] (B >= 0)")
    require(k.device == q.device == v.device == cu_seqlens_q.device == cu_seqlens_k.device, "PA-011",
            lambda: f"q, k, v, cu_seqlens_q, cu_seqlens_k must share one device, got {q.device}, {k.device}, "
            f"{v.device}, {cu_seqlens_q.device}, {cu_seqlens_k.device}")
    cu_k = cu_seqlens_k.tolist()
    require(cu_k[0] == 0 and all(a <= b for a, b in zip(cu_k, cu_k[1:])) and cu_k[-1] <= k.shape[0], "PA-011",
            lambda: f"cu_seqlens_k {cu_k} must start at 0, not decrease and end <= Tk = {k.shape[0]}")
    require(isinstance(max_seqlen_k, int) and not isinstance(max_seqlen_k, bool), "PA-011",
            lambda: f"max_seqlen_k must be a Python int, got {type(max_seqlen_k).__name__} {max_seqlen_k!r}")
    K = [b - a for a, b in zip(cu_k, cu_k[1:])]
    require(max(K, default=0) <= max_seqlen_k, "PA-010",
            lambda: f"keys per request {K}, max_seqlen_k = {max_seqlen_k}: the bound on keys, as max_seqlen_q "
            "bounds the query rows")
    dev = k.device
    width = max(K, default=0) or 1
    table = torch.tensor(cu_k[:-1], dtype=torch.int32, device=dev)[:, None] + torch.arange(width, dtype=torch.int32,
                                                                                         device=dev)
    table = table.clamp(max=max(k.shape[0] - 1, 0))  # columns past K_b are never read (PA-007)
    return emulate_flash_attn_with_kvcache(
        q, k[:, None], v[:, None], cache_seqlens=torch.tensor(K, dtype=torch.int32, device=dev), page_table=table,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, return_softmax_lse=return_softmax_lse)
