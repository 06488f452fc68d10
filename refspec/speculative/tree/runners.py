"""Runners of the production top-k > 1 loop: tree verify and branch draft decode on the FA3 tree backend.

:class:`TreeRunners` extends :class:`~refspec.speculative.runners.SpecRunners` (prefill, draft
prefill and the v1 draft extend are the chain's, unchanged: the a accepted tokens of a tree are a
chain) with

* ``tree_draft``: the S - 1 draft-decode forwards over B*k branch rows, each on the
  :class:`~refspec.fa3.tree_backend.FlashAttentionTreeBackend` of its step, with SGLang's
  per-step top-k expansion between them (``EAGLEWorker.draft_forward``);
* ``tree_verify``: TARGET_VERIFY over the N tree nodes of every request, greedy acceptance and,
  v2, the accepted path's KV move and compaction.

Both run eagerly or, with ``graphs``, replay a captured graph of the same forward function
(:mod:`refspec.speculative.tree.graphs`).  Batch builders for both live here too, in two forms:
the rounds build their batches on the device (:func:`tree_draft_batch_device`,
:func:`tree_verify_batch_device`: lengths that may exist only on the device, no host read);
:func:`tree_draft_batch` and :func:`tree_verify_batch` are the same rules from host lists, the
readable twins.  No round calls the host forms (their callers are the conformance tree cases and
the tests): they are the rule, not a path, and ``tests/test_twins.py`` requires each twin to give
its production twin's batch on random inputs.
"""

from __future__ import annotations

import torch

from refspec.core.future_batch import round_window
from refspec.core.modes import ForwardMode
from refspec.fa3.tree_backend import (
    FlashAttentionTreeBackend,
    TreeDraftBatch,
    TreeVerifyBatch,
    draft_step_batch,
)
from refspec.speculative.tree import kv as tree_kv
from refspec.speculative.runners import SpecRunners
from refspec.speculative.tree.build import (
    draft_topk,
    organize_draft_results,
    select_top_k_tokens_first,
    select_top_k_tokens_later,
)
from refspec.speculative.tree.device import assemble_tree, const_arange, tree_structure, verify_tree_greedy_device


def tree_verify_batch(kv, rows: list[int], seq_lens: list[int], num_draft_tokens: int, topk: int,
                      positions: torch.Tensor, custom_mask: torch.Tensor) -> TreeVerifyBatch:
    """TARGET_VERIFY over the tree: node i of request b writes ``req_to_token[r_b, L_b + i]`` and
    runs at ``positions[b*N + i] = L_b + depth(i)`` (TR-005).

    Readable twin (host lists) of :func:`tree_verify_batch_device`, which the rounds run."""
    N, dev = num_draft_tokens, kv.device
    loc = torch.cat([kv.req_to_token[r, L:L + N].long() for r, L in zip(rows, seq_lens)])
    return TreeVerifyBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor(rows, dtype=torch.long, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), seq_lens_cpu=torch.tensor(seq_lens),
        out_cache_loc=loc, positions=positions.to(dev), num_draft_tokens=N, topk=topk, custom_mask=custom_mask)


def tree_draft_batch(kv, rows: list[int], seq_lens: list[int], topk: int, num_steps: int,
                     draft_cache_loc: torch.Tensor) -> TreeDraftBatch:
    """All draft steps of a round: ``draft_cache_loc`` [B*k*S] (layout [B, k, S]); branch row
    ``b*k + t`` runs step j at RoPE position ``L_b + j`` (its depth j + 1 token, SD-007).

    Readable twin (host lists) of :func:`tree_draft_batch_device`, which the rounds run."""
    dev = kv.device
    pos = torch.tensor([L + j for L in seq_lens for _ in range(topk) for j in range(num_steps)], device=dev)
    return TreeDraftBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(rows, dtype=torch.long, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), seq_lens_cpu=torch.tensor(seq_lens),
        out_cache_loc=draft_cache_loc, positions=pos, topk=topk, num_steps=num_steps,
        draft_cache_loc=draft_cache_loc)


