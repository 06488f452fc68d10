"""The Llama-style model (refspec.model.llama): HF names, the forward against an independent naive
implementation, incremental vs full prefill, and the paged backends against the dense one."""

from __future__ import annotations

import math
import random

import pytest
import torch

from refspec.core.batch import extend_batch
from refspec.fa3.backend import FlashAttentionBackend
from refspec.core.kv_cache import KVCache, KVPool
from refspec.model.llama import LlamaConfig, LlamaModel, apply_rope, init_random_, rope_cos_sin, tiny_config
from refspec.oracle.backend import OracleBackend
from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV
from refspec.oracle.loop import greedy

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)


def _model(**kw):
    return init_random_(LlamaModel(tiny_config(**kw)), seed=0)


def _dense(model, max_len=64):
    c = model.config
    return DenseBackend(DenseKV(c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim))


def _naive_logits(sd: dict, cfg: LlamaConfig, ids: list[int], num_layers: int | None = None) -> torch.Tensor:
    """Float64 Llama written from the HF definition: full causal attention, complex-number RoPE."""
    sd = {k: v.double() for k, v in sd.items()}
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = len(ids)

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rope(x):  # pairs (i, i + D/2) rotate as the complex number x_i + j x_(i+D/2)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * cfg.rope_theta ** (
            -torch.arange(0, D, 2, dtype=torch.float64) / D)
        z = torch.complex(x[..., : D // 2], x[..., D // 2:]) * torch.polar(torch.ones_like(ang), ang)[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg.num_hidden_layers if num_layers is None else num_layers):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = rope((h @ sd[p + "self_attn.q_proj.weight"].T).view(T, H, D))
        k = rope((h @ sd[p + "self_attn.k_proj.weight"].T).view(T, Hkv, D))
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(T, Hkv, D)
        heads = []
        for hh in range(H):
            g = hh // (H // Hkv)
            s = q[:, hh] @ k[:, g].T / math.sqrt(D)
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            heads.append(torch.softmax(s, -1) @ v[:, g])
        x = x + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return rms(x, sd["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_are_huggingface_llama(tied):
    m = _model(tie_word_embeddings=tied)
    names = set(m.state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(2) for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    if not tied:
        expected.add("lm_head.weight")
    assert names == expected
    sd = m.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)  # [H*D, E] (nn.Linear [out, in])
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)


def test_state_dict_loads_strict_and_config_from_dict():
    cfg = LlamaConfig.from_dict(dict(tiny_config().__dict__, model_type="llama", torch_dtype="bfloat16"))
    assert cfg == tiny_config()
    assert LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3).head_dim == 64
    src, dst = _model(), LlamaModel(tiny_config())
    dst.load_state_dict(src.state_dict(), strict=True)
    ids = torch.tensor([3, 1, 4, 1, 5])
    a, _ = src(ids, DenseBatch.span(0, 5), _dense(src))
    b, _ = dst(ids, DenseBatch.span(0, 5), _dense(dst))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw", [dict(), dict(tie_word_embeddings=True), dict(num_key_value_heads=1),
                                dict(num_key_value_heads=4), dict(rope_theta=100000.0)],
                         ids=["gqa2", "tied", "mqa", "mha", "theta1e5"])
def test_forward_matches_naive_float64_llama(kw):
    m = _model(**kw)
    rng = random.Random(1)
    ids = [rng.randrange(128) for _ in range(13)]  # 13 different-looking tokens, not one token 13 times
    assert len(set(ids)) > 1
    ref = _naive_logits(m.state_dict(), m.config, ids)
    with torch.no_grad():
        out, hidden = m(torch.tensor(ids), DenseBatch.span(0, 13), _dense(m))
    assert hidden.shape == (13, 64)
    err = float((out.double() - ref).abs().max())
    assert err < 1e-4 * float(ref.abs().max()), err


def test_early_exit_runs_the_first_k_layers():
    m = _model()
    ids = [5, 9, 2, 7, 7, 1]
    ref = _naive_logits(m.state_dict(), m.config, ids, num_layers=1)
    c = m.config
    with torch.no_grad():
        be = DenseBackend(DenseKV(1, 16, c.num_key_value_heads, c.head_dim))  # a 1-layer pool
        out, _ = m(torch.tensor(ids), DenseBatch.span(0, 6), be, num_layers=1)
    assert float((out.double() - ref).abs().max()) < 1e-4 * float(ref.abs().max())


def test_rope_scores_depend_only_on_position_difference():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)

    def score(i, j):
        ci, si = rope_cos_sin(torch.tensor([i]), 16, 10000.0, torch.float32)
        cj, sj = rope_cos_sin(torch.tensor([j]), 16, 10000.0, torch.float32)
        return float((apply_rope(q, ci, si) * apply_rope(k, cj, sj)).sum())

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-4)
    assert score(0, 9) == pytest.approx(score(31, 40), rel=1e-4)


def test_incremental_decode_equals_full_prefill():
    m = _model()
    ids = torch.tensor([random.Random(2).randrange(128) for _ in range(11)])
    with torch.no_grad():
        full, _ = m(ids, DenseBatch.span(0, 11), _dense(m))
        be = _dense(m)
        part, _ = m(ids[:4], DenseBatch.span(0, 4), be)
        rows = [part]
        for t in range(4, 11):
            rows.append(m(ids[t:t + 1], DenseBatch.span(t, 1), be)[0])
    assert torch.allclose(torch.cat(rows), full, atol=1e-5, rtol=1e-5)


@pytest.mark.spec("SD-007")
@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_backends_match_dense_per_request(page_size):
    """A 2-request EXTEND through the paged oracle and the FA3 path equals each request alone
    in the dense backend (positions = KV indices in every wing)."""
    m = _model()
    c = m.config
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
    kv = KVCache(4, 32, 40, page_size, device="cpu", seed=3)
    rows = [kv.alloc_req() for _ in prompts]
    lens = [len(p) for p in prompts]
    kv.alloc_extend(rows, [0, 0], lens)
    fb = extend_batch(kv, rows, [0, 0], lens)
    ids = torch.tensor([t for p in prompts for t in p])
    dense = torch.cat([m(torch.tensor(p), DenseBatch.span(0, len(p)), _dense(m))[0] for p in prompts])
    for make in (lambda pool: OracleBackend(pool, kv), lambda pool: FlashAttentionBackend(pool, kv)):
        pool = KVPool(c.num_hidden_layers, 40, page_size, c.num_key_value_heads, c.head_dim)
        be = make(pool)
        be.init_forward_metadata(fb)
        with torch.no_grad():
            out, _ = m(ids, fb, be)
        assert torch.allclose(out, dense, atol=1e-5, rtol=1e-5)


def test_random_init_gives_stable_greedy_margins():
    """init_random_'s promise: greedy top-2 margins far above fp32 noise, and varied text."""
    m = _model()
    margins, distinct = [], []
    for k in range(4):
        rng = random.Random(k)
        g = greedy(m, [rng.randrange(128) for _ in range(3 + 4 * k)], 30)
        margins += g.margins
        distinct.append(len(set(g.tokens)))
    assert min(margins) > 1e-4
    assert min(distinct) >= 10
