"""Dense per-request KV and its attention backend: the oracle loop's cache (no pages, no graphs).

One request, one contiguous K/V tensor per layer, indexed directly by KV index (= position,
SD-007).  A forward writes its tokens' K/V at ``fb.positions`` and then each query row at KV
index t attends to keys ``0..t`` (causal by position, PA-004).  Nothing else: no
``req_to_token``, no page table, no ``cu_seqlens``, so it shares no bookkeeping with either
paged wing.

Why there are no stale reads: the rows of one forward are consecutive KV indices
``L..L+q-1`` and every index below ``L`` was written earlier, so every key a row can see
(``0..t``) holds the K/V of the token currently at that index.  Rejected drafts' K/V beyond
the committed length stay in the tensor until the next forward overwrites them, before any row
reads them (store-then-attend, PA-009; causal by position, PA-004).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import einsum, repeat

from refspec.core.layer import AttentionLayer


@dataclass
class DenseBatch:
    """What the model reads from a batch in the dense oracle: ``positions [T]`` int64 (KV indices)."""

    positions: torch.Tensor

    @classmethod
    def span(cls, start: int, length: int, device="cpu") -> "DenseBatch":
        """KV indices ``start .. start + length - 1``."""
        return cls(torch.arange(start, start + length, device=device))


class DenseKV:
    """Per-layer K ``[max_len, Hkv, D]`` and V ``[max_len, Hkv, Dv]`` of one request (zeros at start).

    Args: num_layers, max_len (tokens), num_kv_heads, head_dim, dtype, device; v_head_dim Dv
    (default D; an MLA model's naive form caches per-head K of Dn + Dr and V of Dv,
    :mod:`refspec.model.deepseek`).
    """

    def __init__(self, num_layers, max_len, num_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 v_head_dim: int | None = None):
        shape = (max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape[:2] + (v_head_dim or head_dim,), dtype=dtype, device=device)
                  for _ in range(num_layers)]


def target_kv_dims(model) -> tuple[int, int, int, int]:
    """``(layers, Hkv, D, Dv)`` a target's dense cache holds: its config's heads and head dim, or for
    an MLA model (``config.mla_dims``, :mod:`refspec.model.deepseek`) DeepSeek's naive form, H KV
    heads of K ``Dn + Dr`` and V ``Dv`` (the paged wings cache the latent row instead, ML-001)."""
    c = model.config
    d = getattr(c, "mla_dims", None)
    if d is not None:
        return c.num_hidden_layers, c.num_attention_heads, d.qk_head_dim, d.v_head_dim
    return c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.head_dim


def draft_kv_dims(draft) -> tuple[int, int, int, int]:
    """``(layers, Hkv, D, Dv)`` of a draft's dense cache (:mod:`refspec.model.drafts`; Dv defaults to D)."""
    return draft.num_layers, draft.num_kv_heads, draft.head_dim, getattr(draft, "v_head_dim", draft.head_dim)


class DenseBackend:
    """``forward(q, k, v, layer, fb)`` over a :class:`DenseKV` (same signature as the paged backends).

    Shapes: ``q [T, H, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` at KV indices ``fb.positions [T]``;
    returns ``[T, H, Dv]`` in ``q.dtype``, computed in fp32.
    """

    name = "dense"

    def __init__(self, kv: DenseKV):
        self.kv = kv

    def forward(self, q, k, v, layer: AttentionLayer, fb):
        pos = fb.positions
        K, V = self.kv.k[layer.layer_id], self.kv.v[layer.layer_id]
        K[pos] = k.to(K.dtype)  # store ...
        V[pos] = v.to(V.dtype)
        n_keys = int(pos.max()) + 1  # ... then attend: keys 0..max position (all written)
        g = layer.num_heads // layer.num_kv_heads  # GQA: query head h reads KV head h // g
        keys = repeat(K[:n_keys].float(), "p hkv d -> p (hkv g) d", g=g)
        vals = repeat(V[:n_keys].float(), "p hkv d -> p (hkv g) d", g=g)
        s = einsum(q.float(), keys, "t h d, p h d -> h t p") * layer.softmax_scale
        visible = torch.arange(n_keys, device=q.device)[None, :] <= pos[:, None]  # row at t sees 0..t
        s = s.masked_fill(~visible, float("-inf"))
        out = einsum(torch.softmax(s, dim=-1), vals, "h t p, p h d -> t h d")
        return out.to(q.dtype)
