"""The probes of the FA3 top-k > 1 variants (:mod:`refspec.mutants.tree_variants`).

Same contract as :mod:`refspec.mutants.probes`: ``run(env, found, validate)`` drives the
production tree wing (``validate`` passed to its backends) and appends what the suite-side checks
see to ``found``; a production error propagates.  Every expected value comes from the rule as
data: the parent lists the scenario drew, the slot oracle (:func:`refspec.oracle.slots.attention_over_slots`),
hand-derived key slots, or the eager metadata (the graph-replay probe), never from the seam a
variant replaces.  :data:`TREE_PROBES` maps a variant name to ``(label, run)`` pairs
(:mod:`refspec.mutants.probes` wraps them as ``Probe`` s).

Which path each probe drives (a variant's reach, :mod:`refspec.mutants.reach`, is counted on it):
``verify_probe`` and ``draft_probe`` the eager backends (metadata from ``custom_mask`` and
``draft_cache_loc``); ``verify_graph_probe`` the graphed tree verify, whose expand metadata the
captured graph builds itself from the tree builder's mask rows (``TreeGraphRunner``, one
attention layer as the captured forward); ``draft_replay_probe`` the draft expand replay write;
``loop_probe`` the whole production loop, eager or (``graphs=True``) with every tree phase
replayed.

On CUDA the attention probes run in bf16 through the real kernel at head dim 64 (the graphed
verify probe under a real CUDA graph); the draft-replay metadata probe stays on CPU tensors (its
wrong variant writes past a buffer: on a GPU that is a device-side fault that would end the whole
run); the loop probes are CPU only (they compare fp32 token streams bitwise;
``tests/test_gpu_tree.py`` checks the GPU loop under T2).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.core.tolerance import t1
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.harness import tree_scenario as ts
from refspec.mutants.checks import Env, Symptom
from refspec.oracle.slots import attention_over_slots
from refspec.speculative.tree import graphs as tree_graphs

LENS = [5, 67, 130]  #: committed lengths: a short row, rows over several pages, partial last pages at P = 4


def _head_dim(env: Env) -> int:
    return 64 if env.device == "cuda" else ts.D


def _mismatch(found, env, out, q, pool, slots, inv, what) -> None:
    """T1 (TOL-002) of ``out`` vs the slot oracle over ``slots``; a ``mismatch`` naming ``inv`` if out of budget."""
    k, v = pool.get_flat_kv(0)
    ref = attention_over_slots(q, k, v, slots, out_dtype=torch.float32)
    low = None if env.dtype == torch.float32 else attention_over_slots(q, k, v, slots, upcast=False)
    verdict = t1(out, ref, low)
    if not verdict.ok:
        found.append(Symptom("mismatch", inv, f"{what} vs the slot oracle: {verdict}", verdict.err, verdict.pct))


def verify_probe(env: Env, found: list, validate: bool) -> None:
    """TREE_VERIFY eager, P = 4, k = 4, N = 8, B = 3 random trees: the mask rows (TR-004), the
    expand reads (TR-011) and the merged output (TR-012) against the parents the scenario drew."""
    P, N, hd = 4, 8, _head_dim(env)
    gen = torch.Generator().manual_seed(11)
    kv, pool = ts.make_cache(P, len(LENS), max(LENS) + N, 11, env.device, env.dtype, hd)
    rows = [kv.alloc_req() for _ in LENS]
    kv.alloc_extend(rows, [0] * len(LENS), [L + N for L in LENS])
    for r, L in zip(rows, LENS):
        ts.write_random(pool, kv.req_to_token[r, :L + N], gen)
    parents = [ts.random_parents(N, gen) for _ in LENS]
    fb, slots = ts.tree_batch(kv, rows, LENS, N, parents, env.device)
    fb.topk = 4
    q = torch.randn((len(LENS) * N, ts.H, hd), generator=gen).to(device=env.device, dtype=env.dtype)
    rows_mask = tm.verify_mask_rows(fb.custom_mask, fb.seq_lens, N).tolist()
    for t, row in enumerate(rows_mask):
        want = ts.ancestors_and_self(parents[t // N], t % N)
        if [j for j in range(N) if row[j]] != want:
            found.append(Symptom("check", "TR-004", f"request {t // N} node {t % N}: mask row sees "
                                 f"{[j for j in range(N) if row[j]]}, itself + ancestors are {want}"))
            break
    be = FlashAttentionTreeBackend(pool, kv, topk=4, num_draft_tokens=N, provider=env.provider, validate=validate)
    be.init_forward_metadata(fb)
    md = be.forward_metadata_spec_decode_expand
    K, table = md.cache_seqlens_int32.tolist(), md.page_table.tolist()
    for t, (k_t, want) in enumerate(zip(K, slots)):
        if sorted(table[t][:k_t]) != sorted(want[LENS[t // N]:]):
            found.append(Symptom("check", "TR-011", f"expand row {t} reads slots {table[t][:k_t]}, its tree "
                                 f"keys are {want[LENS[t // N]:]}"))
            break
    out = be.forward(q, None, None, ts.layer(hd), fb)
    _mismatch(found, env, out, q, pool, slots, "TR-012", "tree verify (prefix + expand, LSE merge)")


class _VerifyGraphHost:
    """What :class:`~refspec.speculative.tree.graphs.TreeGraphRunner` reads of a
    :class:`~refspec.speculative.tree.runners.TreeRunners` for its verify graph, with ONE attention
    layer as the captured forward (the query rows come from the static buffer ``q``, an input like
    any other): the graph's metadata work, its padding and its replay are the production ones."""

    def __init__(self, kv, be, layer, q, topk: int, num_draft_tokens: int):
        self.kv, self.tree_verify_be, self.layer, self.q = kv, be, layer, q
        self.topk, self.num_draft_tokens, self.Sd = topk, num_draft_tokens, 1

    def _tree_verify_fn(self, fb, x):
        return (self.tree_verify_be.forward(self.q[:fb.out_cache_loc.shape[0]], None, None, self.layer, fb),)


