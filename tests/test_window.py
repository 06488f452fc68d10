"""A left window through the FA3 wing, end to end on CPU: oracle vs emulator, eager and graphed.

``AttentionLayer.sliding_window_size = w`` means a query at position t sees keys
``t - w .. t`` (w + 1 keys, PA-004); the FA3 wing passes it as ``window_size = (w, 0)``
(:func:`refspec.fa3.backend.kernel_window_size`) and the emulator masks with both edges inclusive
(:func:`refspec.fa3.emulator.visible_keys`).  Before issue 13 no test ran a window through the
FA3 wing, so ``(w - 1, 0)`` or an exclusive edge passed the whole suite; the two variants
``fa3-window-minus-one`` and ``emulator-window-edge`` are now caught here and by ``mutants``.

Cases: every mode the spec loop graphs (verify rows, decode, draft decode, both draft extends),
P in {1, 4, 16}, GQA 8/2 and 16/1, windows 0 (own key only), 3 and 9, with contexts longer than
the window so that the edge cuts.  The real kernel runs the same matrix in ``test_gpu_window.py``.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode as M
from refspec.core.tolerance import assert_t1
from refspec.fa3.backend import kernel_window_size
from refspec.harness.scenario import Scenario
from refspec.mutants import variants

#: label -> Scenario kwargs (contexts 13..41 tokens, longer than every window)
MODES = {
    "verify": {"mode": M.TARGET_VERIFY, "lens": [13, 30, 21]},
    "decode": {"mode": M.DECODE, "lens": [14, 31, 22]},
    "draft_decode": {"mode": M.DECODE, "lens": [13, 30, 21], "draft_step": 1},
    "draft_extend_v1": {"mode": M.DRAFT_EXTEND, "lens": [13, 30, 21], "num_accept_tokens": [2, 4, 1]},
    "draft_extend_v2": {"mode": M.DRAFT_EXTEND_V2, "lens": [13, 30, 21], "num_accept_tokens": [2, 4, 1]},
}
GQA = {"gqa4": (8, 2), "gqa16": (16, 1)}
CASES = [pytest.param(label, P, g, w, id=f"{label}-P{P}-{g}-w{w}")
         for label in MODES for P in (1, 4, 16) for g in GQA for w in (0, 3, 9)]


def scenario(label, P, gqa, w, **kw) -> Scenario:
    H, Hkv = GQA[gqa]
    return Scenario(page_size=P, num_draft_tokens=4, num_heads=H, num_kv_heads=Hkv, head_dim=32, window_left=w,
                    seed=P + w, **MODES[label], **kw)


def test_window_size_passed_to_fa3_is_w_comma_0():
    """The worked values of the mapping (upstream ``window_size = (layer.sliding_window_size, 0)``)."""
    layer = lambda w: AttentionLayer(0, 8, 2, 32, sliding_window_size=w)
    assert [kernel_window_size(layer(w)) for w in (-1, 0, 5)] == [(-1, -1), (0, 0), (5, 0)]


@pytest.mark.spec("PA-004", "PA-006", "TOL-002")
@pytest.mark.parametrize("label,P,gqa,w", CASES)
def test_window_through_the_fa3_wing_equals_the_oracle(label, P, gqa, w):
    """Eager FA3 (emulator) and its graph replay against the paged oracle, fp32."""
    sc = scenario(label, P, gqa, w)
    ref = sc.build().run_oracle()
    full = scenario(label, P, gqa, -1).build().run_oracle()
    assert not torch.allclose(ref, full), "the window does not cut: the case tests nothing"
    assert_t1(sc.build().run_fa3(provider="emulator"), ref, None, f"{label} P={P} {gqa} w={w} eager")
    assert_t1(sc.build().run_fa3_graph(provider="emulator"), ref, None, f"{label} P={P} {gqa} w={w} graph")


@pytest.mark.spec("PA-004")
@pytest.mark.parametrize("w", [0, 3, 9])
@pytest.mark.parametrize("label", list(MODES))
def test_window_horizon_probe_by_hand(label, w):
    """No oracle: q = 0 and V[slot of key p] = p, so the row at position t reads back the mean
    of its visible positions, ``(max(0, t - w) + t) / 2``, on the emulator through the FA3 wing."""
    b = scenario(label, 4, "gqa4", w).build()
    _, vf = b.pool.get_flat_kv(0)
    for r, K in zip(b.fb.req_pool_indices.tolist(), b.K):
        slots = b.kv.req_to_token[r, :K].long()
        vf[slots] = torch.arange(K, dtype=vf.dtype)[:, None, None].expand(K, *vf.shape[1:])
    b.q.zero_()
    b.v.copy_(b.fb.positions.to(b.v.dtype)[:, None, None].expand_as(b.v))
    out = b.run_fa3(provider="emulator").mean(dim=(1, 2))
    t = b.fb.positions.double()
    want = ((t - w).clamp(min=0) + t) / 2
    assert torch.allclose(out.double(), want, atol=1e-4), (out.tolist(), want.tolist())


@pytest.mark.spec("PA-004")
@pytest.mark.parametrize("name", ["fa3-window-minus-one", "emulator-window-edge"])
def test_window_off_by_one_variants_fail_these_tests(name):
    """The matrix above is what catches the two window variants: each fails a case of it."""
    with variants.enabled(name), pytest.raises(AssertionError, match="T1"):
        test_window_through_the_fa3_wing_equals_the_oracle("verify", 4, "gqa4", 3)
