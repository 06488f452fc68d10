"""The DeepSeek-style MLA model (refspec.model.deepseek): HF names, the forward against an
independent float64 MLA, its three forms equal (ML-008), the form chosen per batch (ML-009), the
interleaved RoPE and YaRN, and DeepSeek-V3's attention dims on the emulator (ML-006)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from mla_kit import PROMPTS, accepting_mtp, target
from refspec.core import batch as B
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, MLAKVPool
from refspec.core.mla import DEEPSEEK_V3_ROPE_SCALING, AttnForwardMethod
from refspec.core.modes import ForwardMode as M
from refspec.core.tolerance import assert_t1
from refspec.fa3.backend import FlashAttentionBackend
from refspec.model.deepseek import (
    DeepseekAttention,
    DeepseekConfig,
    DeepseekModel,
    apply_rope,
    deepseek_v3_dims_config,
    rope_inv_freq,
    tiny_deepseek_config,
)
from refspec.model.llama import init_random_
from refspec.oracle.backend import OracleBackend
from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV, target_kv_dims
from refspec.speculative import generate

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

ATTN = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def _model(**kw) -> DeepseekModel:
    return init_random_(DeepseekModel(tiny_deepseek_config(**kw)), seed=0).eval()


def _dense(model, max_len=64) -> DenseBackend:
    layers, heads, d, dv = target_kv_dims(model)
    return DenseBackend(DenseKV(layers, max_len, heads, d, v_head_dim=dv))


def _naive_logits(sd: dict, cfg: DeepseekConfig, ids: list[int]) -> torch.Tensor:
    """Float64 MLA written from DeepSeek's definition (non-absorbed, full causal attention), RoPE as
    DeepSeek-V3's complex multiplication over adjacent pairs; no rope scaling."""
    sd = {k: v.double() for k, v in sd.items()}
    H, R, Dr, Dn, Dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                        cfg.v_head_dim)
    T = len(ids)

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rope(x):  # x [T, h, Dr]: pair (x[2i], x[2i+1]) is the complex number x[2i] + j x[2i+1]
        ang = torch.arange(T, dtype=torch.float64)[:, None] * cfg.rope_theta ** (
            -torch.arange(0, Dr, 2, dtype=torch.float64) / Dr)
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None, :]).flatten(-2)

    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        if cfg.q_lora_rank is None:
            q = h @ sd[p + "self_attn.q_proj.weight"].T
        else:
            q = rms(h @ sd[p + "self_attn.q_a_proj.weight"].T, sd[p + "self_attn.q_a_layernorm.weight"]) \
                @ sd[p + "self_attn.q_b_proj.weight"].T
        q = q.view(T, H, Dn + Dr)
        kv_a = h @ sd[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        c = rms(kv_a[:, :R], sd[p + "self_attn.kv_a_layernorm.weight"])
        k_pe = rope(kv_a[:, None, R:])  # [T, 1, Dr], one per token
        kv = (c @ sd[p + "self_attn.kv_b_proj.weight"].T).view(T, H, Dn + Dv)
        k = torch.cat([kv[..., :Dn], k_pe.expand(T, H, Dr)], -1)
        q = torch.cat([q[..., :Dn], rope(q[..., Dn:])], -1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(Dn + Dr)
        o = torch.einsum("hts,shv->thv", torch.softmax(s.masked_fill(causal, float("-inf")), -1), kv[..., Dn:])
        x = x + o.reshape(T, H * Dv) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


# ---------------------------------------------------------------- names and config
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_parameter_names_are_hf_deepseek_v3(q_lora_rank):
    """The names of DeepSeek-V3's checkpoint (its dense layers: ``mlp.{gate,up,down}_proj``);
    ``q_proj`` instead of ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` without a q LoRA."""
    m = _model(q_lora_rank=q_lora_rank)
    q = ATTN[:3] if q_lora_rank else ("q_proj",)
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(2) for n in (
            *[f"self_attn.{a}" for a in q + ATTN[3:]], "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "input_layernorm", "post_attention_layernorm")}
    sd = m.state_dict()
    assert set(sd) == expected
    # nn.Linear [out, in]; H = 4, R = 256, Dr = Dn = Dv = 16, hidden 64
    assert sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (256 + 16, 64)
    assert sd["model.layers.0.self_attn.kv_a_layernorm.weight"].shape == (256,)
    assert sd["model.layers.0.self_attn.kv_b_proj.weight"].shape == (4 * (16 + 16), 256)
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 16)
    first = "q_b_proj" if q_lora_rank else "q_proj"
    assert sd[f"model.layers.1.self_attn.{first}.weight"].shape == (4 * (16 + 16), q_lora_rank or 64)


def test_config_from_a_deepseek_v3_config_dict():
    """HF's ``config.json`` keys load; the MoE / quantization keys are ignored (no MoE here)."""
    hf = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256,
              first_k_dense_replace=3, num_nextn_predict_layers=1, rope_scaling=DEEPSEEK_V3_ROPE_SCALING,
              vocab_size=129280, max_position_embeddings=163840, quantization_config={"quant_method": "fp8"})
    cfg = DeepseekConfig.from_dict(hf)
    assert (cfg.mla_dims.kv_cache_dim, cfg.mla_dims.qk_head_dim, cfg.num_nextn_predict_layers) == (576, 192, 1)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        tiny_deepseek_config(qk_rope_head_dim=15)
    with pytest.raises(ValueError, match="num_attention_heads"):
        tiny_deepseek_config(num_attention_heads=0)
    with pytest.raises(ValueError, match="q_lora_rank"):
        tiny_deepseek_config(q_lora_rank=0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        tiny_deepseek_config(kv_lora_rank=2.5)


# ---------------------------------------------------------------- the forward
@pytest.mark.spec("ML-008")
@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=None), dict(rope_theta=500.0)],
                         ids=["q_lora", "q_proj", "theta500"])
