"""Adversarial inputs at refspec's public entry points: a clear error, never silent garbage.

Project rule: bad input gets an :class:`~refspec.core.invariants.InvariantError` naming the violated
rule, or a ``ValueError`` naming the bad argument -- never a bare ``IndexError`` / ``RuntimeError``
from deep inside torch, an ``AttributeError`` on ``None``, a hang, a leaked page, or a result
computed from nonsense.  Each test below is one input that, before the review of this file, did
one of those things (what it did is in the test's docstring).  Expected values (the raised ID,
the free-page count, the tokens of a positive case) are hand-derived or come from the oracle.

Sizes are tiny: every test runs in milliseconds except the ``generate`` ones (a 2-layer model).
"""

from __future__ import annotations

import functools

import pytest
import torch

from refspec.core import batch as B
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.kernel import flash_attn_with_kvcache
from refspec.graphs.capture import EmulatedGraph
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, KVPool, PagedAllocator
from refspec.core.layer import AttentionLayer
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.core.modes import ForwardMode as M
from refspec.oracle.attention import attention_by_slot
from refspec.oracle.backend import OracleBackend
from refspec.oracle.loop import greedy, speculative_greedy
from refspec.harness.scenario import Scenario
from refspec.speculative.api import generate
from refspec.model.drafts import make_draft
from refspec.speculative.engine import Engine


def raises(inv_id: str):
    """``pytest.raises`` for an InvariantError carrying exactly ``inv_id``."""
    return pytest.raises(InvariantError, match=rf"^\[{inv_id}\]")


def value_error(word: str):
    """A plain ValueError (not an InvariantError) whose message names ``word``."""
    return pytest.raises(ValueError, match=word)


def cache(P=4, width=16, pages=8, rows=4) -> KVCache:
    """A fresh cache, unshuffled: with P = 4 the first request gets pages 1, 2, ... (slots 4g..4g+3)."""
    return KVCache(max_reqs=rows, max_context=width, num_pages=pages, page_size=P)


def one_request(n=8, **kw) -> tuple[KVCache, int]:
    kv = cache(**kw)
    r = kv.alloc_req()
    kv.alloc_extend([r], [0], [n])
    return kv, r


# ================================================================ sizes
@pytest.mark.parametrize("make", [
    lambda: PagedAllocator(8, 0),
    lambda: KVCache(4, 16, 8, 0),
    lambda: KVPool(1, 8, 0, 2, 8),
], ids=["allocator", "kvcache", "pool"])
def test_page_size_zero_is_refused(make):
    """Before: constructed silently, then ZeroDivisionError / empty tensors on first use."""
    with value_error("page_size"):
        make()


def test_kvcache_without_a_usable_row_is_refused():
    """max_reqs = 1 leaves only the reserved row 0; before: constructed, failed at alloc_req."""
    with value_error("max_reqs"):
        KVCache(max_reqs=1, max_context=16, num_pages=8, page_size=4)


def test_alloc_pages_negative_count_is_refused():
    """Before: ``alloc_pages(-2)`` returned [] as if it had allocated."""
    alloc = PagedAllocator(8, 4)
    with value_error("alloc_pages"):
        alloc.alloc_pages(-2)
    assert alloc.num_free_pages == 7


# ================================================================ alloc_extend
@pytest.mark.spec("KV-003")
def test_alloc_extend_past_the_row_width_takes_nothing():
    """seq_len 40 on a 16-column row.  Before: 10 pages were taken, then torch raised a shape
    RuntimeError while writing ``req_to_token``: 10 pages leaked for good."""
    kv = cache(pages=100)
    r = kv.alloc_req()
    with raises("KV-003"):
        kv.alloc_extend([r], [0], [40])
    assert kv.allocator.num_free_pages == 99
    assert int(kv.req_to_token[r].abs().sum()) == 0


@pytest.mark.spec("PA-008")
def test_alloc_extend_into_the_dummy_row_0_is_refused():
    """Before: row 0 (all-zero by contract, read by every padded graph row) got slots 4..7."""
    kv = cache()
    with raises("PA-008"):
        kv.alloc_extend([0], [0], [4])
    assert kv.allocator.num_free_pages == 7 and int(kv.req_to_token[0].abs().sum()) == 0


@pytest.mark.spec("KV-003")
def test_alloc_extend_on_a_row_never_allocated_is_refused():
    """Before: a row that ``alloc_req`` never handed out (so the next ``alloc_req`` gives it to
    another request) silently got pages."""
    kv = cache()
    with raises("KV-003"):
        kv.alloc_extend([2], [0], [4])


@pytest.mark.parametrize("rows,prefix,seq,word", [
    ([9], [0], [4], "req_pool_index"),  # before: IndexError from torch
    ([1, 1], [0, 0], [4, 4], "repeat"),  # before: the 2nd overwrote the 1st, one page leaked
    ([1], [0, 0], [4, 4], "lengths"),  # before: zip silently dropped the extra entries
    ([1], [5], [3], "prefix_len <= seq_len"),  # before: a silent no-op
    ([1], [0], [-3], "prefix_len <= seq_len"),
], ids=["row-out-of-range", "repeated-row", "length-mismatch", "seq-below-prefix", "negative-seq"])
def test_alloc_extend_bad_arguments(rows, prefix, seq, word):
    kv = cache()
    kv.alloc_req()
    with value_error(word):
        kv.alloc_extend(rows, prefix, seq)
    assert kv.allocator.num_free_pages == 7  # all or nothing


