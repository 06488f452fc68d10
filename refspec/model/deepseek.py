"""A small DeepSeek-V2/V3-style decoder: multi-head latent attention (MLA), dense MLP, random init.

Architecture (HF ``DeepseekV3ForCausalLM`` with every layer dense): token embedding ->
``num_hidden_layers`` x [RMSNorm -> MLA self-attention -> residual, RMSNorm -> SwiGLU MLP ->
residual] -> final RMSNorm -> LM head.  **No mixture of experts**: DeepSeek-V3's layers from
``first_k_dense_replace`` (3) on are MoE; every layer here is one of its dense first layers
(``mlp.{gate,up,down}_proj``).  MoE changes the MLP, never the attention, the KV cache or the
speculative loop, which is what refspec is about.

Parameter names are HF's / SGLang's (``model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight``, ``q_proj`` instead of
the first three when ``q_lora_rank`` is None; ``model.embed_tokens``, ``model.norm``,
``lm_head``), so a DeepSeek state dict's attention and dense-MLP tensors load by name.  SGLang
fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj_with_mqa`` at load; the
HF names stay separate here.

**One MLA layer** (SGLang ``DeepseekV2AttentionMLA``, docs/mla.md for the math)::

    q = q_b_proj(q_a_layernorm(q_a_proj(x)))   [T, H, Dn + Dr]  -> q_nope [T, H, Dn], q_pe [T, H, Dr]
    c, k_pe = kv_a_proj_with_mqa(x)             [T, R + Dr]      -> the latent c [T, R], k_pe [T, Dr]
    c = kv_a_layernorm(c)                        the row the pool caches is [c | RoPE(k_pe)] (ML-001)
    RoPE on q_pe and k_pe only, interleaved pairs (SGLang: is_neox_style = not rope_interleave)
    w_kc [H, Dn, R], w_vc [H, R, Dv] = kv_b_proj.weight split per head (refspec.core.mla.split_kv_b_proj)

and then one of three forms, chosen **per batch** (:func:`attention_method`), side by side as in
DeepSeek-V3's own ``MLA`` module (``attn_impl = "naive" | "absorb"``,
`inference/model.py <https://github.com/deepseek-ai/DeepSeek-V3/blob/1ea5a1a7ed7429e25ba2fa2c76fe74fa5968d348/inference/model.py>`_):

* **absorbed** (:meth:`DeepseekAttention.forward_absorbed`, every paged batch but the prefix-free
  prefill, ML-009): ``o = attn_mqa(W_UK^T q_nope, c, c, q_rope=q_pe, k_rope=k_pe)`` over the
  latent rows (the FA3 ``qv`` call, ML-005), then ``W_UV``;
* **MHA_ONE_SHOT** (:meth:`DeepseekAttention.forward_mha`, a plain EXTEND with no prefix): the
  model writes ``[c | k_pe]`` into the MLA pool itself, expands every key of every request to
  per-head ``k = [W_UK c | k_pe]``, ``v = W_UV c`` and runs ``attn_mha`` on them, the backend
  storing nothing (ML-010);
* **naive** (:meth:`DeepseekAttention.forward_naive`, the dense oracle's batches, which carry no
  forward mode): DeepSeek-V3's ``attn_impl = "naive"``: the per-head ``k``, ``v`` of this
  forward's tokens go to ``attn_mha`` and the dense cache keeps them per head.

The three give the same result to rounding (the absorption identity, ML-008), so the oracle loops
(naive) and the production loop (MHA_ONE_SHOT, then absorbed) emit the same greedy tokens.
The scale is ML-007's (``mla_softmax_scale``: ``(Dn + Dr)^-0.5``, times YaRN's ``mscale^2``).

:meth:`DeepseekModel.forward` returns the logits and the hidden state **after** the final norm:
SGLang's ``DeepseekV2Model`` applies ``self.norm`` before the logits processor, which stores that
hidden for the MTP draft (:mod:`refspec.model.deepseek_nextn`).  Graph-safe: no host syncs in a
forward (the form is chosen from the batch's host lengths, ``seq_lens_cpu`` / ``extend_seq_lens_cpu``).

Upstream: `deepseek_v2.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_v2.py#L2040>`_
(``DeepseekV2AttentionMLA.__init__``), `forward_mla.py@v0.5.23
<https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py#L586>`_,
`forward_mha.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py#L253>`_.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from refspec.core.args import count
from refspec.core.batch import ForwardBatch
from refspec.core.mla import (
    DEEPSEEK_V3_ROPE_SCALING,
    AttnForwardMethod,
    MLADims,
    absorb_q,
    check_rope_scaling,
    expand_latent,
    finite_number,
    latent_to_v,
    mla_attention_layers,
    mla_forward_method,
    mla_softmax_scale,
    split_kv_b_proj,
    yarn_get_mscale,
)
from refspec.model.llama import LlamaMLP, RMSNorm


@dataclass
class DeepseekConfig:
    """HF ``DeepseekV3Config`` fields refspec uses (sizes in elements).

    ``q_lora_rank`` None: one ``q_proj`` (DeepSeek-V2-Lite); else ``q_a_proj`` -> ``q_a_layernorm``
    -> ``q_b_proj``.  ``rope_scaling``: None or HF's dict (DeepSeek-V3: YaRN, :data:`DEEPSEEK_V3_ROPE_SCALING`).
    ``rope_interleave`` True: RoPE rotates adjacent pairs (DeepSeek's layout, SGLang
    ``is_neox_style=False``).  ``num_nextn_predict_layers``: the MTP layers the checkpoint ships
    (1 for DeepSeek-V3; :mod:`refspec.model.deepseek_nextn`).  Raises ValueError naming the field for
    a size that is not an int >= 1 (``q_lora_rank``: or None), an odd ``qk_rope_head_dim``, a
    ``rope_theta`` that is not a finite number > 1, a non-bool ``rope_interleave`` and a
    ``rope_scaling`` that :func:`rope_inv_freq` cannot run (:func:`check_yarn`): at construction,
    not at the first forward.
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 256
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    vocab_size: int = 128
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 512
    num_nextn_predict_layers: int = 1

    def __post_init__(self):
        _ = self.mla_dims  # validates the four MLA dims
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "max_position_embeddings"):
            count(f"DeepseekConfig.{name}", getattr(self, name), 1)
        if self.q_lora_rank is not None:
            count("DeepseekConfig.q_lora_rank (or None)", self.q_lora_rank, 1)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekConfig.qk_rope_head_dim must be even (RoPE rotates pairs), got "
                             f"{self.qk_rope_head_dim}")
        if finite_number("DeepseekConfig.rope_theta", self.rope_theta) <= 1:
            raise ValueError(f"DeepseekConfig.rope_theta must be > 1 (RoPE's base), got {self.rope_theta!r}")
        if not isinstance(self.rope_interleave, bool):
            raise ValueError(f"DeepseekConfig.rope_interleave must be a bool, got {self.rope_interleave!r}")
        check_yarn(self.rope_scaling)

    @property
    def mla_dims(self) -> MLADims:
        """The model's MLA dims: what its KV pool row holds (SGLang: ``attention_arch == MLA``)."""
        return MLADims(self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim)

    @classmethod
    def from_dict(cls, d: dict) -> "DeepseekConfig":
        """Build from a HF-style config dict; unknown keys (MoE, quantization, ...) are ignored.
        Raises ValueError for a ``d`` that is not a dict, and as the constructor."""
        if not isinstance(d, dict):
            raise ValueError(f"DeepseekConfig.from_dict takes a dict (HF config.json), got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def tiny_deepseek_config(**kw) -> DeepseekConfig:
    """The test model: 2 layers, hidden 64, 4 heads, ``q_lora_rank`` 32, vocab 128, and the MLA dims of
    the harness (R = 256, Dr = 16, Dn = 16, Dv = 16: inside FA3's kernels, ML-006: the ``qv`` call is
    (16, 256), the prefill (32, 16))."""
    return DeepseekConfig(**kw)


def deepseek_v3_dims_config(**kw) -> DeepseekConfig:
    """DeepSeek-V3's attention dims on a small body: R = 512, Dr = 64, Dn = 128, Dv = 128 (the 576-wide
    row; the 64 / 512 ``qv`` kernel and the 192 / 128 prefill kernel the real FA3 build would run),
    ``q_lora_rank`` 1536, YaRN (factor 40: scale 0.1352, ML-007) and its 163840 positions; hidden 256,
    4 heads, 2 layers, vocab 128."""
    base = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, q_lora_rank=1536, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_scaling=dict(DEEPSEEK_V3_ROPE_SCALING),
                max_position_embeddings=163840)
    base.update(kw)
    return DeepseekConfig(**base)


