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


def compare(ours: dict, theirs: dict, page_size: int, num_pages: int | None = None) -> list[Diff]:
    """The raw differences (``documented`` unset) between two field dicts.

    ``num_pages``: the pool's page count, where known; a live page id of upstream's outside
    ``[0, num_pages)`` (below 0 alone when it is None) sets ``out_of_pool`` on the
    ``page_table[live]`` diff (PA-011: the kernel dereferences it).

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
                          short_table=short, truncated=all(cut(x) for x in live_bad), out_of_pool=bool(bad_ids)))
    if dead_bad or a.shape[1] != b.shape[1]:
        diffs.append(Diff("page_table[dead]", f"width {a.shape[1]}, rows differing {dead_bad}",
                          f"width {b.shape[1]}" + (f" (< {bound} pages, the kernel bound)" if b.shape[1] < bound
                                                   else ""),
                          short_table=b.shape[1] < bound, width_only=not dead_bad))
    return diffs


def compare_parts(ours: dict, theirs: dict, page_size: int, expand_page_size: int) -> list[Diff]:
    """The raw differences of a top-k > 1 result: each part by :func:`compare` (field names
    ``part:field``), then the ``tree`` part exactly (shape and values)."""
    diffs = []
    for part, P in zip(PARTS, (page_size, expand_page_size)):
        if theirs.get(part) is None:  # upstream returned no such part: every field of it is missing
            diffs.append(Diff(f"{part}:*", "present", MISSING))
            continue
        diffs += [replace(d, field=f"{part}:{d.field}") for d in compare(ours[part], theirs[part], P)]
    mine, their_tree = ours.get("tree", {}), theirs.get("tree", {})
    for f in sorted(set(mine) | set(their_tree)):  # a field only one side has differs too
        a, b = mine.get(f), their_tree.get(f)
        if a is None or b is None or a.shape != b.shape or not torch.equal(a.long(), b.long()):
            diffs.append(Diff(f"tree:{f}", MISSING if a is None else _show(a), MISSING if b is None else _show(b)))
    return diffs
