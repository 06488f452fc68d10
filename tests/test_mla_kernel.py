"""The MLA kernel contract: the emulator's ``qv`` call and varlen prefill, FA3's head-dim pairs, the refused build.

ML-005: ``flash_attn_with_kvcache(q=q_rope, k_cache=k_rope, v_cache=c_kv, qv=q_nope)`` on the two
strided views of the latent row equals a dense reference written here from the formula of FA3's
``attention_ref`` (``scores = q k^T * scale + qv v^T * scale``), bottom-right causal, at page sizes
1, 4, 16, 64.  ML-010's kernel: the emulated ``flash_attn_varlen_func``, ragged and causal.
ML-006: the (D, Dv) pairs a real build has a kernel for.  ML-013: on a fake FA3 build configuration
without the hdim 64 / 512 kernel (the ``tokenspeed-fa3`` wheel's flags) MLA is refused by rule,
before any kernel runs.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, MLAKVPool
from refspec.core.mla import DEEPSEEK_V3_DIMS
from refspec.core.tolerance import assert_t1, t0
from refspec.fa3 import kernel
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.emulator import emulate_flash_attn_varlen_func, emulate_flash_attn_with_kvcache
from refspec.fa3.tree_backend import FlashAttentionTreeBackend

PAGE_SIZES = (1, 4, 16, 64)


def strided_caches(P: int, R: int = 256, Dr: int = 16, lens=(5, 21, 70), seed: int = 0):
    """A latent pool with each request's keys on scattered pages; its two paged views, the page
    table, and each request's dense keys ``[K_b, R + Dr]`` read by slot (for the reference)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-L // P) for L in lens) + 3
    kv = KVCache(len(lens) + 1, max(lens), num_pages, P, seed=seed)
    pool = MLAKVPool(1, num_pages, P, R, Dr, fill=float("nan"))
    rows = [kv.alloc_req() for _ in lens]
    kv.alloc_extend(rows, [0] * len(lens), list(lens))
    dense = []
    for r, L in zip(rows, lens):
        slots = kv.req_to_token[r, :L].long()
        pool.get_key_buffer(0)[slots] = torch.randn(L, 1, R + Dr, generator=g)
        dense.append(pool.get_key_buffer(0)[slots, 0].clone())
    k_rope, c_kv = pool.paged_views(0, v_head_dim=R)
    M = -(-max(lens) // P)
    table = torch.stack([kv.req_to_token[r, 0:M * P:P] // P for r in rows]).to(torch.int32)
    return pool, k_rope, c_kv, table, dense


def dense_reference(q_rope, qv, dense, q_lens, scale, R):
    """FA3's ``attention_ref`` with ``qv`` (hopper/test_util.py), per request, bottom-right causal."""
    outs, lses, start = [], [], 0
    for keys, n in zip(dense, q_lens):
        c, k_pe = keys[:, :R], keys[:, R:]
        s = (torch.einsum("ihd,jd->hij", q_rope[start:start + n], k_pe)
             + torch.einsum("ihd,jd->hij", qv[start:start + n], c)) * scale
        K = keys.shape[0]
        vis = torch.arange(K)[None, :] <= torch.arange(n)[:, None] + K - n
        s = s.masked_fill(~vis, float("-inf"))
        outs.append(torch.einsum("hij,jd->ihd", torch.softmax(s, -1), c))
        lses.append(torch.logsumexp(s, -1))
        start += n
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.spec("ML-005", "ML-003", "PA-004")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_qv_call_on_the_strided_views_equals_attention_ref(P):
    R, Dr, H = 256, 16, 4
    pool, k_rope, c_kv, table, dense = strided_caches(P, R, Dr, seed=P)
    q_lens = [1, 4, 3]
    T = sum(q_lens)
    g = torch.Generator().manual_seed(1)
    q_rope, qv = torch.randn(T, H, Dr, generator=g), torch.randn(T, H, R, generator=g)
    scale = 0.137
    out, lse = emulate_flash_attn_with_kvcache(
        q_rope, k_rope, c_kv, qv=qv, cache_seqlens=torch.tensor([5, 21, 70], dtype=torch.int32), page_table=table,
        cu_seqlens_q=torch.tensor([0, 1, 5, 8], dtype=torch.int32), max_seqlen_q=4, softmax_scale=scale, causal=True,
        return_softmax_lse=True)
    ref, ref_lse = dense_reference(q_rope, qv, dense, q_lens, scale, R)
    assert out.shape == (T, H, R)
    assert_t1(out, ref, what=f"qv call P={P}")
    assert_t1(lse, ref_lse, what=f"qv LSE P={P}")
    # the views are read through their strides: contiguous copies give the very same result (T0)
    same = emulate_flash_attn_with_kvcache(
        q_rope, k_rope.contiguous(), c_kv.contiguous(), qv=qv,
        cache_seqlens=torch.tensor([5, 21, 70], dtype=torch.int32), page_table=table,
        cu_seqlens_q=torch.tensor([0, 1, 5, 8], dtype=torch.int32), max_seqlen_q=4, softmax_scale=scale, causal=True)
    assert t0(same, out).ok


@pytest.mark.spec("ML-005")
def test_dropping_qv_is_a_different_result():
    """Negative control: the call without ``qv`` (what a build without HasQv computes) is far off."""
    R, Dr, H = 256, 16, 2
    _, k_rope, c_kv, table, dense = strided_caches(4, R, Dr, lens=(9,))
    g = torch.Generator().manual_seed(2)
    q_rope, qv = torch.randn(1, H, Dr, generator=g), torch.randn(1, H, R, generator=g)
    kw = dict(cache_seqlens=torch.tensor([9], dtype=torch.int32), page_table=table,
              cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1, softmax_scale=0.1)
    with_qv = emulate_flash_attn_with_kvcache(q_rope, k_rope, c_kv, qv=qv, **kw)
    without = emulate_flash_attn_with_kvcache(q_rope, k_rope, c_kv, **kw)
    assert float((with_qv - without).abs().max()) > 1e-2


@pytest.mark.spec("ML-005", "ML-007")
def test_default_scale_with_qv_is_d_plus_dv():
    """FA3's default with qv is (D + Dv)^-0.5 (flash_attn_interface.py): 272^-0.5 here, which is
    why an MLA call always passes its own scale."""
    R, Dr = 256, 16
    _, k_rope, c_kv, table, _ = strided_caches(4, R, Dr, lens=(9,))
    g = torch.Generator().manual_seed(3)
    q_rope, qv = torch.randn(1, 2, Dr, generator=g), torch.randn(1, 2, R, generator=g)
    kw = dict(qv=qv, cache_seqlens=torch.tensor([9], dtype=torch.int32), page_table=table,
              cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1)
    default = emulate_flash_attn_with_kvcache(q_rope, k_rope, c_kv, **kw)
    assert t0(default, emulate_flash_attn_with_kvcache(q_rope, k_rope, c_kv, softmax_scale=272 ** -0.5, **kw)).ok
    assert not t0(default, emulate_flash_attn_with_kvcache(q_rope, k_rope, c_kv, softmax_scale=16 ** -0.5, **kw)).ok


@pytest.mark.spec("ML-005")
@pytest.mark.parametrize("bad", ["width", "rows", "dtype", "strided"])
def test_qv_of_the_wrong_shape_is_refused(bad):
    R, Dr = 256, 16
    _, k_rope, c_kv, table, _ = strided_caches(4, R, Dr, lens=(9,))
    qv = {"width": torch.zeros(1, 2, R - 1), "rows": torch.zeros(2, 2, R), "dtype": torch.zeros(1, 2, R).double(),
          "strided": torch.zeros(1, 2, 2 * R)[..., ::2]}[bad]
    with pytest.raises(InvariantError, match=r"\[ML-005\] .*qv"):
        emulate_flash_attn_with_kvcache(torch.zeros(1, 2, Dr), k_rope, c_kv, qv=qv,
                                        cache_seqlens=torch.tensor([9], dtype=torch.int32), page_table=table,
                                        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1)


# ---------------------------------------------------------------- the varlen prefill kernel
@pytest.mark.spec("ML-010", "PA-004")
def test_varlen_is_ragged_bottom_right_causal_attention():
    """Three requests with Q_b = [3, 1, 4] queries and K_b = [3, 5, 4] keys (one with a prefix of 4):
    the emulated varlen call equals per-request softmax attention with the bottom-right mask."""
    g = torch.Generator().manual_seed(4)
    H, D, Dv = 2, 24, 16
    Qs, Ks = [3, 1, 4], [3, 5, 4]
    q, k, v = torch.randn(8, H, D, generator=g), torch.randn(12, H, D, generator=g), torch.randn(12, H, Dv, generator=g)
    cu_q, cu_k = torch.tensor([0, 3, 4, 8], dtype=torch.int32), torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    out, lse = emulate_flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                                              max_seqlen_k=5, softmax_scale=0.2, causal=True, return_softmax_lse=True)
    assert out.shape == (8, H, Dv) and lse.shape == (H, 8)
    qs, ks = 0, 0
    for Q, K in zip(Qs, Ks):
        s = torch.einsum("ihd,jhd->hij", q[qs:qs + Q], k[ks:ks + K]) * 0.2
        s = s.masked_fill(~(torch.arange(K)[None, :] <= torch.arange(Q)[:, None] + K - Q), float("-inf"))
        assert_t1(out[qs:qs + Q], torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v[ks:ks + K]), what="varlen")
        assert_t1(lse[:, qs:qs + Q], torch.logsumexp(s, -1), what="varlen lse")
        qs, ks = qs + Q, ks + K


@pytest.mark.spec("ML-010", "PA-010", "PA-011")
def test_varlen_refuses_bad_offsets():
    q, k, v = torch.zeros(4, 1, 8), torch.zeros(6, 1, 8), torch.zeros(6, 1, 8)
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    kw = dict(max_seqlen_q=2, causal=True)
    with pytest.raises(InvariantError, match=r"\[PA-011\].*cu_seqlens_k"):
        emulate_flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_k=4,
                                       cu_seqlens_k=torch.tensor([0, 4, 7], dtype=torch.int32), **kw)
    with pytest.raises(InvariantError, match=r"\[PA-010\].*max_seqlen_k = 3"):
        emulate_flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_k=3,
                                       cu_seqlens_k=torch.tensor([0, 4, 6], dtype=torch.int32), **kw)
    with pytest.raises(InvariantError, match=r"\[PA-011\].*int32"):
        emulate_flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_q, max_seqlen_k=4, **kw)


