"""The draft-extend accept-length rule under CUDA-graph replay (invariants CG-003, CG-004, SD-006).

v1 (DRAFT_EXTEND) packs the a_b = n_b + 1 accepted tokens of each request:
``cu_seqlens_q = [0, cumsum(num_accept_tokens)]``; v2 (DRAFT_EXTEND_V2) runs all N rows of each
request: ``cu_seqlens_q = [0, N, 2N, ...]``.  Each wrong rule kept in :mod:`refspec.mutants.variants` (the
other mode's rule, and n instead of n + 1) must change at least one real row even at batch size 1
(shown with ``validate=False``, so the output difference itself is what is asserted) and must be
flagged by the replay validation (``validate=True``) with its invariant ID.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_kit import N, Requests, real_rows_differ, scenario
from hypothesis import given, settings
from hypothesis import strategies as st

from refspec.mutants import variants
from refspec.core import tolerance as tol
from refspec.core.invariants import InvariantError


def _replay(reqs, idx, validate=True, capture_bs=(1, 2, 4, 8)):
    fb, x, ref = reqs.live(idx)
    return reqs.runner(capture_bs=capture_bs, validate=validate).replay(fb, x), ref


@pytest.mark.spec("CG-003", "SD-004")
@pytest.mark.parametrize("P", [1, 4, 16])
def test_v1_mixed_accept_counts_replay_equals_oracle(P):
    """v1, a = [1, 3, 4, 2] (mixed), 4 requests in the bs=4 graph and 3 in it: equals the oracle."""
    reqs = Requests(scenario("draft_extend", P, accept=[1, 3, 4, 2, 4, 1, 2, 3, 1]))
    for idx in ([0, 1, 2, 3], [5, 1, 3]):
        out, ref = _replay(reqs, idx)
        tol.assert_t1(out, ref, what=f"v1 P={P} idx={idx}")


@pytest.mark.spec("CG-004", "SD-005")
@pytest.mark.parametrize("P", [1, 4, 16])
def test_v2_mixed_accept_counts_replay_equals_oracle(P):
    """v2, accepted counts [1, 3, 4, 2]: every row, and the kept row b*N + a_b - 1, equals the oracle."""
    a = [1, 3, 4, 2, 4, 1, 2, 3, 1]
    reqs = Requests(scenario("draft_extend_v2", P, accept=a))
    for idx in ([0, 1, 2, 3], [5, 1, 3]):
        out, ref = _replay(reqs, idx)
        tol.assert_t1(out, ref, what=f"v2 P={P} idx={idx}")
        kept = [b * N + a[j] - 1 for b, j in enumerate(idx)]
        tol.assert_t1(out[kept], ref[kept], what=f"v2 kept rows P={P} idx={idx}")


WRONG_RULES = [  # (mode, bug, the ID the replay validation names)
    ("draft_extend", "de-v1-uniform-cu-q", "CG-003"),  # v2's uniform layout applied to v1
    ("draft_extend", "de-v1-accept-off-by-one", "CG-003"),  # n instead of n + 1
    ("draft_extend_v2", "de-v2-packed-cu-q", "CG-004"),  # v1's packed layout applied to v2
]


@pytest.mark.spec("CG-003", "CG-004")
@pytest.mark.parametrize("idx", [[0], [0, 1, 2]], ids=["B1", "B3"])
@pytest.mark.parametrize("name,bug,inv", WRONG_RULES, ids=[b for _, b, _ in WRONG_RULES])
def test_wrong_accept_rule_changes_a_real_row_and_is_flagged(name, bug, inv, idx):
    """a = [2, 3, 1] (< N = 4): the wrong rule changes at least one real row (batch size 1
    included), and with validation the replay raises the rule's ID."""
    reqs = Requests(scenario(name, 4, lens=[9, 14, 5], accept=[2, 3, 1]))
    with variants.enabled(bug):
        out, ref = _replay(reqs, idx, validate=False)
    assert real_rows_differ(out, ref), f"{bug} left every real row unchanged"
    with variants.enabled(bug), pytest.raises(InvariantError) as e:
        _replay(reqs, idx, validate=True)
    assert e.value.inv_id == inv


