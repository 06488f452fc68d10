"""Field-by-field comparison of refspec's and upstream's metadata for one result.

Kernel-read fields are compared bitwise (values and dtype-free integer content):

* ``cache_seqlens_int32`` [bs], ``cu_seqlens_q`` [bs + 1], ``cu_seqlens_k`` [bs + 1] (upstream
  passes it as ``cu_seqlens_k_new`` on its extend path), ``max_seq_len_q``;
* the *live* page-table region ``page_table[b, :ceil(K_b / P)]`` of every row b (real and
  padded), K_b being refspec's ``cache_seqlens`` (the region FA3 reads, PA-007).

Fields the kernel does not read are reported, not failed, when the difference is listed in
:data:`refspec.conformance.known.KNOWN`: ``max_seq_len_k`` and the *dead* page-table columns
(at or past ``ceil(K_b / P)``, including a different table width).  An unlisted difference in
them fails like any other.  The ``page_table[dead]`` diff says whether only the width differs
(``width_only``: the dead columns both tables have agree) and whether upstream's table is
narrower than the kernel bound ``ceil(max_b K_b / P)`` (``short_table``: then a live page is
dropped too, and ``page_table[live]`` differs with ``short_table`` set).  The ``page_table[live]``
diff says whether every differing row lacks only the live pages past upstream's width, the pages
both tables have agreeing (``truncated``): the signature of a table below the kernel bound, as
opposed to wrong page ids.

Top-k > 1 results (:mod:`refspec.conformance.tree_cases`) have two metadata *parts*, each
compared by these rules under its own page size (:func:`compare_parts`): ``prefix:<field>`` and
``expand:<field>`` (the verify expand table holds token slots: page size 1); and verify's eager
result a ``tree:<field>`` part (FULL_MASK ``custom_mask``, ``positions``, ``retrive_*``,
``draft_tokens``), compared exactly and never documentable.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

KERNEL_FIELDS = ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "max_seq_len_q", "page_table[live]")
OTHER_FIELDS = ("max_seq_len_k", "page_table[dead]")
PARTS = ("prefix", "expand")  #: the two metadata parts of a top-k > 1 result


def base_field(field: str) -> str:
    """``expand:cu_seqlens_k`` -> ``cu_seqlens_k`` (the field without its part)."""
    return field.rpartition(":")[2]


@dataclass(frozen=True)
class Diff:
    """One field that differs: ``ours`` / ``theirs`` are short printable values."""

    field: str
    ours: str
    theirs: str
    documented: str | None = None  #: the :data:`KNOWN` key that explains it, None if undocumented
    short_table: bool = False  #: upstream's page table has fewer than ceil(K_b / P) columns (PA-003)
    width_only: bool = False  #: page_table[dead]: the tables differ in width only (shared dead columns agree)
    truncated: bool = False  #: page_table[live]: each differing row lacks only pages past upstream's width
    #: page_table[live]: a page id upstream hands the kernel in a row it reads is outside the pool ([0, num_pages):
    #: negative, e.g. a padded row's -1, or at / past ``num_pages`` when it is known): PA-011
    out_of_pool: bool = False
    #: ``kernel:`` diffs: the upstream line that made the kernel call (``(file, line)``, the caller the
    #: recorder saw); None for a metadata field (its line comes from the trace)
    at: tuple[str, int] | None = None
    #: page_table[live]: the row shown is a graph's padding row (no real request's row differs)
    padded: bool = False
    #: ``kernel:`` diff of a replay: the kernel reads stale values from a buffer the replay hook left, while the
    #: metadata field (rebound elsewhere) is right: the captured buffer was not rewritten in place (CG-001)
    stale: bool = False


def _show(x) -> str:
    if isinstance(x, torch.Tensor):
        v = x.tolist()
        s = str(v)
        return s if len(s) <= 60 else s[:57] + "..."
    return str(x)


def _vec(a: torch.Tensor, n: int) -> list[int]:
    return [int(v) for v in a.flatten()[:n].tolist()]


def live_pages(k: int, page_size: int) -> int:
    """Pages FA3 reads for a row of K keys: ``ceil(K / P)``."""
    return -(-int(k) // page_size)


MISSING = "missing"  #: the printed value of a field one side did not return


def compare(ours: dict, theirs: dict, page_size: int, num_pages: int | None = None,
            real: int | None = None) -> list[Diff]:
    """The raw differences (``documented`` unset) between two field dicts.

    ``num_pages``: the pool's page count, where known; a live page id of upstream's outside
    ``[0, num_pages)`` (below 0 alone when it is None) sets ``out_of_pool`` on the
    ``page_table[live]`` diff (PA-011: the kernel dereferences it).  ``real``: how many of the rows
    are real requests (the rest a graph's padding): the row a ``page_table[live]`` diff shows is a
    real one where any differs.

    Rows: the batch size is refspec's ``cache_seqlens`` length; upstream tensors may be longer
    (graph buffers) and are cut to it, never padded.  A field that one side does not return (no
    key, or ``None``) is a difference with the value ``missing`` on that side, never skipped.
    """
    bs = int(ours["cache_seqlens_int32"].numel())
    diffs = []
    for f, n in (("cache_seqlens_int32", bs), ("cu_seqlens_q", bs + 1), ("cu_seqlens_k", bs + 1)):
        a, b = ours.get(f), theirs.get(f)
        if a is None or b is None or b.numel() < n or a.numel() < n or _vec(a, n) != _vec(b, n):
            diffs.append(Diff(f, MISSING if a is None else _show(a[:n]), MISSING if b is None else _show(b[:n])))
    for f in ("max_seq_len_q", "max_seq_len_k"):
        a, b = ours.get(f), theirs.get(f)
        if a is None or b is None or a != b:
            diffs.append(Diff(f, str(MISSING if a is None else a), str(MISSING if b is None else b)))
    if ours.get("page_table") is None or theirs.get("page_table") is None:
        side = lambda d: MISSING if d.get("page_table") is None else f"width {d['page_table'].shape[-1]}"
        return diffs + [Diff("page_table[live]", side(ours), side(theirs))]
    a, b = ours["page_table"], theirs["page_table"]
    live_bad, dead_bad, w = [], [], min(a.shape[1], b.shape[1])
    bound = max([live_pages(k, page_size) for k in ours["cache_seqlens_int32"][:bs].tolist()] + [0])
    for r in range(bs):
        m = live_pages(ours["cache_seqlens_int32"][r], page_size)
        if b.shape[0] <= r or b.shape[1] < m or a.shape[1] < m or _vec(a[r, :m], m) != _vec(b[r, :m], m):
            live_bad.append(r)
        if b.shape[0] > r and _vec(a[r, m:w], w) != _vec(b[r, m:w], w):  # the dead columns both tables have
            dead_bad.append(r)
    if live_bad:
        if real is not None:  # show a real request's row first
            live_bad = [x for x in live_bad if x < real] + [x for x in live_bad if x >= real]
        r = live_bad[0]
        m = live_pages(ours["cache_seqlens_int32"][r], page_size)
        theirs_row = _show(b[r, :m]) if b.shape[0] > r else "missing"
        short = b.shape[1] < m
        if short:
            theirs_row += f" ({b.shape[1]} columns < {m} live pages)"

        def cut(x):  # row x differs only by the live pages upstream's table has no column for
            n = b.shape[1]
            return b.shape[0] > x and n < live_pages(ours["cache_seqlens_int32"][x], page_size) and \
                _vec(a[x, :n], n) == _vec(b[x, :n], n)

        def outside(x):  # a page id of row x the kernel reads that is not a page of the pool
            n = min(live_pages(ours["cache_seqlens_int32"][x], page_size), b.shape[1])
            ids = _vec(b[x, :n], n) if b.shape[0] > x else []
            return any(v < 0 or (num_pages is not None and v >= num_pages) for v in ids)

        bad_ids = [x for x in live_bad if outside(x)]
        if bad_ids:  # show a row with an id outside the pool first
            r = bad_ids[0]
            m = live_pages(ours["cache_seqlens_int32"][r], page_size)
            theirs_row = _show(b[r, :m]) + (f" ({b.shape[1]} columns < {m} live pages)" if b.shape[1] < m else "")
        diffs.append(Diff("page_table[live]", f"row {r}: {_show(a[r, :m])}", f"row {r}: {theirs_row}",
                          short_table=short, truncated=all(cut(x) for x in live_bad), out_of_pool=bool(bad_ids),
                          padded=real is not None and r >= real))
    if dead_bad or a.shape[1] != b.shape[1]:
        diffs.append(Diff("page_table[dead]", f"width {a.shape[1]}, rows differing {dead_bad}",
                          f"width {b.shape[1]}" + (f" (< {bound} pages, the kernel bound)" if b.shape[1] < bound
                                                   else ""),
                          short_table=b.shape[1] < bound, width_only=not dead_bad))
    return diffs


def compare_parts(ours: dict, theirs: dict, page_size: int, expand_page_size: int,
                  real: dict | None = None) -> list[Diff]:
    """The raw differences of a top-k > 1 result: each part by :func:`compare` (field names
    ``part:field``; ``real``: each part's count of real rows), then the ``tree`` part exactly
    (shape and values)."""
    diffs = []
    for part, P in zip(PARTS, (page_size, expand_page_size)):
        if theirs.get(part) is None:  # upstream returned no such part: every field of it is missing
            diffs.append(Diff(f"{part}:*", "present", MISSING))
            continue
        diffs += [replace(d, field=f"{part}:{d.field}")
                  for d in compare(ours[part], theirs[part], P, real=(real or {}).get(part))]
    mine, their_tree = ours.get("tree", {}), theirs.get("tree", {})
    for f in sorted(set(mine) | set(their_tree)):  # a field only one side has differs too
        a, b = mine.get(f), their_tree.get(f)
        if a is None or b is None or a.shape != b.shape or not torch.equal(a.long(), b.long()):
            diffs.append(Diff(f"tree:{f}", MISSING if a is None else _show(a), MISSING if b is None else _show(b)))
    return diffs


# -- the kernel's real arguments (refspec.conformance.recorder): what the forward hands the kernel --

#: the arguments of the paged ``flash_attn_with_kvcache`` call the FA3 kernel reads, as compared
#: (``kernel:<name>``); ``new_kv``: whether new k / v are passed (never, store-then-attend: then
#: ``cu_seqlens_k_new`` is not read either); ``k_cache``: the paged cache's ``[P, Hkv, D]`` layout.
#: Not compared, because the kernel does not read them on this call or they change no value read:
#: ``q`` / ``out`` contents, ``cu_seqlens_k_new`` without new k / v, ``max_seqlen_k`` (FA4's static
#: grid only), ``return_softmax_lse``, ``pack_gqa``, ``sm_margin``, ``ver``
KERNEL_ARGS = ("cache_seqlens", "cu_seqlens_q", "max_seqlen_q", "page_table[live]", "causal", "window_size",
               "softmax_scale", "softcap", "num_splits", "attention_chunk", "k_cache", "new_kv", "scheduler_metadata")
#: the metadata field a kernel argument is read from: a kernel difference showing the same values as
#: that field's difference is the same finding (the metadata one cites the line that wrote it)
KERNEL_ALIASES = {"cache_seqlens": "cache_seqlens_int32", "cu_seqlens_q": "cu_seqlens_q",
                  "max_seqlen_q": "max_seq_len_q", "page_table[live]": "page_table[live]"}
#: ``Diff.documented`` of a metadata field the FA3 call does not read (:data:`UNREAD_FIELDS`): reported,
#: never a failure
UNREAD = "not read by the FA3 kernel"
#: metadata fields the paged FA3 call does not read: ``max_seqlen_k`` (FA4's static grid only),
#: ``cu_seqlens_k`` (read as ``cu_seqlens_k_new`` only with new k / v, which SGLang never passes:
#: docs/kernel-facts.md#cu-seqlens-k-new), the dead page-table columns at or past ``ceil(K_b / P)``
#: (PA-007; a table too narrow for a live page differs on ``page_table[live]``)
UNREAD_FIELDS = ("max_seq_len_k", "cu_seqlens_k", "page_table[dead]")


def unread_by(calls, field: str) -> bool:
    """Whether the kernel calls of a result (plain dicts; None where none were recorded: the paged
    no-new-K/V call every FA3 path here makes) leave ``field`` (an :data:`UNREAD_FIELDS` name, with
    or without its part) unread: no call passes ``max_seqlen_k``, none passes new k / v with
    ``cu_seqlens_k_new``, none is a varlen call; the dead columns are never read."""
    f = base_field(field)
    if f not in UNREAD_FIELDS:
        return False
    for c in calls if isinstance(calls, list) else ():
        a = c["args"]
        if f == "max_seq_len_k" and a.get("max_seqlen_k") is not None:
            return False
        if f == "cu_seqlens_k" and (not c["name"].endswith("kvcache") or a.get("k") is not None):
            return False
    return True


#: ``get_scheduler_metadata``'s markers start here (``upstream_common.SchedulerMetadata.MARK``)
SCHED_MARK = 1_000_000
#: the key of a job's upstream result holding its ``get_scheduler_metadata`` calls
SCHED_KEY = ("scheduler_metadata", None)


def _t(x):
    return x["tensor"] if isinstance(x, dict) and "tensor" in x else None


def _window(x) -> tuple:
    return tuple(-1 if v is None else int(v) for v in (x or (-1, -1)))


def _mask(a: dict) -> tuple[bool, tuple]:
    """``(causal, window)`` as the kernel takes them: FA3's ``mha_fwd`` sets ``window_size_right = 0``
    when ``causal`` and then treats ``window_size_left < 0 and window_size_right == 0`` (no
    attention chunk) as causal (flash_api.cpp:805, :148 at fa4-v4.0.0.beta27), so ``causal=True``
    with ``(-1, 0)`` or ``(-1, -1)`` is one mask; negative sizes are -1."""
    left, right = _window(a.get("window_size"))
    if a.get("causal"):
        right = 0
    left, right = max(left, -1), max(right, -1)
    return left < 0 and right == 0 and not int(a.get("attention_chunk") or 0), (left, right)


def _scale(x, head_dim: int) -> float:
    return head_dim ** -0.5 if x is None else float(x)


def kernel_diffs(ours: list, theirs: list, page_size: int, sched: list | None = None,
                 num_pages: int | None = None) -> list[Diff]:
    """The differences between refspec's and upstream's kernel calls of one result (each a
    :meth:`~refspec.conformance.recorder.Call.plain` dict), as ``kernel:<argument>`` diffs
    (:data:`KERNEL_ARGS`, compared as :func:`compare` compares the metadata: rows cut to refspec's
    batch, the live page-table region per row).  The calls are paired in order; a different number
    or kind of call is one ``kernel:calls`` diff.  Where upstream passes ``scheduler_metadata`` it
    must be the marker of one of ``sched`` (the job's ``get_scheduler_metadata`` calls) whose
    arguments agree with this call's (:func:`scheduler_diffs`)."""
    a_calls = [c for c in ours if c["name"].startswith("flash_attn")]
    b_calls = [c for c in theirs if c["name"].startswith("flash_attn")]
    if [c["name"] for c in a_calls] != [c["name"] for c in b_calls]:
        show = lambda cs: ", ".join(c["name"] for c in cs) or "no kernel call"  # noqa: E731
        return [Diff("kernel:calls", show(a_calls), show(b_calls))]
    diffs = []
    for a, b in zip(a_calls, b_calls):
        at = tuple(b["where"]) if b.get("where") else None
        diffs += [replace(d, at=at) for d in _call_diffs(a["args"], b["args"], page_size, sched or [], num_pages)]
    return diffs


def _call_diffs(a: dict, b: dict, page_size: int, sched: list, num_pages: int | None) -> list[Diff]:
    out = []
    ka, kb = _t(a.get("cache_seqlens")), _t(b.get("cache_seqlens"))
    qa = _t(a.get("q"))
    head_dim = int(qa.shape[-1]) if qa is not None else 1
    if ka is None or kb is None:
        return [Diff("kernel:cache_seqlens", MISSING if ka is None else _show(ka),
                     MISSING if kb is None else _show(kb))]
    md_a = {"cache_seqlens_int32": ka, "cu_seqlens_q": _t(a.get("cu_seqlens_q")), "cu_seqlens_k": None,
            "max_seq_len_q": a.get("max_seqlen_q"), "max_seq_len_k": None, "page_table": _t(a.get("page_table"))}
    md_b = {"cache_seqlens_int32": kb, "cu_seqlens_q": _t(b.get("cu_seqlens_q")), "cu_seqlens_k": None,
            "max_seq_len_q": b.get("max_seqlen_q"), "max_seq_len_k": None, "page_table": _t(b.get("page_table"))}
    names = {v: k for k, v in KERNEL_ALIASES.items()}
    for d in compare(md_a, md_b, page_size, num_pages):
        if d.field in names:  # (cu_seqlens_k / max_seqlen_k / the dead columns: not read on this call)
            out.append(replace(d, field=f"kernel:{names[d.field]}"))
    scalars = (("softcap", lambda x: float(x or 0.0), 0.0), ("num_splits", lambda x: int(x or 0), 0),
               ("attention_chunk", lambda x: int(x or 0), 0))
    for name, norm, default in scalars:
        va, vb = norm(a.get(name, default)), norm(b.get(name, default))
        if va != vb:
            out.append(Diff(f"kernel:{name}", str(va), str(vb)))
    ma, mb = _mask(a), _mask(b)  # the mask the kernel applies: a flag or window differing into the same one is none
    if bool(a.get("causal")) != bool(b.get("causal")):
        if ma != mb:
            out.append(Diff("kernel:causal", str(bool(a.get("causal"))), str(bool(b.get("causal")))))
    elif ma[1] != mb[1]:
        out.append(Diff("kernel:window_size", str(_window(a.get("window_size"))), str(_window(b.get("window_size")))))
    sa, sb = _scale(a.get("softmax_scale"), head_dim), _scale(b.get("softmax_scale"), head_dim)
    if sa != sb:
        out.append(Diff("kernel:softmax_scale", repr(sa), repr(sb)))
    ca, cb = a.get("k_cache"), b.get("k_cache")
    la = tuple(ca["shape"][1:]) if isinstance(ca, dict) else None
    lb = tuple(cb["shape"][1:]) if isinstance(cb, dict) else None
    if la != lb:
        out.append(Diff("kernel:k_cache", f"pages of [P, Hkv, D] = {list(la) if la else MISSING}",
                        f"pages of {list(lb) if lb else MISSING}"))
    new_a = [n for n in ("k", "v") if a.get(n) is not None]
    new_b = [n for n in ("k", "v") if b.get(n) is not None]
    if new_a != new_b:
        out.append(Diff("kernel:new_kv", ", ".join(new_a) or "none", ", ".join(new_b) or "none"))
    if b.get("scheduler_metadata") is not None or a.get("scheduler_metadata") is not None:
        out += scheduler_diffs(b, sched)
    return out


def scheduler_diffs(call: dict, sched: list) -> list[Diff]:
    """``kernel:scheduler_metadata`` diffs of one upstream kernel call (its bound arguments ``call``)
    against the ``get_scheduler_metadata`` call whose marker it hands the kernel (``sched``: that
    job's calls, :meth:`~refspec.conformance.recorder.Call.plain` dicts, in order).  FA3 plans its
    split-KV work from those arguments, so they must be this call's: the batch size (rows of
    ``cache_seqlens``), ``max_seqlen_q``, a ``max_seqlen_k`` of at least every K_b, the heads and
    head dimension of ``q`` / ``k_cache``, ``cache_seqlens`` and ``cu_seqlens_q`` value for value,
    the page size, ``causal``, ``window_size``, softcap on or off, and ``num_splits``.  A
    ``scheduler_metadata`` that is no call's marker (stale, partly rewritten, computed elsewhere)
    differs as a whole."""
    x = _t(call.get("scheduler_metadata"))
    vals = [] if x is None else sorted({int(v) for v in x.flatten().tolist()})
    idx = vals[0] - SCHED_MARK if len(vals) == 1 else -1
    if x is None or not 0 <= idx < len(sched):
        shown = "None" if x is None else f"values {vals[:6]}"
        return [Diff("kernel:scheduler_metadata", "a scheduler_metadata",
                     f"not the output of any get_scheduler_metadata call of this job ({shown})")]
    s = sched[idx]["args"]
    q, kc, kb = _t(call.get("q")), call.get("k_cache"), _t(call.get("cache_seqlens"))
    checks = [("batch_size", int(kb.numel()), int(s.get("batch_size"))),
              ("max_seqlen_q", int(call.get("max_seqlen_q") or 0), int(s.get("max_seqlen_q") or 0)),
              ("num_heads", int(q.shape[-2]), int(s.get("num_heads"))),
              ("num_heads_k", int(kc["shape"][-2]), int(s.get("num_heads_k"))),
              ("headdim", int(q.shape[-1]), int(s.get("headdim"))),
              ("cache_seqlens", _vec(kb, kb.numel()), _vec(_t(s.get("cache_seqlens")), kb.numel())
               if _t(s.get("cache_seqlens")) is not None else MISSING),
              ("page_size", int(kc["shape"][1]), None if s.get("page_size") is None else int(s.get("page_size"))),
              ("causal", bool(call.get("causal")), bool(s.get("causal"))),
              ("window_size", _window(call.get("window_size")), _window(s.get("window_size"))),
              ("has_softcap", bool(call.get("softcap")), bool(s.get("has_softcap"))),
              ("num_splits", int(call.get("num_splits") or 0), int(s.get("num_splits") or 0))]
    cq, sq = _t(call.get("cu_seqlens_q")), _t(s.get("cu_seqlens_q"))
    if sq is not None and cq is not None:
        n = int(kb.numel()) + 1
        checks.append(("cu_seqlens_q", _vec(cq, n), _vec(sq, n)))
    out = [Diff("kernel:scheduler_metadata", f"{name} {mine}", f"get_scheduler_metadata({name}={got})")
           for name, mine, got in checks if mine != got]
    max_k = s.get("max_seqlen_k")
    if max_k is None or int(max_k) < max(_vec(kb, kb.numel()) or [0]):
        out.append(Diff("kernel:scheduler_metadata", f"cache_seqlens up to {max(_vec(kb, kb.numel()) or [0])}",
                        f"get_scheduler_metadata(max_seqlen_k={max_k})"))
    return out
