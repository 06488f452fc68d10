"""The real FA3 kernel called as SGLang calls it: ``cu_seqlens_k_new`` and ``num_splits`` (GPU).

SGLang's FA3 backend passes ``cu_seqlens_k_new=metadata.cu_seqlens_k`` and
``num_splits=self.num_splits`` (0, or 1 with ``--enable-deterministic-inference``) to
``flash_attn_with_kvcache`` (``forward_extend``: ``flashattention_backend.py:784@v0.5.5``,
``:835@v0.5.12.post1``, ``:1796@v0.5.23``; ``forward_decode``: ``:1115@v0.5.5``).  refspec passes
neither (docs/fa3-contract.md#what-sglang-passes-and-what-refspec-passes).  FA3's ``mha_fwd``
reads ``cu_seqlens_k_new`` only together with a new ``k`` / ``v`` (``hopper/flash_api.cpp:929``
at ``fa4-v4.0.0.beta27``), so with store-then-attend it must change nothing.  These tests call the real
kernel (``flash_attn_interface``) on every mode's metadata, P in {1, 4, 16, 64}:

* refspec's call vs SGLang's call (``cu_seqlens_k_new`` = the metadata's ``cu_seqlens_k``):
  **asserted bitwise equal** (TOL-001) — a failure means the claim in the docs is wrong;
* the same call twice: asserted bitwise equal (determinism);
* ``num_splits`` 0 (the heuristic, SGLang's default) vs 1 (SGLang's deterministic mode) vs 4:
  each asserted within T1 of the fp32 oracle (TOL-002); whether 1 and 0 are bitwise equal is
  **recorded, not asserted** (docs/kernel-facts.md#split-kv-and-graph-replay says they may differ).

Each comparison prints one line (``-s``) and, with ``REFSPEC_RECORD=path.jsonl``, appends a JSON
record there.  What to look for on the H200: every ``cu_seqlens_k_new`` line ``bitwise=True``;
the ``num_splits`` lines say how often 1 and 0 differ (the kernel-facts page quotes them).
Run: ``python -m pytest -m gpu tests/test_gpu_cu_seqlens_k.py -s``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from refspec.harness.modes import MODES, mode_scenarios
from refspec.core.tolerance import assert_t1, t0

pytestmark = pytest.mark.gpu

PAGE_SIZES = [1, 4, 16, 64]
LABELS = [m for m in MODES if m != "IDLE"]


def record(kind: str, label: str, P: int, **fields):
    line = {"check": kind, "mode": label, "P": P, **fields}
    print(" ".join(f"{k}={v}" for k, v in line.items()))
    path = os.environ.get("REFSPEC_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def setup(label: str, P: int):
    """The scenario after refspec's own forward (KV stored), the real kernel and its arguments."""
    fai = pytest.importorskip("flash_attn_interface", reason="needs FA3 (flash_attn_interface)")
    sc = mode_scenarios(P, dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, head_dim=64, device="cuda",
                        seed=P)[label]
    built = sc.build()
    be = built.fa3_backend(provider="fa3")
    md = be.init_forward_metadata(built.fb)
    out_refspec = be.forward(built.q, built.k, built.v, built.layer, built.fb)  # stores k/v, then attends
    k_cache, v_cache = built.pool.get_kv_buffer(0)
    args = {"cache_seqlens": md.cache_seqlens_int32, "page_table": md.page_table, "cu_seqlens_q": md.cu_seqlens_q,
            "max_seqlen_q": md.max_seq_len_q, "softmax_scale": built.layer.softmax_scale, "causal": True}

    def call(**extra):
        out = fai.flash_attn_with_kvcache(built.q, k_cache, v_cache, **args, **extra)
        torch.cuda.synchronize()
        return out[0] if isinstance(out, tuple) else out

    return built, md, out_refspec, call


@pytest.mark.spec("MD-006", "TOL-001")
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
@pytest.mark.parametrize("label", LABELS)
def test_cu_seqlens_k_new_as_sglang_passes_it_changes_nothing(label, P):
    _, md, out_refspec, call = setup(label, P)
    plain = call()
    sglang = call(cu_seqlens_k_new=md.cu_seqlens_k, num_splits=0)
    v = t0(sglang, plain)
    record("cu_seqlens_k_new", label, P, bitwise=v.ok, max_abs_diff=v.err)
    assert v.ok, f"{label} P={P}: passing cu_seqlens_k_new changed the output by {v.err}"
    assert t0(plain, out_refspec).ok, f"{label} P={P}: refspec's backend call differs from the direct call"


@pytest.mark.spec("TOL-001")
@pytest.mark.parametrize("label", ["DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"])
def test_deterministic(label):
    *_, call = setup(label, 16)
    a, b = call(), call()
    record("deterministic", label, 16, bitwise=t0(a, b).ok)
    assert t0(a, b).ok


@pytest.mark.spec("TOL-002")
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
@pytest.mark.parametrize("label", LABELS)
def test_num_splits_choices_are_within_t1(label, P):
    built, md, _, call = setup(label, P)
    ref, low = built.run_oracle(), built.run_oracle(upcast=False)
    outs = {n: call(cu_seqlens_k_new=md.cu_seqlens_k, num_splits=n) for n in (0, 1, 4)}
    for n, out in outs.items():
        assert bool(torch.isfinite(out).all()), f"{label} P={P} num_splits={n}: NaN/inf"
        assert_t1(out, ref, low, f"{label} P={P} num_splits={n}")
    v1, v4 = t0(outs[1], outs[0]), t0(outs[4], outs[0])
    record("num_splits", label, P, one_vs_auto_bitwise=v1.ok, one_vs_auto_max_abs_diff=v1.err,
           four_vs_auto_bitwise=v4.ok, four_vs_auto_max_abs_diff=v4.err)