class TreeRunners(SpecRunners):
    """:class:`SpecRunners` plus the tree phases (module doc).

    Args: as :class:`SpecRunners`, plus ``topk`` (k >= 2) and ``num_draft_tokens`` (N).
    ``attention`` must be "fa3".  Raises: ValueError otherwise.
    """

    head = "logits"  # the tree reads the draft-extend top-k (draft_topk), not only the argmax

    def __init__(self, target, draft, kv, target_pool, draft_pool, *, topk, num_draft_tokens, num_steps,
                 attention="fa3", provider=None, validate=True, **kw):
        if attention != "fa3":
            raise ValueError(f"top-k > 1 runs on the FA3 tree backend only, got attention={attention!r}")
        self.topk, self.num_draft_tokens = topk, num_draft_tokens
        self.target_pool, self.draft_pool = target_pool, draft_pool  # the tree forwards move KV inside them
        bkw = dict(topk=topk, provider=provider, validate=validate)
        self.tree_verify_be = FlashAttentionTreeBackend(target_pool, kv, num_draft_tokens=num_draft_tokens, **bkw)
        self.tree_step_bes = [FlashAttentionTreeBackend(draft_pool, kv, num_steps=num_steps, speculative_step_id=s,
                                                        **bkw) for s in range(num_steps - 1)]
        super().__init__(target, draft, kv, target_pool, draft_pool, num_steps=num_steps, attention=attention,
                         provider=provider, validate=validate, **kw)

    def _capture(self, capture_bs, dtype):
        from refspec.speculative.tree.graphs import capture_tree_graphs
        capture_tree_graphs(self, capture_bs, dtype)

    # ---- forward functions (eager and graphed alike) ----
    def _tree_verify_fn(self, fb, x):
        """TARGET_VERIFY over the tree, then greedy tree acceptance: ``x`` holds ``ids`` [B*N] (the
        node tokens, root first) and the child lists ``retrive_next_token`` /
        ``retrive_next_sibling`` [B*N] (request-local node ids, -1 = none).

        Returns ``(target_predict [B*N], hidden [B*N, E], predict [B*N], accept_index [B, S+1],
        accept_token_num [B])``: the argmax and
        :func:`~refspec.speculative.tree.device.verify_tree_greedy_device` run inside the forward
        (inside the verify graph when replayed), so the ``[B*N, V]`` logits never leave it
        (upstream ``EagleVerifyInput.verify``: ``target_predict``, then ``verify_tree_greedy``).

        v2 (upstream ``run_eagle_verify``'s tail, TR-020 / TR-021) then finishes the path inside
        the forward too: its target KV moves to the first a verify slots of each request
        (:func:`~refspec.speculative.tree.v2.move_accept_tokens_to_target_kvcache` on
        ``fb.out_cache_loc``) and ``predict`` (and, for a draft that reads it, ``hidden``) come
        back compacted to the front of each N-row block
        (:func:`~refspec.speculative.tree.v2.compact_accept_to_front`).  v1 returns them per node
        and compacts after its host read (:func:`~refspec.speculative.tree.kv.compact_accepted_path`)."""
        N = self.num_draft_tokens
        logits, hidden = self.target.forward(x["ids"], fb, self.tree_verify_be, aux=self.aux)
        target_predict = logits.argmax(-1)
        B = target_predict.shape[0] // N
        ridx = torch.arange(B * N, device=target_predict.device).view(B, N)
        predict, accept_index, n = verify_tree_greedy_device(
            x["ids"].view(B, N), ridx, x["retrive_next_token"].view(B, N), x["retrive_next_sibling"].view(B, N),
            target_predict, self.Sd + 1)
        if self.version == "v2":
            from refspec.speculative.tree.v2 import compact_accept_to_front, move_accept_tokens_to_target_kvcache
            acc = accept_index[:, :min(self.Sd + 1, N)]  # a path has at most min(S + 1, N) nodes
            move_accept_tokens_to_target_kvcache(self.target_pool, fb.out_cache_loc, acc, N)
            predict = compact_accept_to_front(predict, acc, N)
            if self.draft.uses_hidden:  # else the draft extend ignores it
                hidden = compact_accept_to_front(hidden, acc, N)
        return target_predict, hidden, predict, accept_index, n

    def _tree_draft_fn(self, fb, x):
        """The tail copies, S - 1 draft steps + the expansion between them, then the tree's
        structure.  ``x``: ``topk_p``, ``topk_index`` [B, k] (the root's children) and ``hidden``
        [B, E] (EAGLE).  First the partial tail page's lp tokens are copied into branches t >= 1
        (TR-015: :func:`~refspec.speculative.tree.kv.tail_copy_slots` from the batch's device
        rows and L, fixed shape, then :func:`~refspec.speculative.tree.kv.move_kv_cache` in the
        draft pool), so inside the draft graph when replayed; upstream runs
        ``duplicate_prefix_tail_to_draft_branches`` just before the draft forward.

        Returns ``(draft_tokens [B, N-1], parents, retrive_next_token, retrive_next_sibling
        [B, N], ancestors [B, N, N], depth [B, N])``: SGLang's ``organize_draft_results`` over
        ``score_list`` / ``token_list`` / ``parents_list``, then the length-free part of
        ``build_tree_efficient`` (:func:`~refspec.speculative.tree.device.tree_structure`), all
        inside the draft graph when replayed; the round adds L (positions, the flat mask)."""
        k, S = self.topk, self.Sd
        if S > 1:  # fb is None at S = 1: no draft step, no branch KV
            src, tgt = tree_kv.tail_copy_slots(self.kv, fb.req_pool_indices, fb.seq_lens, k, S)
            tree_kv.move_kv_cache(self.draft_pool, tgt, src)
        hidden = x.get("hidden")
        ids, hid, scores, info = select_top_k_tokens_first(x["topk_p"], x["topk_index"], hidden, k)
        score_list, token_list, parents_list = [info[0]], [info[1]], [info[2]]
        for s in range(S - 1):
            logits, hid_out = self.draft.forward(ids, hid, draft_step_batch(fb, s), self.tree_step_bes[s])
            p, i = draft_topk(logits, k)
            ids, hid, scores, info = select_top_k_tokens_later(s + 1, p, i, hid_out if hidden is not None else None,
                                                               scores, k)
            score_list.append(info[0])
            token_list.append(info[1])
            parents_list.append(info[2])
        parent_list, top, draft_tokens = organize_draft_results(score_list, token_list, parents_list,
                                                                self.num_draft_tokens)
        return (draft_tokens, *tree_structure(parent_list, top, k))

    # ---- public phases ----
    def tree_verify(self, ids, retrive_next_token, retrive_next_sibling, fb: TreeVerifyBatch):
        """TARGET_VERIFY over the tree and greedy acceptance (:meth:`_tree_verify_fn`): ``ids``
        [B*N], the child lists [B, N] -> ``(target_predict, hidden, predict, accept_index, n)``."""
        x = {"ids": ids, "retrive_next_token": retrive_next_token.flatten(),
             "retrive_next_sibling": retrive_next_sibling.flatten()}
        return self._run("tree_verify", fb, x, self._tree_verify_fn, self.tree_verify_be.init_forward_metadata)

    def tree_draft(self, fb: TreeDraftBatch, topk_p, topk_index, hidden):
        """All draft steps of a round and the tree's structure (:meth:`_tree_draft_fn`)."""
        x = {"topk_p": topk_p, "topk_index": topk_index}
        if hidden is not None and self.draft.uses_hidden:
            x["hidden"] = hidden

        def eager_init(fb):
            for be in self.tree_step_bes:
                be.init_forward_metadata(fb)
        return self._run("tree_draft", fb, x, self._tree_draft_fn, eager_init)


