"""Attention over an explicit key-slot list per query row: the oracle for tree attention.

``attention_by_slot`` (refspec.oracle.attention) derives each row's keys from a causal rule.
A top-k tree breaks that rule: a verify row sees the committed prefix, its *ancestors* and
itself, and a draft-decode branch row sees the prefix and the slots its own row wrote.  Here the
caller names the keys outright, so the oracle states the rule as data and nothing else:

* row ``t`` attends exactly the keys at ``slots_per_row[t]`` (order does not matter, a slot
  listed twice counts twice, as a duplicated key would in any kernel);
* a row with no key outputs exactly 0 (PA-005) and has LSE ``-inf``;
* query head ``h`` reads KV head ``h // (H / Hkv)`` (PA-006);
* ``s = scale * q.k``, softmax over the row's keys, weighted V; fp32 by default.

The log-sum-exp ``lse[h, t] = log sum_j exp(s_j)`` (natural log, scaled scores) is what FA3
returns with ``return_softmax_lse=True`` and what ``merge_state_v2`` combines: for two disjoint
key sets A and B, ``o = (e^lse_A o_A + e^lse_B o_B) / (e^lse_A + e^lse_B)`` equals attention over
A union B.  Upstream: ``FlashAttentionBackend.forward_decode`` / ``forward_extend`` (cascade
prefix + expand, merged by ``merge_state_v2``) in
https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L2340
(v0.5.23; ``forward_extend``'s merge is ``:1865``)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import repeat

from refspec.core.invariants import require


def _as_slots(row, NS: int, t: int, device) -> torch.Tensor:
    s = torch.as_tensor(row, dtype=torch.long, device=device).reshape(-1) if len(row) else \
        torch.zeros(0, dtype=torch.long, device=device)
    require(bool(((s >= 0) & (s < NS)).all()), "PA-011",
            lambda: f"slots_per_row[{t}] = {s.tolist()} must lie in [0, {NS}) (the pool's slots)")
    return s


def attention_over_slots(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                         slots_per_row: Sequence, *, softmax_scale: float | None = None,
                         upcast: bool = True, out_dtype: torch.dtype | None = None,
                         return_lse: bool = False):
    """Row ``t`` of ``q`` attends exactly the keys at ``slots_per_row[t]``.

    Shapes:
        q: ``[T, H, D]``; k_flat ``[NS, Hkv, D]``, v_flat ``[NS, Hkv, Dv]`` (a pool's slot view, NS
        slots; Dv = D but for MLA's latent rows, :mod:`refspec.oracle.mla`).
        slots_per_row: length-T sequence of 1-D int tensors or lists of slot ids (slots).
        returns ``out [T, H, Dv]`` in ``out_dtype`` (default ``q.dtype``), and with
        ``return_lse=True`` also ``lse [H, T]`` fp32, natural log of the summed exp of the
        scaled scores; ``-inf`` for a row with no keys (its output is 0).
    Args:
        softmax_scale: default ``D ** -0.5``.
        upcast: compute in fp32 (the truth); ``False`` computes in ``q.dtype``.
    Raises: InvariantError PA-011 on bad shapes (q not 3-D, k / v of other slots or heads, q / k
        head dims differ, H not a multiple of Hkv, ``len(slots_per_row) != T``) or a slot outside
        ``[0, NS)``.
    """
    require(q.dim() == 3 and k_flat.dim() == 3 and v_flat.dim() == 3
            and tuple(v_flat.shape[:2]) == tuple(k_flat.shape[:2]), "PA-011",
            lambda: f"q {tuple(q.shape)} must be [T, H, D], k_flat {tuple(k_flat.shape)} [NS, Hkv, D] and v_flat "
            f"{tuple(v_flat.shape)} [NS, Hkv, Dv]")
    T, H, D = q.shape
    NS, Hkv = k_flat.shape[0], k_flat.shape[1]
    require(k_flat.shape[2] == D and Hkv > 0 and H % Hkv == 0, "PA-011",
            f"q {tuple(q.shape)} vs k_flat {tuple(k_flat.shape)}: head dims differ or H is not a "
            "multiple of Hkv")
    require(len(slots_per_row) == T, "PA-011",
            f"slots_per_row has {len(slots_per_row)} rows, q has T = {T}")
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    cdt = torch.float32 if upcast else q.dtype
    out = torch.zeros((T, H, v_flat.shape[-1]), dtype=cdt, device=q.device)
    lse = torch.full((H, T), float("-inf"), dtype=torch.float32, device=q.device)
    for t, row in enumerate(slots_per_row):
        slots = _as_slots(row, NS, t, q.device)
        if slots.numel() == 0:
            continue  # PA-005: no key, output 0
        k = repeat(k_flat[slots].to(cdt), "j hkv d -> j (hkv g) d", g=H // Hkv)
        v = repeat(v_flat[slots].to(cdt), "j hkv d -> j (hkv g) d", g=H // Hkv)
        s = torch.einsum("hd,jhd->hj", q[t].to(cdt), k) * scale  # [H, J]
        out[t] = torch.einsum("hj,jhd->hd", torch.softmax(s, dim=-1), v)
        lse[:, t] = torch.logsumexp(s.float(), dim=-1)
    out = out.to(out_dtype or q.dtype)
    return (out, lse) if return_lse else out


def merge_by_lse(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine two partial attentions over disjoint key sets (the rule of ``merge_state_v2``).

    Shapes: o_a, o_b ``[T, H, D]``; lse_a, lse_b ``[H, T]`` (natural log).  Returns
    ``(o [T, H, D] fp32, lse [H, T] fp32)``.  A side with LSE ``-inf`` (no keys) gets weight 0;
    both sides empty gives 0.  Written out in fp32 for the oracle's tests and tutorial.
    """
    la, lb = lse_a.float().T[..., None], lse_b.float().T[..., None]  # [T, H, 1]
    m = torch.maximum(la, lb)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    den = wa + wb
    o = (wa * o_a.float() + wb * o_b.float()) / torch.where(den > 0, den, torch.ones_like(den))
    return o, (m + torch.log(den)).squeeze(-1).T
