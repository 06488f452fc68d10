"""``python -m refspec check --sections tree``: the FA3 top-k > 1 path, one row per check.

Rows, for k in (2, 4) (and 8 on CUDA), P in (1, 4, 16, 64):

* ``TREE_VERIFY`` / ``TREE_DRAFT`` (every draft step), eager: the cascade (prefix + expand +
  LSE merge) vs the fp32 slot oracle, T1 (TOL-002), per provider;
* the same, graphed: captured once, the metadata (a new tree) or the KV rewritten in place and
  replayed: T0 vs the eager run of the new inputs on CPU (T1 on CUDA, where the real kernel may
  pick another split), and T1 vs the oracle (TR-018);
* ``TREE_LOOP`` (CPU): the production top-k loop, v1 and v2 (TR-020, TR-021), eager and
  graphed, emits plain greedy's tokens (fp32, bitwise) and the oracle tree loop's accept counts
  (same version, TR-019).  On CUDA the loop is checked by ``tests/test_gpu_tree.py`` (bf16, T2)
  and the row says so.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.core.tolerance import Verdict, t0, t1
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.graphs.capture import make_graph
from refspec.harness import tree_scenario as ts
from refspec.oracle.slots import attention_over_slots

TREE_PAGE_SIZES = (1, 4, 16, 64)
N_FOR_K = {2: 4, 4: 8, 8: 16}
LENS = [5, 67, 130]


def _oracle(q, pool, slots):
    k, v = pool.get_flat_kv(0)
    return (attention_over_slots(q, k, v, slots, out_dtype=torch.float32),
            attention_over_slots(q, k, v, slots, upcast=False))


def _head_dim(device) -> int:
    """64 on CUDA (a head dim the FA3 build has), the scenarios' small default elsewhere."""
    return 64 if device == "cuda" else ts.D


def _verify_checks(P, k, dtype, device, prov, graphed=True):
    """(T1 eager, T0/T1 graph == eager, T1 graph vs oracle) for tree verify; graph ones None unless ``graphed``."""
    N, hd = N_FOR_K[k], _head_dim(device)
    lay = ts.layer(hd)
    kv, pool, fb, q, slots, rows = ts.verify_setup(P, LENS, N, seed=P + k, device=device, dtype=dtype, head_dim=hd)
    be = FlashAttentionTreeBackend(pool, kv, topk=k, num_draft_tokens=N, provider=prov)
    be.init_forward_metadata(fb)
    out = be.forward(q, None, None, lay, fb)
    eager = t1(out, *_oracle(q, pool, slots))
    if not graphed:
        return eager, None, None
    q_static = q.clone()
    graph = make_graph(torch.device(device))
    graph.capture(lambda: be.forward(q_static, None, None, lay, fb))
    gen = torch.Generator().manual_seed(100 + P)
    fb2, slots2 = ts.tree_batch(kv, rows, LENS, N, [ts.random_parents(N, gen) for _ in LENS], device)
    R = kv.req_to_token
    new = (tm.verify_prefix_metadata(fb2.seq_lens, fb2.seq_lens_cpu, fb2.req_pool_indices, R, N, P),
           tm.verify_expand_metadata(fb2.custom_mask, fb2.seq_lens, fb2.req_pool_indices, R, N))
    for old, nw in zip((be.forward_metadata, be.forward_metadata_spec_decode_expand), new):
        for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"):
            getattr(old, name).copy_(getattr(nw, name))
    q2 = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    q_static.copy_(q2)
    replay = graph.replay().clone()
    ref_eager = FlashAttentionTreeBackend(pool, kv, topk=k, num_draft_tokens=N, provider=prov)
    ref_eager.init_forward_metadata(fb2)
    again = ref_eager.forward(q2, None, None, lay, fb2)
    ref, low = _oracle(q2, pool, slots2)
    same = t1(replay, again.float(), low) if replay.is_cuda else t0(replay, again)
    return eager, same, t1(replay, ref, low)


