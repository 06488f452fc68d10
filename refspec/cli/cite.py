"""``python -m refspec cite ID [ID ...]``: one invariant, ready to paste into a review.

For each ID it prints a block that reads well pasted into a GitHub review comment
(``--format markdown``, the default) or a terminal (``--format text``):

* the rule's one-line statement and its conformance level (what the level means for the review);
* the SGLang versions it matches and the pins ``python -m refspec conformance`` checks;
* the upstream sources: permalinks at a release tag or commit, with a line, first; then the PRs
  and commits that made or broke the rule (its history);
* the rule's page ``docs/spec/<page>.md#<id>`` as a full link: under ``--base-url URL`` (or
  ``$REFSPEC_DOCS_URL``), e.g. ``--base-url https://github.com/<owner>/refspec/blob/<tag>``, else
  under this repository's GitHub blob (``main``) when its URL is known, else repo-relative
  (:func:`refspec.harness.docs_links.docs_base`, as the conformance report links it);
* the refspec test that shows it (the first ``@pytest.mark.spec`` test found by
  ``docs/spec_index.py``; ``--tests`` lists them all) as a ``pytest`` command;
* a review line to complete.

Lookups: ``cite --list`` prints every ID with its level and title; ``--level kernel`` (alone or
with ``--list``) only that level's IDs; ``cite --grep TERM`` (or ``cite TERM`` for a token that
is not an ID, e.g. ``cite page_table``) lists the rules whose title or spec entry mentions the
term.  ``cite accept-length`` (a *topic*, :data:`TOPICS`) prints a story that spans several
rules, told on one docs page (here v1's packed and v2's uniform draft-extend ``cu_seqlens_q``,
CG-003 / CG-004); the entry of each of its rules ends with a "See also" line naming it.
IDs are matched case-insensitively (``cg-004`` works); an unknown ID-like token is a
one-line error naming the close matches, exit code 2.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from functools import cache
from typing import NamedTuple

from refspec.cli._args import PROG, ArgumentParser, CLIError, run
from refspec.core.invariants import RULES
from refspec.core.sources import Level, Source
from refspec.harness.docs_links import BASE_URL_ENV, ROOT, docs_base, load_spec_index, spec_link

ID_LIKE = re.compile(r"^[A-Za-z]{2,3}-?\d{1,4}$")


def _is_permalink(s: Source) -> bool:
    """An upstream file at a release tag or commit with a line (``.../blob/<ref>/<path>#L<n>``)."""
    return "/blob/" in s.url and "#L" in s.url


def _url(s: Source, base_url: str) -> str:
    return f"{base_url.rstrip('/')}/{s.url}" if base_url and s.url.startswith("docs/") else s.url


class Topic(NamedTuple):
    """A story across several rules, told on one docs page."""

    page: str  #: repo-relative, ``docs/...md``
    ids: tuple[str, ...]  #: the rules it ties together; each one's entry points to it ("See also")
    summary: str  #: one line, for the "See also" item


#: ``cite TOPIC`` prints the page
TOPICS = {"accept-length": Topic("docs/accept-length.md", ("CG-003", "CG-004"),
                                 "v1 packs cumsum(a), CG-003; v2 keeps the stride W and row b * N + a_b - 1, "
                                 "CG-004; why they differ; the upstream bugs")}


def _docs_link(target: str, base_url: str) -> str:
    """A link found on a ``docs/`` page, made repo-relative (``docs/...``) or absolute under ``base_url``."""
    if re.match(r"^[a-z]+:|^#", target):
        return target
    path = "docs/" + target
    return f"{base_url.rstrip('/')}/{path}" if base_url else path


def render_topic(name: str, base_url: str = "") -> str:
    """``TOPICS[name]``'s page as Markdown, its links repo-relative (or under ``base_url``), no images."""
    page = TOPICS[name].page
    text = (ROOT / page).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.startswith("![")]
    body = re.sub(r"\]\(([^)\s]+)\)", lambda m: f"]({_docs_link(m.group(1), base_url)})", "\n".join(lines))
    return f"{body.rstrip()}\n\n(from {_docs_link(page[len('docs/'):], base_url)})"


def see_also(inv_id: str) -> list[str]:
    """The topics whose story includes ``inv_id``."""
    return [name for name, t in TOPICS.items() if inv_id in t.ids]