# ================================================================ freeing
@pytest.mark.spec("KV-003")
def test_freeing_a_request_row_twice_is_refused():
    """``free_req(r, 0)`` twice.  Before: row r went onto the free list twice, so two later
    requests were handed the same ``req_to_token`` row."""
    kv = cache()
    r = kv.alloc_req()
    kv.free_req(r, 0)
    with raises("KV-003"):
        kv.free_req(r, 0)
    assert kv.alloc_req() != kv.alloc_req()


@pytest.mark.spec("KV-003")
def test_freeing_a_request_with_pages_twice_is_refused():
    kv, r = one_request(5)
    kv.free_req(r, 5)
    assert kv.allocator.num_free_pages == 7
    with raises("KV-003"):
        kv.free_req(r, 5)
    assert kv.allocator.num_free_pages == 7


@pytest.mark.spec("PA-008")
def test_freeing_the_dummy_row_0_is_refused():
    """Before: row 0 joined the free list and a later ``alloc_req`` handed it to a request."""
    kv = cache()
    with raises("PA-008"):
        kv.free_req(0, 0)
    assert 0 not in [kv.alloc_req() for _ in range(3)]


@pytest.mark.parametrize("call,word", [
    (lambda kv, r: kv.free_req(r, 20), "alloc_len"),  # before: IndexError
    (lambda kv, r: kv.free_tail(r, -3, 8), "keep_len"),  # before: freed every page of the row
    (lambda kv, r: kv.free_tail(r, 2, 30), "alloc_len"),  # before: IndexError
    (lambda kv, r: kv.check_page_contiguous(r, 40), "length"),  # before: IndexError
], ids=["free_req-past-width", "free_tail-negative-keep", "free_tail-past-width", "check-past-width"])
def test_lengths_outside_the_row_are_refused(call, word):
    kv, r = one_request(8)
    with value_error(word):
        call(kv, r)
    assert kv.allocator.num_free_pages == 5  # nothing was freed


# ================================================================ the pool
def test_pool_layer_out_of_range_is_refused():
    """Before: a bare ``IndexError: list index out of range``."""
    pool = KVPool(1, 4, 4, 2, 8)
    with value_error("layer_id"):
        pool.get_kv_buffer(3)


@pytest.mark.spec("PA-011")
@pytest.mark.parametrize("shape", [(1, 2, 8), (3, 1, 8), (3, 2, 4)], ids=["one-row", "one-head", "head-dim"])
def test_store_with_the_wrong_kv_shape_is_refused(shape):
    """k / v of shape ``shape`` stored at 3 slots of a ``[Hkv = 2, D = 8]`` pool.  Before: the
    one-row and one-head cases broadcast silently (every slot / head got the same K)."""
    pool = KVPool(1, 4, 4, 2, 8)
    kv = torch.ones(shape)
    with raises("PA-011"):
        pool.set_kv_buffer(0, torch.tensor([4, 5, 6]), kv, kv)
    assert int(pool.get_flat_kv(0)[0].abs().sum()) == 0


# ================================================================ batch builders
@pytest.mark.spec("MD-004")
def test_decode_with_seq_len_zero_is_refused():
    """DECODE L = 0 (L counts the new token).  Before: position -1, so ``out_cache_loc`` was
    ``req_to_token[r, -1]``, the row's *last* column; the oracle silently returned zeros."""
    kv, r = one_request(5)
    with raises("MD-004"):
        B.decode_batch(kv, [r], [0])


@pytest.mark.spec("MD-004")
def test_draft_extend_with_more_tokens_than_the_sequence_is_refused():
    """v1 L' = 6 with a = 9: the packed tokens would start at position -3 (before: silently
    ``out_cache_loc`` [0, 0, 0, 4, ...] and ``positions`` [-3, -2, -1, 0, ...])."""
    kv, r = one_request(8)
    with raises("MD-004"):
        B.draft_extend_batch(kv, [r], [6], [9])


@pytest.mark.spec("MD-009")
@pytest.mark.parametrize("a", [0, 5])
def test_draft_extend_accept_count_outside_1_to_N_is_refused(a):
    """a = n + 1 lies in [1, N = 4].  Before: a = 0 built a request with no query row (its
    "last row" is then another request's), a = 5 ran 5 packed rows."""
    kv, r = one_request(8)
    with raises("MD-009"):
        B.draft_extend_batch(kv, [r], [8], [a], num_draft_tokens=4)


@pytest.mark.spec("MD-012")
def test_a_batch_repeating_a_row_is_refused_by_the_builder():
    """DECODE rows [r, r], L = [5, 5].  Before: both requests stored their K at slot 8 and each
    attended to whichever came last (both wings, no error)."""
    kv, r = one_request(8)
    with raises("MD-012"):
        B.decode_batch(kv, [r, r], [5, 5])


@pytest.mark.spec("PA-008")
def test_a_batch_on_the_dummy_row_0_is_refused_by_the_builder():
    """Before: built; the FA3 validator caught it, the oracle silently attended to page 0."""
    kv, _ = one_request(8)
    with raises("PA-008"):
        B.verify_batch(kv, [0], [3], 4)


