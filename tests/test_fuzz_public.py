"""Random malformed arguments to every public entry point: a named error or a correct result.

For each entry point a valid call is set up, then hypothesis replaces one or two of its
arguments with junk (None, bools, negative / huge / fractional numbers, strings, lists of the
wrong length or with junk items, tensors of the wrong dtype / shape / rank).  The call must
either

* raise :class:`~refspec.core.invariants.InvariantError` (it names its rule by construction), or
  a ``ValueError`` whose message names the replaced argument (or carries an invariant ID), or
* succeed with a result that passes the entry point's own correctness check below (e.g. the
  emulator's output equals the oracle's when the junk happened to be a valid value).

Any other exception type (TypeError, IndexError, AttributeError, RuntimeError, ...) fails the
test: the user would see a message that does not say which argument or rule is wrong.
Entry points: generate, Scenario (+ build), KVCache / PagedAllocator / KVPool methods, the
batch builders, init_forward_metadata (both wings), the FA3 emulator, attention_by_slot,
GraphRunner.replay; MLA (issue 40): MLADims, the scale and layer helpers, the weight helpers,
the MLAKVPool methods and the absorbed ``forward(q, k, v, layer, fb, q_rope=, k_rope=)`` of both
wings.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refspec import InvariantError, Scenario, generate
from refspec.core import batch as B
from refspec.core import mla
from refspec.core.kv_cache import KVCache, KVPool, MLAKVPool, PagedAllocator
from refspec.core.modes import ForwardMode as M
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.emulator import emulate_flash_attn_with_kvcache
from refspec.harness.mla_scenario import MLAScenario
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.attention import attention_by_slot
from refspec.oracle.backend import OracleBackend

N_EXAMPLES = int(os.environ.get("REFSPEC_FUZZ_EXAMPLES", 40))  #: per test; raise it for a longer hunt
FAST = settings(max_examples=N_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ID = re.compile(r"\[(PA|KV|MD|CG|SD|ML|TOL)-\d{3}\]")

_SCALARS = [None, True, False, 0, -1, 1, 3, 7, 2 ** 40, 1.5, float("nan"), "4", b"x", object()]
_LISTS = [[], [None], [-1], [0], [1.5], ["a"], [[1]], [1, 2, 3, 4, 5, 6, 7], [True], [2 ** 40], (1,)]


def _tensors():
    return [torch.tensor(3), torch.tensor([1.5]), torch.zeros(0, dtype=torch.int32),
            torch.ones(2, 2, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int64), torch.tensor([2 ** 30], dtype=torch.int32),
            torch.randn(2, 3, 8), torch.randn(3, 4, 8).to(torch.float16), torch.tensor([True])]


JUNK = st.sampled_from(_SCALARS + _LISTS + _tensors())


def _aliases(name: str) -> set[str]:
    """Ways a message may name argument ``name`` (singular forms, SGLang's short names)."""
    out = {name, name.rstrip("s"), name.replace("_lens", "_len"), name.replace("indices", "index")}
    return out | {"K" if name == "cache_seqlens" else name, "seq_len" if name == "seq_lens" else name}


def named_or_correct(call, replaced: list[str], check=None):
    """Run ``call()``; the outcome must be a named error or a result that ``check`` accepts."""
    try:
        result = call()
    except InvariantError as e:
        assert ID.search(str(e)), str(e)
        return None
    except ValueError as e:
        msg = str(e)
        assert ID.search(msg) or any(a in msg for n in replaced for a in _aliases(n)), \
            f"ValueError naming none of {replaced}: {msg}"
        return None
    except Exception as e:  # noqa: BLE001 - exactly what this test forbids
        pytest.fail(f"{type(e).__name__} (not a named error) for junk in {replaced}: {e}")
    if check is not None:
        check(result)
    return result


def mutate(draw, args: dict, names: list[str]) -> tuple[dict, list[str]]:
    """``args`` with one or two of ``names`` replaced by junk."""
    picked = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
    out = dict(args)
    for n in picked:
        out[n] = draw(st.one_of(JUNK, st.lists(st.integers(-3, 40), max_size=4)))
    return out, picked


# ============================================================================ the KV cache
def cache() -> tuple[KVCache, int]:
    kv = KVCache(max_reqs=4, max_context=16, num_pages=8, page_size=4)
    r = kv.alloc_req()
    kv.alloc_extend([r], [0], [6])
    return kv, r


KV_CALLS = {
    "KVCache": (lambda kv_, r_, **a: KVCache(**a),
                dict(max_reqs=4, max_context=16, num_pages=8, page_size=4)),
    "PagedAllocator": (lambda kv_, r_, **a: PagedAllocator(**a), dict(num_pages=8, page_size=4)),
    "KVPool": (lambda kv_, r_, **a: KVPool(**a),
               dict(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)),
    "alloc_extend": (lambda kv_, r_, **a: kv_.alloc_extend(**a), dict(req_pool_indices=[1], prefix_lens=[6],
                                                                   seq_lens=[9])),
    "free_req": (lambda kv_, r_, **a: kv_.free_req(**a), dict(r=1, alloc_len=6)),
    "free_tail": (lambda kv_, r_, **a: kv_.free_tail(**a), dict(r=1, keep_len=5, alloc_len=6)),
    "check_page_contiguous": (lambda kv_, r_, **a: kv_.check_page_contiguous(**a), dict(r=1, length=6)),
    "row_pages": (lambda kv_, r_, **a: kv_.row_pages(**a), dict(r=1, length=6, start=0)),
    "alloc_pages": (lambda kv_, r_, **a: kv_.allocator.alloc_pages(**a), dict(n=1)),
    "free_pages": (lambda kv_, r_, **a: kv_.allocator.free_pages(**a), dict(pages=[1])),
    "set_kv_buffer": (lambda kv_, r_, **a: KVPool(1, 8, 4, 2, 8).set_kv_buffer(**a),
                      dict(layer_id=0, loc=torch.tensor([4, 5]), k=torch.randn(2, 2, 8), v=torch.randn(2, 2, 8))),
    "get_kv_buffer": (lambda kv_, r_, **a: KVPool(1, 8, 4, 2, 8).get_kv_buffer(**a), dict(layer_id=0)),
}


@FAST
@given(st.data(), st.sampled_from(sorted(KV_CALLS)))
def test_kv_cache_entry_points(data, which):
    fn, args = KV_CALLS[which]
    kv, r = cache()
    bad, names = mutate(data.draw, args, list(args))
    named_or_correct(lambda: fn(kv, r, **bad), names)


# ============================================================================ batch builders
BUILDERS = {
    "decode_batch": (B.decode_batch, dict(req_pool_indices=[1], seq_lens=[6])),
    "draft_decode_batch": (B.draft_decode_batch, dict(req_pool_indices=[1], seq_lens=[4], step=1)),
    "extend_batch": (B.extend_batch, dict(req_pool_indices=[1], prefix_lens=[2], extend_lens=[4])),
    "verify_batch": (B.verify_batch, dict(req_pool_indices=[1], seq_lens=[2], num_draft_tokens=4)),
    "draft_extend_batch": (B.draft_extend_batch, dict(req_pool_indices=[1], seq_lens=[6], num_accept_tokens=[2],
                                                      num_draft_tokens=4)),
    "draft_extend_v2_batch": (B.draft_extend_v2_batch, dict(req_pool_indices=[1], seq_lens=[6], num_draft_tokens=4,
                                                            num_accept_tokens=[2])),
    "draft_decode_steps_batch": (B.draft_decode_steps_batch, dict(req_pool_indices=[1], seq_lens=[3], num_steps=3)),
}


def _batch_ok(fb):
    """A built batch is self-consistent: one q_b per request, T = sum q_b, int index fields."""
    B.check_batch_shapes(fb)
    assert fb.out_cache_loc.dtype == torch.int64 and fb.positions.dtype == torch.int64


@FAST
@given(st.data(), st.sampled_from(sorted(BUILDERS)))
def test_batch_builders(data, which):
    fn, args = BUILDERS[which]
    kv, _ = cache()
    bad, names = mutate(data.draw, args, list(args))
    named_or_correct(lambda: fn(kv, **bad), names, _batch_ok)


# ============================================================================ metadata, attention
@functools.lru_cache(maxsize=None)
def built(mode=M.TARGET_VERIFY):
    return Scenario(mode, page_size=4, lens=[5, 9], num_draft_tokens=4, num_heads=4, num_kv_heads=2,
                    head_dim=16).build()


FB_FIELDS = ["req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions", "num_draft_tokens"]


@FAST
@given(st.data(), st.sampled_from(["fa3", "oracle"]))
def test_init_forward_metadata(data, wing):
    b = built()
    bad, names = mutate(data.draw, {}, FB_FIELDS)
    be = b.fa3_backend() if wing == "fa3" else OracleBackend(b.pool, b.kv)
    named_or_correct(lambda: be.init_forward_metadata(b.fb.replace(**bad)), names)


def _kernel_args():
    b = built()
    md = FlashAttentionBackend(b.pool, b.kv).init_forward_metadata(b.fb)
    k, v = b.pool.get_kv_buffer(0)
    return dict(q=b.q, k_cache=k, v_cache=v, cache_seqlens=md.cache_seqlens_int32, page_table=md.page_table,
                cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seq_len_q)


@FAST
@given(st.data())
def test_emulator(data):
    args = _kernel_args()
    good = emulate_flash_attn_with_kvcache(**args)
    bad, names = mutate(data.draw, args, list(args))

    def well_formed(out):  # accepted junk was a valid value: the documented [T, H, D] in q's dtype
        assert isinstance(out, torch.Tensor) and out.shape == bad["q"].shape and out.dtype == bad["q"].dtype
        if all(bad[n] is args[n] for n in args):
            assert torch.equal(out, good)
    named_or_correct(lambda: emulate_flash_attn_with_kvcache(**bad), names, well_formed)


@FAST
@given(st.data())
def test_attention_by_slot(data):
    b = built()
    k, v = b.pool.get_flat_kv(0)
    fb = b.fb
    K = [x + 4 for x in fb.seq_lens_cpu.tolist()]
    args = dict(q=b.q, k_flat=k, v_flat=v, req_to_token=b.kv.req_to_token,
                req_pool_indices=fb.req_pool_indices.tolist(), cache_seqlens=K, cu_seqlens_q=[0, 4, 8])
    good = attention_by_slot(**args)
    bad, names = mutate(data.draw, args, list(args))
    def well_formed(out):  # e.g. row 0 instead of a request's row is a valid call: it reads page 0
        assert isinstance(out, torch.Tensor) and out.shape == bad["q"].shape and out.dtype == bad["q"].dtype
        if all(bad[n] is args[n] for n in args):
            torch.testing.assert_close(out, good)
    named_or_correct(lambda: attention_by_slot(**bad), names, well_formed)


# ============================================================================ graphs
@functools.lru_cache(maxsize=None)
def runner():
    b = built()
    return b, b.graph_runner(capture_bs=(2,))


@FAST
@given(st.data())
def test_graph_runner_replay(data):
    b, r = runner()
    inputs = dict(q=b.q, k=b.k, v=b.v)
    which = data.draw(st.sampled_from(["fb", "inputs"]))
    if which == "fb":
        bad, names = mutate(data.draw, {}, FB_FIELDS)
        named_or_correct(lambda: r.replay(b.fb.replace(**bad), inputs), names)
    else:
        bad, names = mutate(data.draw, inputs, list(inputs))
        named_or_correct(lambda: r.replay(b.fb, bad), names + ["inputs"])


# ============================================================================ Scenario, generate
SCENARIO = dict(mode=M.TARGET_VERIFY, page_size=4, lens=[5, 9], num_draft_tokens=4, num_accept_tokens=None,
                extend_lens=None, draft_step=None, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                seed=0, shuffle_pages=True, poison=True, window_left=-1, softcap=0.0, device="cpu", extra_pages=3)


def _scenario_ok(built):
    """A built scenario the junk did not break: both eager wings agree on ``[T, H, D]``."""
    ref, out = built.run_oracle(), built.run_fa3()
    sc = built.sc
    assert ref.shape == out.shape == (built.fb.num_tokens, sc.num_heads, sc.head_dim)
    torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=1e-4)


