"""The generated parts of the docs, committed between markers so that the pages also read well on
a plain Markdown viewer (GitHub), and refreshed by the build hook (``docs/hooks.py``).

A generated part is an opening marker, the generated text, and a closing marker::

    <!-- refspec:tests CG-004 -->

    **Tests** (generated from `@pytest.mark.spec`): ...

    <!-- /refspec:tests -->

Kinds: ``tests ID`` (the test node ids citing ``ID`` via ``@pytest.mark.spec``, from the ast scan
of ``tests/`` in ``docs/spec_index.py``), ``id-index`` (the ID | rule | tests table),
``bug-zoo`` (the table of :data:`refspec.variants.VARIANTS`), ``t1-floors``
(:data:`refspec.core.tolerance.T1_FLOOR`, ``T2_DELTA``) and ``tutorial-list``.

The build always renders the current text, whatever is committed; ``tests/test_docs.py`` fails
when the committed text is stale and names the command that rewrites it::

    python docs/generated.py --write      # rewrite every stale part in docs/**/*.md
    python docs/generated.py              # list the stale files (exit 1 if any)

No mkdocs import here: the test and the command run without the ``docs`` extra.
"""

from __future__ import annotations

import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIALS = ROOT / "tutorials"
if str(ROOT) not in sys.path:  # `python docs/generated.py` from a checkout
    sys.path.insert(0, str(ROOT))
if str(DOCS) not in sys.path:  # spec_index.py, also when a test loads this file by path
    sys.path.insert(0, str(DOCS))

from refspec.core import tolerance  # noqa: E402
from refspec.core.invariants import INVARIANTS, RULES  # noqa: E402
from refspec.mutants import variants  # noqa: E402
from refspec.mutants.probes import PROBES  # noqa: E402
import spec_index  # noqa: E402  (docs/spec_index.py)

COMMAND = "python docs/generated.py --write"
OPEN = re.compile(r"<!--\s*refspec:([\w-]+)[ \t]*([^>]*?)\s*-->")
KINDS = ("tests", "id-index", "bug-zoo", "t1-floors", "tutorial-list")


@dataclass
class Context:
    """What one page's generated parts are made from.

    ``target`` is ``"github"`` (the committed text: links between repository files) or ``"site"``
    (the built page: the tutorial list links to the rendered notebook pages).
    """

    src_uri: str  #: the page, relative to docs/ (``spec/graphs.md``)
    index: spec_index.Index
    target: str = "github"


# ---------------------------------------------------------------- the parts
def tutorial_sources() -> list[Path]:
    """``tutorials/NN_*.py`` (jupytext percent sources of the notebooks) in order."""
    return sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))


def tutorial_title(path: Path) -> str:
    """The first ``# # Title`` markdown heading of a percent source, else its stem."""
    m = re.search(r"^# # (.+)$", path.read_text(), re.M)
    return m.group(1).strip() if m else path.stem


def id_link(inv_id: str, src_uri: str) -> str:
    """``[CG-004](graphs.md#cg-004)``, relative to the page ``src_uri`` (valid on GitHub and the site)."""
    here = posixpath.dirname(src_uri) or "."
    target = posixpath.relpath(f"spec/{spec_index.family_page(inv_id)}", here)
    return f"[{inv_id}]({target}#{inv_id.lower()})"


def _tests(ctx: Context, inv_id: str) -> str:
    nodes = ctx.index.tests.get(inv_id, [])
    if not nodes:
        return f'**Tests:** *none yet* (no test carries `@pytest.mark.spec("{inv_id}")`).'
    return ("**Tests** (generated from `@pytest.mark.spec`):\n\n"
            + "\n".join(f"- `{n}`" for n in nodes))


def _id_index(ctx: Context, arg: str) -> str:
    rows = ["| ID | rule | level | tests |", "|---|---|---|---|"]
    for inv_id, title in INVARIANTS.items():
        n = len(ctx.index.tests.get(inv_id, []))
        rows.append(f"| {id_link(inv_id, ctx.src_uri)} | {title.replace('|', '/')} | {RULES[inv_id].level} | "
                    f"{n if n else '**none yet**'} |")
    return "\n".join(rows)


_URL = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+)/(?:pull|issues)/(\d+)")
_DOC = re.compile(r"\bdocs/([\w/.-]+\.md)(#[\w-]+)?")


def _seam(v) -> str:
    """The production function a variant replaces, as markdown (and the one module it is limited to)."""
    where = f" (in `{v.within.removeprefix('refspec.')}` only)" if v.within else ""
    return f"`{v.seam.removeprefix('refspec.')}`{where}"


def _source_links(text: str, src_uri: str) -> str:
    """Upstream PR / issue URLs as ``owner/repo#N`` links, ``docs/...md`` as relative links."""
    here = posixpath.dirname(src_uri)
    text = _URL.sub(lambda m: f"[{m.group(1)}#{m.group(2)}]({m.group(0)})", text)
    return _DOC.sub(lambda m: f"[{m.group(1)}{m.group(2) or ''}]"
                    f"({posixpath.relpath(m.group(1), here or '.')}{m.group(2) or ''})", text)


