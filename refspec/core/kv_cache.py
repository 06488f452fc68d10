"""The paged KV cache: per-layer K/V pools, ``req_to_token`` and the page allocator.

Units (docs/glossary.md): *tokens* are logical positions of a request, *slots* are flat indices
into a pool, *pages* are ``slot // P``.  Slot ``s`` lives at ``(page s // P, offset s % P)``.

Mirrors SGLang's ``mem_cache/memory_pool.py`` (``ReqToTokenPool``, ``MHATokenToKVPool``) and
``mem_cache/allocator.py`` (``PagedTokenToKVPoolAllocator``, allocator.py@v0.5.5), PA-001 / KV-001 / KV-002:

* page 0 (slots ``0..P-1``) and ``req_to_token`` row 0 are reserved dummies (padded graph rows
  write and read there) and are never given to a request (PA-008);
* ``alloc_extend`` continues a request's last partial page and takes a new page only when a
  position crosses a page boundary, so every row stays page-contiguous (PA-001, KV-001);
* ``free`` is page-granular: freeing any slot frees its whole page (KV-002).

**Host mirror.**  ``req_to_token`` lives on the device (the kernels and the batch builders read
it there); the allocator also keeps ``req_to_token_cpu``, a host copy of every entry it writes,
and reads only that (``alloc_extend``'s last slot, ``row_pages`` for ``free_tail`` /
``free_req``), so no allocator call reads the device (on a GPU each such read is a
``cudaStreamSynchronize`` behind the queued forwards).  SGLang keeps the same values on the
host for the same reason (``Req.kv_allocated_len`` / ``kv_committed_len``,
``python/sglang/srt/mem_cache/common.py``).  ``alloc_extend`` writes both: the host rows, then
the device entries in one pinned, non-blocking copy and one scatter.  Whoever writes the device
``req_to_token`` directly (a test poking a bad slot) must write the mirror too;
:meth:`KVCache.check_mirror` compares them (the engine's audit does).

**First reading:** :class:`KVCache` (``alloc_req``, ``alloc_extend``, ``free_tail``,
``free_req``, ``check_page_contiguous``) and :class:`PagedAllocator`; skip the host-mirror
paragraph above and ``check_mirror``, ``stacked_halves`` (a fused-write detail) and
``backup_state`` / ``restore_state`` (v1's transient draft slots, met again in the engine).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from refspec.core.args import allocate, count, int_list, tensor
from refspec.core.invariants import InvariantError, require
from refspec.core.transfer import h2d


def _positive(**sizes) -> None:
    """ValueError naming the first size that is not a positive int (bools are not sizes)."""
    for name, n in sizes.items():
        count(name, n, 1)


class KVPool:
    """Per-layer K and V buffers shaped ``[NP, P, Hkv, D]`` (one pool per model: target, draft).

    A layer's K and V buffers are the two contiguous halves of one ``[2, NP, P, Hkv, D]``
    tensor (``kv_buffer[l]``), so that :meth:`set_kv_buffer` writes both in ONE scatter when the
    new k and v are the two halves of one ``[2, T, Hkv, D]`` tensor (the fused model's,
    :class:`~refspec.model.fused.FusedLlama`), as SGLang's ``MHATokenToKVPool.set_kv_buffer``
    stores both with one kernel (``store_cache``,
    `python/sglang/jit_kernel/kvcache.py:store_cache@0d65353ce <https://github.com/sgl-project/sglang/blob/0d65353ce32f1b39676e63042b0313054ea277c3/python/sglang/jit_kernel/kvcache.py>`_).
    The kernel still reads each half as its own contiguous ``[NP, P, Hkv, D]`` cache.

    Args:
        num_layers: layers with attention.
        num_pages: NP, pages in the pool *including* the reserved page 0.
        page_size: P, tokens per page.
        num_kv_heads, head_dim: Hkv, D.
        dtype, device: of the buffers.
        fill: initial value of every slot (tests poison with NaN).
    """

    def __init__(self, num_layers, num_pages, page_size, num_kv_heads, head_dim,
                 dtype=torch.float32, device="cpu", fill: float = 0.0):
        _positive(num_layers=num_layers, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.page_size, self.num_pages = page_size, num_pages
        what = f"KVPool num_layers={num_layers} x [num_pages, page_size, num_kv_heads, head_dim] = {list(shape)}"
        self.kv_buffer = allocate(what + " for K and for V", lambda: [
            torch.full((2, *shape), fill, dtype=dtype, device=device) for _ in range(num_layers)])
        self.k_buffer = [kv[0] for kv in self.kv_buffer]
        self.v_buffer = [kv[1] for kv in self.kv_buffer]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged view ``([NP, P, Hkv, D], [NP, P, Hkv, D])`` the kernel reads.

        Raises: ValueError if ``layer_id`` is not in ``[0, num_layers)``."""
        layer_id = check_layer_id(layer_id, len(self.k_buffer))
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def get_flat_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot view ``([NP*P, Hkv, D], [NP*P, Hkv, D])`` (same storage)."""
        k, v = self.get_kv_buffer(layer_id)
        return k.flatten(0, 1), v.flatten(0, 1)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v [T, Hkv, D]`` at flat slots ``loc [T]`` (int64), in place: one scatter
        when ``k`` and ``v`` are the halves of one ``[2, T, Hkv, D]`` tensor (class doc), else
        one each.

        Raises: InvariantError PA-011 if ``k`` / ``v`` are not ``[len(loc), Hkv, D]`` (torch
        would broadcast a single row or head over all of them).  Shapes only: no host sync.
        """
        fk, fv = self.get_flat_kv(layer_id)
        tensor("set_kv_buffer: loc", loc, integer=True)
        tensor("set_kv_buffer: k", k)
        tensor("set_kv_buffer: v", v)
        want = (loc.shape[0], *fk.shape[1:]) if loc.dim() == 1 else None
        require(want is not None and tuple(k.shape) == want and tuple(v.shape) == want, "PA-011",
                lambda: f"store at out_cache_loc {tuple(loc.shape)}: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                f"the pool wants [T, Hkv, D] = {want}")
        kv = stacked_halves(k, v)
        if kv is not None:
            self.kv_buffer[layer_id].view(2, -1, *fk.shape[1:])[:, loc] = kv.to(fk.dtype)
            return
        fk[loc] = k.to(fk.dtype)
        fv[loc] = v.to(fv.dtype)

    def move_kv_cache(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """``pool[tgt] = pool[src]`` in every layer, K and V together: per layer one gather of
        ``[2, M, Hkv, D]`` (a new tensor, so overlapping ``tgt`` / ``src`` are safe) and one
        scatter.  ``tgt``, ``src`` int64 ``[M]`` flat slots.  SGLang's
        ``MHATokenToKVPool.move_kv_cache`` (the tree path's KV moves, TR-015 / TR-017;
        :func:`refspec.speculative.tree.kv.move_kv_cache` runs it, or one fused kernel on a GPU)."""
        for kv in self.kv_buffer:
            flat = kv.view(2, -1, *kv.shape[3:])  # [2, NP*P, Hkv, D], same storage
            flat[:, tgt] = flat[:, src]


def check_pool_fits(pool, kv: "KVCache") -> None:
    """A backend's pool (:class:`KVPool` or :class:`MLAKVPool`) is paged as its cache: the same page
    size P (the page table's page ids are the allocator's: slot = page * P + offset).  Checked once,
    when a backend is built.  Raises ValueError naming ``page_size``: FA3's paged views of a pool
    of another P would read other slots than the table names, silently (the oracle, reading by
    slot, would not notice).  ``pool`` None (a backend built for its metadata only) has nothing to check."""
    if pool is not None and pool.page_size != kv.page_size:
        raise ValueError(f"the pool's page_size {pool.page_size} is not the cache's {kv.page_size}: the page table's "
                         "page ids would name other slots of the pool")


def check_layer_id(layer_id: int, num_layers: int) -> int:
    """``layer_id`` as an int in ``[0, num_layers)`` (both pools' per-layer buffers).

    Raises: ValueError naming it otherwise."""
    if not 0 <= count("layer_id", layer_id) < num_layers:
        raise ValueError(f"layer_id {layer_id} outside the pool's {num_layers} layers")
    return layer_id


def stacked_halves(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The ``[2, T, Hkv, D]`` tensor whose halves ``k`` and ``v`` are (``k = kv[0]``,
    ``v = kv[1]``, contiguous), or None when they are separate tensors."""
    kv = k._base
    if kv is None or v._base is not kv or tuple(kv.shape) != (2, *k.shape) or not kv.is_contiguous():
        return None
    return kv if k.data_ptr() == kv.data_ptr() and v.data_ptr() == kv[1].data_ptr() else None


def paged_view(flat: torch.Tensor, page_size: int) -> torch.Tensor:
    """``flat [S, ...]`` seen as ``[S / P, P, ...]`` pages, a view that keeps ``flat``'s own slot
    stride at every P (``as_strided``; a ``.view`` gives a size-1 dim the row stride instead).
    SGLang's ``paged_view``,
    `mem_cache/layout/paged_view.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/layout/paged_view.py#L11>`_.

    Raises: ValueError if ``S`` is not a multiple of ``page_size``."""
    S = flat.shape[0]
    if S % count("page_size", page_size, 1):
        raise ValueError(f"paged_view: {S} slots are not a whole number of pages of {page_size} (page_size)")
    return flat.as_strided((S // page_size, page_size, *flat.shape[1:]),
                           (flat.stride(0) * page_size, flat.stride(0), *flat.stride()[1:]))


def store_rows_keep_slot_0(buf: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """ML-002's store: ``buf[loc[i]] = rows[i]`` for every token whose slot is not 0; a token at
    slot 0 (a padded graph row, CG-005) writes slot 0's own current row back, so slot 0 keeps its
    bytes.  No data-dependent shape (graph-safe, no host sync).

    Shapes: ``buf [S, 1, W]`` (one layer's rows), ``loc [T]`` int64 (slots), ``rows [T, 1, W]`` in
    ``buf``'s dtype.  Upstream: ``set_mla_kv_buffer_kernel``'s ``is_valid = loc != reserved_skip_index``
    (`mla_buffer.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/kernels/ops/kvcache/mla_buffer.py#L42>`_,
    sglang#36003); v0.5.12.post1's writer stores every row."""
    buf[loc] = torch.where((loc != 0)[:, None, None], rows, buf[loc])


class MLAKVPool:
    """The MLA KV pool: ONE latent row per slot and layer, ``[NP*P, 1, kv_lora_rank + qk_rope_head_dim]``.

    The sibling of :class:`KVPool` for multi-head latent attention (SGLang ``MLATokenToKVPool``,
    `memory_pool.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/memory_pool.py#L4754>`_).
    It shares the allocator, ``req_to_token`` and the page geometry with :class:`KVCache` (a
    slot is still ``page * P + offset``, page 0 the reserved padding page, PA-008); what differs
    is the row (docs/mla.md has the picture):

    * **the row (ML-001)**: ``[c_kv | k_rope]``, R + Dr wide (576 = 512 + 64 for DeepSeek-V3):
      the normalised latent ``c_kv`` (the layer's ``k_nope``) then the shared RoPE key
      ``k_rope``; one KV head.  No per-head K or V is ever stored: they are ``W_UK c`` and
      ``W_UV c`` (ML-008);
    * **the store (ML-002)**: :meth:`set_mla_kv_buffer` writes ``[k_nope | k_rope]`` at
      ``out_cache_loc`` and never writes slot 0 (graph padding writes there);
    * **the views (ML-003)**: :meth:`paged_views` splits the row at the layer's ``v_head_dim``
      into ``k_rope [NP, P, 1, Dr]`` and ``c_kv [NP, P, 1, R]``, two strided, non-contiguous
      views of the same storage, strides ``(row * P, row, row, 1)``;
    * **the move (ML-012)**: :meth:`move_kv_cache` moves whole rows (the tree / v2 paths).

    Args:
        num_layers: layers with attention.
        num_pages: NP, pages in the pool *including* the reserved page 0.
        page_size: P, tokens per page.
        kv_lora_rank, qk_rope_head_dim: R, Dr (the row is R + Dr wide).
        dtype, device: of the buffers (a floating dtype).
        fill: initial value of every slot (tests poison with NaN).
    Raises: ValueError naming a size that is not an int >= 1, or a ``dtype`` that is not floating.
    """

    def __init__(self, num_layers, num_pages, page_size, kv_lora_rank, qk_rope_head_dim,
                 dtype=torch.float32, device="cpu", fill: float = 0.0):
        _positive(num_layers=num_layers, num_pages=num_pages, page_size=page_size, kv_lora_rank=kv_lora_rank,
                  qk_rope_head_dim=qk_rope_head_dim)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"MLAKVPool dtype must be a floating torch.dtype (the latent rows), got {dtype!r}")
        self.page_size, self.num_pages = page_size, num_pages
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        shape = (num_pages * page_size, 1, self.kv_cache_dim)
        self.kv_buffer = allocate(f"MLAKVPool num_layers={num_layers} x [slots, 1, kv_lora_rank + qk_rope_head_dim] = "
                                  f"{list(shape)}",
                                  lambda: [torch.full(shape, fill, dtype=dtype, device=device)
                                           for _ in range(num_layers)])

    @property
    def device(self) -> torch.device:
        """Where the rows live (every operand of an MLA call must be there too)."""
        return self.kv_buffer[0].device

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s rows ``[NP*P, 1, R + Dr]`` (SGLang's name; the whole row, ML-001).

        Raises: ValueError if ``layer_id`` is not in ``[0, num_layers)``."""
        return self.kv_buffer[check_layer_id(layer_id, len(self.kv_buffer))]

    def paged_views(self, layer_id: int, v_head_dim: int, page_size: int | None = None):
        """``(k_rope [NP', P', 1, D - v_head_dim], c_kv [NP', P', 1, v_head_dim])``: the row split at
        ``v_head_dim``, paged by ``page_size`` (default the pool's P; 1 for a table of token slots),
        strides ``(row * P', row, row, 1)``: views, never copies (ML-003).

        Upstream splits at the *layer's* ``v_head_dim`` (``kv_cache[:, :, :layer.v_head_dim]``,
        `flashattention_backend.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L1944>`_),
        not at the pool's ``kv_lora_rank``; the two agree for every DeepSeek layer
        (``v_head_dim = kv_lora_rank``), and the split point is the layer's to state.
        Raises: InvariantError ML-003 if ``v_head_dim`` is not inside the row (``0 < v_head_dim
        < R + Dr``); ValueError (``layer_id``, ``page_size``)."""
        row = self.get_key_buffer(layer_id)
        require(isinstance(v_head_dim, int) and 0 < v_head_dim < self.kv_cache_dim, "ML-003",
                lambda: f"split at v_head_dim = {v_head_dim!r}: must lie inside the {self.kv_cache_dim}-wide row")
        P = self.page_size if page_size is None else page_size
        return paged_view(row[:, :, v_head_dim:], P), paged_view(row[:, :, :v_head_dim], P)

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write the row ``[k_nope | k_rope]`` of each token at its slot ``loc`` (ML-002), cast to
        the pool's dtype, in place; a token whose ``loc`` is 0 (a padded graph row) leaves slot 0
        as it was.

        Shapes: ``loc [T]`` int (slots, ``out_cache_loc``); ``k_nope [T, 1, R]`` (the latent);
        ``k_rope [T, 1, Dr]``.  Upstream: ``MLATokenToKVPool.set_mla_kv_buffer`` ->
        ``set_mla_kv_buffer_triton(..., reserved_skip_index=0)`` (v0.5.23; sglang#36003), whose
        kernel masks the store of a ``loc == 0`` row.  Here the same rule without a
        data-dependent shape (graph-safe, no host sync, :func:`store_rows_keep_slot_0`): a
        ``loc == 0`` token writes slot 0's own current row back, so slot 0 keeps its bytes.
        Raises: InvariantError ML-002 on shapes (T, one head, R / Dr wide); ValueError naming ``loc``
        (not an integer tensor; on a CPU pool, a slot at or past the pool's end), ``k_nope`` /
        ``k_rope`` (not floating tensors), or an operand on another device than the pool.  The slots'
        values are not read here (no host sync): a backend checks ``out_cache_loc`` against
        ``req_to_token`` when it builds the metadata (MD-005), which also refuses a negative slot
        (that torch indexing would wrap to the pool's end).
        """
        buf = self.get_key_buffer(layer_id)
        tensor("set_mla_kv_buffer: loc", loc, integer=True)
        tensor("set_mla_kv_buffer: k_nope", k_nope, integer=False)
        tensor("set_mla_kv_buffer: k_rope", k_rope, integer=False)
        T = loc.shape[0] if loc.dim() == 1 else None
        require(T is not None and tuple(k_nope.shape) == (T, 1, self.kv_lora_rank)
                and tuple(k_rope.shape) == (T, 1, self.qk_rope_head_dim), "ML-002",
                lambda: f"store at out_cache_loc {tuple(loc.shape)}: k_nope {tuple(k_nope.shape)}, k_rope "
                f"{tuple(k_rope.shape)}; the pool wants [T, 1, kv_lora_rank = {self.kv_lora_rank}] and "
                f"[T, 1, qk_rope_head_dim = {self.qk_rope_head_dim}]")
        self._same_device(loc=loc, k_nope=k_nope, k_rope=k_rope)
        row = torch.cat([k_nope.to(buf.dtype), k_rope.to(buf.dtype)], dim=-1)  # [T, 1, R + Dr]
        try:
            store_rows_keep_slot_0(buf, loc.long(), row)
        except IndexError:  # torch's CPU bounds check (CUDA reports it as a device-side assert)
            raise ValueError(f"set_mla_kv_buffer: loc holds a slot outside the pool's [0, {buf.shape[0]})") from None

    def _same_device(self, **tensors) -> None:
        for name, t in tensors.items():
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the MLA pool on {self.device}")

    def get_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at slots ``loc [n]`` split back into ``(k_nope [n, 1, R], k_rope [n, 1, Dr])``
        (new tensors): what a model gathers to expand a cached prefix for the non-absorbed prefill
        (ML-010; SGLang's ``MLATokenToKVPool.get_mla_kv_buffer``, MHA_ONE_SHOT with a prefix).
        Raises ValueError naming ``loc`` (not a 1-D integer tensor on the pool's device; on a CPU
        pool, a slot at or past the pool's end)."""
        buf = self.get_key_buffer(layer_id)
        tensor("get_mla_kv_buffer: loc", loc, dim=1, integer=True)
        self._same_device(loc=loc)
        try:
            rows = buf[loc.long()]
        except IndexError:
            raise ValueError(f"get_mla_kv_buffer: loc holds a slot outside the pool's [0, {buf.shape[0]})") from None
        return rows[..., :self.kv_lora_rank].clone(), rows[..., self.kv_lora_rank:].clone()

    def move_kv_cache(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """``pool[tgt] = pool[src]``, whole rows, in every layer (ML-012): one gather (a new
        tensor, so overlapping ``tgt`` / ``src`` are safe) and one scatter per layer.  ``tgt``,
        ``src`` int64 ``[M]`` flat slots.  Upstream: ``MLATokenToKVPool.move_kv_cache`` (v0.5.23,
        sglang#26982; v0.5.12.post1's pool has none, so MLA + EAGLE top-k > 1 with P > 1 fails there).
        Raises ValueError naming ``tgt`` / ``src`` (not 1-D integer tensors of one length on the
        pool's device; on a CPU pool, a slot at or past the pool's end)."""
        tensor("move_kv_cache: tgt", tgt, dim=1, integer=True)
        tensor("move_kv_cache: src", src, dim=1, integer=True)
        if tgt.shape != src.shape:
            raise ValueError(f"move_kv_cache: tgt {tuple(tgt.shape)} and src {tuple(src.shape)} must name as many "
                             "slots")
        self._same_device(tgt=tgt, src=src)
        try:
            for buf in self.kv_buffer:
                buf[tgt] = buf[src]
        except IndexError:
            raise ValueError(f"move_kv_cache: tgt / src hold a slot outside the pool's [0, "
                             f"{self.kv_buffer[0].shape[0]})") from None


@dataclass
class _AllocatorState:
    free: deque
    in_use: torch.Tensor


class PagedAllocator:
    """Page-granular allocator over pages ``1..NP-1`` (page 0 is reserved, PA-008).

    Args:
        num_pages: NP, including the reserved page 0.
        page_size: P.
        seed: if given, the free list starts shuffled, so requests get scattered,
            non-monotonic physical pages (a layout FA3 must handle).
    """

    def __init__(self, num_pages: int, page_size: int, seed: int | None = None):
        if count("num_pages", num_pages) < 2:
            raise ValueError(f"num_pages: need at least 2 pages (page 0 is reserved), got {num_pages}")
        _positive(page_size=page_size)
        self.num_pages, self.page_size = num_pages, page_size
        pages = list(range(1, num_pages))
        if seed is not None:
            random.Random(seed).shuffle(pages)
        self._free = deque(pages)
        self._in_use = allocate(f"PagedAllocator num_pages={num_pages}",
                                lambda: torch.zeros(num_pages, dtype=torch.bool))

    @property
    def num_free_pages(self) -> int:
        """Exact count of free pages (KV-002)."""
        return len(self._free)

    def alloc_pages(self, n: int) -> list[int]:
        """Take ``n`` pages; raises KV-003 on exhaustion (nothing is taken then)."""
        count("alloc_pages: n", n, 0)
        require(n <= len(self._free), "KV-003", lambda: f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._in_use[pages] = True
        return pages

    def free_pages(self, pages) -> None:
        """Return whole pages; raises KV-003 on page 0, a free page, or a repeated page."""
        pages = int_list("free_pages: pages", pages)
        require(len(set(pages)) == len(pages), "KV-003", f"page freed twice in one call: {pages}")
        for p in pages:
            require(0 < p < self.num_pages, "KV-003", f"page {p} is reserved or out of range")
            require(bool(self._in_use[p]), "KV-003", f"double free of page {p}")
        self._in_use[pages] = False
        self._free.extend(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding ``slots [n]`` (page-granular: ``unique(slot // P)``, KV-002)."""
        self.free_pages(torch.unique(slots.cpu().long() // self.page_size).tolist())

    def is_in_use(self, page: int) -> bool:
        return bool(self._in_use[page])

    def backup_state(self) -> _AllocatorState:
        """Snapshot (SGLang ``backup_state``): v1 draft slots are allocated, then restored."""
        return _AllocatorState(deque(self._free), self._in_use.clone())

    def restore_state(self, state: _AllocatorState) -> None:
        self._free, self._in_use = deque(state.free), state.in_use.clone()


def first_freeable_position(keep_len: int, page_size: int) -> int:
    """First position whose page v1 may free after verify: ``ceil(keep_len / P) * P`` (tokens);
    the page of position keep_len - 1 stays (KV-004).  P = 4: keep_len 6 -> 8, 8 -> 8, 9 -> 12.
    Upstream: ``align_evict_mask_to_page_size``, `speculative/spec_utils.py#L340@v0.5.12.post1
    <https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/speculative/spec_utils.py#L340>`_."""
    return -(-keep_len // page_size) * page_size


class KVCache:
    """``req_to_token`` + allocator + one or more pools sharing them (target and draft).

    ``req_to_token`` is int32 ``[max_reqs, max_context + extra]`` (tokens -> slots) on
    ``device``, zero initialised; row 0 is reserved.  ``req_to_token_cpu`` is its host mirror
    (module doc), the only copy the allocator reads.  The draft model's pool shares ``req_to_token`` and the
    allocator with the target's, as in SGLang.

    Args:
        max_reqs: rows of ``req_to_token`` including the reserved row 0.
        max_context: longest sequence (tokens); ``extra`` columns of headroom are added for
            speculative tokens (SGLang: 4 + N).
        num_pages, page_size: the allocator's pages (NP includes page 0).
        device: of ``req_to_token``.
        seed: shuffle the free page list (scattered physical pages).
    """

    def __init__(self, max_reqs, max_context, num_pages, page_size, extra=0, device="cpu", seed=None):
        if count("max_reqs", max_reqs) < 2:
            raise ValueError(f"max_reqs must be >= 2 (row 0 is reserved), got {max_reqs}")
        count("max_context", max_context)
        count("extra", extra)
        _positive(max_context_plus_extra=max_context + extra, num_pages=num_pages, page_size=page_size)
        self.page_size = page_size
        self.device = torch.device(device)
        self.req_to_token = allocate(f"req_to_token [max_reqs, max_context + extra] = "
                                     f"[{max_reqs}, {max_context + extra}]",
                                     lambda: torch.zeros((max_reqs, max_context + extra), dtype=torch.int32,
                                                         device=device))
        self.req_to_token_cpu = allocate(f"req_to_token_cpu [{max_reqs}, {max_context + extra}]",
                                         lambda: torch.zeros((max_reqs, max_context + extra), dtype=torch.int32))
        self.allocator = PagedAllocator(num_pages, page_size, seed=seed)
        self._free_rows = deque(range(1, max_reqs))

    # ---- request rows ----
    def alloc_req(self) -> int:
        """A fresh ``req_to_token`` row (never row 0, PA-008)."""
        require(len(self._free_rows) > 0, "KV-003", "no free req_to_token row")
        return self._free_rows.popleft()

    def _check_row(self, r: int) -> None:
        """``r`` is a row handed out by :meth:`alloc_req` and not freed since (PA-008, KV-003)."""
        count("req_pool_index r", r)
        require(r != 0, "PA-008", "req_to_token row 0 is the reserved dummy row")
        if not 0 < r < self.req_to_token.shape[0]:
            raise ValueError(f"req_pool_index {r} outside req_to_token rows [1, {self.req_to_token.shape[0]})")
        require(r not in self._free_rows, "KV-003", f"req_to_token row {r} is free (never allocated, or freed)")

    def _check_len(self, name: str, n: int) -> None:
        count(name, n)
        if not 0 <= n <= self.req_to_token.shape[1]:
            raise ValueError(f"{name} = {n} outside [0, {self.req_to_token.shape[1]}] (req_to_token width)")

    def free_req(self, r: int, alloc_len: int) -> None:
        """Free every page of row ``r``'s first ``alloc_len`` positions, and the row itself.

        Raises: InvariantError KV-003 (row already free: a double free would hand the row to two
        requests), PA-008 (row 0); ValueError (``alloc_len`` outside the row).
        """
        self._check_row(r)
        self._check_len("alloc_len", alloc_len)
        if alloc_len > 0:
            self.allocator.free_pages(self.row_pages(r, alloc_len))
        self._free_rows.append(r)

    # ---- slots ----
    def row_pages(self, r: int, length: int, start: int = 0) -> list[int]:
        """Pages of row ``r`` covering positions ``[start, length)``; ``start`` rounds up to a page.

        Raises: ValueError (``r`` outside ``req_to_token``, ``length`` / ``start`` not in the row)."""
        count("req_pool_index r", r)
        if not r < self.req_to_token.shape[0]:
            raise ValueError(f"req_pool_index r = {r} outside req_to_token rows [0, {self.req_to_token.shape[0]})")
        self._check_len("length", length)
        self._check_len("start", start)
        P = self.page_size
        first = -(-start // P)
        if first * P >= length:  # [start, length) lies inside start's page: no whole page
            return []
        return (self.req_to_token_cpu[r, first * P:length:P] // P).tolist()  # host mirror: no sync

    def alloc_extend(self, req_pool_indices, prefix_lens, seq_lens) -> torch.Tensor:
        """Give positions ``[prefix_b, seq_b)`` of each request a slot; write ``req_to_token``.

        A request's next token goes into the next slot of its last partial page; a new page is
        taken only at a page boundary (KV-001; SGLang asserts ``(last_loc + 1) % P ==
        prefix_len % P``).  All-or-nothing: on any error (a misplaced last slot, exhaustion) nothing is
        allocated and no row is written (KV-001, KV-003).

        Args (Python int lists, length B): ``req_pool_indices``, ``prefix_lens`` (tokens already
        holding slots), ``seq_lens`` (tokens after the call).
        Returns: ``out_cache_loc`` int64 ``[sum(seq - prefix)]`` (slots), request-major.
        Raises: InvariantError KV-001 (the row's last slot is not at the expected offset),
        KV-003 (exhaustion: pages, or ``seq_b`` past the row's width; or a free row), PA-008
        (row 0); ValueError (lists of different lengths or holding something else than ints, a
        repeated row, ``seq_b < prefix_b``).
        All checks run before anything is taken.
        """
        P = self.page_size
        req_pool_indices = int_list("req_pool_indices", req_pool_indices)
        prefix_lens, seq_lens = int_list("prefix_lens", prefix_lens), int_list("seq_lens", seq_lens)
        if not len(req_pool_indices) == len(prefix_lens) == len(seq_lens):
            raise ValueError(f"alloc_extend: req_pool_indices, prefix_lens, seq_lens have lengths "
                             f"{len(req_pool_indices)}, {len(prefix_lens)}, {len(seq_lens)}")
        if len(set(req_pool_indices)) != len(req_pool_indices):
            raise ValueError(f"alloc_extend: req_pool_indices {req_pool_indices} repeat a row")
        W = self.req_to_token.shape[1]
        for r, p, s in zip(req_pool_indices, prefix_lens, seq_lens):
            self._check_row(r)
            if not 0 <= p <= s:
                raise ValueError(f"alloc_extend row {r}: need 0 <= prefix_len <= seq_len, got {p}, {s}")
            require(s <= W, "KV-003", f"row {r}: seq_len {s} past the req_to_token width {W}")
        mirror = self.req_to_token_cpu.numpy()  # the host mirror's memory (no copy): cheap per-entry reads/writes
        for r, p, s in zip(req_pool_indices, prefix_lens, seq_lens):
            if s > p and p % P:  # the row continues a partial page: its last slot must sit at offset p % P - 1
                last_loc = int(mirror[r, p - 1])  # host mirror: no sync
                require((last_loc + 1) % P == p % P, "KV-001",
                        f"row {r}: last_loc {last_loc} at prefix {p} with P={P}")
        need = [-(-s // P) - -(-p // P) for p, s in zip(prefix_lens, seq_lens)]
        require(sum(need) <= self.allocator.num_free_pages, "KV-003",
                lambda: f"need {sum(need)} pages, {self.allocator.num_free_pages} free")
        rows_w, cols_w, slots_w = [], [], []  # every check passed: from here on pages are taken
        for r, p, s, n in zip(req_pool_indices, prefix_lens, seq_lens, need):
            if s <= p:
                continue
            new_pages = self.allocator.alloc_pages(n) if n else []
            last_loc = int(mirror[r, p - 1]) if p % P else -1  # checked above; unused when p % P == 0
            # position t < ceil(p/P)*P continues the partial page; later ones go to new page k
            first_new = -(-p // P) * P
            slots = [last_loc + 1 + (t - p) if t < first_new else new_pages[(t - first_new) // P] * P + t % P
                     for t in range(p, s)]
            mirror[r, p:s] = slots
            rows_w += [r] * (s - p)
            cols_w += range(p, s)
            slots_w += slots
        if not slots_w:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        rcs = h2d([rows_w, cols_w, slots_w], self.device)  # one pinned, non-blocking copy [3, n]
        self.req_to_token[rcs[0], rcs[1]] = rcs[2].to(torch.int32)
        return rcs[2]

    def free_tail(self, r: int, keep_len: int, alloc_len: int) -> None:
        """Free the whole pages of row ``r`` strictly after the page holding position ``keep_len-1``.

        KV-004 (SGLang ``align_evict_mask_to_page_size``): rejected slots inside the page of
        the last committed token stay allocated (freeing them would free committed tokens' page),
        and are reused next round (KV-004).
        Raises: ValueError (``keep_len`` / ``alloc_len`` outside the row, or ``keep_len >
        alloc_len``: more tokens kept than the row holds), KV-003 (row not allocated).
        """
        self._check_row(r)
        self._check_len("keep_len", keep_len)
        self._check_len("alloc_len", alloc_len)
        if keep_len > alloc_len:
            raise ValueError(f"free_tail row {r}: keep_len {keep_len} > alloc_len {alloc_len} (cannot keep "
                             f"more tokens than were allocated)")
        start = first_freeable_position(keep_len, self.page_size)
        if alloc_len > start:
            self.allocator.free_pages(self.row_pages(r, alloc_len, start=start))

    def check_mirror(self) -> None:
        """``req_to_token_cpu`` equals the device ``req_to_token`` (KV-007; reads the device:
        an audit, not a hot-path call).  Raises InvariantError KV-007 naming the first entry."""
        dev = self.req_to_token.cpu()
        if not torch.equal(dev, self.req_to_token_cpu):
            r, c = (dev != self.req_to_token_cpu).nonzero()[0].tolist()
            raise InvariantError("KV-007", f"req_to_token[{r}, {c}] = {int(dev[r, c])} on the device, "
                                 f"{int(self.req_to_token_cpu[r, c])} in the allocator's host mirror")

    def check_page_contiguous(self, r: int, length: int) -> None:
        """Assert INV-PAGE (PA-001) on row ``r`` for positions ``[0, length)``.

        Raises: InvariantError PA-001; ValueError (``r`` outside ``req_to_token``, ``length``
        outside the row)."""
        count("req_pool_index r", r)
        if not r < self.req_to_token.shape[0]:
            raise ValueError(f"req_pool_index r = {r} outside req_to_token rows [0, {self.req_to_token.shape[0]})")
        self._check_len("length", length)
        P = self.page_size
        row = self.req_to_token[r, :length].long()
        pos = torch.arange(length, device=row.device)
        head = row[(pos // P) * P]
        ok = (row % P == pos % P) & (row - pos % P == head)
        if not bool(ok.all()):
            bad = int((~ok).nonzero()[0])
            raise InvariantError("PA-001", f"row {r} position {bad}: slot {int(row[bad])}, "
                                 f"page head slot {int(head[bad])}, P={P}")