# ---------------------------------------------------------------- FA3's head-dim pairs (a real build)
@pytest.mark.spec("ML-006")
def test_fa3_dims_table():
    ok = [(64, 512, True), (64, 256, True), (192, 128, False), (128, 128, False), (64, 512, False), (256, 256, False)]
    bad = [(64, 128, True), (96, 512, True), (64, 576, True), (192, 192 + 1, False), (128, 96, False),
           (16, 32, True), (576, 512, False)]
    assert all(kernel.fa3_dims_problem(*c) is None for c in ok)
    for c in bad:
        assert "FA3 has no kernel for head dims" in kernel.fa3_dims_problem(*c), c


@pytest.mark.spec("ML-006")
@pytest.mark.parametrize("provider", ["emulator", "fa3"])
def test_dims_without_an_fa3_kernel_are_refused(provider):
    """A qv call at (D, Dv) = (16, 32) has no FA3 kernel: the emulator refuses it as the contract,
    a real provider before importing anything (a real kernel would not raise for every such pair)."""
    with pytest.raises(InvariantError, match=r"\[ML-006\].*\(16, 32\) with qv"):
        kernel.flash_attn_with_kvcache(torch.zeros(1, 2, 16), torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 32),
                                       qv=torch.zeros(1, 2, 32), cache_seqlens=torch.ones(1, dtype=torch.int32),
                                       page_table=torch.zeros(1, 1, dtype=torch.int32),
                                       cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1,
                                       provider=provider)
    with pytest.raises(InvariantError, match=r"\[ML-006\].*\(8, 600\)"):  # no qv: V wider than 512
        kernel.flash_attn_with_kvcache(torch.zeros(1, 2, 8), torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 600),
                                       cache_seqlens=torch.ones(1, dtype=torch.int32),
                                       page_table=torch.zeros(1, 1, dtype=torch.int32),
                                       cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1,
                                       provider=provider)


