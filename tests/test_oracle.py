"""The oracle (``refspec.oracle.attention.attention_by_slot``) against a dense textbook attention.

The textbook version below works on one request at a time, contiguous ``[S, Hkv, D]`` keys, an
explicit ``[Q, S]`` mask matrix and float64; the oracle gets the same keys scattered over a
NaN-poisoned slot pool through ``req_to_token``.  docs/fa3-contract.md#semantics: PA-004, PA-005, PA-006.
"""

from __future__ import annotations

import pytest
import torch

from refspec.oracle.attention import attention_by_slot


def textbook_attention(q, k, v, mask, scale, softcap=0.0):
    """Dense attention of one request in float64.

    Shapes: q ``[Q, H, D]``, k / v ``[S, Hkv, D]``, mask bool ``[Q, S]`` (True = visible).
    Query head h uses KV head ``floor(h * Hkv / H)`` (PA-006).  A row with no visible key is 0.
    """
    Q, H, D = q.shape
    Hkv = k.shape[1]
    out = torch.zeros((Q, H, D), dtype=torch.float64)
    for h in range(H):
        j = h * Hkv // H
        s = q[:, h].double() @ k[:, j].double().T * scale  # [Q, S]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        for i in range(Q):
            if mask[i].any():
                w = torch.softmax(s[i][mask[i]], dim=0)
                out[i, h] = w @ v[mask[i], j].double()
    return out


def bottom_right_mask(Q, S, window_left=-1):
    """The FA docstring's rule written as a matrix: row i keeps key p iff p <= i + S - Q (and the window)."""
    m = torch.zeros((Q, S), dtype=torch.bool)
    for i in range(Q):
        for p in range(S):
            last = i + S - Q
            m[i, p] = p <= last and (window_left < 0 or p >= last - window_left)
    return m


def scatter_batch(reqs, H, Hkv, D, dtype=torch.float32, seed=0, q_scale=1.0):
    """Requests ``[(Q_b, S_b), ...]`` with random q/k/v, keys scattered over a NaN slot pool.

    Returns (q ``[T, H, D]``, k_flat, v_flat ``[NS, Hkv, D]``, req_to_token ``[B+1, max S]`` with
    row 0 unused, cu_seqlens_q, dense per-request (q, k, v)).
    """
    g = torch.Generator().manual_seed(seed)
    total = sum(S for _, S in reqs)
    NS = 2 * total + 7
    slots = torch.randperm(NS, generator=g)[:total]
    k_flat = torch.full((NS, Hkv, D), float("nan"), dtype=dtype)
    v_flat = torch.full((NS, Hkv, D), float("nan"), dtype=dtype)
    R = torch.zeros((len(reqs) + 1, max([S for _, S in reqs] + [1])), dtype=torch.int32)
    qs, dense, cu, used = [], [], [0], 0
    for b, (Q, S) in enumerate(reqs):
        qb = (q_scale * torch.randn(Q, H, D, generator=g)).to(dtype)
        kb, vb = torch.randn(S, Hkv, D, generator=g).to(dtype), torch.randn(S, Hkv, D, generator=g).to(dtype)
        sl = slots[used:used + S]
        used += S
        R[b + 1, :S] = sl.to(torch.int32)
        k_flat[sl], v_flat[sl] = kb, vb
        qs.append(qb)
        dense.append((qb, kb, vb))
        cu.append(cu[-1] + Q)
    return torch.cat(qs), k_flat, v_flat, R, cu, dense


def run_oracle(reqs, H=4, Hkv=2, D=16, dtype=torch.float32, seed=0, q_scale=1.0, **kw):
    q, kf, vf, R, cu, dense = scatter_batch(reqs, H, Hkv, D, dtype, seed, q_scale)
    out = attention_by_slot(q, kf, vf, R, list(range(1, len(reqs) + 1)), [S for _, S in reqs], cu, **kw)
    return out, cu, dense


BATCHES = {
    "decode": [(1, 7), (1, 1)],
    "verify-S==Q": [(4, 9), (4, 4)],
    "extend": [(5, 5), (3, 8)],
    "more-q-than-k": [(5, 2), (2, 5)],
    "no-keys": [(2, 0), (1, 3)],
    "long": [(3, 300)],
}


@pytest.mark.spec("PA-004", "PA-005")
@pytest.mark.parametrize("name", BATCHES)
def test_oracle_equals_textbook_attention(name):
    reqs = BATCHES[name]
    out, cu, dense = run_oracle(reqs)
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    for b, ((Q, S), (q, k, v)) in enumerate(zip(reqs, dense)):
        ref = textbook_attention(q, k, v, bottom_right_mask(Q, S), scale=16 ** -0.5)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].double(), ref, atol=2e-6, rtol=1e-5)


def visible_keys(Q, S, **kw):
    """Read back the oracle's mask: q = 0 (uniform weights) and V[p] = one-hot(p) over D = S.

    Output row i, head 0, is 1/h at each visible key and 0 elsewhere, so ``> 0`` is the mask.
    """
    R = torch.arange(S, dtype=torch.int32)[None].repeat(2, 1)
    v = torch.eye(S, dtype=torch.float32)[:, None, :]  # [S, 1, D=S]
    out = attention_by_slot(torch.zeros(Q, 1, S), torch.zeros(S, 1, S), v, R, [1], [S], [0, Q], **kw)
    return out[:, 0, :], (out[:, 0, :] > 0).int().tolist()


