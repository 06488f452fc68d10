"""The oracle's attention backend: same names as the FA3 wing, no page table anywhere.

``init_forward_metadata`` is the oracle twin of the FA3 metadata builder: it derives each
request's query rows q_b and key count K_b from the batch's *meaning*, not from SGLang's
``seq_lens + delta`` formulas:

* q_b is the mode's number of query tokens (``ForwardBatch.q_lens_cpu``, MD-002);
* K_b = (position of the request's last query token) + 1, because in every mode the query
  tokens are the last q_b keys (spec §1.4) and positions are KV indices (SD-007).

Tests compare these with the FA3 wing's ``cache_seqlens`` / ``cu_seqlens_q`` mode by mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from refspec.core.batch import ForwardBatch, check_batch_shapes
from refspec.core.invariants import require
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.oracle.attention import attention_by_slot


@dataclass
class OracleMetadata:
    """Per-request lengths as Python ints: ``q_lens`` (rows), ``cache_seqlens`` K (tokens),
    ``cu_seqlens_q`` (B+1 row offsets), ``req_pool_indices``."""

    q_lens: list[int]
    cache_seqlens: list[int]
    cu_seqlens_q: list[int]
    req_pool_indices: list[int]


def oracle_metadata(fb: ForwardBatch) -> OracleMetadata:
    """The oracle twin of ``init_forward_metadata`` (see module doc).

    Raises: InvariantError MD-012 if two requests name the same ``req_to_token`` row;
    ValueError from :func:`refspec.core.batch.check_batch_shapes`.
    """
    check_batch_shapes(fb)
    rows = fb.req_pool_indices.tolist()
    require(len(set(rows)) == len(rows), "MD-012", f"req_pool_indices {rows} repeat a row")
    q = fb.q_lens_cpu()
    cu = [0, *accumulate(q)]
    pos = fb.positions.tolist()
    K = [int(pos[cu[b + 1] - 1]) + 1 if q[b] else 0 for b in range(len(q))]
    return OracleMetadata(q, K, cu, rows)


class OracleBackend:
    """Reference backend: store-then-attend, attention by slot gather (fp32 by default).

    Args:
        pool: this model's KV pool; kv: the shared ``req_to_token`` / allocator.
        upcast: False computes in the input dtype (the T1 budget run, TOL-002).
        out_dtype: dtype of the output (default: the query's; ``torch.float32`` keeps the
            fp32 truth unrounded for T1 comparisons).
    """

    name = "oracle"

    def __init__(self, pool: KVPool, kv: KVCache, upcast: bool = True, out_dtype=None):
        self.pool, self.kv, self.upcast, self.out_dtype = pool, kv, upcast, out_dtype
        self.forward_metadata: OracleMetadata | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> OracleMetadata:
        self.forward_metadata = oracle_metadata(fb)
        return self.forward_metadata

    def forward(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch):
        """``q [T, H, D]``, ``k, v [T, Hkv, D]`` (or None: nothing new to store) -> ``[T, H, D]``.

        Raises: RuntimeError if no metadata was built yet; InvariantError PA-009 / PA-011 (shapes).
        """
        if self.forward_metadata is None:
            raise RuntimeError("OracleBackend.forward before init_forward_metadata(fb): there is no metadata")
        require(q.dim() == 3 and tuple(q.shape[1:]) == (layer.num_heads, layer.head_dim), "PA-011",
                lambda: f"q {tuple(q.shape)} vs layer {layer.layer_id}: [T, H = {layer.num_heads}, D = {layer.head_dim}]")
        if k is not None:
            self.pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        md = self.forward_metadata
        kf, vf = self.pool.get_flat_kv(layer.layer_id)
        return attention_by_slot(q, kf, vf, self.kv.req_to_token, md.req_pool_indices, md.cache_seqlens,
                                 md.cu_seqlens_q, softmax_scale=layer.softmax_scale,
                                 window_left=layer.sliding_window_size, softcap=layer.logit_cap,
                                 upcast=self.upcast, out_dtype=self.out_dtype)
