"""``python -m refspec cite ID [ID ...]``: one invariant, ready to paste into a review.

For each ID it prints (Markdown, so it pastes into a GitHub review as is) the rule's title, its
conformance level and what that level means for the review, the upstream versions it matches
and the pins ``python -m refspec conformance`` checks, its spec entry, its upstream sources as
links, and the tests that prove it (``@pytest.mark.spec``, found by
:mod:`refspec.harness.spec_index`), then a review line to complete.

``cite --list`` prints every ID with its level and title (``--level hardening``: only the rules
that are stricter than SGLang).  IDs are matched case-insensitively
(``cg-004`` works); an unknown ID is a one-line error naming the close matches, exit code 2.
"""

from __future__ import annotations

import difflib
import sys

from refspec.cli._args import PROG, ArgumentParser, CLIError, run
from refspec.core.invariants import RULES
from refspec.core.sources import Level
from refspec.harness import spec_index


def spec_link(inv_id: str) -> str:
    """The ID's entry in the repository: ``docs/spec/<page>.md#<id>``."""
    return f"docs/spec/{spec_index.family_page(inv_id)}#{inv_id.lower()}"


def render(inv_id: str, tests: list[str]) -> str:
    """The Markdown block for one known ID (``tests``: node ids citing it)."""
    r = RULES[inv_id]
    out = [f"**{inv_id}** — {r.title}", "",
           f"- **Level:** *{r.level}*: {r.level.meaning}."]
    if r.level is Level.HARDENING:
        out.append(f"- **In SGLang:** {r.upstream}.")
    elif r.upstream:
        out.append(f"- **Earlier SGLang:** {r.upstream}.")
    if r.violated_by:
        out.append(f"- **Released SGLang breaks it:** {r.violated_by}. Quoting it against that code is a bug "
                   "report.")
    if r.versions:
        out.append(f"- **Matches SGLang:** {', '.join(r.versions)}")
    if r.conformance:
        out.append(f"- **Checked against upstream:** `python -m refspec conformance` at {', '.join(r.conformance)}")
    out.append(f"- **Spec:** {spec_link(inv_id)}")
    out.append("- **Sources:** " + ", ".join(f"[{s.label}]({s.url})" for s in r.sources))
    if tests:
        out.append(f"- **Tests ({len(tests)}):**")
        out += [f"    - `{t}`" for t in tests]
    else:
        out.append("- **Tests:** none yet")
    verb = "does not follow" if r.level is Level.HARDENING else "violates"
    review = (f"> {verb} **{inv_id}** ({r.level}: {r.title}): <what the change does>, <the consequence>. "
              f"See {spec_link(inv_id)}.")
    out += ["", "Review line:", "", review]
    return "\n".join(out)


def resolve(token: str) -> str | None:
    """The catalogue ID ``token`` names (case-insensitive), or None."""
    t = token.strip().upper()
    return t if t in RULES else None


def close_matches(token: str) -> list[str]:
    return difflib.get_close_matches(token.strip().upper(), list(RULES), n=3, cutoff=0.5)


LEVEL_NAMES = {"kernel": Level.KERNEL, "upstream": Level.UPSTREAM, "hardening": Level.HARDENING}


def listing(level: Level | None = None) -> str:
    """One line per ID (``ID  level  title``), only ``level``'s IDs if given."""
    width = max(len(str(lv)) for lv in Level)
    return "\n".join(f"{i:<8} {r.level!s:<{width}}  {r.title}" for i, r in RULES.items()
                     if level is None or r.level is level)


def main(argv: list[str] | None = None) -> int:
    """Print the IDs' entries (or the list); 0, or 2 with one line for a missing / unknown ID."""
    return run(_main, argv, f"{PROG} cite")


def _main(argv) -> int:
    parser = ArgumentParser(
        prog=f"{PROG} cite",
        description="Print an invariant's rule, conformance level, upstream sources and tests, ready for a review.")
    parser.add_argument("ids", nargs="*", metavar="ID", help="invariant IDs, e.g. CG-004 (case-insensitive)")
    parser.add_argument("--list", action="store_true", help="list every ID with its level and title")
    parser.add_argument("--level", choices=sorted(LEVEL_NAMES), help="with --list: only the IDs of this level")
    args = parser.parse_args(argv)
    if args.list:
        print(listing(LEVEL_NAMES[args.level] if args.level else None))
        return 0
    if not args.ids:
        raise CLIError("give an invariant ID (e.g. CG-004) or --list")
    resolved = []
    for token in args.ids:
        inv_id = resolve(token)
        if inv_id is None:
            near = close_matches(token)
            hint = f"; close matches: {', '.join(near)}" if near else "; 'python -m refspec cite --list' shows them all"
            raise CLIError(f"unknown invariant {token!r}{hint}")
        resolved.append(inv_id)
    index = spec_index.build_index()
    print("\n\n---\n\n".join(render(i, index.tests.get(i, [])) for i in resolved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
