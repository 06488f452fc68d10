"""Every readable twin gives its production twin's result on random inputs (issue 42).

The reference keeps readable versions beside the code the production rounds run: host ports that
loop over requests and nodes beside device tensor code, torch rules beside fused Triton kernels,
eager metadata beside the in-graph writes.  A readable twin that no round calls can drift unseen
(its docstring still reads right), so each pair here runs both sides on the same random inputs and
requires the same result, for page sizes P in {1, 4, 16} and top-k k in {2, 4}:

================  ==============================================  ============================================
family            readable twin                                   production twin
================  ==============================================  ============================================
tree structure    ``build.build_tree``, ``build.tree_parents``    ``device.build_tree_device``,
                                                                  ``device.tree_parents_device``
acceptance        ``build.verify_tree_greedy``                    ``device.verify_tree_greedy_device``
draft positions   ``runners.tree_draft_batch``,                   ``runners.tree_draft_batch_device``,
                  ``kv.assign_draft_cache_locs``,                 ``kv.assign_draft_cache_locs_device``,
                  ``kv.branch_step_positions``, ``kv.tail_copy_   ``kv.branch_step_positions_device``, the
                  slots`` (host lists)                            device form of ``tail_copy_slots``
verify batch      ``runners.tree_verify_batch``                   ``runners.tree_verify_batch_device``
KV move           ``kv.get_src_tgt_cache_loc`` +                  ``kv.path_to_window_slots`` (v1
                  ``kv.get_target_cache_loc`` (upstream's form)   ``compact_accepted_path``, v2
                                                                  ``move_accept_tokens_to_target_kvcache``)
expand metadata   ``tree_metadata.verify_expand_metadata``,       ``graphs.write_verify_expand``,
                  ``draft_expand_metadata`` (eager)               ``graphs.write_draft_expand`` (in the graph)
================  ==============================================  ============================================

The trees come from the real expansion over random draft probabilities (``random_draft`` of
``tests/test_tree_device.py``, whose one-hot level makes orphans, TR-003).  Where both twins could
drift together, a hand rule is checked too (draft step j at ``L + j``, verify node i at slot
``req_to_token[r, L + i]``, the moved KV read back by position).  The fused Triton kernels against
their torch rules: ``tests/test_triton_interpret.py`` (Triton's interpreter, ``make
triton-check``); ``FusedLlama`` against ``LlamaModel``: ``tests/test_fused_greedy.py``.
:data:`TWINS` lists every pair; each side's docstring names the other.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from test_tree_device import V, assert_same_accept, assert_same_tree, random_draft, target_along

from refspec.core.future_batch import round_window
from refspec.fa3 import merge_kernel
from refspec.fa3 import tree_attention as ta
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.metadata import FlashAttentionMetadata
from refspec.fa3.tree_backend import draft_step_batch
from refspec.harness.tree_scenario import make_cache, write_random
from refspec.model.fused import FusedLlama
from refspec.model.llama import LlamaModel
from refspec.speculative.tree import accept_kernel, build_kernel, move_kernel
from refspec.speculative.tree import build as host
from refspec.speculative.tree import device as dev
from refspec.speculative.tree import graphs as tg
from refspec.speculative.tree import kv as tkv
from refspec.speculative.tree import runners
from refspec.speculative.tree.v2 import move_accept_tokens_to_target_kvcache

#: (readable twin, production twin): each docstring names the other (test_each_twin_names_the_other)
TWINS = [
    (host.build_tree, dev.build_tree_device),
    (host.tree_parents, dev.tree_parents_device),
    (host.verify_tree_greedy, dev.verify_tree_greedy_device),
    (runners.tree_draft_batch, runners.tree_draft_batch_device),
    (runners.tree_verify_batch, runners.tree_verify_batch_device),
    (tkv.branch_geometry, tkv.branch_geometry_device),
    (tkv.branch_step_positions, tkv.branch_step_positions_device),
    (tkv.assign_draft_cache_locs, tkv.assign_draft_cache_locs_device),
    (tkv.tail_copy_slots, tkv._tail_copy_slots_device),
    (tkv.get_src_tgt_cache_loc, tkv.path_to_window_slots),
    (tkv.get_target_cache_loc, tkv.path_to_window_slots),
    (tm.verify_expand_metadata, tg.write_verify_expand),
    (tm.draft_expand_metadata, tg.write_draft_expand),
    (dev.tree_structure_torch, build_kernel.tree_structure_fused),
    (dev.verify_tree_greedy_torch, accept_kernel.verify_tree_greedy_fused),
    (tkv.move_kv_cache, move_kernel.move_kv_cache_fused),
    (ta.merge_state_torch, merge_kernel.merge_state_fused),
    (LlamaModel, FusedLlama),
]

PAGE_SIZES = (1, 4, 16)
TOPKS = (2, 4)
SEEDS = range(8)
S = 3  #: draft steps: k + (S-1) k^2 candidates (10 at k = 2, 36 at k = 4)


def lengths(P: int, rnd: random.Random, B: int = 3) -> list[int]:
    """B committed lengths: one on a page edge, one just past it, one random (L >= 1)."""
    return [max(1, P * rnd.randrange(1, 4)), P * rnd.randrange(0, 3) + 1, rnd.randrange(1, 50)][:B]


def a_tree(P: int, k: int, seed: int):
    """A random round's tree over three requests: ``(Ls, N, roots, organized, host_tree, dev_tree)``."""
    rnd = random.Random(1000 * P + 10 * k + seed)
    Ls = lengths(P, rnd)
    N = rnd.randrange(2, min(k + (S - 1) * k * k, 12) + 2)
    sl, tl, pl = random_draft(len(Ls), k, S, seed, (0, 1, 2, 5, 1000)[seed % 5])  # level 0: orphans
    organized = host.organize_draft_results(sl, tl, pl, N)
    roots = torch.randint(0, V, (len(Ls),), generator=torch.Generator().manual_seed(seed))
    L = torch.tensor(Ls)
    built = host.build_tree(roots, *organized, L, k, N)
    built_dev = dev.build_tree_device(roots, *organized, L, k, N, sum(Ls) * N + len(Ls) * N * N)
    return Ls, N, roots, organized, built, built_dev


