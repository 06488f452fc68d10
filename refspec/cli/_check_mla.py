"""``python -m refspec check --sections mla``: MLA (DeepSeek's latent attention) through the same FA3
backend, one row per check (docs/mla.md).

Rows, for P in 1, 4, 16, 64 (``--quick``: 1 and 16; like the tree section, MLA keeps its own page
sizes), each against the MLA oracle (absorbed MLA over the latent rows, keys by slot):

* every forward mode of :data:`refspec.harness.modes.MODES` (the same batches, keys at page
  boundaries), eager: the FA3 wing's MLA branch (the store, then the ``qv`` call on the two
  strided views of the latent pool, ML-002 / ML-003 / ML-005) vs the oracle, T1 (TOL-002), worst
  over fp32 and bf16 (``--quick``: bf16).  ``EXTEND`` (no cached prefix) is the non-absorbed
  prefill ML-009 picks for it: ``flash_attn_varlen_func`` over every key expanded from its latent
  row (ML-010) vs the oracle's MHA pass over the same keys;
* the graphed modes: 3 live requests replayed in a graph captured for 4 (one padded row, which
  stores at ``out_cache_loc`` 0): T0 graph == eager, with slot 0 unchanged (ML-002), and T1 graph
  vs the oracle;
* top-k 2 (the MLA cascade, ML-011): ``TREE_VERIFY k=2`` and ``TREE_DRAFT k=2`` (every draft
  step), eager and graphed (a new tree / new KV written in place, then replayed), vs attention
  over each row's ancestor slots (fp32 on CPU, as the tree section).

On CUDA the FA3 rows need a build with the hdim 64 / 512 kernel: where it is missing (the
``tokenspeed-fa3`` wheel) they are ``skip`` with the ML-013 refusal and only the emulator's eager
rows run, with DeepSeek's attention dims (R 512, Dr 64); on CPU the dims are the tiny test config
(:data:`refspec.harness.mla_scenario.TINY_DIMS`).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.core.mla import DEEPSEEK_V3_DIMS
from refspec.core.tolerance import t0, t1
from refspec.fa3 import kernel
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.graphs.capture import make_graph
from refspec.harness import tree_scenario as ts
from refspec.harness.mla_scenario import TINY_DIMS, mla_draft_setup, mla_mode_scenarios, mla_verify_setup
from refspec.harness.modes import MODES
from refspec.oracle.backend import OracleBackend
from refspec.oracle.slots import attention_over_slots

MLA_PAGE_SIZES = (1, 4, 16, 64)
QUICK_MLA_PAGE_SIZES = (1, 16)
GRAPHED = ["DECODE", "DRAFT_DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2"]
TREE_LENS = [5, 67, 130]
SLOT0 = -3.0  #: written into slot 0 before a replay: the padded row must leave it (ML-002)


def _dims(device):
    return DEEPSEEK_V3_DIMS if device == "cuda" else TINY_DIMS


def _dtypes(device, quick):
    dts = [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.bfloat16]
    return dts[-1:] if quick else dts


def _refused(prov) -> str | None:
    """Why ``prov`` cannot run MLA (ML-013), or None."""
    problem = kernel.mla_kernel_problem(prov, "qv")
    return None if problem is None else f"ML-013: {problem}"


# ---------------------------------------------------------------- chain modes
def _eager_verdict(label, sc, prov):
    b = sc.build()
    if label == "EXTEND":  # no cached prefix: the non-absorbed prefill (ML-009, ML-010)
        q, k, v, fb = b.mha_pass_inputs(seed=sc.page_size)
        outs = []
        for be in (OracleBackend(b.pool, b.kv, out_dtype=torch.float32), OracleBackend(b.pool, b.kv, upcast=False),
                   FlashAttentionBackend(b.pool, b.kv, provider=prov)):
            be.init_forward_metadata(fb)
            outs.append(be.forward(q, k, v, b.mha_layer, fb))
        return t1(outs[2], outs[0], outs[1])
    return t1(b.run_fa3(provider=prov), b.run_oracle(), b.run_oracle(upcast=False))


def _graph_verdicts(sc, prov):
    b = sc.build()
    assert b.fb.batch_size == 3
    ref, low = b.run_oracle(), b.run_oracle(upcast=False)
    eager = b.run_fa3(provider=prov)
    row = b.pool.get_key_buffer(0)
    row[0] = SLOT0
    runner = b.graph_runner(capture_bs=(2, 4), provider=prov)
    graph = b.run_fa3_graph(runner)
    assert runner.graph_bs(3) == 4  # the live batch of 3 runs padded
    if not bool((row[0] == SLOT0).all()):
        raise AssertionError("a padded row wrote slot 0 (ML-002)")
    if graph.is_cuda:  # the real kernel may split KV differently at Bg = 4 (CG-009)
        return t1(graph, eager.float(), low), t1(graph, ref, low)
    return t0(graph, eager), t1(graph, ref, low)


# ---------------------------------------------------------------- top-k 2: the MLA cascade
def _slot_oracle(q, q_rope, pool, slots, layer):
    """(fp32, low-precision) absorbed attention of ``[q | q_rope]`` over each row's ``slots`` of the
    latent rows, value their first Dv columns, the layer's scale (ML-007)."""
    rows, Dv, scale = pool.get_key_buffer(0), layer.v_head_dim, layer.scaling
    qq = torch.cat([q, q_rope], -1)
    return (attention_over_slots(qq, rows, rows[..., :Dv], slots, softmax_scale=scale, out_dtype=torch.float32),
            attention_over_slots(qq, rows, rows[..., :Dv], slots, softmax_scale=scale, upcast=False))


