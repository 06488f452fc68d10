"""The fused Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

TR-012's merge (:mod:`refspec.fa3.merge_kernel`), TR-016's tree acceptance
(:mod:`refspec.speculative.tree.accept_kernel`) and the tree's structure, TR-003 / TR-004 /
TR-005 (:mod:`refspec.speculative.tree.build_kernel`) and the tree's KV move, TR-020
(:mod:`refspec.speculative.tree.move_kernel`), run only on CUDA.  Triton's front end,
its GPU passes and ``ptxas`` (shipped in the triton wheel) all run on a CPU, so a typing or
lowering error in a kernel shows here, at the shapes the engines launch, before a GPU is lent.
What this cannot show is a wrong result: the GPU tests (``tests/test_gpu_tree_*_kernel.py``,
``tests/test_gpu_merge*.py``) compare the kernels with their torch rules on CUDA.

Needs Triton, which a CPU build of torch does not bring: ``make triton-check`` (run by ``.ci/run``
after ``make test``) installs a pinned one into ``.triton/`` and runs this file with a fresh Triton
cache; under a plain ``make test`` on a CPU torch the file is skipped with that reason.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="needs Triton (make triton-check installs it into .triton/)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from refspec.fa3 import merge_kernel  # noqa: E402
from refspec.speculative.tree import accept_kernel, build_kernel, move_kernel  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compiled(fn, signature: dict, constexprs: dict, num_warps: int = 4):
    """``fn`` compiled for sm_90 down to machine code; the compiled kernel's assembly dict."""
    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                       options={"num_warps": num_warps})
    assert "cubin" in k.asm and "ptx" in k.asm
    return k.asm


@pytest.mark.spec("TR-012")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 80, 128])
def test_the_merge_kernel_compiles_for_hopper(dtype, D):
    merge, pow2 = merge_kernel._kernel()
    sig = {n: f"*{dtype}" for n in ("o1", "o2", "out")} | {n: "*fp32" for n in ("l1p", "l2p", "lse_out")}
    sig |= {n: "i32" for n in ("s1t", "s1h", "s2t", "s2h", "sot", "soh", "sl1t", "sl1h", "sl2t", "sl2h", "H")}
    sig |= {"D": "constexpr", "BLOCK_D": "constexpr"}
    compiled(merge, sig, {"D": D, "BLOCK_D": pow2(D)})


@pytest.mark.spec("TR-016")
@pytest.mark.parametrize("S,N", [(1, 2), (4, 8), (6, 21)])
def test_the_accept_kernel_compiles_for_hopper(S, N):
    sig = {n: "*i64" for n in ("predicts", "accept_index", "accept_num", "cand", "ridx", "nxt", "sib", "tp")}
    compiled(accept_kernel._kernel(), sig | {"S": "constexpr", "N": "constexpr"}, {"S": S, "N": N})


@pytest.mark.spec("TR-003", "TR-004", "TR-005")
@pytest.mark.parametrize("K,S,N", [(2, 1, 2), (4, 1, 4), (4, 3, 8), (2, 3, 5), (3, 4, 20), (2, 6, 12)])
def test_the_structure_kernel_compiles_for_hopper(K, S, N):
    PL = 0 if S == 1 else 1 + (S - 1) * K
    sig = {"links": "*i64", "anc": "*u8", "depth": "*i64", "plist": "*i64", "top": "*i64"}
    sig |= {n: "constexpr" for n in ("K", "S", "N", "PL")}
    compiled(build_kernel._kernel(), sig, {"K": K, "S": S, "N": N, "PL": PL}, num_warps=1)


@pytest.mark.spec("TR-020")
@pytest.mark.parametrize("M,row", [(1, 384), (4, 384), (45, 384), (256, 384), (64, 2048), (128, 16384)])
def test_the_move_kernel_compiles_for_hopper(M, row):
    """At SmolLM2's slot (3 KV heads x 64, bf16: 384 bytes) for the path and tail-copy moves, and
    at wider slots (8 x 128, 64 x 128), with the launch's own tiling."""
    upper = max(2, 1 << (M - 1).bit_length())
    tile, warps = move_kernel._tile(row, upper)
    sig = {"ptrs": "*i64", "tgt": "*i64", "src": "*i64", "n": "i32"}
    sig |= {n: "constexpr" for n in ("UPPER", "ROW", "TILE")}
    compiled(move_kernel._kernel(), sig, {"UPPER": upper, "ROW": row, "TILE": tile}, num_warps=warps)


def test_a_kernel_that_does_not_type_check_fails_to_compile_here():
    """Negative control: a variable that is a scalar in one branch and a block in the other is
    refused here too, without a GPU, so the tests above check more than that Triton imports."""
    tl = triton.language

    @triton.jit
    def ill_typed(x, N: tl.constexpr):
        v = tl.load(x)
        if v > 0:
            v = tl.zeros((4,), dtype=tl.float32)
        tl.store(x, v)

    with pytest.raises(Exception, match="(?i)type|mismatch|shape"):
        compiled(ill_typed, {"x": "*i64", "N": "constexpr"}, {"N": 1})
