"""The docs site: it builds offline with ``mkdocs build --strict``, quotes the code's numbers, reads
well on GitHub too, and stays small.

* the strict build (a subprocess, ``sys.executable -m mkdocs``, notebooks not executed) must
  succeed with no warning, render every tutorial, link IDs and upstream references, and reference
  no external font;
* the generated parts committed in the pages (``docs/generated.py``: ID index, bug zoo, Tests
  lists) are current, and spec headings carry GitHub-safe anchors (no literal ``{#cg-004}``);
* each forward-mode page quotes, for its running example, exactly the metadata that refspec
  computes (``docs/gen_figures.example_metadata``): a changed rule or a stale page fails here;
* images are small (< 60 KB each, < 400 KB in all), all referenced, none missing, and readable:
  at most the text column wide, smallest text >= 11 px (``docs/gen_figures.render_all``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="docs build: install the `docs` extra (mkdocs-material)")
    pytest.importorskip("material", reason="docs build: install the `docs` extra (mkdocs-material)")
    pytest.importorskip("mkdocs_jupyter", reason="docs build: install the `docs` extra (mkdocs-jupyter)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env.pop("REFSPEC_DOCS_EXECUTE", None)  # the notebooks run in tests/test_notebooks.py, not here
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert not warnings, "\n".join(warnings)
    return out


def test_strict_build_has_every_page(site):
    for page in ["index.html", "spec/index.html", "spec/graphs/index.html", "modes/draft-extend-v2/index.html",
                 "fa3-contract/index.html", "glossary/index.html", "bug-zoo/index.html", "citing/index.html",
                 "tolerance-policy/index.html", "tutorials/index.html"]:
        assert (site / page).is_file(), page
    css = (site / "stylesheets/extra.css").read_text()  # field names in tables never break mid-word
    assert "white-space: nowrap" in css and "stylesheets/extra.css" in (site / "modes/decode/index.html").read_text()


def test_generated_parts_are_filled(site):
    from refspec.core.invariants import INVARIANTS
    from refspec.mutants import variants

    index = (site / "spec/index.html").read_text()
    missing = [i for i in INVARIANTS if f'href="{_family(i)}/#{i.lower()}"' not in index]
    assert not missing, f"the ID index does not link {missing}"
    zoo = (site / "bug-zoo/index.html").read_text()
    assert all(f"<code>{name}</code>" in zoo for name in variants.VARIANTS)
    graphs = (site / "spec/graphs/index.html").read_text()
    assert "tests/test_graphs.py::" in graphs  # a Tests list rendered on its entry


def _family(inv_id: str) -> str:
    import spec_index  # docs/spec_index.py (pytest's pythonpath)

    return spec_index.family_page(inv_id).removesuffix(".md")


def test_committed_generated_parts_are_current():
    """The ID index, bug zoo, Tests lists, T1 floors and tutorial list committed in docs/**/*.md
    equal what the code gives now (GitHub shows the committed text)."""
    gen = _load("generated")
    stale = gen.stale(write=False)
    assert not stale, f"generated parts are stale in {stale}: run `{gen.COMMAND}`"


def test_every_marker_is_closed():
    gen = _load("generated")
    for p in gen.pages():
        text = p.read_text()
        for m in gen.OPEN.finditer(text):
            assert f"<!-- /refspec:{m.group(1)} -->" in text[m.end():], f"{p.name}: {m.group(0)} is not closed"


def test_spec_headings_have_github_safe_anchors(site):
    from refspec.core.invariants import INVARIANTS
    import spec_index  # docs/spec_index.py (pytest's pythonpath)

    literal = [f"{p.relative_to(ROOT)}:{n}" for p in DOCS.rglob("*.md")
               for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\{#[\w-]+\}", line)]
    assert not literal, f"GitHub shows {{#...}} literally: {literal}"
    for inv_id in INVARIANTS:
        page = spec_index.SPEC_DIR / spec_index.family_page(inv_id)
        lines = page.read_text().splitlines()
        n = next(i for i, line in enumerate(lines) if spec_index.HEADING_RE.match(line)
                 and spec_index.HEADING_RE.match(line).group(1) == inv_id)
        above = [line for line in lines[max(0, n - 2):n] if line.strip()]
        assert above == [f'<a id="{inv_id.lower()}"></a>'], f"{page.name}: no anchor line above {inv_id}"
        html = (site / "spec" / _family(inv_id) / "index.html").read_text()
        assert re.search(rf'<h\d id="{inv_id.lower()}"', html), f"the site's heading id of {inv_id} changed"


def test_prose_ids_and_upstream_refs_are_links(site):
    v2 = (site / "modes/draft-extend-v2/index.html").read_text()
    assert '<a href="../../spec/spec-decode/#sd-005">SD-005</a>' in v2
    assert '<a href="https://github.com/sgl-project/sglang/pull/26512">#26512</a>' in v2
    pa = (site / "spec/paging-attention/index.html").read_text()
    assert '<a href="https://github.com/sgl-project/sglang/commit/188f0955f"><code>188f0955f</code></a>' in pa
    tut = (site / "tutorials/01_paged_kv_cache/index.html").read_text()
    assert '<a href="../../spec/paging-attention/#pa-008">PA-008</a>' in tut  # notebook pages too
    for page in (site / "tutorials").glob("*/index.html"):  # every injected link has its target
        for family, anchor in re.findall(r'href="\.\./\.\./spec/([\w-]+)/#([\w-]+)"', page.read_text()):
            assert f'id="{anchor}"' in (site / "spec" / family / "index.html").read_text(), (page, anchor)
    home = (site / "index.html").read_text()
    assert 'href="https://github.com/refspec/refspec"' in home
    assert "refspec.github.io" not in home and 'rel="canonical"' not in home  # no site_url: none is published
    assert 'href="https://github.com/refspec/refspec/edit/main/docs/spec/graphs.md"' in \
        (site / "spec/graphs/index.html").read_text()  # edit_uri
    assert 'href="https://github.com/refspec/refspec/edit/main/tutorials/08_review_a_patch.py"' in \
        (site / "tutorials/08_review_a_patch/index.html").read_text()  # a notebook edits its source


def test_linkify_rules():
    pytest.importorskip("mkdocs", reason="the hooks import mkdocs: install the `docs` extra")
    hooks = _load("hooks")
    md = "\n".join([
        "### CG-004 heading stays",
        "CG-004 and `MD-008`, see [CG-001](graphs.md#cg-001). SGLang #26512 (`e5f5d8478`), reverted by #26628;",
        "vLLM #16087, #7999. Plain 188f0955f; tokenspeed #913 stays text. v1 replay `631950280`, 123456789 tokens.",
        "```",
        "CG-004 #5090 in code",
        "```",
        "`python/sglang/srt/layers/attention/flashattention_backend.py@188f0955f` XX-001 CG-999",
    ])
    out = hooks.linkify(md, "modes/decode.md").splitlines()
    assert out[0] == "### CG-004 heading stays"
    assert out[1].startswith("[CG-004](../spec/graphs.md#cg-004) and [`MD-008`](../spec/metadata.md#md-008), "
                             "see [CG-001](graphs.md#cg-001).")
    assert "[#26512](https://github.com/sgl-project/sglang/pull/26512)" in out[1]
    assert "[`e5f5d8478`](https://github.com/sgl-project/sglang/commit/e5f5d8478)" in out[1]
    assert "[#26628](https://github.com/sgl-project/sglang/pull/26628)" in out[1]
    assert out[2].startswith("vLLM [#16087](https://github.com/vllm-project/vllm/issues/16087), "
                             "[#7999](https://github.com/vllm-project/vllm/issues/7999).")
    assert "[188f0955f](https://github.com/sgl-project/sglang/commit/188f0955f)" in out[2]
    assert "tokenspeed #913 stays text." in out[2]
    assert "[`631950280`](https://github.com/sgl-project/sglang/commit/631950280), 123456789 tokens." in out[2]
    assert out[3:6] == ["```", "CG-004 #5090 in code", "```"]
    assert out[6].startswith("[`python/sglang/srt/layers/attention/flashattention_backend.py@188f0955f`]"
                             "(https://github.com/sgl-project/sglang/commit/188f0955f)")
    assert out[6].endswith(" XX-001 CG-999")  # not IDs of the catalogue
    assert hooks.anchors_to_attr_list('<a id="cg-004"></a>\n\n### CG-004 — t\n') == "### CG-004 — t {#cg-004}\n"


def test_no_external_fonts_or_scripts(site):
    for p in site.rglob("*.html"):
        t = p.read_text()
        assert "fonts.googleapis.com" not in t and "fonts.gstatic.com" not in t, p
        assert not re.search(r'<script[^>]+src="https?://', t), p


def test_tutorial_pages_follow_the_sources(site):
    """Every notebook is a page rendered by mkdocs-jupyter (cells, not a code listing), linked
    from the tutorial index, with the .ipynb offered for download."""
    sources = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
    listing = (site / "tutorials/index.html").read_text()
    for src in sources:
        page = site / "tutorials" / src.stem / "index.html"
        assert page.is_file(), f"no docs page for {src.name}"
        assert "jp-Cell" in page.read_text(), f"{src.stem}: not rendered as a notebook"
        assert (site / "tutorials" / src.stem / f"{src.stem}.ipynb").is_file()
        assert f'href="{src.stem}/"' in listing, f"the tutorial index does not link {src.stem}"


# ---------------------------------------------------------------- mode pages quote the code
MODE_PAGES = ["decode", "draft-decode", "target-verify", "draft-extend-v1", "draft-extend-v2", "extend"]


def _label(key: str) -> str:
    """``"cache_seqlens"`` -> ``| `cache_seqlens` |``; ``"replay cu_seqlens_q"`` -> ``| replay `cu_seqlens_q` |``;
    ``"replay page_table shape"`` -> ``| replay `page_table` shape |``."""
    words = key.split()
    if words[0] == "replay":
        return "| replay `" + words[1] + "`" + "".join(" " + w for w in words[2:]) + " |"
    return f"| `{key}` |"


@pytest.mark.parametrize("page", MODE_PAGES)
def test_mode_page_quotes_the_metadata(page):
    gen = _load("gen_figures")
    text = (DOCS / "modes" / f"{page}.md").read_text()
    assert "## Running example" in text
    text = text.split("## Running example", 1)[1]  # the rule table above it uses the same labels
    expected = gen.example_metadata(page)
    wrong = []
    for key, value in expected.items():
        rows = [line for line in text.splitlines() if line.startswith(_label(key))]
        if len(rows) != 1 or f"`{value}`" not in rows[0]:
            wrong.append(f"{key}: the code gives `{value}`, the page has {rows}")
    assert not wrong, f"docs/modes/{page}.md disagrees with refspec:\n" + "\n".join(wrong)


# ---------------------------------------------------------------- images and markdown hygiene
def test_figures_readable(tmp_path):
    """Each figure, redrawn now: at most the text column wide (so the browser does not shrink it)
    and smallest text >= 11 px (font size x dpi / 72); the committed PNG has the same size."""
    pytest.importorskip("matplotlib", reason="figures: install the `notebooks` extra (matplotlib)")
    gen = _load("gen_figures")
    saved = gen.render_all(tmp_path)
    assert set(saved) == {p.stem for p in (DOCS / "img").glob("*.png")}
    for name, (w, h, pt, dpi) in saved.items():
        assert w <= gen.MAX_WIDTH_PX, f"{name}: {w} px wide, the text column is {gen.MAX_WIDTH_PX} px"
        assert pt * dpi / 72 >= gen.MIN_TEXT_PX, f"{name}: smallest text {pt} pt at {dpi} dpi"
        assert 200 <= h <= 900, f"{name}: {h} px high"
        committed = gen.png_size(DOCS / "img" / f"{name}.png")
        assert committed == (w, h), (f"docs/img/{name}.png is {committed}, redrawn {(w, h)}: "
                                     "run `python docs/gen_figures.py`")


def test_images_small_and_all_used():
    imgs = sorted((DOCS / "img").glob("*.png"))
    assert imgs
    sizes = {p.name: p.stat().st_size for p in imgs}
    big = {n: s for n, s in sizes.items() if s >= 60 * 1024}
    assert not big, f"images >= 60 KB: {big}"
    assert sum(sizes.values()) < 400 * 1024, f"images total {sum(sizes.values()) / 1024:.0f} KB"
    text = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    used = set(re.findall(r"img/([\w.-]+\.png)", text))
    assert used <= set(sizes), f"missing images: {used - set(sizes)}"
    assert set(sizes) <= used, f"unused images: {set(sizes) - used}"


def test_no_accidental_headings():
    """Python-Markdown makes ``#123 ...`` at the start of a line a heading: keep PR numbers inline."""
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in DOCS.rglob("*.md")
           for n, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"#+[^#\s]", line)]
    assert not bad, bad