# ------------------------------------------------- the steps the v1 and v2 tree rounds share
def tree_draft_batch_device(rows_dev: torch.Tensor, seq_lens: torch.Tensor, seq_lens_hi: list[int], topk: int,
                            num_steps: int, draft_cache_loc: torch.Tensor, bound: bool) -> TreeDraftBatch:
    """:func:`tree_draft_batch` from device ``rows_dev`` / ``seq_lens`` ``[B]`` (L): branch row
    ``b*k + t`` runs step j at ``L_b + j``; ``seq_lens_cpu`` = ``seq_lens_hi`` (the exact L, or an
    upper bound under the overlap schedule: ``seq_lens_cpu_is_bound``, MD-006).  No host read.

    Production twin of the readable :func:`tree_draft_batch` (same batch from the same inputs)."""
    pos = (seq_lens.long()[:, None] + const_arange(num_steps, seq_lens.device)).repeat_interleave(topk, 0)
    return TreeDraftBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=rows_dev, seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens_hi, dtype=torch.long), out_cache_loc=draft_cache_loc,
        positions=pos.flatten(), topk=topk, num_steps=num_steps, draft_cache_loc=draft_cache_loc,
        seq_lens_cpu_is_bound=bound)


def tree_verify_batch_device(rows_dev: torch.Tensor, seq_lens: torch.Tensor, seq_lens_hi: list[int],
                             num_draft_tokens: int, topk: int, window_slots: torch.Tensor, tree: dict,
                             bound: bool) -> TreeVerifyBatch:
    """:func:`tree_verify_batch` from device ``rows_dev`` / ``seq_lens`` ``[B]`` (L): node i of
    request b writes ``window_slots[b, i]`` (int64 ``[B, N]``, the slot of position ``L_b + i``:
    :func:`~refspec.core.future_batch.round_window`) and runs at ``tree["positions"][b*N + i] =
    L_b + depth(i)`` (TR-005); ``tree`` is :func:`~refspec.speculative.tree.device.assemble_tree`'s
    dict (its flat ``custom_mask``, and its ``tree_mask`` rows, which graph replay reads);
    ``seq_lens_cpu`` = ``seq_lens_hi`` (exact, or ``bound``: MD-006).  No host read.

    Production twin of the readable :func:`tree_verify_batch` (same batch from the same inputs)."""
    return TreeVerifyBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=rows_dev, seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens_hi, dtype=torch.long), out_cache_loc=window_slots.flatten(),
        positions=tree["positions"], num_draft_tokens=num_draft_tokens, topk=topk, custom_mask=tree["custom_mask"],
        tree_mask=tree["tree_mask"], seq_lens_cpu_is_bound=bound)


