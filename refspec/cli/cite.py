"""``python -m refspec cite ID [ID ...]``: one invariant, ready to paste into a review.

For each ID it prints a block that reads well pasted into a GitHub review comment
(``--format markdown``, the default) or a terminal (``--format text``):

* the rule's one-line title, then its **Rule.** paragraph as the spec page states it, word for word
  (:func:`rule_paragraph`; ``--format text`` drops only the Markdown markup: backticks, ``**``), then
  its conformance level (what the level means for the review);
* the SGLang versions it matches and the pins ``python -m refspec conformance`` checks;
* the upstream sources: permalinks at a release tag or commit, with a line, first; then the PRs
  and commits that made or broke the rule (its history); two links that would print the same label
  (one symbol cited at two lines) carry their line, ``forward_extend L1844@v0.5.23`` /
  ``forward_extend L2034@v0.5.23`` (:func:`source_labels`);
* the rule's page ``docs/spec/<page>.md#<id>`` as a full link: under ``--base-url URL`` (or
  ``$REFSPEC_DOCS_URL``), e.g. ``--base-url https://github.com/<owner>/refspec/blob/<tag>``, else
  under this repository's GitHub blob (``main``) when its URL is known, else repo-relative
  (:func:`refspec.harness.docs_links.docs_base`, as the conformance report links it);
* the refspec test that shows it as a ``pytest`` command: the first of the ``@pytest.mark.spec``
  tests ``docs/spec_index.py`` finds, in :func:`pick_tests`'s order (a test about this rule alone
  before one that checks it among others); ``--tests`` lists them all;
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
import posixpath
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


@cache
def citations() -> dict[str, list[str]]:
    """``ID -> the node ids of the tests citing it`` (``docs/spec_index.py``'s index of this checkout)."""
    return load_spec_index().build_index().tests


def _def_line(node_id: str) -> int:
    """The line of the test's ``def`` in its module (file order), or a large number if not found."""
    path, _, name = node_id.partition("::")
    func = name.split("::")[-1].split("[")[0]
    text = _module_text(path)
    m = re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(func)}\(", text, re.M)
    return text.count("\n", 0, m.start()) + 1 if m else 1 << 30


@cache
def _module_text(path: str) -> str:
    f = ROOT / path
    return f.read_text(encoding="utf-8") if f.is_file() else ""


def pick_tests(tests: list[str], cited: dict[str, list[str]] | None = None) -> list[str]:
    """The tests of one rule in showing order: the first is the one ``Shown by`` names.

    ``tests``: node ids citing the rule; ``cited``: ``ID -> node ids`` for every rule (default
    :func:`citations`), to count how many rules each test cites.  The order, each key breaking the
    previous one's ties:

    1. tests that run without a GPU before ``test_gpu_*`` tests (the command runs where it is pasted);
    2. public-case tests (``case_B..``, the documented failure scenarios) first;
    3. fewer rules cited first: a test that cites this rule alone reproduces or exercises it; one
       that cites it among others is an end-to-end check (a lossless loop) or a shared guard (the
       reachability test that ML-011 and ML-012 both cite) and comes later;
    4. the rule's home module first: modules ordered by how many of the rule's tests they hold
       (most first), then by path;
    5. file order within a module (the line of the test's ``def``).
    """
    cited = citations() if cited is None else cited
    rules_of: dict[str, int] = {}
    for ids in cited.values():
        for t in ids:
            rules_of[t] = rules_of.get(t, 0) + 1
    per_module: dict[str, int] = {}
    for t in tests:
        per_module[t.partition("::")[0]] = per_module.get(t.partition("::")[0], 0) + 1

    def key(t: str):
        module = t.partition("::")[0]
        return ("test_gpu_" in t, "case_B" not in t, rules_of.get(t, 1), -per_module[module], module, _def_line(t))

    return sorted(tests, key=key)


def source_labels(sources: tuple[Source, ...] | list[Source]) -> list[str]:
    """Each source's label; labels that would repeat (one symbol cited at two lines) get the line.

    ``path:symbol@version`` linked to ``#L1844`` becomes ``path:symbol L1844@version``; a label
    without ``@`` gets `` L1844`` at its end.  Labels that stay equal (same line) are left as they are."""
    labels = [s.label for s in sources]
    out = []
    for s in sources:
        m = re.search(r"#L(\d+)(?:-L?\d+)?$", s.url)
        if labels.count(s.label) > 1 and m:
            head, at, version = s.label.rpartition("@")
            out.append(f"{head} L{m.group(1)}@{version}" if at else f"{s.label} L{m.group(1)}")
        else:
            out.append(s.label)
    return out


def rule_paragraph(inv_id: str, base_url: str = "", markdown: bool = True) -> str:
    """The ``**Rule.**`` paragraph of the ID's spec entry (``docs/spec/<page>.md``), word for word.

    Its lines are joined with one space (a paragraph, as Markdown renders it).  Links relative to
    ``docs/spec/`` become repo-relative (``docs/...``) or absolute under ``base_url``.  With
    ``markdown=False`` the Markdown markup (backticks, ``**``) is dropped and a link ``[x](u)``
    reads ``x <u>``; every word stays.  '' when the entry has no Rule paragraph."""
    entry = spec_entries().get(inv_id, "")
    para = next((p for p in re.split(r"\n[ \t]*\n", entry) if p.lstrip().startswith("**Rule.**")), "")
    text = " ".join(line.strip() for line in para.strip().splitlines())

    def target(m: re.Match) -> str:
        url = m.group(2)
        if not re.match(r"^[a-z]+:|^#", url):
            path = posixpath.normpath(posixpath.join("docs/spec", url))
            url = f"{base_url.rstrip('/')}/{path}" if base_url else path
        return f"[{m.group(1)}]({url})" if markdown else f"{m.group(1)} <{url}>"

    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", target, text)
    return text if markdown else text.replace("**", "").replace("`", "")


def render(inv_id: str, tests: list[str], fmt: str = "markdown", base_url: str = "",
           all_tests: bool = False, cited: dict[str, list[str]] | None = None) -> str:
    """The block for one known ID (``tests``: node ids citing it; ``cited``: every rule's, for
    :func:`pick_tests`), Markdown or plain text."""
    r = RULES[inv_id]
    md = fmt == "markdown"
    code = (lambda s: f"`{s}`") if md else (lambda s: s)
    link = (lambda label, url: f"[{label}]({url})") if md else (lambda label, url: f"{label} <{url}>")
    head = (f"**{inv_id}** — {r.title}" if md else f"{inv_id} — {r.title}")
    level = f"*{r.level}*" if md else str(r.level)
    item = (lambda key, val: f"- **{key}:** {val}") if md else (lambda key, val: f"  {key}: {val}")
    out = [head, ""]
    rule = rule_paragraph(inv_id, base_url, md)
    if rule:
        out += [rule, ""]
    out.append(item("Level", f"{level}: {r.level.meaning}."))
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
    labelled = list(zip(source_labels(r.sources), r.sources))
    upstream = [(lab, s) for lab, s in labelled if _is_permalink(s)]
    history = [(lab, s) for lab, s in labelled if not _is_permalink(s) and not s.url.startswith("docs/")]
    pages = [(lab, s) for lab, s in labelled if s.url.startswith("docs/")]
    if upstream:
        out.append(item("Upstream", ", ".join(link(code(lab), s.url) for lab, s in upstream)))
    if history:
        out.append(item("History", ", ".join(link(lab, s.url) for lab, s in history)))
    page = spec_link(inv_id, base_url)
    out.append(item("Rule page", link(code(spec_link(inv_id)), page) if md else page))
    if pages:
        out.append(item("Evidence", ", ".join(link(code(lab), _url(s, base_url)) for lab, s in pages)))
    for topic in see_also(inv_id):
        t = TOPICS[topic]
        url = _docs_link(t.page[len("docs/"):], base_url)
        out.append(item("See also", f"the {topic} story ({t.summary}): {code(f'python -m refspec cite {topic}')}, "
                        f"{link(code(t.page), url) if md else url}"))
    shown = pick_tests(tests, cited)
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
    cited = citations()
    sep = "\n\n---\n\n" if args.format == "markdown" else "\n\n"
    base = docs_base(args.base_url)[0]  # absolute links: --base-url, else the repository's blob
    print(sep.join(render(i, cited.get(i, []), args.format, base, args.tests, cited) for i in resolved))
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
