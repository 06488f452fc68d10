"""The production top-k > 1 round (EAGLE tree, v1) and its engine: a sibling of :mod:`rounds`.

One round over the running batch at committed lengths L (roots t_L known, the previous draft
extend left each request's root children ``topk_p``, ``topk_index`` and, for an EAGLE draft,
its hidden state), B requests, k = topk, S = num_steps, N = num_draft_tokens:

1. **draft** (TR-013..TR-015): allocate every branch's page-aligned region under
   ``backup_state``, copy the partial tail page into branches t >= 1, run the S - 1 draft steps
   over B*k branch rows with the per-step top-k expansion, restore the allocator (the draft
   slots are transient, as in v1);
2. **tree** (TR-016): ``organize_draft_results`` + ``build_tree_device`` -> N nodes per
   request, positions L + depth, the flat FULL_MASK (on the device,
   :mod:`refspec.speculative.tree.device`);
3. **verify** (TR-010..TR-012): allocate L..L+N-1, TARGET_VERIFY (cascade prefix + expand);
4. **accept** (TR-016 / TR-006): ``verify_tree_greedy_device`` -> path, n, a = n + 1; the
   round's one device -> host read (``"in_round"``): a, the path and its tokens;
5. **compact** (TR-017): the path's target KV to L..L+a-1 (on the device), whole pages from
   ``ceil_P(L + a)`` on freed (``free_tail``: the allocator's host mirror);
6. **draft extend** (v1 DRAFT_EXTEND, SD-004): the a emitted tokens at draft KV L..L+a-1 with
   the target hidden of the path nodes; the last row's softmax top-k seed the next round.

Observer events (``Engine.observe``, v1 and v2 rounds): ``draft_decode`` (``fb``: the TreeDraftBatch), ``verify``
(the TreeVerifyBatch), ``tree_accept`` (``parents``: int64 [B, N], each node's parent node id;
``accept_index`` [B, S+1]: the accepted path; ``draft_tokens`` and ``target_predict`` [B*N]: the
node tokens, root first, and the target's argmax per node) and ``draft_extend``; a trace recorder
(:mod:`refspec.traces.tree`) reads them.

The row per request is the chain's contract (:mod:`refspec.speculative.rounds`): ``[a, c_0 ..
c_(N-1), d_1 .. d_S, draft_len]`` with ``c[:a]`` the emitted tokens (then -1) and ``d`` the
accepted drafts (then -1).  Upstream: ``eagle_worker.py`` ``EAGLEWorker.forward_batch_generation``
-> ``draft`` / ``verify`` / ``forward_draft_extend_after_decode``; ``eagle_info.py``
``EagleVerifyInput.verify`` (v1).  The spec-v2 tree round (upstream's only EAGLE worker from
v0.5.14 on, ``EAGLEWorkerV2``) is :func:`refspec.speculative.tree.v2.round_tree_v2`; it also runs
under the overlap schedule (``overlap=True``, v2 only).  Both read each request's inputs (L, root,
root children, draft hidden) from the engine's
:class:`~refspec.speculative.tree.future.TreeFutureMap` and write the next round's there.

**Host reads per round** (``Engine.syncs``; before this module used the device twins the tree
was built and accepted by host ports, 7 more device reads per round in both versions, and v1's
compaction read 4 more): v1 1 (``"in_round"``), v2 0 inside + 1 after (``"post_round"``; under
overlap after the next round was launched).
"""

from __future__ import annotations

import torch

from refspec.core.args import tree_args
from refspec.core.batch import draft_extend_batch
from refspec.core.transfer import h2d_many
from refspec.speculative.tree import kv as tree_kv, v2 as tree_v2
from refspec.speculative.drafters import Drafter
from refspec.speculative.engine import Engine
from refspec.speculative.round_row import RoundRow
from refspec.speculative.tree.build import draft_topk
from refspec.speculative.tree.future import TreeFutureMap
from refspec.speculative.tree.runners import TreeRunners, draft_in_branches, round_inputs, tree_verify_accept