def pick_tests(tests: list[str]) -> list[str]:
    """The tests in showing order: public-case and non-GPU tests first (both keep their order)."""
    return sorted(tests, key=lambda t: ("test_gpu_" in t, "case_B" not in t))


def render(inv_id: str, tests: list[str], fmt: str = "markdown", base_url: str = "",
           all_tests: bool = False) -> str:
    """The block for one known ID (``tests``: node ids citing it), Markdown or plain text."""
    r = RULES[inv_id]
    md = fmt == "markdown"
    code = (lambda s: f"`{s}`") if md else (lambda s: s)
    link = (lambda label, url: f"[{label}]({url})") if md else (lambda label, url: f"{label} <{url}>")
    head = (f"**{inv_id}** — {r.title}" if md else f"{inv_id} — {r.title}")
    level = f"*{r.level}*" if md else str(r.level)
    item = (lambda key, val: f"- **{key}:** {val}") if md else (lambda key, val: f"  {key}: {val}")
    out = [head, "", item("Level", f"{level}: {r.level.meaning}.")]
    if r.level is Level.HARDENING:
        out.append(item("In SGLang", f"{r.upstream}."))
    elif r.upstream:
        out.append(item("Earlier SGLang", f"{r.upstream}."))
    if r.violated_by:
        out.append(item("Released SGLang breaks it", f"{r.violated_by}. Quoting it against that code is a bug "
                        "report."))
    if r.versions:
        out.append(item("Matches SGLang", ", ".join(r.versions)))
    if r.conformance:
        out.append(item("Checked against upstream", f"{code('python -m refspec conformance')} at "
                        f"{', '.join(r.conformance)}"))
    upstream = [s for s in r.sources if _is_permalink(s)]
    history = [s for s in r.sources if not _is_permalink(s) and not s.url.startswith("docs/")]
    pages = [s for s in r.sources if s.url.startswith("docs/")]
    if upstream:
        out.append(item("Upstream", ", ".join(link(code(s.label), s.url) for s in upstream)))
    if history:
        out.append(item("History", ", ".join(link(s.label, s.url) for s in history)))
    page = spec_link(inv_id, base_url)
    out.append(item("Rule page", link(code(spec_link(inv_id)), page) if md else page))
    if pages:
        out.append(item("Evidence", ", ".join(link(code(s.label), _url(s, base_url)) for s in pages)))
    for topic in see_also(inv_id):
        t = TOPICS[topic]
        url = _docs_link(t.page[len("docs/"):], base_url)
        out.append(item("See also", f"the {topic} story ({t.summary}): {code(f'python -m refspec cite {topic}')}, "
                        f"{link(code(t.page), url) if md else url}"))
    shown = pick_tests(tests)
    if shown:
        more = len(shown) - 1
        extra = f" (+{more} more: {code(f'python -m refspec cite {inv_id} --tests')})" if more and not all_tests else ""
        out.append(item("Shown by", code(f"pytest '{shown[0]}'") + extra))
        if all_tests and more:
            out += [f"    - {code(t)}" for t in shown[1:]]
    else:
        out.append(item("Shown by", "no test yet"))
    verb = "does not follow" if r.level is Level.HARDENING else "violates"
    rid = f"**{inv_id}**" if md else inv_id
    review = (f"{'> ' if md else ''}{verb} {rid} ({r.level}: {r.title}): <what the change does>, "
              f"<the consequence>. See {page}.")
    out += ["", "Review line:", "", review]
    return "\n".join(out)


def resolve(token: str) -> str | None:
    """The catalogue ID ``token`` names (case-insensitive), or None."""
    t = token.strip().upper()
    return t if t in RULES else None


def close_matches(token: str) -> list[str]:
    return difflib.get_close_matches(token.strip().upper(), list(RULES), n=3, cutoff=0.5)


LEVEL_NAMES = {"kernel": Level.KERNEL, "upstream": Level.UPSTREAM, "hardening": Level.HARDENING}


def listing(level: Level | None = None, ids: list[str] | None = None) -> str:
    """One line per ID (``ID  level  title``): ``ids`` (default all), only ``level``'s if given."""
    width = max(len(str(lv)) for lv in Level)
    return "\n".join(f"{i:<8} {RULES[i].level!s:<{width}}  {RULES[i].title}" for i in (ids or list(RULES))
                     if level is None or RULES[i].level is level)


