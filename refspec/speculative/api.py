"""``generate``: one call for the oracle loop or the production loop, same arguments, same result.

    res = generate(model, prompts, backend="fa3", version="v2", page_size=16, graphs=True,
                   draft="eagle", drafter="perfect", num_steps=3, max_new_tokens=32)
    res.tokens, res.accepts, res.accept_length, res.host_syncs, res.trace

so that "oracle loop == production loop" and "speculative == plain greedy" are one-line tests.
"""

from __future__ import annotations

import torch

from refspec.core.args import count, int_list, is_int, tree_args
from refspec.oracle.loop import greedy, speculative_greedy
from refspec.oracle.tree_loop import speculative_tree_greedy
from refspec.speculative.accept import ScriptedAccept
from refspec.speculative.drafters import make_drafter
from refspec.model.drafts import make_draft
from refspec.speculative.engine import Engine
from refspec.speculative.metrics import GenerateResult, RequestResult

BACKENDS = ("oracle", "fa3", "paged-oracle")


def greedy_reference(model, prompts, max_new_tokens, eos=None) -> dict[int, list[int]]:
    """``rid -> prompt + plain greedy output`` (the reference the test drafters read)."""
    _check_args(model, prompts, 1, 1, None)
    _check_eos(eos, model.config.vocab_size)
    budgets = _budgets(prompts, max_new_tokens, model.config.max_position_embeddings)
    return {i: list(p) + greedy(model, p, m, eos).tokens for i, (p, m) in enumerate(zip(prompts, budgets))}


def _budgets(prompts, max_new_tokens, max_positions: int | None = None) -> list[int]:
    """One budget per prompt (tokens); ValueError naming ``max_new_tokens`` if any is not an int in
    ``[1, max_positions - len(prompt)]`` (the model's ``max_position_embeddings``)."""
    if is_int(max_new_tokens):
        budgets = [max_new_tokens] * len(prompts)
    elif not isinstance(max_new_tokens, (list, tuple)) or len(max_new_tokens) != len(prompts):
        raise ValueError(f"max_new_tokens: one int, or one per prompt ({len(prompts)}), got {max_new_tokens!r}")
    else:
        budgets = list(max_new_tokens)
    bad = [m for m in budgets if not is_int(m) or m < 1]
    if bad:
        raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {bad}")
    if max_positions is not None:
        over = [i for i, (p, m) in enumerate(zip(prompts, budgets)) if len(p) + m > max_positions]
        if over:
            raise ValueError(f"max_new_tokens: prompts {over} would run past the model's max_position_embeddings "
                             f"= {max_positions} (prompt + max_new_tokens tokens)")
    return [int(m) for m in budgets]


