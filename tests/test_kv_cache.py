"""The paged allocator and ``KVCache`` (docs/spec/kv.md): PA-001, PA-008, KV-001..KV-004, KV-006.

Worked examples use an unshuffled free list, so pages come out as 1, 2, 3, ... and every slot
below is computed by hand: with P = 4, page g holds slots ``4g .. 4g+3``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refspec.mutants import variants
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, PagedAllocator


def raises(inv_id: str):
    """``pytest.raises`` for an InvariantError carrying exactly ``inv_id``."""
    return pytest.raises(InvariantError, match=rf"^\[{inv_id}\]")


def row(kv: KVCache, r: int, n: int) -> list[int]:
    return kv.req_to_token[r, :n].tolist()


def assert_inv_page(kv: KVCache, r: int, length: int) -> None:
    """INV-PAGE written out independently of ``check_page_contiguous`` (PA-001)."""
    P, R = kv.page_size, row(kv, r, length)
    for p, slot in enumerate(R):
        assert slot % P == p % P, f"row {r} pos {p}: slot {slot} at offset {slot % P}, expected {p % P}"
        assert slot - p % P == R[p - p % P], f"row {r} pos {p}: slot {slot} not in the page of pos {p - p % P}"


# ---------------------------------------------------------------- PA-008 reserved dummies
@pytest.mark.spec("PA-008")
def test_page_0_is_never_allocated_even_when_the_pool_is_drained():
    alloc = PagedAllocator(num_pages=6, page_size=4, seed=3)
    got = alloc.alloc_pages(5)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert alloc.num_free_pages == 0
    assert not alloc.is_in_use(0)


@pytest.mark.spec("PA-008", "KV-003")
def test_req_to_token_row_0_is_never_handed_out():
    kv = KVCache(max_reqs=4, max_context=8, num_pages=4, page_size=2)
    assert [kv.alloc_req() for _ in range(3)] == [1, 2, 3]
    with raises("KV-003"):
        kv.alloc_req()
    assert kv.req_to_token[0].eq(0).all()  # the dummy row stays zeros -> dummy page 0


@pytest.mark.spec("PA-008", "KV-003")
def test_freeing_page_0_raises():
    alloc = PagedAllocator(num_pages=4, page_size=4)
    with raises("KV-003"):
        alloc.free_pages([0])
    with raises("KV-003"):
        alloc.free(torch.tensor([1, 2]))  # slots 1, 2 live in page 0


# ---------------------------------------------------------------- KV-001 alloc_extend
@pytest.mark.spec("KV-001", "PA-001")
def test_alloc_extend_continues_the_partial_page_worked_example():
    """P = 4, fresh pool (pages 1..7 free, in order).

    r1 takes 5 tokens: pages 1, 2 -> slots 4 5 6 7 | 8.  r2 takes 3: page 3 -> slots 12 13 14.
    Then r1 grows 5 -> 7: positions 5, 6 fit in page 2 (slots 9, 10), no new page.
    r2 grows 3 -> 6: position 3 is slot 15 (page 3), positions 4, 5 open page 4 (slots 16, 17).
    """
    kv = KVCache(max_reqs=4, max_context=16, num_pages=8, page_size=4)
    r1, r2 = kv.alloc_req(), kv.alloc_req()
    assert kv.alloc_extend([r1], [0], [5]).tolist() == [4, 5, 6, 7, 8]
    assert kv.alloc_extend([r2], [0], [3]).tolist() == [12, 13, 14]
    assert kv.allocator.num_free_pages == 7 - 3
    out = kv.alloc_extend([r1, r2], [5, 3], [7, 6])
    assert out.dtype == torch.int64 and out.tolist() == [9, 10, 15, 16, 17]
    assert row(kv, r1, 7) == [4, 5, 6, 7, 8, 9, 10]
    assert row(kv, r2, 6) == [12, 13, 14, 15, 16, 17]
    assert kv.allocator.num_free_pages == 3  # exactly one new page (4) was taken
    for r, n in ((r1, 7), (r2, 6)):
        assert_inv_page(kv, r, n)
        kv.check_page_contiguous(r, n)


@pytest.mark.spec("KV-001")
def test_alloc_extend_exact_page_boundary_takes_a_new_page():
    """P = 4: a row of exactly 4 tokens (page 1) grows by 1 -> position 4 opens page 2 (slot 8)."""
    kv = KVCache(max_reqs=2, max_context=16, num_pages=4, page_size=4)
    r = kv.alloc_req()
    kv.alloc_extend([r], [0], [4])
    assert kv.alloc_extend([r], [4], [5]).tolist() == [8]
    assert kv.allocator.num_free_pages == 1


@pytest.mark.spec("KV-001", "KV-007")
def test_alloc_extend_refuses_a_row_whose_last_slot_is_misplaced():
    """SGLang's assert ``(last_loc + 1) % P == prefix_len % P``: last slot 9 at prefix 3, P = 4."""
    kv = KVCache(max_reqs=2, max_context=16, num_pages=4, page_size=4)
    r = kv.alloc_req()
    kv.alloc_extend([r], [0], [3])
    kv.req_to_token[r, 2] = 9  # (9 + 1) % 4 == 2 != 3, on the device ...
    with raises("KV-007"):  # ... which the audit's mirror check sees
        kv.check_mirror()
    kv.req_to_token_cpu[r, 2] = 9  # ... and in the host mirror, the copy the allocator reads
    with raises("KV-001"):
        kv.alloc_extend([r], [3], [4])