@cache
def spec_entries() -> dict[str, str]:
    """``ID -> the text of its spec entry`` (from its heading to the next heading), all pages."""
    out: dict[str, str] = {}
    for page in sorted(load_spec_index().SPEC_DIR.glob("*.md")):
        current = None
        for line in page.read_text().splitlines():
            if re.match(r"^#{1,6}\s", line):
                m = load_spec_index().HEADING_RE.match(line)
                current = m.group(1) if m else None
            if current and not line.startswith("- `tests/"):  # not the generated list of test names
                out[current] = out.get(current, "") + line + "\n"
    return out


def grep(term: str) -> list[str]:
    """The IDs whose title or spec entry mentions ``term`` (case-insensitive, as a whole word)."""
    pat = re.compile(rf"(?<![\w]){re.escape(term.strip())}(?![\w])", re.IGNORECASE)
    entries = spec_entries()
    return [i for i, r in RULES.items() if pat.search(r.title) or pat.search(entries.get(i, ""))]


def main(argv: list[str] | None = None) -> int:
    """Print the IDs' entries, a listing or a lookup; 0, or 2 with one line for bad input."""
    return run(_main, argv, f"{PROG} cite")


def _main(argv) -> int:
    parser = ArgumentParser(
        prog=f"{PROG} cite",
        description="Print an invariant's rule, conformance level, upstream sources and test, ready for a review "
                    "comment; or look rules up by level or by a term.")
    parser.add_argument("ids", nargs="*", metavar="ID",
                        help="invariant IDs, e.g. CG-004 (case-insensitive); a topic "
                             f"({', '.join(TOPICS)}) prints its story; a term that is not an ID (page_table) "
                             "lists the rules that mention it")
    parser.add_argument("--list", action="store_true", help="list every ID with its level and title")
    parser.add_argument("--level", choices=sorted(LEVEL_NAMES), help="only the IDs of this level (a listing)")
    parser.add_argument("--grep", metavar="TERM", help="list the rules whose title or spec entry mentions TERM")
    parser.add_argument("--format", choices=("markdown", "text"), default="markdown",
                        help="markdown (default: pastes into a GitHub comment) or plain text")
    parser.add_argument("--base-url", default=os.environ.get(BASE_URL_ENV, ""), metavar="URL",
                        help=f"put URL in front of docs/ links (default ${BASE_URL_ENV}, else this repository's "
                             f"GitHub blob when its URL is known, else repo-relative paths)")
    parser.add_argument("--tests", action="store_true", help="list every test that cites the ID, not only the first")
    args = parser.parse_args(argv)
    level = LEVEL_NAMES[args.level] if args.level else None
    if args.grep is not None:
        return _print_grep(args.grep, level)
    if args.list or (level is not None and not args.ids):
        print(listing(level))
        return 0
    if not args.ids:
        raise CLIError("give an invariant ID (e.g. CG-004), a term (e.g. page_table), --grep TERM, --level or --list")
    if len(args.ids) == 1 and args.ids[0].strip().lower() in TOPICS:
        print(render_topic(args.ids[0].strip().lower(), args.base_url))
        return 0
    if len(args.ids) == 1 and resolve(args.ids[0]) is None and not ID_LIKE.match(args.ids[0].strip()):
        return _print_grep(args.ids[0], level)
    resolved = []
    for token in args.ids:
        inv_id = resolve(token)
        if inv_id is None:
            near = close_matches(token)
            hint = f"; close matches: {', '.join(near)}" if near else "; 'python -m refspec cite --list' shows them all"
            raise CLIError(f"unknown invariant {token!r}{hint}")
        resolved.append(inv_id)
    index = load_spec_index().build_index()
    sep = "\n\n---\n\n" if args.format == "markdown" else "\n\n"
    base = docs_base(args.base_url)[0]  # absolute links: --base-url, else the repository's blob
    print(sep.join(render(i, index.tests.get(i, []), args.format, base, args.tests) for i in resolved))
    return 0


def _print_grep(term: str, level: Level | None) -> int:
    if not term.strip():
        raise CLIError("--grep needs a term, e.g. page_table")
    ids = grep(term)
    if level is not None:
        ids = [i for i in ids if RULES[i].level is level]
    if not ids:
        raise CLIError(f"no rule mentions {term.strip()!r}; 'python -m refspec cite --list' shows them all")
    print(listing(level, ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
