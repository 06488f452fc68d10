"""Tree traces: what a top-k > 1 round fed the FA3 wing, so that any device can re-run its attention.

A chain trace (:mod:`refspec.traces.chain`) is replayed by forcing the accept counts through
the whole engine.  A tree round cannot be forced that way: its tree comes from the draft model's
probabilities, which a random-init model on another device does not reproduce.  So a tree trace
(``"format": "refspec-tree-trace/1"``, config ``topk`` k >= 2, ``num_draft_tokens`` N and
``num_pages``, the recording engine's KV pool in pages, page 0 included) carries,
besides the chain schedule, each round's *kernel inputs*, and ``python -m refspec replay``
re-runs the three tree phases of every round at the recorded layout on random K/V
(:mod:`refspec.traces.replay_tree`).  Per round, ``tree`` holds one entry per request of ``rids``:

* ``req_pool_index``: the ``req_to_token`` row r;
* ``req_to_token``: that row's slots for positions ``0 .. L+N-1`` at verify time, as
  ``[first_slot, count]`` runs of consecutive slots (slots, not pages);
* ``page_table``: the verify prefix page table row the FA3 wing built, ``ceil(L / P)`` page ids
  (TR-010; it must satisfy PA-002 against ``req_to_token``);
* ``parents``: N parent node ids (node 0, the root, and orphans: -1; TR-003), from ``build_tree``;
* ``positions``: N RoPE positions ``L + depth`` (TR-005);
* ``mask``: N strings of N ``0``/``1``, the tree columns of the FULL_MASK rows (TR-004; the
  ``L`` prefix columns of every row are all true by construction and not stored);
* ``accept_path``: the accepted nodes from the root, a entries (TR-006);
* ``draft_cache_loc``: k lists of S slots, branch t's draft step slots (TR-015; empty at S = 1);
* ``draft_tokens``: the N node tokens, the root (the committed last token, TR-003) first
  (upstream ``build_tree_kernel_efficient``'s ``draft_tokens``, ``EagleVerifyInput.draft_token``);
* ``target_predict``: the N target argmaxes, one per node (``EagleVerifyInput.verify``'s
  ``target_predict``): ``accept_path`` must be their greedy walk and the round's output tokens
  its draft tokens + the bonus (TR-006, :mod:`refspec.traces.tree_checks`).

Every slot and page id above lies in the recorded pool and outside the reserved page 0
(PA-011 / PA-008), so a replay allocates exactly ``num_pages`` pages.

The config's ``version`` says which tree round was recorded.  A **v1** trace is as above.  A
**v2** trace (:mod:`refspec.speculative.tree.v2`) differs where the v2 round does:

* ``req_to_token`` covers the row's whole per-round reserve, positions ``0 .. L+R-1``
  (R = ``alloc_len_per_decode``, TR-020), since the branch slots live in it: branch t's step j
  is the slot at row position ``prefix_base + t*npp*P + lp + j``;
* ``moved_to``: the a slots the accepted path's target KV was moved to, in path order (TR-020:
  the first a verify slots, ``req_to_token[L .. L+a-1]``; nothing is freed);
* ``kept_row``: the row of the request's N-row ``DRAFT_EXTEND_V2`` block that seeded the next
  round (TR-021: ``a - 1``).

Recording: :class:`TreeRecorder` is an engine observer (``draft_decode``, ``verify``,
``tree_accept``, ``draft_extend``, ``round_end`` events of
:class:`~refspec.speculative.tree.engine.TreeEngine`, v1 or v2).
:func:`check_tree_rounds` checks shapes, page ids and acceptance (ValueError naming the ID);
:func:`tree_round_failures` checks the remaining rules above and returns one line per violation,
each naming its invariant ID.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from refspec.core.invariants import require
from refspec.core.modes import ForwardMode
from refspec.fa3.tree_backend import TreeDraftBatch, TreeVerifyBatch
from refspec.traces.tree_checks import acceptance_failures, page_id_failures, pool_size_problem, round_tokens

TREE_FORMAT = "refspec-tree-trace/1"
TREE_CONFIG_KEYS = ("topk", "num_draft_tokens", "num_pages")
TREE_KEYS = ("req_pool_index", "req_to_token", "page_table", "parents", "positions", "mask", "accept_path",
             "draft_cache_loc", "draft_tokens", "target_predict")
TREE_V2_KEYS = ("moved_to", "kept_row")  #: a v2 trace's entries also hold these


def to_runs(slots: list[int]) -> list[list[int]]:
    """``[3, 4, 5, 9, 10]`` -> ``[[3, 3], [9, 2]]``: runs of consecutive slots as ``[first, count]``."""
    runs: list[list[int]] = []
    for s in slots:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1][1] += 1
        else:
            runs.append([int(s), 1])
    return runs


def from_runs(runs: list[list[int]]) -> list[int]:
    """The inverse of :func:`to_runs`."""
    return [first + i for first, count in runs for i in range(count)]


def mask_tree_rows(custom_mask: list[bool], seq_lens: list[int], N: int) -> list[list[str]]:
    """Per request, the tree columns of its N FULL_MASK rows as ``"0"``/``"1"`` strings.

    Layout (``build_tree``): request b's block starts at ``N * sum_{j<b} (L_j + N)``; node i's row
    there has ``L_b + N`` entries, the last N being the tree columns.
    """
    out, start = [], 0
    for L in seq_lens:
        rows = []
        for i in range(N):
            row = start + i * (L + N)
            rows.append("".join("1" if custom_mask[row + L + j] else "0" for j in range(N)))
        out.append(rows)
        start += N * (L + N)
    return out


class TreeRecorder:
    """Engine observer that keeps each committed tree round's kernel inputs (module doc).

    ``rounds``: one list per finished round (aligned with that round's ``rids``) of
    :data:`TREE_KEYS` dicts; ``num_pages``: the engine's KV pool (pages, page 0 included), for
    the config.  ``chain``: another observer called first (e.g. a progress bar).
    """

    def __init__(self, chain=None):
        self.chain, self.rounds, self._cur, self.num_pages = chain, [], {}, None

    def __call__(self, event, eng, **info):
        if self.chain is not None:
            self.chain(event, eng, **info)
        fb = info.get("fb")
        if event == "draft_decode" and isinstance(fb, TreeDraftBatch):
            k, S = fb.topk, fb.num_steps
            loc = fb.draft_cache_loc.view(-1, k, S).tolist()
            self._cur["draft_cache_loc"] = loc
        elif event == "verify" and isinstance(fb, TreeVerifyBatch):
            self._verify(eng, fb, info["reqs"])
        elif event == "tree_accept":
            acc = info["accept_index"].tolist()
            N = eng.N
            self._cur["parents"] = info["parents"].tolist()
            self._cur["accept_path"] = [[x - b * N for x in row if x >= 0] for b, row in enumerate(acc)]
            self._cur["draft_tokens"] = info["draft_tokens"].view(-1, N).tolist()
            self._cur["target_predict"] = info["target_predict"].view(-1, N).tolist()
            if eng.version == "v2":  # move_accept_tokens_to_target_kvcache: node slot -> window slot j
                win = self._cur["window"]
                self._cur["moved_to"] = [win[b * N:b * N + len(p)] for b, p in enumerate(self._cur["accept_path"])]
        elif event == "draft_extend" and getattr(fb, "forward_mode", None) == ForwardMode.DRAFT_EXTEND_V2:
            self._cur["kept_row"] = [a - 1 for a in fb.num_accept_tokens.tolist()]  # select_index - b*N
        elif event == "round_end" and "rows" in self._cur:
            c, self._cur = self._cur, {}
            loc = c.get("draft_cache_loc") or [[] for _ in c["rows"]]
            rnd = [dict(req_pool_index=r, req_to_token=to_runs(slots), page_table=pt, parents=par,
                        positions=pos, mask=m, accept_path=path, draft_cache_loc=d, draft_tokens=tok,
                        target_predict=pred)
                   for r, slots, pt, par, pos, m, path, d, tok, pred in zip(
                       c["rows"], c["slots"], c["page_table"], c["parents"], c["positions"],
                       c["mask"], c["accept_path"], loc, c["draft_tokens"], c["target_predict"])]
            if eng.version == "v2":
                for e, moved, kept in zip(rnd, c["moved_to"], c["kept_row"]):
                    e.update(moved_to=moved, kept_row=kept)
            self.rounds.append(rnd)

    def _verify(self, eng, fb: TreeVerifyBatch, reqs) -> None:
        N, P = fb.num_draft_tokens, eng.P
        self.num_pages = eng.kv.allocator.num_pages
        Ls, rows = fb.seq_lens.tolist(), fb.req_pool_indices.tolist()  # exact L (seq_lens_cpu: a bound under overlap)
        pt = eng.runners.tree_verify_be.forward_metadata.page_table  # what the prefix call read (graph or eager)
        pos = fb.positions.tolist()
        # v1: the row at verify time, L + N positions; v2: the whole reserve the round runs in (TR-020)
        ends = [r.alloc_len for r in reqs] if eng.version == "v2" else [L + N for L in Ls]
        self._cur.update(
            rows=rows, slots=[eng.kv.req_to_token[r, :n].tolist() for r, n in zip(rows, ends)],
            window=fb.out_cache_loc.tolist(),
            page_table=[pt[b, :-(-L // P)].tolist() for b, L in enumerate(Ls)],
            positions=[pos[b * N:(b + 1) * N] for b in range(len(Ls))],
            mask=mask_tree_rows(fb.custom_mask.tolist(), Ls, N))


def check_tree_rounds(trace: dict, bad) -> None:
    """A tree trace's config and ``tree`` entries; ``bad(msg)`` raises (ValueError).

    Shapes first, then per request-round the page ids (PA-008 / PA-011,
    :func:`~refspec.traces.tree_checks.page_id_failures`) and the acceptance against
    the recorded tokens (TR-003 / TR-006, :func:`~refspec.traces.tree_checks.acceptance_failures`):
    the first violation is raised as ``round i request rid: [ID] field ...``.  Needs the schedule
    checks of :func:`~refspec.traces.chain.check_trace` to have passed.
    """
    cfg = trace["config"]
    if any(k not in cfg for k in TREE_CONFIG_KEYS) or not cfg["topk"] >= 2 or not cfg["num_draft_tokens"] >= 2:
        bad(f"a tree trace needs config topk >= 2, num_draft_tokens >= 2 and num_pages (the recording "
            f"engine's KV pool), got { {k: cfg.get(k) for k in TREE_CONFIG_KEYS} }")
    if cfg["version"] not in ("v1", "v2"):
        bad(f"tree rounds are recorded from the v1 or v2 tree engine, config says {cfg['version']!r}")
    if (why := pool_size_problem(trace)) is not None:
        bad(why)
    v2 = cfg["version"] == "v2"
    k, N, S = cfg["topk"], cfg["num_draft_tokens"], cfg["num_steps"]
    for i, rd in enumerate(trace["rounds"]):
        tree = rd.get("tree")
        if not isinstance(tree, list) or len(tree) != len(rd["rids"]):
            bad(f"round {i}: 'tree' must hold one entry per request of rids")
        for b, (e, L, a) in enumerate(zip(tree, rd["seq_lens"], rd["num_accept_tokens"])):
            where = f"round {i} request {rd['rids'][b]}"
            keys = TREE_KEYS + (TREE_V2_KEYS if v2 else ())
            if any(x not in e for x in keys):
                bad(f"{where}: tree entry lacks {[x for x in keys if x not in e]}")
            if any(not (isinstance(c, int) and c >= 1) for _, c in e["req_to_token"]):
                bad(f"{where}: req_to_token runs are [first_slot, count] with count >= 1")
            covered = sum(c for _, c in e["req_to_token"])
            if covered != L + N and not (v2 and covered > L + N):
                bad(f"{where}: req_to_token runs cover {covered} positions, expected "
                    f"{'at least ' if v2 else ''}L + N = {L + N}")
            if v2 and (not isinstance(e["kept_row"], int) or len(e["moved_to"]) != a):
                bad(f"{where}: a v2 entry needs kept_row (an int) and moved_to (a = {a} slots)")
            if len(e["page_table"]) != -(-L // cfg["page_size"]):
                bad(f"{where}: page_table has {len(e['page_table'])} pages, ceil(L / P) = "
                    f"{-(-L // cfg['page_size'])}")
            if len(e["parents"]) != N or len(e["positions"]) != N or len(e["mask"]) != N \
                    or any(len(m) != N or set(m) - {"0", "1"} for m in e["mask"]):
                bad(f"{where}: parents / positions / mask need N = {N} entries (mask: N strings of N 0/1)")
            if len(e["accept_path"]) != a:
                bad(f"{where}: accept_path has {len(e['accept_path'])} nodes, a = {a}")
            want = k if S > 1 else 0
            if len(e["draft_cache_loc"]) != want or any(len(x) != S for x in e["draft_cache_loc"]):
                bad(f"{where}: draft_cache_loc needs {want} branches of S = {S} slots")
            if len(e["draft_tokens"]) != N or len(e["target_predict"]) != N:
                bad(f"{where}: draft_tokens and target_predict need N = {N} tokens (one per node)")
    for i, (rd, toks) in enumerate(zip(trace["rounds"], round_tokens(trace))):
        for rid, e, (root, emitted, at) in zip(rd["rids"], rd["tree"], toks):
            rules = page_id_failures(e, cfg) + acceptance_failures(e, root, emitted, at)
            if rules:
                bad(f"round {i} request {rid}: {rules[0]}")


def ancestors_and_self(parents: list[int], i: int) -> list[int]:
    """Node i, its ancestors and the root (an orphan: itself and the root), ascending (TR-004).

    Raises: InvariantError TR-003 if a parent does not precede its child (a cycle in a
    hand-edited trace would otherwise never end the walk).
    """
    out = {0, i}
    while parents[i] > 0:
        require(parents[i] < i, "TR-003", lambda: f"node {i}'s parent {parents[i]} does not precede it")
        i = parents[i]
        out.add(i)
    return sorted(out)


def tree_round_failures(entry: dict, L: int, a: int, cfg: dict) -> list[str]:
    """The rules one recorded request-round must satisfy; one line per violation, ID first.

    TR-003 (parents precede children, the root has none), TR-004 (mask row i = itself + its
    ancestors + the root), TR-005 (position = L + depth), TR-006 (the path starts at the root and
    follows parent links, a nodes), PA-002 (``page_table[p // P] * P + p % P == req_to_token[p]``
    for p < L), TR-015 (branch t's step 0 sits at offset L mod P of its page; branch 0's tail is
    the committed tail; branches own distinct pages).
    """
    P, N = cfg["page_size"], cfg["num_draft_tokens"]
    out = []
    par, slots = entry["parents"], from_runs(entry["req_to_token"])
    if par[0] != -1 or any(not (p == -1 or 0 <= p < i) for i, p in enumerate(par) if i):
        out.append(f"[TR-003] parents {par}: node 0 is the root (-1) and every parent precedes its child")
        return out  # the other tree rules need a well-formed tree
    for i, row in enumerate(entry["mask"]):
        want = ancestors_and_self(par, i)
        got = [j for j in range(N) if row[j] == "1"]
        if got != want:
            out.append(f"[TR-004] node {i}: the stored mask row sees tree nodes {got}; itself, its ancestors "
                       f"and the root are {want}")
    for i, p in enumerate(entry["positions"]):
        depth = len(ancestors_and_self(par, i)) - 1
        if p != L + depth:
            out.append(f"[TR-005] node {i}: position {p}, L + depth = {L} + {depth}")
    path = entry["accept_path"]
    if path[:1] != [0] or any(par[c] != p for p, c in zip(path, path[1:])) or len(path) != a:
        out.append(f"[TR-006] accept_path {path} must start at the root and follow parent links ({a} nodes)")
    pt = entry["page_table"]
    for p in range(L):
        if pt[p // P] * P + p % P != slots[p]:
            out.append(f"[PA-002] page_table[{p // P}] = {pt[p // P]} gives slot {pt[p // P] * P + p % P} for "
                       f"position {p}, req_to_token holds {slots[p]} (P={P})")
            break
    lp = L % P if P > 1 else 0
    loc = entry["draft_cache_loc"]
    firsts = [b[0] for b in loc]
    if loc and (any(s0 % P != lp % P for s0 in firsts) or (lp and firsts[0] - lp != slots[L - lp])
                or len({s0 // P for s0 in firsts}) != len(firsts)):
        out.append(f"[TR-015] branch step-0 slots {firsts}: each at offset L mod P = {lp} of its own page, "
                   f"branch 0 continuing the committed tail (slots {slots[L - lp:L]})")
    return out


def tree_v2_round_failures(entry: dict, L: int, a: int, cfg: dict) -> list[str]:
    """The v2 rules of one recorded request-round (on top of :func:`tree_round_failures`).

    TR-020: the row holds its reserve ``L + R`` positions (R = ``max(npp*P*k, N)``, ``npp =
    ceil((P - 1 + S) / P)``; ``max(k*S, N)`` at P = 1) of distinct slots, branch t's step j is the
    reserve's slot at ``prefix_base + t*npp*P + lp + j``, and the path KV went to the first a
    verify slots.  TR-021: the kept draft-extend row is ``a - 1``.
    """
    P, N, k, S = cfg["page_size"], cfg["num_draft_tokens"], cfg["topk"], cfg["num_steps"]
    slots, out = from_runs(entry["req_to_token"]), []
    R = max(k * S, N) if P == 1 else max(-(-(P - 1 + S) // P) * P * k, N)
    if len(slots) < L + R or len(set(slots)) != len(slots):
        out.append(f"[TR-020] the row holds {len(slots)} positions ({len(set(slots))} distinct slots); the "
                   f"reserve is L + R = {L} + {R}")
    lp = L % P if P > 1 else 0
    npp = -(-(lp + S) // P) if P > 1 else S
    for t, branch in enumerate(entry["draft_cache_loc"]):
        want = [slots[p] if p < len(slots) else None for p in range(L - lp + t * npp * P + lp,
                                                                     L - lp + t * npp * P + lp + S)]
        if branch != want:
            out.append(f"[TR-020] branch {t}: draft slots {branch}, the reserve holds {want} at its step positions")
    if entry["moved_to"] != slots[L:L + a]:
        out.append(f"[TR-020] the path's KV was moved to slots {entry['moved_to']}; the first a = {a} verify "
                   f"slots are {slots[L:L + a]}")
    if entry["kept_row"] != a - 1:
        out.append(f"[TR-021] kept draft-extend row {entry['kept_row']} of the N = {N} window rows; "
                   f"select_index keeps row a - 1 = {a - 1}")
    return out
