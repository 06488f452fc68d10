"""MLA on the real FA3 kernel (``@pytest.mark.gpu``): skipped, with the refused-build reason, until a
build with the hdim 64 / 512 kernel is importable.

refspec claims no MLA result on a GPU (docs/mla.md, "The GPU build"): the wheel its GPU runs use
(``tokenspeed-fa3``) is built without ``HDIMDIFF64`` / ``HDIMDIFF192`` and refspec refuses MLA on it
by rule (ML-013).  On a Hopper machine whose FA3 build has both kernels, these tests run the
absorbed ``qv`` call and the prefill in bf16 against the fp32 oracle (T1), DeepSeek's dims.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.core.mla import DEEPSEEK_V3_DIMS
from refspec.core.modes import ForwardMode as M
from refspec.core.tolerance import assert_t1
from refspec.fa3 import kernel
from refspec.harness.mla_scenario import MLAScenario

pytestmark = pytest.mark.gpu

MODES = {
    "decode": dict(mode=M.DECODE, lens=[5, 17, 70]),
    "target_verify": dict(mode=M.TARGET_VERIFY, lens=[5, 17, 70]),
    "draft_extend_v2": dict(mode=M.DRAFT_EXTEND_V2, lens=[5, 17, 70], num_accept_tokens=[1, 3, 2]),
}


def require_mla_build(call: str = "qv") -> None:
    reason = kernel.mla_kernel_problem("fa3", call)
    if reason:
        pytest.skip(f"MLA refused on this FA3 build (ML-013): {reason}")


@pytest.mark.spec("ML-013")
def test_this_build_is_refused_or_has_the_kernel():
    """On the GPU machine: either the build has the 64 / 512 kernel, or constructing an MLA backend
    on it raises ML-013 (never a silent run)."""
    built = MLAScenario(M.DECODE, 16, [5, 9], dims=DEEPSEEK_V3_DIMS, dtype=torch.bfloat16, device="cuda").build()
    if kernel.mla_kernel_problem("fa3", "qv"):
        with pytest.raises(InvariantError, match=r"\[ML-013\]"):
            built.fa3_backend(provider="fa3")
    else:
        assert built.fa3_backend(provider="fa3").use_mla


@pytest.mark.spec("ML-005", "ML-003", "TOL-002")
@pytest.mark.parametrize("P", (1, 16, 64))
@pytest.mark.parametrize("mode", MODES)
def test_real_qv_kernel_equals_the_oracle(mode, P):
    require_mla_build("qv")
    built = MLAScenario(page_size=P, dims=DEEPSEEK_V3_DIMS, num_heads=16, dtype=torch.bfloat16, device="cuda",
                        **MODES[mode]).build()
    ref, low = built.run_oracle(), built.run_oracle(upcast=False)
    out = built.run_fa3(provider="fa3")
    assert bool(torch.isfinite(out).all()), f"{mode} P={P}: the real kernel returned NaN / inf"
    assert_t1(out, ref, low, f"MLA {mode} P={P} bf16")
