"""``str(Verdict)`` reads as a sentence (issue 23): no "err 0 = 0.0% of budget 0", no "inf%"."""

from __future__ import annotations

import pytest
import torch

from refspec.core import tolerance
from refspec.core.tolerance import Verdict


@pytest.mark.spec("TOL-001")
def test_t0_verdicts_say_bitwise():
    x = torch.arange(4.0)
    assert str(tolerance.t0(x, x.clone())) == "bitwise equal"
    assert str(tolerance.t0(x + torch.tensor([0, 0, 0.5, 0]), x)) == "not bitwise equal: max |diff| 0.5"
    nan = x.clone()
    nan[1] = float("nan")
    assert str(tolerance.t0(nan, x)) == "not bitwise equal: a NaN / inf, or another shape"
    assert str(tolerance.t0(x[:3], x)) == "not bitwise equal: a NaN / inf, or another shape"


def test_budgeted_verdicts_give_the_share_of_the_budget():
    assert str(Verdict(True, 0.006, 0.024)) == "err 0.006 = 25.0% of budget 0.024"
    assert str(Verdict(False, float("inf"), 0.024)) == "err inf (a NaN / inf, or another shape), budget 0.024"
    assert "%" not in str(Verdict(False, float("inf"), 0.024))