def verify_graph_probe(env: Env, found: list, validate: bool) -> None:
    """TREE_VERIFY graph replay, P = 4, k = 4, N = 8, B = 3 random trees in Bg = 4: the expand
    metadata the captured graph built (TR-011: each real row reads exactly its ancestors' and its
    own verify slots) and the merged output (TR-012) against the parents the scenario drew.  The
    live batch carries the builder's mask rows (``tree_mask``, built here from the parents by
    hand), as the production rounds' batches do, so replay never extracts rows from the flat mask."""
    P, N, k, hd = 4, 8, 4, _head_dim(env)
    gen = torch.Generator().manual_seed(11)
    kv, pool = ts.make_cache(P, len(LENS), max(LENS) + N, 11, env.device, env.dtype, hd)
    rows = [kv.alloc_req() for _ in LENS]
    kv.alloc_extend(rows, [0] * len(LENS), [L + N for L in LENS])
    for r, L in zip(rows, LENS):
        ts.write_random(pool, kv.req_to_token[r, :L + N], gen)
    parents = [ts.random_parents(N, gen) for _ in LENS]
    fb, slots = ts.tree_batch(kv, rows, LENS, N, parents, env.device)
    mask = [[j in ts.ancestors_and_self(par, i) for j in range(N)] for par in parents for i in range(N)]
    live = fb.replace(topk=k, tree_mask=torch.tensor(mask, dtype=torch.bool, device=env.device))
    q = torch.randn((len(LENS) * N, ts.H, hd), generator=gen).to(device=env.device, dtype=env.dtype)
    be = FlashAttentionTreeBackend(pool, kv, topk=k, num_draft_tokens=N, provider=env.provider, validate=validate)
    layer = ts.layer(hd)
    host = _VerifyGraphHost(kv, be, layer, torch.zeros((4 * N, ts.H, hd), dtype=env.dtype, device=env.device), k, N)
    runner = tree_graphs.TreeGraphRunner(host, "verify", capture_bs=(4,), dtype=env.dtype)
    host.q[:q.shape[0]].copy_(q)
    (out,) = runner.replay(live, {})
    md = be.forward_metadata_spec_decode_expand  # the graph's own buffers, bound at capture
    K, table = md.cache_seqlens_int32.tolist(), md.page_table.tolist()
    for t, want in enumerate(slots):
        tree_slots = want[LENS[t // N]:]
        if K[t] != len(tree_slots) or sorted(table[t][:K[t]]) != sorted(tree_slots):
            found.append(Symptom("check", "TR-011", f"graph replay: expand row {t} reads slots {table[t][:K[t]]}, "
                                 f"its tree keys are {tree_slots}"))
            break
    _mismatch(found, env, out, q, pool, slots, "TR-012", "tree verify graph replay (prefix + expand, LSE merge)")


def draft_probe(env: Env, found: list, validate: bool) -> None:
    """TREE_DRAFT eager, P = 4, k = 2, S = 3, B = 3: the branch tails hold the committed tail
    (TR-015), then every step vs the oracle over the prefix and the row's own steps (TR-008)."""
    P, k, S, hd = 4, 2, 3, _head_dim(env)
    kv, pool, fb, rows, loc = ts.draft_setup(P, LENS, k, S, seed=3, device=env.device, dtype=env.dtype, head_dim=hd)
    kf, vf = pool.get_flat_kv(0)
    steps = loc.view(-1, S).tolist()
    same = lambda a, b: bool(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))  # noqa: E731  (NaN == NaN)
    for i, s0 in enumerate(row[0] for row in steps):
        b, L = i // k, LENS[i // k]
        lp = L % P
        tail, mine = kv.req_to_token[rows[b], L - lp:L].long(), torch.arange(s0 - lp, s0, device=loc.device)
        if not (same(kf[mine], kf[tail]) and same(vf[mine], vf[tail])):
            found.append(Symptom("check", "TR-015", f"request {b} branch {i % k}: slots {mine.tolist()} do not hold "
                                 f"the committed tail (slots {tail.tolist()})"))
    gen = torch.Generator().manual_seed(5)
    for s in range(S - 1):
        be = FlashAttentionTreeBackend(pool, kv, topk=k, num_steps=S, speculative_step_id=s, provider=env.provider,
                                       validate=validate)
        be.init_forward_metadata(fb)
        q = torch.randn((len(LENS) * k, ts.H, hd), generator=gen).to(device=env.device, dtype=env.dtype)
        slots = [kv.req_to_token[rows[i // k], :LENS[i // k]].tolist() + steps[i][:s + 1] for i in range(len(steps))]
        out = be.forward(q, None, None, ts.layer(hd), draft_step_batch(fb, s))
        _mismatch(found, env, out, q, pool, slots, "TR-008", f"draft decode step {s}")


def draft_replay_probe(env: Env, found: list, validate: bool) -> None:
    """Draft expand metadata replayed in place (TR-018), P = 2, S = 6, k = 2: a branch's steps span
    4 pages, more than the s + 2 columns of the step-s buffer; each replay must equal eager."""
    k, S, P = 2, 6, 2
    _, _, fb, _, loc = ts.draft_setup(P, [5, 8], k, S, seed=2)  # CPU tensors on every device (module doc)
    for s in range(S - 1):
        eager = tm.draft_expand_metadata(loc, fb.seq_lens, s, k, S, P)
        table = torch.zeros((2 * k, s + 2), dtype=torch.int32)
        K = torch.zeros(2 * k, dtype=torch.int32)
        try:
            tree_graphs.replay_draft_expand_table(table, K, loc, fb.seq_lens, s, k, S, P)
        except (RuntimeError, IndexError) as e:  # the in-place write does not fit the captured buffer
            found.append(Symptom("check", "TR-018", f"step {s}: replay into the [{2 * k}, {s + 2}] buffer "
                                 f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
            return
        for t in range(2 * k):
            n = -(-int(eager.cache_seqlens_int32[t]) // P)
            if int(K[t]) != int(eager.cache_seqlens_int32[t]) or not torch.equal(table[t, :n], eager.page_table[t, :n]):
                found.append(Symptom("check", "TR-018", f"step {s} row {t}: replay K {int(K[t])} table "
                                     f"{table[t, :n].tolist()}, eager {eager.page_table[t, :n].tolist()}"))
                return


def loop_probe(env: Env, found: list, validate: bool, graphs: bool = False) -> None:
    """The production top-k loop (k = 2, N = 5, S = 3, P = 4, NaN-poisoned pools, 2 requests) vs
    plain greedy (tokens) and the oracle tree loop (accepts per round), fp32 (TR-019); ``graphs``:
    every tree phase replayed from its captured graph (capture size 2)."""
    from refspec.mutants.engine_probes import EngineUnavailable  # here: engine_probes imports probes, which imports us

    if env.device != "cpu" or env.dtype != torch.float32:
        raise EngineUnavailable("the tree loop probe compares fp32 token streams bitwise: CPU fp32 only "
                                "(tests/test_gpu_tree.py checks the GPU loop under T2)")
    from refspec.model.drafts import make_draft
    from refspec.model.llama import LlamaModel, init_random_, tiny_config
    from refspec.oracle.loop import greedy
    from refspec.oracle.tree_loop import speculative_tree_greedy
    from refspec.speculative.tree.engine import TreeEngine

    key = ("tree-loop-model",)
    if key not in env._refs:
        m = init_random_(LlamaModel(tiny_config()), seed=0).eval()
        d = make_draft(m, m)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
        ref = [(greedy(m, p, 12).tokens,
                speculative_tree_greedy(m, d, p, num_steps=3, topk=2, num_draft_tokens=5, max_new_tokens=12).accepts)
               for p in prompts]
        env._refs[key] = (m, d, prompts, ref)
    m, d, prompts, ref = env._refs[key]
    eng = TreeEngine(m, d, topk=2, num_draft_tokens=5, num_steps=3, page_size=4, max_context=48, max_batch=2,
                     provider="emulator", shuffle_pages=1, pool_fill=float("nan"), validate=validate,
                     graphs=graphs, capture_bs=(2,))
    for i, p in enumerate(prompts):
        eng.add_request(i, p, 12)
    with torch.no_grad():
        eng.run()
    if graphs and eng.runners.counts[("tree_verify", "eager")]:
        found.append(Symptom("check", "TR-018", "the graphed loop ran an eager tree verify"))
    for r in sorted(eng.done, key=lambda r: r.rid):
        tokens, accepts = ref[r.rid]
        if r.output != tokens:
            found.append(Symptom("tokens", "TR-019", f"request {r.rid}: production tree loop tokens differ from "
                                 f"plain greedy"))
        elif r.accepts != accepts:
            found.append(Symptom("accepts", "TR-019", f"request {r.rid}: accepts {r.accepts}, the oracle tree "
                                 f"loop's {accepts}"))


def graphed_loop_probe(env: Env, found: list, validate: bool) -> None:
    """:func:`loop_probe` with every tree phase replayed from its captured graph."""
    loop_probe(env, found, validate, graphs=True)


_VERIFY = ("TREE_VERIFY eager P=4, k=4, N=8, B=3 random trees", verify_probe)
_VERIFY_GRAPH = ("TREE_VERIFY graph replay P=4, k=4, N=8, B=3 in Bg=4", verify_graph_probe)
_LOOP = ("TREE_LOOP k=2 N=5 P=4, 2 requests, NaN pools (CPU)", loop_probe)
_LOOP_GRAPH = ("TREE_LOOP graphed k=2 N=5 P=4, 2 requests (CPU)", graphed_loop_probe)

TREE_PROBES: dict[str, list[tuple[str, object]]] = {
    "tree-mask-sibling-visible": [_VERIFY, _LOOP],
    "expand-reads-prefix-twice": [_VERIFY],
    "lse-merge-no-rescale": [_VERIFY],
    "branch-no-tail-copy": [("TREE_DRAFT eager P=4, k=2, S=3, B=3", draft_probe), _LOOP],
    "draft-expand-unsliced-cache-loc": [("TREE_DRAFT expand replay P=2, k=2, S=6 (CPU tensors)",
                                         draft_replay_probe)],
    "graph-mask-sibling-visible": [_VERIFY_GRAPH, _LOOP_GRAPH],
    "expand-seqlens-all-nodes": [_VERIFY_GRAPH, _VERIFY],
    "expand-table-from-row-start": [_VERIFY_GRAPH, _VERIFY],
}