def _probes(name: str) -> str:
    """The scenarios ``python -m refspec mutants`` runs the variant in (refspec.mutants.probes.PROBES)."""
    return "; ".join(p.label for p in PROBES.get(name, [])) or "no probe"


def _bug_zoo(ctx: Context, arg: str) -> str:
    # a narrow table first ("caught by" second: what a reviewer looks for, on screen at 1280 px),
    # then the long columns (symptom, where it was seen) as one paragraph per variant
    rows = ["| variant | caught by | what it changes |", "|---|---|---|"]
    for b in variants.VARIANTS.values():
        caught = ", ".join(id_link(i, ctx.src_uri) for i in b.caught_by)
        rows.append(f"| [`{b.name}`](#{b.name}) | {caught} | {b.changes} |")
    details = [f'<a id="{b.name}"></a>\n**`{b.name}`** replaces {_seam(b)} — {b.symptom}. '
               f'*Seen in:* {_source_links(b.source, ctx.src_uri)}. '
               f'*Probed by* (the path its seam must be called on): {_probes(b.name)}.'
               for b in variants.VARIANTS.values()]
    return "\n".join(rows) + "\n\n**Symptoms and sources**\n\n" + "\n\n".join(details)


def _t1_floors(ctx: Context, arg: str) -> str:
    rows = ["| dtype | T1 absolute floor |", "|---|---|"]
    rows += [f"| `{str(dt).replace('torch.', '')}` | `{f}` |" for dt, f in tolerance.T1_FLOOR.items()]
    return "\n".join(rows) + f"\n\nT2 margin δ (`T2_DELTA`): `{tolerance.T2_DELTA}` (logits)."


def _tutorial_list(ctx: Context, arg: str) -> str:
    here = posixpath.dirname(ctx.src_uri) or "."
    out = []
    for p in tutorial_sources():
        if ctx.target == "site":  # the rendered notebook page (docs/hooks.py adds it)
            link = posixpath.relpath(f"tutorials/{p.stem}.ipynb", here)
        else:  # the notebook file itself, which GitHub renders
            link = posixpath.relpath(f"../tutorials/{p.stem}.ipynb", here)
        out.append(f"- [{tutorial_title(p)}]({link}) — `tutorials/{p.stem}.ipynb`")
    return "\n".join(out)


def render(kind: str, arg: str, ctx: Context) -> str:
    """The generated text of one part (without the markers). ``ValueError`` on an unknown kind / ID."""
    if kind == "tests":
        if arg not in INVARIANTS:
            raise ValueError(f"{ctx.src_uri}: refspec:tests names unknown id {arg!r}")
        return _tests(ctx, arg)
    makers = {"id-index": _id_index, "bug-zoo": _bug_zoo, "t1-floors": _t1_floors,
              "tutorial-list": _tutorial_list}
    if kind not in makers:
        raise ValueError(f"{ctx.src_uri}: unknown marker refspec:{kind} (known: {', '.join(KINDS)})")
    return makers[kind](ctx, arg)


def sync_text(text: str, ctx: Context) -> str:
    """``text`` with every generated part replaced by its current text.

    An opening marker with no closing marker (``<!-- /refspec:KIND -->``) before the next opening
    marker gets its part and closing marker inserted. ``ValueError`` for unknown kinds / IDs.
    """
    out, pos = [], 0
    opens = list(OPEN.finditer(text))
    for i, m in enumerate(opens):
        kind, arg = m.group(1), m.group(2)
        limit = opens[i + 1].start() if i + 1 < len(opens) else len(text)
        close = re.compile(r"<!--\s*/refspec:" + re.escape(kind) + r"\s*-->").search(text, m.end(), limit)
        out.append(text[pos:m.end()])
        out.append("\n\n" + render(kind, arg, ctx) + "\n\n")
        out.append(close.group(0) if close else f"<!-- /refspec:{kind} -->")
        pos = close.end() if close else m.end()
    out.append(text[pos:])
    return "".join(out)


# ---------------------------------------------------------------- the committed text
def pages() -> list[Path]:
    """Every docs page that holds a generated part."""
    return [p for p in sorted(DOCS.rglob("*.md")) if OPEN.search(p.read_text())]


def stale(write: bool = False) -> list[str]:
    """The docs pages whose committed generated parts differ from the current ones (rewritten
    in place when ``write``)."""
    index = spec_index.build_index()
    out = []
    for p in pages():
        text = p.read_text()
        new = sync_text(text, Context(p.relative_to(DOCS).as_posix(), index, "github"))
        if new != text:
            out.append(p.relative_to(ROOT).as_posix())
            if write:
                p.write_text(new)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    write = "--write" in argv
    files = stale(write=write)
    for f in files:
        print(("rewrote " if write else "stale: ") + f)
    if files and not write:
        print(f"run `{COMMAND}` to refresh them")
    return 1 if files and not write else 0


if __name__ == "__main__":
    sys.exit(main())