def round_inputs(eng, reqs):
    """A round's device inputs, gathered from the engine's :class:`~refspec.speculative.tree.future.TreeFutureMap`
    by ``req_to_token`` row: ``(rows_dev [B], L [B], roots [B], x, hidden [B, E] | None)`` with
    ``x = {topk_p, topk_index}`` ``[B, k]`` (each request's root children).  One h2d copy, no read."""
    rows_dev = eng.ids([r.row for r in reqs])
    L, roots, topk_p, topk_index, hidden = eng.future.gather_tree(rows_dev)
    return rows_dev, L, roots, dict(topk_p=topk_p, topk_index=topk_index), hidden if eng.draft.uses_hidden else None


def draft_in_branches(eng, reqs, rows_dev, L, hi, bound, x, hidden):
    """Draft decode over the k branches once their slots exist (v1: allocated for the round; v2:
    inside the reserve): branch slots (TR-013), then the draft forward (the partial tail page
    copied into branches t >= 1, TR-015, and the S - 1 steps).  ``L`` [B] on the device, ``hi``
    its host value or bound.
    Returns the runner's draft outputs (:meth:`TreeRunners._tree_draft_fn`)."""
    kv, k, S = eng.kv, eng.topk, eng.Sd
    loc = tree_kv.assign_draft_cache_locs_device(kv, rows_dev, L, k, S)
    fb = tree_draft_batch_device(rows_dev, L, hi, k, S, loc, bound)
    out = eng.runners.tree_draft(fb, x["topk_p"], x["topk_index"], hidden)
    eng.observe("draft_decode", reqs=reqs, fb=fb)
    return out


def tree_verify_accept(eng, reqs, rows_dev, L, hi, bound, roots, drafted):
    """The tree (TR-001/002, TR-016), TARGET_VERIFY at L..L+N-1 (whose slots must exist) and
    greedy tree acceptance, all on the device (:mod:`refspec.speculative.tree.device`): no host
    read.  ``drafted``: the draft phase's outputs (:meth:`TreeRunners._tree_draft_fn`); ``L``
    [B] on the device, ``hi`` its host value (or, ``bound``, an upper bound, which sizes the
    flat ``custom_mask``).  Returns (tree, fb, target_predict, hidden, predict, accept_index, n,
    window); ``target_predict`` int64 [B*N] is the target's argmax per node (upstream
    ``EagleVerifyInput.verify``'s ``target_predict``), ``predict`` the accepted tokens (TR-016;
    v2: with ``hidden`` compacted to the front and the path KV moved, :meth:`TreeRunners._tree_verify_fn`),
    ``window`` the ``(positions, slots)`` ``[B, N]`` of L..L+N-1."""
    kv, k, N, B = eng.kv, eng.topk, eng.N, len(reqs)
    tree = assemble_tree(roots, drafted[0], drafted[1:], L, sum(hi) * N + B * N * N)
    window = round_window(kv, [r.row for r in reqs], rows_dev, L, hi, N)
    fb = tree_verify_batch_device(rows_dev, L, hi, N, k, window[1], tree, bound)
    target_predict, hidden, predict, accept_index, n = eng.runners.tree_verify(
        tree["draft_tokens"], tree["retrive_next_token"], tree["retrive_next_sibling"], fb)
    eng.observe("verify", reqs=reqs, fb=fb)
    return tree, fb, target_predict, hidden, predict, accept_index, n, window
