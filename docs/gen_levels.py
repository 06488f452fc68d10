"""Write the conformance level of every invariant into the docs, from ``refspec.core.invariants.RULES``.

* every entry of ``docs/spec/*.md`` gets (or has refreshed) one ``**Level.**`` paragraph right
  after its heading: the level, the SGLang versions it matches, the conformance pins, for a
  hardening rule what upstream does instead, and the upstream sources as links;
* ``docs/versions.md`` gets the rule-by-rule table between ``<!-- levels:table:start -->`` and
  ``<!-- levels:table:end -->``.

The output is committed, so the pages read the same on a plain Markdown viewer and on the site.
Run ``python docs/gen_levels.py`` after editing ``RULES``; ``--check`` exits 1 (and names the
files) when a page is stale, which ``tests/test_provenance.py`` runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs"))  # spec_index.py

from refspec.core.invariants import RULES  # noqa: E402  (after the sys.path line: run from a checkout)
from refspec.core.sources import Level  # noqa: E402
import spec_index  # noqa: E402  (docs/spec_index.py)

SPEC = ROOT / "docs" / "spec"
VERSIONS = ROOT / "docs" / "versions.md"
START, END = "<!-- levels:table:start -->", "<!-- levels:table:end -->"
CONFORMANCE = "`python -m refspec conformance`"


def level_paragraph(inv_id: str, docs_prefix: str = "../") -> str:
    """The ``**Level.**`` paragraph of one entry (Markdown, links relative to ``docs/spec/``)."""
    r = RULES[inv_id]
    parts = [f"**Level.** *{r.level}*:"]
    if r.level is Level.KERNEL:
        parts.append("what FA3's `flash_attn_with_kvcache` requires or does.")
    elif r.level is Level.UPSTREAM:
        parts.append(f"what SGLang does at {', '.join(r.versions)}." if r.versions
                     else "what SGLang does at the releases linked.")
        if r.upstream:
            parts.append(f"Earlier: {r.upstream}.")
    else:
        parts.append(f"stricter than SGLang (in SGLang: {r.upstream}). Quoting it against SGLang code "
                     "is a suggestion, not a bug report.")
    if r.violated_by:
        parts.append(f"**Released SGLang breaks it:** {r.violated_by}. Quoting it against that code is a bug "
                     "report.")
    if r.conformance:
        parts.append(f"Checked by {CONFORMANCE} against {', '.join(r.conformance)}.")
    parts.append("Sources: " + ", ".join(s.markdown(docs_prefix) for s in r.sources) + ".")
    return " ".join(parts)


def _heading_level_pairs(lines: list[str]):
    """Indices ``(heading, level_line or None)`` of every ID entry."""
    in_fence = False
    for n, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else spec_index.HEADING_RE.match(line)
        if m:
            nxt = next((k for k in range(n + 1, len(lines)) if lines[k].strip()), None)
            yield m.group(1), n, (nxt if nxt is not None and lines[nxt].startswith("**Level.**") else None)


def render_spec_page(text: str) -> str:
    lines = text.splitlines()
    edits = list(_heading_level_pairs(lines))
    for inv_id, head, lvl in reversed(edits):
        para = level_paragraph(inv_id)
        if lvl is not None:
            lines[lvl] = para
        else:
            lines[head + 1:head + 1] = ["", para]
    return "\n".join(lines) + "\n"


def versions_table() -> str:
    rows = ["| ID | rule | level | matches SGLang | conformance | upstream |", "|---|---|---|---|---|---|"]
    for inv_id, r in RULES.items():
        link = f"[{inv_id}](spec/{spec_index.family_page(inv_id)}#{inv_id.lower()})"
        where = ", ".join(r.versions) if r.versions else ("—" if r.level is Level.KERNEL else "no (see the rule)")
        conf = ", ".join(r.conformance) if r.conformance else "—"
        src = ", ".join(s.markdown("") for s in r.sources)
        title = r.title.replace("|", "/")
        rows.append(f"| {link} | {title} | {r.level} | {where} | {conf} | {src} |")
    return "\n".join(rows)


def render_versions(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{versions_table()}\n{END}{tail}"


def targets() -> dict[Path, str]:
    """Each generated file -> its up-to-date text."""
    out = {p: render_spec_page(p.read_text()) for p in sorted(SPEC.glob("*.md"))}
    out[VERSIONS] = render_versions(VERSIONS.read_text())
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stale = [p for p, new in targets().items() if p.read_text() != new]
    if "--check" in argv:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run python docs/gen_levels.py)")
        return 1 if stale else 0
    for p, new in targets().items():
        if p.read_text() != new:
            p.write_text(new)
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
