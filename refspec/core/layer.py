"""``AttentionLayer``: the per-layer constants an attention backend needs (SGLang ``RadixAttention``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer's constants.

    Attributes:
        layer_id: index into the KV pool's per-layer buffers.
        num_heads, num_kv_heads, head_dim: H, Hkv, D (H % Hkv == 0).
        scaling: softmax scale (default D ** -0.5).
        logit_cap: softcap c (scores become c * tanh(s / c)); 0 disables.
        sliding_window_size: left window w in tokens (a key p is visible to a query at
            position t iff t - w <= p <= t); -1 disables.  Passed to FA3 as ``(w, 0)``.
        v_head_dim: Dv, the value (and output) head dim; None means D (MHA / GQA).  MLA's
            layers differ (:mod:`refspec.core.mla`): the absorbed one has D = kv_lora_rank +
            qk_rope_head_dim (576) and Dv = kv_lora_rank (512), one KV head; the prefill one
            D = qk_nope + qk_rope (192), Dv = v_head_dim (128).  SGLang's ``RadixAttention``
            takes the same ``v_head_dim`` (default: ``head_dim``).
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float | None = None
    logit_cap: float = 0.0
    sliding_window_size: int = -1
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scaling is None else self.scaling