@pytest.mark.parametrize("build,word", [
    (lambda kv, r: B.decode_batch(kv, [r], [30]), "width"),  # before: IndexError
    (lambda kv, r: B.decode_batch(kv, [r, 2], [5]), "entries"),  # before: zip dropped row 2
    (lambda kv, r: B.draft_extend_batch(kv, [r], [8], []), "num_accept_tokens"),  # before: 0 rows
    (lambda kv, r: B.decode_batch(kv, [9], [5]), "req_pool_index"),  # before: IndexError
    (lambda kv, r: B.extend_batch(kv, [r], [0], [-1]), "extend_lens"),  # before: RuntimeError
    (lambda kv, r: B.extend_batch(kv, [r], [0], [0]), "extend_lens"),  # before: an empty request
    (lambda kv, r: B.verify_batch(kv, [r], [4], 0), "num_draft_tokens"),  # before: empty batch
    (lambda kv, r: B.draft_extend_v2_batch(kv, [r], [8], 0), "num_draft_tokens"),
    (lambda kv, r: B.draft_decode_batch(kv, [r], [5], -3), "step"),  # before: ran at position 2
    (lambda kv, r: B.draft_decode_steps_batch(kv, [r], [4], 0), "num_steps"),  # before: empty
    (lambda kv, r: B.draft_decode_steps_batch(kv, [r], [15], 4), "width"),  # before: IndexError
    (lambda kv, r: B.draft_step_view(B.draft_decode_steps_batch(kv, [r], [4], 3), 5, 3), "step"),
], ids=["decode-past-width", "length-mismatch", "accepts-short", "row-out-of-range", "extend-negative", "extend-empty",
        "verify-N0", "v2-N0", "draft-step-negative", "steps-zero", "steps-past-width", "step-view-oob"])
def test_builder_bad_arguments(build, word):
    kv, r = one_request(8)
    with value_error(word):
        build(kv, r)


# ================================================================ the kernel emulator
def kernel_args(**over):
    """One request: T = 3 rows, K = 3 keys in page 1 of a [4, 4, Hkv = 2, D = 8] pool, H = 4."""
    g = torch.Generator().manual_seed(0)
    a = dict(q=torch.randn(3, 4, 8, generator=g), k_cache=torch.randn(4, 4, 2, 8, generator=g),
             v_cache=torch.randn(4, 4, 2, 8, generator=g), cache_seqlens=torch.tensor([3], dtype=torch.int32),
             page_table=torch.tensor([[1, 1]], dtype=torch.int32),
             cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32), max_seqlen_q=3)
    a.update(over)
    return a


def run_kernel(provider="emulator", **over):
    a = kernel_args(**over)
    return flash_attn_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), provider=provider, **a)


@pytest.mark.spec("PA-011")
@pytest.mark.parametrize("over", [
    dict(q=torch.randn(3, 32)),  # before: "not enough values to unpack"
    dict(k_cache=torch.randn(16, 2, 8)),
    dict(v_cache=torch.randn(4, 2, 2, 8)),  # V on other pages than K (V's head dim may differ: ML-006's pairs)
    dict(v_cache=torch.randn(4, 4, 1, 8)),  # before: V broadcast over the KV heads, silently
    dict(v_cache=torch.randn(4, 4, 2, 8).to(torch.bfloat16)),  # before: silently upcast
    dict(q=torch.randn(3, 4, 8).to(torch.bfloat16)),  # real FA3 refuses mixed dtypes
    dict(q=torch.ones(3, 4, 8, dtype=torch.long)),  # before: an integer "attention" output
    dict(cache_seqlens=torch.tensor([-3], dtype=torch.int32)),  # before: silently all zeros
    dict(cache_seqlens=torch.tensor([[3]], dtype=torch.int32)),  # before: TypeError
], ids=["q-2d", "k-3d", "v-pages", "v-heads", "v-dtype", "q-dtype", "q-int", "K-negative", "K-2d"])
def test_emulator_refuses_malformed_arguments(over):
    with raises("PA-011"):
        run_kernel(**over)


# ================================================================ the oracle's attention
def oracle_args(**over):
    kf = torch.randn(16, 2, 8)
    R = torch.zeros(4, 16, dtype=torch.int32)
    R[1, :4] = torch.arange(4, 8, dtype=torch.int32)
    a = dict(q=torch.randn(3, 4, 8), k_flat=kf, v_flat=kf, req_to_token=R, req_pool_indices=[1],
             cache_seqlens=[4], cu_seqlens_q=[0, 3])
    a.update(over)
    return a


@pytest.mark.spec("PA-011")
@pytest.mark.parametrize("over", [
    dict(q=torch.randn(3, 3, 8)),  # H = 3 with Hkv = 2; before: an einsum RuntimeError
    dict(q=torch.randn(3, 4, 16)),  # D mismatch
    dict(cache_seqlens=[40]),  # K past the row; before: a shape RuntimeError
    dict(cache_seqlens=[-4]),  # before: "upper bound and lower bound inconsistent"
    dict(cu_seqlens_q=[0]),  # before: IndexError
    dict(cu_seqlens_q=[0, 5]),  # past T = 3
    dict(req_pool_indices=[7]),  # before: IndexError
], ids=["gqa", "head-dim", "K-past-width", "K-negative", "cu-short", "cu-past-T", "row-out-of-range"])
def test_oracle_attention_refuses_malformed_arguments(over):
    with raises("PA-011"):
        attention_by_slot(**oracle_args(**over))


