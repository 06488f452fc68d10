"""GPU: the real FA3 kernel on the top-k > 1 tree path (``@pytest.mark.gpu``), eager and graphed.

For every mode (tree verify, tree draft decode at every step) x page size (1, 4, 16, 64) x
topk (2, 4, 8): the cascade (prefix call + expand call + LSE merge) on the real kernel and on the
emulator vs the fp32 slot oracle, tier T1 (TOL-002), pools NaN-poisoned outside the written
slots.  Graphed: a ``torch.cuda.CUDAGraph`` captured on one tree / one set of KV, then the
metadata (a new tree) or the KV rewritten *in place* and replayed: T1 against the oracle of the
new inputs.  Loop: the production top-k loop in bf16 with the real kernel (eager and CUDA
graphs) equals the fp32 oracle tree loop under T2 (TOL-003), every page freed.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.tolerance import assert_t1
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.graphs.capture import CudaGraph
from refspec.harness.tree_scenario import (
    H,
    draft_setup,
    layer,
    random_parents,
    tree_batch,
    verify_setup,
    write_random,
)
from refspec.oracle.slots import attention_over_slots

pytestmark = pytest.mark.gpu

PAGE_SIZES = (1, 4, 16, 64)
TOPKS = (2, 4, 8)
N_FOR_K = {2: 4, 4: 8, 8: 16}
LENS = [5, 67, 130, 300]
BF16 = torch.bfloat16
HD = 64  #: a head dim the FA3 build supports
LAYER = layer(HD)


def _oracle(q, pool, slots):
    k, v = pool.get_flat_kv(0)
    ref = attention_over_slots(q, k, v, slots, out_dtype=torch.float32)
    low = attention_over_slots(q, k, v, slots, upcast=False)
    return ref, low


def _check(out, q, pool, slots, what):
    assert bool(torch.isfinite(out).all()), f"{what}: read poison (NaN)"
    ref, low = _oracle(q, pool, slots)
    assert_t1(out, ref, low, what)


@pytest.mark.spec("TR-010", "TR-011", "TR-012", "TOL-002")
@pytest.mark.parametrize("provider", ["fa3", "emulator"])
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
def test_gpu_tree_verify_eager(P, topk, provider):
    N = N_FOR_K[topk]
    kv, pool, fb, q, slots, _ = verify_setup(P, LENS, N, seed=P + topk, device="cuda", dtype=BF16, head_dim=HD)
    be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_draft_tokens=N, provider=provider)
    be.init_forward_metadata(fb)
    _check(be.forward(q, None, None, LAYER, fb), q, pool, slots, f"verify P={P} k={topk} {provider}")


@pytest.mark.spec("TR-018", "TR-011", "CG-001", "TOL-002")
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
def test_gpu_tree_verify_graphed(P, topk):
    N = N_FOR_K[topk]
    kv, pool, fb, q, _slots, rows = verify_setup(P, LENS, N, seed=P * topk, device="cuda", dtype=BF16, head_dim=HD)
    be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_draft_tokens=N, provider="fa3")
    be.init_forward_metadata(fb)
    q_static = q.clone()
    graph = CudaGraph()
    graph.capture(lambda: be.forward(q_static, None, None, LAYER, fb))
    gen = torch.Generator().manual_seed(1000 + P)
    fb2, slots2 = tree_batch(kv, rows, LENS, N, [random_parents(N, gen) for _ in LENS], "cuda")
    R = kv.req_to_token
    new_pre = tm.verify_prefix_metadata(fb2.seq_lens, fb2.seq_lens_cpu, fb2.req_pool_indices, R, N, P)
    new_exp = tm.verify_expand_metadata(fb2.custom_mask, fb2.seq_lens, fb2.req_pool_indices, R, N)
    for old, new in ((be.forward_metadata, new_pre), (be.forward_metadata_spec_decode_expand, new_exp)):
        for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"):
            getattr(old, name).copy_(getattr(new, name))  # in place (CG-001)
    q2 = torch.randn_like(q, dtype=torch.float32).to(BF16)
    q_static.copy_(q2)
    out = graph.replay()
    _check(out, q2, pool, slots2, f"graphed verify P={P} k={topk}")


@pytest.mark.spec("TR-013", "TR-014", "TR-015", "TR-012", "TOL-002")
@pytest.mark.parametrize("provider", ["fa3", "emulator"])
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
def test_gpu_tree_draft_decode_eager(P, topk, provider):
    S = 4
    kv, pool, fb, rows, loc = draft_setup(P, LENS, topk, S, seed=P + 3 * topk, device="cuda", dtype=BF16, head_dim=HD)
    gen = torch.Generator().manual_seed(topk)
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_steps=S, speculative_step_id=s, provider=provider)
        be.init_forward_metadata(fb)
        q = torch.randn((len(LENS) * topk, H, HD), generator=gen).to("cuda", BF16)
        out = be.forward(q, None, None, LAYER, draft_step_batch(fb, s))
        slots = [kv.req_to_token[rows[i // topk], :LENS[i // topk]].tolist() + loc.view(-1, S)[i, :s + 1].tolist()
                 for i in range(len(LENS) * topk)]
        _check(out, q, pool, slots, f"draft step {s} P={P} k={topk} {provider}")


@pytest.mark.spec("TR-018", "TR-014", "CG-001", "TOL-002")
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
def test_gpu_tree_draft_decode_graphed(P, topk):
    S = 4
    kv, pool, fb, rows, loc = draft_setup(P, LENS, topk, S, seed=2 * P + topk, device="cuda", dtype=BF16, head_dim=HD)
    gen = torch.Generator().manual_seed(50 + P)
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_steps=S, speculative_step_id=s, provider="fa3")
        be.init_forward_metadata(fb)
        step = draft_step_batch(fb, s)
        q_static = torch.zeros((len(LENS) * topk, H, HD), device="cuda", dtype=BF16)
        graph = CudaGraph()
        graph.capture(lambda: be.forward(q_static, None, None, LAYER, step))
        write_random(pool, loc, gen)  # new KV at every branch step slot, in place
        q2 = torch.randn((len(LENS) * topk, H, HD), generator=gen).to("cuda", BF16)
        q_static.copy_(q2)
        out = graph.replay()
        slots = [kv.req_to_token[rows[i // topk], :LENS[i // topk]].tolist() + loc.view(-1, S)[i, :s + 1].tolist()
                 for i in range(len(LENS) * topk)]
        _check(out, q2, pool, slots, f"graphed draft step {s} P={P} k={topk}")


@pytest.mark.spec("TR-019", "TR-018", "TR-020", "TR-021", "TOL-003", "KV-006")
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("k,N", [(2, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda P: f"P{P}")
def test_gpu_tree_loop_matches_oracle_t2(P, k, N, graphs, version):
    from test_gpu_spec import SMALL, _check_t2, _pair, _prompts
    m32, m16 = _pair(SMALL)
    prompts = _prompts(SMALL, [5, 17, 33, 64])
    prod = _check_t2(m32, m16, prompts, [20, 16, 24, 12], version=version, page_size=P, graphs=graphs,
                     draft="eagle", num_steps=3, topk=k, num_draft_tokens=N)
    if graphs:
        assert prod.forwards.get(("tree_verify", "graph"), 0) > 0
        assert prod.forwards.get(("tree_draft", "graph"), 0) > 0
