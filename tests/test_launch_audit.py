"""Host work per round of the production loop, counted on CPU (refspec.audits.launch).

On a GPU every torch op the host dispatches outside a CUDA graph is a launch (or a host tensor
built for one), and the round is host-bound when they add up to more than the GPU's work
(benchmarks/results/h200_round2.md: wall / GPU-busy 1.24 at B = 1, 1.43 at B = 16).  The probe
counts those ops on the CPU, graph replays once each, so these bounds hold on every device.
The expected numbers are derived from the rules in the docstrings, op by op; allocator work
(``core/kv_cache.py``: a page when a row crosses its reserve) is amortised and left out.
"""

from __future__ import annotations

import functools

import pytest
import torch

from refspec.graphs.capture import EmulatedGraph
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative.engine import Engine
from refspec.audits.launch import host_ops, round_ops

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8], [9, 7, 9, 3]]


@functools.lru_cache(maxsize=None)
def target() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0)


def audited(B: int, draft: str = "early-exit:1"):
    """An overlap v2 run (graphs, validation off, Sd = 3, P = 4) of B requests, 12 tokens each:
    ``(ops Counter, rounds launched)``."""
    eng = Engine(target(), make_draft(draft, target()), version="v2", num_steps=3, page_size=4, max_context=32,
                 max_batch=B, graphs=True, capture_bs=(1, 2, 4), validate=False, overlap=True)
    for i, p in enumerate(PROMPTS[:B]):
        eng.add_request(i, p, 12)
    ops = round_ops(eng)
    return ops, eng.rounds_launched


def per_round(ops, rounds, phase="launch", skip=("core/kv_cache.py",), site=None) -> float:
    n = sum(v for (ph, path, fn, _op), v in ops.items()
            if ph == phase and path not in skip and (site is None or (path, fn) == site))
    return n / rounds


def test_the_probe_counts_dispatched_ops_and_a_graph_replay_once():
    """``a + b`` is one op; an emulated replay is one ``graph_replay`` whatever it runs; views
    are free (no launch)."""
    a, b = torch.ones(3), torch.ones(3)
    g = EmulatedGraph()
    g.capture(lambda: (a * 2 + b).sum())
    with host_ops() as seen:
        _ = a + b
        _ = a[1:].view(2)
        g.replay()
    by_op = {op: n for (_ph, _p, _f, op), n in seen.items()}
    assert by_op == {"add": 1, "graph_replay": 1}


@pytest.mark.spec("CG-005")
@pytest.mark.parametrize("draft, dtypes", [("early-exit:1", {"draft_decode": 2, "verify": 2, "draft_extend": 2}),
                                           ("eagle", {"draft_decode": 3, "verify": 2, "draft_extend": 3})])
def test_a_replay_writes_its_buffers_in_one_copy_per_dtype(draft, dtypes):
    """graphs/runner.py ("one copy per dtype"): a replay's real rows and padded rows (CG-005)
    of every static buffer go in ONE ``_foreach_copy_`` per dtype: int64 (req_pool_indices,
    out_cache_loc, positions, ids / forced) and int32 (seq_lens, num_accept_tokens,
    extend_seq_lens), plus the model dtype where an EAGLE draft passes ``hidden`` (draft decode
    and draft extend; verify takes ids only).  Per round: 2 + 2 + 2 = 6 copies (early exit),
    3 + 2 + 3 = 8 (EAGLE), whatever B and however many fields."""
    want = sum(dtypes.values())
    for B in (1, 3):
        ops, rounds = audited(B, draft)
        assert per_round(ops, rounds, site=("graphs/runner.py", "copy_rows")) == want
        fill_ops = {op for (ph, path, fn, op) in ops if (path, fn) == ("graphs/runner.py", "_fill")}
        assert fill_ops <= {"full", "cat"}, f"per-field writes are back in _fill: {fill_ops}"


#: the bound of one round's launch phase (B = 1), op by op (test docstring)
REPLAYS = {"draft_decode": 2 + 2 * 2 + 1 + 1, "verify": 2 + 2 + 1 + 1, "draft_extend": 2 + 3 + 1 + 1}
ROUND_LOGIC = 2 + 3 + 5 + 3 + 8 + 13
BOUND_B1 = sum(REPLAYS.values()) + ROUND_LOGIC  # 21 + 34 = 55
PADDED = 1  #: a replay with padded rows adds the host ``seq_lens_cpu`` padding: one ``cat`` (its fill made once)