def a_verify_window(P: int, Ls: list[int], N: int, seed: int):
    """KV with positions 0 .. L + N - 1 of each request allocated (shuffled pages) and written."""
    kv, pool = make_cache(P, len(Ls), max(Ls) + N, seed)
    rows = [kv.alloc_req() for _ in Ls]
    kv.alloc_extend(rows, [0] * len(Ls), [L + N for L in Ls])
    gen = torch.Generator().manual_seed(seed)
    for r, L in zip(rows, Ls):
        write_random(pool, kv.req_to_token[r, :L + N], gen)
    return kv, pool, rows


def bitwise(xs, ys) -> bool:
    """Two lists of pool buffers hold the same bytes (the pools are NaN where unwritten: NaN != NaN)."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(xs, ys))


def fields_differ(a, b, names) -> list[str]:
    """The batch fields of ``names`` that differ between ``a`` and ``b`` (value and dtype)."""
    out = []
    for n in names:
        x, y = getattr(a, n), getattr(b, n)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype \
                and x.shape == y.shape and torch.equal(x, y)
        else:
            same = x == y
        if not same:
            out.append(n)
    return out


BATCH = ("forward_mode", "req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions", "topk")
DRAFT_FIELDS = BATCH + ("num_steps", "draft_cache_loc")
VERIFY_FIELDS = BATCH + ("num_draft_tokens", "custom_mask")


# ---- tree structure and acceptance -------------------------------------------------------

@pytest.mark.spec("TR-003", "TR-004", "TR-005", "TR-016")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_tree_structure_twins_agree(P, k):
    for seed in SEEDS:
        Ls, N, _, (parent_list, top, _), built, built_dev = a_tree(P, k, seed)
        assert_same_tree(built, built_dev)
        parents_dev = dev.tree_parents_device(parent_list, top, k)
        for b in range(len(Ls)):
            assert host.tree_parents(parent_list[b].tolist(), top[b].tolist(), k) == parents_dev[b].tolist()


@pytest.mark.spec("TR-006", "TR-016")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_acceptance_twins_agree(P, k):
    for seed in SEEDS:
        _, N, _, _, built, _ = a_tree(P, k, seed)
        for hit in (0.0, 0.7, 1.0):
            assert_same_accept(built, N, S, target_along(built, N, seed, hit))


# ---- draft positions (the host draft batch, issue 42's drift) ------------------------------

def draft_batches(P: int, k: int, seed: int):
    """The host and device draft batches of one round over three requests (branch slots exist)."""
    Ls = lengths(P, random.Random(100 * P + k + seed))
    width = max(tkv.draft_alloc_len(L, k, S, P) for L in Ls)
    kv, _ = make_cache(P, len(Ls), width, seed)
    rows = [kv.alloc_req() for _ in Ls]
    kv.alloc_extend(rows, [0] * len(Ls), [tkv.draft_alloc_len(L, k, S, P) for L in Ls])
    rows_dev, L_dev = torch.tensor(rows), torch.tensor(Ls)
    loc = tkv.assign_draft_cache_locs(kv, rows, Ls, k, S)
    loc_dev = tkv.assign_draft_cache_locs_device(kv, rows_dev, L_dev, k, S)
    fb = runners.tree_draft_batch(kv, rows, Ls, k, S, loc)
    fb_dev = runners.tree_draft_batch_device(rows_dev, L_dev, Ls, k, S, loc_dev, False)
    return kv, rows, Ls, loc, loc_dev, fb, fb_dev


@pytest.mark.spec("TR-013", "TR-015", "SD-007")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_draft_batch_twins_agree(P, k):
    """Slots, positions and every batch field, whole and per draft step; positions also against
    the rule by hand: branch row ``b*k + t`` runs step j at ``L_b + j`` (SD-007)."""
    for seed in SEEDS:
        kv, rows, Ls, loc, loc_dev, fb, fb_dev = draft_batches(P, k, seed)
        assert torch.equal(loc, loc_dev)
        assert fields_differ(fb, fb_dev, DRAFT_FIELDS) == []
        for s in range(S - 1):
            assert fields_differ(draft_step_batch(fb, s), draft_step_batch(fb_dev, s), BATCH) == []
        want = [L + j for L in Ls for _ in range(k) for j in range(S)]
        assert fb.positions.tolist() == want and fb_dev.positions.tolist() == want
        L_dev = torch.tensor(Ls)
        for b, L in enumerate(Ls):
            assert torch.equal(tkv.branch_step_positions(L, k, S, P),
                               tkv.branch_step_positions_device(L_dev, k, S, P)[b])
            assert tkv.branch_geometry(L, S, P) == tuple(int(x[b]) for x in tkv.branch_geometry_device(L_dev, S, P))
        src, tgt = tkv.tail_copy_slots(kv, rows, Ls, k, S)
        dsrc, dtgt = tkv.tail_copy_slots(kv, torch.tensor(rows), L_dev, k, S)
        real = (dsrc != 0) | (dtgt != 0)  # the device form pads with slot 0 -> slot 0
        assert sorted(zip(dtgt[real].tolist(), dsrc[real].tolist())) == sorted(zip(tgt.tolist(), src.tolist()))


def test_the_draft_comparison_sees_the_known_drift(monkeypatch):
    """Negative control: the drift issue 42 found (the host draft batch giving step j the position
    ``L + j + 1``) fails the comparison above; nothing else in the suite saw it."""
    real = runners.tree_draft_batch

    def drifted(kv, rows, seq_lens, topk, num_steps, draft_cache_loc):
        fb = real(kv, rows, seq_lens, topk, num_steps, draft_cache_loc)
        return fb.replace(positions=fb.positions + 1)
    monkeypatch.setattr(runners, "tree_draft_batch", drifted)
    *_, fb, fb_dev = draft_batches(4, 2, 0)
    assert fields_differ(fb, fb_dev, DRAFT_FIELDS) == ["positions"]


# ---- the verify batch -------------------------------------------------------------------

@pytest.mark.spec("TR-004", "TR-005", "TR-011")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_verify_batch_twins_agree(P, k):
    """Every field; the slots also by hand (node i of request b writes ``req_to_token[r_b, L_b + i]``),
    and the builder's mask rows (what graph replay reads) against the rows the eager path extracts
    from the flat mask (:func:`~refspec.fa3.tree_metadata.verify_mask_rows`)."""
    for seed in SEEDS:
        Ls, N, _, _, built, built_dev = a_tree(P, k, seed)
        kv, _, rows = a_verify_window(P, Ls, N, seed)
        rows_dev, L_dev = torch.tensor(rows), torch.tensor(Ls)
        fb = runners.tree_verify_batch(kv, rows, Ls, N, k, built["positions"], built["custom_mask"])
        window = round_window(kv, rows, rows_dev, L_dev, Ls, N)
        fb_dev = runners.tree_verify_batch_device(rows_dev, L_dev, Ls, N, k, window[1], built_dev, False)
        assert fields_differ(fb, fb_dev, VERIFY_FIELDS) == []
        want = [int(kv.req_to_token[r, L + i]) for r, L in zip(rows, Ls) for i in range(N)]
        assert fb.out_cache_loc.tolist() == want
        assert torch.equal(fb_dev.tree_mask, tm.verify_mask_rows(fb.custom_mask, fb.seq_lens, N))


# ---- the accepted path's KV move ----------------------------------------------------------

@pytest.mark.spec("TR-017", "TR-020")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_kv_move_twins_agree(P, k):
    """Upstream's readable form (``get_src_tgt_cache_loc`` / ``get_target_cache_loc``, host reads)
    against the rounds' device moves, v1 (``compact_accepted_path``: the move and the frees) and v2
    (``move_accept_tokens_to_target_kvcache``): the same pools, the same kept lengths, the same
    freed pages; and by hand: position L + j now holds what node ``accept_index[b, j]`` held."""
    moved = 0  # entries whose node is not already at its target: the random paths leave the chain
    for seed in SEEDS:
        Ls, N, _, _, built, _ = a_tree(P, k, seed)
        tp = target_along(built, N, seed, 0.8)
        B = len(Ls)
        _, accept_index, n = host.verify_tree_greedy(built["draft_tokens"].view(B, N), built["retrive_index"],
                                                     built["retrive_next_token"], built["retrive_next_sibling"],
                                                     tp, S + 1)
        kv, pool, rows = a_verify_window(P, Ls, N, seed)
        loc = torch.cat([kv.req_to_token[r, L:L + N].long() for r, L in zip(rows, Ls)])
        start = [x.clone() for x in pool.kv_buffer]
        # the readable form
        src, keep, free_n = tkv.get_src_tgt_cache_loc(torch.tensor(Ls), loc, accept_index, n, N, P)
        tgt, to_free = tkv.get_target_cache_loc(loc, n, free_n, N)
        tkv.move_kv_cache(pool, tgt, src)
        moved += int((tgt != src).sum())
        readable = [x.clone() for x in pool.kv_buffer]
        # v2: the verify graph's move
        for x, s0 in zip(pool.kv_buffer, start):
            x.copy_(s0)
        move_accept_tokens_to_target_kvcache(pool, loc, accept_index[:, :min(S + 1, N)], N)
        assert bitwise(pool.kv_buffer, readable), seed
        # v1: the move and the frees
        for x, s0 in zip(pool.kv_buffer, start):
            x.copy_(s0)
        in_use = {r: set(kv.row_pages(r, L + N)) for r, L in zip(rows, Ls)}
        kept = tkv.compact_accepted_path(kv, pool, rows, Ls, loc, accept_index, (n + 1).tolist(), N)
        assert bitwise(pool.kv_buffer, readable), seed
        assert kept == keep.tolist()
        freed = {p for r in rows for p in in_use[r] if not kv.allocator.is_in_use(p)}
        assert freed == {int(s) // P for s in to_free.tolist()}
        # by hand: request b's position L + j holds node accept_index[b, j]'s KV (from the start pool)
        k0 = start[0][0].view(-1, *start[0].shape[-2:])
        got = pool.kv_buffer[0][0].view(-1, *start[0].shape[-2:])
        for b, (r, L) in enumerate(zip(rows, Ls)):
            for j in range(int(n[b]) + 1):
                assert bitwise([got[kv.req_to_token[r, L + j].long()]], [k0[loc[accept_index[b, j]]]]), (seed, b, j)
    assert moved > 0


# ---- expand metadata, eager and in the graph -------------------------------------------------

def _buffers(rows: int, width: int) -> FlashAttentionMetadata:
    """Graph-style expand buffers, stale (-7) before the in-graph write."""
    z = lambda *shape: torch.full(shape, -7, dtype=torch.int32)  # noqa: E731
    return FlashAttentionMetadata(z(rows), torch.arange(rows + 1, dtype=torch.int32), z(rows + 1), 1, 0,
                                  z(rows, width))


@pytest.mark.spec("TR-011", "TR-014", "TR-018")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_expand_metadata_twins_agree(P, k):
    """The in-graph writes (:func:`~refspec.speculative.tree.graphs.write_verify_expand` from the
    builder's mask rows, :func:`~refspec.speculative.tree.graphs.write_draft_expand`) against the
    eager metadata on every row: ``cache_seqlens``, ``cu_seqlens_k`` and the table entries a row
    reads (verify: K token slots; draft: ceil(K / P) pages)."""
    for seed in SEEDS:
        Ls, N, _, _, built, built_dev = a_tree(P, k, seed)
        kv, _, rows = a_verify_window(P, Ls, N, seed)
        fb = runners.tree_verify_batch(kv, rows, Ls, N, k, built["positions"], built["custom_mask"])
        eager = tm.verify_expand_metadata(fb.custom_mask, fb.seq_lens, fb.req_pool_indices, kv.req_to_token, N)
        exp = _buffers(len(Ls) * N, N)
        tg.write_verify_expand(exp, built_dev["tree_mask"], fb, kv.req_to_token, N)
        assert torch.equal(exp.cache_seqlens_int32, eager.cache_seqlens_int32)
        assert torch.equal(exp.cu_seqlens_k[1:], eager.cu_seqlens_k[1:])
        for t, K in enumerate(eager.cache_seqlens_int32.tolist()):
            assert torch.equal(exp.page_table[t, :K], eager.page_table[t, :K]), (seed, t)
        _, _, Ls, loc, _, dfb, _ = draft_batches(P, k, seed)
        expand = [_buffers(len(Ls) * k, s + 2) for s in range(S - 1)]
        tg.write_draft_expand(expand, dfb, k, S, P)
        for s, exp in enumerate(expand):
            eager = tm.draft_expand_metadata(loc, dfb.seq_lens, s, k, S, P)
            assert torch.equal(exp.cache_seqlens_int32, eager.cache_seqlens_int32)
            assert torch.equal(exp.cu_seqlens_k[1:], eager.cu_seqlens_k[1:])
            for t, K in enumerate(eager.cache_seqlens_int32.tolist()):
                n_pages = -(-K // P)
                assert torch.equal(exp.page_table[t, :n_pages], eager.page_table[t, :n_pages]), (seed, s, t)


# ---- every pair names the other -----------------------------------------------------------

@pytest.mark.parametrize("readable,production", TWINS, ids=lambda f: f.__name__)
def test_each_twin_names_the_other(readable, production):
    """A reader of either side finds the other (issue 42: "a docstring line in each naming its twin")."""
    assert production.__name__ in inspect.getdoc(readable), (readable.__qualname__, production.__name__)
    assert readable.__name__ in inspect.getdoc(production), (production.__qualname__, readable.__name__)