# ---------------------------------------------------------------- the refused build (a fake FA3 configuration)
#: ``flash_attn_config.py`` of the ``tokenspeed-fa3==3.0.0.post20260810`` wheel (top level), verbatim
TOKENSPEED_FLAGS = {
    "FLASHATTENTION_DISABLE_BACKWARD": True, "FLASHATTENTION_DISABLE_SPLIT": False,
    "FLASHATTENTION_DISABLE_PAGEDKV": False, "FLASHATTENTION_DISABLE_APPENDKV": False,
    "FLASHATTENTION_DISABLE_LOCAL": False, "FLASHATTENTION_DISABLE_SOFTCAP": True,
    "FLASHATTENTION_DISABLE_PACKGQA": False, "FLASHATTENTION_DISABLE_FP16": False,
    "FLASHATTENTION_DISABLE_FP8": False, "FLASHATTENTION_DISABLE_VARLEN": False,
    "FLASHATTENTION_DISABLE_CLUSTER": False, "FLASHATTENTION_DISABLE_HDIM64": False,
    "FLASHATTENTION_DISABLE_HDIM96": True, "FLASHATTENTION_DISABLE_HDIM128": False,
    "FLASHATTENTION_DISABLE_HDIM192": False, "FLASHATTENTION_DISABLE_HDIM256": False,
    "FLASHATTENTION_DISABLE_SM8x": True, "FLASHATTENTION_ENABLE_VCOLMAJOR": False,
    "FLASH_ATTENTION_DISABLE_HDIMDIFF64": True, "FLASH_ATTENTION_DISABLE_HDIMDIFF192": True,
}


