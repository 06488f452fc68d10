"""Regenerate the pictures of the docs (``docs/img/*.png``) and print the worked examples' numbers.

    .venv/bin/python docs/gen_figures.py          # writes docs/img/*.png, prints the tables

Every number and picture comes from refspec itself on the docs' running example (P = 4,
Sd = 3, N = 4, three requests with committed lengths L = [5, 8, 12], v1 accepts a = [2, 4, 1];
pages handed out by a shuffled allocator, seed 0).  ``tests/test_docs.py`` recomputes the
numbers with :func:`example_metadata` and checks that the mode pages quote them, keeps the
images small (< 60 KB each) and readable: every figure is at most ``MAX_WIDTH_PX`` wide (the
docs' text column at 1280 px, so the browser never scales it down) and its smallest text is
``min font size x DPI / 72 >= MIN_TEXT_PX`` pixels (:func:`render_all` reports both).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from refspec.mutants import variants

from refspec.harness import viz
from refspec.core.modes import ForwardMode as M
from refspec.harness.scenario import Scenario

IMG = Path(__file__).resolve().parent / "img"
P, N = 4, 4
L = [5, 8, 12]
A = [2, 4, 1]

#: page name -> Scenario keyword arguments of its worked example
EXAMPLES = {
    "decode": dict(mode=M.DECODE, lens=[x + 1 for x in L]),
    "draft-decode": dict(mode=M.DECODE, lens=L, draft_step=1),
    "target-verify": dict(mode=M.TARGET_VERIFY, lens=L),
    "draft-extend-v1": dict(mode=M.DRAFT_EXTEND, lens=L, num_accept_tokens=A),
    "draft-extend-v2": dict(mode=M.DRAFT_EXTEND_V2, lens=L, num_accept_tokens=A),
    "extend": dict(mode=M.EXTEND, lens=[0, 8, 3], extend_lens=[5, 4, 2]),
}
TITLES = {
    "decode": "DECODE: one new token per request, at position L (seq_lens = L + 1)",
    "draft-decode": "draft decode, step s = 1: K = L + s + 1",
    "target-verify": "TARGET_VERIFY: N = 4 chained tokens per request, K = L + N",
    "draft-extend-v1": "DRAFT_EXTEND (v1): a = [2, 4, 1] accepted, packed; K = L + a;\n"
                       "kept row = the last of each request's a_b rows",
    "draft-extend-v2": "DRAFT_EXTEND_V2: all N = 4 rows per request; K = seq_lens = L + N;\n"
                       "kept row b*N + a_b - 1 = [1, 7, 8] (a = [2, 4, 1])",
    "extend": "EXTEND (prefill): prefixes [0, 8, 3], extend lengths [5, 4, 2]",
}
GRAPH_BS = 4
DPI = 100  #: pixels per inch of the saved PNGs
MAX_WIDTH_PX = 700  #: the text column of the Material theme at a 1280 px wide window is ~ 700 px
MIN_TEXT_PX = 11  #: smallest text on the page, in pixels
WIDTH_IN = 6.8  #: figure width (inches) before bbox_inches="tight" trims the margins


def build(name: str):
    return Scenario(page_size=P, num_draft_tokens=N, seed=0, **EXAMPLES[name]).build()


def _fmt(t) -> str:
    return str(t.tolist() if hasattr(t, "tolist") else t)


def example_metadata(name: str) -> dict[str, str]:
    """The eager metadata of page ``name``'s example (and the replay at Bg = 4 for graphed
    modes) as strings, e.g. ``{"cache_seqlens": "[9, 12, 16]", ...}``."""
    built = build(name)
    built.run_fa3()
    md = built.extra["metadata"]
    fb = built.fb
    out = {
        "cache_seqlens": _fmt(md.cache_seqlens_int32),
        "cu_seqlens_q": _fmt(md.cu_seqlens_q),
        "cu_seqlens_k": _fmt(md.cu_seqlens_k),
        "max_seqlen_q": _fmt(md.max_seq_len_q),
        "max_seqlen_k": _fmt(md.max_seq_len_k),
        "page_table": _fmt(md.page_table),
        "positions": _fmt(fb.positions),
        "out_cache_loc": _fmt(fb.out_cache_loc),
        "req_to_token": _fmt([built.kv.req_to_token[r, :k].tolist()
                              for r, k in zip(fb.req_pool_indices.tolist(), built.K)]),
    }
    if name != "extend":
        runner = built.graph_runner(capture_bs=(GRAPH_BS,))
        built.run_fa3_graph(runner)
        g = runner.backend.forward_metadata
        out.update({
            "replay cache_seqlens": _fmt(g.cache_seqlens_int32),
            "replay cu_seqlens_q": _fmt(g.cu_seqlens_q[: GRAPH_BS + 1]),
            "replay max_seqlen_q": _fmt(g.max_seq_len_q),
            "replay page_table shape": _fmt(list(g.page_table.shape)),
        })
    return out


#: figure name -> (width px, height px, smallest font size in points, dpi) of the last save
SAVED: dict[str, tuple[int, int, float, int]] = {}


def _save(fig, name: str, out: Path | None = None) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    out = IMG if out is None else out
    out.mkdir(exist_ok=True)
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    fig.savefig(out / f"{name}.png", dpi=DPI, bbox_inches="tight")
    _quantize(out / f"{name}.png")
    w, h = png_size(out / f"{name}.png")
    SAVED[name] = (w, h, min(sizes), DPI)
    plt.close(fig)


def _quantize(path: Path, colors: int = 96) -> None:
    """Rewrite the PNG with a palette of ``colors`` entries (a third of the bytes, same look)."""
    from PIL import Image

    with Image.open(path) as im:
        pal = im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    pal.save(path, optimize=True)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    head = path.read_bytes()[16:24]
    return int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")


def kept_rows(name: str, cu: list[int]) -> list[int] | None:
    """The draft-extend rows whose output is used: v2 row ``b * N + a_b - 1`` (SD-005), v1 the
    last of each request's packed ``a_b`` rows; None for the other modes."""
    if name == "draft-extend-v2":
        return [b * N + a - 1 for b, a in enumerate(A)]
    if name == "draft-extend-v1":
        return [c - 1 for c in cu[1:]]
    return None


