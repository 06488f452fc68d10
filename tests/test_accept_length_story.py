"""One home for "the accept-length ``cu_seqlens_q`` rule" (issue 43, item 3): ``docs/accept-length.md``
tells v1's packing and v2's stride and kept row side by side, ``cite accept-length`` prints it,
``cite CG-003`` / ``cite CG-004`` point to it, and the README's phrase links there.

The page's numbers are checked twice: against the rules written out here (CG-003:
``[0, cumsum(a)]``, CG-004: ``[0, W, 2W, ...]``, SD-005: kept row ``b * N + a_b - 1``) and against
what refspec's graph replay writes for the page's running example.
"""

from __future__ import annotations

import re
from pathlib import Path

from refspec import cli
from refspec.cli import cite

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "accept-length.md"
L, A, N, BG = [5, 8, 12], [2, 4, 1], 4, 4  # the page's running example (W = N = Sd + 1)


def _cite(capsys, *argv):
    rc = cli.main(["cite", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cite_accept_length_prints_the_v1_v2_story(capsys):
    rc, out, err = _cite(capsys, "accept-length")
    assert rc == 0 and not err
    for needle in ("CG-003", "CG-004", "cumsum(a)", "b * N + a_b - 1", "packed", "uniform",
                   "sglang#21987", "sglang#25002", "sglang#19807", "Why the two loops differ"):
        assert needle in out, needle
    assert not any(line.startswith("![") for line in out.splitlines())
    # links are repo-relative (a clone opens them) and the source page is named
    assert "](docs/spec/graphs.md#cg-003)" in out and "](docs/glossary.md#speculative-decoding)" in out
    assert out.rstrip().endswith("(from docs/accept-length.md)")
    rc, out, _ = _cite(capsys, "ACCEPT-LENGTH", "--base-url", "https://example.org/refspec/blob/v1")
    assert rc == 0 and "](https://example.org/refspec/blob/v1/docs/spec/graphs.md#cg-004)" in out


def test_cg_003_and_cg_004_see_also_the_story_and_other_rules_do_not(capsys):
    for inv in ("CG-003", "CG-004"):
        md = cite.render(inv, [])
        line = next(x for x in md.splitlines() if x.startswith("- **See also:**"))
        assert "`python -m refspec cite accept-length`" in line and "(docs/accept-length.md)" in line
        assert "cumsum(a)" in line and "b * N + a_b - 1" in line
        text = cite.render(inv, [], fmt="text")
        assert "  See also: " in text and "python -m refspec cite accept-length, docs/accept-length.md" in text
    assert "See also" not in cite.render("CG-001", [])  # the negative control: no topic names CG-001
    rc, out, _ = _cite(capsys, "CG-004")  # and the command prints it
    assert rc == 0 and "- **See also:** the accept-length story" in out


def test_every_topic_page_exists_names_its_rules_and_is_in_the_docs_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for name, topic in cite.TOPICS.items():
        text = (ROOT / topic.page).read_text(encoding="utf-8")
        assert all(i in text for i in topic.ids), (name, topic.ids)
        assert topic.page.removeprefix("docs/") in nav, f"{topic.page} is not in mkdocs.yml's nav"


def _table(text: str) -> dict[str, tuple[str, str]]:
    """The page's v1 / v2 table: row label -> (v1 cell, v2 cell)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] and not cells[0].startswith("---"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def _last_list(cell: str) -> list[int]:
    return [int(x) for x in re.findall(r"\[([\d, ]+)\]", cell)[-1].split(",")]


def test_the_pages_numbers_follow_the_rules():
    rows = _table(PAGE.read_text(encoding="utf-8"))
    W = N
    v1_cu = [0] + [sum((A + [W] * (BG - len(A)))[:i + 1]) for i in range(BG)]  # CG-003, padded rows count W
    v2_cu = [W * i for i in range(BG + 1)]  # CG-004
    assert _last_list(rows["replayed `cu_seqlens_q`"][0]) == v1_cu == [0, 2, 6, 7, 11]
    assert _last_list(rows["replayed `cu_seqlens_q`"][1]) == v2_cu
    assert _last_list(rows["kept row of request `b`"][0]) == [v1_cu[b + 1] - 1 for b in range(len(A))]
    assert _last_list(rows["kept row of request `b`"][1]) == [b * N + a - 1 for b, a in enumerate(A)]
    assert _last_list(rows["keys `K_b`"][0]) == [x + a for x, a in zip(L, A)]
    assert _last_list(rows["keys `K_b`"][1]) == [x + N for x in L]


def test_the_pages_cu_seqlens_q_are_what_the_graph_replay_writes():
    from refspec.core.modes import ForwardMode as M
    from refspec.harness.scenario import Scenario

    rows = _table(PAGE.read_text(encoding="utf-8"))
    for col, mode in ((0, M.DRAFT_EXTEND), (1, M.DRAFT_EXTEND_V2)):
        built = Scenario(mode, page_size=4, lens=L, num_draft_tokens=N, num_accept_tokens=A, seed=0).build()
        runner = built.graph_runner(capture_bs=(BG,))
        built.run_fa3_graph(runner)
        got = runner.backend.forward_metadata.cu_seqlens_q[:BG + 1].tolist()
        assert got == _last_list(rows["replayed `cu_seqlens_q`"][col]), (mode, got)


def test_the_readme_phrase_links_the_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    uses = [m.start() for m in re.finditer(r"accept-length `cu_seqlens_q` rule", readme)]
    assert uses, "the README no longer names the accept-length cu_seqlens_q rule"
    for i in uses:
        assert readme[i:].startswith("accept-length `cu_seqlens_q` rule](docs/accept-length.md)"), readme[i - 40:i + 80]