@pytest.fixture
def fake_build(monkeypatch):
    """Install a fake ``flash_attn_config`` (what FA3's setup.py writes) with the given flags."""
    def install(flags, module="flash_attn_config"):
        kernel.build_flags.cache_clear()
        fake = types.ModuleType(module)
        fake.CONFIG = {"build_flags": dict(flags)}
        monkeypatch.setitem(sys.modules, module, fake)
        if module.startswith("flash_attn_3."):
            monkeypatch.setitem(sys.modules, "flash_attn_3", types.ModuleType("flash_attn_3"))
            monkeypatch.setitem(sys.modules, "flash_attn_config", None)  # not importable at the top level
    yield install
    kernel.build_flags.cache_clear()


def mla_pool_and_cache(P=4):
    return MLAKVPool(1, 4, P, 512, 64), KVCache(2, 8, 4, P)


@pytest.mark.spec("ML-013")
@pytest.mark.parametrize("module", ["flash_attn_config", "flash_attn_3.flash_attn_config"])
def test_tokenspeed_build_is_refused_by_rule(fake_build, module):
    fake_build(TOKENSPEED_FLAGS, module)
    assert "FLASH_ATTENTION_DISABLE_HDIMDIFF64=TRUE" in kernel.mla_kernel_problem("fa3", "qv")
    assert "FLASH_ATTENTION_DISABLE_HDIMDIFF192=TRUE" in kernel.mla_kernel_problem("fa3", "prefill")
    pool, kv = mla_pool_and_cache()
    for make in (lambda: FlashAttentionBackend(pool, kv, provider="fa3"),
                 lambda: FlashAttentionTreeBackend(pool, kv, topk=2, num_draft_tokens=4, provider="fa3")):
        with pytest.raises(InvariantError, match=r"\[ML-013\].*HDIMDIFF64=TRUE.*refuses MLA"):
            make()


