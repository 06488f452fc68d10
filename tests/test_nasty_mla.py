"""Adversarial inputs at the MLA entry points (issue 40): a named error, never a bare one or garbage.

The MLA twin of ``test_nasty_inputs.py``: each test is one input that, before this file, raised a
bare ``IndexError`` / ``RuntimeError`` / ``AttributeError`` / ``ZeroDivisionError`` / an einsum
error from deep inside torch, or was accepted silently (what it did is in the docstring).  Now it
raises an :class:`~refspec.core.invariants.InvariantError` naming the rule it breaks, or a
``ValueError`` naming the argument.  Positive controls show the valid call next to each refusal
still runs (and, where it matters, gives the oracle's answer).

Sizes are tiny (the harness's TINY_DIMS: R = 256, Dr = 16); the whole file runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVPool, MLAKVPool
from refspec.core.mla import (
    DEEPSEEK_V3_DIMS,
    DEEPSEEK_V3_ROPE_SCALING,
    MLADims,
    absorb_q,
    expand_latent,
    latent_to_v,
    mla_attention_layers,
    mla_softmax_scale,
    split_kv_b_proj,
    yarn_get_mscale,
)
from refspec.core.modes import ForwardMode as M
from refspec.fa3 import kernel
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.emulator import emulate_flash_attn_varlen_func, emulate_flash_attn_with_kvcache
from refspec.harness.mla_scenario import MLAScenario
from refspec.model.deepseek import DeepseekConfig, DeepseekModel
from refspec.oracle.backend import OracleBackend


def raises(inv_id: str, match: str = ""):
    """``pytest.raises`` for an InvariantError carrying exactly ``inv_id`` (and ``match`` after it)."""
    return pytest.raises(InvariantError, match=rf"^\[{inv_id}\].*{match}")


@contextlib.contextmanager
def value_error(word: str):
    """A plain ValueError (not an InvariantError) whose message names ``word``."""
    with pytest.raises(ValueError, match=word) as info:
        yield info
    assert not isinstance(info.value, InvariantError), str(info.value)


# ================================================================ dims, scale, layers, weights
@pytest.mark.parametrize("rope_scaling,word", [
    ({"type": "yarn", "factor": 0, "mscale_all_dim": 1}, r"factor'\] must be > 0"),
    ({"type": "yarn", "factor": -40, "mscale_all_dim": 1}, r"factor'\] must be > 0"),
    ({"type": "yarn", "factor": float("nan")}, r"factor'\] must be a finite number"),
    ({"type": "yarn", "factor": "40"}, r"factor'\] must be a finite number"),
    ({"type": "yarn", "factor": None}, r"factor'\] must be a finite number"),
    ({"type": "yarn", "factor": 40, "mscale_all_dim": "x"}, r"mscale_all_dim'\] must be a finite number"),
    ([("factor", 40)], "rope_scaling must be None or a dict"),
    ("yarn", "rope_scaling must be None or a dict"),
], ids=["factor-0", "factor-negative", "factor-nan", "factor-str", "factor-None", "mscale-str", "list", "str"])
def test_mla_softmax_scale_refuses_a_malformed_rope_scaling(rope_scaling, word):
    """Before: factor <= 0 passed silently as "no YaRN" (upstream's yarn_get_mscale returns 1 for
    any factor <= 1: a broken config read as a valid one); a str / None factor raised a bare
    TypeError ('<=' not supported), a list / str rope_scaling an AttributeError ('.get')."""
    with value_error(word):
        mla_softmax_scale(DEEPSEEK_V3_DIMS, rope_scaling)


def test_mla_softmax_scale_positive_controls():
    """The valid configs keep their numbers: DeepSeek-V3's 0.1352, no scaling 192^-0.5, a missing
    factor is upstream's 1.0 (mscale 1), a factor in (0, 1] gives mscale 1 as upstream."""
    assert mla_softmax_scale(DEEPSEEK_V3_DIMS, DEEPSEEK_V3_ROPE_SCALING) == pytest.approx(0.1352, abs=5e-5)
    assert mla_softmax_scale(DEEPSEEK_V3_DIMS) == 192 ** -0.5
    with pytest.warns(UserWarning, match="missing 'factor', defaulting to 1.0"):  # upstream warns too
        assert mla_softmax_scale(DEEPSEEK_V3_DIMS, {"type": "yarn", "mscale_all_dim": 1}) == 192 ** -0.5
    assert mla_softmax_scale(DEEPSEEK_V3_DIMS, {"type": "yarn", "factor": 0.5, "mscale_all_dim": 1}) == 192 ** -0.5