# ================================================================ backends
@functools.lru_cache(maxsize=None)
def decode_scenario():
    return Scenario(M.DECODE, page_size=4, lens=[5, 9]).build()  # H = 8, Hkv = 2, D = 64, T = 2


def backends(b):
    return {"fa3": lambda: b.fa3_backend(), "oracle": lambda: OracleBackend(b.pool, b.kv)}


@pytest.mark.parametrize("wing", ["fa3", "oracle"])
def test_forward_before_metadata_names_the_missing_call(wing):
    """Before: ``AttributeError: 'NoneType' object has no attribute ...``."""
    b = decode_scenario()
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backends(b)[wing]().forward(b.q, b.k, b.v, b.layer, b.fb)


@pytest.mark.parametrize("wing", ["fa3", "oracle"])
@pytest.mark.parametrize("what", ["k-one-row", "k-one-head", "q-heads", "layer-id"])
def test_forward_with_mismatched_shapes_is_refused(wing, what):
    """Before: k of 1 row / 1 head was broadcast into both requests' slots, q with 6 heads ran a
    6-head attention under an 8-head layer (all silently), a bad layer id was an IndexError."""
    b = decode_scenario()
    be = backends(b)[wing]()
    be.init_forward_metadata(b.fb)
    q, k, v, layer = b.q, b.k, b.v, b.layer
    if what == "k-one-row":
        k, v, ctx = k[:1], v[:1], raises("PA-011")
    elif what == "k-one-head":
        k, v, ctx = k[:, :1], v[:, :1], raises("PA-011")
    elif what == "q-heads":
        q, ctx = q[:, :6], raises("PA-011")
    else:
        layer, ctx = AttentionLayer(3, 8, 2, 64), value_error("layer_id")
    with ctx:
        be.forward(q, k, v, layer, b.fb)


@pytest.mark.spec("MD-012")
@pytest.mark.parametrize("wing", ["fa3", "oracle"])
def test_a_hand_made_batch_repeating_a_row_is_refused(wing):
    """Two requests on row r with L = 5, both writing slot ``req_to_token[r, 4]``: every
    per-request check (INV-TAIL, the page table) passes, so only MD-012 sees it."""
    b = Scenario(M.DECODE, page_size=4, lens=[5, 5]).build()
    r = int(b.fb.req_pool_indices[0])
    fb = b.fb.replace(req_pool_indices=torch.tensor([r, r]), out_cache_loc=b.fb.out_cache_loc[:1].repeat(2))
    with raises("MD-012"):
        backends(b)[wing]().init_forward_metadata(fb)


@pytest.mark.spec("MD-006")
def test_a_stale_cpu_mirror_of_seq_lens_is_refused():
    """seq_lens_cpu [5, 12] for device seq_lens [5, 9].  Before: max_seqlen_k and the page-table
    width came from the stale mirror and nothing noticed."""
    b = decode_scenario()
    with raises("MD-006"):
        b.fa3_backend().init_forward_metadata(b.fb.replace(seq_lens_cpu=torch.tensor([5, 12])))


@pytest.mark.parametrize("over,word", [
    (dict(req_pool_indices=torch.tensor([1])), "seq_lens has 2 entries"),  # before: 1 row checked
    (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), "seq_lens has 1 entries"),  # IndexError
    (dict(req_pool_indices=torch.tensor([1, 9])), "outside req_to_token"),  # before: IndexError
], ids=["rows-short", "seq_lens-short", "row-out-of-range"])
def test_a_hand_made_batch_with_inconsistent_fields_is_refused(over, word):
    b = decode_scenario()
    with value_error(word):
        b.fa3_backend().init_forward_metadata(b.fb.replace(**over))


# ================================================================ graphs
@functools.lru_cache(maxsize=None)
def verify_runner():
    b = Scenario(M.TARGET_VERIFY, page_size=4, lens=[5, 9], num_draft_tokens=4).build()
    return b, b.graph_runner(capture_bs=(1, 2))


@pytest.mark.spec("CG-007")
@pytest.mark.parametrize("what", ["other-mode", "empty", "too-large"])
def test_replay_refuses_batches_the_graphs_cannot_take(what):
    """Regression guards (these already raised CG-007): the mode must be the captured one, and
    0 < B <= the largest captured size."""
    b, runner = verify_runner()
    fb = {"other-mode": b.fb.replace(forward_mode=M.DECODE),
          "empty": B.idle_batch(b.kv).replace(forward_mode=M.TARGET_VERIFY),
          "too-large": b.fb.replace(req_pool_indices=torch.tensor([1, 2, 3]), seq_lens=torch.tensor(
              [5, 9, 5], dtype=torch.int32), seq_lens_cpu=torch.tensor([5, 9, 5]))}[what]
    with raises("CG-007"):
        runner.replay(fb, dict(q=b.q, k=b.k, v=b.v))