def _verify_checks(P, dtype, device, prov, graphed):
    """(T1 eager, T0 graph == eager, T1 graph vs oracle) of the MLA tree verify, k = 2, N = 4."""
    N, dims = 4, _dims(device)
    kv, pool, fb, layer, x, slots = mla_verify_setup(P, TREE_LENS, N, seed=P, dims=dims, dtype=dtype, device=device)
    fwd = lambda be, fb, x: be.forward(x["q"], x["k"], x["k"], layer, fb, q_rope=x["q_rope"], k_rope=x["k_rope"])
    be = FlashAttentionTreeBackend(pool, kv, topk=2, num_draft_tokens=N, provider=prov)
    be.init_forward_metadata(fb)
    eager = t1(fwd(be, fb, x), *_slot_oracle(x["q"], x["q_rope"], pool, slots, layer))
    if not graphed:
        return eager, None, None
    static = {n: t.clone() for n, t in x.items()}
    graph = make_graph(torch.device(device))
    graph.capture(lambda: fwd(be, fb, static))
    gen = torch.Generator().manual_seed(100 + P)  # a new tree over the same slots, new queries: in place
    rows = fb.req_pool_indices.tolist()
    fb2, slots2 = ts.tree_batch(kv, rows, TREE_LENS, N, [ts.random_parents(N, gen) for _ in TREE_LENS], device)
    R = kv.req_to_token
    new = (tm.verify_prefix_metadata(fb2.seq_lens, fb2.seq_lens_cpu, fb2.req_pool_indices, R, N, P),
           tm.verify_expand_metadata(fb2.custom_mask, fb2.seq_lens, fb2.req_pool_indices, R, N))
    for old, nw in zip((be.forward_metadata, be.forward_metadata_spec_decode_expand), new):
        for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"):
            getattr(old, name).copy_(getattr(nw, name))
    for n in ("q", "q_rope"):
        static[n].copy_(torch.randn(x[n].shape, generator=gen).to(device=device, dtype=dtype))
    replay = graph.replay().clone()
    again_be = FlashAttentionTreeBackend(pool, kv, topk=2, num_draft_tokens=N, provider=prov)
    again_be.init_forward_metadata(fb2)
    again = fwd(again_be, fb2, {n: t.clone() for n, t in static.items()})
    ref, low = _slot_oracle(static["q"], static["q_rope"], pool, slots2, layer)
    same = t1(replay, again.float(), low) if replay.is_cuda else t0(replay, again)
    return eager, same, t1(replay, ref, low)


