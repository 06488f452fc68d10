"""A left window through the real FA3 kernel on Hopper (``@pytest.mark.gpu``): the CPU matrix
of ``test_window.py`` in bf16, real kernel and emulator on CUDA, eager and under real CUDA graphs,
each against the fp32 oracle under T1 (TOL-002, budget from the oracle's own bf16 run).

Run on an H200: ``python -m pytest -m gpu tests/test_gpu_window.py -q``.  Elsewhere every test
skips with the reason (no CUDA device / no FA3).  The tests write no files.
"""

from __future__ import annotations

import pytest
import torch
from test_window import CASES, scenario

from refspec.core.tolerance import assert_t1

pytestmark = pytest.mark.gpu


@pytest.mark.spec("PA-004", "PA-006", "TOL-002")
@pytest.mark.parametrize("label,P,gqa,w", CASES)
def test_real_fa3_window_equals_the_oracle(label, P, gqa, w):
    sc = scenario(label, P, gqa, w, dtype=torch.bfloat16, device="cuda")
    b = sc.build()
    ref, low = b.run_oracle(), b.run_oracle(upcast=False)
    what = f"{label} P={P} {gqa} w={w}"
    for provider in ("fa3", "emulator"):
        out = sc.build().run_fa3(provider=provider)
        assert bool(torch.isfinite(out).all()), f"{what} {provider}: read poison"
        assert_t1(out, ref, low, f"{what} {provider} eager")
    assert_t1(sc.build().run_fa3_graph(provider="fa3"), ref, low, f"{what} fa3 graph")
