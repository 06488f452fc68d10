"""MkDocs hooks: the generated parts of the refspec docs (all offline, all from the repo).

* ``<!-- refspec:tests ID -->`` -> the test node ids that cite ``ID`` via
  ``@pytest.mark.spec`` (:mod:`refspec.harness.spec_index`, an ast scan of ``tests/``, no pytest run).
* ``<!-- refspec:id-index -->`` -> the ID | rule | tests table of every invariant.
* ``<!-- refspec:bug-zoo -->`` -> the table of :data:`refspec.bugs.BUGS`.
* ``<!-- refspec:t1-floors -->`` -> :data:`refspec.core.tolerance.T1_FLOOR` and ``T2_DELTA``.
* ``<!-- refspec:tutorial-list -->`` -> the list of tutorials.
* every ``tutorials/NN_name.py`` (jupytext percent format) becomes the page
  ``tutorials/NN_name.md`` and is appended to the "Tutorials" nav section, so new tutorials
  appear without editing ``mkdocs.yml``.

An unknown ``refspec:`` placeholder is a warning, so ``mkdocs build --strict`` fails on typos.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

from refspec import bugs

from refspec.harness import spec_index

from refspec.core import tolerance
from refspec.core.invariants import INVARIANTS

log = logging.getLogger("mkdocs.hooks.refspec")
ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
PLACEHOLDER = re.compile(r"<!--\s*refspec:([\w-]+)\s*([^>]*?)\s*-->")
_index: spec_index.Index | None = None


# ---------------------------------------------------------------- tutorials as pages
def tutorial_sources() -> list[Path]:
    """``tutorials/NN_*.py`` in order."""
    return sorted(p for p in TUTORIALS.glob("[0-9][0-9]_*.py"))


def percent_to_markdown(text: str, name: str) -> str:
    """A jupytext percent script as Markdown: markdown cells as is, code cells fenced."""
    lines = text.splitlines()
    if lines and lines[0].strip() == "# ---":  # jupytext header
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "# ---")
        lines = lines[end + 1:]
    cells, kind, buf = [], None, []
    for line in lines + ["# %%"]:
        if line.startswith("# %%"):
            if kind is not None and any(s.strip() for s in buf):
                cells.append((kind, buf))
            kind = "markdown" if "[markdown]" in line else "code"
            buf = []
        elif kind is not None:
            buf.append(line)
    out = [f'!!! note "Notebook `tutorials/{name}.ipynb`"\n    This page is the notebook\'s source '
           f"(`tutorials/{name}.py`, jupytext percent format) without outputs. Run the notebook to "
           "see the pictures: `jupyter lab tutorials/` or `make test` (which executes it).\n"]
    for kind, buf in cells:
        while buf and not buf[0].strip():
            buf = buf[1:]
        while buf and not buf[-1].strip():
            buf = buf[:-1]
        if kind == "markdown":
            out.append("\n".join(re.sub(r"^# ?", "", s) for s in buf))
        else:
            out.append("```python\n" + "\n".join(buf) + "\n```")
    return "\n\n".join(out) + "\n"


def _title(md: str, fallback: str) -> str:
    m = re.search(r"^# (.+)$", md, re.M)
    return m.group(1).strip() if m else fallback


def on_config(config, **kw):
    nav = config["nav"]
    for i, item in enumerate(nav):
        if isinstance(item, dict) and "Tutorials" in item and isinstance(item["Tutorials"], str):
            pages = [item["Tutorials"]]
            for p in tutorial_sources():
                md = percent_to_markdown(p.read_text(), p.stem)
                pages.append({_title(md, p.stem): f"tutorials/{p.stem}.md"})
            nav[i] = {"Tutorials": pages}
    return config


def on_files(files, config, **kw):
    for p in tutorial_sources():
        files.append(File.generated(config, f"tutorials/{p.stem}.md",
                                    content=percent_to_markdown(p.read_text(), p.stem)))
    return files


# ---------------------------------------------------------------- tables
def on_pre_build(config, **kw):
    global _index
    _index = spec_index.build_index()
    for p in _index.problems:
        log.warning(f"spec index: {p}")
    for inv_id, nodes in _index.unknown().items():
        log.warning(f"tests cite unknown invariant {inv_id}: {nodes}")
    if _index.uncovered():
        log.info(f"invariants no test cites yet: {', '.join(_index.uncovered())}")


def _id_link(inv_id: str, page) -> str:
    here = posixpath.dirname(page.file.src_uri)
    target = posixpath.relpath(f"spec/{spec_index.family_page(inv_id)}", here or ".")
    return f"[{inv_id}]({target}#{inv_id.lower()})"


def _tests_block(inv_id: str) -> str:
    nodes = _index.tests.get(inv_id, [])
    if not nodes:
        return "**Tests:** *none yet* (no test carries `@pytest.mark.spec(\"%s\")`)." % inv_id
    return "**Tests** (generated from `@pytest.mark.spec`):\n\n" + "\n".join(f"- `{n}`" for n in nodes)


def _id_index(page) -> str:
    rows = ["| ID | rule | tests |", "|---|---|---|"]
    for inv_id, title in INVARIANTS.items():
        n = len(_index.tests.get(inv_id, []))
        rows.append(f"| {_id_link(inv_id, page)} | {title.replace('|', '/')} | {n if n else '**none yet**'} |")
    return "\n".join(rows)


def _bug_zoo(page) -> str:
    rows = ["| variant | what it changes | seen in | symptom | caught by |", "|---|---|---|---|---|"]
    for b in bugs.BUGS.values():
        caught = ", ".join(_id_link(i, page) for i in b.caught_by)
        rows.append(f"| `{b.name}` | {b.changes} | {b.source} | {b.symptom} | {caught} |")
    return "\n".join(rows)


def _t1_floors(page) -> str:
    rows = ["| dtype | T1 absolute floor |", "|---|---|"]
    rows += [f"| `{str(dt).replace('torch.', '')}` | `{f}` |" for dt, f in tolerance.T1_FLOOR.items()]
    return "\n".join(rows) + f"\n\nT2 margin δ (`T2_DELTA`): `{tolerance.T2_DELTA}` (logits)."


def _tutorial_list(page) -> str:
    out = []
    for p in tutorial_sources():
        title = _title(percent_to_markdown(p.read_text(), p.stem), p.stem)
        out.append(f"- [{title}]({p.stem}.md) — `tutorials/{p.stem}.ipynb`")
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files, **kw):
    def sub(m):
        kind, arg = m.group(1), m.group(2)
        if kind == "tests":
            if arg not in INVARIANTS:
                log.warning(f"{page.file.src_uri}: refspec:tests names unknown id {arg!r}")
                return m.group(0)
            return _tests_block(arg)
        makers = {"id-index": _id_index, "bug-zoo": _bug_zoo, "t1-floors": _t1_floors,
                  "tutorial-list": _tutorial_list}
        if kind in makers:
            return makers[kind](page)
        log.warning(f"{page.file.src_uri}: unknown placeholder refspec:{kind}")
        return m.group(0)

    return PLACEHOLDER.sub(sub, markdown)
