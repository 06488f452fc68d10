"""The tree loop's future map: the chain's (:mod:`refspec.speculative.future`) plus the root children.

Between two top-k > 1 rounds a request carries, on the device, its committed length, its root
(the bonus token), its draft hidden (EAGLE) -- the chain's :class:`~refspec.speculative.future.FutureMap`
columns -- and the k root children of the next tree: the softmax top-k of the kept draft-extend
row (TR-001).  Those two live here, indexed like the rest by ``req_to_token`` row:

=================  ======================  ==============================================
buffer             shape, dtype            row r after a round
=================  ======================  ==============================================
``topk_p``         ``[R, k]`` fp32          the kept draft row's top-k probabilities
``topk_index``     ``[R, k]`` int64         their token ids (``d1`` = ``topk_index[:, 0]``)
=================  ======================  ==============================================

A round gathers them once at its start and scatters them once at its end: no per-request
Python state, so a round launched before the previous one was read (the overlap schedule)
finds its inputs on the device.  Upstream keeps the same tensors in the draft input it carries
to the next batch (``EagleDraftInput.topk_p`` / ``topk_index``, ``eagle_info.py``; the overlap
worker's ``FutureMap`` stores them, ``managers/overlap_utils.py`` at v0.5.23).
"""

from __future__ import annotations

import torch

from refspec.speculative.future import FutureMap


class TreeFutureMap(FutureMap):
    """:class:`FutureMap` plus ``topk_p`` / ``topk_index`` ``[R, k]`` (module doc).  Args: R, k, device."""

    def __init__(self, num_rows: int, topk: int, device: torch.device):
        super().__init__(num_rows, device)
        self.topk_p = torch.zeros((num_rows, topk), dtype=torch.float32, device=device)
        self.topk_index = torch.zeros((num_rows, topk), dtype=torch.long, device=device)

    def stash_tree(self, rows: torch.Tensor, *, seq_lens, root, topk_p, topk_index, hidden=None) -> None:
        """Write rows ``rows [B]``: ``seq_lens``, ``root [B]``, ``topk_p`` / ``topk_index [B, k]``,
        ``hidden [B, E]`` (``d1`` = the top child)."""
        self.stash(rows, seq_lens=seq_lens, root=root, d1=topk_index[:, 0], hidden=hidden)
        self.topk_p[rows] = topk_p.float()
        self.topk_index[rows] = topk_index

    def gather_tree(self, rows: torch.Tensor):
        """``(seq_lens [B], root [B], topk_p [B, k], topk_index [B, k], hidden [B, E] | None)``."""
        seq_lens, root, _, hidden = self.gather(rows)
        return seq_lens, root, self.topk_p[rows], self.topk_index[rows], hidden