@pytest.mark.parametrize("scale,mscale", [(float("nan"), 1.0), (float("inf"), 1.0), ("40", 1.0), (40, None)])
def test_yarn_get_mscale_refuses_what_is_no_finite_number(scale, mscale):
    """Before: nan / inf came back as the temperature (nan / inf softmax scales), a str raised a bare
    TypeError."""
    with value_error("scale must be a finite number"):
        yarn_get_mscale(scale, mscale)
    assert yarn_get_mscale(40, 1) == pytest.approx(1.3689, abs=5e-5)  # the valid call


def test_mla_softmax_scale_names_dims_that_are_not_mla_dims():
    """Before: AttributeError ('tuple' object has no attribute 'qk_head_dim')."""
    with value_error("dims must be an MLADims"):
        mla_softmax_scale((512, 64, 128, 128))


@pytest.mark.parametrize("kw,word", [
    (dict(num_heads=0), "num_heads"), (dict(num_heads=-1), "num_heads"), (dict(layer_id=-1), "layer_id"),
    (dict(dims=(512, 64, 128, 128)), "dims must be an MLADims"),
])
def test_mla_attention_layers_refuse_bad_sizes(kw, word):
    """Before: layers of 0 or -1 heads / a negative layer id were built silently (failing later,
    elsewhere); a tuple for dims raised AttributeError."""
    args = dict(layer_id=0, num_heads=4, dims=DEEPSEEK_V3_DIMS, scaling=0.1352) | kw
    with value_error(word):
        mla_attention_layers(**args)


@pytest.mark.spec("ML-007")
@pytest.mark.parametrize("scaling", [None, float("nan"), float("inf"), 0.0, -0.1, "0.1"])
def test_mla_attention_layers_refuse_a_scale_that_is_not_mla_s(scaling):
    """Before: the layers were built with it; a NaN scale made every output NaN, a None one fell
    back to FA3's qv default (D + Dv)^-0.5 = 576^-0.5 (the ML-007 bug) only caught at the forward."""
    with raises("ML-007", "scaling" if scaling is not None else "no scaling"):
        mla_attention_layers(0, 4, DEEPSEEK_V3_DIMS, scaling)
    absorbed, mha = mla_attention_layers(0, 4, DEEPSEEK_V3_DIMS, 0.1352)
    assert (absorbed.head_dim, absorbed.v_head_dim, mha.head_dim, mha.v_head_dim) == (576, 512, 192, 128)


