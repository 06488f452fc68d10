"""The fused Triton kernels equal their torch rules on random inputs, run by Triton's interpreter
on a CPU (issue 42: every readable twin pinned to the production code it explains).

On a CUDA device the production path runs four fused kernels where a CPU runs their torch rules:
the tree's structure (:func:`~refspec.speculative.tree.build_kernel.tree_structure_fused` vs
:func:`~refspec.speculative.tree.device.tree_structure_torch`, TR-003 / TR-004 / TR-005), greedy
tree acceptance (:func:`~refspec.speculative.tree.accept_kernel.verify_tree_greedy_fused` vs
:func:`~refspec.speculative.tree.device.verify_tree_greedy_torch`, TR-016), the tree's KV move
(:func:`~refspec.speculative.tree.move_kernel.move_kv_cache_fused` vs
:func:`~refspec.speculative.tree.kv.move_kv_cache`, TR-020) and the cascade merge
(:func:`~refspec.fa3.merge_kernel.merge_state_fused` vs
:func:`~refspec.fa3.tree_attention.merge_state_torch`, TR-012).  ``tests/test_gpu_*kernel*.py``
compare them on a GPU; this file compares the same kernels, jitted under ``TRITON_INTERPRET=1``
(Triton executes the kernel body in Python on CPU tensors), so a kernel that leaves its rule
fails here, on the CPU machine, for top-k k in {2, 4} and page sizes P in {1, 4, 16}.  The
fused entry points run unchanged (their argument checks, tiling and launch); only ``available``
is made true for CPU tensors and the kernel is the interpreted one.

Needs Triton, which a CPU build of torch does not bring: ``make triton-check`` (run by
``.ci/run`` after ``make test``) runs this file with ``tests/test_triton_compile.py`` on the
pinned Triton in ``.triton/``; under a plain ``make test`` on a CPU torch the file is skipped
with that reason.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs Triton (make triton-check installs it into .triton/)")

from test_tree_device import both_trees, random_draft, target_along  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from refspec.core.kv_cache import KVPool  # noqa: E402
from refspec.fa3 import merge_kernel  # noqa: E402
from refspec.fa3.tree_attention import merge_state, merge_state_torch  # noqa: E402
from refspec.speculative.tree import accept_kernel, build_kernel, device, move_kernel  # noqa: E402
from refspec.speculative.tree.build import organize_draft_results  # noqa: E402
from refspec.speculative.tree.kv import move_kv_cache  # noqa: E402

TOPKS = (2, 4)
PAGE_SIZES = (1, 4, 16)


@pytest.fixture
def interpreted(monkeypatch):
    """``use(module)``: from now on ``module``'s kernel is jitted by the interpreter (a fresh build
    under ``TRITON_INTERPRET=1``, which Triton reads when ``@triton.jit`` runs) and ``available``
    is true for CPU tensors, so the production dispatch and the fused entry point run it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def use(module):
        built = inspect.unwrap(module._kernel)(triton, triton.language)  # the undecorated build(triton, tl)
        kernel = built[0] if isinstance(built, tuple) else built
        assert isinstance(kernel, InterpretedFunction), type(kernel)
        monkeypatch.setattr(module, "_kernel", lambda: built)
        monkeypatch.setattr(module, "available", lambda device: True)
        return built
    return use


def trees(k: int):
    """Random S-step expansions (S in 1, 3, 4) at every tie level (0: one-hot, orphans, TR-003)."""
    for S, N in ((1, k + 1), (3, 7), (4, 10)):
        for levels in (0, 2, 1000):
            for seed in range(1 if S == 4 else 2):
                sl, tl, pl = random_draft(3, k, S, seed, levels)
                parent_list, top, _ = organize_draft_results(sl, tl, pl, N)
                yield (S, N, levels, seed), parent_list.long().contiguous(), top.long().contiguous()


@pytest.mark.spec("TR-003", "TR-004", "TR-005")
@pytest.mark.parametrize("k", TOPKS)
def test_interpreted_structure_kernel_equals_the_torch_rule(interpreted, k):
    rule = [(case, device.tree_structure_torch(pl, top, k)) for case, pl, top in trees(k)]
    interpreted(build_kernel)
    orphans = 0
    for (case, want), (_, pl, top) in zip(rule, trees(k)):
        got = device.tree_structure(pl, top, k)  # the production dispatch: now the fused kernel
        for name, g, w in zip(("parents", "next_token", "next_sibling", "ancestors", "depth"), got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), (case, name)
        orphans += int((want[0][:, 1:] < 0).sum())
    assert orphans > 0  # the orphan rule was compared, not only well-formed trees


