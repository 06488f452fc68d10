"""The docs site: it builds offline with ``mkdocs build --strict``, quotes the code's numbers, and
stays small.

* the strict build (a subprocess, ``sys.executable -m mkdocs``) must succeed with no warning,
  fill every generated placeholder, and reference no external font;
* each forward-mode page quotes, for its running example, exactly the metadata that refspec
  computes (``docs/gen_figures.example_metadata``): a changed rule or a stale page fails here;
* images are small (< 60 KB each, < 400 KB in all), all referenced, none missing.
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
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="docs build: install the `docs` extra (mkdocs-material)")
    pytest.importorskip("material", reason="docs build: install the `docs` extra (mkdocs-material)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
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


def test_generated_parts_are_filled(site):
    from refspec import bugs
    from refspec.core.invariants import INVARIANTS

    html = {p: p.read_text() for p in site.rglob("*.html")}
    leftover = [str(p.relative_to(site)) for p, t in html.items() if "<!-- refspec:" in t]
    assert not leftover, f"unreplaced placeholders in {leftover}"
    index = (site / "spec/index.html").read_text()
    assert all(i in index for i in INVARIANTS)
    zoo = (site / "bug-zoo/index.html").read_text()
    assert all(name in zoo for name in bugs.BUGS)


def test_no_external_fonts_or_scripts(site):
    for p in site.rglob("*.html"):
        t = p.read_text()
        assert "fonts.googleapis.com" not in t and "fonts.gstatic.com" not in t, p
        assert not re.search(r'<script[^>]+src="https?://', t), p


def test_tutorial_pages_follow_the_sources(site):
    sources = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
    for src in sources:
        page = site / "tutorials" / src.stem / "index.html"
        assert page.is_file(), f"no docs page for {src.name}"
    listing = (site / "tutorials/index.html").read_text()
    assert all(f"tutorials/{s.stem}.ipynb" in listing for s in sources)


def test_percent_to_markdown():
    pytest.importorskip("mkdocs", reason="the hooks import mkdocs: install the `docs` extra")
    hooks = _load("hooks")
    src = "# ---\n# jupyter: x\n# ---\n\n# %% [markdown]\n# # Title\n# text\n\n# %%\nx = 1\n\n# %%\nassert x\n"
    md = hooks.percent_to_markdown(src, "00_t")
    assert "# Title\ntext" in md
    assert "```python\nx = 1\n```" in md and "```python\nassert x\n```" in md
    assert "jupyter: x" not in md


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