@pytest.mark.spec("CG-003", "CG-004")
@pytest.mark.parametrize("name,bug", [("draft_extend", "de-v1-uniform-cu-q"), ("draft_extend_v2", "de-v2-packed-cu-q")])
def test_cross_applied_rule_is_invisible_at_full_acceptance(name, bug):
    """Why the tests above use a_b < N: with every a_b = N the two layouts coincide (CG-003),
    so the cross-applied rule gives the right output; only mixed counts expose it."""
    reqs = Requests(scenario(name, 4, lens=[9, 14, 5], accept=[N, N, N]))
    with variants.enabled(bug):
        out, ref = _replay(reqs, [0, 1, 2], validate=False)
    tol.assert_t1(out, ref, what=f"{bug} at full acceptance")


@pytest.mark.spec("CG-003", "CG-002")
@settings(max_examples=15, deadline=None)
@given(a=st.lists(st.integers(1, N), min_size=1, max_size=6), P=st.sampled_from([1, 3, 4, 16]))
def test_v1_replay_packed_layout_random_accepts(a, P):
    """Random accepted counts and page sizes: replay cu_q = [0, cumsum a] then + N per padded row
    (numpy cumsum, by hand), and the replay equals the eager path bitwise (T0)."""
    B = len(a)
    reqs = Requests(scenario("draft_extend", P, lens=[7 + 5 * b for b in range(B)], accept=a))
    runner = reqs.runner(capture_bs=(2, 4, 8))
    fb, x, _ = reqs.live(list(range(B)))
    out = runner.replay(fb, x)
    Bg = {1: 2, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8}[B]
    want = np.concatenate([[0], np.cumsum(a + [N] * (Bg - B))]).tolist()
    assert runner.backend.forward_metadata.cu_seqlens_q.tolist() == want
    assert tol.t0(out, reqs.eager(fb, x)[0]).ok


# ---- SD-006: v1 and v2 agree on the kept row; rows >= a_b cannot reach rows < a_b ----
LENS_13, ACC_13 = [9, 14, 5, 30], [2, 4, 1, 3]


def _v1_and_v2(P):
    """v1 and v2 pools with the same prefix KV (same seed and committed lengths) whose v2 rows
    b*N + i, i < a_b, are the v1 rows of segment b."""
    v1 = Requests(scenario("draft_extend", P, lens=LENS_13, accept=ACC_13))
    v2 = Requests(scenario("draft_extend_v2", P, lens=LENS_13, accept=ACC_13))
    same = [b * N + i for b, a in enumerate(ACC_13) for i in range(a)]
    for name in ("q", "k", "v"):
        getattr(v2.built, name)[same] = getattr(v1.built, name)
    return v1, v2, same


@pytest.mark.spec("SD-006")
@pytest.mark.parametrize("P", [1, 4, 16])
def test_v2_kept_row_equals_v1_last_row(P):
    """SD-006: v2 row b*N + a_b - 1 equals v1's last row of segment b, and in fact every
    v2 row b*N + i (i < a_b) equals v1 row cu[b] + i: same visible keys L_b + i + 1, same values.
    T1 (fp32): the two runs see different K_b and page tables, so bitwise is not promised."""
    v1, v2, same = _v1_and_v2(P)
    idx = list(range(len(LENS_13)))
    out1 = v1.runner(capture_bs=(4,)).replay(*v1.live(idx)[:2])
    out2 = v2.runner(capture_bs=(4,)).replay(*v2.live(idx)[:2])
    last1 = np.cumsum(ACC_13) - 1
    kept2 = [b * N + a - 1 for b, a in enumerate(ACC_13)]
    tol.assert_t1(out2[kept2], out1[last1], what="v2 kept rows vs v1 last rows")
    tol.assert_t1(out2[same], out1, what="v2 rows < a_b vs v1 rows")


@pytest.mark.spec("SD-006", "PA-004")
def test_v2_rows_past_accept_cannot_change_earlier_rows():
    """Changing v2's q/k/v in rows >= a_b (the rejected drafts) leaves rows < a_b bitwise equal,
    and changes rows >= a_b (so the change did reach the kernel)."""
    _, v2, same = _v1_and_v2(4)
    idx = list(range(len(LENS_13)))
    runner = v2.runner(capture_bs=(4,))
    fb, x, _ = v2.live(idx)
    before = runner.replay(fb, x)
    rest = [t for t in range(len(LENS_13) * N) if t not in same]
    x2 = {n: t.clone() for n, t in x.items()}
    for t in x2.values():
        t[rest] = -3.0 * t[rest] + 7.0
    after = runner.replay(fb, x2)
    assert torch.equal(after[same], before[same])
    assert not torch.allclose(after[rest], before[rest])
