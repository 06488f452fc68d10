"""Tree scenarios for the FA3 top-k > 1 checks: a paged pool with shuffled pages, NaN where unwritten.

Used by ``tests/test_tree_*.py``, ``tests/test_gpu_tree.py`` and ``python -m refspec check
--sections tree``.  Everything here is the checks' own construction (random trees, the FULL_MASK
built from parent lists by a plain loop, the expected key slots of each row), independent of the
production metadata code it checks; only the branch layout (TR-015) is taken from
:mod:`refspec.speculative.tree.kv`, whose own tests pin it by hand.

Shapes: one attention layer, H = 4 query heads over Hkv = 2 KV heads (GQA), head dim ``head_dim``
(default D = 16; the GPU runs use 64, a head dim the real FA3 kernel is built for).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode
from refspec.fa3.tree_backend import TreeDraftBatch, TreeVerifyBatch
from refspec.speculative.tree import kv as tree_kv

H, HKV, D = 4, 2, 16  #: GQA: 2 query heads per KV head
LAYER = AttentionLayer(0, H, HKV, D)


def layer(head_dim: int = D) -> AttentionLayer:
    return AttentionLayer(0, H, HKV, head_dim)


def make_cache(P: int, B: int, width: int, seed: int, device="cpu", dtype=torch.float32, head_dim: int = D):
    """KVCache with shuffled pages and a 1-layer pool poisoned with NaN."""
    num_pages = B * (-(-width // P) + 2) + 4
    kv = KVCache(B + 1, width, num_pages, P, extra=0, seed=seed, device=device)
    pool = KVPool(1, num_pages, P, HKV, head_dim, dtype=dtype, device=device, fill=float("nan"))
    return kv, pool


def write_random(pool: KVPool, slots: torch.Tensor, gen: torch.Generator) -> None:
    hd = pool.k_buffer[0].shape[-1]
    k = torch.randn((slots.numel(), HKV, hd), generator=gen).to(slots.device)
    v = torch.randn((slots.numel(), HKV, hd), generator=gen).to(slots.device)
    pool.set_kv_buffer(0, slots.long(), k, v)


def random_parents(N: int, gen: torch.Generator) -> list[int]:
    """A random tree over N nodes: node 0 the root, parent[i] < i."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, N)]


def ancestors_and_self(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return sorted(out)


def full_mask(parents_per_req: list[list[int]], Ls: list[int]) -> torch.Tensor:
    """SGLang's FULL_MASK layout, built by a plain loop: per request, per node, [prefix | tree]."""
    flat = []
    for parents, L in zip(parents_per_req, Ls):
        N = len(parents)
        for i in range(N):
            seen = set(ancestors_and_self(parents, i))
            flat += [True] * L + [j in seen for j in range(N)]
    return torch.tensor(flat, dtype=torch.bool)


def verify_setup(P: int, Ls: list[int], N: int, seed: int, device="cpu", dtype=torch.float32, head_dim: int = D):
    """Committed KV at 0..L-1 and N verify slots at L..L+N-1 per request, random trees."""
    gen = torch.Generator().manual_seed(seed)
    B = len(Ls)
    kv, pool = make_cache(P, B, max(Ls) + N, seed, device, dtype, head_dim)
    rows = [kv.alloc_req() for _ in range(B)]
    kv.alloc_extend(rows, [0] * B, Ls)
    kv.alloc_extend(rows, Ls, [L + N for L in Ls])
    for r, L in zip(rows, Ls):
        write_random(pool, kv.req_to_token[r, :L + N], gen)
    parents = [random_parents(N, gen) for _ in Ls]
    fb, expected_slots = tree_batch(kv, rows, Ls, N, parents, device)
    q = torch.randn((B * N, H, head_dim), generator=gen).to(device=device, dtype=dtype)
    return kv, pool, fb, q, expected_slots, rows


def tree_batch(kv, rows, Ls, N, parents, device="cpu"):
    """The TreeVerifyBatch of trees ``parents`` over verify slots L..L+N-1, and each row's keys."""
    loc = torch.cat([kv.req_to_token[r, L:L + N].long() for r, L in zip(rows, Ls)])
    depth = [len(ancestors_and_self(p, i)) - 1 for p in parents for i in range(N)]
    fb = TreeVerifyBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.tensor(Ls, dtype=torch.int32, device=device), seq_lens_cpu=torch.tensor(Ls), out_cache_loc=loc,
        positions=torch.tensor([Ls[i // N] + depth[i] for i in range(len(depth))], device=device),
        num_draft_tokens=N, topk=2, custom_mask=full_mask(parents, Ls).to(device))
    expected_slots = []
    for b, (r, L) in enumerate(zip(rows, Ls)):
        prefix = kv.req_to_token[r, :L].tolist()
        for i in range(N):
            expected_slots.append(prefix + [int(loc[b * N + j]) for j in ancestors_and_self(parents[b], i)])
    return fb, expected_slots


def draft_setup(P: int, Ls: list[int], topk: int, S: int, seed: int, copy_tail: bool = True, device="cpu",
                dtype=torch.float32, head_dim: int = D):
    """Committed draft KV, the branch regions of TR-015 (tail copied), K/V written at every step."""
    gen = torch.Generator().manual_seed(seed)
    B = len(Ls)
    width = max(tree_kv.draft_alloc_len(L, topk, S, P) for L in Ls)
    kv, pool = make_cache(P, B, width, seed, device, dtype, head_dim)
    rows = [kv.alloc_req() for _ in range(B)]
    kv.alloc_extend(rows, [0] * B, Ls)
    for r, L in zip(rows, Ls):
        write_random(pool, kv.req_to_token[r, :L], gen)
    kv.alloc_extend(rows, Ls, [tree_kv.draft_alloc_len(L, topk, S, P) for L in Ls])
    loc = tree_kv.assign_draft_cache_locs(kv, rows, Ls, topk, S)
    if copy_tail:
        src, tgt = tree_kv.tail_copy_slots(kv, rows, Ls, topk, S)
        tree_kv.move_kv_cache(pool, tgt, src)
    write_random(pool, loc, gen)  # every step's K/V (a step-s row may read steps 0..s only)
    fb = TreeDraftBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.tensor(Ls, dtype=torch.int32, device=device), seq_lens_cpu=torch.tensor(Ls),
        out_cache_loc=loc, positions=torch.tensor([L + j for L in Ls for _ in range(topk) for j in range(S)],
                                                  device=device),
        topk=topk, num_steps=S, draft_cache_loc=loc)
    return kv, pool, fb, rows, loc