def mode_figures(out: Path | None = None) -> None:
    for name in EXAMPLES:
        built = build(name)
        built.run_fa3()
        md = built.extra["metadata"]
        cu = md.cu_seqlens_q.tolist()
        fig = viz.mode_figure(md.cu_seqlens_q, md.cache_seqlens_int32, md.page_table, P, TITLES[name],
                              kept_rows=kept_rows(name, cu), width_in=WIDTH_IN)
        _save(fig, name, out)


def _replay_cu_q(name: str, variant: str | None):
    built = build(name)
    runner = built.graph_runner(capture_bs=(GRAPH_BS,), validate=False)
    if variant:
        with variants.enabled(variant):
            built.run_fa3_graph(runner)
    else:
        built.run_fa3_graph(runner)
    return runner.backend.forward_metadata.cu_seqlens_q[: GRAPH_BS + 1].tolist(), built


def draft_extend_replay_figure(out: Path | None = None) -> None:
    """Four strips: what the runner laid out (letters) vs what cu_seqlens_q says (colours)."""
    plt = viz._plt()
    cases = [("draft-extend-v1", None, "v1 correct: [0, cumsum(num_accept_tokens)]"),
             ("draft-extend-v1", "de-v1-uniform-cu-q", "v1 with v2's uniform rule (bug de-v1-uniform-cu-q)"),
             ("draft-extend-v2", None, "v2 correct: [0, W, 2W, ...] from extend_seq_lens"),
             ("draft-extend-v2", "de-v2-packed-cu-q", "v2 with v1's packed rule (bug de-v2-packed-cu-q)")]
    fig, axes = plt.subplots(len(cases), 1, figsize=(WIDTH_IN, 6.4), dpi=DPI)
    W = N
    for ax, (name, variant, label) in zip(axes, cases):
        cu, built = _replay_cu_q(name, variant)
        q_live = built.q_lens
        owner = [b for b, q in enumerate(q_live) for _ in range(q)]
        owner += [-1] * (GRAPH_BS * W - len(owner))
        viz.draw_query_rows(ax, cu, GRAPH_BS * W, label, owner=owner, num_real=len(q_live))
    fig.suptitle("draft-extend replay at Bg = 4 (3 real requests, a = [2, 4, 1], W = 4)\n"
                 "colour = request per cu_seqlens_q; text = the token actually in the row",
                 fontsize=viz.TITLE_FONT, x=0.01, ha="left")
    fig.tight_layout()
    _save(fig, "draft-extend-replay", out)


def causal_figure(out: Path | None = None) -> None:
    plt = viz._plt()
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH_IN, 2.6), dpi=DPI, width_ratios=[2.6, 1])
    viz.draw_visibility(axes[0], 9, 4, 4, [2, 11, 10], "q = 4, K = 9: row i sees p <= i + 5")
    viz.draw_visibility(axes[1], 2, 4, 4, [7], "K = 2 < q = 4:\nrows 0, 1 empty -> 0")
    fig.tight_layout()
    viz.add_legend(fig)
    _save(fig, "causal", out)


def paged_kv_figure(out: Path | None = None) -> None:
    plt = viz._plt()
    built = build("target-verify")
    fb, kv = built.fb, built.kv
    rows = fb.req_pool_indices.tolist()
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH_IN, 5.6), dpi=DPI, height_ratios=[2.3, 1])
    viz.draw_pool(axes[0], kv.req_to_token, rows, built.K, built.pool.num_pages, P, "KV pool: pages x slots")
    vals = [kv.req_to_token[r, :k].tolist() for r, k in zip(rows, built.K)]
    colors = [[viz.req_color(b)] * len(v) for b, v in enumerate(vals)]
    colors = [[c + "66" for c in row] for row in colors]
    viz.draw_int_table(axes[1], vals, [f"r{b} (row {r})" for b, r in enumerate(rows)],
                       "req_to_token[row, position] = slot (K = L + N = [9, 12, 16])", colors)
    fig.tight_layout()
    _save(fig, "paged-kv", out)


def render_all(out: Path | None = None) -> dict[str, tuple[int, int, float, int]]:
    """Draw every figure into ``out`` (default ``docs/img``); returns :data:`SAVED`."""
    import matplotlib

    matplotlib.use("Agg")  # headless; imported here so that example_metadata needs no matplotlib
    torch.manual_seed(0)
    mode_figures(out)
    draft_extend_replay_figure(out)
    causal_figure(out)
    paged_kv_figure(out)
    return dict(SAVED)


def main() -> None:
    for name, (w, h, pt, dpi) in render_all().items():
        print(f"{name}: {w} x {h} px, smallest text {pt:g} pt = {pt * dpi / 72:.1f} px", file=sys.stderr)
    for name in EXAMPLES:
        print(f"## {name}")
        for k, v in example_metadata(name).items():
            print(f"  {k:28s} {v}")
    for p in sorted(IMG.glob("*.png")):
        print(f"{p.name}: {p.stat().st_size / 1024:.1f} KB", file=sys.stderr)


if __name__ == "__main__":
    main()