@pytest.mark.parametrize("inputs,word", [
    (None, "inputs"),  # before: TypeError 'NoneType' object is not subscriptable
    ("q-only", "inputs"),  # before: KeyError 'k'
    ("half", "shape"),  # before: a RuntimeError in the buffer copy
], ids=["none", "missing-key", "wrong-T"])
def test_replay_refuses_inputs_unlike_the_capture(inputs, word):
    b, runner = verify_runner()
    x = {None: None, "q-only": dict(q=b.q), "half": dict(q=b.q[:4], k=b.k[:4], v=b.v[:4])}[inputs]
    with value_error(word):
        runner.replay(b.fb, x)


def test_replay_refuses_another_number_of_draft_tokens():
    """A verify batch with N = 3 into a graph captured for N = 4.  Before: an MD-005 message about
    out_cache_loc, which does not say that N is the problem."""
    b, runner = verify_runner()
    fb = B.verify_batch(b.kv, b.fb.req_pool_indices.tolist(), [5, 9], 3)
    with value_error("num_draft_tokens"):
        runner.replay(fb, dict(q=b.q[:6], k=b.k[:6], v=b.v[:6]))


@pytest.mark.spec("CG-006")
def test_replay_refuses_a_draft_extend_longer_than_the_captured_rows():
    """v1 graph captured with W = N = 4 rows per request, live a = [6, 6] (N = 6).  Before: the
    12 tokens overflowed the 8-token input buffer: a bare RuntimeError from ``copy_``."""
    small = Scenario(M.DRAFT_EXTEND, page_size=4, lens=[5, 9], num_draft_tokens=4, num_accept_tokens=[2, 4]).build()
    runner = small.graph_runner(capture_bs=(2,))
    big = Scenario(M.DRAFT_EXTEND, page_size=4, lens=[5, 9], num_draft_tokens=6, num_accept_tokens=[6, 6]).build()
    with raises("CG-006"):
        runner.replay(big.fb, dict(q=big.q, k=big.k, v=big.v))


@pytest.mark.parametrize("capture_bs", [(), (0, 2), (-1, 2)], ids=["empty", "zero", "negative"])
def test_runner_refuses_bad_capture_sizes(capture_bs):
    """Before: IndexError (empty), a ``max()`` RuntimeError (0), a ``zeros`` RuntimeError (< 0)."""
    b, _ = verify_runner()
    with value_error("capture_bs"):
        b.graph_runner(capture_bs=capture_bs)


def test_replay_hooks_before_capture_are_refused():
    """Before: ``TypeError: 'NoneType' object is not callable`` / AttributeError on None."""
    with pytest.raises(RuntimeError, match="before capture"):
        EmulatedGraph().replay()
    b = decode_scenario()
    with value_error("captured"):
        FlashAttentionBackend(b.pool, b.kv).init_forward_metadata_replay_cuda_graph(2, b.fb, num_real=2)


# ================================================================ scenario
@pytest.mark.parametrize("kw,word", [
    (dict(mode=M.EXTEND, lens=[3]), "extend_lens"),  # before: TypeError on None
    (dict(mode=M.EXTEND, lens=[3, 4], extend_lens=[2]), "extend_lens"),  # before: dropped request 1
    (dict(mode=M.DRAFT_EXTEND, lens=[3]), "num_accept_tokens"),
    (dict(mode=M.DECODE, lens=[3], page_size=0), "page_size"),  # before: ZeroDivisionError
], ids=["no-extend-lens", "short-extend-lens", "no-accepts", "page-size-0"])
def test_scenario_bad_arguments(kw, word):
    kw = {"page_size": 4, **kw}
    with value_error(word):
        Scenario(**kw)


SCENARIO_REFUSALS = {  # id -> (Scenario kwargs past mode TARGET_VERIFY / P = 4 / lens [5, 9], the whole message)
    # before: RuntimeError "max(): Expected reduction dim" on the empty [0, H, D] output
    "no-requests": (dict(lens=[]), "lens must list at least one request for mode TARGET_VERIFY, got [] "
                    "(an empty batch is mode=ForwardMode.IDLE)"),
    "idle-with-requests": (dict(mode=M.IDLE), "mode IDLE is the empty batch: lens must be [], got [5, 9]"),
    # before: torch's "Expected one of cpu, cuda, ipu, ..." from torch.device
    "device-gpu": (dict(device="gpu"), "device 'gpu': choose cpu or cuda"),
    "device-none": (dict(device=None), "device=None: choose cpu or cuda"),
    # before: einsum RuntimeError (oracle) / PA-011 without the rule (FA3)
    "gqa": (dict(num_heads=3, num_kv_heads=2), "num_heads = 3 must be a multiple of num_kv_heads = 2 "
            "(GQA: each KV head serves num_heads / num_kv_heads query heads)"),
    "verify-N-1": (dict(num_draft_tokens=1), "num_draft_tokens N = 1: TARGET_VERIFY needs N = Sd + 1 >= 2 "
                   "(the root and at least one draft token per request, SD-010)"),
    # before: a silently ignored field
    "draft-step-on-verify": (dict(draft_step=1), "draft_step is not used by mode TARGET_VERIFY (only by DECODE "
                             "(draft decode step s)), got 1; leave it None"),
    "extend-lens-on-verify": (dict(extend_lens=[2, 2]), "extend_lens is not used by mode TARGET_VERIFY (only by "
                              "EXTEND), got [2, 2]; leave it None"),
    "v2-accept-past-N": (dict(mode=M.DRAFT_EXTEND_V2, num_accept_tokens=[2, 9]),
                         "num_accept_tokens [2, 9]: each a = n + 1 must lie in [1, N = 4] (num_draft_tokens)"),
    "decode-len-0": (dict(mode=M.DECODE, lens=[0, 3]), "DECODE lens include the new token, so every entry must be "
                     ">= 1, got [0, 3]"),
    # before: TypeError from torch.full
    "dtype-string": (dict(dtype="bfloat16"), "dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
                     "got 'bfloat16' (a string: pass torch.bfloat16)"),
    "dtype-int": (dict(dtype=torch.int32), "dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
                  "got torch.int32"),
    "seed-string": (dict(seed="a"), "seed must be an int in [0, 2**63), got 'a'"),  # before: RuntimeError
    "window-below-minus-1": (dict(window_left=-3), "window_left (-1: no window) must be an int >= -1, got -3"),
    "softcap-negative": (dict(softcap=-1.0), "softcap must be a finite number >= 0 (0 disables it), got -1.0"),
    "extra-pages-negative": (dict(extra_pages=-5), "extra_pages must be an int >= 0, got -5"),
    "poison-none": (dict(poison=None), "poison must be True or False, got None"),
}


