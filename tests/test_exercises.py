"""``refspec.harness.exercises.check``: a right answer passes, a wrong one fails with the hint, an
unanswered exercise checks the stored solution (so an executed tutorial proves its solutions)."""

from __future__ import annotations

import pytest
import torch

from refspec.harness import exercises


def test_right_answer_passes():
    assert exercises.check("t", [0, 4, 8], torch.tensor([0, 4, 8], dtype=torch.int32), solution=[0, 4, 8]) is True


def test_wrong_answer_fails_with_the_hint():
    with pytest.raises(AssertionError, match="Hint: uniform"):
        exercises.check("t", [0, 2, 6], [0, 4, 8], solution=[0, 4, 8], hint="uniform")


def test_unanswered_checks_the_solution():
    assert exercises.check("t", ..., (13, 9), solution=(13, 9)) is False
    with pytest.raises(AssertionError, match="stored solution"):
        exercises.check("t", ..., (13, 9), solution=(9, 13))


@pytest.mark.parametrize("a,b,same", [
    (1, 1, True), (1, 2, False), ("CG-004", "CG-004", True), ([1, [2, 3]], (1, (2, 3)), True),
    (torch.tensor([1.0, 2.0]), [1.0, 2.0 + 1e-9], True), (torch.tensor([1, 2]), [1, 2, 3], False),
    (0.1 + 0.2, 0.3, True),
])
def test_same(a, b, same):
    assert exercises.same(a, b) is same
