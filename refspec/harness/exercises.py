"""Checks for the tutorials' exercises.

Each exercise in ``tutorials/NN_*.py`` is three cells: the question with ``answer_x = ...`` for the
reader to fill in, a collapsed solution (``<details>``), and a hidden check cell (tag ``check``,
source hidden in Jupyter, input removed on the docs site) that computes the expected value from
the *rule* -- with the oracle or the spec's formula, never with the production code the
exercise is about -- and calls :func:`check`:

* the reader's answer given: it must equal the expected value (AssertionError with a hint if not);
* left as ``...``: the stored solution must equal the expected value (so the executed notebook,
  in ``tests/test_notebooks.py`` and on the docs site, proves every solution right).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from typing import Any

import torch


def same(a: Any, b: Any) -> bool:
    """Equality for exercise answers: tensors (by value, any integer / float dtype), lists,
    tuples, ints, strings; floats / float tensors to 1e-5 relative."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        if a.shape != b.shape:
            return False
        if a.is_floating_point() or b.is_floating_point():
            return torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6, equal_nan=True)
        return torch.equal(a.long(), b.long())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-5 * max(1.0, abs(b))
    return a == b


def check(name: str, answer: Any, expected: Any, solution: Any, hint: str = "") -> bool:
    """Check exercise ``name``. Returns True when the reader's ``answer`` is right, False when it
    is still ``...`` (then the stored ``solution`` is checked instead).

    Raises AssertionError: a wrong answer (with ``hint``), or a stored solution that disagrees
    with ``expected`` (a broken tutorial).
    """
    if answer is ...:
        assert same(solution, expected), f"exercise {name}: the stored solution {solution!r} != {expected!r}"
        print(f"exercise {name}: not answered yet (answer is ...); the solution above is checked: {expected!r}")
        return False
    assert same(answer, expected), (f"exercise {name}: {answer!r} is not what the rule gives."
                                    + (f" Hint: {hint}" if hint else ""))
    print(f"exercise {name}: correct")
    return True
