"""``refspec.oracle.slots.attention_over_slots`` against a float64 textbook, one row at a time.

The textbook gets each row's keys as a dense ``[J, Hkv, D]`` block; the function under test gets
them as slot ids into a NaN-poisoned pool, so reading any unlisted slot would show as NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.oracle.attention import attention_by_slot
from refspec.oracle.slots import attention_over_slots, merge_by_lse


def textbook_row(q_row, k_rows, v_rows, scale):
    """One query row ``[H, D]`` over keys ``[J, Hkv, D]`` in float64: (out ``[H, D]``, lse ``[H]``)."""
    H, D = q_row.shape
    Hkv = k_rows.shape[1]
    out = torch.zeros((H, D), dtype=torch.float64)
    lse = torch.full((H,), -math.inf, dtype=torch.float64)
    if k_rows.shape[0] == 0:
        return out, lse
    for h in range(H):
        j = h * Hkv // H
        s = [scale * float(q_row[h].double() @ k_rows[n, j].double()) for n in range(k_rows.shape[0])]
        mx = max(s)
        w = [math.exp(x - mx) for x in s]
        z = sum(w)
        lse[h] = mx + math.log(z)
        for n in range(k_rows.shape[0]):
            out[h] += (w[n] / z) * v_rows[n, j].double()
    return out, lse


def poisoned_pool(NS, Hkv, D, live, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.full((NS, Hkv, D), float("nan"))
    v = torch.full((NS, Hkv, D), float("nan"))
    k[live] = torch.randn((len(live), Hkv, D), generator=g)
    v[live] = torch.randn((len(live), Hkv, D), generator=g)
    return k, v


@pytest.mark.spec("PA-005", "PA-006")
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 1)])
def test_matches_textbook_with_gqa_and_empty_rows(H, Hkv):
    D, NS = 8, 40
    live = [3, 5, 8, 9, 17, 21, 22, 30, 31, 38]
    k, v = poisoned_pool(NS, Hkv, D, live)
    rows = [[3, 5, 8], [], [38], [22, 3, 31, 30, 9, 17], torch.tensor([21, 8]), [5, 5]]
    q = torch.randn((len(rows), H, D), generator=torch.Generator().manual_seed(1))
    out, lse = attention_over_slots(q, k, v, rows, return_lse=True)
    assert out.dtype == torch.float32 and lse.shape == (H, len(rows)) and lse.dtype == torch.float32
    for t, row in enumerate(rows):
        idx = torch.as_tensor(list(row), dtype=torch.long)
        ref_o, ref_l = textbook_row(q[t], k[idx], v[idx], D ** -0.5)
        torch.testing.assert_close(out[t].double(), ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, t].double(), ref_l, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros(H, D)) and bool(torch.isneginf(lse[:, 1]).all())


@pytest.mark.spec("PA-004")
def test_causal_slot_lists_equal_attention_by_slot():
    """With row i's list = the first (i + K - Q + 1) slots of a request, it is the causal oracle."""
    H, Hkv, D, NS = 4, 2, 8, 32
    slots = [7, 2, 19, 11, 4, 25]  # req_to_token row of one request, K = 6, Q = 3
    k, v = poisoned_pool(NS, Hkv, D, slots, seed=2)
    q = torch.randn((3, H, D), generator=torch.Generator().manual_seed(3))
    r2t = torch.tensor([[0] * 6, slots], dtype=torch.int32)
    ref = attention_by_slot(q, k, v, r2t, [1], [6], [0, 3])
    got = attention_over_slots(q, k, v, [slots[:4], slots[:5], slots[:6]])
    assert torch.equal(got, ref)


def test_two_disjoint_sets_merge_to_the_union():
    """The cascade identity: LSE-merging prefix and expand parts equals attention over both."""
    H, Hkv, D, NS = 4, 1, 16, 64
    prefix, expand = [1, 4, 9, 16, 25, 36], [40, 41, 50]
    k, v = poisoned_pool(NS, Hkv, D, prefix + expand, seed=4)
    q = torch.randn((3, H, D), generator=torch.Generator().manual_seed(5))
    exp_rows = [expand[:1], expand[:2], []]  # the last row has no expand key: weight 0
    o_p, l_p = attention_over_slots(q, k, v, [prefix] * 3, return_lse=True)
    o_e, l_e = attention_over_slots(q, k, v, exp_rows, return_lse=True)
    o_m, l_m = merge_by_lse(o_p, l_p, o_e, l_e)
    o_u, l_u = attention_over_slots(q, k, v, [prefix + r for r in exp_rows], return_lse=True)
    torch.testing.assert_close(o_m, o_u, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l_m, l_u, atol=1e-6, rtol=1e-6)
    assert torch.equal(o_m[2], o_p[2].float())  # empty expand leaves the prefix part unchanged


def test_order_of_slots_does_not_matter_and_out_dtype():
    H, D, NS = 2, 4, 10
    k, v = poisoned_pool(NS, 2, D, list(range(NS)), seed=6)
    q = torch.randn((1, H, D), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    a = attention_over_slots(q, k, v, [[1, 2, 3, 9]], out_dtype=torch.float32)
    b = attention_over_slots(q, k, v, [[9, 3, 1, 2]], out_dtype=torch.float32)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert attention_over_slots(q, k, v, [[1, 2]]).dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["q2d", "kv_mismatch", "head_dim", "gqa", "rows", "slot_oob", "slot_neg"])
def test_bad_input_raises_pa011(case):
    H, Hkv, D, NS = 4, 2, 8, 10
    q, k, v, rows = torch.zeros(2, H, D), torch.zeros(NS, Hkv, D), torch.zeros(NS, Hkv, D), [[0], [1]]
    if case == "q2d":
        q = q[0]
    elif case == "kv_mismatch":
        v = torch.zeros(NS + 1, Hkv, D)
    elif case == "head_dim":
        k = v = torch.zeros(NS, Hkv, D + 1)
    elif case == "gqa":
        k = v = torch.zeros(NS, 3, D)
    elif case == "rows":
        rows = [[0]]
    elif case == "slot_oob":
        rows = [[0], [NS]]
    else:
        rows = [[-1], [1]]
    with pytest.raises(InvariantError, match=r"\[PA-011\]"):
        attention_over_slots(q, k, v, rows)
