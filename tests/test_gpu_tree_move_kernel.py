"""The tree's KV move as one fused kernel (refspec.speculative.tree.move_kernel) against the rule,
``pool[tgt] = pool[src]`` in every layer written out here as one gather per layer then one scatter.

GPU tests (``@pytest.mark.gpu``) run the Triton kernel on CUDA on random pools (1-31 layers, page
sizes 1-64, slot widths of 32 bytes to 16 KiB, so every tiling of ``move_kernel._tile``) and random
moves of 1-256 slots, among them the accepted-path pattern where a slot is one entry's source and
an earlier entry's target (the barrier's case), at widths that span several warps.  The CPU tests
pin where the kernel is not used (a CPU tensor: the torch rule) and the argument errors.  (Before
the GPU: the same comparison under Triton's interpreter, ``TRITON_INTERPRET=1``, 60 random moves,
and two broken kernels (stores at the source, a skipped byte tile) fail it; on every ``make
triton-check`` now: ``tests/test_triton_interpret.py``.)
"""

from __future__ import annotations

import random

import pytest
import torch

from refspec.core.kv_cache import KVPool
from refspec.speculative.tree import move_kernel
from refspec.speculative.tree.kv import move_kv_cache


def _pool(rng, device, layers=None):
    L = layers or rng.choice([1, 2, 5, 31])
    H, D = rng.choice([(1, 16), (3, 64), (8, 128), (32, 128), (64, 128)])
    pool = KVPool(num_layers=L, num_pages=rng.choice([8, 16]), page_size=rng.choice([1, 4, 16, 64]),
                  num_kv_heads=H, head_dim=D, dtype=rng.choice([torch.bfloat16, torch.float16, torch.float32]),
                  device=device)
    gen = torch.Generator(device=device).manual_seed(rng.randrange(1 << 30))
    for kv in pool.kv_buffer:
        kv.copy_(torch.randn(kv.shape, generator=gen, device=device).to(kv.dtype))
    return pool


def _moves(rng, slots):
    """(tgt, src): distinct targets; half the time the accepted path's pattern (tgt = a window's
    first M slots, src = M increasing slots of the window from the first on: overlapping)."""
    M = rng.randrange(1, min(256, slots) + 1)
    if rng.random() < 0.5:
        base = rng.randrange(0, slots - M + 1)
        src = sorted(rng.sample(range(base, min(slots, base + 2 * M)), M))
        return torch.arange(base, base + M), torch.tensor(src)
    return torch.tensor(rng.sample(range(slots), M)), torch.tensor([rng.randrange(slots) for _ in range(M)])


def _rule(pool, tgt, src):
    """The rule written out: each layer's K and V, all sources read, then all targets written."""
    out = []
    for kv in pool.kv_buffer:
        flat = kv.clone().view(2, -1, *kv.shape[-2:])
        flat[:, tgt.long()] = flat[:, src.long()].clone()
        out.append(flat.view(kv.shape))
    return out


@pytest.mark.gpu
@pytest.mark.spec("TR-015", "TR-017", "TR-020")
@pytest.mark.parametrize("seed", range(40))
def test_fused_move_equals_the_rule(seed):
    rng = random.Random(seed)
    pool = _pool(rng, "cuda")
    tgt, src = _moves(rng, pool.kv_buffer[0].shape[1] * pool.kv_buffer[0].shape[2])
    want = _rule(pool, tgt, src)
    move_kernel.move_kv_cache_fused(pool, tgt.cuda(), src.cuda())
    for layer, (got, w) in enumerate(zip(pool.kv_buffer, want)):
        assert torch.equal(got, w), (seed, layer)


