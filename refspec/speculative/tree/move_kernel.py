"""The tree's KV move (``pool[tgt] = pool[src]`` in every layer, K and V) as ONE fused GPU kernel
(Triton), as upstream moves it.

The rule is :func:`refspec.speculative.tree.kv.move_kv_cache`: the slots of the accepted path's
nodes copied to the first verify slots (TR-020, TR-017), and the committed tail page copied into
each draft branch (TR-015).  Written in torch it is one gather and one scatter per layer: 62
kernels per tree round for SmolLM2 (30 target layers and the one-layer head).  Upstream's pool
moves all layers in one launch: ``MHATokenToKVPool.move_kv_cache`` ->
``copy_all_layer_kv_cache_func`` -> the Triton kernel ``copy_all_layer_kv_cache_tiled``
(`python/sglang/kernels/ops/kvcache/cache_move.py@v0.5.23
<https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/kernels/ops/kvcache/cache_move.py>`_,
called from ``python/sglang/srt/mem_cache/memory_pool.py``): one program per (buffer, byte tile)
of a table of buffer addresses, copying that tile of every moved slot.

This kernel is that one, over a :class:`~refspec.core.kv_cache.KVPool`'s ``2 * num_layers`` buffers
(each layer's K half and V half; a slot is ``Hkv * D`` contiguous elements).  One difference: a
slot may be both one entry's source and another's target (a path node moved down onto a node
that is itself moved), so all of a tile's sources are loaded, then a barrier across the program's
warps, then the stores; the torch rule is safe the same way (gather first, then scatter).
Upstream's kernel loads, then stores, with no barrier between them.

Available where Triton is (CUDA builds of torch ship it); :func:`available` says so, and
``move_kv_cache`` keeps the torch rule elsewhere.  ``tests/test_gpu_tree_move_kernel.py``
compares the two on CUDA.
"""

from __future__ import annotations

import weakref

import torch

from refspec.core.kv_cache import KVPool
from refspec.core.transfer import h2d
from refspec.core.triton_kernels import runs_on, triton_kernel

#: the most slots one launch moves (upstream's ``num_locs_upper`` cap): all of them are read before
#: any is written only within one launch, so larger moves keep the torch rule (``move_kv_cache``)
MAX_SLOTS = 256


@triton_kernel
def _kernel(triton, tl):
    """The jitted move kernel."""
    @triton.jit
    def move(ptrs, tgt, src, n, UPPER: tl.constexpr, ROW: tl.constexpr, TILE: tl.constexpr):
        # ptrs: int64 [2 * layers], each buffer's address; a slot is ROW bytes in every buffer.
        base = tl.load(ptrs + tl.program_id(0)).to(tl.pointer_type(tl.uint8))
        off = tl.program_id(1) * TILE + tl.arange(0, TILE)  # this program's byte tile of a slot
        i = tl.arange(0, UPPER)
        rows = i < n
        s = tl.load(src + i, mask=rows, other=0)
        d = tl.load(tgt + i, mask=rows, other=0)
        m = rows[:, None] & (off < ROW)[None, :]
        vals = tl.load(base + s[:, None] * ROW + off[None, :], mask=m)
        tl.debug_barrier()  # every source read before any target is written
        tl.store(base + d[:, None] * ROW + off[None, :], vals, mask=m)

    return move


def available(device: torch.device) -> bool:
    """True where the fused kernel runs: a CUDA device and an importable Triton."""
    return runs_on(device, _kernel)


_POINTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def buffer_pointers(pool: KVPool) -> tuple[torch.Tensor, int]:
    """The pool's buffer table: int64 ``[2 * num_layers]`` addresses (layer l's K half at ``2l``,
    its V half at ``2l + 1``) on the pool's device, and the bytes of one slot (``Hkv * D`` elements).
    Built once per pool (its buffers never move), so a captured graph reads a table that stays valid;
    copied without a stream sync (:func:`refspec.core.transfer.h2d`), so a round's launch does not wait."""
    got = _POINTERS.get(pool)
    if got is None:
        halves = [h for kv in pool.kv_buffer for h in (kv[0], kv[1])]
        row = halves[0].shape[-1] * halves[0].shape[-2] * halves[0].element_size()
        got = (h2d([h.data_ptr() for h in halves], halves[0].device, torch.int64), row)  # no stream sync
        _POINTERS[pool] = got
    return got


def _tile(row_bytes: int, upper: int) -> tuple[int, int]:
    """(bytes per tile, warps): upstream's heuristic (``_init_kv_copy_and_warmup``: 512 bytes and 8
    warps for slots of 8 KiB or more, 256 from 4 KiB, else 128, 4 warps), with the tile narrowed so
    that a program holds at most 32 KiB (``upper`` slots x the tile), where upstream caps the slots
    per launch at 128 for 512-byte tiles."""
    tile, warps = (512, 8) if row_bytes >= 8192 else (256, 4) if row_bytes >= 4096 else (128, 4)
    return min(tile, max(16, 32768 // upper)), warps


def move_kv_cache_fused(pool: KVPool, tgt: torch.Tensor, src: torch.Tensor) -> None:
    """``pool[tgt] = pool[src]`` in every layer, K and V, in one kernel launch.

    ``tgt``, ``src`` int64 ``[M]`` flat slots (``page * P + offset``) on the pool's CUDA device,
    contiguous, ``1 <= M <=`` :data:`MAX_SLOTS`.  Overlapping ``tgt`` / ``src`` are safe (module
    doc).  Graph-safe: no host read, the launch fixed by ``M``.  Raises ValueError naming the
    argument for other dtypes, shapes, devices, layouts or sizes, and RuntimeError where
    :func:`available` is False.

    Fused twin of the torch rule :func:`refspec.speculative.tree.kv.move_kv_cache`.
    """
    if not available(tgt.device):
        raise RuntimeError("move_kv_cache_fused needs a CUDA tensor and Triton (see move_kernel.available)")
    ptrs, row = buffer_pointers(pool)
    for name, t in (("tgt", tgt), ("src", src)):
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous() or t.device != ptrs.device:
            raise ValueError(f"move_kv_cache_fused: {name} must be a contiguous int64 [M] tensor on {ptrs.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if tgt.shape != src.shape:
        raise ValueError(f"move_kv_cache_fused: tgt {tuple(tgt.shape)} and src {tuple(src.shape)} differ in length")
    n = tgt.numel()
    if not 1 <= n <= MAX_SLOTS:
        raise ValueError(f"move_kv_cache_fused: tgt has {n} slots, one launch moves 1 .. {MAX_SLOTS}")
    upper = max(2, 1 << (n - 1).bit_length())
    tile, warps = _tile(row, upper)
    _kernel()[(ptrs.numel(), -(-row // tile))](ptrs, tgt, src, n, UPPER=upper, ROW=row, TILE=tile, num_warps=warps)