def test_forward_matches_naive_float64_mla(kw):
    """The dense oracle's naive form and the paged wings' MHA_ONE_SHOT prefill (oracle and FA3) against
    an independent float64 non-absorbed MLA."""
    m = _model(**kw)
    rng = random.Random(1)
    ids = [rng.randrange(128) for _ in range(13)]
    assert len(set(ids)) > 10  # distinct tokens: with one token repeated, every value row is the same
    ref = _naive_logits(m.state_dict(), m.config, ids)
    with torch.no_grad():
        outs = [m(torch.tensor(ids), DenseBatch.span(0, 13), _dense(m))]
        for make in (lambda pool, kv: OracleBackend(pool, kv), lambda pool, kv: FlashAttentionBackend(pool, kv)):
            kv, pool = _cache(m, 4)
            row = kv.alloc_req()
            kv.alloc_extend([row], [0], [13])
            fb = B.extend_batch(kv, [row], [0], [13])
            be = make(pool, kv)
            be.init_forward_metadata(fb)
            outs.append(m(torch.tensor(ids), fb, be))
    for out, hidden in outs:
        assert hidden.shape == (13, 64)
        err = float((out.double() - ref).abs().max())
        assert err < 1e-4 * float(ref.abs().max()), err
    with pytest.raises(ValueError, match="aux"):
        m(torch.tensor(ids), DenseBatch.span(0, 13), _dense(m), aux=(1, 2))


def _cache(model, P, num_pages=24, seed=3):
    d = model.config.mla_dims
    kv = KVCache(4, 48, num_pages, P, seed=seed)
    return kv, MLAKVPool(model.config.num_hidden_layers, num_pages, P, d.kv_lora_rank, d.qk_rope_head_dim,
                         fill=float("nan"))


WINGS = {"oracle": lambda pool, kv: OracleBackend(pool, kv),
         "fa3": lambda pool, kv: FlashAttentionBackend(pool, kv, provider="emulator")}