@pytest.mark.gpu
@pytest.mark.spec("TR-020")
def test_fused_move_reads_every_source_before_writing_a_target():
    """256 slots of 16 KiB each (8 warps per program, a 128-byte tile): entry j moves slot j + 1 down to slot j, so
    every source but the last is also the next entry's target; a store before a load reads a
    moved value, which the rule does not."""
    pool = KVPool(num_layers=2, num_pages=6, page_size=64, num_kv_heads=64, head_dim=128,
                  dtype=torch.bfloat16, device="cuda")
    for kv in pool.kv_buffer:
        kv.copy_(torch.randn(kv.shape, device="cuda").to(kv.dtype))
    tgt, src = torch.arange(64, 320), torch.arange(65, 321)
    want = _rule(pool, tgt, src)
    for _ in range(3):  # the same move three times from fresh copies of the same start
        start = [kv.clone() for kv in pool.kv_buffer]
        move_kernel.move_kv_cache_fused(pool, tgt.cuda(), src.cuda())
        assert all(torch.equal(g, w) for g, w in zip(pool.kv_buffer, want))
        for kv, s in zip(pool.kv_buffer, start):
            kv.copy_(s)


@pytest.mark.gpu
def test_the_tree_move_runs_the_fused_kernel_on_cuda(monkeypatch):
    pool = KVPool(num_layers=2, num_pages=8, page_size=64, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16,
                  device="cuda")  # 512 slots
    calls = []
    real = move_kernel.move_kv_cache_fused
    monkeypatch.setattr(move_kernel, "move_kv_cache_fused", lambda *a: calls.append(1) or real(*a))
    move_kv_cache(pool, torch.tensor([3, 4], device="cuda"), torch.tensor([5, 6], device="cuda"))
    move_kv_cache(pool, torch.arange(300, device="cuda"), torch.arange(300, device="cuda"))  # > 256: the rule
    assert calls == [1]


@pytest.mark.gpu
def test_the_fused_move_captured_in_a_cuda_graph_replays_new_slots():
    pool = KVPool(num_layers=3, num_pages=4, page_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16,
                  device="cuda")  # 64 slots
    for kv in pool.kv_buffer:
        kv.copy_(torch.randn(kv.shape, device="cuda").to(kv.dtype))
    tgt, src = torch.tensor([1, 2, 3], device="cuda"), torch.tensor([7, 8, 9], device="cuda")
    move_kernel.move_kv_cache_fused(pool, tgt, src)  # jit outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        move_kernel.move_kv_cache_fused(pool, tgt, src)
    tgt.copy_(torch.tensor([10, 11, 12])), src.copy_(torch.tensor([4, 5, 6]))
    want = _rule(pool, tgt, src)
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(g_, w) for g_, w in zip(pool.kv_buffer, want))


def test_the_tree_move_on_cpu_is_the_rule():
    rng = random.Random(3)
    for _ in range(10):
        pool = _pool(rng, "cpu")
        tgt, src = _moves(rng, pool.kv_buffer[0].shape[1] * pool.kv_buffer[0].shape[2])
        want = _rule(pool, tgt, src)
        move_kv_cache(pool, tgt, src)
        assert all(torch.equal(g, w) for g, w in zip(pool.kv_buffer, want))


def test_fused_move_refuses_cpu_tensors():
    pool = _pool(random.Random(4), "cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA tensor and Triton"):
        move_kernel.move_kv_cache_fused(pool, torch.tensor([1]), torch.tensor([2]))


def test_fused_move_names_a_bad_argument(monkeypatch):
    """The argument checks run before any launch (Triton is not needed to reach them)."""
    monkeypatch.setattr(move_kernel, "available", lambda device: True)
    pool = _pool(random.Random(5), "cpu")
    one = torch.tensor([1])
    with pytest.raises(ValueError, match=r"tgt must be a contiguous int64 \[M\] tensor"):
        move_kernel.move_kv_cache_fused(pool, one.int(), one)
    with pytest.raises(ValueError, match=r"src must be a contiguous int64 \[M\] tensor"):
        move_kernel.move_kv_cache_fused(pool, one, torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"tgt \(2,\) and src \(1,\) differ in length"):
        move_kernel.move_kv_cache_fused(pool, torch.tensor([1, 2]), one)
    with pytest.raises(ValueError, match=r"tgt has 257 slots, one launch moves 1 \.\. 256"):
        move_kernel.move_kv_cache_fused(pool, torch.arange(257), torch.arange(257))
