"""A small Llama-style decoder whose attention is a pluggable backend (oracle, dense or FA3).

Architecture (HuggingFace ``LlamaForCausalLM``, no bias, no rope scaling): token embedding ->
``num_hidden_layers`` x [RMSNorm -> GQA self-attention with rotate-half RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> final RMSNorm -> LM head (tied to the embedding or not).

Parameter names are exactly HuggingFace Llama's (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj
.weight``, ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight``,
``lm_head.weight`` unless tied), so a HF-named state dict (e.g. SmolLM2 from ``refspec.real``)
loads with ``load_state_dict(strict=True)``.

Attention never touches a KV cache itself: every layer computes ``q [T, H, D]``,
``k, v [T, Hkv, D]`` (RoPE applied at ``fb.positions``) and calls
``backend.forward(q, k, v, AttentionLayer, fb)``, which stores k/v and attends (store-then-attend,
docs/fa3-contract.md): an :class:`~refspec.core.backend.AttentionBackend` (either paged wing) or the
dense oracle's :class:`~refspec.oracle.dense.DenseBackend`.  ``fb`` is a
:class:`~refspec.core.batch.ForwardBatch` (paged wings) or any object with ``positions`` (the dense
oracle).  Positions are KV indices in every forward (SD-007; see :mod:`refspec.speculative.engine`).
Graph-safe: no host syncs in ``forward``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from refspec.core.layer import AttentionLayer


@dataclass
class LlamaConfig:
    """HF ``LlamaConfig`` fields refspec uses (sizes in elements, ``rope_theta`` unitless)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  #: default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 128
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads (GQA)")

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """Build from a HF-style config dict; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 and cast back (HF ``LlamaRMSNorm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (HF's RoPE layout, not the interleaved one)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[T, D]`` for integer ``positions [T]`` (tokens): angle ``p * theta^(-2i/D)``.

    Computed in fp32 (as HF) and cast to ``dtype``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by per-token ``cos, sin [T, D]``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        H, Hkv, D, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(E, H * D, bias=False)
        self.k_proj = nn.Linear(E, Hkv * D, bias=False)
        self.v_proj = nn.Linear(E, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, E, bias=False)
        self.layer = AttentionLayer(layer_id, H, Hkv, D)

    def forward(self, x, cos, sin, fb, backend):
        """``x [T, E]`` -> ``[T, E]``; the backend stores k/v at ``fb.out_cache_loc`` and attends."""
        T, L = x.shape[0], self.layer
        q = apply_rope(self.q_proj(x).view(T, L.num_heads, L.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, L.num_kv_heads, L.head_dim), cos, sin)
        v = self.v_proj(x).view(T, L.num_kv_heads, L.head_dim)
        o = backend.forward(q, k, v, L, fb)
        return self.o_proj(o.reshape(T, L.num_heads * L.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, fb, backend):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, fb, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    """HF ``LlamaModel``: ``embed_tokens``, ``layers``, ``norm`` (the ``model.`` prefix)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """Llama causal LM (HF ``LlamaForCausalLM`` names) with a pluggable attention backend.

    The readable twin of :class:`refspec.model.fused.FusedLlama` (the GPU speed path built from it;
    same logits on CPU, ``tests/test_fused_greedy.py``).

    Args:
        config: a :class:`LlamaConfig`.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, E]``: ``lm_head.weight``, or the embedding when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[T, E]`` pre-norm hidden -> ``[T, V]`` logits."""
        return nn.functional.linear(self.model.norm(hidden), self.lm_head_weight)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype)

    def run_layers(self, h, fb, backend, layers) -> torch.Tensor:
        """Run decoder ``layers`` on ``h [T, E]`` at RoPE positions ``fb.positions``."""
        cos, sin = self.rope(fb.positions, h.dtype)
        for layer in layers:
            h = layer(h, cos, sin, fb, backend)
        return h

    def forward(self, input_ids, fb, backend, num_layers: int | None = None, aux: tuple[int, ...] | None = None):
        """One forward over the batch ``fb``.

        Shapes: ``input_ids [T]`` int64 (request-major, as ``fb.out_cache_loc``);
        returns ``logits [T, V]`` and ``hidden [T, E]`` (the last run layer's output *before*
        the final norm: what an EAGLE draft consumes), or with ``aux`` ``[T, len(aux) * E]``.
        Args: ``num_layers`` k runs only the first k layers, then the final norm and head (an
        early-exit self-draft; its KV pool then has k layers).  ``aux``: strictly increasing
        hidden-state indices i in ``0..k`` whose states are returned concatenated instead
        (:func:`capture_states`; an EAGLE-3 draft's input, :class:`~refspec.model.drafts.Eagle3Draft`).
        """
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        h = self.model.embed_tokens(input_ids)
        if aux is None:
            h = self.run_layers(h, fb, backend, layers)
            return self.logits(h), h
        check_aux(aux, len(layers))
        cos, sin = self.rope(fb.positions, h.dtype)
        states = []
        for i, layer in enumerate(layers):
            if i in aux:
                states.append(h)
            h = layer(h, cos, sin, fb, backend)
        return self.logits(h), capture_states(states, h, aux, len(layers))