@pytest.mark.parametrize("kw,message", list(SCENARIO_REFUSALS.values()), ids=list(SCENARIO_REFUSALS))
def test_scenario_refuses_at_construction(kw, message):
    with pytest.raises(ValueError) as e:
        Scenario(**{"mode": M.TARGET_VERIFY, "page_size": 4, "lens": [5, 9], **kw})
    assert str(e.value) == message
    assert not isinstance(e.value, InvariantError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CPU-only torch")
def test_scenario_cuda_without_cuda_says_what_the_cli_says():
    """Before: "Cannot get CUDA generator without ATen_cuda library" from build(); now the CLI's words."""
    from refspec.cli._args import device_problem

    cli = f"no CUDA device here (torch {torch.__version__}); use cpu"
    assert device_problem("cuda") == cli
    with pytest.raises(ValueError) as e:
        Scenario(M.TARGET_VERIFY, page_size=4, lens=[5], device="cuda")
    assert str(e.value) == f"device='cuda': {cli}"


def test_scenario_idle_is_the_empty_batch():
    """IDLE (SGLang's data-parallel filler) builds with lens=[]: both eager wings give [0, H, D];
    graphs refuse it by name."""
    b = Scenario(M.IDLE, page_size=4, lens=[]).build()
    assert b.fb.batch_size == 0 and b.K == [] and b.q_lens == []
    assert tuple(b.run_oracle().shape) == (0, 8, 64) and tuple(b.run_fa3().shape) == (0, 8, 64)
    with value_error("mode IDLE .* is not captured in a graph"):
        b.run_fa3_graph()


@pytest.mark.spec("PA-011")
def test_emulator_gqa_refusal_states_the_rule():
    """Before: ``[PA-011] ... q (3, 3, 8) vs k_cache (4, 4, 2, 8)`` without saying which rule."""
    with raises("PA-011") as e:
        run_kernel(q=torch.randn(3, 3, 8))
    assert "num_heads must be a multiple of num_kv_heads (H = 3, Hkv = 2; GQA)" in str(e.value)
    assert "head_dim must match (D = 8, 8)" in str(e.value)
    with raises("PA-011") as e:  # before: ZeroDivisionError inside the check
        run_kernel(k_cache=torch.randn(4, 4, 0, 8), v_cache=torch.randn(4, 4, 0, 8))
    assert "(H = 4, Hkv = 0; GQA)" in str(e.value)


@pytest.mark.spec("PA-011")
def test_the_oracle_by_position_refuses_bad_query_offsets_by_rule():
    """Before: a bare IndexError (a short cu_seqlens_q) or silently wrong rows (offsets past T)."""
    from refspec.oracle.attention import attention_by_position
    r2t = torch.arange(8, dtype=torch.int32)[None, :].repeat(2, 1)
    q, kv = torch.randn(3, 4, 8), torch.randn(8, 2, 8)
    for cu in ([0, 3], [0, 2, 4], [1, 2, 3], [0, 2, 1]):
        with raises("PA-011") as e:
            attention_by_position(q, kv, kv, r2t, [0, 1], cu, [0, 1, 0])
        assert "cu_seqlens_q" in str(e.value) and "B + 1 = 3" in str(e.value)
    out = attention_by_position(q, kv, kv, r2t, [0, 1], [0, 2, 3], [0, 1, 0])  # well formed: runs
    assert out.shape == (3, 4, 8)


@pytest.mark.spec("PA-011")
def test_the_oracle_refuses_heads_that_are_not_gqa_by_rule():
    """Before: a raw einsum RuntimeError (H = 3, Hkv = 2) or a ZeroDivisionError (Hkv = 0) from
    ``OracleBackend.forward``'s gather; now PA-011 from the oracle's own check."""
    from refspec.oracle.attention import attention_by_position
    r2t = torch.arange(8, dtype=torch.int32)[None, :]
    for H, Hkv in ((3, 2), (4, 0)):
        with raises("PA-011") as e:
            attention_by_position(torch.randn(2, H, 8), torch.randn(8, Hkv, 8), torch.randn(8, Hkv, 8), r2t, [0],
                                  [0, 2], [0, 1])
        assert "H is not a multiple of Hkv" in str(e.value)
        with raises("PA-011") as e:  # (q, k_flat, v_flat, req_to_token, req_pool_indices, cache_seqlens, cu_seqlens_q)
            attention_by_slot(torch.randn(2, H, 8), torch.randn(8, Hkv, 8), torch.randn(8, Hkv, 8), r2t, [0], [2],
                              [0, 2])
        assert "H is not a multiple of Hkv" in str(e.value)


# ================================================================ generate / the engine
@functools.lru_cache(maxsize=None)
def tiny() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0)  # vocab 128


