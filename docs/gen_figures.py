"""Regenerate the pictures of the docs (``docs/img/*.png``) and print the worked examples' numbers.

    .venv/bin/python docs/gen_figures.py          # writes docs/img/*.png, prints the tables

Every number and picture comes from refspec itself on the docs' running example (P = 4,
Sd = 3, N = 4, three requests with committed lengths L = [5, 8, 12], v1 accepts a = [2, 4, 1];
pages handed out by a shuffled allocator, seed 0).  ``tests/test_docs.py`` recomputes the
numbers with :func:`example_metadata` and checks that the mode pages quote them, and keeps the
images small (< 60 KB each).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from refspec import bugs

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
    "decode": "DECODE: one new token per request (seq_lens = L including it)",
    "draft-decode": "draft decode, step s = 1: K = L + s + 1",
    "target-verify": "TARGET_VERIFY: N = 4 chained tokens per request, K = L + N",
    "draft-extend-v1": "DRAFT_EXTEND (v1): a = [2, 4, 1] accepted tokens, packed; K = L + a",
    "draft-extend-v2": "DRAFT_EXTEND_V2: all N = 4 rows per request; K = seq_lens = L + N",
    "extend": "EXTEND (prefill): prefixes [0, 8, 3], extend lengths [5, 4, 2]",
}
GRAPH_BS = 4


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
        "req_to_token": _fmt([built.kv.req_to_token[r, :k].tolist() for r, k in zip(fb.req_pool_indices.tolist(), built.K)]),
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


def _save(fig, name: str) -> None:
    IMG.mkdir(exist_ok=True)
    fig.savefig(IMG / f"{name}.png", dpi=80, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)


def mode_figures() -> None:
    for name in EXAMPLES:
        built = build(name)
        built.run_fa3()
        md = built.extra["metadata"]
        _save(viz.mode_figure(md.cu_seqlens_q, md.cache_seqlens_int32, md.page_table, P, TITLES[name]), name)


def _replay_cu_q(name: str, variant: str | None):
    built = build(name)
    runner = built.graph_runner(capture_bs=(GRAPH_BS,), validate=False)
    if variant:
        with bugs.enabled(variant):
            built.run_fa3_graph(runner)
    else:
        built.run_fa3_graph(runner)
    return runner.backend.forward_metadata.cu_seqlens_q[: GRAPH_BS + 1].tolist(), built


def draft_extend_replay_figure() -> None:
    """Four strips: what the runner laid out (letters) vs what cu_seqlens_q says (colours)."""
    plt = viz._plt()
    cases = [("draft-extend-v1", None, "v1 correct: [0, cumsum(num_accept_tokens)]"),
             ("draft-extend-v1", "de-v1-uniform-cu-q", "v1 with v2's uniform rule (bug de-v1-uniform-cu-q)"),
             ("draft-extend-v2", None, "v2 correct: [0, W, 2W, ...] from extend_seq_lens"),
             ("draft-extend-v2", "de-v2-packed-cu-q", "v2 with v1's packed rule (bug de-v2-packed-cu-q)")]
    fig, axes = plt.subplots(len(cases), 1, figsize=(8, 4.4), dpi=80)
    W = N
    for ax, (name, variant, label) in zip(axes, cases):
        cu, built = _replay_cu_q(name, variant)
        q_live = built.q_lens
        owner = [b for b, q in enumerate(q_live) for _ in range(q)]
        owner += [-1] * (GRAPH_BS * W - len(owner))
        viz.draw_query_rows(ax, cu, GRAPH_BS * W, label, owner=owner, num_real=len(q_live))
    fig.suptitle("draft-extend replay at Bg = 4 (3 real requests, a = [2, 4, 1], W = 4): "
                 "colour = request per cu_seqlens_q, text = token actually there", fontsize=8, x=0.01, ha="left")
    fig.tight_layout()
    _save(fig, "draft-extend-replay")


def causal_figure() -> None:
    plt = viz._plt()
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.0), dpi=80, width_ratios=[3, 1])
    viz.draw_visibility(axes[0], 9, 4, 4, [2, 11, 10], "q = 4 rows, K = 9 keys: row i sees p <= i + 5")
    viz.draw_visibility(axes[1], 2, 4, 4, [7], "K = 2 < q = 4: rows 0, 1 empty -> 0")
    fig.tight_layout()
    viz.add_legend(fig)
    _save(fig, "causal")


def paged_kv_figure() -> None:
    plt = viz._plt()
    built = build("target-verify")
    fb, kv = built.fb, built.kv
    rows = fb.req_pool_indices.tolist()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), dpi=80, width_ratios=[1, 2.2])
    viz.draw_pool(axes[0], kv.req_to_token, rows, built.K, built.pool.num_pages, P, "KV pool: pages x slots")
    vals = [kv.req_to_token[r, :k].tolist() for r, k in zip(rows, built.K)]
    colors = [[viz.req_color(b)] * len(v) for b, v in enumerate(vals)]
    colors = [[c + "66" for c in row] for row in colors]
    viz.draw_int_table(axes[1], vals, [f"r{b} (row {r})" for b, r in enumerate(rows)],
                       "req_to_token[row, position] = slot (K = L + N = [9, 12, 16])", colors)
    fig.tight_layout()
    _save(fig, "paged-kv")


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless; imported here so that example_metadata needs no matplotlib
    torch.manual_seed(0)
    mode_figures()
    draft_extend_replay_figure()
    causal_figure()
    paged_kv_figure()
    for name in EXAMPLES:
        print(f"## {name}")
        for k, v in example_metadata(name).items():
            print(f"  {k:28s} {v}")
    for p in sorted(IMG.glob("*.png")):
        print(f"{p.name}: {p.stat().st_size / 1024:.1f} KB", file=sys.stderr)


if __name__ == "__main__":
    main()