def _draft_checks(P, dtype, device, prov, graphed):
    """The same three verdicts for every draft-decode step of the MLA tree draft (k = 2, Sd = 4)."""
    topk, S, dims = 2, 4, _dims(device)
    kv, pool, fb, layer, rws, loc = mla_draft_setup(P, TREE_LENS, topk, S, seed=P, dims=dims, dtype=dtype,
                                                    device=device)
    Dv, H, T = layer.v_head_dim, layer.num_heads, len(TREE_LENS) * topk
    cache_loc = loc.view(-1, S)
    gen = torch.Generator().manual_seed(P)
    rnd = lambda *s: torch.randn(s, generator=gen).to(device=device, dtype=dtype)
    out = []
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=topk, num_steps=S, speculative_step_id=s, provider=prov)
        be.init_forward_metadata(fb)
        step = draft_step_batch(fb, s)
        slots = [kv.req_to_token[rws[i // topk], :TREE_LENS[i // topk]].tolist() + cache_loc[i, :s + 1].tolist()
                 for i in range(T)]
        q, q_rope = rnd(T, H, Dv), rnd(T, H, dims.qk_rope_head_dim)
        eager = t1(be.forward(q, None, None, layer, step, q_rope=q_rope), *_slot_oracle(q, q_rope, pool, slots, layer))
        if not graphed:
            out.append((eager, None, None))
            continue
        q_static, qr_static = torch.zeros_like(q), torch.zeros_like(q_rope)
        graph = make_graph(torch.device(device))
        graph.capture(lambda: be.forward(q_static, None, None, layer, step, q_rope=qr_static))
        row = pool.get_key_buffer(0)
        row[loc.long()] = rnd(loc.numel(), 1, pool.kv_cache_dim)  # new latent rows at every step slot, in place
        q_static.copy_(rnd(T, H, Dv))
        qr_static.copy_(rnd(T, H, dims.qk_rope_head_dim))
        replay = graph.replay().clone()
        again = be.forward(q_static.clone(), None, None, layer, step, q_rope=qr_static.clone())
        ref, low = _slot_oracle(q_static, qr_static, pool, slots, layer)
        same = t1(replay, again.float(), low) if replay.is_cuda else t0(replay, again)
        out.append((eager, same, t1(replay, ref, low)))
    return tuple(zip(*out))


# ---------------------------------------------------------------- the rows
def mla_rows(device, page_sizes, quick, *, row, guard, providers):
    """The rows (``row`` / ``guard`` / ``providers`` are check.py's helpers; ``page_sizes`` is
    not used: MLA keeps its own, module doc)."""
    Ps = QUICK_MLA_PAGE_SIZES if quick else MLA_PAGE_SIZES
    dims = _dims(device)
    for P in Ps:
        for prov in providers(device):
            refused = _refused(prov)
            graphable = not (device == "cuda" and prov == "emulator")  # the emulator syncs with the host
            if refused:
                for label in MODES:
                    yield row("mla", label, P, prov, "T1 vs oracle", skip=refused)
                for label in ("TREE_VERIFY k=2", "TREE_DRAFT k=2"):
                    yield row("mla", label, P, prov, "T1 eager vs oracle", skip=refused)
                continue
            verdicts, errors = {m: [] for m in MODES}, {}
            graph0, graph1 = {m: [] for m in GRAPHED}, {m: [] for m in GRAPHED}
            for dt in _dtypes(device, quick):
                scs = mla_mode_scenarios(P, dims=dims, num_heads=4, dtype=dt, device=device, seed=P)
                for label, sc in scs.items():
                    got = guard(lambda: _eager_verdict(label, sc, prov))
                    if isinstance(got, Exception):
                        errors.setdefault(label, f"{type(got).__name__}: {got}")
                    else:
                        verdicts[label].append(got)
                    if label in GRAPHED and graphable:
                        got = guard(lambda: _graph_verdicts(sc, prov))
                        if isinstance(got, Exception):
                            errors.setdefault(("graph", label), f"{type(got).__name__}: {got}")
                        else:
                            graph0[label].append(got[0])
                            graph1[label].append(got[1])
            for label in MODES:
                yield row("mla", label, P, prov, "T1 vs oracle", verdicts[label], error=errors.get(label))
            for label in GRAPHED if graphable else ():
                err = errors.get(("graph", label))
                yield row("mla", label, P, prov, "graph == eager", graph0[label], error=err)
                yield row("mla", label, P, prov, "T1 graph vs oracle", graph1[label], error=err)
            dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as the tree section
            for label, fn in (("TREE_VERIFY k=2", _verify_checks), ("TREE_DRAFT k=2", _draft_checks)):
                got = guard(lambda: fn(P, dtype, device, prov, graphable))
                if isinstance(got, Exception):
                    yield row("mla", label, P, prov, "T1 eager vs oracle", error=f"{type(got).__name__}: {got}")
                    continue
                eager, same, vs = (g if isinstance(g, tuple) else (g,) for g in got)
                yield row("mla", label, P, prov, "T1 eager vs oracle", list(eager))
                if graphable:
                    yield row("mla", label, P, prov, "graph == eager", list(same))
                    yield row("mla", label, P, prov, "T1 graph vs oracle", list(vs))