@pytest.mark.spec("PA-004")
def test_fa_docstring_mask_q2_k5():
    """FA docstring: seqlen_q = 2, seqlen_k = 5 -> rows 1 1 1 1 0 / 1 1 1 1 1."""
    out, mask = visible_keys(2, 5)
    assert mask == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0]))


@pytest.mark.spec("PA-004", "PA-005")
def test_fa_docstring_mask_q5_k2_empty_rows_are_zero():
    """FA docstring: seqlen_q = 5, seqlen_k = 2 -> rows 0..2 see nothing, row 3 key 0, row 4 keys 0, 1.

    "If the row of the mask is all zero, the output will be zero": rows 0..2 are exactly 0.
    """
    out, mask = visible_keys(5, 2)
    assert mask == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    assert torch.equal(out[:3], torch.zeros(3, 2))
    torch.testing.assert_close(out[3:], torch.tensor([[1.0, 0.0], [0.5, 0.5]]))


@pytest.mark.spec("PA-005")
def test_request_with_no_keys_outputs_zero_even_over_a_nan_pool():
    out, cu, _ = run_oracle([(2, 0), (1, 3)])
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert bool(torch.isfinite(out[2]).all())


@pytest.mark.spec("PA-006")
@pytest.mark.parametrize("Hkv", [8, 4, 2, 1], ids=lambda h: f"gqa{8 // h}")
def test_gqa_head_mapping(Hkv):
    """H = 8.  V of KV head j is the constant j + 10, so output head h reads back its KV head:
    ``h // (8 / Hkv)`` (e.g. GQA 4: heads 0-3 -> 10, heads 4-7 -> 11)."""
    H, D, S = 8, 4, 5
    k = torch.randn(S, Hkv, D)
    v = (torch.arange(Hkv, dtype=torch.float32) + 10)[None, :, None].expand(S, Hkv, D).contiguous()
    R = torch.arange(S, dtype=torch.int32)[None].repeat(2, 1)
    out = attention_by_slot(torch.randn(2, H, D), k, v, R, [1], [S], [0, 2])
    got = out[:, :, 0].round().int()
    expected = [10 + h // (H // Hkv) for h in range(H)]
    assert got.tolist() == [expected, expected]
    # and the full numbers against the textbook mapping floor(h * Hkv / H)
    o2, cu, dense = run_oracle([(3, 11), (1, 6)], H=8, Hkv=Hkv, seed=Hkv)
    for b, ((Q, S), (q, kk, vv)) in enumerate(zip([(3, 11), (1, 6)], dense)):
        ref = textbook_attention(q, kk, vv, bottom_right_mask(Q, S), scale=16 ** -0.5)
        torch.testing.assert_close(o2[cu[b]:cu[b + 1]].double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.spec("PA-004")
def test_window_left_worked_examples():
    """w = 2, q 1 x k 6: the row ends at key 5 and sees keys 3, 4, 5.
    w = 1, q 3 x k 6: row i ends at key i + 3 and sees keys i + 2, i + 3."""
    _, m = visible_keys(1, 6, window_left=2)
    assert m == [[0, 0, 0, 1, 1, 1]]
    _, m = visible_keys(3, 6, window_left=1)
    assert m == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    _, m = visible_keys(3, 6, window_left=0)  # w = 0: only the query's own key
    assert m == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]


@pytest.mark.spec("PA-004")
@pytest.mark.parametrize("w", [0, 1, 3, 50])
def test_window_left_equals_textbook(w):
    reqs = [(4, 9), (1, 7), (5, 5)]
    out, cu, dense = run_oracle(reqs, window_left=w, seed=w)
    for b, ((Q, S), (q, k, v)) in enumerate(zip(reqs, dense)):
        ref = textbook_attention(q, k, v, bottom_right_mask(Q, S, w), scale=16 ** -0.5)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].double(), ref, atol=2e-6, rtol=1e-5)


def test_softcap_equals_textbook_and_matters():
    """Scores up to ~|40| with softcap c = 5: capped output equals the textbook and differs from uncapped."""
    reqs = [(4, 9), (1, 6)]
    out, cu, dense = run_oracle(reqs, softcap=5.0, q_scale=10.0, seed=1)
    plain, _, _ = run_oracle(reqs, q_scale=10.0, seed=1)
    for b, ((Q, S), (q, k, v)) in enumerate(zip(reqs, dense)):
        ref = textbook_attention(q, k, v, bottom_right_mask(Q, S), scale=16 ** -0.5, softcap=5.0)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].double(), ref, atol=2e-6, rtol=1e-5)
    assert float((out - plain).abs().max()) > 0.1


@pytest.mark.spec("TOL-002")
def test_upcast_false_makes_a_small_nonzero_bf16_error():
    """The T1 budget unit: the same oracle computed in bf16 is off, but only by bf16 rounding."""
    reqs = [(4, 40), (1, 90), (3, 3)]
    ref32, _, _ = run_oracle(reqs, H=8, Hkv=2, D=64, dtype=torch.bfloat16, seed=4, upcast=True)
    low, _, _ = run_oracle(reqs, H=8, Hkv=2, D=64, dtype=torch.bfloat16, seed=4, upcast=False)
    assert ref32.dtype == low.dtype == torch.bfloat16
    err = float((low.float() - ref32.float()).abs().max())
    assert 0 < err < 5e-2, err