@pytest.mark.spec("KV-001")
def test_alloc_extend_checks_every_row_before_it_takes_a_page():
    """All-or-nothing: a misplaced last slot in the *second* row is refused before the first row
    got pages.  P = 4, pages 1..9 free.  Row a holds 3 tokens (page 1: slots 4 5 6), row b 2
    (page 2: slots 8 9); b's last slot is then moved to 10 in the host mirror ((10 + 1) % 4 = 3,
    but prefix 2 % 4 = 2).  Growing both to 9 tokens (2 pages each) raises KV-001 and leaves the
    pool as it was: 7 free pages, page 3 not in use, both rows (host and device) unchanged.
    """
    kv = KVCache(max_reqs=3, max_context=16, num_pages=10, page_size=4)
    a, b = kv.alloc_req(), kv.alloc_req()
    kv.alloc_extend([a], [0], [3])
    kv.alloc_extend([b], [0], [2])
    kv.req_to_token_cpu[b, 1] = 10
    assert kv.allocator.num_free_pages == 7
    with raises("KV-001"):
        kv.alloc_extend([a, b], [3, 2], [9, 9])
    assert kv.allocator.num_free_pages == 7
    assert not kv.allocator.is_in_use(3)
    assert kv.req_to_token_cpu[a, :9].tolist() == [4, 5, 6, 0, 0, 0, 0, 0, 0]
    assert row(kv, a, 9) == [4, 5, 6, 0, 0, 0, 0, 0, 0]
    assert kv.req_to_token_cpu[b, :3].tolist() == [8, 10, 0]
    assert row(kv, b, 3) == [8, 9, 0]


# ---------------------------------------------------------------- KV-002 page-granular free
@pytest.mark.spec("KV-002")
def test_free_is_page_granular_and_the_count_is_exact():
    """P = 4: freeing slots 9 and 10 frees their whole page 2; slots 4 and 13 free pages 1 and 3."""
    alloc = PagedAllocator(num_pages=8, page_size=4)
    assert alloc.alloc_pages(4) == [1, 2, 3, 4]
    assert alloc.num_free_pages == 3
    alloc.free(torch.tensor([9, 10]))
    assert alloc.num_free_pages == 4 and not alloc.is_in_use(2) and alloc.is_in_use(1)
    alloc.free(torch.tensor([4, 13, 14]))
    assert alloc.num_free_pages == 6
    assert [alloc.is_in_use(g) for g in range(8)] == [False, False, False, False, True, False, False, False]


# ---------------------------------------------------------------- KV-003 errors
@pytest.mark.spec("KV-003")
def test_exhaustion_raises_and_allocates_nothing():
    """2 requests need 2 + 2 pages, only 3 are free: nothing is taken, req_to_token untouched."""
    kv = KVCache(max_reqs=3, max_context=16, num_pages=4, page_size=4)
    r1, r2 = kv.alloc_req(), kv.alloc_req()
    before = kv.req_to_token.clone()
    with raises("KV-003"):
        kv.alloc_extend([r1, r2], [0, 0], [5, 8])
    assert kv.allocator.num_free_pages == 3
    assert torch.equal(kv.req_to_token, before)
    with raises("KV-003"):
        kv.allocator.alloc_pages(4)
    assert kv.allocator.num_free_pages == 3


@pytest.mark.spec("KV-003")
def test_double_free_raises():
    alloc = PagedAllocator(num_pages=4, page_size=2)
    alloc.alloc_pages(2)  # pages 1, 2
    alloc.free_pages([2])
    with raises("KV-003"):
        alloc.free_pages([2])
    with raises("KV-003"):
        alloc.free_pages([1, 1])  # the same page twice in one call
    with raises("KV-003"):
        alloc.free_pages([3])  # never allocated
    assert alloc.num_free_pages == 2