@pytest.mark.parametrize("backend", ["oracle", "fa3", "paged-oracle"])
@pytest.mark.parametrize("prompts,kw,word", [
    ([], {}, "prompts"),  # before: "max() arg is an empty sequence" (fa3), [] (oracle)
    ([[]], {}, "prompts"),  # before: a torch max() RuntimeError (oracle)
    ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),  # before: the oracle emitted 1 token
    ([[1, 2]], dict(num_steps=0), "num_steps"),  # before: a shape RuntimeError (oracle)
    ([[1, 200]], {}, "vocab"),  # before: IndexError from the embedding
    ([[1, -2]], {}, "vocab"),
    ([[1, 2]], dict(page_size=0), "page_size"),  # before: ZeroDivisionError; ignored by the oracle
    ([[1, 2], [3]], dict(arrivals=[0]), "arrivals"),  # before: IndexError; ignored by the oracle
], ids=["no-prompts", "empty-prompt", "budget-0", "steps-0", "token-past-vocab", "token-negative",
        "page-0", "arrivals-short"])
def test_generate_bad_arguments(backend, prompts, kw, word):
    kw = {"max_new_tokens": 3, **kw}
    with value_error(word):
        generate(tiny(), prompts, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["fa3", "paged-oracle"])
def test_generate_max_batch_zero_is_refused(backend):
    """Before: ``max_batch=0`` was read as "no limit" (and ``Engine(max_batch=0)`` failed with
    "need at least 2 pages"; a 0-slot engine would otherwise never admit a request)."""
    with value_error("max_batch"):
        generate(tiny(), [[1, 2]], backend=backend, max_batch=0, max_new_tokens=3)


@pytest.mark.parametrize("call", [
    lambda m, d: greedy(m, [1, 2], 0),  # before: 1 token for a budget of 0
    lambda m, d: greedy(m, [], 3),  # before: a torch max() RuntimeError
    lambda m, d: speculative_greedy(m, d, [1, 2], num_steps=2, max_new_tokens=0),
    lambda m, d: speculative_greedy(m, d, [1, 2], num_steps=0, max_new_tokens=3),
], ids=["greedy-budget-0", "greedy-empty", "spec-budget-0", "spec-steps-0"])
def test_oracle_loop_bad_arguments(call):
    m = tiny()
    with value_error("max_new_tokens|num_steps"):
        call(m, make_draft("eagle", m))


def test_engine_refuses_a_request_longer_than_its_context():
    """prompt 6 + budget 10 > max_context 8.  Before: a torch shape RuntimeError deep in
    ``alloc_extend`` once the row ran out (and pages leaked); now refused at ``add_request``."""
    m = tiny()
    eng = Engine(m, make_draft("eagle", m), max_context=8, max_batch=1)
    with value_error("max_context"):
        eng.add_request(0, list(range(6)), 10)
    eng.add_request(0, list(range(6)), 2)
    with value_error("already in use"):
        eng.add_request(0, [1, 2], 2)  # before: two requests with one id, results keyed by id


@pytest.mark.spec("KV-006", "SD-002")
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("P", [3, 5, 7])
def test_generate_with_odd_page_sizes_is_lossless_and_frees_every_page(P, version):
    """Page sizes that divide nothing (3, 5, 7), graphs on, a request that finishes early:
    tokens equal the dense oracle loop and the free-page count returns to its start."""
    m, prompts = tiny(), [[1, 2, 3, 4, 5], [7, 8]]
    ref = generate(m, prompts, backend="oracle", version=version, max_new_tokens=[9, 4])
    res = generate(m, prompts, backend="fa3", version=version, page_size=P, graphs=True, capture_bs=(1, 2),
                   max_new_tokens=[9, 4])
    assert res.tokens == ref.tokens
    assert res.free_pages[0] == res.free_pages[1]


@pytest.mark.spec("KV-006")
@pytest.mark.parametrize("backend", ["oracle", "fa3"])
def test_eos_as_the_first_token_finishes_after_one_token(backend):
    """EOS = the prompt's first greedy token: the request emits exactly that token, finishes at
    prefill (no verify round) and, on the paged path, gives every page back."""
    m, prompt = tiny(), [1, 2, 3]
    eos = greedy(m, prompt, 1).tokens[0]
    res = generate(m, [prompt], backend=backend, page_size=4, eos=eos, max_new_tokens=8)
    assert res.tokens == [[eos]] and res.requests[0].finish_reason == "eos"
    assert res.requests[0].accepts == []
    if backend == "fa3":
        assert res.free_pages[0] == res.free_pages[1]