# ---------------------------------------------------------------- RoPE (DeepSeek's: interleaved, YaRN)
#: the ``rope_scaling`` entries :func:`rope_inv_freq` reads that must be finite numbers > 0
YARN_POSITIVE = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def check_yarn(rope_scaling) -> None:
    """``rope_scaling`` is one :func:`rope_inv_freq` runs: None, or a dict of ``type`` /
    ``rope_type`` "yarn" or "deepseek_yarn" whose :data:`YARN_POSITIVE` entries are finite numbers
    > 0 and whose ``mscale``, ``mscale_all_dim``, ``attn_factor``, ``extrapolation_factor`` are
    finite numbers (each optional; :func:`~refspec.core.mla.check_rope_scaling` too).  SGLang's
    DeepSeek model sets ``rope_type = "deepseek_yarn"`` on any ``rope_scaling`` it is given; refspec
    asks for the YaRN type to be stated.  Raises ValueError naming the entry."""
    check_rope_scaling(rope_scaling)
    if rope_scaling is None:
        return
    kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"rope_scaling type {kind!r}: refspec's DeepSeek model has YaRN ('yarn', 'deepseek_yarn') "
                         "or none")
    for key in (*YARN_POSITIVE, "mscale", "attn_factor", "extrapolation_factor"):
        if key in rope_scaling and finite_number(f"rope_scaling[{key!r}]", rope_scaling[key]) <= 0 \
                and key in YARN_POSITIVE:
            raise ValueError(f"rope_scaling[{key!r}] must be > 0, got {rope_scaling[key]!r}")