def _draft(eng, reqs, rows_dev, L_dev, L, x, hidden):
    """Step 1: the branch regions (allocated for the round, given back after it), the tail
    copies, the S - 1 steps and the tree structure (``TreeRunners._tree_draft_fn``)."""
    kv, k, S = eng.kv, eng.topk, eng.Sd
    if S == 1:
        return eng.runners._tree_draft_fn(None, x)
    state = kv.allocator.backup_state()
    rows = [r.row for r in reqs]
    kv.alloc_extend(rows, L, [tree_kv.draft_alloc_len(l, k, S, eng.P) for l in L])
    out = draft_in_branches(eng, reqs, rows_dev, L_dev, L, False, x, hidden)
    kv.allocator.restore_state(state)
    return out


def round_tree_v1(eng, reqs) -> list[RoundRow]:
    """One v1 top-k round (module doc); returns the host rows.  One device -> host read
    (``"in_round"``: a, the path and its tokens), the allocator's frees need a."""
    kv, k, S, N = eng.kv, eng.topk, eng.Sd, eng.N
    rows, L = [r.row for r in reqs], [r.seq_len for r in reqs]
    B = len(reqs)
    rows_dev, L_dev, roots, x, dhid = round_inputs(eng, reqs)
    drafted = _draft(eng, reqs, rows_dev, L_dev, L, x, dhid)
    # 2.-4. the tree, verify at L..L+N-1 (its slots allocated first), accept
    kv.alloc_extend(rows, L, [l + N for l in L])
    for r, l in zip(reqs, L):
        r.alloc_len = l + N
    tree, fb, target_predict, hidden, predicts, accept_index, n, _ = tree_verify_accept(
        eng, reqs, rows_dev, L_dev, L, False, roots, drafted)
    W = accept_index.shape[1]  # S + 1
    path_tokens = torch.where(accept_index >= 0, predicts[accept_index.clamp(min=0)], -1)
    host = eng.host("in_round", torch.cat([(n + 1)[:, None], accept_index, path_tokens], dim=1))
    eng.observe("tree_accept", reqs=reqs, parents=tree["parents"], accept_index=accept_index,
                draft_tokens=tree["draft_tokens"], target_predict=target_predict)  # for recorders
    a = [h[0] for h in host]
    # 5. compact the path's target KV to L..L+a-1; free whole pages past ceil_P(L + a) (TR-017)
    tree_kv.compact_accepted_path(kv, eng.target_pool, rows, L, fb.out_cache_loc, accept_index, a, N)
    for r, l, ab in zip(reqs, L, a):
        r.alloc_len = r.seq_len = r.target_kv_len = l + ab
    # 6. v1 draft extend over the a emitted tokens (their KV index L + j consumes t_(L+j+1))
    de = draft_extend_batch(kv, rows, [l + ab for l, ab in zip(L, a)], a, num_draft_tokens=S + 1)
    path, keep = h2d_many([[x for h in host for x in h[1:1 + h[0]]],
                           [sum(a[:b + 1]) - 1 for b in range(B)]], eng.device)
    emitted = predicts[path]
    dl, dh = eng.runners.draft_extend(de, emitted, hidden[path])
    eng.observe("draft_extend", reqs=reqs, fb=de)
    topk_p, topk_index = draft_topk(dl[keep], k)
    eng.future.stash_tree(rows_dev, seq_lens=de.seq_lens, root=emitted[keep], topk_p=topk_p, topk_index=topk_index,
                          hidden=dh[keep] if eng.draft.uses_hidden else None)
    out = []
    for r, l, h, ab in zip(reqs, L, host, a):  # host rows from the one read
        r.draft_kv_len = l + ab
        c = h[1 + W:1 + W + ab]
        out.append(RoundRow(ab, c + [-1] * (N - ab), c[:-1] + [-1] * (S + 1 - ab), l + ab))
    return out