W = torch.randn(4 * (128 + 128), 512, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("call,word", [
    (lambda: split_kv_b_proj(W, 0, 128), "num_heads"),  # before: ZeroDivisionError
    (lambda: split_kv_b_proj(W, 4, 0), "qk_nope_head_dim"),  # before: split into an empty W_UK, silently
    (lambda: split_kv_b_proj(W, 4, -3), "qk_nope_head_dim"),  # before: w_kc of 125 rows, silently
    (lambda: split_kv_b_proj(W[0], 4, 128), "kv_b_proj.weight must have 2"),  # before: 'not enough values to unpack'
    (lambda: split_kv_b_proj(W.long(), 4, 128), "kv_b_proj.weight must be a floating"),
    (lambda: split_kv_b_proj([[1.0]], 1, 1), "kv_b_proj.weight must be a torch.Tensor"),  # before: AttributeError
], ids=["H-0", "Dn-0", "Dn-negative", "1-D", "int", "list"])
def test_split_kv_b_proj_refuses_bad_arguments(call, word):
    with value_error(word):
        call()


@functools.lru_cache(maxsize=None)
def weights():
    return split_kv_b_proj(W, 4, 128)  # w_kc [4, 128, 512], w_vc [4, 512, 128]


@pytest.mark.parametrize("call,word", [
    (lambda w_kc, w_vc: absorb_q(torch.randn(3, 2, 128), w_kc), r"q_nope \(3, 2, 128\) must be \[T, H = 4"),
    (lambda w_kc, w_vc: absorb_q(torch.randn(3, 4, 64), w_kc), r"Dn = 128"),
    (lambda w_kc, w_vc: absorb_q(torch.randn(3, 128), w_kc), "q_nope must have 3"),
    (lambda w_kc, w_vc: absorb_q(torch.ones(3, 4, 128, dtype=torch.long), w_kc), "q_nope must be a floating"),
    (lambda w_kc, w_vc: latent_to_v(torch.randn(3, 4, 256), w_vc), r"o \(3, 4, 256\) must be \[T, H = 4, R = 512"),
    (lambda w_kc, w_vc: latent_to_v(torch.randn(3, 4, 512), w_kc), r"R = 128"),  # w_kc passed as w_vc
    (lambda w_kc, w_vc: expand_latent(torch.randn(5, 256), torch.randn(5, 64), w_kc, w_vc), r"c \(5, 256\)"),
    (lambda w_kc, w_vc: expand_latent(torch.randn(5, 512), torch.randn(4, 64), w_kc, w_vc), r"k_pe \(4, 64\)"),
    (lambda w_kc, w_vc: expand_latent(torch.randn(5, 512), torch.randn(5, 1, 64), w_kc, w_vc), "k_pe must have 2"),
    (lambda w_kc, w_vc: expand_latent(torch.randn(5, 512), torch.randn(5, 64), w_vc, w_kc), "other order"),
], ids=["absorb-H", "absorb-Dn", "absorb-2d", "absorb-int", "to-v-R", "to-v-swapped", "expand-c",
        "expand-k_pe-rows", "expand-k_pe-3d", "expand-swapped"])
def test_weight_helpers_name_the_mismatched_argument(call, word):
    """Before: einsum's 'subscript h has size 4 ... does not broadcast', torch.cat's 'Sizes of
    tensors must match' or expand's 'the number of sizes provided'; an integer q_nope was absorbed
    into a truncated integer product, silently."""
    with value_error(word):
        call(*weights())
    w_kc, w_vc = weights()  # the valid calls
    assert absorb_q(torch.randn(3, 4, 128), w_kc).shape == (3, 4, 512)
    assert [t.shape for t in expand_latent(torch.randn(5, 512), torch.randn(5, 64), w_kc, w_vc)] == [(5, 4, 192),
                                                                                                     (5, 4, 128)]


# ================================================================ the MLA pool
def pool(**kw) -> MLAKVPool:
    return MLAKVPool(**(dict(num_layers=2, num_pages=4, page_size=4, kv_lora_rank=8, qk_rope_head_dim=4) | kw))


LOC, K_NOPE, K_ROPE = torch.tensor([5, 6]), torch.ones(2, 1, 8), torch.full((2, 1, 4), 2.0)


@pytest.mark.spec("ML-002")
@pytest.mark.parametrize("loc", [[5, 16], [5, 100]], ids=["first-past", "far-past"])
def test_store_at_a_slot_past_the_pool_names_loc(loc):
    """Before: IndexError 'index 16 is out of bounds for dimension 0 with size 16'.  Nothing is written."""
    p = pool()
    before = p.get_key_buffer(0).clone()
    with value_error(r"loc holds a slot outside the pool's \[0, 16\)"):
        p.set_mla_kv_buffer(0, torch.tensor(loc), K_NOPE, K_ROPE)
    assert torch.equal(p.get_key_buffer(0), before)


@pytest.mark.parametrize("call,word", [
    (lambda p: p.get_mla_kv_buffer(0, torch.tensor([100])), "loc holds a slot outside"),  # before: IndexError
    (lambda p: p.get_mla_kv_buffer(0, [1, 2]), "loc must be a torch.Tensor"),  # before: AttributeError '.long'
    (lambda p: p.get_mla_kv_buffer(0, torch.tensor([1.7])), "loc must be an integer"),  # before: read slot 1
    (lambda p: p.get_mla_kv_buffer(0, torch.tensor([[1, 2]])), "loc must have 1"),  # before: [1, 2, 1, 8] rows
    (lambda p: p.move_kv_cache(torch.tensor([100]), torch.tensor([6])), "slot outside"),  # before: IndexError
    (lambda p: p.move_kv_cache(torch.tensor([5]), torch.tensor([6, 7])), "must name as many"),  # before: RuntimeError
    (lambda p: p.move_kv_cache(torch.tensor([5, 7]), torch.tensor([6])), "must name as many"),  # before: broadcast
    (lambda p: p.move_kv_cache(torch.tensor([5.0]), torch.tensor([6.0])), "tgt must be an integer"),  # IndexError
    (lambda p: p.move_kv_cache(torch.tensor([True]), torch.tensor([False])), "tgt must be an integer"),
    (lambda p: p.set_mla_kv_buffer(0, LOC, torch.ones(2, 1, 8, dtype=torch.long), K_ROPE), "k_nope must be a floating"),
    (lambda p: p.set_mla_kv_buffer(0, LOC.to("meta"), K_NOPE, K_ROPE), "loc is on meta"),  # before: RuntimeError
    (lambda p: p.set_mla_kv_buffer(0, LOC, K_NOPE.to("meta"), K_ROPE), "k_nope is on meta"),
], ids=["get-past", "get-list", "get-float", "get-2d", "move-past", "move-src-longer", "move-tgt-longer",
        "move-float", "move-bool", "store-int-rows", "store-loc-meta", "store-k-meta"])
def test_pool_methods_name_the_bad_argument(call, word):
    """(What each did before is on its line.)  ``move-tgt-longer`` broadcast one source row over two
    targets silently; ``store-int-rows`` cast integer rows into the pool silently."""
    p = pool()
    with value_error(word):
        call(p)
    p.move_kv_cache(torch.tensor([5]), torch.tensor([6]))  # the valid calls
    p.set_mla_kv_buffer(0, LOC, K_NOPE, K_ROPE)
    assert torch.equal(p.get_mla_kv_buffer(0, LOC)[1], K_ROPE)


def test_a_pool_of_integer_rows_is_refused():
    """Before: MLAKVPool(dtype=torch.int32) was built, and every store truncated the latent rows."""
    with value_error("dtype must be a floating"):
        pool(dtype=torch.int32)


# ================================================================ the backends' MLA forward
@functools.lru_cache(maxsize=None)
def verify():
    return MLAScenario(M.TARGET_VERIFY, page_size=4, lens=[5, 9], num_draft_tokens=4, poison=False).build()


def backend(wing: str, pool_=None):
    b = verify()
    be = (FlashAttentionBackend(pool_ or b.pool, b.kv, provider="emulator") if wing == "fa3"
          else OracleBackend(pool_ or b.pool, b.kv))
    be.init_forward_metadata(b.fb)
    return be


def forward(wing: str, layer=None, **over):
    b = verify()
    x = dict(q=b.q, q_rope=b.q_rope, k=b.k, k_rope=b.k_rope) | over
    return backend(wing).forward(x["q"], x["k"], x["k"], layer or b.layer, b.fb, q_rope=x["q_rope"],
                                 k_rope=x["k_rope"])


@pytest.mark.spec("ML-005")
@pytest.mark.parametrize("wing", ["fa3", "oracle"])
@pytest.mark.parametrize("over", ["q-int", "q-bf16", "q_rope-bf16"])
def test_absorbed_call_refuses_a_q_and_q_rope_of_other_dtypes(wing, over):
    """Before: the oracle ran an integer q (cast) and a bf16 q next to an fp32 q_rope silently, while
    the FA3 wing refused the same call with the kernel's qv-dtype message: the two wings disagreed.
    Both now refuse it by ML-005 (the kernel's qv and q share one floating dtype)."""
    b = verify()
    q, q_rope = b.q, b.q_rope
    q = {"q-int": q.long(), "q-bf16": q.bfloat16()}.get(over, q)
    q_rope = q_rope.bfloat16() if over == "q_rope-bf16" else q_rope
    with raises("ML-005", "one floating dtype"):
        forward(wing, q=q, q_rope=q_rope)


@pytest.mark.spec("ML-007")
@pytest.mark.parametrize("wing", ["fa3", "oracle"])
@pytest.mark.parametrize("scaling", [float("nan"), -0.25, 0.0])
def test_absorbed_call_refuses_a_layer_scale_that_is_no_finite_positive_number(wing, scaling):
    """Before: a NaN scale gave NaN outputs in both wings, a negative one a softmax that prefers the
    least similar keys, silently."""
    with raises("ML-007", f"scaling {scaling!r}"):
        forward(wing, layer=dataclasses.replace(verify().layer, scaling=scaling))


@pytest.mark.parametrize("wing", ["fa3", "oracle"])
def test_absorbed_call_refuses_a_sliding_window_it_would_ignore(wing):
    """Before: both wings attended every key of a layer with ``sliding_window_size = 3``, silently
    (neither passes a window on the MLA path; SGLang passes ``window_size`` to its qv call)."""
    with value_error("sliding_window_size=3"):
        forward(wing, layer=dataclasses.replace(verify().layer, sliding_window_size=3))


@pytest.mark.parametrize("wing", ["fa3", "oracle"])
@pytest.mark.parametrize("over,word", [
    (dict(q=[[1.0]]), r"q \(the absorbed q_nope\) must be a torch.Tensor"),  # before: AttributeError '.dim'
    (dict(q_rope=[[1.0]]), "q_rope must be a torch.Tensor"),  # before: AttributeError '.shape'
    (dict(q_rope="meta"), "q_rope is on meta"),  # before: RuntimeError deep in the oracle / emulator
    (dict(q="meta"), "q is on meta"),
])
def test_absorbed_call_names_an_operand_that_is_no_tensor_or_on_another_device(wing, over, word):
    b = verify()
    over = {k: (getattr(b, k).to("meta") if v == "meta" else v) for k, v in over.items()}
    with value_error(word):
        forward(wing, **over)


@pytest.mark.spec("ML-005", "ML-002")
@pytest.mark.parametrize("wing", ["fa3", "oracle"])
def test_absorbed_call_positive_control_the_wings_agree(wing):
    """The valid call still runs in both wings and gives the oracle's answer (T1 on fp32: 1e-4)."""
    ref = forward("oracle")
    out = forward(wing)
    assert out.shape == (8, 4, 256) and torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("wing", ["fa3", "oracle"])
def test_a_pool_paged_otherwise_than_the_cache_is_refused(wing):
    """Before, an MLA pool of page size 8 over a cache of page size 4: the FA3 wing read the pool's
    P = 8 pages through the cache's P = 4 page table and returned wrong rows silently (max error
    4.4 against the oracle); a P = 2 pool raised PA-003 for a table that was right."""
    b = verify()
    for P in (8, 2):
        with value_error(rf"the pool's page_size {P} is not the cache's 4"):
            backend(wing, MLAKVPool(1, b.pool.num_pages * 4 // P, P, 256, 16))
    with value_error("the pool's page_size 8 is not the cache's 4"):  # the MHA pool too
        backend(wing, KVPool(1, b.pool.num_pages, 8, 1, 8))


@pytest.mark.spec("ML-010", "ML-007", "PA-011")
@pytest.mark.parametrize("wing", ["fa3", "oracle"])
def test_mha_pass_refuses_what_it_would_compute_wrongly(wing):
    """The non-absorbed prefill (ML-010): before, a NaN scale and a sliding window ran silently, a
    q of another dtype than k / v was cast by the oracle (the FA3 emulator refused it by PA-011:
    both wings now do, before the call)."""
    b = MLAScenario(M.EXTEND, 4, [5, 9], extend_lens=[5, 9], poison=False).build()
    q, k, v, fb = b.mha_pass_inputs()
    be = b.fa3_backend() if wing == "fa3" else OracleBackend(b.pool, b.kv)
    be.init_forward_metadata(b.fb)
    L = b.mha_layer
    with raises("ML-007"):
        be.forward(q, k, v, dataclasses.replace(L, scaling=float("nan")), fb)
    with value_error("sliding_window_size"):
        be.forward(q, k, v, dataclasses.replace(L, sliding_window_size=2), fb)
    with raises("PA-011", "one floating dtype"):
        be.forward(q.double(), k, v, L, fb)
    assert be.forward(q, k, v, L, fb).shape == (14, 4, 16)  # the valid call


@pytest.mark.spec("ML-009")
def test_the_path_choice_refuses_extend_lengths_that_do_not_fit_the_batch():
    """Before, on a prefix-free EXTEND of seq_lens [5, 9]: extend_seq_lens_cpu [6, 8] summed the
    prefixes (-1) + 1 to 0 and chose MHA_ONE_SHOT for a batch whose second request has a prefix; a
    list of one entry (zip) looked at the first request only; ``fb=None`` raised AttributeError."""
    from refspec.core.mla import AttnForwardMethod, mla_forward_method

    fb = MLAScenario(M.EXTEND, 4, [0, 0], extend_lens=[5, 9]).build().fb
    assert mla_forward_method(fb) is AttnForwardMethod.MHA_ONE_SHOT  # the valid batch
    with value_error(r"extend_seq_lens_cpu \[6, 8\] exceeds seq_lens \[5, 9\]"):
        mla_forward_method(fb.replace(extend_seq_lens_cpu=[6, 8]))
    with value_error("extend_seq_lens_cpu has 1 entries, expected 2"):
        mla_forward_method(fb.replace(extend_seq_lens_cpu=[5]))
    with value_error("takes a ForwardBatch"):
        mla_forward_method(None)


# ================================================================ the kernel entry points
def test_varlen_emulator_refuses_empty_offsets_and_a_non_int_max_seqlen_k():
    """Before: ``cu_seqlens_q = cu_seqlens_k = []`` raised IndexError (list index out of range);
    ``max_seqlen_k = True`` / ``3.0`` were refused as PA-010 with the query bound's title although
    the value's type was the fault."""
    q, k, v = torch.randn(4, 2, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 16)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    kw = dict(cu_seqlens_q=i32([0, 2, 4]), cu_seqlens_k=i32([0, 2, 5]), max_seqlen_q=2, max_seqlen_k=3, causal=True)
    with raises("PA-011", r"\[B \+ 1\]"):
        emulate_flash_attn_varlen_func(q[:0], k, v, **(kw | dict(cu_seqlens_q=i32([]), cu_seqlens_k=i32([]))))
    for bad in (True, 3.0):
        with raises("PA-011", "max_seqlen_k must be a Python int"):
            emulate_flash_attn_varlen_func(q, k, v, **(kw | dict(max_seqlen_k=bad)))
    with raises("PA-010", "max_seqlen_k = 2"):  # a real bound that is too small stays PA-010
        emulate_flash_attn_varlen_func(q, k, v, **(kw | dict(max_seqlen_k=2)))
    with raises("PA-011", "one device"):
        emulate_flash_attn_varlen_func(q, k.to("meta"), v, **kw)
    assert emulate_flash_attn_varlen_func(q, k, v, **kw).shape == (4, 2, 16)


@pytest.mark.spec("ML-005")
def test_qv_call_names_a_qv_on_another_device():
    """Before: RuntimeError 'index_copy(): self, index and source expected to be in the same device'."""
    T, H = 3, 2
    q, qv = torch.randn(T, H, 16), torch.randn(T, H, 256)
    kc, vc = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 1, 256)
    md = dict(cache_seqlens=torch.tensor([3], dtype=torch.int32), page_table=torch.tensor([[1, 2]], dtype=torch.int32),
              cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32), max_seqlen_q=3)
    with raises("PA-011", "one device"):
        emulate_flash_attn_with_kvcache(q, kc, vc, qv=qv.to("meta"), **md)
    assert emulate_flash_attn_with_kvcache(q, kc, vc, qv=qv, **md).shape == (T, H, 256)


def test_an_unknown_provider_is_named_not_reported_as_a_build_without_mla():
    """Before: a typo (``provider="fa-3"``) raised ML-013 'provider 'fa-3' exposes no FA3 build
    configuration': a rule violation where the name was the fault."""
    b = verify()
    with value_error("unknown FA3 provider 'fa-3'"):
        FlashAttentionBackend(b.pool, b.kv, provider="fa-3")
    with value_error("unknown FA3 provider"):
        kernel.mla_kernel_problem("fa-3")
    with value_error("unknown FA3 provider"):
        kernel.require_mla_kernel(None)
    assert kernel.mla_kernel_problem("emulator") is None


@pytest.mark.parametrize("call", [
    lambda: kernel.flash_attn_with_kvcache([1.0], None, None, cache_seqlens=None, page_table=None, cu_seqlens_q=None,
                                           max_seqlen_q=1),
    lambda: kernel.flash_attn_varlen_func([1.0], None, None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=1,
                                          max_seqlen_k=1),
], ids=["kvcache", "varlen"])
def test_kernel_entry_points_name_a_q_that_is_no_tensor(call):
    """Before: AttributeError ('list' object has no attribute 'device') while picking a provider."""
    with raises("PA-011", "q must be a torch.Tensor"):
        call()


# ================================================================ the DeepSeek config
@pytest.mark.parametrize("kw,word", [
    (dict(rope_scaling={"type": "yarn", "factor": 0}), r"factor'\] must be > 0"),  # before: NaN RoPE
    (dict(rope_scaling={"type": "yarn", "factor": -2}), r"factor'\] must be > 0"),  # before: silent
    (dict(rope_scaling={"type": "yarn", "factor": "4"}), r"factor'\] must be a finite"),  # before: TypeError
    (dict(rope_scaling={"type": "yarn", "factor": 4, "beta_fast": 0}), r"beta_fast'\] must be > 0"),  # ZeroDivision
    (dict(rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}),
     r"original_max_position_embeddings'\] must be > 0"),  # before: 'math domain error' at the first forward
    (dict(rope_scaling={"type": "linear", "factor": 2}), "rope_scaling type 'linear'"),  # before: at the forward
    (dict(rope_scaling="yarn"), "rope_scaling must be None or a dict"),  # before: AttributeError at the forward
    (dict(rope_theta=0), "rope_theta must be > 1"),  # before: NaN cos / sin, silently
    (dict(rope_theta=1.0, rope_scaling={"type": "yarn", "factor": 4}), "rope_theta must be > 1"),  # ZeroDivision
    (dict(rope_interleave="no"), "rope_interleave must be a bool"),  # before: a truthy str meant interleaved
], ids=["factor-0", "factor-negative", "factor-str", "beta-0", "window-0", "linear", "str", "theta-0", "theta-1",
        "interleave-str"])
