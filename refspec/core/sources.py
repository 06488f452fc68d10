"""Conformance levels and upstream sources: the vocabulary of :data:`refspec.core.invariants.RULES`.

Every invariant has one :class:`Level`:

* ``kernel contract``: what FlashAttention-3's ``flash_attn_with_kvcache`` requires or does
  (its source, or an H200 measurement on ``docs/kernel-facts.md``);
* ``upstream behaviour``: what SGLang's code does, at the versions listed (``Rule.versions``);
  where ``python -m refspec conformance`` compares that field against upstream's own FA3
  backend, ``Rule.conformance`` names the pinned releases;
* ``refspec hardening``: stricter than upstream (``Rule.upstream`` says what SGLang does
  instead). Quoting it against SGLang code is a suggestion, not a bug report.

A :class:`Source` is a label a reader can paste plus a link a reader can open: an upstream file
at a release tag or commit (``python/sglang/srt/...:symbol@version``, linked to the line), a PR,
a commit, or a page under ``docs/``.  The pinned versions are the constants below; the version
table is ``docs/versions.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

SGLANG = "https://github.com/sgl-project/sglang"
FLASH_ATTN = "https://github.com/Dao-AILab/flash-attention"
#: the FlashAttention release tag whose ``hopper/`` (FA3) sources the kernel-contract citations
#: point to; the tag is commit ``0251105a2fb19d2957484b7f023cd8c115286ced`` (2026-08-15), the
#: commit docs/kernel-facts.md was read at (the FA4 release tags also carry ``hopper/``)
FA_TAG = "fa4-v4.0.0.beta27"

#: the release that matches 0bfe1d145 (#11874: v1 + eager v2, legacy capture/replay hooks)
V_OLDEST = "v0.5.5"
#: the newest release that still has ``ForwardMode.DRAFT_EXTEND`` (v1) and the legacy hooks
V_LAST_V1 = "v0.5.12.post1"
#: the newest release (conformance pin): no v1, out-of-graph / in-graph hooks, Triton replay kernels
V_LATEST = "v0.5.23"


class Level(str, Enum):
    """The conformance level of a rule (its ``str`` is the level's name)."""

    KERNEL = "kernel contract"
    UPSTREAM = "upstream behaviour"
    HARDENING = "refspec hardening"

    def __str__(self) -> str:
        return self.value

    @property
    def meaning(self) -> str:
        """One sentence for a reviewer: how to quote a rule of this level."""
        return {
            Level.KERNEL: "what FA3's flash_attn_with_kvcache requires; a violation is a bug in any caller",
            Level.UPSTREAM: "what SGLang's code does at the versions listed; a violation is a regression against upstream",
            Level.HARDENING: "stricter than SGLang; quoting it against SGLang code is a suggestion, not a bug report",
        }[self]


@dataclass(frozen=True)
class Source:
    """``label``: what to paste in a review; ``url``: a link to open (absolute, or ``docs/...``)."""

    label: str
    url: str

    def markdown(self, docs_prefix: str = "../") -> str:
        """``[label](url)``; a ``docs/`` link is made relative with ``docs_prefix`` (from docs/spec/)."""
        url = docs_prefix + self.url[len("docs/"):] if self.url.startswith("docs/") else self.url
        return f"[{self.label}]({url})"


@dataclass(frozen=True)
class Rule:
    """One invariant: its title, level, sources and the upstream versions it matches.

    ``versions``: upstream releases / commits where SGLang's code matches the rule as stated
    (empty for a kernel contract or a pure refspec policy). ``conformance``: the pinned releases
    at which ``python -m refspec conformance`` compares the rule's fields with upstream.
    ``upstream``: for a hardening rule, what SGLang does instead (required); for an upstream rule,
    how older SGLang versions differed (optional).  ``violated_by``: released SGLang code that
    breaks the rule -- which releases, the open or merged PR, how the conformance run shows it
    (``refspec.conformance.known.BUGS``); quoting the rule against that code is a bug report.
    """

    title: str
    level: Level
    sources: tuple[Source, ...]
    versions: tuple[str, ...] = ()
    conformance: tuple[str, ...] = ()
    upstream: str = ""
    violated_by: str = ""

    def __post_init__(self):
        if not isinstance(self.level, Level):
            raise TypeError(f"Rule.level must be a Level, got {self.level!r}")
        if not self.sources:
            raise ValueError(f"rule {self.title!r} has no source")
        if self.level is Level.HARDENING and not self.upstream:
            raise ValueError(f"hardening rule {self.title!r} must say what upstream does (Rule.upstream)")
        if self.level is Level.HARDENING and self.violated_by:
            raise ValueError(f"hardening rule {self.title!r}: code that breaks a rule SGLang does not promise is "
                             "not a bug; a rule released code violates is a kernel contract or upstream rule")


# ---------------------------------------------------------------- link builders
def sgl(path: str, version: str, line: int | None, symbol: str) -> Source:
    """``python/sglang/<path>:<symbol>@<version>``, linked to ``line`` (or the file) at that tag or commit."""
    anchor = f"#L{line}" if line else ""
    label = f"python/sglang/{path}:{symbol}@{version if version.startswith('v') else version[:9]}"
    return Source(label, f"{SGLANG}/blob/{version}/python/sglang/{path}{anchor}")


def pr(number: int, note: str = "") -> Source:
    """An SGLang pull request (``note``: what it did, e.g. "fix", "closed")."""
    return Source(f"sglang#{number}" + (f" ({note})" if note else ""), f"{SGLANG}/pull/{number}")


def commit(sha: str, number: int | None = None) -> Source:
    """An SGLang commit (squash merge of PR ``number``)."""
    return Source(f"sglang@{sha}" + (f" (#{number})" if number else ""), f"{SGLANG}/commit/{sha}")


def fa3(path: str, line: int, symbol: str) -> Source:
    """A FlashAttention-3 source line at the release tag :data:`FA_TAG` (``path`` under ``hopper/``)."""
    return Source(f"flash-attention/hopper/{path}:{symbol}@{FA_TAG}",
                  f"{FLASH_ATTN}/blob/{FA_TAG}/hopper/{path}#L{line}")


def doc(page: str, anchor: str = "", label: str = "") -> Source:
    """A page (and heading anchor) under ``docs/``."""
    target = f"docs/{page}" + (f"#{anchor}" if anchor else "")
    return Source(label or target, target)


def external(label: str, url: str) -> Source:
    """Any other public source (another project's issue or PR)."""
    return Source(label, url)
