"""SGLang's FA3 backend on an MLA pool vs the MLA oracle: every mode, eager and graph replay, top-k 1 and 2.

* both wings take SGLang's call ``forward(q, k, v, layer, fb, q_rope=, k_rope=)`` and agree (T1,
  fp32) in every forward mode at P = 1, 4, 16, 64, the pools poisoned (NaN outside every table,
  1e4 past K_b), so a read outside the rule shows;
* the kernel receives what ML-003 / ML-005 / ML-007 say (the strided views, q_rope as q, the
  absorbed q_nope as qv, the layer's scale), recorded at the kernel seam;
* the metadata is the MHA backend's, bit for bit (ML-004), eager and replayed;
* graph capture and padded replay equal eager (T0, CG-002), DRAFT_EXTEND_V2 with the
  accept-length ``cu_seqlens_q = [0, W, 2W, ...]`` (CG-004), padded rows never write slot 0 (ML-002);
* the multi-step draft backend, the non-absorbed prefill (ML-010), the top-k > 1 cascade (ML-011)
  eager and in the tree verify graph.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVPool
from refspec.core.mla import DEEPSEEK_V3_DIMS, absorb_q, expand_latent, latent_to_v, split_kv_b_proj
from refspec.core.modes import ForwardMode as M
from refspec.core.tolerance import assert_t1, t0
from refspec.fa3 import kernel
from refspec.fa3.backend import FlashAttentionBackend, FlashAttentionMultiStepBackend
from refspec.fa3.tree_attention import mla_cascade_attention
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.harness.mla_scenario import TINY_DIMS, MLAScenario, mla_draft_setup, mla_verify_setup
from refspec.oracle.backend import OracleBackend
from refspec.oracle.slots import attention_over_slots
from refspec.speculative.tree.graphs import TreeGraphRunner

PAGE_SIZES = (1, 4, 16, 64)
LENS = [5, 17, 70]  # partial last pages at every P > 1, one request longer than a P = 64 page
A = [1, 3, 2]  # accepted tokens a = n + 1 (draft extends)
MODES = {
    "decode": dict(mode=M.DECODE, lens=LENS),
    "draft_decode": dict(mode=M.DECODE, lens=LENS, draft_step=2),
    "extend": dict(mode=M.EXTEND, lens=[0, 6, 20], extend_lens=[5, 3, 7]),
    "target_verify": dict(mode=M.TARGET_VERIFY, lens=LENS),
    "draft_extend": dict(mode=M.DRAFT_EXTEND, lens=LENS, num_accept_tokens=A),
    "draft_extend_v2": dict(mode=M.DRAFT_EXTEND_V2, lens=LENS, num_accept_tokens=A),
}
GRAPHED = [m for m in MODES if m != "extend"]


def no_poison(out, what):
    assert bool(torch.isfinite(out).all()), f"{what}: a poisoned slot (NaN / 1e4 region) reached the output"


@pytest.mark.spec("ML-005", "ML-003", "PA-002", "PA-004", "MD-003")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_fa3_wing_equals_the_oracle(mode, P):
    built = MLAScenario(page_size=P, seed=P, **MODES[mode]).build()
    ref, out = built.run_oracle(), built.run_fa3()
    assert out.shape == (built.fb.num_tokens, 4, TINY_DIMS.kv_lora_rank)
    no_poison(out, f"{mode} P={P}")
    assert_t1(out, ref, what=f"{mode} P={P}")


@pytest.mark.spec("ML-005", "ML-006")
def test_deepseek_dims_both_wings():
    """DeepSeek's attention dims (R = 512, Dr = 64: the real qv kernel's 64 / 512), 16 heads, YaRN scale."""
    from refspec.core.mla import DEEPSEEK_V3_ROPE_SCALING
    built = MLAScenario(M.TARGET_VERIFY, 16, [40, 70], dims=DEEPSEEK_V3_DIMS, num_heads=16,
                        rope_scaling=DEEPSEEK_V3_ROPE_SCALING).build()
    assert round(built.layer.scaling, 4) == 0.1352 and kernel.fa3_dims_problem(64, 512, True) is None
    assert_t1(built.run_fa3(), built.run_oracle(), what="DeepSeek dims verify")


@pytest.mark.spec("ML-003", "ML-005", "ML-007")
@pytest.mark.parametrize("P", (1, 16))
def test_the_kernel_receives_the_views_q_rope_qv_and_the_scale(P, monkeypatch):
    calls = []
    real = kernel.attention
    monkeypatch.setattr(kernel, "attention", lambda **kw: calls.append(kw) or real(**kw))
    built = MLAScenario(M.DECODE, P, LENS, dims=DEEPSEEK_V3_DIMS, num_heads=2).build()
    built.run_fa3()
    (kw,) = calls
    row = 576
    assert kw["q"] is built.q_rope and kw["qv"] is built.q
    assert kw["k_cache"].shape[1:] == (P, 1, 64) and kw["v_cache"].shape[1:] == (P, 1, 512)
    assert kw["k_cache"].stride() == kw["v_cache"].stride() == (row * P, row, row, 1)
    assert kw["softmax_scale"] == built.layer.scaling == 192 ** -0.5 and kw["causal"] is True
    assert kw["return_softmax_lse"] is False


@pytest.mark.spec("ML-004")
@pytest.mark.parametrize("mode", MODES)
def test_the_metadata_is_the_mha_metadata(mode):
    """The same batch through an MLA backend and an MHA backend: every metadata tensor bitwise equal."""
    built = MLAScenario(page_size=4, **MODES[mode]).build()
    step = built.sc.draft_step
    mla = FlashAttentionBackend(built.pool, built.kv, speculative_step_id=step, provider="emulator")
    mha = FlashAttentionBackend(KVPool(1, built.pool.num_pages, 4, 1, 8), built.kv, speculative_step_id=step,
                                provider="emulator")
    a, b = mla.init_forward_metadata(built.fb), mha.init_forward_metadata(built.fb)
    assert mla.use_mla and not mha.use_mla
    for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"):
        assert t0(getattr(a, name), getattr(b, name)).ok, name
    assert (a.max_seq_len_q, a.max_seq_len_k) == (b.max_seq_len_q, b.max_seq_len_k)


# ---------------------------------------------------------------- CUDA graphs (emulated on CPU)
@pytest.mark.spec("CG-002", "CG-005", "ML-002", "ML-004")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("mode", GRAPHED)
def test_padded_replay_equals_eager_and_never_writes_slot_0(mode, P):
    """3 live requests replayed in the bs = 4 graph (one padded row, out_cache_loc 0): real rows
    equal eager bitwise, slot 0 keeps its sentinel, and the replayed metadata of the real rows is
    the eager metadata."""
    built = MLAScenario(page_size=P, seed=P, **MODES[mode]).build()
    row0 = built.pool.get_key_buffer(0)
    row0[0] = -3.0  # slot 0 (the padding slot): a sentinel that must survive every replay
    eager = built.run_fa3()
    md_eager = built.extra["metadata"]
    runner = built.graph_runner(capture_bs=(1, 4))
    for _ in range(2):  # capture wrote dummies; two replays of the padded batch
        out = built.run_fa3_graph(runner)
        assert t0(out, eager).ok, f"{mode} P={P}: replay != eager"
    assert bool((row0[0] == -3.0).all()), "a padded row wrote slot 0"
    md = runner.backend.forward_metadata
    B = len(LENS)
    assert t0(md.cache_seqlens_int32[:B], md_eager.cache_seqlens_int32).ok
    n = md_eager.page_table.shape[1]
    for b in range(B):
        pages = -(-int(md_eager.cache_seqlens_int32[b]) // P)
        assert t0(md.page_table[b, :pages], md_eager.page_table[b, :pages]).ok and pages <= n


@pytest.mark.spec("CG-004", "CG-002")
@pytest.mark.parametrize("P", (1, 16))
def test_draft_extend_v2_replay_uses_the_uniform_cu_seqlens_q(P):
    """DRAFT_EXTEND_V2 on MLA: the replayed cu_seqlens_q over the padded batch is [0, W, 2W, 3W, 4W]
    (W = N = 4 rows per request, whatever the accept lengths [1, 3, 2]), and the output equals eager."""
    built = MLAScenario(page_size=P, **MODES["draft_extend_v2"]).build()
    eager = built.run_fa3()
    runner = built.graph_runner(capture_bs=(4,))
    out = built.run_fa3_graph(runner)
    assert runner.backend.forward_metadata.cu_seqlens_q[:5].tolist() == [0, 4, 8, 12, 16]
    assert t0(out, eager).ok


@pytest.mark.spec("MD-010", "ML-004", "ML-005")
@pytest.mark.parametrize("P", (1, 4))
def test_multi_step_draft_backend(P):
    """The Sd - 1 draft-decode backends on one MLA pool: step s writes slot L + s and attends K = L + s + 1."""
    S = 4
    for s in range(S - 1):
        built = MLAScenario(M.DECODE, P, LENS, draft_step=s, seed=s).build()
        multi = FlashAttentionMultiStepBackend(built.pool, built.kv, S, provider="emulator")
        be = multi.backends[s]
        assert be.use_mla and be.speculative_step_id == s
        md = be.init_forward_metadata(built.fb)
        assert md.cache_seqlens_int32.tolist() == [L + s + 1 for L in LENS]
        out = be.forward(built.q, built.k, built.k, built.layer, built.fb, q_rope=built.q_rope, k_rope=built.k_rope)
        assert_t1(out, built.run_oracle(), what=f"draft step {s} P={P}")


# ---------------------------------------------------------------- the non-absorbed prefill
def prefill_inputs(built, seed=0):
    """The model's side of ML-010 (written out here): kv_b_proj weights, the latent rows already in
    the pool, every key of every request expanded, q for the new tokens."""
    d, H = built.sc.dims, built.sc.num_heads
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.randn(H * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g) / d.kv_lora_rank ** 0.5
    w_kc, w_vc = split_kv_b_proj(kv_b, H, d.qk_nope_head_dim)
    fb = built.fb
    built.pool.set_mla_kv_buffer(0, fb.out_cache_loc, built.k, built.k_rope)  # the model writes the latent
    slots = torch.cat([built.kv.req_to_token[r, :K].long() for r, K in zip(fb.req_pool_indices.tolist(), built.K)])
    c, k_pe = built.pool.get_mla_kv_buffer(0, slots)  # every key's latent, the prefix gathered back (one-shot)
    assert torch.equal(torch.cat([c, k_pe], -1), built.pool.get_key_buffer(0)[slots])
    k, v = expand_latent(c[:, 0], k_pe[:, 0], w_kc, w_vc)
    q_nope = torch.randn(fb.num_tokens, H, d.qk_nope_head_dim, generator=g)
    return q_nope, k, v, w_kc, w_vc


@pytest.mark.spec("ML-010", "ML-008", "ML-009")
@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("prefix", [[0, 0, 0], [0, 6, 20]], ids=["no-prefix", "one-shot-prefix"])
def test_mha_prefill_both_wings_and_the_absorbed_form(P, prefix):
    """The prefill's MHA pass (varlen, every key) in both wings equals the absorbed path through the
    same backend, times W_UV: the absorption identity at the backend level."""
    built = MLAScenario(M.EXTEND, P, prefix, extend_lens=[5, 3, 7], seed=P).build()
    q_nope, k, v, w_kc, w_vc = prefill_inputs(built, seed=P)
    q = torch.cat([q_nope, built.q_rope], dim=-1)  # [T, H, Dn + Dr]
    fb_mha = built.fb.replace(attn_attend_prefix_cache=False)
    outs = []
    for be in (OracleBackend(built.pool, built.kv), FlashAttentionBackend(built.pool, built.kv, provider="emulator")):
        be.init_forward_metadata(fb_mha)
        outs.append(be.forward(q, k, v, built.mha_layer, fb_mha))
    assert outs[1].shape == (15, 4, TINY_DIMS.v_head_dim)
    no_poison(outs[1], "mha prefill")
    assert_t1(outs[1], outs[0], what=f"mha prefill P={P}")
    fa3 = FlashAttentionBackend(built.pool, built.kv, provider="emulator")
    fa3.init_forward_metadata(built.fb)
    absorbed = fa3.forward(absorb_q(q_nope, w_kc), None, None, built.layer, built.fb, q_rope=built.q_rope)
    assert_t1(latent_to_v(absorbed, w_vc), outs[0], what=f"absorbed x W_UV vs mha P={P}")


@pytest.mark.spec("ML-010", "ML-009")
def test_mha_pass_refusals():
    built = MLAScenario(M.EXTEND, 4, [0, 6], extend_lens=[5, 3]).build()
    q_nope, k, v, _, _ = prefill_inputs(built)
    q = torch.cat([q_nope, built.q_rope], dim=-1)
    be = FlashAttentionBackend(built.pool, built.kv, provider="emulator")
    be.init_forward_metadata(built.fb)
    fb = built.fb.replace(attn_attend_prefix_cache=False)
    with pytest.raises(InvariantError, match=r"\[ML-010\].*every key of every request"):
        be.forward(q, k[5:], v[5:], built.mha_layer, fb)  # the chunked layout: the extend keys only
    with pytest.raises(ValueError, match="MHA_CHUNKED_KV"):
        be.forward(q, k, v, built.mha_layer, built.fb.replace(attn_attend_prefix_cache=True))
    verify = MLAScenario(M.TARGET_VERIFY, 4, [5, 9]).build()
    be = FlashAttentionBackend(verify.pool, verify.kv, provider="emulator")
    be.init_forward_metadata(verify.fb)
    with pytest.raises(InvariantError, match=r"\[ML-009\].*only a plain EXTEND"):
        be.forward(q, k, v, built.mha_layer, verify.fb.replace(attn_attend_prefix_cache=False))


@pytest.mark.spec("ML-005", "ML-002", "ML-003")
def test_absorbed_call_refusals():
    built = MLAScenario(M.DECODE, 4, [5, 9]).build()
    be = built.fa3_backend()
    be.init_forward_metadata(built.fb)
    L, x = built.layer, built
    with pytest.raises(InvariantError, match=r"\[ML-005\]"):
        be.forward(x.q, x.k, x.k, L, x.fb)  # no q_rope
    with pytest.raises(InvariantError, match=r"\[ML-005\]"):
        be.forward(torch.cat([x.q, x.q_rope], -1), x.k, x.k, L, x.fb, q_rope=x.q_rope)  # a fused q
    with pytest.raises(InvariantError, match=r"\[ML-002\].*both, or neither"):
        be.forward(x.q, x.k, x.k, L, x.fb, q_rope=x.q_rope)  # a latent without its k_rope
    import dataclasses
    with pytest.raises(InvariantError, match=r"\[ML-003\].*one KV head"):
        be.forward(x.q, x.k, x.k, dataclasses.replace(L, num_kv_heads=2, num_heads=4), x.fb, q_rope=x.q_rope,
                   k_rope=x.k_rope)
    mha = FlashAttentionBackend(KVPool(1, 4, 4, 1, 8), built.kv, provider="emulator")
    mha.init_forward_metadata(built.fb)
    with pytest.raises(ValueError, match="MLA arguments"):
        mha.forward(torch.zeros(2, 1, 8), None, None, dataclasses.replace(L, num_heads=1, head_dim=8, v_head_dim=8),
                    built.fb, q_rope=x.q_rope)


# ---------------------------------------------------------------- top-k > 1: the MLA cascade
TREE_LENS = [5, 67, 130]


@pytest.mark.spec("ML-011", "TR-010", "TR-011", "TR-012")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_tree_verify_cascade_equals_attention_over_ancestor_slots(P):
    kv, pool, fb, layer, x, slots = mla_verify_setup(P, TREE_LENS, 4, seed=P)
    be = FlashAttentionTreeBackend(pool, kv, topk=2, num_draft_tokens=4, provider="emulator")
    be.init_forward_metadata(fb)
    out = be.forward(x["q"], x["k"], x["k"], layer, fb, q_rope=x["q_rope"], k_rope=x["k_rope"])
    rows = pool.get_key_buffer(0)  # after the forward's store
    ref = attention_over_slots(torch.cat([x["q"], x["q_rope"]], -1), rows, rows[..., :layer.v_head_dim], slots,
                               softmax_scale=layer.scaling)
    no_poison(out, f"tree verify P={P}")
    assert_t1(out, ref, what=f"tree verify P={P}")


@pytest.mark.spec("ML-011")
def test_verify_expand_on_the_paged_views_reads_the_wrong_keys():
    """Negative control (upstream's MLA branch at both pins): the verify expand call on the P-paged
    views, whose table holds token slots, reads slot * P + offset: wrong (here poison) at P = 4."""
    kv, pool, fb, layer, x, slots = mla_verify_setup(4, TREE_LENS, 4, seed=9)
    be = FlashAttentionTreeBackend(pool, kv, topk=2, num_draft_tokens=4, provider="emulator")
    be.init_forward_metadata(fb)
    good = be.forward(x["q"], x["k"], x["k"], layer, fb, q_rope=x["q_rope"], k_rope=x["k_rope"])
    try:
        bad = mla_cascade_attention(x["q"], x["q_rope"], pool, be.forward_metadata,
                                    be.forward_metadata_spec_decode_expand, layer, expand_page1=False,
                                    provider="emulator")
    except InvariantError as e:  # a slot read as a page id past the pool
        assert e.inv_id == "PA-011"
    else:
        assert not torch.isfinite(bad).all() or float((bad - good).abs().max()) > 1e-2


@pytest.mark.spec("ML-011", "ML-012", "TR-013", "TR-014", "TR-015")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_tree_draft_decode_cascade_equals_prefix_plus_own_steps(P):
    """Branches t >= 1 hold the tail copy that the MLA pool's move_kv_cache made (ML-012)."""
    topk, S = 2, 4
    kv, pool, fb, layer, rws, loc = mla_draft_setup(P, TREE_LENS, topk, S, seed=P)
    cache_loc, rows = loc.view(-1, S), pool.get_key_buffer(0)
    g = torch.Generator().manual_seed(P)
    T, R, Dr = len(TREE_LENS) * topk, TINY_DIMS.kv_lora_rank, TINY_DIMS.qk_rope_head_dim
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_steps=S, speculative_step_id=s, provider="emulator")
        be.init_forward_metadata(fb)
        q, q_rope = torch.randn(T, 4, R, generator=g), torch.randn(T, 4, Dr, generator=g)
        out = be.forward(q, None, None, layer, draft_step_batch(fb, s), q_rope=q_rope)
        want = [kv.req_to_token[rws[i // topk], :TREE_LENS[i // topk]].tolist() + cache_loc[i, :s + 1].tolist()
                for i in range(T)]
        ref = attention_over_slots(torch.cat([q, q_rope], -1), rows, rows[..., :R], want, softmax_scale=layer.scaling)
        no_poison(out, f"tree draft P={P} s={s}")
        assert_t1(out, ref, what=f"tree draft P={P} step {s}")


class _VerifyRunners:
    """What :class:`~refspec.speculative.tree.graphs.TreeGraphRunner` reads of the engine's runners,
    for one MLA attention layer whose inputs come from per-token tables indexed by the node ids (as
    an embedding would): the verify graph's function is the tree backend's MLA forward."""

    def __init__(self, kv, be, layer, tables, N):
        self.kv, self.topk, self.Sd, self.num_draft_tokens, self.tree_verify_be = kv, 2, 3, N, be
        self.layer, self.tables = layer, tables

    def _tree_verify_fn(self, fb, x):
        t = {n: table[x["ids"]] for n, table in self.tables.items()}
        return (self.tree_verify_be.forward(t["q"], t["k"], t["k"], self.layer, fb, q_rope=t["q_rope"],
                                            k_rope=t["k_rope"]),)


@pytest.mark.spec("ML-011", "TR-018", "CG-002", "ML-002")
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_tree_verify_graph_padded_replay_equals_eager(P):
    """The MLA cascade inside the tree verify graph: 3 live requests in the bs = 4 graph (one padded
    request: row 0, L = 1, slots 0), the real rows bitwise equal to eager, slot 0 untouched."""
    N = 4
    kv, pool, fb, layer, x, _ = mla_verify_setup(P, TREE_LENS, N, seed=P)
    pool.get_key_buffer(0)[0] = -3.0
    eager_be = FlashAttentionTreeBackend(pool, kv, topk=2, num_draft_tokens=N, provider="emulator")
    eager_be.init_forward_metadata(fb)
    eager = eager_be.forward(x["q"], x["k"], x["k"], layer, fb, q_rope=x["q_rope"], k_rope=x["k_rope"])
    T = fb.num_tokens
    tables = {n: torch.cat([t, torch.zeros((4 * N - T, *t.shape[1:]))]) for n, t in x.items()}  # row per token id
    graph_be = FlashAttentionTreeBackend(pool, kv, topk=2, num_draft_tokens=N, provider="emulator")
    runner = TreeGraphRunner(_VerifyRunners(kv, graph_be, layer, tables, N), "verify", (4,), torch.float32)
    ids = torch.arange(T)
    live = {"ids": ids, "retrive_next_token": torch.zeros_like(ids), "retrive_next_sibling": torch.zeros_like(ids)}
    for _ in range(2):
        (out,) = runner.replay(fb, live)
        assert t0(out, eager).ok, f"tree verify graph P={P}"
    assert bool((pool.get_key_buffer(0)[0] == -3.0).all()), "a padded tree row wrote slot 0"


@pytest.mark.spec("MD-010", "CG-002", "ML-002")
@pytest.mark.parametrize("P", (1, 4, 16, 64))
def test_all_draft_steps_in_one_graph(P):
    """Sd = 4: the 3 draft-decode steps of the multi-step backend in ONE graph (3 live requests in
    bs 4), each step storing its latent row then reading the rows steps < s stored in the same
    replay (the draft positions start as NaN, so a missing store shows): equal to eager (T0) and to
    the oracle (T1); the padded request never writes slot 0."""
    from refspec.core import batch as fbatch
    from refspec.graphs.runner import GraphRunner
    S, S1, d = 4, 3, TINY_DIMS
    built = MLAScenario(M.DECODE, P, LENS, draft_step=S - 2, num_draft_tokens=S, seed=P).build()
    kv, pool, layer = built.kv, built.pool, built.layer
    rows = built.fb.req_pool_indices.tolist()
    for r, L in zip(rows, LENS):  # the draft positions L .. L + Sd - 2: NaN until a step stores them
        pool.get_key_buffer(0)[kv.req_to_token[r, L:L + S1].long()] = float("nan")
    pool.get_key_buffer(0)[0] = -3.0
    g = torch.Generator().manual_seed(P)
    T, H, R, Dr = len(LENS) * S1, 4, d.kv_lora_rank, d.qk_rope_head_dim
    x = dict(q=torch.randn(T, H, R, generator=g), q_rope=torch.randn(T, H, Dr, generator=g),
             k=torch.randn(T, 1, R, generator=g), k_rope=torch.randn(T, 1, Dr, generator=g))

    def steps(backends, fbs, x):  # step s of request b is entry b * S1 + s (request-major)
        cut = {n: t.unflatten(0, (fbs[0].batch_size, S1)) for n, t in x.items()}
        return torch.stack([be.forward(cut["q"][:, s].contiguous(), cut["k"][:, s].contiguous(), None, layer, fb,
                                       q_rope=cut["q_rope"][:, s].contiguous(), k_rope=cut["k_rope"][:, s].contiguous())
                            for s, (be, fb) in enumerate(zip(backends, fbs))], 1).flatten(0, 1)

    split = lambda fb: [fbatch.draft_step_view(fb, s, S) for s in range(S1)]
    multi = FlashAttentionMultiStepBackend(pool, kv, S, provider="emulator")
    shapes = {n: (tuple(t.shape[1:]), t.dtype) for n, t in x.items()}
    runner = GraphRunner(M.DECODE, multi.backends, lambda fb, xx: steps(multi.backends, split(fb), xx), kv=kv,
                         capture_bs=(4,), tokens_per_req=S1, inputs=shapes, split=split)
    live = fbatch.draft_decode_steps_batch(kv, rows, LENS, S)
    out = runner.replay(live, x)
    eager_be = FlashAttentionMultiStepBackend(pool, kv, S, provider="emulator").backends
    fbs = [fbatch.draft_decode_batch(kv, rows, LENS, s) for s in range(S1)]
    for be, fb in zip(eager_be, fbs):
        be.init_forward_metadata(fb)
    assert t0(out, steps(eager_be, fbs, x)).ok
    oracles = [OracleBackend(pool, kv, out_dtype=torch.float32) for _ in range(S1)]
    for be, fb in zip(oracles, fbs):
        be.init_forward_metadata(fb)
    assert_t1(out, steps(oracles, fbs, x), what=f"draft steps P={P}")
    no_poison(out, f"draft steps P={P}")
    assert bool((pool.get_key_buffer(0)[0] == -3.0).all())


@pytest.mark.spec("TOL-002", "ML-005")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_within_t1(dtype):
    """bf16 / fp16: the emulator's qv call within T1 of the fp32 oracle, the budget the oracle's own
    low-precision error (docs/tolerance-policy.md)."""
    built = MLAScenario(M.TARGET_VERIFY, 16, LENS, dtype=dtype).build()
    out = built.run_fa3()
    assert out.dtype == dtype
    assert_t1(out, built.run_oracle(), built.run_oracle(upcast=False), what=f"MLA verify {dtype}")


@pytest.mark.spec("ML-005")
def test_idle_batch_is_empty():
    built = MLAScenario(M.IDLE, 4, []).build()
    assert built.run_fa3().shape == built.run_oracle().shape == (0, 4, TINY_DIMS.kv_lora_rank)


class _DraftRunners:
    """:class:`TreeGraphRunner`'s view of the runners for the tree draft phase: one MLA layer per
    step backend, the rows' inputs from per-step tables indexed by ``topk_index`` (a branch's token,
    as an embedding would be)."""

    def __init__(self, kv, bes, layer, tables, topk, S):
        self.kv, self.topk, self.Sd, self.num_draft_tokens, self.tree_step_bes = kv, topk, S, S + 1, bes
        self.layer, self.tables = layer, tables
        self.target = type("T", (), {"config": type("C", (), {"hidden_size": 8})})()
        self.draft = type("D", (), {"uses_hidden": False})()

    def _tree_draft_fn(self, fb, x):
        ids, outs = x["topk_index"].flatten(), []
        for s, be in enumerate(self.tree_step_bes):
            t = {n: table[s][ids] for n, table in self.tables.items()}
            outs.append(be.forward(t["q"], t["k"], None, self.layer, draft_step_batch(fb, s), q_rope=t["q_rope"],
                                   k_rope=t["k_rope"]))
        return (torch.stack(outs, 1).flatten(1).view(fb.batch_size, -1),)  # per request: k rows x steps


@pytest.mark.spec("ML-011", "TR-018", "CG-002", "ML-002")
@pytest.mark.parametrize("P", (1, 4, 16, 64))
def test_tree_draft_graph_padded_replay_equals_eager(P):
    """The MLA draft-decode cascade of every step in the tree draft graph (3 live requests in bs 4),
    each step storing its branch rows: the real rows bitwise equal to eager, slot 0 untouched."""
    topk, S, d = 2, 4, TINY_DIMS
    kv, pool, fb, layer, rws, loc = mla_draft_setup(P, TREE_LENS, topk, S, seed=P)
    pool.get_key_buffer(0)[0] = -3.0
    B, H = len(TREE_LENS), 4
    g = torch.Generator().manual_seed(P)
    V = 4 * topk  # token ids: one row of every table per (padded) branch
    tables = {"q": torch.randn(S - 1, V, H, d.kv_lora_rank, generator=g),
              "q_rope": torch.randn(S - 1, V, H, d.qk_rope_head_dim, generator=g),
              "k": torch.randn(S - 1, V, 1, d.kv_lora_rank, generator=g),
              "k_rope": torch.randn(S - 1, V, 1, d.qk_rope_head_dim, generator=g)}
    live = {"topk_p": torch.rand(B, topk, generator=g), "topk_index": torch.arange(B * topk).view(B, topk)}
    mk = lambda: [FlashAttentionTreeBackend(pool, kv, topk=topk, num_steps=S, speculative_step_id=s,
                                            provider="emulator") for s in range(S - 1)]
    eager_runners = _DraftRunners(kv, mk(), layer, tables, topk, S)
    for be in eager_runners.tree_step_bes:
        be.init_forward_metadata(fb)
    (eager,) = eager_runners._tree_draft_fn(fb, live)
    runner = TreeGraphRunner(_DraftRunners(kv, mk(), layer, tables, topk, S), "draft", (4,), torch.float32)
    for _ in range(2):
        (out,) = runner.replay(fb, live)
        assert t0(out, eager).ok, f"tree draft graph P={P}"
    no_poison(out, f"tree draft graph P={P}")
    assert bool((pool.get_key_buffer(0)[0] == -3.0).all()), "a padded branch row wrote slot 0"