def check_aux(aux, num_layers: int) -> tuple[int, ...]:
    """``aux`` as a tuple; ValueError unless it is a non-empty, strictly increasing sequence of
    hidden-state indices in ``0..num_layers`` (the order the states are concatenated in)."""
    if isinstance(aux, (str, bytes)) or not hasattr(aux, "__iter__"):
        raise ValueError(f"aux hidden states must be a sequence of ints (e.g. (2, 15, 27)), got "
                         f"{type(aux).__name__} {aux!r}")
    aux = tuple(aux)
    if not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux) \
            or any(b <= a for a, b in zip(aux, aux[1:])) or aux[0] < 0 or aux[-1] > num_layers:
        raise ValueError(f"aux hidden states {aux!r}: need strictly increasing indices in 0..{num_layers} "
                         f"(i = the input of decoder layer i; {num_layers} = the last layer's output)")
    return aux


def capture_states(states: list[torch.Tensor], last: torch.Tensor, aux: tuple[int, ...],
                   num_layers: int) -> torch.Tensor:
    """The aux hidden states concatenated on the last dim, ``[T, len(aux) * E]``.

    Hidden-state index i is the residual stream entering decoder layer i (0 = the embeddings),
    HuggingFace's ``hidden_states[i]``; ``num_layers`` is the last layer's output (pre-norm).
    ``states``: the inputs of the layers whose index is in ``aux``, in order; ``last``: the last
    layer's output.  Upstream captures ``hidden_states + residual`` before layer i for every i in
    ``layers_to_capture``, default ``[2, L // 2, L - 3]``
    (``LlamaModel.forward``,
    `models/llama.py@v0.5.12.post1 L394 <https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/models/llama.py#L394>`_;
    ``set_eagle3_layers_to_capture``, `L798 <https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/models/llama.py#L798>`_).
    """
    if aux[-1] == num_layers:
        states = [*states, last]
    return torch.cat(states, dim=-1)


def init_random_(model: nn.Module, seed: int = 0, gain: float = 2.0) -> nn.Module:
    """Random init with a stable greedy argmax (in place; returns ``model``).

    HF's ``std = 0.02`` makes a random model's logits nearly uniform, so greedy tokens hinge on
    ~1e-4 margins that fp32 rounding can flip.  Here: embeddings ~ N(0, 1), every ``nn.Linear``
    ~ N(0, gain^2 / fan_in), norms 1.  Logits then have std of order sqrt(hidden) and top-2
    margins of order 1 (the smallest of a few hundred steps ~1e-3), far above fp32 noise
    (~1e-5 here), so fp32 token streams can be compared bit for bit (TOL-001).  ``gain = 2``
    lets attention and MLP outweigh the embedding; with ``gain = 1`` a random model soon
    repeats one token forever, which makes speculation trivially easy.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2 and "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (gain / math.sqrt(p.shape[1])))
    return model


def tiny_config(**kw) -> LlamaConfig:
    """The test model: 2 layers, hidden 64, 4 heads / 2 KV heads (GQA 2), head dim 16, vocab 128."""
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=False,
                max_position_embeddings=512)
    base.update(kw)
    return LlamaConfig(**base)
