"""Tree traces: what a top-k > 1 round fed the FA3 wing, so that any device can re-run its attention.

A chain trace (:mod:`refspec.speculative.trace`) is replayed by forcing the accept counts through
the whole engine.  A tree round cannot be forced that way: its tree comes from the draft model's
probabilities, which a random-init model on another device does not reproduce.  So a tree trace
(``"format": "refspec-tree-trace/1"``, config ``topk`` k >= 2 and ``num_draft_tokens`` N) carries,
besides the chain schedule, each round's *kernel inputs*, and ``python -m refspec replay``
re-runs the three tree phases of every round at the recorded layout on random K/V
(:mod:`refspec.cli._replay_tree`).  Per round, ``tree`` holds one entry per request of ``rids``:

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
* ``draft_cache_loc``: k lists of S slots, branch t's draft step slots (TR-015; empty at S = 1).

Recording: :class:`TreeRecorder` is an engine observer (``draft_decode``, ``verify``,
``tree_accept``, ``round_end`` events of :class:`~refspec.speculative.tree.TreeEngine`).
:func:`check_tree_rounds` checks shapes (ValueError); :func:`tree_round_failures` checks the
rules above and returns one line per violation, each naming its invariant ID.
"""

from __future__ import annotations

from refspec.fa3.tree_backend import TreeDraftBatch, TreeVerifyBatch

TREE_FORMAT = "refspec-tree-trace/1"
TREE_CONFIG_KEYS = ("topk", "num_draft_tokens")
TREE_KEYS = ("req_pool_index", "req_to_token", "page_table", "parents", "positions", "mask", "accept_path",
             "draft_cache_loc")


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
    :data:`TREE_KEYS` dicts.  ``chain``: another observer called first (e.g. a progress bar).
    """

    def __init__(self, chain=None):
        self.chain, self.rounds, self._cur = chain, [], {}

    def __call__(self, event, eng, **info):
        if self.chain is not None:
            self.chain(event, eng, **info)
        fb = info.get("fb")
        if event == "draft_decode" and isinstance(fb, TreeDraftBatch):
            k, S = fb.topk, fb.num_steps
            loc = fb.draft_cache_loc.view(-1, k, S).tolist()
            self._cur["draft_cache_loc"] = loc
        elif event == "verify" and isinstance(fb, TreeVerifyBatch):
            self._verify(eng, fb)
        elif event == "tree_accept":
            acc = info["accept_index"].tolist()
            N = eng.N
            self._cur["parents"] = [list(p) for p in info["parents"]]
            self._cur["accept_path"] = [[x - b * N for x in row if x >= 0] for b, row in enumerate(acc)]
        elif event == "round_end" and "rows" in self._cur:
            c, self._cur = self._cur, {}
            loc = c.get("draft_cache_loc") or [[] for _ in c["rows"]]
            self.rounds.append([dict(req_pool_index=r, req_to_token=to_runs(slots), page_table=pt, parents=par,
                                     positions=pos, mask=m, accept_path=path, draft_cache_loc=d)
                                for r, slots, pt, par, pos, m, path, d in zip(
                                    c["rows"], c["slots"], c["page_table"], c["parents"], c["positions"],
                                    c["mask"], c["accept_path"], loc)])

    def _verify(self, eng, fb: TreeVerifyBatch) -> None:
        N, P = fb.num_draft_tokens, eng.P
        Ls, rows = fb.seq_lens_cpu.tolist(), fb.req_pool_indices.tolist()
        pt = eng.runners.tree_verify_be.forward_metadata.page_table  # what the prefix call read (graph or eager)
        pos = fb.positions.tolist()
        self._cur.update(
            rows=rows, slots=[eng.kv.req_to_token[r, :L + N].tolist() for r, L in zip(rows, Ls)],
            page_table=[pt[b, :-(-L // P)].tolist() for b, L in enumerate(Ls)],
            positions=[pos[b * N:(b + 1) * N] for b in range(len(Ls))],
            mask=mask_tree_rows(fb.custom_mask.tolist(), Ls, N))


def check_tree_rounds(trace: dict, bad) -> None:
    """Shapes of a tree trace's config and ``tree`` entries; ``bad(msg)`` raises (ValueError)."""
    cfg = trace["config"]
    if any(k not in cfg for k in TREE_CONFIG_KEYS) or not cfg["topk"] >= 2 or not cfg["num_draft_tokens"] >= 2:
        bad(f"a tree trace needs config topk >= 2 and num_draft_tokens >= 2, got "
            f"{ {k: cfg.get(k) for k in TREE_CONFIG_KEYS} }")
    if cfg["version"] != "v1":
        bad(f"tree rounds are recorded from the v1 tree engine, config says {cfg['version']!r}")
    k, N, S = cfg["topk"], cfg["num_draft_tokens"], cfg["num_steps"]
    for i, rd in enumerate(trace["rounds"]):
        tree = rd.get("tree")
        if not isinstance(tree, list) or len(tree) != len(rd["rids"]):
            bad(f"round {i}: 'tree' must hold one entry per request of rids")
        for b, (e, L, a) in enumerate(zip(tree, rd["seq_lens"], rd["num_accept_tokens"])):
            where = f"round {i} request {rd['rids'][b]}"
            if any(x not in e for x in TREE_KEYS):
                bad(f"{where}: tree entry lacks {[x for x in TREE_KEYS if x not in e]}")
            if sum(c for _, c in e["req_to_token"]) != L + N:
                bad(f"{where}: req_to_token runs cover {sum(c for _, c in e['req_to_token'])} positions, "
                    f"expected L + N = {L + N}")
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


def ancestors_and_self(parents: list[int], i: int) -> list[int]:
    """Node i, its ancestors and the root (an orphan: itself and the root), ascending (TR-004)."""
    out = {0, i}
    while parents[i] > 0:
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
