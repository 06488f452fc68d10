"""The real FA3 kernel on the top-k > 1 draft expand call with upstream's *stale* ``cu_seqlens_k`` (GPU).

``python -m refspec conformance`` documents one kernel-listed difference (``tree-draft-expand-cu-k``,
``refspec/conformance/known.py``): for P > 1, SGLang's draft-decode expand metadata keeps
``cu_seqlens_k = arange(0, B*k*(s+1) + 1, s + 1)`` -- built before ``cache_seqlens += L mod P``
(eager, ``flashattention_backend.py:979@v0.5.23``) and a static graph buffer never rewritten at
replay (``:2522``) -- and passes it as ``cu_seqlens_k_new`` (``:2328``); refspec's is the cumsum of
the K it passes.  FA3 reads ``cu_seqlens_k_new`` only together with a new ``k`` / ``v``
(``hopper/flash_api.cpp:929`` at ``fa4-v4.0.0.beta27``), so the call must not change.  This test makes the
expand call as SGLang does, with the stale prefix sum (and with zeros, what the never-written
prefix buffer of the draft-decode replay holds), and asserts the output and LSE bitwise equal to
the call without ``cu_seqlens_k_new`` (TOL-001), for P in {1, 4, 16, 64}, k in {2, 4, 8}, every
draft step.  Run: ``python -m pytest -m gpu tests/test_gpu_tree_cu_seqlens_k.py -s``.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.tolerance import t0
from refspec.fa3 import tree_metadata as tm
from refspec.harness.tree_scenario import H, draft_setup, layer

pytestmark = pytest.mark.gpu

S = 4  #: speculative_num_steps (draft steps 0..2)
LENS = [5, 67, 130]
HD = 64


@pytest.mark.spec("TR-014", "TOL-001")
@pytest.mark.parametrize("k", (2, 4, 8))
@pytest.mark.parametrize("P", (1, 4, 16, 64), ids=lambda P: f"P{P}")
def test_stale_cu_seqlens_k_new_on_the_draft_expand_call_changes_nothing(P, k):
    fai = pytest.importorskip("flash_attn_interface", reason="needs FA3 (flash_attn_interface)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _, pool, fb, _, loc = draft_setup(P, LENS, k, S, seed=P + k, device="cuda", dtype=torch.bfloat16, head_dim=HD)
    k_cache, v_cache = pool.get_kv_buffer(0)
    lay = layer(HD)
    rows = len(LENS) * k
    q = torch.randn((rows, H, HD), generator=torch.Generator().manual_seed(k)).to("cuda", torch.bfloat16)
    for s in range(S - 1):
        md = tm.draft_expand_metadata(loc, fb.seq_lens, s, k, S, P)
        args = dict(cache_seqlens=md.cache_seqlens_int32, page_table=md.page_table, cu_seqlens_q=md.cu_seqlens_q,
                    max_seqlen_q=md.max_seq_len_q, softmax_scale=lay.softmax_scale, causal=False,
                    return_softmax_lse=True)
        plain = fai.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
        stale = torch.arange(0, rows * (s + 1) + 1, s + 1, dtype=torch.int32, device="cuda")
        for name, cu in (("stale arange", stale), ("zeros", torch.zeros_like(stale)), ("refspec", md.cu_seqlens_k)):
            out = fai.flash_attn_with_kvcache(q, k_cache, v_cache, cu_seqlens_k_new=cu, **args)
            torch.cuda.synchronize()
            vo, vl = t0(out[0], plain[0]), t0(out[1], plain[1])
            print(f"P={P} k={k} s={s} cu_seqlens_k_new={name}: out bitwise={vo.ok} lse bitwise={vl.ok}")
            assert vo.ok and vl.ok, f"P={P} k={k} s={s}: cu_seqlens_k_new={name} changed the expand call"