def rope_inv_freq(dim: int, theta: float, rope_scaling: dict | None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2] fp32, mscale)`` of DeepSeek's RoPE over ``dim`` = Dr.

    No scaling: ``theta^(-2i / dim)``, mscale 1.  YaRN (``type`` / ``rope_type`` "yarn" or
    "deepseek_yarn", SGLang's ``DeepseekScalingRotaryEmbedding``): with ``factor`` f and the
    ``original_max_position_embeddings`` window, frequencies of pairs below the correction range
    (``beta_fast`` rotations) keep ``theta^(-2i / dim)``, those above it (``beta_slow``) are divided
    by f, a linear ramp in between; cos / sin are multiplied by
    ``yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim) * attn_factor`` (1 for
    DeepSeek-V3, whose ``mscale = mscale_all_dim``; the softmax scale carries the rest, ML-007).
    Raises ValueError for another scaling type or a malformed entry (:func:`check_yarn`).

    Upstream: `rope_variant.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/rotary_embedding/rope_variant.py#L380>`_
    (``_compute_inv_freq``), `yarn.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/rotary_embedding/yarn.py#L15>`_.
    """
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not rope_scaling:
        return 1.0 / base, 1.0
    check_yarn(rope_scaling)
    f = float(rope_scaling.get("factor", 1.0))
    window = rope_scaling.get("original_max_position_embeddings", 4096)

    def correction_dim(rotations):  # the pair index whose wavelength fits `rotations` times into the window
        return dim * math.log(window / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(rope_scaling.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(rope_scaling.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = (1 - ramp) * rope_scaling.get("extrapolation_factor", 1)  # 1: the original frequency
    inv_freq = (1.0 / (f * base)) * (1 - keep) + (1.0 / base) * keep
    mscale = (yarn_get_mscale(f, float(rope_scaling.get("mscale", 1)))
              / yarn_get_mscale(f, float(rope_scaling.get("mscale_all_dim", 0))) * rope_scaling.get("attn_factor", 1))
    return inv_freq, mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """Rotate ``x [T, heads, Dr]`` by ``cos, sin [T, Dr / 2]`` (fp32 in, cast to ``x.dtype``).

    ``interleave`` (DeepSeek): pair ``(x[2i], x[2i+1])`` rotates by angle i, DeepSeek-V3's
    ``view_as_complex`` over adjacent pairs, SGLang's ``_rotate_gptj``; False: pair
    ``(x[i], x[i + Dr/2])`` (rotate-half, the Llama layout)."""
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# ---------------------------------------------------------------- the attention form per batch
def attention_method(fb) -> AttnForwardMethod | None:
    """Which form this batch runs in (module doc): for a paged :class:`~refspec.core.batch.ForwardBatch`,
    SGLang's per-batch choice on the FA3 backend (ML-009, :func:`~refspec.core.mla.mla_forward_method`:
    MHA_ONE_SHOT for a plain EXTEND with no prefix, the absorbed MLA otherwise); None for the dense
    oracle's batches (no forward mode: DeepSeek's naive form)."""
    return mla_forward_method(fb) if isinstance(fb, ForwardBatch) else None


class DeepseekAttention(nn.Module):
    """One MLA layer (module doc), HF / SGLang parameter names; its two attention layers are SGLang's
    ``attn_mqa`` (absorbed: one KV head, head_dim R + Dr, v_head_dim R) and ``attn_mha`` (H KV
    heads, head_dim Dn + Dr, v_head_dim Dv), both with the ML-007 scale.

    Shapes: ``x [T, E]`` -> ``[T, E]``; ``cos, sin [T, Dr / 2]`` at ``fb.positions``."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int):
        super().__init__()
        E, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.mla_dims
        self.num_heads, self.dims, self.interleave = H, d, cfg.rope_interleave
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(E, H * d.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(E, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * d.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(E, d.kv_cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(d.kv_lora_rank, H * (d.qk_nope_head_dim + d.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * d.v_head_dim, E, bias=False)
        self.attn_mqa, self.attn_mha = mla_attention_layers(layer_id, H, d, mla_softmax_scale(d, cfg.rope_scaling))

    def project(self, x, cos, sin):
        """``x [T, E]`` -> ``q_nope [T, H, Dn]``, ``q_pe [T, H, Dr]``, the latent ``c [T, R]``
        (normalised), ``k_pe [T, 1, Dr]``; RoPE on ``q_pe`` and ``k_pe`` only."""
        T, d = x.shape[0], self.dims
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, self.num_heads, d.qk_head_dim).split([d.qk_nope_head_dim, d.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        return (q_nope, apply_rope(q_pe, cos, sin, self.interleave), self.kv_a_layernorm(c),
                apply_rope(k_pe[:, None], cos, sin, self.interleave))

    def weights(self):
        """``(w_kc [H, Dn, R], w_vc [H, R, Dv])``: views of ``kv_b_proj.weight`` (SGLang splits it at load)."""
        return split_kv_b_proj(self.kv_b_proj.weight, self.num_heads, self.dims.qk_nope_head_dim)

    def forward(self, x, cos, sin, fb, backend):
        method = attention_method(fb)
        parts = self.project(x, cos, sin)
        if method is AttnForwardMethod.MLA:
            o = self.forward_absorbed(*parts, fb, backend)
        elif method is None:
            o = self.forward_naive(*parts, fb, backend)
        else:
            o = self.forward_mha(*parts, fb, backend, method)
        return self.o_proj(o.flatten(1))

    def forward_absorbed(self, q_nope, q_pe, c, k_pe, fb, backend):
        """The absorbed form: store ``[c | k_pe]`` and attend over the latent rows with
        ``q = W_UK^T q_nope`` (R wide) and ``q_rope = q_pe`` (ML-005), then ``W_UV``: ``[T, H, Dv]``.
        SGLang ``forward_absorb_prepare`` / ``forward_absorb_core`` (``bmm(q_nope, w_kc)``, ``attn_mqa``,
        ``bmm(o, w_vc)``)."""
        w_kc, w_vc = self.weights()
        o = backend.forward(absorb_q(q_nope, w_kc), c[:, None], c[:, None], self.attn_mqa, fb, q_rope=q_pe, k_rope=k_pe)
        return latent_to_v(o, w_vc)

    def forward_mha(self, q_nope, q_pe, c, k_pe, fb, backend, method=AttnForwardMethod.MHA_ONE_SHOT):
        """MHA_ONE_SHOT (ML-010): write the latent rows into the pool (the backend stores nothing),
        expand every key of every request (its cached prefix gathered back by slot, request-major)
        to per-head ``k``, ``v`` and run ``attn_mha`` on the ragged keys: ``[T, H, Dv]``.
        SGLang ``forward_normal_prepare`` (``_set_mla_kv_buffer``, ``kv_b_proj``).
        Raises ValueError for MHA_CHUNKED_KV (over 128K keys: not modelled)."""
        if method is not AttnForwardMethod.MHA_ONE_SHOT:
            raise ValueError(f"attention method {method.name}: refspec runs MLA prefills as MHA_ONE_SHOT or absorbed "
                             "(MHA_CHUNKED_KV, over 128K keys, is not modelled)")
        layer_id = self.attn_mha.layer_id
        backend.pool.set_mla_kv_buffer(layer_id, fb.out_cache_loc, c[:, None], k_pe)
        prefix = [int(s) - e for s, e in zip(fb.seq_lens_cpu.tolist(), fb.extend_seq_lens_cpu)]
        if any(prefix):  # the cached prefix too (SGLang: prefix >= 8192, the latents read back from the pool)
            slots = torch.cat([backend.kv.req_to_token[fb.req_pool_indices[b], :int(n)]
                               for b, n in enumerate(fb.seq_lens_cpu.tolist())])
            rows_c, rows_pe = backend.pool.get_mla_kv_buffer(layer_id, slots)
            c, k_pe = rows_c.to(c.dtype), rows_pe.to(k_pe.dtype)
        k, v = expand_latent(c.flatten(1), k_pe.flatten(1), *self.weights())
        return backend.forward(torch.cat([q_nope, q_pe], -1), k, v, self.attn_mha,
                               fb.replace(attn_attend_prefix_cache=False))

    def forward_naive(self, q_nope, q_pe, c, k_pe, fb, backend):
        """DeepSeek-V3's naive form on the dense oracle: this forward's tokens expanded to per-head
        ``k = [W_UK c | k_pe]``, ``v = W_UV c`` for the dense cache, ordinary attention: ``[T, H, Dv]``."""
        k, v = expand_latent(c, k_pe[:, 0], *self.weights())
        return backend.forward(torch.cat([q_nope, q_pe], -1), k, v, self.attn_mha, fb)


class DeepseekDecoderLayer(nn.Module):
    """``input_layernorm`` -> MLA -> residual, ``post_attention_layernorm`` -> dense SwiGLU MLP -> residual
    (DeepSeek's dense layers; ``mlp.{gate,up,down}_proj``)."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int):
        super().__init__()
        self.self_attn = DeepseekAttention(cfg, layer_id)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, fb, backend):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, fb, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekBody(nn.Module):
    """HF ``DeepseekV3Model``: ``embed_tokens``, ``layers``, ``norm`` (the ``model.`` prefix)."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekModel(nn.Module):
    """DeepSeek-style causal LM (HF ``DeepseekV3ForCausalLM`` names, dense MLP) with a pluggable
    attention backend; an MLA model (``config.mla_dims``): the engine gives it an
    :class:`~refspec.core.kv_cache.MLAKVPool`.

    Args:
        config: a :class:`DeepseekConfig`.
    """

    def __init__(self, config: DeepseekConfig):
        super().__init__()
        self.config = config
        self.model = DeepseekBody(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, E]``: ``lm_head.weight``, or the embedding when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def rope(self, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[T, Dr / 2]`` (fp32) of ``positions [T]`` (:func:`rope_inv_freq`; no cache)."""
        c = self.config
        inv_freq, mscale = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        ang = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
        return ang.cos() * mscale, ang.sin() * mscale

    def forward(self, input_ids, fb, backend, aux=None):
        """One forward over the batch ``fb``: ``input_ids [T]`` int64 (request-major) ->
        ``logits [T, V]`` and ``hidden [T, E]``, the final norm's output (what the MTP draft reads).

        ``aux``: the target's intermediate hidden states an EAGLE-3 draft reads (the Llama model's
        ``aux``); a DeepSeek target's draft is its MTP layer, which reads the final hidden: only None.
        Raises ValueError for another ``aux``."""
        if aux is not None:
            raise ValueError(f"aux={aux!r}: a DeepSeek target returns its final hidden only (its draft is 'mtp')")
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(fb.positions)
        for layer in self.model.layers:
            h = layer(h, cos, sin, fb, backend)
        h = self.model.norm(h)
        return nn.functional.linear(h, self.lm_head_weight), h