@pytest.mark.spec("ML-008", "ML-010")
@pytest.mark.parametrize("wing", list(WINGS))
def test_absorbed_and_mha_forms_of_one_layer_are_equal(wing):
    """One layer, one EXTEND batch with cached prefixes, both forms on the same inputs: the absorbed
    call over the latent rows and the MHA_ONE_SHOT pass (the prefix's latents gathered back from the
    pool and expanded) give the same output, and store the same rows."""
    m = target()
    attn: DeepseekAttention = m.model.layers[0].self_attn
    d, E = m.config.mla_dims, m.config.hidden_size
    outs, rows = [], []
    for form in ("absorbed", "mha"):  # the same pages, prefix rows and inputs for both forms
        kv, pool = _cache(m, 4)
        reqs = [kv.alloc_req() for _ in range(2)]
        kv.alloc_extend(reqs, [0, 0], [5 + 4, 9 + 3])
        prefix = torch.cat([kv.req_to_token[r, :n].long() for r, n in zip(reqs, (5, 9))])
        g = torch.Generator().manual_seed(5)
        pool.get_key_buffer(0)[prefix] = torch.randn(len(prefix), 1, d.kv_cache_dim, generator=g)
        fb = B.extend_batch(kv, reqs, [5, 9], [4, 3])
        be = WINGS[wing](pool, kv)
        be.init_forward_metadata(fb)
        x = torch.randn(7, E, generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            parts = attn.project(x, *m.rope(fb.positions))
            run = attn.forward_absorbed if form == "absorbed" else attn.forward_mha
            outs.append(run(*parts, fb, be))
        rows.append(pool.get_key_buffer(0)[fb.out_cache_loc])
    assert outs[0].shape == (7, 4, d.v_head_dim)
    assert_t1(outs[1], outs[0], what=f"MHA_ONE_SHOT vs absorbed ({wing})")
    assert torch.equal(rows[0], rows[1]), "the two forms stored different latent rows"
    with pytest.raises(ValueError, match="MHA_CHUNKED_KV"):
        attn.forward_mha(*parts, fb, be, AttnForwardMethod.MHA_CHUNKED_KV)


@pytest.mark.spec("ML-008", "ML-009")
def test_prefill_extend_and_decode_forms_give_the_same_logits():
    """The same 12 tokens as one prefill (MHA_ONE_SHOT), as prefill 5 + extend 7 (absorbed: a prefix),
    and as prefill 5 + seven decodes (absorbed), through the FA3 wing: the same logits (T1), which
    are also the dense oracle's (naive form)."""
    m = target()
    ids = torch.tensor(PROMPTS[4][:12])
    with torch.no_grad():
        dense, _ = m(ids, DenseBatch.span(0, 12), _dense(m))
        runs = []
        for cuts in ([12], [5, 7], [5] + [1] * 7):
            kv, pool = _cache(m, 4)
            row = kv.alloc_req()
            be, done, logits = FlashAttentionBackend(pool, kv, provider="emulator"), 0, []
            for n in cuts:
                kv.alloc_extend([row], [done], [done + n])
                fb = B.extend_batch(kv, [row], [done], [n]) if n > 1 else B.decode_batch(kv, [row], [done + 1])
                be.init_forward_metadata(fb)
                logits.append(m(ids[done:done + n], fb, be)[0])
                done += n
            runs.append(torch.cat(logits))
    for out in runs:
        assert_t1(out, dense, what="paged forms vs the dense naive form")


class Recorder:
    """A backend proxy recording, per call, the forward mode and which form the model ran (module tests)."""

    def __init__(self, be):
        self.be, self.calls = be, []

    def __getattr__(self, name):  # pool, kv, init_forward_metadata
        return getattr(self.be, name)

    def forward(self, q, k, v, layer, fb, q_rope=None, k_rope=None):
        form = "absorbed" if q_rope is not None else ("mha" if fb.attn_attend_prefix_cache is False else "?")
        self.calls.append((fb.forward_mode, form, layer.head_dim))
        return self.be.forward(q, k, v, layer, fb, q_rope=q_rope, k_rope=k_rope)


@pytest.mark.spec("ML-009")
def test_the_form_is_chosen_per_batch():
    """Prefix-free EXTEND: the MHA pass (head_dim Dn + Dr = 32); every other batch, an EXTEND with a
    prefix and every speculative mode included: the absorbed call (head_dim R + Dr = 272)."""
    m = target()
    kv, pool = _cache(m, 4, num_pages=40)
    reqs = [kv.alloc_req() for _ in range(2)]
    kv.alloc_extend(reqs, [0, 0], [20, 20])
    rec = Recorder(OracleBackend(pool, kv))
    batches = {"prefill": B.extend_batch(kv, reqs, [0, 0], [4, 6]),
               "extend with prefix": B.extend_batch(kv, reqs, [4, 6], [2, 1]),
               "decode": B.decode_batch(kv, reqs, [7, 8]),
               "draft decode": B.draft_decode_batch(kv, reqs, [7, 8], 0),
               "verify": B.verify_batch(kv, reqs, [8, 9], 4),
               "draft extend": B.draft_extend_batch(kv, reqs, [10, 11], [2, 2], num_draft_tokens=4),
               "draft extend v2": B.draft_extend_v2_batch(kv, reqs, [14, 15], 4)}
    forms = {}
    with torch.no_grad():
        for name, fb in batches.items():
            rec.calls.clear()
            rec.init_forward_metadata(fb)
            m(torch.zeros(fb.num_tokens, dtype=torch.long), fb, rec)
            forms[name] = set(rec.calls)
    assert forms.pop("prefill") == {(M.EXTEND, "mha", 32)}
    for name, calls in forms.items():
        assert {(form, hd) for _, form, hd in calls} == {("absorbed", 256 + 16)}, name


@pytest.mark.spec("ML-009", "SD-002")
@pytest.mark.parametrize("version,topk", [("v1", 1), ("v2", 2)])
def test_generate_runs_prefills_mha_and_every_speculative_forward_absorbed(monkeypatch, version, topk):
    """In a whole production run (target and MTP draft): which form ran in which mode."""
    seen = Counter()
    for form in ("forward_absorbed", "forward_mha"):
        orig = getattr(DeepseekAttention, form)

        def spy(self, *args, _orig=orig, _form=form):
            fb = args[4]
            seen[(fb.forward_mode, _form)] += 1
            return _orig(self, *args)
        monkeypatch.setattr(DeepseekAttention, form, spy)
    m = target()
    res = generate(m, PROMPTS[:2], backend="fa3", version=version, page_size=4, draft=accepting_mtp(m),
                   max_new_tokens=6, topk=topk, num_draft_tokens=4 if topk > 1 else None)
    assert res.tokens  # ran
    modes = {(mode, form) for (mode, form) in seen}
    draft_extend = M.DRAFT_EXTEND if version == "v1" else M.DRAFT_EXTEND_V2
    assert modes == {(M.EXTEND, "forward_mha"), (M.DECODE, "forward_absorbed"),
                     (M.TARGET_VERIFY, "forward_absorbed"), (draft_extend, "forward_absorbed")}
    assert seen[(M.EXTEND, "forward_mha")] == 2 + 1, "target prefill (2 layers) + draft prefill (1 layer)"


# ---------------------------------------------------------------- RoPE, YaRN, the scale
def test_rope_rotates_adjacent_pairs():
    """DeepSeek's layout (SGLang ``is_neox_style=False``): pair (x[2i], x[2i+1]) turns by p * theta_i,
    as DeepSeek-V3's ``view_as_complex``; the rotate-half layout pairs (x[i], x[i + Dr/2]) instead."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 5, 17])
    inv, mscale = rope_inv_freq(8, 10000.0, None)
    assert mscale == 1.0 and torch.allclose(inv.double(), 10000.0 ** (-torch.arange(0, 8, 2) / 8).double())
    ang = pos.double()[:, None] * inv.double()[None]
    z = torch.view_as_complex(x.reshape(3, 2, 4, 2).contiguous()) * torch.polar(torch.ones_like(ang), ang)[:, None]
    want = torch.view_as_real(z).flatten(-2)
    got = apply_rope(x, ang.cos(), ang.sin())
    assert torch.allclose(got, want, atol=1e-12)
    half = apply_rope(x, ang.cos(), ang.sin(), interleave=False)
    assert not torch.allclose(half, want, atol=1e-3), "rotate-half must differ: the layout is a real choice"
    e0 = torch.zeros(1, 1, 8, dtype=torch.float64)
    e0[..., 0] = 1
    turned = apply_rope(e0, torch.tensor([[0.0, 1, 1, 1]]).double(), torch.tensor([[1.0, 0, 0, 0]]).double())
    assert turned.flatten().tolist() == [0, 1, 0, 0, 0, 0, 0, 0]  # x[0] turned a quarter into x[1]


@pytest.mark.spec("ML-007")
def test_yarn_frequencies_mscale_and_the_softmax_scale():
    """DeepSeek-V3's YaRN (factor 40 over a 4096 window, beta 32 / 1, Dr = 64, theta 1e4): the
    correction range is pairs 10..23 (floor(64 ln(4096 / (64 pi)) / (2 ln 1e4)) = 10,
    ceil(64 ln(4096 / (2 pi)) / (2 ln 1e4)) = 23): pairs 0..10 keep theta^(-2i/64), pairs from 23 on
    are divided by 40, a ramp between; cos / sin unscaled (mscale = mscale_all_dim); the softmax
    scale 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.1352."""
    inv, mscale = rope_inv_freq(64, 10000.0, DEEPSEEK_V3_ROPE_SCALING)
    base = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert mscale == 1.0
    assert torch.allclose(inv[:11].double(), base[:11], rtol=1e-6)
    assert torch.allclose(inv[23:].double(), base[23:] / 40, rtol=1e-6)
    between = inv[11:23].double()
    assert bool(((between < base[11:23]) & (between > base[11:23] / 40)).all())
    _, m2 = rope_inv_freq(64, 10000.0, {"type": "yarn", "factor": 4, "mscale": 1, "mscale_all_dim": 0})
    assert m2 == pytest.approx(0.1 * math.log(4) + 1)
    with pytest.raises(ValueError, match="YaRN"):
        rope_inv_freq(64, 10000.0, {"type": "linear", "factor": 2})
    v3 = DeepseekAttention(deepseek_v3_dims_config(), 0)
    assert v3.attn_mqa.scaling == v3.attn_mha.scaling == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert v3.attn_mqa.scaling == pytest.approx(0.1352, abs=1e-4)
    assert DeepseekAttention(tiny_deepseek_config(), 0).attn_mqa.scaling == pytest.approx(32 ** -0.5)


@pytest.mark.spec("ML-006", "ML-005")
def test_deepseek_v3_dims_run_on_the_emulator_and_dims_without_a_kernel_are_refused():
    """At DeepSeek-V3's attention dims (a 576-wide row: the qv call 64 / 512, the prefill 192 / 128)
    a prefill and two decodes through the FA3 wing equal the dense naive form; a rope dim of 128
    has no FA3 qv kernel (its prefill, 144 / 128, has one): the absorbed call is refused by ML-006
    instead of computed."""
    m = init_random_(DeepseekModel(deepseek_v3_dims_config(num_hidden_layers=1)), seed=0).eval()
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    with torch.no_grad():
        dense, _ = m(ids, DenseBatch.span(0, 7), _dense(m))
        kv, pool = _cache(m, 16, num_pages=4)
        assert pool.kv_cache_dim == 576
        row = kv.alloc_req()
        be, out = FlashAttentionBackend(pool, kv, provider="emulator"), []
        for done, n in ((0, 5), (5, 1), (6, 1)):
            kv.alloc_extend([row], [done], [done + n])
            fb = B.extend_batch(kv, [row], [0], [5]) if done == 0 else B.decode_batch(kv, [row], [done + 1])
            be.init_forward_metadata(fb)
            out.append(m(ids[done:done + n], fb, be)[0])
    assert_t1(torch.cat(out), dense, what="DeepSeek-V3 dims, FA3 emulator vs dense")
    wide = _model(qk_rope_head_dim=128, v_head_dim=128)
    kv, pool = _cache(wide, 4)
    row = kv.alloc_req()
    kv.alloc_extend([row], [0], [3])
    be = FlashAttentionBackend(pool, kv, provider="emulator")
    fb = B.extend_batch(kv, [row], [0], [3])
    be.init_forward_metadata(fb)
    with torch.no_grad():
        wide(torch.tensor([1, 2, 3]), fb, be)  # the prefill's MHA pass: (144, 128) has an FA3 kernel
        kv.alloc_extend([row], [3], [4])
        fb = B.decode_batch(kv, [row], [4])
        be.init_forward_metadata(fb)
        with pytest.raises(InvariantError, match=r"\[ML-006\]"):
            wide(torch.tensor([4]), fb, be)