def test_deepseek_config_refuses_a_rope_it_cannot_run_at_construction(kw, word):
    with value_error(word):
        DeepseekConfig(**kw)


def test_deepseek_config_positive_controls():
    """DeepSeek-V3's YaRN and no scaling still build, and the V3 dims config keeps its scale."""
    from refspec.model.deepseek import deepseek_v3_dims_config

    cfg = deepseek_v3_dims_config()
    m = DeepseekModel(DeepseekConfig(rope_scaling=dict(DEEPSEEK_V3_ROPE_SCALING)))
    cos, _ = m.rope(torch.arange(8))
    assert torch.isfinite(cos).all() and cfg.rope_scaling["factor"] == 40
    assert DeepseekConfig.from_dict({"hidden_size": 64}).hidden_size == 64
    with value_error("from_dict takes a dict"):  # before: AttributeError ('list' object has no attribute 'items')
        DeepseekConfig.from_dict([("hidden_size", 64)])


@pytest.mark.parametrize("rope_scaling", [[1], {"type": "yarn", "factor": "x"}], ids=["list", "factor-str"])
def test_mla_scenario_refuses_a_malformed_rope_scaling_at_construction(rope_scaling):
    """Before: an AttributeError ('list' object has no attribute 'get') or a TypeError at ``build()``."""
    with value_error("rope_scaling"):
        MLAScenario(M.TARGET_VERIFY, 4, [5, 9], rope_scaling=rope_scaling)


def test_mla_dims_accept_what_attention_alone_can_run():
    """MLADims describes attention only: an odd Dr is a valid row (the RoPE evenness is the model's,
    DeepseekConfig refuses it), a dim < 1 is not."""
    assert MLADims(256, 15, 16, 16).kv_cache_dim == 271
    with value_error("MLADims.qk_rope_head_dim"):
        MLADims(256, 0, 16, 16)
    with value_error("qk_rope_head_dim must be even"):
        DeepseekConfig(qk_rope_head_dim=15)
    assert math.isfinite(mla_softmax_scale(MLADims(256, 15, 16, 16)))