def test_host_ops_per_round_stay_under_the_rule_and_do_not_grow_with_the_batch():
    """Upper bound of a v2 overlap round's launch phase, derived from the rules (B = 1, early-exit
    draft, no drafter; allocator work left out):

    * each graph replay (graphs/runner.py, fa3/graph_metadata.py): 2 copies (int64, int32); no
      padded row at B = 1 (a captured size 1), so ``seq_lens_cpu`` is the live one (a padded
      replay adds a ``cat`` onto a constant fill, :data:`PADDED`); per backend 2 = the page-table
      gather and ``// P`` (the host bound ``max K`` is read from the CPU list, no op; ``seq_lens
      + delta`` into ``cache_seqlens`` and the ``cu_seqlens_k`` cumsum are the graph's own work,
      ``init_forward_metadata_in_graph``: 0); draft extend + 1 (``cu_seqlens_q`` cumsum); the
      replay 1; 1 clone of the one output read (tokens; hidden only for EAGLE).  Draft decode has
      Sd - 1 = 2 backends: 2 + 4 + 1 + 1 = 8; verify 6; draft extend 7: **21**.
    * round logic (speculative/rounds.py, core/future_batch.py, speculative/overlap.py):
      rows to the device + one future-map gather = 2; the window's positions (+ a constant
      ``arange``, ``core/constants.py``) and slots (gather, int64) = 3; per builder a host
      ``seq_lens_cpu`` = 3, the int32 ``seq_lens`` once for all three and draft extend's L + N
      (its ``extend_seq_lens`` a constant) = 5; draft-decode inputs (ids, forced) and the drafts
      ``cat`` <= 3; the verify input ``cat`` + acceptance (eq, int64, cumprod, sum) + candidates
      (cat, lt, where) = 8; a = n + 1, its int32 copy, the kept rows (constant ``b * N`` + n),
      the next state (L + a, a - 1, the roots' gather, the kept d_1), the future-map scatter
      (stack, index_put), ``draft_len`` (gather, + 1), the result ``cat`` and its copy = 13:
      **34**.  The constants are made once per shape (a few ops in the first round).

    So <= 55 ops per round at B = 1 (69 before the in-graph lengths and the constants; 134 before
    the fused copies, of which 40 per-field copies and fills in the three replays; 83 before the
    unpadded replay and the host bound's CPU list).
    B = 3 (replayed padded to 4) adds the three replays' ``seq_lens_cpu`` padding, the two copies
    of the draft steps' first Sd - 1 window columns (a strided slice) and, once per batch size
    the run meets (3, 2, 1 as requests finish), the constant "no override" drafts: no op per
    request.  The commit phase reads one
    pinned buffer and works on host lists: 0 ops outside the allocator.
    """
    ops1, r1 = audited(1)
    ops3, r3 = audited(3)
    n1, n3 = per_round(ops1, r1), per_round(ops3, r3)
    assert n1 <= BOUND_B1, f"{n1:.1f} ops per round > {BOUND_B1}"
    bound3 = BOUND_B1 + 3 * PADDED + 2 + 3 / r3
    assert n3 <= bound3, f"B = 3: {n3:.1f} ops per round > {bound3:.1f}"
    assert per_round(ops1, r1, "commit") == 0 and per_round(ops3, r3, "commit") == 0
    graph_replays = {k: v for k, v in ops3.items() if k[3] == "graph_replay"}
    assert sum(graph_replays.values()) == 3 * r3  # three graphs a round, all replayed (none eager)


def test_a_stacked_kv_store_is_one_scatter_with_the_same_bits():
    """KVPool.set_kv_buffer: k and v as the halves of one [2, T, Hkv, D] tensor (what the fused
    model's pre region returns) are written by ONE index_put, with exactly the values of two
    separate stores (the readable model's k and v); separate tensors still take two."""
    from refspec.core.kv_cache import KVPool, stacked_halves

    pools = [KVPool(2, 5, 4, 2, 8, fill=float("nan")) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 6, 2, 8, generator=g)
    loc = torch.tensor([4, 5, 6, 9, 10, 19])
    assert stacked_halves(kv[0], kv[1]) is kv and stacked_halves(kv[0].clone(), kv[1]) is None
    ops = []
    for pool, (k, v) in zip(pools, [(kv[0], kv[1]), (kv[0].clone(), kv[1].clone())]):
        with host_ops() as seen:
            pool.set_kv_buffer(1, loc, k, v)
        ops.append(sum(n for (_ph, _p, _f, op), n in seen.items() if op == "index_put_"))
    assert ops == [1, 2]
    for a, b in zip(pools[0].k_buffer + pools[0].v_buffer, pools[1].k_buffer + pools[1].v_buffer):
        assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))
    assert torch.equal(pools[0].get_flat_kv(1)[1][loc], kv[1]) and pools[0].k_buffer[0].isnan().all()
    assert all(b.is_contiguous() for b in pools[0].k_buffer + pools[0].v_buffer)


def audited_tree(B: int):
    """A top-k tree v2 overlap run (k = 4, N = 8, Sd = 3, P = 4, graphs, validation off, early-exit
    draft: 1 draft layer, 2 target layers) of B requests, 12 tokens each: ``(ops, rounds)``."""
    from refspec.speculative.tree.engine import TreeEngine

    eng = TreeEngine(target(), make_draft("early-exit:1", target()), topk=4, num_draft_tokens=8, version="v2",
                     num_steps=3, page_size=4, max_context=48, max_batch=B, graphs=True, capture_bs=(1, 2, 4),
                     validate=False, overlap=True)
    for i, p in enumerate(PROMPTS[:B]):
        eng.add_request(i, p, 12)
    ops = round_ops(eng)
    return ops, eng.rounds_launched