@FAST
@given(st.data())
def test_scenario(data):
    names = [n for n in SCENARIO if n != "mode"]
    mode = data.draw(st.sampled_from(list(M)))
    bad, replaced = mutate(data.draw, {**SCENARIO, "mode": mode}, names)
    # a mode that needs a per-request list (or none: IDLE) may be refused naming that list
    named_or_correct(lambda: Scenario(**bad).build(), replaced + ["mode", "lens", "extend_lens", "num_accept_tokens"],
                     _scenario_ok)


@functools.lru_cache(maxsize=None)
def model():
    return init_random_(LlamaModel(tiny_config()), seed=0).eval().requires_grad_(False)


GENERATE = dict(prompts=[[1, 2, 3]], backend="oracle", version="v1", page_size=2, num_steps=2, max_new_tokens=2,
                draft="early-exit:1", max_batch=None, eos=None, topk=1, num_draft_tokens=None)


@settings(max_examples=N_EXAMPLES // 2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_generate(data):
    backend = data.draw(st.sampled_from(["oracle", "fa3"]))
    bad, names = mutate(data.draw, {**GENERATE, "backend": backend}, [n for n in GENERATE if n != "backend"])

    def lossless(res):  # an accepted junk value is a valid one: output == plain greedy
        from refspec.oracle.loop import greedy
        budgets = bad["max_new_tokens"] if isinstance(bad["max_new_tokens"], list) else \
            [bad["max_new_tokens"]] * len(bad["prompts"])
        assert res.tokens == [greedy(model(), p, m, bad["eos"]).tokens for p, m in zip(bad["prompts"], budgets)]
    with torch.no_grad():
        named_or_correct(lambda: generate(model(), **bad), names, lossless)


# ============================================================================ MLA (issue 40)
def _mla_pool():
    return MLAKVPool(num_layers=1, num_pages=4, page_size=4, kv_lora_rank=8, qk_rope_head_dim=4)


_W = torch.randn(4 * (16 + 16), 8)  # kv_b_proj.weight of H = 4, Dn = Dv = 16, R = 8
_WKC, _WVC = mla.split_kv_b_proj(_W, 4, 16)
MLA_CALLS = {
    "MLADims": (lambda **a: mla.MLADims(**a), dict(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=16,
                                                   v_head_dim=16)),
    "yarn_get_mscale": (mla.yarn_get_mscale, dict(scale=40, mscale=1.0)),
    "mla_softmax_scale": (mla.mla_softmax_scale, dict(dims=mla.DEEPSEEK_V3_DIMS,
                                                      rope_scaling=dict(mla.DEEPSEEK_V3_ROPE_SCALING))),
    "rope_scaling entries": (lambda **a: mla.mla_softmax_scale(mla.DEEPSEEK_V3_DIMS, dict(type="yarn", **a)),
                             dict(factor=40, mscale_all_dim=1.0)),
    "mla_attention_layers": (mla.mla_attention_layers, dict(layer_id=0, num_heads=4, dims=mla.DEEPSEEK_V3_DIMS,
                                                            scaling=0.1352)),
    "split_kv_b_proj": (mla.split_kv_b_proj, dict(weight=_W, num_heads=4, qk_nope_head_dim=16)),
    "absorb_q": (mla.absorb_q, dict(q_nope=torch.randn(3, 4, 16), w_kc=_WKC)),
    "latent_to_v": (mla.latent_to_v, dict(o=torch.randn(3, 4, 8), w_vc=_WVC)),
    "expand_latent": (mla.expand_latent, dict(c=torch.randn(5, 8), k_pe=torch.randn(5, 4), w_kc=_WKC, w_vc=_WVC)),
    "MLAKVPool": (lambda **a: MLAKVPool(**a), dict(num_layers=1, num_pages=4, page_size=4, kv_lora_rank=8,
                                                   qk_rope_head_dim=4)),
    "set_mla_kv_buffer": (lambda **a: _mla_pool().set_mla_kv_buffer(**a),
                          dict(layer_id=0, loc=torch.tensor([5, 6]), k_nope=torch.randn(2, 1, 8),
                               k_rope=torch.randn(2, 1, 4))),
    "get_mla_kv_buffer": (lambda **a: _mla_pool().get_mla_kv_buffer(**a), dict(layer_id=0, loc=torch.tensor([5, 6]))),
    "move_kv_cache": (lambda **a: _mla_pool().move_kv_cache(**a), dict(tgt=torch.tensor([5]), src=torch.tensor([6]))),
    "paged_views": (lambda **a: _mla_pool().paged_views(**a), dict(layer_id=0, v_head_dim=8, page_size=4)),
}


@FAST
@given(st.data(), st.sampled_from(sorted(MLA_CALLS)))
def test_mla_entry_points(data, which):
    fn, args = MLA_CALLS[which]
    bad, names = mutate(data.draw, args, list(args))
    # the weight helpers name the tensor whose shape is off; with one replaced, the other may be named
    also = {"absorb_q": list(args), "latent_to_v": list(args), "expand_latent": list(args),
            "rope_scaling entries": ["rope_scaling"]}.get(which, [])
    named_or_correct(lambda: fn(**bad), names + also)


@functools.lru_cache(maxsize=None)
def mla_built():
    return MLAScenario(M.TARGET_VERIFY, page_size=4, lens=[5, 9], num_draft_tokens=4, poison=False).build()


@FAST
@given(st.data(), st.sampled_from(["fa3", "oracle"]))
def test_mla_absorbed_forward(data, wing):
    """Junk in the absorbed call's four tensors: a named error, or (a valid value after all) the
    other wing's answer on the same call."""
    b = mla_built()
    args = dict(q=b.q, q_rope=b.q_rope, k=b.k, k_rope=b.k_rope)
    bad, names = mutate(data.draw, args, list(args))

    def run(w):
        be = b.fa3_backend() if w == "fa3" else OracleBackend(b.pool, b.kv)
        be.init_forward_metadata(b.fb)
        return be.forward(bad["q"], bad["k"], bad["k"], b.layer, b.fb, q_rope=bad["q_rope"], k_rope=bad["k_rope"])

    def agrees(out):
        ref = run("oracle" if wing == "fa3" else "fa3")
        assert out.shape == ref.shape == (b.fb.num_tokens, 4, 256)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    # k (the latent) and k_rope are stored as k_nope / k_rope; q is the absorbed q_nope
    named_or_correct(lambda: run(wing), names + ["k_nope"] * ("k" in names), agrees)
