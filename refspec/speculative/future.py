"""The future map: what the next round reads from this one, kept on the device, indexed by row.

SGLang's overlap scheduler never brings a round's outputs to the host before it launches the
next round: the next round's inputs live in device buffers indexed by the request's
``req_pool_idx`` (its ``req_to_token`` row), written at the end of a round and gathered at the
start of the next (``FutureMap`` in ``python/sglang/srt/managers/overlap_utils.py``, indexed by
``req_pool_indices`` since sgl-project/sglang#25862; seq_lens routed through it since #25879).
refspec keeps one per engine, for every version (v1, v2, overlap): rounds scatter into it and
gather from it with one indexing op per field, never a per-request Python loop.

=================  =========================  ==============================================
buffer             shape, dtype               row r after a round at committed length L
=================  =========================  ==============================================
``seq_lens``       ``[R]`` int64 (tokens)     L + a: the next round's committed length
``root``           ``[R]`` int64              t_(L+a), the bonus token (next round's t_L)
``d1``             ``[R]`` int64              the kept draft-extend row's argmax (next d_1)
``hidden``         ``[R, E]`` model dtype     that row's draft hidden (EAGLE drafts), or None
=================  =========================  ==============================================

R = ``req_to_token.shape[0]``; row 0 is the dummy row (never a request's, PA-008).  A prefill
writes the row's first entry (L = prompt length, root = the first generated token).

The three int64 buffers are the columns of one ``[R, 3]`` tensor, so a round writes them with
one scatter and reads them with one gather (two and one launches instead of six).
"""

from __future__ import annotations

import torch


class FutureMap:
    """Device buffers of the next round's inputs, one row per ``req_to_token`` row (module doc).

    Args: ``num_rows`` R; ``device``.  The hidden buffer ``[R, E]`` is allocated at the first
    :meth:`stash` that carries one (E and the dtype from it), as SGLang allocates it lazily.
    """

    def __init__(self, num_rows: int, device: torch.device):
        self.num_rows = num_rows
        self.ints = torch.zeros((num_rows, 3), dtype=torch.long, device=device)  #: columns seq_lens, root, d1
        self.seq_lens, self.root, self.d1 = self.ints.unbind(1)  # [R] views (strided)
        self.hidden: torch.Tensor | None = None

    def stash(self, rows: torch.Tensor, *, seq_lens: torch.Tensor, root: torch.Tensor, d1: torch.Tensor,
              hidden: torch.Tensor | None = None) -> None:
        """Write rows ``rows [B]`` (int64, device): ``seq_lens, root, d1 [B]``, ``hidden [B, E]``."""
        self.ints[rows] = torch.stack([seq_lens.long(), root, d1], dim=1)
        if hidden is not None:
            if self.hidden is None:
                self.hidden = torch.zeros((self.num_rows, hidden.shape[-1]), dtype=hidden.dtype,
                                          device=hidden.device)
            self.hidden[rows] = hidden

    def gather(self, rows: torch.Tensor):
        """``(seq_lens, root, d1, hidden)`` of ``rows [B]``: ``[B]`` int64 x 3, ``[B, E]`` or None."""
        hidden = None if self.hidden is None else self.hidden[rows]
        seq_lens, root, d1 = self.ints[rows].unbind(1)
        return seq_lens, root, d1, hidden
