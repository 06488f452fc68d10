"""One request's result of a round: the row the engine commits (:meth:`Engine.commit`).

    symbolic   [a, c_0 .. c_(N-1), d_1 .. d_Sd, draft_len]           (v2 appends L)
    example    N = 3, Sd = 2, a = 2:  [2, 17, 5, 23, 17, 9, 66]      (+ [64] in v2)
               (L = 64; d_1 = 17 accepted, d_2 = 9 rejected by p_1 = 5; c = [d_1, p_1, p_2])

``a`` (1..N) tokens are committed: the accepted drafts and the bonus; ``c`` are the committed
candidates (:func:`~refspec.speculative.accept.committed_candidates`), ``c[:a]`` the emitted
tokens; ``d`` the round's drafts; ``draft_len`` the draft KV length the draft extend committed
(the kept row's KV index + 1); ``L`` the committed length the device started the round from
(v2, the overlap loop checks it against the host's, SD-008).  v1 builds its rows on the host
(it reads a inside the round); v2 packs them on the device (:func:`pack`) and the engine reads
all of them with ONE device-to-host copy after the round, then :func:`unpack` s each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoundRow:
    a: int  #: tokens committed this round (accepted drafts + the bonus)
    committed: list[int]  #: c_0 .. c_(N-1); c[:a] are emitted
    drafts: list[int]  #: d_1 .. d_Sd
    draft_len: int  #: the draft KV length after the draft extend (tokens)
    seq_len: int | None = None  #: v2: the device's L at the round's start


def pack(a: torch.Tensor, committed: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor,
         seq_len: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of a batch on the device: ``a [B]``, ``committed [B, N]``, ``drafts [B, Sd]``,
    ``draft_len [B]`` (and ``seq_len [B]``) -> int64 ``[B, 2 + N + Sd (+ 1)]``, one tensor (one copy)."""
    cols = [a[:, None], committed, drafts, draft_len[:, None]] + ([] if seq_len is None else [seq_len[:, None]])
    return torch.cat(cols, dim=1)


def unpack(row: list[int], N: int, Sd: int) -> RoundRow:
    """One host row (a list of ints, module doc) as a :class:`RoundRow`."""
    return RoundRow(row[0], row[1:1 + N], row[1 + N:1 + N + Sd], row[1 + N + Sd],
                    row[2 + N + Sd] if len(row) > 2 + N + Sd else None)
