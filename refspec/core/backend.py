"""The attention-backend contract both wings implement (SGLang ``AttentionBackend`` names).

Store-then-attend (PA-009): ``forward`` writes this forward's K/V at ``fb.out_cache_loc``, then
attends with the metadata that ``init_forward_metadata`` built for the same batch.  The model
(:mod:`refspec.model`) is handed a backend and imports neither wing:

* :class:`AttentionBackend`: :class:`~refspec.oracle.backend.OracleBackend` (eager only) and
  :class:`~refspec.fa3.backend.FlashAttentionBackend`;
* :class:`GraphableBackend`: the FA3 backend, whose metadata can be captured in CUDA graphs and
  rewritten in place at replay (SGLang ``init_cuda_graph_state`` and the capture / replay hooks,
  CG-001; the names are SGLang's, the signatures refspec's: 0.5.23's ``init_forward_metadata_in_graph``
  takes only the forward batch).

The dense oracle (:class:`~refspec.oracle.dense.DenseBackend`) takes a ``DenseBatch``, not a
``ForwardBatch``, so it stands outside this contract on purpose.

**First reading:** :class:`AttentionBackend`; :class:`GraphableBackend`'s hooks can wait for the
CUDA-graph modules (14-16 of the reading order).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from refspec.core.batch import ForwardBatch
from refspec.core.layer import AttentionLayer


@runtime_checkable
class AttentionBackend(Protocol):
    """Eager attention over the paged pool."""

    name: str

    def init_forward_metadata(self, fb: ForwardBatch) -> object:
        """Build (and keep as ``forward_metadata``) what ``forward`` needs for ``fb``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: AttentionLayer, fb: ForwardBatch, q_rope: torch.Tensor | None = None,
                k_rope: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, Hkv, D]`` (None: nothing to store) -> ``[T, H, D]``.

        With an MLA pool, SGLang's ``RadixAttention`` call of the absorbed layer: ``q`` the
        absorbed ``q_nope [T, H, R]``, ``k`` the latent ``[T, 1, R]``, ``q_rope [T, H, Dr]``,
        ``k_rope [T, 1, Dr]`` -> ``[T, H, R]`` (``refspec/fa3/mla.py``, docs/mla.md)."""


@runtime_checkable
class GraphableBackend(AttentionBackend, Protocol):
    """An :class:`AttentionBackend` whose metadata lives in preallocated graph buffers."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Preallocate the buffers for batches of up to ``max_bs`` requests / ``max_num_tokens`` rows."""

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, fb: ForwardBatch) -> object:
        """Bind the metadata of batch size ``bs`` to buffer slices and freeze its scalars."""

    def init_forward_metadata_in_graph(self, bs: int, fb: ForwardBatch) -> None:
        """Rewrite the captured metadata in place from ``fb``'s device fields: recorded in the graph."""

    def init_forward_metadata_replay_cuda_graph(self, bs: int, fb: ForwardBatch, num_real: int) -> object:
        """Before a replay of the padded batch ``fb`` (``num_real`` real rows): what needs the host."""
