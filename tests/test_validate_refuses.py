"""What the FA3 validators (``refspec.fa3.validate``) must refuse, and what they must let through.

The mutation run (``make mutation``, benchmarks/mutation.py) mutates the validators against this
file and test_metadata.py's refusal tests: each test here states one input the checker must
refuse (the rule it names) or one it must accept (a check that is wider than its rule).

Worked batches: P = 4, an unshuffled pool (pages 1, 2, ... in order), rows 1 and 2.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core import batch as B
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache
from refspec.fa3.metadata import init_forward_metadata
from refspec.fa3.validate import validate_batch, validate_metadata


def raises(inv_id, detail=""):
    """The rule ID first, then (somewhere in the message) ``detail``, a regex naming the values."""
    return pytest.raises(InvariantError, match=rf"^\[{inv_id}\].*{detail}")


def cache(seq, max_reqs=4, max_context=24, P=4):
    """``len(seq)`` requests in rows 1, 2, ... with ``seq`` slots reserved from position 0."""
    kv = KVCache(max_reqs=max_reqs, max_context=max_context, num_pages=16, page_size=P, extra=8)
    rows = [kv.alloc_req() for _ in seq]
    kv.alloc_extend(rows, [0] * len(seq), list(seq))
    return kv, rows


def decode(seq=(5, 9), **kw):
    kv, rows = cache(seq, **kw)
    return kv, B.decode_batch(kv, rows, list(seq))


def verify(L=(5, 9), N=4):
    kv, rows = cache([x + N for x in L])
    return kv, B.verify_batch(kv, rows, list(L), N)


# ---------------------------------------------------------------- validate_batch
@pytest.mark.parametrize("row", [3, 7, -1])
def test_validate_batch_refuses_a_row_outside_req_to_token_even_for_one_request(row):
    """req_to_token has 3 rows (max_reqs 3, the dummy row 0 included) and 24+ columns: rows 3 and 7 are
    inside its width but not its height; -1 would index from the end."""
    kv, fb = decode((5,), max_reqs=3)
    assert kv.req_to_token.shape[0] == 3 and kv.req_to_token.shape[1] > 7
    fb = fb.replace(req_pool_indices=torch.tensor([row]))
    with pytest.raises(ValueError, match=rf"req_pool_indices \[{row}\] outside req_to_token rows \[0, 3\)"):
        validate_batch(fb, kv.req_to_token)


def test_validate_batch_leaves_row_0_to_pa_008():
    """Row 0 is inside req_to_token: validate_batch lets it through and validate_metadata names
    the rule it breaks (PA-008, the reserved dummy row), not a range error.  (out_cache_loc is
    what row 0 holds, slot 0, so that INV-TAIL, MD-005, agrees.)"""
    kv, fb = decode((5,))
    fb = fb.replace(req_pool_indices=torch.tensor([0]), out_cache_loc=torch.tensor([0]))
    validate_batch(fb, kv.req_to_token)
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    with raises("PA-008"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_batch_checks_only_the_real_rows():
    """A graph batch padded past ``num_real``: the padding may repeat a row or lie outside
    req_to_token (CG-005 checks it), the real rows are checked."""
    kv, fb = decode()
    padded = fb.replace(req_pool_indices=torch.tensor([1, 1]), seq_lens_cpu=torch.tensor([5, 99]))
    validate_batch(padded, kv.req_to_token, num_real=1)
    with raises("MD-006"):
        validate_batch(padded, kv.req_to_token)
    with raises("MD-012"):
        validate_batch(padded.replace(seq_lens_cpu=fb.seq_lens_cpu), kv.req_to_token)
    outside = fb.replace(req_pool_indices=torch.tensor([1, 50]))
    validate_batch(outside, kv.req_to_token, num_real=1)
    with pytest.raises(ValueError, match="outside req_to_token"):
        validate_batch(outside, kv.req_to_token, num_real=2)


@pytest.mark.parametrize("B_", [1, 2])
def test_validate_batch_refuses_a_cpu_mirror_that_disagrees(B_):
    kv, fb = decode((5, 9)[:B_])
    cpu = fb.seq_lens_cpu.clone()
    cpu[-1] += 1
    with raises("MD-006", rf"seq_lens_cpu \[.*{int(cpu[-1])}\] is not a mirror of seq_lens"):
        validate_batch(fb.replace(seq_lens_cpu=cpu), kv.req_to_token)
    cpu[-1] -= 2
    with raises("MD-006", "is not a mirror"):
        validate_batch(fb.replace(seq_lens_cpu=cpu), kv.req_to_token)


def test_validate_batch_overlap_bound_accepts_larger_and_refuses_smaller():
    """Under the overlap loop seq_lens_cpu is an upper bound: equal or larger passes, one short fails."""
    kv, fb = decode()
    bound = fb.replace(seq_lens_cpu_is_bound=True)
    validate_batch(bound, kv.req_to_token)
    validate_batch(bound.replace(seq_lens_cpu=torch.tensor([5, 12])), kv.req_to_token)
    with raises("MD-006", r"seq_lens_cpu \[5, 8\] is no upper bound of seq_lens \[5, 9\]"):
        validate_batch(bound.replace(seq_lens_cpu=torch.tensor([5, 8])), kv.req_to_token)


def test_validate_batch_refuses_a_repeated_row():
    kv, fb = decode()
    with raises("MD-012", r"req_pool_indices \[2, 2\] repeat a row"):
        validate_batch(fb.replace(req_pool_indices=torch.tensor([2, 2])), kv.req_to_token)


def test_validate_batch_refuses_fields_of_different_batch_sizes():
    kv, fb = decode()
    with pytest.raises(ValueError, match="seq_lens has 1 entries"):
        validate_batch(fb.replace(seq_lens=fb.seq_lens[:1]), kv.req_to_token)


# ---------------------------------------------------------------- validate_metadata
# verify, L = [5, 9], N = 4: K = [9, 13], cu_seqlens_q [0, 4, 8], cu_seqlens_k [0, 9, 22], page
# table [[1, 2, 3, 0], [4, 5, 6, 7]], out_cache_loc [9 .. 12, 25 .. 28]
def verify_md():
    kv, fb = verify()
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    assert md.cu_seqlens_q.tolist() == [0, 4, 8] and md.cache_seqlens_int32.tolist() == [9, 13]
    assert md.page_table.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    return kv, fb, md


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_validate_metadata_accepts_the_worked_verify_and_decode_batches():
    kv, fb, md = verify_md()
    validate_metadata(md, fb, kv.req_to_token, 4)
    kv, fb = decode()
    validate_metadata(init_forward_metadata(fb, kv.req_to_token, 4), fb, kv.req_to_token, 4)


NAMES = ["cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"]


@pytest.mark.parametrize("name", NAMES)
def test_validate_metadata_refuses_a_tensor_that_is_not_int32(name):
    kv, fb, md = verify_md()
    setattr(md, name, getattr(md, name).long())
    with raises("MD-001", rf"{name}: torch.int64, contiguous=True"):
        validate_metadata(md, fb, kv.req_to_token, 4)


@pytest.mark.parametrize("name", NAMES)
def test_validate_metadata_refuses_an_int32_tensor_that_is_not_contiguous(name):
    kv, fb, md = verify_md()
    t = getattr(md, name)
    if t.dim() == 2:
        strided = t.t().contiguous().t()  # the same values, column-major
    else:
        strided = torch.stack([t, t], dim=1)[:, 0]  # the same values, stride 2
    assert torch.equal(strided, t) and not strided.is_contiguous() and strided.dtype == torch.int32
    setattr(md, name, strided)
    with raises("MD-001", rf"{name}: torch.int32, contiguous=False"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_refuses_a_one_element_tensor_with_a_stride_of_2():
    """A one-element tensor counts as contiguous whatever its stride; the kernel still reads
    stride(-1): one request's cache_seqlens_int32 at stride 2 is refused."""
    kv, fb = decode((5,))
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    md.cache_seqlens_int32 = torch.as_strided(i32([5, 0]), (1,), (2,))
    assert md.cache_seqlens_int32.is_contiguous() and md.cache_seqlens_int32.stride() == (2,)
    with raises("MD-001", r"cache_seqlens_int32: torch.int32, contiguous=True, strides \(2,\)"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_accepts_the_empty_tensors_of_an_idle_batch():
    kv, _ = cache(())
    fb = B.idle_batch(kv)
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    md.page_table = torch.as_strided(i32([0, 0]), (0, 2), (1, 2))  # no element: no stride to honour
    validate_metadata(md, fb, kv.req_to_token, 4)


@pytest.mark.parametrize("cu,detail", [
    ([1, 5, 9], r"cu_seqlens_q = \[1, 5, 9\]"),   # q lens [4, 4] as the mode asks, but not from 0
    ([0, 5, 4], r"cu_seqlens_q = \[0, 5, 4\]"),   # decreasing
])
def test_validate_metadata_refuses_cu_seqlens_q_that_does_not_start_at_0_or_decreases(cu, detail):
    kv, fb, md = verify_md()
    md.cu_seqlens_q = i32(cu)
    with raises("MD-002", detail):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_reads_all_of_cu_seqlens_q_for_order_and_the_real_rows_for_q():
    """Two graph rows, one real: the padded row may hold no query tokens (cu repeats), but a
    decreasing cu_seqlens_q is refused even past num_real."""
    kv, fb = decode()
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    md.cu_seqlens_q = i32([0, 1, 1])
    validate_metadata(md, fb, kv.req_to_token, 4, num_real=1)
    md.cu_seqlens_q = i32([0, 1, 0])
    with raises("MD-002", r"cu_seqlens_q = \[0, 1, 0\]"):
        validate_metadata(md, fb, kv.req_to_token, 4, num_real=1)


def test_validate_metadata_refuses_q_lens_the_mode_does_not_give():
    kv, fb, md = verify_md()
    md.cu_seqlens_q = i32([0, 3, 8])
    with raises("MD-002", r"TARGET_VERIFY: q lens \[3, 5\], the mode requires \[4, 4\]"):
        validate_metadata(md, fb, kv.req_to_token, 4)


@pytest.mark.parametrize("cuk", [[1, 10, 23], [0, 9, 21], [0, 8, 22]])
def test_validate_metadata_refuses_cu_seqlens_k_that_is_not_the_cumsum_of_k(cuk):
    kv, fb, md = verify_md()
    md.cu_seqlens_k = i32(cuk)
    with raises("MD-006", rf"cu_seqlens_k \[{cuk[0]}, {cuk[1]}, {cuk[2]}\] vs K \[9, 13\]"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_reads_the_frozen_max_seqlen_q_when_given():
    """PA-010: max q = 4.  4 is enough, 3 is not; a frozen value (graph replay) replaces the
    metadata's own."""
    kv, fb, md = verify_md()
    assert md.max_seq_len_q == 4
    validate_metadata(md, fb, kv.req_to_token, 4, max_seqlen_q=4)
    with raises("PA-010", r"q lens \[4, 4\], max_seqlen_q 3"):
        validate_metadata(md, fb, kv.req_to_token, 4, max_seqlen_q=3)
    md.max_seq_len_q = 3
    with raises("PA-010", r"q lens \[4, 4\], max_seqlen_q 3"):
        validate_metadata(md, fb, kv.req_to_token, 4)
    validate_metadata(md, fb, kv.req_to_token, 4, max_seqlen_q=4)


def test_validate_metadata_refuses_fewer_keys_than_query_tokens():
    kv, fb, md = verify_md()
    md.cache_seqlens_int32 = i32([3, 13])
    md.cu_seqlens_k = i32([0, 3, 16])
    with raises("MD-004", r"request 0: K=3 < q=4"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_refuses_a_page_table_too_narrow_for_k():
    """K = 13 at P = 4 needs 4 pages (the worked table is exactly that wide and passes)."""
    kv, fb, md = verify_md()
    md.page_table = md.page_table[:, :3].contiguous()
    with raises("PA-003", r"request 1: K=13 needs 4 pages, width 3"):
        validate_metadata(md, fb, kv.req_to_token, 4)


@pytest.mark.parametrize("b", [0, 1])
def test_validate_metadata_refuses_an_out_cache_loc_that_is_not_the_tail(b):
    kv, fb, md = verify_md()
    loc = fb.out_cache_loc.clone()
    loc[4 * b + 3] += 1
    want = [9, 10, 11, 12] if b == 0 else [25, 26, 27, 28]
    got = list(want)
    got[3] += 1
    with raises("MD-005", rf"request {b} \(K={9 + 4 * b}, q=4\): out_cache_loc \[{', '.join(map(str, got))}\] "
                rf"!= req_to_token\[{b + 1}, {5 + 4 * b}:{9 + 4 * b}\] \[{', '.join(map(str, want))}\]"):
        validate_metadata(md, fb.replace(out_cache_loc=loc), kv.req_to_token, 4)


def test_validate_metadata_refuses_the_one_request_of_a_batch_of_1():
    kv, fb = decode((5,))
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    with raises("MD-005", r"request 0 \(K=5, q=1\)"):
        validate_metadata(md, fb.replace(out_cache_loc=fb.out_cache_loc + 1), kv.req_to_token, 4)


def test_validate_metadata_checks_only_the_real_rows():
    kv, fb, md = verify_md()
    loc = fb.out_cache_loc.clone()
    loc[7] += 1  # request 1's last row
    validate_metadata(md, fb.replace(out_cache_loc=loc), kv.req_to_token, 4, num_real=1)
    with raises("MD-005", "request 1"):
        validate_metadata(md, fb.replace(out_cache_loc=loc), kv.req_to_token, 4)


@pytest.mark.parametrize("slot", [0, 3])
def test_validate_metadata_refuses_a_key_in_page_0(slot):
    """Request 0's position 1 moved to slot 0 or 3 (page 0, P = 4); slot 4, page 1, is where
    request 0 starts and passes (the worked batch)."""
    kv, fb, md = verify_md()
    assert kv.req_to_token[1, 0] == 4
    kv.req_to_token[1, 1] = slot
    with raises("PA-008", r"request 0 \(row 1, K=9\): position\(s\) \[1\] map to the reserved page 0"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_refuses_a_slot_at_the_wrong_page_offset():
    """Position 1 of request 0 held in slot 7 (offset 3 of page 1, not 1): PA-001."""
    kv, fb, md = verify_md()
    kv.req_to_token[1, 1] = 7
    with raises("PA-001", r"request 0 position 1: page_table gives slot 5, req_to_token\[1\] holds 7 \(P=4\)"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_refuses_a_page_table_naming_the_wrong_page():
    """Request 1's second table column says page 3, req_to_token holds page 5 (slots 20 .. 23)."""
    kv, fb, md = verify_md()
    md.page_table[1, 1] = 3
    with raises("PA-002", r"request 1 position 4: page_table gives slot 12, req_to_token\[2\] holds 20 \(P=4\)"):
        validate_metadata(md, fb, kv.req_to_token, 4)


def test_validate_metadata_refuses_a_repeated_row_or_slot():
    """Rows 1 and 2 made to hold the same pages: with rows [1, 1] the rows repeat, with rows
    [1, 2] every per-request rule holds and the two requests write the same slots."""
    kv, fb, md = verify_md()
    kv.req_to_token[2] = kv.req_to_token[1]
    md.page_table[1] = md.page_table[0]
    md.cache_seqlens_int32 = i32([9, 9])
    md.cu_seqlens_k = i32([0, 9, 18])
    fb = fb.replace(out_cache_loc=torch.cat([fb.out_cache_loc[:4]] * 2), seq_lens=i32([5, 5]),
                    seq_lens_cpu=torch.tensor([5, 5]))
    with raises("MD-012", r"out_cache_loc \[9, 10, 11, 12, 9, 10, 11, 12\] writes a slot twice"):
        validate_metadata(md, fb, kv.req_to_token, 4)
    # the repeated row itself is refused once, before metadata is built (validate_batch; issue 22 dropped
    # validate_metadata's second copy of that check)
    with raises("MD-012", r"req_pool_indices \[1, 1\] repeat a row"):
        validate_batch(fb.replace(req_pool_indices=torch.tensor([1, 1])), kv.req_to_token)


def test_validate_metadata_names_the_real_rows_of_cu_seqlens_k():
    """With one real request of two the message shows cu_seqlens_k[:2] and K of that request."""
    kv, fb, md = verify_md()
    md.cu_seqlens_k = i32([0, 8, 22])
    with raises("MD-006", r"cu_seqlens_k \[0, 8\] vs K \[9\] \["):
        validate_metadata(md, fb, kv.req_to_token, 4, num_real=1)


def test_validate_metadata_accepts_as_many_keys_as_query_tokens():
    """A prefill with no prefix: K = q (MD-004 asks K >= q)."""
    kv, rows = cache((3, 6))
    fb = B.extend_batch(kv, rows, [0, 0], [3, 6])
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    assert md.cache_seqlens_int32.tolist() == [3, 6] and md.cu_seqlens_q.tolist() == [0, 3, 9]
    validate_metadata(md, fb, kv.req_to_token, 4)