def _draft_checks(P, k, dtype, device, prov, graphed=True):
    """The same three verdicts for every draft-decode step (worst over steps)."""
    S, hd = 4, _head_dim(device)
    lay = ts.layer(hd)
    kv, pool, fb, rows, loc = ts.draft_setup(P, LENS, k, S, seed=P + 7 * k, device=device, dtype=dtype,
                                             head_dim=hd)
    gen = torch.Generator().manual_seed(k)
    out = []
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=k, num_steps=S, speculative_step_id=s, provider=prov)
        be.init_forward_metadata(fb)
        step = draft_step_batch(fb, s)
        slots = [kv.req_to_token[rows[i // k], :LENS[i // k]].tolist() + loc.view(-1, S)[i, :s + 1].tolist()
                 for i in range(len(LENS) * k)]
        q = torch.randn((len(LENS) * k, ts.H, hd), generator=gen).to(device=device, dtype=dtype)
        eager = t1(be.forward(q, None, None, lay, step), *_oracle(q, pool, slots))
        if not graphed:
            out.append((eager, None, None))
            continue
        q_static = torch.zeros_like(q)
        graph = make_graph(torch.device(device))
        graph.capture(lambda: be.forward(q_static, None, None, lay, step))
        ts.write_random(pool, loc, gen)  # new KV at every step slot, in place
        q2 = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
        q_static.copy_(q2)
        replay = graph.replay().clone()
        again = be.forward(q2, None, None, lay, step)
        ref, low = _oracle(q2, pool, slots)
        same = t1(replay, again.float(), low) if replay.is_cuda else t0(replay, again)
        out.append((eager, same, t1(replay, ref, low)))
    return tuple(zip(*out))


def _loop_ok(P, k, graphs, version):
    from refspec.model.drafts import make_draft
    from refspec.model.llama import LlamaModel, init_random_, tiny_config
    from refspec.oracle.loop import greedy
    from refspec.oracle.tree_loop import speculative_tree_greedy
    from refspec.speculative.tree.engine import TreeEngine

    m = init_random_(LlamaModel(tiny_config()), seed=0).eval()
    d = make_draft(m, m)
    prompts, budgets, N = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 3, 3]], [14, 10, 12], N_FOR_K[k]
    eng = TreeEngine(m, d, topk=k, num_draft_tokens=N, num_steps=3, page_size=P, max_context=48, max_batch=3,
                     provider="emulator", shuffle_pages=P, graphs=graphs, capture_bs=(1, 2, 4), version=version)
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        eng.add_request(i, p, b)
    eng.run()
    for r in sorted(eng.done, key=lambda r: r.rid):
        o = speculative_tree_greedy(m, d, r.prompt, num_steps=3, topk=k, num_draft_tokens=N,
                                    max_new_tokens=r.max_new_tokens, version=version)
        if r.output != greedy(m, r.prompt, r.max_new_tokens).tokens:
            raise AssertionError(f"request {r.rid}: tokens differ from plain greedy")
        if r.accepts != o.accepts:
            raise AssertionError(f"request {r.rid}: accepts {r.accepts} != the oracle tree loop's {o.accepts}")
    if eng.kv.allocator.num_free_pages != eng.free_pages_at_start:
        raise AssertionError("pages leaked (KV-006)")
    return Verdict(True, 0.0, 0.0)


def tree_rows(device, page_sizes, quick, *, row, guard, providers):
    """The rows (``row`` / ``guard`` / ``providers`` are check.py's helpers)."""
    Ps = (1, 16) if quick else TREE_PAGE_SIZES
    ks = (2, 4, 8) if device == "cuda" and not quick else (2, 4)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for P in Ps:
        for k in ks:
            for prov in providers(device):
                graphable = not (device == "cuda" and prov == "emulator")  # the emulator syncs with the host
                for label, fn in (("TREE_VERIFY", _verify_checks), ("TREE_DRAFT", _draft_checks)):
                    got = guard(lambda: fn(P, k, dtype, device, prov, graphable))
                    mode = f"{label} k={k}"
                    if isinstance(got, Exception):
                        err = f"{type(got).__name__}: {got}"
                        yield row("tree", mode, P, prov, "T1 eager vs oracle", error=err)
                        continue
                    eager, same, vs = (g if isinstance(g, tuple) else (g,) for g in got)
                    yield row("tree", mode, P, prov, "T1 eager vs oracle", list(eager))
                    if graphable:
                        yield row("tree", mode, P, prov, "graph == eager", list(same))
                        yield row("tree", mode, P, prov, "T1 graph vs oracle", list(vs))
            for version, graphs in ((v, g) for v in ("v1", "v2") for g in (False, True)):
                check = f"lossless {version}, {'graphs' if graphs else 'eager'}"
                if device == "cuda":
                    yield row("tree", f"TREE_LOOP k={k}", P, "-", check, skip="GPU: tests/test_gpu_tree.py (T2)")
                    continue
                got = guard(lambda: _loop_ok(P, k, graphs, version))
                yield row("tree", f"TREE_LOOP k={k}", P, "emulator", check,
                          *(() if isinstance(got, Exception) else ([got],)),
                          error=f"{type(got).__name__}: {got}" if isinstance(got, Exception) else None)