class TreeEngine(Engine):
    """The continuous-batching engine with EAGLE top-k > 1 trees (v1 or v2, FA3 tree backend).

    Args: as :class:`~refspec.speculative.engine.Engine`, plus ``topk`` (k >= 2) and
    ``num_draft_tokens`` (N, root included; ``2 <= N <= 1 + k + (S-1) k^2``).  ``version`` is
    "v1" (:func:`round_tree_v1`) or "v2" (:func:`refspec.speculative.tree.v2.round_tree_v2`),
    ``attention`` "fa3"; ``overlap=True`` runs v2 under the overlap schedule
    (:mod:`refspec.speculative.overlap`, :mod:`refspec.speculative.tree.v2`); None or False: off
    (the tree default, on CUDA too); the chain-only hooks ``drafter`` / ``accept`` are refused.
    Between rounds each request's root children live in the engine's
    :class:`~refspec.speculative.tree.future.TreeFutureMap` (by ``req_to_token`` row).
    Raises: ValueError for any of the above, and for ``overlap=True`` with v1.
    """

    def __init__(self, target, draft, *, topk: int, num_draft_tokens: int, num_steps: int = 3, version: str = "v1",
                 drafter=None, accept=None, overlap=None, **kw):
        tree_args(topk, num_steps, num_draft_tokens)
        if topk < 2:
            raise ValueError(f"TreeEngine is the top-k > 1 engine: topk must be >= 2, got {topk} (k = 1: Engine)")
        if topk > target.config.vocab_size:
            raise ValueError(f"topk k = {topk} > vocab_size V = {target.config.vocab_size}: each draft step takes "
                             f"the top-k of the V draft probabilities (TR-001)")
        if version not in ("v1", "v2"):
            raise ValueError(f"top-k > 1 runs version 'v1' or 'v2', got version={version!r}")
        if overlap and version != "v2":
            raise ValueError("top-k > 1 with the overlap schedule needs version 'v2' (v1 reads the accept counts "
                             "inside the round, docs/spec/tree.md); pass overlap=False or None")
        if (drafter is not None and type(drafter) is not Drafter) or accept is not None:
            raise ValueError("top-k > 1: the drafter / accept hooks are for the chain loop only")
        self.topk, self._tree_N = topk, num_draft_tokens
        super().__init__(target, draft, version=version, num_steps=num_steps, overlap=bool(overlap), **kw)
        self.future = TreeFutureMap(self.kv.req_to_token.shape[0], topk, self.device)

    def _verify_width(self, num_steps: int) -> int:
        return self._tree_N

    def _row_span(self) -> int:
        """The most positions past L a round gives slots: the k branch regions, or the N verify slots."""
        return tree_kv.alloc_len_per_decode(self.topk, self.Sd, self.N, self.P)

    def _make_runners(self, **kw) -> TreeRunners:
        return TreeRunners(self.target, self.draft, self.kv, self.target_pool, self.draft_pool, topk=self.topk,
                           num_draft_tokens=self.N, **kw)

    def _set_draft_state(self, reqs, fb, first, draft_logits, draft_hidden) -> None:
        """After the prefill: each request's root t_p and its k root children (top-k of the kept
        draft row), into the future map by row."""
        topk_p, topk_index = draft_topk(draft_logits, self.topk)
        self.future.stash_tree(fb.req_pool_indices, seq_lens=fb.seq_lens, root=first, topk_p=topk_p,
                               topk_index=topk_index, hidden=draft_hidden if self.draft.uses_hidden else None)

    def _run_round(self, reqs):
        if self.version == "v1":
            return round_tree_v1(self, reqs)
        tree_v2.prepare_tree_v2(self, reqs)  # before the round: alloc_len = seq_len + R (TR-020)
        return tree_v2.round_tree_v2(self, reqs)

    def _overlap_round(self, reqs, seq_lens_hi, batches):
        """The overlap schedule's launch: the 2x reserve, then the v2 round on device lengths
        with host bounds ``seq_lens_hi`` (:mod:`refspec.speculative.tree.v2`)."""
        tree_v2.prepare_tree_v2(self, reqs, overlap=True)
        return tree_v2.round_tree_v2(self, reqs, seq_lens_hi)