@pytest.mark.spec("PA-011")
def test_emulator_refuses_a_strided_last_dimension():
    """q viewed as ``[..., ::2]`` (last-dim stride 2): real FA3 refuses it; before, the emulator
    computed a result, so a CPU run passed where the GPU run would fail."""
    with raises("PA-011"):
        run_kernel(q=torch.randn(3, 4, 16)[..., ::2])


def test_unknown_kernel_provider_is_named(monkeypatch):
    """Before: ``KeyError: 'bogus'`` (argument and ``REFSPEC_FA3_PROVIDER`` alike)."""
    with value_error("provider 'bogus'"):
        run_kernel(provider="bogus")
    monkeypatch.setenv("REFSPEC_FA3_PROVIDER", "bogus")
    with value_error("provider 'bogus'"):
        run_kernel(provider=None)


# ================================================================ issue 16: bad input that was not named
@pytest.mark.spec("PA-011")
@pytest.mark.parametrize("over", [dict(cache_seqlens=3), dict(page_table=[[1, 1]]), dict(cu_seqlens_q=(0, 3)),
                                  dict(max_seqlen_q=3.0), dict(max_seqlen_q=True)],
                         ids=["K-int", "table-list", "cu-tuple", "max-q-float", "max-q-bool"])
def test_emulator_refuses_python_numbers_for_tensor_arguments(over):
    """Before: ``AttributeError: 'int' object has no attribute 'dim'``; the real kernel (and the
    docs) refuse anything but tensors, so the emulator names PA-011 and the argument."""
    name = next(iter(over))
    with pytest.raises(InvariantError, match=rf"^\[PA-011\].*{name}"):
        run_kernel(**over)


def test_free_tail_keeping_more_than_was_allocated_is_refused():
    """Before: silently nothing (keep_len 10 > alloc_len 8 freed no page and said nothing)."""
    kv, r = one_request(8)
    free = kv.allocator.num_free_pages
    with value_error("keep_len 10 > alloc_len 8"):
        kv.free_tail(r, keep_len=10, alloc_len=8)
    assert kv.allocator.num_free_pages == free


@pytest.mark.parametrize("P", [0, -4, True, 2.0])
def test_strided_page_table_needs_a_page_size(P):
    """Before: page_size 0 failed with "slice step cannot be zero"."""
    from refspec.fa3.metadata import strided_page_table

    kv, r = one_request(8)
    with value_error("page_size must be an int >= 1"):
        strided_page_table(kv.req_to_token, torch.tensor([r]), 8, P)


@pytest.mark.parametrize("field", ["page_size", "num_draft_tokens", "num_heads", "num_kv_heads", "head_dim"])
def test_scenario_bools_are_not_sizes(field):
    """Before: ``Scenario(page_size=True)`` was accepted as P = 1."""
    with value_error(f"{field} must be an int >= 1, got True"):
        Scenario(M.TARGET_VERIFY, **{"page_size": 4, "lens": [5], field: True})


@pytest.mark.spec("PA-008")
def test_decode_over_unreserved_positions_names_the_missing_reservation():
    """A decode batch at L = 9 on a request that reserved only 5 positions: positions 5..8 still
    read slot 0 of the dummy page.  Before, validation reported the symptom (PA-001, the row is
    not page-contiguous); the cause is the missing reservation (PA-008)."""
    kv, r = one_request(5)
    pool = KVPool(1, 8, 4, 2, 8)
    fb = B.decode_batch(kv, [r], [9])
    with pytest.raises(InvariantError, match=r"^\[PA-008\].*position\(s\) \[5, 6, 7, 8\].*no slot was reserved"):
        FlashAttentionBackend(pool, kv).init_forward_metadata(fb)


def test_cuda_graphs_with_the_emulator_are_refused_with_the_reason(monkeypatch):
    """A CUDA graph capture cannot run the emulator (it checks its metadata on the host): a graphed
    backend on a CUDA device whose provider is the emulator is refused up front, naming why no
    real kernel was chosen, instead of failing inside torch's capture.  CPU graphs (the emulated
    ones) and real providers pass."""
    from refspec.fa3 import kernel

    kernel.check_graphable(torch.device("cpu"), "emulator")  # the emulated graphs: fine
    kernel.check_graphable(torch.device("cuda"), "fa3")  # a real kernel: nothing to check here
    monkeypatch.setattr(kernel, "hopper_reason", lambda device=None: "GPU is sm_80, FA3 needs Hopper (sm_90)")
    with pytest.raises(ValueError, match="need a real FA3 kernel.*sm_80"):
        kernel.check_graphable(torch.device("cuda"), "emulator")
    monkeypatch.setattr(kernel, "hopper_reason", lambda device=None: None)
    monkeypatch.setattr(kernel, "_real_kernel", lambda name: f"`import {name}` failed: ImportError")
    with pytest.raises(ValueError, match="import fa3` failed"):
        kernel.check_graphable(torch.device("cuda"), "emulator")
    monkeypatch.setenv("REFSPEC_FA3_PROVIDER", "emulator")
    with pytest.raises(ValueError, match="REFSPEC_FA3_PROVIDER=emulator"):
        kernel.check_graphable(torch.device("cuda"), "emulator")
