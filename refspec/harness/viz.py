"""Pictures for the docs and the tutorials (matplotlib; the ``notebooks`` extra installs it).

Nothing here computes metadata: every function draws numbers it is given (``cu_seqlens_q``,
``cache_seqlens`` K_b, query lengths q_b, page-table rows, ``req_to_token`` rows), so a picture
shows exactly what the code under test produced.  Colours: one per request; in the visibility
grids blue = a key written before this forward, orange = a key this forward wrote, grey = masked
by the bottom-right causal rule, hatched = inside the request's last page but ``>= K_b`` (never
read, PA-007).

matplotlib is imported lazily, on the first drawing call; the backend is the caller's choice
(``docs/gen_figures.py`` and the headless notebook runs use Agg).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

PREFIX, NEW, MASKED, UNREAD = "#4c72b0", "#dd8452", "#d9d9d9", "#ffffff"
REQ_COLORS = ["#4c72b0", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974"]
PAD_COLOR = "#eeeeee"
KEPT_COLOR = "#000000"
#: font sizes (points): with the docs' 100 dpi, 9 pt is 12.5 px on the page (docs/gen_figures.py)
FONT, TITLE_FONT = 9, 10


def _plt():
    import matplotlib.pyplot as plt  # the backend is the caller's choice (scripts: Agg)

    return plt


def req_color(b: int) -> str:
    return REQ_COLORS[b % len(REQ_COLORS)]


def draw_query_rows(ax, cu_seqlens_q, total_rows: int, label: str = "", owner=None, num_real=None,
                    kept=None):
    """One strip of ``total_rows`` query rows; row t is coloured by the request that
    ``cu_seqlens_q`` assigns it to (white: no request).  ``owner[t]`` (optional, request index
    or -1) marks, as a letter in each cell, which request's token physically sits in row t, so
    a mismatch between layout and metadata is visible.  Requests >= ``num_real`` are padding.
    ``kept`` (optional): row indices to frame and label "kept" (the draft-extend rows whose
    output is used, e.g. ``b * N + a_b - 1`` in v2).

    Shapes: cu_seqlens_q ``[Bg+1]`` ints (rows); owner ``[total_rows]`` ints.
    """
    plt = _plt()
    cu = [int(x) for x in cu_seqlens_q]
    for t in range(total_rows):
        b = next((b for b in range(len(cu) - 1) if cu[b] <= t < cu[b + 1]), None)
        pad = b is not None and num_real is not None and b >= num_real
        color = "white" if b is None else (PAD_COLOR if pad else req_color(b))
        ax.add_patch(plt.Rectangle((t, 0), 1, 1, facecolor=color, edgecolor="black", lw=0.6))
        if owner is not None:
            o = int(owner[t])
            ax.text(t + 0.5, 0.5, "pad" if o < 0 else "r%d" % o, ha="center", va="center", fontsize=FONT)
    for t in kept or []:
        ax.add_patch(plt.Rectangle((t + 0.08, 0.08), 0.84, 0.84, fill=False, edgecolor=KEPT_COLOR, lw=3))
        ax.plot([t + 0.5], [1.3], marker="v", color=KEPT_COLOR, markersize=7)
    for x in cu:
        ax.plot([x, x], [-0.25, 1.25], color="black", lw=2)
    ax.set_xlim(-0.5, total_rows + 0.5)
    ax.set_ylim(-0.4, 1.6 if kept else 1.4)
    ax.set_yticks([])
    ax.set_xticks(cu)
    ax.tick_params(labelsize=FONT)
    ax.set_title(label, fontsize=TITLE_FONT, loc="left")
    for s in ("top", "right", "left"):
        ax.spines[s].set_visible(False)


def draw_visibility(ax, K: int, q: int, page_size: int, page_row=None, title: str = "", kept_row=None):
    """The bottom-right causal window of one request: rows i < q, key columns p.

    Row i sees key p iff ``p <= i + K - q`` (PA-004).  Columns run to the end of the last page
    the request uses; page boundaries are drawn and labelled with ``page_row`` (page ids).
    ``kept_row`` (optional): the row i whose output is used, framed and labelled "kept".
    """
    plt = _plt()
    P = page_size
    n_pages = max(1, -(-K // P))
    ncols = n_pages * P
    for i in range(q):
        for p in range(ncols):
            if p >= K:
                c, hatch = UNREAD, "////"
            elif p <= i + K - q:
                c, hatch = (PREFIX if p < K - q else NEW), None
            else:
                c, hatch = MASKED, None
            ax.add_patch(plt.Rectangle((p, q - 1 - i), 1, 1, facecolor=c, lw=0.5, hatch=hatch,
                                       edgecolor="#aaaaaa" if hatch else "white"))
    for j in range(n_pages + 1):
        ax.plot([j * P, j * P], [0, q], color="black", lw=1.2)
    if page_row is not None:
        for j in range(n_pages):
            ax.text(j * P + P / 2, q + 0.12, f"p{int(page_row[j])}", ha="center", va="bottom", fontsize=FONT)
    if kept_row is not None:
        ax.add_patch(plt.Rectangle((0, q - 1 - kept_row), ncols, 1, fill=False, edgecolor=KEPT_COLOR, lw=2.5,
                                   zorder=3))
    ax.set_xlim(0, ncols)
    ax.set_ylim(0, q + 1.0)
    ax.set_yticks([q - 0.5 - i for i in range(q)],
                  [f"i={i}" + (" kept" if i == kept_row else "") for i in range(q)], fontsize=FONT)
    ax.set_xticks(range(0, ncols, max(1, P)))
    ax.tick_params(labelsize=FONT)
    ax.set_title(title, fontsize=TITLE_FONT)


def add_legend(fig) -> None:
    """The colour key of :func:`draw_visibility`, across the bottom of ``fig``."""
    plt = _plt()
    items = [(PREFIX, None, "key written before this forward"), (NEW, None, "key written by this forward"),
             (MASKED, None, "hidden by the causal rule"), (UNREAD, "////", "past K: never read")]
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, hatch=h, edgecolor="#aaaaaa") for c, h, _ in items]
    fig.legend(handles, [t for _, _, t in items], loc="lower center", ncol=2, fontsize=FONT, frameon=False,
               bbox_to_anchor=(0.5, -0.16))


def mode_figure(cu_seqlens_q, cache_seqlens, page_table, page_size: int, title: str, num_real=None,
                total_rows=None, kept_rows=None, width_in: float = 6.8):
    """Query layout strip on top, one visibility grid per real request below (``width_in`` inches
    wide; the docs save it at 100 dpi, the width of the docs' text column).

    ``kept_rows`` (optional): one query row per request whose output is used (v2 draft extend:
    ``b * N + a_b - 1``), framed in the strip and in the request's grid.
    Shapes: cu_seqlens_q ``[B+1]``; cache_seqlens ``[B]`` (tokens); page_table ``[B, M]`` (pages).
    Returns the matplotlib Figure.
    """
    plt = _plt()
    cu = [int(x) for x in cu_seqlens_q]
    K = [int(x) for x in cache_seqlens]
    B = len(K) if num_real is None else num_real
    widths = [max(1, -(-K[b] // page_size)) * page_size for b in range(B)]
    lines = title.count("\n") + 1
    fig = plt.figure(figsize=(width_in, 3.6 + 0.2 * lines), dpi=100)
    gs = fig.add_gridspec(2, max(B, 1), height_ratios=[1, 2.6], width_ratios=widths or [1], hspace=0.75,
                          wspace=0.45 if kept_rows is None else 0.9, top=0.86 - 0.05 * lines)
    ax = fig.add_subplot(gs[0, :])
    label = "query rows (cu_seqlens_q = %s)" % cu + ("; framed: kept rows" if kept_rows else "")
    draw_query_rows(ax, cu, total_rows or cu[-1], label, num_real=num_real, kept=kept_rows)
    for b in range(B):
        q = cu[b + 1] - cu[b]
        axb = fig.add_subplot(gs[1, b])
        kept = None if kept_rows is None else int(kept_rows[b]) - cu[b]
        draw_visibility(axb, K[b], q, page_size, page_table[b], f"req {b}: q={q}, K={K[b]}", kept_row=kept)
    fig.suptitle(title, fontsize=TITLE_FONT, x=0.01, ha="left")
    add_legend(fig)
    return fig


def draw_pool(ax, req_to_token, rows, lens, num_pages: int, page_size: int, title: str = "KV pool"):
    """The pool as a grid: one row per page (page 0 reserved), ``P`` slots per row, each slot
    coloured by the request whose ``req_to_token`` row points at it and labelled
    ``r<b>:<position>``.

    Shapes: req_to_token ``[max_reqs, ctx]`` int32; rows, lens: per request (row, tokens).
    """
    plt = _plt()
    P = page_size
    owner = {}
    for b, (r, n) in enumerate(zip(rows, lens)):
        for pos, slot in enumerate(req_to_token[r, :n].tolist()):
            owner[int(slot)] = (b, pos)
    for page in range(num_pages):
        y = num_pages - 1 - page
        for off in range(P):
            s = page * P + off
            b, pos = owner.get(s, (None, None))
            c = "#bbbbbb" if page == 0 else ("white" if b is None else req_color(b))
            ax.add_patch(plt.Rectangle((off, y), 1, 1, facecolor=c, edgecolor="black", lw=0.5))
            txt = "dummy" if page == 0 and off == 0 else ("" if b is None else f"r{b}:{pos}")
            ax.text(off + 0.5, y + 0.5, txt, ha="center", va="center", fontsize=FONT)
    ax.set_xlim(0, P)
    ax.set_ylim(0, num_pages)
    ax.set_yticks([num_pages - 0.5 - p for p in range(num_pages)], [f"page {p}" for p in range(num_pages)],
                  fontsize=FONT)
    ax.set_xticks([o + 0.5 for o in range(P)], [f"+{o}" for o in range(P)], fontsize=FONT)
    ax.set_title(title, fontsize=TITLE_FONT)


def draw_slot_arrows(ax, pairs, num_pages: int, page_size: int, color: str = "#c44e52") -> None:
    """Arrows on a :func:`draw_pool` grid, one per ``(from_slot, to_slot)`` pair (flat slot ids),
    e.g. from the slot that holds a position to the slot a wrong page table makes the kernel read."""
    P = page_size

    def centre(slot: int) -> tuple[float, float]:
        return slot % P + 0.5, num_pages - 1 - slot // P + 0.5

    for src, dst in pairs:
        ax.annotate("", xy=centre(dst), xytext=centre(src),
                    arrowprops=dict(arrowstyle="->", color=color, lw=1.2, connectionstyle="arc3,rad=0.25"))


def draw_int_table(ax, values, row_labels, title: str = "", colors=None):
    """A small table of integers (e.g. ``req_to_token`` rows or a page table) as coloured cells.

    ``values``: list of lists of ints (ragged is fine); ``colors``: same shape, or None.
    """
    plt = _plt()
    n = len(values)
    width = max((len(v) for v in values), default=1)
    for i, row in enumerate(values):
        for j, x in enumerate(row):
            c = "white" if colors is None else colors[i][j]
            ax.add_patch(plt.Rectangle((j, n - 1 - i), 1, 1, facecolor=c, edgecolor="black", lw=0.5))
            ax.text(j + 0.5, n - 0.5 - i, str(x), ha="center", va="center", fontsize=FONT)
    ax.set_xlim(0, width)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 0.5 - i for i in range(n)], row_labels, fontsize=FONT)
    ax.set_xticks([j + 0.5 for j in range(width)], [str(j) for j in range(width)], fontsize=FONT)
    ax.set_title(title, fontsize=TITLE_FONT)


def show(fig) -> None:
    """Show ``fig`` in Jupyter (inline backend), then close it; headless runs (CI executing the
    tutorials, plain ``python``) only build the figure."""
    import matplotlib

    plt = _plt()
    if "inline" in matplotlib.get_backend():
        plt.show()
    plt.close(fig)