@pytest.mark.spec("ML-013")
def test_refused_before_any_kernel_call(fake_build):
    """The kernel entry points refuse too (a caller that bypasses the backend): DeepSeek's dims pass
    ML-006, the build fails ML-013, and no real kernel is imported or called."""
    fake_build(TOKENSPEED_FLAGS)
    d = DEEPSEEK_V3_DIMS
    with pytest.raises(InvariantError, match=r"\[ML-013\].*qv call"):
        kernel.flash_attn_with_kvcache(torch.zeros(1, 2, 64), torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 512),
                                       qv=torch.zeros(1, 2, 512), cache_seqlens=torch.ones(1, dtype=torch.int32),
                                       page_table=torch.zeros(1, 1, dtype=torch.int32),
                                       cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1,
                                       provider="fa3")
    with pytest.raises(InvariantError, match=r"\[ML-013\].*prefill call"):
        two = torch.tensor([0, 2], dtype=torch.int32)
        kernel.flash_attn_varlen_func(torch.zeros(2, 2, d.qk_head_dim), torch.zeros(2, 2, d.qk_head_dim),
                                      torch.zeros(2, 2, d.v_head_dim), cu_seqlens_q=two, cu_seqlens_k=two,
                                      max_seqlen_q=2, max_seqlen_k=2, causal=True, provider="fa3")


@pytest.mark.spec("ML-013")
def test_a_build_with_the_kernels_passes_and_unknown_builds_are_refused(fake_build):
    fake_build({**TOKENSPEED_FLAGS, "FLASH_ATTENTION_DISABLE_HDIMDIFF64": False,
                "FLASH_ATTENTION_DISABLE_HDIMDIFF192": False})
    assert kernel.mla_kernel_problem("fa3", "qv") is None and kernel.mla_kernel_problem("fa3", "prefill") is None
    pool, kv = mla_pool_and_cache()
    assert FlashAttentionBackend(pool, kv, provider="fa3").use_mla  # constructed: the check passed
    fake_build({**TOKENSPEED_FLAGS, "FLASH_ATTENTION_DISABLE_HDIMDIFF64": False,
                "FLASHATTENTION_DISABLE_PAGEDKV": True})  # fa3-fwd's build: 64 / 512, but no paged KV
    assert "FLASHATTENTION_DISABLE_PAGEDKV=TRUE" in kernel.mla_kernel_problem("fa3", "qv")
    assert "exposes no FA3 build configuration" in kernel.mla_kernel_problem("sgl_kernel", "qv")
    assert kernel.mla_kernel_problem("emulator", "qv") is None
    with pytest.raises(ValueError, match="call must be one of"):
        kernel.mla_kernel_problem("fa3", "decode")


@pytest.mark.spec("ML-013")
def test_no_configuration_is_refused(monkeypatch):
    kernel.build_flags.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn_config", None)
    monkeypatch.setitem(sys.modules, "flash_attn_3", None)
    try:
        assert "no readable FA3 build configuration" in kernel.mla_kernel_problem("fa3", "qv")
    finally:
        kernel.build_flags.cache_clear()


@pytest.mark.spec("ML-013")
def test_info_says_whether_the_active_provider_may_run_mla(fake_build, monkeypatch, capsys):
    from refspec.cli import info
    fake_build(TOKENSPEED_FLAGS)
    monkeypatch.setattr(info, "select_provider", lambda device: "fa3")
    assert info.main([]) == 0
    out = capsys.readouterr().out
    assert "MLA on fa3: refused (ML-013): qv: the 'fa3' build sets FLASH_ATTENTION_DISABLE_HDIMDIFF64=TRUE" in out
    assert "prefill: the 'fa3' build sets FLASH_ATTENTION_DISABLE_HDIMDIFF192=TRUE" in out
    monkeypatch.setattr(info, "select_provider", lambda device: "emulator")
    info.main([])
    assert "MLA on emulator: yes" in capsys.readouterr().out
