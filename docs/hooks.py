"""MkDocs hooks for the refspec docs (all offline, all from the repository).

* **Generated parts.** Every ``<!-- refspec:KIND ARG -->`` ... ``<!-- /refspec:KIND -->`` region
  (the ID index, the bug-zoo table, each "Tests" list, the T1 floors, the tutorial list) is
  re-rendered from the code by :mod:`docs.generated` (``docs/generated.py``), so the site is always
  current; the committed text is what GitHub shows, and ``tests/test_docs.py`` fails when it is
  stale (``python docs/generated.py --write`` refreshes it).
* **Anchors.** A spec heading is committed as ``<a id="cg-004"></a>`` + blank line + ``### CG-004 ...``
  (GitHub renders that cleanly); the build turns it into ``### CG-004 ... {#cg-004}``, so the site's
  heading ids and permalinks are the anchor ids (``spec/graphs/#cg-004``).
* **Links in prose.** Outside fenced code, headings, existing links and HTML tags: every invariant
  ID (``CG-004``, plain or as inline code) becomes a link to its spec entry; ``#NNNN`` becomes a
  link to that pull request / issue of the project named before it in the same clause (SGLang
  when none is named; no link for a project whose repository is not known); a commit hash
  (``188f0955f``, or ``file.py@188f0955f`` in inline code) becomes a link to the commit.
* **Tutorials.** Every ``tutorials/NN_name.ipynb`` (stored without outputs) becomes the page
  ``tutorials/NN_name/`` rendered by the ``mkdocs-jupyter`` plugin, appended to the "Tutorials"
  nav section. The plugin executes the notebooks (outputs and figures on the page) when the
  environment variable ``REFSPEC_DOCS_EXECUTE=true`` (``make docs``); otherwise it renders them
  without outputs (the strict build in ``make test``). IDs in the rendered notebook text are
  linked too (:func:`linkify_html`, on the HTML: those pages skip ``on_page_markdown``).

An unknown marker or an ID that does not exist is a warning, so ``mkdocs build --strict`` fails.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "docs") not in sys.path:
    sys.path.insert(0, str(ROOT / "docs"))

import generated  # noqa: E402  (docs/generated.py)
import spec_index  # noqa: E402  (docs/spec_index.py)

from refspec.core.invariants import INVARIANTS  # noqa: E402

log = logging.getLogger("mkdocs.hooks.refspec")
_index: spec_index.Index | None = None

# ---------------------------------------------------------------- upstream repositories
SGLANG = "https://github.com/sgl-project/sglang"
#: a project named in the text -> its GitHub repository (None: not known, the number stays text).
#: Longest names first: "vllm-ascend" before "vllm".
PROJECTS = {
    "vllm-ascend": "https://github.com/vllm-project/vllm-ascend",
    "rocm-libraries": "https://github.com/ROCm/rocm-libraries",
    "transformers": "https://github.com/huggingface/transformers",
    "tokenspeed": None,
    "mlxcel": "https://github.com/lablup/mlxcel",
    "sglang": SGLANG,
    "vllm": "https://github.com/vllm-project/vllm",
}
PROJECT_RE = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, PROJECTS)) + r")(?![\w-])", re.I)
PR_RE = re.compile(r"(?<![\w/#&\[])#(\d{3,6})\b")
HASH = r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{9,40}"
HASH_RE = re.compile(r"(?<![\w/@.-])" + HASH + r"(?![\w-])")
#: in inline code a 9-digit hash may be all digits (`631950280`); in prose that is a number
CODE_HASH = HASH + r"|\d{9}"
CODE_HASH_RE = re.compile(r"^(?:(?P<path>[\w./-]+\.\w+)(?::[\w.]+)?)?@(?P<hash>" + CODE_HASH + r")$"
                          r"|^(?P<bare>" + CODE_HASH + r")$")
#: clause boundaries: the project context goes back to SGLang after one
CLAUSE_RE = re.compile(r"[.;|](?=\s|$)")


def _id_re() -> re.Pattern:
    families = sorted({i.split("-")[0] for i in INVARIANTS}, key=len, reverse=True)
    return re.compile(r"(?<![\w-])((?:" + "|".join(families) + r")-\d{3})(?![\w-])")


# inline code, links / images (with their URL), reference links, raw HTML tags, autolinks
PROTECTED_RE = re.compile(r"(?P<code>(`+)(?P<code_text>.+?)\2)|!?\[[^\]\n]*\]\([^)\n]*\)|\[[^\]\n]*\]\[[^\]\n]*\]"
                          r"|</?[A-Za-z][^>\n]*>")


def _repo_for(context: str | None) -> str | None:
    return SGLANG if context is None else PROJECTS[context.lower()]


def link_text(s: str, context: list, id_target, fmt) -> str:
    """Plain text ``s`` with IDs, ``#NNNN`` and commit hashes linked: ``fmt(label, url)`` writes
    a link, ``id_target(ID)`` gives an ID's URL. ``context`` is a one-element list holding the
    project named last in the current clause (carried across a paragraph's lines)."""
    id_re = _id_re()
    out, pos = [], 0
    tokens = sorted([(m.start(), m.end(), "id", m) for m in id_re.finditer(s) if m.group(1) in INVARIANTS]
                    + [(m.start(), m.end(), "pr", m) for m in PR_RE.finditer(s)]
                    + [(m.start(), m.end(), "hash", m) for m in HASH_RE.finditer(s)]
                    + [(m.start(), m.end(), "project", m) for m in PROJECT_RE.finditer(s)]
                    + [(m.start(), m.end(), "clause", m) for m in CLAUSE_RE.finditer(s)],
                    key=lambda t: t[0])
    for start, end, kind, m in tokens:
        if start < pos:
            continue
        out.append(s[pos:start])
        piece = m.group(0)
        if kind == "id":
            piece = fmt(piece, id_target(m.group(1)))
        elif kind == "pr" and (repo := _repo_for(context[0])):
            piece = fmt(piece, f"{repo}/{'pull' if repo == SGLANG else 'issues'}/{m.group(1)}")
        elif kind == "hash" and (repo := _repo_for(context[0])):
            piece = fmt(piece, f"{repo}/commit/{piece}")
        elif kind == "project":
            context[0] = m.group(1)
        elif kind == "clause":
            context[0] = None
        out.append(piece)
        pos = end
    out.append(s[pos:])
    return "".join(out)


def _md_id_target(src_uri: str):
    here = posixpath.dirname(src_uri) or "."
    return lambda i: f"{posixpath.relpath('spec/' + spec_index.family_page(i), here)}#{i.lower()}"


def linkify_line(line: str, src_uri: str, id_re: re.Pattern, context: list) -> str:
    """One prose line of Markdown with IDs, ``#NNNN`` and commit hashes linked (see :func:`link_text`)."""
    target = _md_id_target(src_uri)

    def text_part(s: str) -> str:
        return link_text(s, context, target, lambda label, url: f"[{label}]({url})")

    out, pos = [], 0
    for m in PROTECTED_RE.finditer(line):
        out.append(text_part(line[pos:m.start()]))
        piece = m.group(0)
        if m.group("code"):
            code = m.group("code_text").strip()
            if code in INVARIANTS:
                piece = generated.id_link(code, src_uri).replace(f"[{code}]", f"[{piece}]", 1)
            elif (h := CODE_HASH_RE.match(code)) and (repo := _repo_for(context[0])):
                piece = f"[{piece}]({repo}/commit/{h.group('hash') or h.group('bare')})"
        out.append(piece)
        pos = m.end()
    out.append(text_part(line[pos:]))
    return "".join(out)


def linkify(markdown: str, src_uri: str) -> str:
    """``markdown`` with IDs and upstream references in prose turned into links (see the module doc)."""
    id_re = _id_re()
    out, fence, context = [], None, [None]
    for line in markdown.split("\n"):
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = None
            out.append(line)
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            out.append(line)
            continue
        if not stripped:
            context[0] = None  # a new paragraph
        if re.match(r"#{1,6}\s", stripped) or stripped.startswith("<!--") or not stripped:
            out.append(line)
            continue
        out.append(linkify_line(line, src_uri, id_re, context))
    return "\n".join(out)


ANCHOR_RE = re.compile(r'^<a id="([\w-]+)"></a>[ \t]*\n(?:[ \t]*\n)?(#{1,6} [^\n]*?)[ \t]*$', re.M)


def anchors_to_attr_list(markdown: str) -> str:
    """``<a id="x"></a>`` + (blank line) + heading -> ``heading {#x}`` (the site's heading id is x)."""
    return ANCHOR_RE.sub(lambda m: f"{m.group(2)} {{#{m.group(1)}}}", markdown)


# ---------------------------------------------------------------- tutorials as pages
def tutorial_notebooks() -> list[Path]:
    """``tutorials/NN_*.ipynb`` in order (one per percent source)."""
    return [p.with_suffix(".ipynb") for p in generated.tutorial_sources()]


def on_config(config, **kw):
    nav = config["nav"]
    for i, item in enumerate(nav):
        if isinstance(item, dict) and "Tutorials" in item and isinstance(item["Tutorials"], str):
            pages = [item["Tutorials"]]
            for p in generated.tutorial_sources():
                pages.append({generated.tutorial_title(p): f"tutorials/{p.stem}.ipynb"})
            nav[i] = {"Tutorials": pages}
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the .ipynb files as pages
def on_files(files, config, **kw):
    for nb in tutorial_notebooks():
        if not nb.is_file():
            log.warning(f"{nb.relative_to(ROOT)} is missing (run `jupytext --to ipynb` on its .py)")
            continue
        files.append(File(f"tutorials/{nb.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


# ---------------------------------------------------------------- generated parts, anchors, links
def on_pre_build(config, **kw):
    global _index
    _index = spec_index.build_index()
    for p in _index.problems:
        log.warning(f"spec index: {p}")
    for inv_id, nodes in _index.unknown().items():
        log.warning(f"tests cite unknown invariant {inv_id}: {nodes}")
    if _index.uncovered():
        log.info(f"invariants no test cites yet: {', '.join(_index.uncovered())}")


_SKIP_TAGS = {"a", "code", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "style", "script", "textarea"}
_TAG_RE = re.compile(r"<(/?)([A-Za-z][\w-]*)[^>]*?(/?)>|<!--.*?-->", re.S)


def linkify_html(html: str, page_url: str) -> str:
    """IDs and upstream references in the text of rendered HTML (the notebook pages, which skip
    ``on_page_markdown``) become links; text inside links, code, headings, styles is left alone."""
    depth = 0  # nesting inside skipped tags
    here = posixpath.dirname(page_url.rstrip("/") + "/x")  # the page's directory URL

    def target(i):
        family = spec_index.family_page(i).removesuffix(".md")
        return f"{posixpath.relpath('spec/' + family, here or '.')}/#{i.lower()}"

    def text(s):
        if depth or not s.strip():
            return s
        return link_text(s, [None], target, lambda label, url: f'<a href="{url}">{label}</a>')

    out, pos = [], 0
    for m in _TAG_RE.finditer(html):
        out.append(text(html[pos:m.start()]))
        out.append(m.group(0))
        if m.group(2) and m.group(2).lower() in _SKIP_TAGS and not m.group(3):
            depth = max(0, depth - 1) if m.group(1) else depth + 1
        pos = m.end()
    out.append(text(html[pos:]))
    return "".join(out)


def on_page_content(html, page, config, files, **kw):
    if page.file.src_uri.endswith(".ipynb"):
        return linkify_html(html, page.url)
    return html


def on_page_markdown(markdown, page, config, files, **kw):
    src = page.file.src_uri
    if src.endswith(".ipynb"):  # rendered by mkdocs-jupyter from the file; edit its jupytext source
        if config.get("repo_url"):
            page.edit_url = f"{config['repo_url'].rstrip('/')}/edit/main/tutorials/{Path(src).stem}.py"
        return markdown
    try:
        markdown = generated.sync_text(markdown, generated.Context(src, _index, "site"))
    except ValueError as e:
        log.warning(str(e))
    markdown = anchors_to_attr_list(markdown)
    return linkify(markdown, src)

