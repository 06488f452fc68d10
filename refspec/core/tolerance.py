"""Tolerance tiers (docs/tolerance-policy.md; docs/spec TOL-001..TOL-003).  Every comparison reports its
error as a percentage of its budget.

* **T0 bitwise** (TOL-001): ``torch.equal``.  Metadata, slot/page bookkeeping, KV writes, graph
  vs eager within one backend, fp32 token streams.
* **T1 relative** (TOL-002): ``max|out - ref32| <= 2 * max|ref_low - ref32| + floor(dtype)``,
  where ``ref32`` is the fp32 oracle and ``ref_low`` the same oracle run in the low precision
  (``upcast=False``).  This is FlashAttention's own test rule: a kernel may be at most twice as
  wrong as a straightforward low-precision implementation, plus a small absolute floor.
* **T2 tokens** (TOL-003): token streams equal, except that a first divergence is forgiven where
  the baseline's top-2 logit margin at that step is below ``delta`` (a near tie that rounding
  may flip); everything after a forgiven divergence is not compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: absolute floor of T1 per dtype (fp32: reordered sums, e.g. online softmax vs one softmax)
T1_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: T2 margin (logits) below which a greedy flip is forgiven
T2_DELTA = 1e-2


@dataclass
class Verdict:
    ok: bool
    err: float
    budget: float

    @property
    def pct(self) -> float:
        """The error as % of the budget (100 % = at the limit)."""
        return 100.0 * self.err / self.budget if self.budget > 0 else (0.0 if self.err == 0 else float("inf"))

    def __str__(self) -> str:
        """``err 0.006 = 25.0% of budget 0.024``.  A zero budget (T0) reads ``bitwise equal`` or
        ``not bitwise equal: max |diff| 0.5``; an infinite error (a NaN / inf in the output, or
        another shape) says so instead of printing ``inf%``."""
        finite = self.err != float("inf")
        if self.budget == 0:
            if self.ok:
                return "bitwise equal"
            return f"not bitwise equal: max |diff| {self.err:.3g}" if finite else \
                "not bitwise equal: a NaN / inf, or another shape"
        if not finite:
            return f"err inf (a NaN / inf, or another shape), budget {self.budget:.3g}"
        return f"err {self.err:.3g} = {self.pct:.1f}% of budget {self.budget:.3g}"


def _finite_max(x: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    return float(x.abs().max())


def t0(out: torch.Tensor, ref: torch.Tensor) -> Verdict:
    """TOL-001: bitwise equal (NaN never equals)."""
    ok = out.shape == ref.shape and torch.equal(out, ref)
    err = 0.0 if ok else (_finite_max(out.double() - ref.double()) if out.shape == ref.shape else float("inf"))
    return Verdict(ok, err, 0.0)


def t1(out: torch.Tensor, ref32: torch.Tensor, ref_low: torch.Tensor | None = None, dtype=None) -> Verdict:
    """TOL-002.  ``out`` / ``ref_low`` in the low dtype, ``ref32`` the fp32 oracle; same shape."""
    dtype = dtype or out.dtype
    base = 0.0 if ref_low is None else _finite_max(ref_low.float() - ref32.float())
    budget = 2 * base + T1_FLOOR[dtype]
    err = _finite_max(out.float() - ref32.float())
    return Verdict(err <= budget, err, budget)


def assert_t1(out, ref32, ref_low=None, what: str = "") -> Verdict:
    v = t1(out, ref32, ref_low)
    assert v.ok, f"T1 (TOL-002) {what}: {v}"
    return v


def t2(tokens: list[int], baseline: list[int], margins: list[float], delta: float = T2_DELTA) -> tuple[bool, str]:
    """TOL-003 for one request: ``margins[i]`` is the baseline's top-2 margin at step i."""
    for i, (a, b) in enumerate(zip(tokens, baseline)):
        if a != b:
            if margins[i] < delta:
                return True, f"first divergence at {i} forgiven (margin {margins[i]:.3g} < {delta})"
            return False, f"token {i}: {a} != {b} with margin {margins[i]:.3g} >= {delta}"
    if len(tokens) != len(baseline):
        return False, f"lengths {len(tokens)} != {len(baseline)}"
    return True, "equal"