#: the tree round's launch phase (B = 1), op by op (test docstring)
TREE_REPLAYS = {"draft": 3 + 2 + 1, "verify": 3 + 2 + 1,
                "draft_extend": 2 + 2 + 2 + 1 + 1 + 1}  # 6 + 6 + 9 = 21
TREE_ROUND_LOGIC = 5 + (10 + 4) + 12 + 6 + 21  # 5 + 14 + 12 + 6 + 21 = 58
TREE_BOUND_B1 = sum(TREE_REPLAYS.values()) + TREE_ROUND_LOGIC  # 21 + 58 = 79
TREE_ONCE = 8  #: ops of the constants made on first use per batch size (const_arange, padding)


@pytest.mark.spec("TR-018", "TR-020")
def test_tree_v2_overlap_host_ops_per_round_stay_under_the_rule_and_do_not_grow_with_the_batch():
    """Upper bound of a top-k tree v2 overlap round's launch phase (B = 1; allocator work left
    out), derived from the rules:

    * graph replays (speculative/tree/graphs.py, fa3/graph_metadata.py, graphs/runner.py): the
      draft graph 6 = 3 fused copies of the batch and inputs (int64, int32, fp32 topk_p), the
      shared prefix page table over the host bound (the gather and ``// P``), the replay; the
      prefix lengths (TR-013: K = L - lp, ``cu_seqlens_k``), every step's expand metadata and
      the tail copies into branches t >= 1 (TR-015) are the graph's own work (0 host ops), and
      its 6 outputs are views (no clone: every reader is launched before the graph's next
      replay, tests/test_tree_overlap.py).  Verify 6 = 3 copies (int64, int32, the bool tree
      mask rows), 2 for the page table, the replay; the prefix lengths (K = L), the expand
      metadata and, v2, the path's KV move and the compaction of predict (TR-020 / TR-021) are
      inside the graph, its 5 outputs views.  Draft extend (the chain's runner) 9 = 2 copies,
      ``seq_lens_cpu`` (full, cat), 2 for the page table, the ``cu_seqlens_q`` cumsum, the
      replay, the clone of its logits (``seq_lens + 0`` and its cumsum are the graph's own work):
      **21**;
    * round logic: rows to the device (2) and the future-map gathers (3) = 5; the branch slots
      (geometry 4, positions 4, gather + int64 2) 10, the draft batch (positions 2, int32 L,
      ``seq_lens_cpu``) 4; the tree (root ``cat``, positions, FULL_MASK 10) 12; the verify
      window and batch 6; after verify 21: a = n + 1, the draft-extend batch 4, its
      ``num_accept_tokens`` 1, the kept rows (``select_index``, the logits gather, top-k 2) 4,
      L + a, the next root, the future-map scatters 4, the result rows 4 and their ``cat``:
      **58**.

    So <= 79 ops per round at B = 1 (83 before the chain runner's in-graph lengths; 298 at this
    shape, then 127 with the tail copies, the path's KV move and compaction and the prefix
    lengths eager and the tree outputs cloned).  The index constants (``const_arange``) and the
    tree replays' padding constants are made once per batch size (``TREE_ONCE``).  B = 3 pads to
    the graph of 4: the two tree replays each add one ``cat`` of the padded ``seq_lens_cpu``,
    verify one of the padded FULL_MASK (the static batch's ``custom_mask``): 3, and no op per
    request.  The commit phase works on host data: 0 ops outside the allocator.
    """
    ops1, r1 = audited_tree(1)
    ops3, r3 = audited_tree(3)
    n1, n3 = per_round(ops1, r1), per_round(ops3, r3)
    assert n1 <= TREE_BOUND_B1 + TREE_ONCE / r1, f"{n1:.1f} ops per round > {TREE_BOUND_B1}"
    bound3 = TREE_BOUND_B1 + 3 + 3 * TREE_ONCE / r3  # batch sizes 3, 2, 1 as requests finish
    assert n3 <= bound3, f"B = 3: {n3:.1f} ops per round > {bound3:.1f}"
    assert per_round(ops1, r1, "commit") == 0 and per_round(ops3, r3, "commit") == 0
    fill_ops = {op for (ph, path, fn, op) in ops3 if (path, fn) == ("speculative/tree/graphs.py", "_fill")}
    assert fill_ops <= {"_foreach_copy_", "cat"}, f"per-field writes are back in the tree replay: {fill_ops}"
    graph_replays = sum(v for k, v in ops3.items() if k[3] == "graph_replay")
    assert graph_replays == 3 * r3  # draft, verify, draft extend: all replayed (none eager)
