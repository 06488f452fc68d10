"""Step 4 of a tree-trace replay for a **v2** trace: the path move (TR-020) and the v2 draft
extend over the whole window (TR-021), in place of v1's compaction + ``DRAFT_EXTEND``
(:mod:`refspec.traces.replay_tree`, :mod:`refspec.traces.tree`).

Per round, on the :class:`~refspec.traces.replay_tree._Round` already loaded and verified:

1. **move** (TR-020): the production ``move_accept_tokens_to_target_kvcache`` on the recorded
   verify window and accepted paths; the recorded ``moved_to`` slots must then hold the path
   nodes' pre-move target KV in path order, and every other window slot its own KV (nothing is
   freed or overwritten past the first a), both bitwise (T0);
2. **draft extend v2** (TR-021): ``DRAFT_EXTEND_V2`` over all N window rows per request at
   draft KV ``L .. L+N-1`` (``seq_lens = L + N``), FA3 vs the oracle backend under T1
   (TOL-002), and the recorded ``kept_row`` of each request must be the oracle's row ``a - 1``
   (the one that saw exactly the ``L + a`` committed positions) under T1 too.

Upstream (sgl-project/sglang v0.5.23): ``spec_utils.py`` ``move_accept_tokens_to_target_kvcache``;
``eagle_worker_v2.py`` ``EagleDraftWorker._draft_extend_for_decode`` (``select_index``), see
docs/spec/tree.md "The v2 tree round".

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import copy

import torch

from refspec.core.batch import draft_extend_v2_batch
from refspec.core.tolerance import t1
from refspec.fa3.backend import FlashAttentionBackend
from refspec.oracle.backend import OracleBackend
from refspec.speculative.tree.v2 import move_accept_tokens_to_target_kvcache


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def extend_vs_oracle(rd, fb, T: int, check, provider, what: str):
    """One draft extend ``fb`` over T token rows on random q / k / v: the FA3 wing vs the oracle
    backend (fp32, and in q's dtype for the T1 budget, TOL-002), each on its own copy of the draft
    pool; a failure is recorded as ``"{what}: FA3 vs oracle ..."``.  Returns (out, ref, low)."""
    H, Hkv, D = rd.layer.num_heads, rd.layer.num_kv_heads, rd.layer.head_dim
    q, k, v = rd.randn(T, H, D), rd.randn(T, Hkv, D), rd.randn(T, Hkv, D)
    pool_oracle = copy.deepcopy(rd.draft)
    be = FlashAttentionBackend(rd.draft, rd.kv, provider=provider)
    be.init_forward_metadata(fb)
    out = be.forward(q, k, v, rd.layer, fb)
    ora = OracleBackend(pool_oracle, rd.kv, out_dtype=torch.float32)
    ora.init_forward_metadata(fb)
    ref = ora.forward(q, k, v, rd.layer, fb)
    low = None
    if q.dtype != torch.float32:
        lo = OracleBackend(copy.deepcopy(pool_oracle), rd.kv, upcast=False)
        lo.init_forward_metadata(fb)
        low = lo.forward(q, k, v, rd.layer, fb)
    verdict = t1(out, ref, low)
    check.worst["extend"] = verdict.pct
    if not verdict.ok:
        check.failures.append(f"{what}: FA3 vs oracle {verdict}")
    return out, ref, low


def move_and_extend_v2(rd, entries, accepts, node_slots, check, provider) -> None:
    """Module doc, steps 1 and 2.  ``rd``: the loaded round; ``entries``: its ``tree`` list;
    ``accepts``: a per request; ``node_slots`` int64 [B*N]: the verify window; ``check``: the
    :class:`~refspec.traces.replay_tree.TreeRoundCheck` the failures go to (ID first)."""
    N, S, dev, B = rd.N, rd.S, rd.device, len(rd.rows)
    flat_k = rd.target.get_flat_kv(0)[0]
    before = flat_k.clone()
    accept_index = torch.full((B, min(S + 1, N)), -1, dtype=torch.long, device=dev)
    for b, e in enumerate(entries):
        accept_index[b, :len(e["accept_path"])] = torch.tensor([b * N + i for i in e["accept_path"]])
    move_accept_tokens_to_target_kvcache(rd.target, node_slots, accept_index, N)
    for b, (e, s, L, a) in enumerate(zip(entries, rd.slots, rd.Ls, accepts)):
        want = before[[s[L + i] for i in e["accept_path"]]]
        if not _bitwise(flat_k[e["moved_to"]], want):
            check.failures.append(f"[TR-020] request {b}: the recorded moved_to slots {e['moved_to']} do not hold "
                                  f"the accepted path {e['accept_path']}'s KV after the move")
        rest = s[L + a:L + N]
        if not _bitwise(flat_k[rest], before[rest]):
            check.failures.append(f"[TR-020] request {b}: the move changed window slots past the first a = {a}")
    fb = draft_extend_v2_batch(rd.kv, rd.rows, [L + N for L in rd.Ls], N, num_accept_tokens=accepts)
    out, ref, low = extend_vs_oracle(rd, fb, B * N, check, provider,
                                     f"[TR-021] DRAFT_EXTEND_V2 over the N = {N} window rows")
    for b, (e, a) in enumerate(zip(entries, accepts)):
        kept = e["kept_row"]
        if not 0 <= kept < N:
            continue  # tree_v2_round_failures names it
        row, want = b * N + kept, b * N + a - 1
        v_row = t1(out[row:row + 1], ref[want:want + 1], None if low is None else low[want:want + 1])
        if not v_row.ok:
            check.failures.append(f"[TR-021] request {b}: the kept draft-extend row {kept} is not the oracle's row "
                                  f"a - 1 = {a - 1} (the one over L + a = {rd.Ls[b] + a} positions): {v_row}")
