"""What a tree trace (:mod:`refspec.traces.tree`) must satisfy before anything runs:
every page id it names lies in the pool it was recorded in, and every accepted path is the one
the target chose.

**Page ids** (:func:`page_id_failures`).  The config's ``num_pages`` is the recording engine's
pool (``eng.kv``, pages ``0 .. num_pages - 1``, page 0 included); a replay allocates exactly
that pool.  Every slot (token index, ``slot // P`` its page) and page id an entry names --
``req_to_token`` runs, ``page_table``, ``draft_cache_loc``, v2 ``moved_to`` -- MUST lie inside it
(PA-011: kernel arguments name pages of the pool) and MUST NOT be in page 0, the reserved dummy
page the allocator never gives to a request (PA-008); ``req_pool_index`` likewise names a row
``1 .. max_batch`` of ``req_to_token`` (row 0 reserved, PA-008; the engine has ``max_batch + 1``
rows, PA-011).  Runs are checked at their ends, never expanded, so a hand-edited ``10**9`` fails
here with its field instead of sizing a giant pool.  ``num_pages`` itself is at most the pool the
recording engine sizes for the trace's requests (:func:`recording_pool_pages`), so a hand-edited
pool size cannot make a replay allocate past it either.

**Acceptance** (:func:`acceptance_failures`).  A tree round's attention replays on random K/V,
so it cannot tell which root-to-node path the target chose; the tokens can.  Each entry stores
``draft_tokens`` (the N node tokens, root first: upstream ``build_tree_kernel_efficient``'s
``draft_tokens`` = ``EagleVerifyInput.draft_token``) and ``target_predict`` (the target's argmax
at every node: ``EagleVerifyInput.verify``'s ``target_predict``, passed to
``verify_tree_greedy``).  Then:

* TR-003: the root token is the request's committed last token (the previous round's bonus,
  ``output_ids[sum(a of its earlier rounds)]``, the prefill's token in its first round);
* TR-006: ``accept_path`` is the greedy walk (:func:`greedy_path`), and the output tokens the
  round emitted (``output_ids`` after the root, a of them, fewer in a request's last round when
  its budget or EOS ended it) are the path's draft tokens plus the bonus ``target_predict`` at the
  last path node.

Each function returns one line per violation, ID first; :func:`check_tree_rounds
<refspec.traces.tree.check_tree_rounds>` raises the first as a ValueError on load and
the replay (:mod:`refspec.traces.replay_tree`) reports them per round.

Upstream (sgl-project/sglang): ``python/sglang/srt/speculative/eagle_utils.py``
``build_tree_kernel_efficient`` / ``verify_tree_greedy_func`` at 003ddbce0
(https://github.com/sgl-project/sglang/blob/003ddbce039cd49b05c84568b7b357031366abf7/python/sglang/srt/speculative/eagle_utils.py),
``python/sglang/srt/speculative/eagle_info.py`` ``EagleVerifyInput.verify`` at v0.5.5
(https://github.com/sgl-project/sglang/blob/v0.5.5/python/sglang/srt/speculative/eagle_info.py#L286);
the rules: docs/spec/paging-attention.md (PA-008, PA-011), docs/spec/tree.md (TR-003, TR-006).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from refspec.speculative.tree.kv import alloc_len_per_decode


def recording_pool_pages(trace: dict) -> int:
    """The KV pool (pages, page 0 included) ``record`` gives a tree trace's requests: the engine's
    default ``1 + max_batch * (ceil(width / P) + 1)`` for rows of ``width = max_context + 4 + R``
    tokens, ``max_context`` = the longest prompt + the largest budget (``generate``), ``R`` =
    ``alloc_len_per_decode(k, S, N, P)`` (TR-020: the most positions past L one round gives
    slots).  Upstream has no such bound (its pool is sized from free GPU memory); here it caps a
    replay's allocation."""
    cfg, reqs = trace["config"], trace["requests"]
    P = cfg["page_size"]
    ctx = max((len(r["prompt_ids"]) for r in reqs), default=0) + max((r["max_new_tokens"] for r in reqs), default=0)
    width = ctx + 4 + alloc_len_per_decode(cfg["topk"], cfg["num_steps"], cfg["num_draft_tokens"], P)
    return 1 + cfg["max_batch"] * (-(-width // P) + 1)


def pool_size_problem(trace: dict) -> str | None:
    """Why the config's ``num_pages`` is no pool to allocate (not an int in ``2 ..``
    :func:`recording_pool_pages`), or None."""
    n, most = trace["config"].get("num_pages"), recording_pool_pages(trace)
    if not (isinstance(n, int) and 2 <= n <= most):
        return (f"config num_pages = {n}: not the pool the recording engine gives these requests (an int, 2 .. "
                f"{most} pages, page 0 included); a replay allocates num_pages")
    return None


def _page_problem(field: str, what, page: int, num_pages: int) -> str | None:
    """The PA-008 / PA-011 line for ``field`` = ``what`` naming ``page``, or None if it is a usable page."""
    if page == 0:
        return f"[PA-008] {field} = {what} lies in page 0, the reserved dummy page never given to a request"
    if not 0 < page < num_pages:
        return (f"[PA-011] {field} = {what} names page {page}, outside the recorded pool (num_pages = "
                f"{num_pages}: pages 1 .. {num_pages - 1} can be given out)")
    return None


def page_id_failures(entry: dict, cfg: dict) -> list[str]:
    """PA-008 / PA-011 for one request-round (module doc): at most one line per field, ID first.

    ``entry``: a ``tree`` entry; ``cfg``: the trace config (``page_size`` P, ``num_pages``,
    ``max_batch``).  Slots are token indices into the pool (page ``slot // P``), ``page_table``
    holds page ids.
    """
    P, NP = cfg["page_size"], cfg["num_pages"]
    raw = [("req_pool_index", entry["req_pool_index"])]
    raw += [(f"req_to_token[{j}]", x) for j, run in enumerate(entry["req_to_token"]) for x in run]
    raw += [(f"page_table[{j}]", x) for j, x in enumerate(entry["page_table"])]
    raw += [(f"draft_cache_loc[{t}][{j}]", x) for t, b in enumerate(entry["draft_cache_loc"]) for j, x in enumerate(b)]
    raw += [(f"moved_to[{j}]", x) for j, x in enumerate(entry.get("moved_to", []))]
    for field, x in raw:
        if type(x) is not int:  # a float or a string would index the pool wrongly or not at all
            return [f"[PA-011] {field} = {x!r}: slot, page and row ids are ints"]
    out = []
    r = entry["req_pool_index"]
    if r == 0:
        out.append("[PA-008] req_pool_index = 0 is the reserved dummy row of req_to_token")
    elif not 0 < r <= cfg["max_batch"]:
        out.append(f"[PA-011] req_pool_index = {r} is not a row of req_to_token (rows 1 .. max_batch = "
                   f"{cfg['max_batch']})")
    for j, (first, count) in enumerate(entry["req_to_token"]):  # a run's pages lie between its ends'
        bad = _page_problem(f"req_to_token[{j}]", [first, count], first // P, NP) or \
            _page_problem(f"req_to_token[{j}]", [first, count], (first + count - 1) // P, NP)
        if bad:
            out.append(bad)
            break
    fields = [("page_table", [(f"page_table[{j}]", p, p) for j, p in enumerate(entry["page_table"])])]
    fields.append(("draft_cache_loc", [(f"draft_cache_loc[{t}][{j}]", s, s // P)
                                       for t, branch in enumerate(entry["draft_cache_loc"])
                                       for j, s in enumerate(branch)]))
    if "moved_to" in entry:
        fields.append(("moved_to", [(f"moved_to[{j}]", s, s // P) for j, s in enumerate(entry["moved_to"])]))
    for _, items in fields:
        bad = next((b for f, what, page in items if (b := _page_problem(f, what, page, NP))), None)
        if bad:
            out.append(bad)
    return out


def greedy_path(parents: list[int], draft_tokens: list[int], target_predict: list[int]) -> list[int]:
    """TR-006 on a recorded tree: from the root (node 0), repeatedly take the first child in
    ascending node order whose token equals ``target_predict`` at the current node; stop when
    none does.  Children of ``cur`` are the later nodes whose parent is ``cur`` (TR-003: a parent
    precedes its child, so the walk ends even on a hand-edited cycle).  Returns the node ids."""
    path = [0]
    while True:
        cur = path[-1]
        nxt = next((c for c in range(cur + 1, len(parents))
                    if parents[c] == cur and draft_tokens[c] == target_predict[cur]), None)
        if nxt is None:
            return path
        path.append(nxt)


def round_tokens(trace: dict) -> list[list[tuple[int, list[int], int]]]:
    """Per round, per request of its ``rids``: ``(root token, the output tokens the round emitted,
    the index of the root in output_ids)`` (module doc).  Needs a trace whose schedule
    :func:`~refspec.traces.chain.check_trace` accepted (output lengths match the a's)."""
    outs = {r["rid"]: r["output_ids"] for r in trace["requests"]}
    done = dict.fromkeys(outs, 0)  # rid -> sum of a over its earlier rounds
    table = []
    for rd in trace["rounds"]:
        row = []
        for rid, a in zip(rd["rids"], rd["num_accept_tokens"]):
            s, o = done[rid], outs[rid]
            row.append((o[s], o[s + 1:s + 1 + a], s))
            done[rid] = s + a
        table.append(row)
    return table


def acceptance_failures(entry: dict, root: int, emitted: list[int], root_index: int = 0) -> list[str]:
    """TR-003 (the root token) and TR-006 (the path and the emitted tokens) of one request-round
    (module doc); ``root``, ``emitted`` and ``root_index`` from :func:`round_tokens`."""
    par, tok, pred, path = entry["parents"], entry["draft_tokens"], entry["target_predict"], entry["accept_path"]
    out = []
    if tok[0] != root:
        out.append(f"[TR-003] draft_tokens[0] = {tok[0]}: the root must be the committed last token "
                   f"output_ids[{root_index}] = {root}")
    walk = greedy_path(par, tok, pred)
    if path != walk:
        out.append(f"[TR-006] accept_path {path} is not the greedy walk {walk} over the recorded draft_tokens "
                   f"{tok} / target_predict {pred} (from the root, the first child whose token is the target's "
                   f"prediction at the current node)")
    if any(not (isinstance(i, int) and 0 <= i < len(tok)) for i in path):
        return out
    want = [tok[i] for i in path[1:]] + [pred[path[-1]]]
    if emitted != want[:len(emitted)]:
        out.append(f"[TR-006] the round emitted output_ids[{root_index + 1}:{root_index + 1 + len(emitted)}] = "
                   f"{emitted}; accept_path {path} gives its draft tokens + the bonus = {want}")
    return out
