"""Greedy acceptance for top-k = 1 (SD-001), vectorised on the device, and the scripted hook.

For a request with drafts ``d_1..d_Sd`` and target predictions ``p_0..p_Sd`` (argmax of the N
verify rows ``[t_L, d_1..d_Sd]``):

* ``num_correct_drafts`` n = the longest prefix with ``d_i == p_(i-1)`` (0..Sd), the chain case
  of SGLang's ``VerifyTreeGreedy`` CUDA kernel
  (https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/kernels/jit/include/sgl_kernel/speculative/eagle.cuh#L215,
  called through ``verify_tree_greedy_func``,
  https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/kernels/ops/speculative/spec_tree.py#L480);
* ``num_accept_tokens`` a = n + 1 (the bonus ``p_n`` included; MD-009 for the history of the
  names);
* the committed tokens of the round are ``t_(L+1)..t_(L+a) = d_1..d_n, p_n``, which equal
  ``p_0..p_n`` under the greedy rule.

Written without host syncs (cumprod of the match mask), so the v2 round reads nothing back.

**Scripted acceptance** (the record/replay hook): a :class:`ScriptedAccept` forces a request's
a for its k-th verify round.  The round then commits ``d_1..d_(a-1), p_(a-1)``: the tokens whose
target KV the verify forward actually computed, so the committed sequence stays self-consistent
(teacher forcing) and the oracle loop and the production loop still agree token for token.  With
a forced a above the greedy one the output is no longer the target's greedy text; combined with
:class:`~refspec.speculative.drafters.PerfectDrafter` (greedy n = Sd) any forced a keeps it lossless.
"""

from __future__ import annotations

import torch

from refspec.core.constants import const_arange


def num_correct_drafts(drafts: torch.Tensor, predict: torch.Tensor) -> torch.Tensor:
    """n per request (SD-001).

    Shapes: ``drafts [B, Sd]`` int64, ``predict [B, N]`` int64 (N = Sd + 1) -> ``[B]`` int64.
    """
    match = (drafts == predict[:, :-1]).long()
    return torch.cumprod(match, dim=1).sum(dim=1)


def committed_candidates(drafts: torch.Tensor, predict: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``c[b, i] = d_(i+1) if i < n_b else p_i``: ``[B, N]`` int64.

    ``c[b, :a_b]`` are the round's committed tokens (the last is the bonus), and ``c`` is the
    input of the v2 draft extend (all N rows; equal to ``predict`` under the greedy rule).
    """
    B, N = predict.shape
    i = const_arange(N, predict.device)
    d_shift = torch.cat([drafts, predict[:, -1:]], dim=1)  # column N-1 is never < n
    return torch.where(i[None, :] < n[:, None], d_shift, predict)


class ScriptedAccept:
    """Forced ``num_accept_tokens``: ``table[rid][k]`` is a for the request's k-th verify round.

    Rounds beyond a request's list use the greedy rule.  The hook returns the table's value as
    is; both loops clamp it to ``1..N`` where they apply it.
    """

    def __init__(self, table: dict[int, list[int]]):
        self.table = table

    @classmethod
    def from_trace(cls, trace) -> "ScriptedAccept":
        """Replay a recorded schedule: ``trace`` is a list of
        :class:`~refspec.speculative.metrics.RoundTrace` (``rids`` / ``num_accept_tokens`` per round)."""
        table: dict[int, list[int]] = {}
        for t in trace:
            for rid, a in zip(t.rids, t.num_accept_tokens):
                table.setdefault(rid, []).append(a)
        return cls(table)

    def __call__(self, rid: int, k: int) -> int | None:
        seq = self.table.get(rid, [])
        return seq[k] if k < len(seq) else None