# ---------------------------------------------------------------- KV-004 free_tail
@pytest.mark.spec("KV-004")
def test_free_tail_keeps_the_page_of_the_last_committed_token_worked_example():
    """P = 4, v1 verify allocated 13 positions: pages 1 (pos 0-3), 2 (4-7), 3 (8-11), 4 (12).

    3 tokens are committed after the 3 already there: keep_len = 6, the last committed token is
    position 5 in page 2.  Positions 6, 7 (rejected) share page 2 and stay allocated; pages 3
    and 4 (positions 8..12) are freed: 2 pages.
    """
    kv = KVCache(max_reqs=2, max_context=16, num_pages=6, page_size=4)
    r = kv.alloc_req()
    kv.alloc_extend([r], [0], [13])
    assert row(kv, r, 13) == list(range(4, 17))
    assert kv.allocator.num_free_pages == 1
    kv.free_tail(r, keep_len=6, alloc_len=13)
    assert kv.allocator.num_free_pages == 3
    assert [kv.allocator.is_in_use(g) for g in range(6)] == [False, True, True, False, False, False]
    # the next round continues the partial page 2 at position 6 -> slot 10 (reuses a rejected slot)
    assert kv.alloc_extend([r], [6], [9]).tolist() == [10, 11, 20]  # position 8 opens the freed page 5
    kv.check_page_contiguous(r, 9)


@pytest.mark.spec("KV-004")
def test_free_tail_at_a_page_boundary_frees_everything_after_it():
    """P = 4, 13 positions allocated, keep_len = 8: position 7 ends page 2; pages 3 and 4 go."""
    kv = KVCache(max_reqs=2, max_context=16, num_pages=6, page_size=4)
    r = kv.alloc_req()
    kv.alloc_extend([r], [0], [13])
    kv.free_tail(r, keep_len=8, alloc_len=13)
    assert [kv.allocator.is_in_use(g) for g in range(6)] == [False, True, True, False, False, False]


@pytest.mark.spec("KV-004")
def test_free_tail_bug_variant_frees_a_committed_page():
    """The ``free-last-committed-page`` variant frees page 2 that holds committed positions 4, 5."""
    kv = KVCache(max_reqs=2, max_context=16, num_pages=6, page_size=4)
    r = kv.alloc_req()
    kv.alloc_extend([r], [0], [13])
    with variants.enabled("free-last-committed-page"):
        kv.free_tail(r, keep_len=6, alloc_len=13)
    assert not kv.allocator.is_in_use(2)  # what the KV-004 assertion above would catch


# ---------------------------------------------------------------- PA-001 check
@pytest.mark.spec("PA-001")
def test_check_page_contiguous_rejects_a_hand_made_row():
    """P = 4: row 4 5 6 7 | 8 13 ... breaks INV-PAGE at position 5 (slot 13 is in page 3)."""
    kv = KVCache(max_reqs=2, max_context=16, num_pages=6, page_size=4)
    r = kv.alloc_req()
    kv.req_to_token[r, :8] = torch.tensor([4, 5, 6, 7, 8, 13, 10, 11], dtype=torch.int32)
    kv.check_page_contiguous(r, 5)  # the first 5 positions are fine
    with raises("PA-001"):
        kv.check_page_contiguous(r, 6)
    kv.req_to_token[r, :8] = torch.tensor([4, 5, 6, 7, 9, 10, 11, 12], dtype=torch.int32)  # off by one slot
    with raises("PA-001"):
        kv.check_page_contiguous(r, 8)


# ---------------------------------------------------------------- KV-006 property
OPS = st.lists(st.tuples(st.sampled_from(["extend", "tail", "finish"]), st.integers(0, 3), st.integers(0, 9)),
               max_size=25)


@pytest.mark.spec("PA-001", "KV-001", "KV-002", "KV-006")
@given(P=st.sampled_from([1, 2, 3, 4, 16]), seed=st.integers(0, 3), ops=OPS)
def test_any_op_sequence_keeps_inv_page_and_returns_every_page(P, seed, ops):
    """Random alloc_extend / free_tail / free_req over 4 request slots (lengths in tokens).

    After every op: each live row is page-contiguous over its length, live rows share no page,
    and the allocator's in-use count equals the pages the live rows cover.  When everything is
    finished the free count is back at its start (KV-006).
    """
    kv = KVCache(max_reqs=5, max_context=64, num_pages=40, page_size=P, seed=seed)
    start = kv.allocator.num_free_pages
    live: dict[int, tuple[int, int]] = {}  # slot index -> (req row, length)
    for kind, who, n in ops:
        if kind == "extend":
            r, L = live.get(who) or (kv.alloc_req(), 0)
            new = min(L + n, 64)
            try:
                kv.alloc_extend([r], [L], [new])
            except InvariantError as e:  # exhaustion is allowed, and must leave things unchanged
                assert e.inv_id == "KV-003"
                new = L
            live[who] = (r, new)
        elif kind == "tail" and who in live:
            r, L = live[who]
            keep = min(n, L)
            kv.free_tail(r, keep_len=keep, alloc_len=L)
            live[who] = (r, keep)
        elif kind == "finish" and who in live:
            r, L = live.pop(who)
            kv.free_req(r, L)
        owned = []
        for r, L in live.values():
            assert_inv_page(kv, r, L)
            owned += kv.row_pages(r, L)
        assert len(owned) == len(set(owned)), f"two live rows share a page: {owned}"
        assert 0 not in owned
        assert start - kv.allocator.num_free_pages == len(owned)
    for r, L in live.values():
        kv.free_req(r, L)
    assert kv.allocator.num_free_pages == start
