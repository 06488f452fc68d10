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
* an argument that is not a tensor (e.g. ``cache_seqlens`` as a Python int), wrong
  dtypes/shapes (q / k_cache / v_cache of different dtypes or shapes too), a negative
  ``cache_seqlens``, a read page id outside ``[0, NP)``, ``cu_seqlens_q`` not starting at 0 /
  decreasing / past ``T`` (PA-011).

Output rows not covered by ``cu_seqlens_q`` are NaN: the kernel never writes them, so they hold
whatever the output buffer held ("garbage"); NaN makes any use of them visible.
"""

from __future__ import annotations

import torch

from refspec.core.invariants import InvariantError, require

TILE = 128  #: keys per tile of the online softmax (the kernel's n-block)


def _check_args(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                    ("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q)):
        require(isinstance(t, torch.Tensor), "PA-011",
                lambda: f"{name} must be a torch.Tensor (the kernel takes no Python numbers), got {type(t).__name__}")
    require(isinstance(max_seqlen_q, int) and not isinstance(max_seqlen_q, bool), "PA-011",
            lambda: f"max_seqlen_q must be a Python int, got {type(max_seqlen_q).__name__}")
    require(q.dim() == 3 and k_cache.dim() == 4 and tuple(v_cache.shape) == tuple(k_cache.shape), "PA-011",
            lambda: f"q {tuple(q.shape)} must be [T, H, D], k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} the same [NP, P, Hkv, D]")
    require(all(t.stride(-1) == 1 for t in (q, k_cache, v_cache)), "PA-011",
            f"q, k_cache, v_cache need a contiguous last dimension (FA3), strides {q.stride()}, "
            f"{k_cache.stride()}, {v_cache.stride()}")
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
                                    softcap=0.0, return_softmax_lse=False):
    """Emulate ``flash_attn_interface.flash_attn_with_kvcache`` as SGLang calls it (no new k/v).

    Shapes: q ``[T, H, D]``; k_cache, v_cache ``[NP, P, Hkv, D]``; cache_seqlens int32 ``[B]``
    (K_b, tokens); page_table int32 ``[B, M]`` (pages); cu_seqlens_q int32 ``[B+1]`` (rows);
    max_seqlen_q a Python int (frozen under CUDA graphs).  Returns ``[T, H, D]`` in q.dtype, and
    the LSE ``[H, T]`` (fp32) if ``return_softmax_lse``.
    Raises: InvariantError PA-003, PA-010, PA-011 (see module doc).

    The requests run side by side, as the kernel's thread blocks do: request b's query rows are
    padded to the batch's longest query and masked.  Key tile j is ``TILE`` keys wide, keys
    ``TILE j .. TILE j + TILE - 1`` of every request, like the kernel's n-block: only keys
    ``p < K_b`` are gathered, through columns ``p // P < ceil(K_b / P)`` of b's page table
    (PA-007); the rest of the tile is zeros that the mask hides.  The tile width never depends
    on the other requests, so neither does a request's output (graph padding vs eager is T0;
    ``tests/test_emulator.py`` checks it).
    """
    cu, K_list, P, NP = _check_args(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q)
    _check_requests(cu, K_list, P, page_table, max_seqlen_q)
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    left = window_size[0]
    dev = q.device
    out = torch.full((T, H, D), float("nan"), dtype=torch.float32, device=dev)
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
    qb = torch.zeros((Bl * Qm, H, D), device=dev).index_copy_(0, q_at, q.index_select(0, qrows).float())
    qb = qb.view(Bl, Qm, Hkv, G, D).transpose(1, 2).reshape(Bl, Hkv, Qm * G, D)
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

    def gather(cache):  # [Bl, Hkv, n_keys, D]; zeros at p >= K_b
        flat = torch.zeros((Bl * n_keys, Hkv, D), device=dev)
        flat.index_copy_(0, rb * n_keys + kp, cache.reshape(-1, Hkv, D).index_select(0, slots).float())
        return flat.view(Bl, n_keys, Hkv, D).transpose(1, 2)

    keys, vals = gather(k_cache), gather(v_cache)  # reshape: a view of the (contiguous) pool
    m = torch.full((Bl, Hkv, Qm, G), float("-inf"), device=dev)
    l = torch.zeros((Bl, Hkv, Qm, G), device=dev)
    acc = torch.zeros((Bl, Hkv, Qm, G, D), device=dev)
    row, Kr, Qr = i[..., None], K_t[..., None], Q_t[..., None]  # [1, Qm, 1], [Bl, 1, 1], [Bl, 1, 1]
    for j in range(n_tiles):  # the online softmax over key tiles
        t = slice(j * TILE, (j + 1) * TILE)
        s = torch.matmul(qb, keys[:, :, t].transpose(-1, -2)).view(Bl, Hkv, Qm, G, TILE) * scale
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
        pv = torch.matmul(w.view(Bl, Hkv, Qm * G, TILE), vals[:, :, t]).view(Bl, Hkv, Qm, G, D)
        acc = acc * corr[..., None] + pv
        m = m_new
    # l == 0 only for rows with no visible key (PA-005); a NaN read keeps l NaN and shows
    o = torch.where(l[..., None] == 0, torch.zeros_like(acc), acc / l[..., None])
    out.index_copy_(0, qrows, o.transpose(1, 2).reshape(Bl * Qm, H, D).index_select(0, q_at))
    out = out.to(q.dtype)
    if not return_softmax_lse:
        return out
    row_lse = torch.where(l != 0, m + torch.log(l), torch.full_like(l, float("-inf")))
    lse.index_copy_(1, qrows, row_lse.transpose(1, 2).reshape(Bl * Qm, H).index_select(0, q_at).T)
    return out, lse