def _check_args(target, prompts, num_steps, page_size, arrivals) -> None:
    """ValueError naming the first bad argument of :func:`generate` (every backend alike)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    V = target.config.vocab_size
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {p!r}")
        if not all(is_int(t) and 0 <= t < V for t in p):
            raise ValueError(f"prompts[{i}] has token ids outside [0, vocab_size = {V}): "
                             f"{[t for t in p if not (is_int(t) and 0 <= t < V)]}")
    count("num_steps (Sd)", num_steps, 1)
    count("page_size", page_size, 1)
    if arrivals is not None:
        int_list("arrivals (one step per prompt)", arrivals, length=len(prompts), least=0)


def _check_eos(eos, vocab_size: int) -> None:
    """ValueError unless ``eos`` is None or a token id of the vocabulary."""
    if eos is not None and not (is_int(eos) and 0 <= eos < vocab_size):
        raise ValueError(f"eos must be None or a token id in [0, vocab_size = {vocab_size}), got {eos!r}")


def generate(target, prompts: list[list[int]], *, backend: str = "fa3", version: str = "v1", page_size: int = 1,
             graphs: bool = False, draft="eagle", drafter=None, num_steps: int = 3, max_new_tokens=16,
             eos: int | None = None, accept=None, reference: dict | None = None, capture_bs=(1, 2, 4, 8),
             max_batch: int | None = None, arrivals: list[int] | None = None, provider: str | None = None,
             validate: bool = True, observer=None, shuffle_pages: int | None = 0, pool_fill: float = 0.0,
             draft_seed: int = 1, topk: int = 1, num_draft_tokens: int | None = None,
             overlap: bool | None = None) -> GenerateResult:
    """Speculative greedy generation of every prompt (request id = index in ``prompts``).

    Args:
        target: :class:`~refspec.model.llama.LlamaModel`, or :class:`~refspec.model.deepseek.DeepseekModel`
            (MLA: latent KV pools, :mod:`refspec.speculative.engine`); its device / dtype are used.
        backend: "oracle" (dense per-request loop, :mod:`refspec.oracle.loop`), "fa3" (the
            production loop with the FA3 wing), "paged-oracle" (the production loop with the
            paged oracle attention, eager).
        version: "v1" / "v2".  page_size: P.  graphs: CUDA graphs (fa3 only).
        draft: "eagle", "early-exit[:k]", "mtp" (a DeepSeek target's MTP layer), a small
            :class:`LlamaModel`, or a draft object (:func:`refspec.model.drafts.make_draft`).
        drafter: None (the draft's argmax), "perfect", "adversarial", "random", or a Drafter.
        num_steps: Sd.  max_new_tokens: int or one per prompt.  eos: stop token (emitted).
        topk: k branches per draft step (EAGLE top-k tree, docs/spec/tree.md); 1 = the chain.
        num_draft_tokens: N tree nodes verified per round, root included; default Sd + 1 (the
            only value at k = 1, SD-010); needed for k > 1, with ``N - 1 <= k + (Sd-1) k^2``
            (TR-002).  k > 1 runs with backend "oracle" or "fa3" (the production
            :class:`~refspec.speculative.tree.engine.TreeEngine`), v1 or v2; overlap only with v2
            and only when asked (``overlap=True``; None = off for trees), no drafter / accept.
        accept: a ``(rid, k) -> a`` hook or ``{rid: [a, ...]}`` (scripted acceptance).
        reference: ``rid -> prompt + greedy`` for the drafters (computed when needed and absent,
            N tokens past each budget so that even the last round's drafts are known).
        max_batch, arrivals: continuous batching (default: everything at once).
        observer, shuffle_pages, pool_fill, provider, validate, capture_bs, overlap: see
            :class:`~refspec.speculative.engine.Engine` (overlap: None = on for v2 on CUDA;
            the oracle loop ignores it).
    Returns: :class:`~refspec.speculative.metrics.GenerateResult`.
    Raises: ValueError for a bad argument (empty ``prompts`` or prompt, a token id outside the
    vocabulary, ``max_new_tokens`` / ``num_steps`` / ``page_size`` < 1, ``arrivals`` not one
    step >= 0 per prompt, unknown backend / version, a bad topk / num_draft_tokens);
    InvariantError from the loop's checks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_args(target, prompts, num_steps, page_size, arrivals)
    _check_eos(eos, target.config.vocab_size)
    budgets = _budgets(prompts, max_new_tokens, target.config.max_position_embeddings)
    num_draft_tokens = tree_args(topk, num_steps, num_draft_tokens)
    if topk > 1 and backend == "oracle":
        return _generate_tree(target, prompts, budgets, backend=backend, version=version, draft=draft,
                              drafter=drafter, accept=accept, num_steps=num_steps, topk=topk,
                              num_draft_tokens=num_draft_tokens, eos=eos, draft_seed=draft_seed)
    if isinstance(accept, dict):
        accept = ScriptedAccept(accept)
    if isinstance(drafter, str) and reference is None:  # N extra tokens: the last round's drafts too
        reference = greedy_reference(target, prompts, [b + num_steps + 1 for b in budgets], eos)
    drafter = make_drafter(drafter, reference, target.config.vocab_size)
    dm = make_draft(draft, target, seed=draft_seed)
    if backend == "oracle":
        with torch.no_grad():
            outs = [speculative_greedy(target, dm, p, num_steps=num_steps, max_new_tokens=m, version=version,
                                       eos=eos, drafter=drafter, accept=accept, rid=i)
                    for i, (p, m) in enumerate(zip(prompts, budgets))]
        reqs = [RequestResult(i, o.tokens, o.accepts, o.emitted, o.drafts,
                              "eos" if eos is not None and o.tokens[-1] == eos else "length")
                for i, o in enumerate(outs)]
        return GenerateResult(reqs, backend, version)
    engine, tree_kw = Engine, {}
    if topk > 1:  # the production top-k > 1 loop (refspec.speculative.tree.engine)
        from refspec.speculative.tree.engine import TreeEngine
        if backend != "fa3":
            raise ValueError(f"topk = {topk} > 1 runs on backend 'oracle' or 'fa3', got {backend!r}")
        engine, tree_kw = TreeEngine, dict(topk=topk, num_draft_tokens=num_draft_tokens)
    eng = engine(target, dm, version=version, num_steps=num_steps, page_size=page_size,
                 max_context=max(len(p) for p in prompts) + max(budgets),
                 max_batch=len(prompts) if max_batch is None else max_batch,
                 attention="fa3" if backend == "fa3" else "oracle", graphs=graphs, capture_bs=capture_bs,
                 provider=provider, validate=validate, drafter=drafter, accept=accept, eos=eos,
                 observer=observer, shuffle_pages=shuffle_pages, pool_fill=pool_fill, overlap=overlap, **tree_kw)
    for i, (p, m) in enumerate(zip(prompts, budgets)):
        eng.add_request(i, p, m, arrival=arrivals[i] if arrivals else 0)
    eng.run()
    by_rid = {r.rid: r for r in eng.done}
    reqs = [RequestResult(i, r.output, r.accepts, r.emitted, r.drafts, r.finish_reason)
            for i, r in sorted(by_rid.items())]
    return GenerateResult(reqs, backend, version, trace=eng.trace, host_syncs=dict(eng.syncs),
                          free_pages=(eng.free_pages_at_start, eng.kv.allocator.num_free_pages),
                          forwards=dict(eng.runners.counts))


# ---------------------------------------------------------------- top-k > 1 (EAGLE trees)
def _generate_tree(target, prompts, budgets, *, backend, version, draft, drafter, accept, num_steps, topk,
                   num_draft_tokens, eos, draft_seed) -> GenerateResult:
    """k > 1 on the oracle: :func:`refspec.oracle.tree_loop.speculative_tree_greedy` per request."""
    if drafter is not None or accept is not None:
        raise ValueError("topk > 1: drafter / accept overrides are not supported (the tree comes from the draft)")
    dm = make_draft(draft, target, seed=draft_seed)
    with torch.no_grad():
        outs = [speculative_tree_greedy(target, dm, p, num_steps=num_steps, topk=topk,
                                        num_draft_tokens=num_draft_tokens, max_new_tokens=m, version=version,
                                        eos=eos, rid=i)
                for i, (p, m) in enumerate(zip(prompts, budgets))]
    reqs = [RequestResult(i, o.tokens, o.accepts, o.emitted, o.drafts,
                          "eos" if eos is not None and o.tokens[-1] == eos else "length")
            for i, o in enumerate(outs)]
    return GenerateResult(reqs, backend, version)