@pytest.mark.spec("TR-016", "TR-006")
@pytest.mark.parametrize("k", TOPKS)
def test_interpreted_accept_kernel_equals_the_torch_rule(interpreted, k):
    cases = []
    for B, S, N in ((1, 1, k + 1), (3, 3, 7), (2, 4, 12)):
        for seed in range(3):
            built, _ = both_trees(B, k, S, N, [5 + b for b in range(B)], seed, (0, 2, 1000)[seed])
            for hit in (0.0, 0.7, 1.0):
                tp = target_along(built, N, seed, hit)
                args = (built["draft_tokens"].view(B, N).contiguous(), built["retrive_index"].contiguous(),
                        built["retrive_next_token"].contiguous(), built["retrive_next_sibling"].contiguous(),
                        tp, S + 1)
                cases.append((args, device.verify_tree_greedy_torch(*args)))
    interpreted(accept_kernel)
    longest = 0
    for args, want in cases:
        got = device.verify_tree_greedy_device(*args)  # the production dispatch: now the fused kernel
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)), args
        longest = max(longest, int(want[2].max()))
    assert longest >= 2  # paths of two drafts and more were walked


def test_the_structure_and_accept_comparisons_can_fail(interpreted):
    """Negative control: the interpreted kernels' results depend on their inputs as the rules do,
    so the comparisons above can fail: the structure over a parent list whose frontier entries are
    rotated, the acceptance on a target shifted by one token, both differ from the rule's."""
    _, pl, top = next(t for t in trees(2) if t[0][:3] == (3, 7, 1000))
    want = device.tree_structure_torch(pl, top, 2)
    interpreted(build_kernel)
    assert all(torch.equal(g, w) for g, w in zip(build_kernel.tree_structure_fused(pl, top, 2), want))
    rotated = torch.cat([pl[:, :1], pl[:, 1:].roll(1, dims=1)], dim=1).contiguous()
    assert not all(torch.equal(g, w) for g, w in zip(build_kernel.tree_structure_fused(rotated, top, 2), want))
    built, _ = both_trees(1, 2, 3, 7, [5], 0, 1000)
    tp = target_along(built, 7, 0, 1.0)
    args = (built["draft_tokens"].view(1, 7), built["retrive_index"], built["retrive_next_token"],
            built["retrive_next_sibling"])
    want = device.verify_tree_greedy_torch(*args, tp, 4)
    assert int(want[2][0]) >= 1  # the target follows the tree: a path to tell apart
    interpreted(accept_kernel)
    assert all(torch.equal(g, w) for g, w in zip(accept_kernel.verify_tree_greedy_fused(*args, tp, 4), want))
    assert not all(torch.equal(g, w) for g, w in zip(accept_kernel.verify_tree_greedy_fused(*args, tp + 1, 4), want))


def _pool(P: int, seed: int, layers: int = 2) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(num_layers=layers, num_pages=6, page_size=P, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    for kv in pool.kv_buffer:
        kv.copy_(torch.randn(kv.shape, generator=g))
    return pool


def _moves(rnd: random.Random, slots: int):
    """(tgt, src) int64: distinct targets; half the time the accepted path's pattern (a window's
    first M slots from M increasing slots of it: a source that is also an earlier target)."""
    M = rnd.randrange(1, min(64, slots) + 1)
    if rnd.random() < 0.5:
        base = rnd.randrange(0, slots - M + 1)
        src = sorted(rnd.sample(range(base, min(slots, base + 2 * M)), M))
        return torch.arange(base, base + M), torch.tensor(src)
    return torch.tensor(rnd.sample(range(slots), M)), torch.tensor([rnd.randrange(slots) for _ in range(M)])


@pytest.mark.spec("TR-015", "TR-017", "TR-020")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_interpreted_move_kernel_equals_the_torch_rule(interpreted, P):
    rnd = random.Random(P)
    cases = []
    for seed in range(6):
        pool = _pool(P, seed)
        tgt, src = _moves(rnd, 6 * P)
        want = _pool(P, seed)
        move_kv_cache(want, tgt, src)  # the torch rule (a CPU tensor: no kernel yet)
        cases.append((pool, tgt, src, want))
    interpreted(move_kernel)
    for pool, tgt, src, want in cases:
        move_kv_cache(pool, tgt, src)  # the production dispatch: now the fused kernel
        assert all(torch.equal(g, w) for g, w in zip(pool.kv_buffer, want.kv_buffer)), (P, tgt, src)


def _merge_inputs(T, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    o1, o2 = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(2))
    l1, l2 = (torch.randn(H, T, generator=g) * 4 for _ in range(2))  # FA3's [H, T], passed as .T
    l1[0, 0] = float("inf")  # an empty prefix side as FA3 may report it
    l2[1 % H, 1 % T] = float("-inf")  # an empty expand side
    return o1, l1.T, o2, l2.T


@pytest.mark.spec("TR-012")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3, 16), (9, 4, 48), (5, 2, 4)])
def test_interpreted_merge_kernel_equals_the_torch_rule(interpreted, shape, dtype):
    o1, l1, o2, l2 = _merge_inputs(*shape, dtype, seed=sum(shape))
    want, want_lse = merge_state_torch(o1, l1, o2, l2)
    interpreted(merge_kernel)
    got, lse = merge_state(o1, l1, o2, l2)  # the production dispatch: now the fused kernel
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    assert got.dtype == dtype and got.shape == want.shape and lse.shape == want_lse.shape
    assert (got.double() - want.double()).abs().max().item() <= ulp * max(1.0, want.abs().max().item())
    assert torch.allclose(lse.double(), want_lse.double(), atol=1e-5, rtol=1e-6)
