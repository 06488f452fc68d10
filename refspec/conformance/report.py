"""Result rows, their findings (rule ID, level, both values, the upstream line) and the printed
and Markdown reports.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

from refspec.conformance import cases, install, rules
from refspec.conformance.compare import KERNEL_ARGS as KERNEL_ARG_NAMES
from refspec.conformance.compare import Diff
from refspec.conformance.known import BUGS, KNOWN, by_key, link
from refspec.harness import docs_links
from refspec.harness.docs_links import repository_url, spec_link

#: the "rule" of an adapter gap (:func:`is_gap`): refspec's adapter, not upstream, cannot go on; not a rule broken
ADAPTER = "ADAPTER"
#: what an adapter gap says, wherever it is printed
GAP_WORDS = "no rule broken; refspec cannot drive this code yet"
#: ``Finding.how``: the line ran and wrote the field (traced in the worker, :func:`rules.ran`)
RAN = "ran"
#: ``Finding.how``: the traceback's line of an upstream exception
TRACEBACK = "traceback"
#: ``Finding.how``: no traced line writes the field; read statically (:func:`rules.locate`)
STATIC = "static"
#: how each kind of upstream line is said after it (console, report)
HOW = {RAN: "", TRACEBACK: "", STATIC: "not traced, read statically"}
#: rules a passing run has not checked: the comparison reads values, never addresses
NOT_BY_VALUES = (("CG-001", "buffer identity: captured buffers rewritten in place, not rebound; the metadata's "
                            "values are compared, not addresses; only a legacy-hooks replay re-reads the kernel's "
                            "captured call, where a rebound buffer shows as stale kernel arguments"),)


@dataclass(frozen=True)
class Finding:
    """One failure a reviewer can paste: the rule broken, its level, both values, upstream's line."""

    rule: str
    level: str
    field: str | None  #: None: upstream raised
    ours: str
    theirs: str
    where: tuple[str, int] | None  #: (file relative to the folder holding sglang/, line) in the code under test
    url: str | None  #: permalink at the release tag, or the local file:line
    note: str = ""  #: for an upstream exception: whether it is the page-table bound or the mode's rule
    how: str = STATIC  #: how ``where`` was found: :data:`RAN`, :data:`TRACEBACK` or :data:`STATIC`
    #: a helper / kernel line (:data:`RAN`), or an exception's line (:data:`TRACEBACK`) outside the backend's
    #: metadata hook: the backend's line that ran it
    via: tuple[str, int] | None = None
    via_url: str | None = None
    padded: bool = False  #: the values shown are a graph's padding row (``Diff.padded``)

    @property
    def spec(self) -> str:
        return spec_link(self.rule)


@dataclass
class Row:
    """One compared result: a job's (phase, draft step) on one pin."""

    pin: str
    job: str
    mode: str
    page_size: int
    shape: str
    phase: str
    step: int | None
    diffs: list[Diff] = field(default_factory=list)
    error: str | None = None  #: upstream raised (or produced no result): counts as undocumented
    findings: list[Finding] = field(default_factory=list)  #: one per undocumented diff / the error (:func:`find`)
    bug: str | None = None  #: the known upstream bug (``known.BUGS`` key) this failing row shows
    #: further known upstream bugs the same row shows (each of its findings names its own: ``known.cover``)
    also: tuple[str, ...] = ()
    #: a known upstream bug (``known.BUGS`` key) this failing row resembles on code it is not recognised on
    #: (:func:`known.resembles`): said on the row, the row still fails
    like: str | None = None
    #: refspec's adapter cannot drive this result (or its kernel part) here: upstream read something the
    #: adapter does not lay out (:func:`is_gap`).  No rule broken; the row is not counted as agreeing either
    gap: str | None = None
    batch: int | None = None  #: requests in the batch this phase hands the backend (eager: live B; graphs: bs)
    topk: int = 1  #: top-k of the configuration
    num_steps: int | None = None  #: speculative_num_steps S of the configuration
    kernel_calls: int = 0  #: kernel calls whose arguments were compared (0: no forward ran on both sides)
    sched_checked: int = 0  #: of them, the calls handed a scheduler_metadata (checked against its maker: PA-013)

    @property
    def label(self) -> str:
        mode = f"{self.mode} {self.shape}" if self.mode.startswith("tree_") else self.mode  # shape: k2, k4, k8
        return mode if self.step is None else f"{mode} s={self.step}"

    @property
    def undocumented(self) -> list[Diff]:
        return [d for d in self.diffs if d.documented is None]

    @property
    def broken(self) -> bool:
        """A rule broken here: upstream raised, or a field differs undocumented."""
        return self.error is not None or bool(self.undocumented)

    @property
    def ok(self) -> bool:
        """Everything compared agrees (or differs only as documented) and nothing is an adapter gap."""
        return not self.broken and self.gap is None


def is_gap(text: str) -> bool:
    """Whether an error text is refspec's adapter failing, not upstream: upstream read an attribute
    the adapter does not lay out (``AdapterGap``), used a package the worker stubs
    (``StubUsed``), or the exception was raised in refspec's own adapter code."""
    head = text.split(":", 1)[0]
    return text.startswith(("AdapterGap", "StubUsed")) or (
        _AT.search(text) is None and " at " in text and "/refspec/conformance/" in head + text)


#: the case dimensions a headline's condition is looked for in, in this order: (name shown, Row attribute)
DIMS = (("bs", "batch"), ("P", "page_size"), ("k", "topk"), ("S", "num_steps"), ("step", "step"))
PHASE_ORDER = ("eager", "capture", "replay", "replay-staged")


def _case_key(r: Row) -> tuple:
    return (r.batch or 0, r.page_size, r.topk, r.num_steps or 0, -1 if r.step is None else r.step,
            PHASE_ORDER.index(r.phase) if r.phase in PHASE_ORDER else 9, r.job)


def condition(failing: list[Row], pool: list[Row]) -> str:
    """The condition under which ``failing`` rows fail among ``pool`` (the rows of the same modes
    compared on the same code): the first case dimension (:data:`DIMS`) whose failing values all lie
    above (or below) every passing value -- ``bs >= 2 (every bs = 1 case holds)`` --, else where
    it fails in how many cases."""
    ids = {id(r) for r in failing}
    passing = [r for r in pool if id(r) not in ids and not r.broken]
    if not passing:
        return f"in every case compared ({len(failing)})"
    for name, attr in DIMS:
        fail = {getattr(r, attr) for r in failing if getattr(r, attr) is not None}
        hold = {getattr(r, attr) for r in passing if getattr(r, attr) is not None}
        if not fail or not hold:
            continue
        if min(fail) > max(hold):
            held = f"{name} = {max(hold)}" if len(hold) == 1 else f"{name} <= {max(hold)}"
            return f"when {name} >= {min(fail)} (every {held} case holds)"
        if max(fail) < min(hold):
            held = f"{name} = {min(hold)}" if len(hold) == 1 else f"{name} >= {min(hold)}"
            return f"when {name} <= {max(fail)} (every {held} case holds)"
    return f"in {len(failing)} of {len(failing) + len(passing)} cases (no one case dimension separates them)"


@dataclass
class Headline:
    """One broken rule on one target, as a reviewer pastes it: the rule, the smallest failing case,
    the condition that triggers it, both values and upstream's line."""

    rule: str
    level: str
    row: Row  #: the smallest failing case (:func:`_case_key`)
    finding: Finding
    condition: str
    count: int  #: failing results under this rule
    bug: str | None  #: the known upstream bug all of them are, or None

    def case(self) -> str:
        r = self.row
        bits = [f"bs = {r.batch}" if r.batch is not None else None, f"P = {r.page_size}", f"k = {r.topk}",
                f"S = {r.num_steps}" if r.num_steps is not None else None, f"step {r.step}" if r.step is not None
                else None]
        return f"{r.mode} {r.phase}, " + ", ".join(b for b in bits if b) + f" ({r.job})"


def headlines(rows: list[Row], label: str) -> list[Headline]:
    """One :class:`Headline` per rule broken on ``label``'s rows (adapter gaps left out): the
    rules no known upstream bug explains first (cause first), then the known bugs' rules."""
    mine = [r for r in rows if r.pin == label and (r.gap is None or r.broken)]
    by_rule: dict[str, list[tuple[Row, Finding]]] = defaultdict(list)
    for r in mine:
        for f in r.findings:
            if f.rule != ADAPTER:
                by_rule[f.rule].append((r, f))
    out = []
    for rid in rules.by_cause(set(by_rule)):
        items = by_rule[rid]
        failing = list({id(r): r for r, _ in items}.values())
        modes, phases = {r.mode for r in failing}, {r.phase for r in failing}
        # the condition among the same modes and phases; where every such case fails, among the modes' other
        # phases too (a capture only binds buffers, so its rows do not count)
        cond = condition(failing, [r for r in mine if r.mode in modes and r.phase in phases])
        if cond.startswith("in every case"):
            wider = condition(failing, [r for r in mine if r.mode in modes and r.phase != "capture"])
            cond = wider if wider.startswith("when") else cond
        r0, f0 = min(items, key=lambda it: (it[1].padded, _case_key(it[0])))  # a real request's row first
        # the known bug of this rule on each row (a row may show two: Row.also, each finding its own rule)
        bugs = {next((b for b in (r.bug, *r.also) if b and by_key(b).rule == rid), r.bug) for r in failing}
        out.append(Headline(rid, f0.level, r0, f0, cond, len(failing),
                            next(iter(bugs)) if len(bugs) == 1 and None not in bugs else None))
    return sorted(out, key=lambda h: h.bug is not None)


def broken_by(h: Headline, label: str, variant: str | None = None) -> str:
    """Whose defect a headline's rule shows: ``broken by sglang 0.4.7``; with refspec's bug
    ``variant`` switched on (a negative control) the planted variant's, upstream being the side that
    holds (a known upstream bug's rule stays upstream's)."""
    if variant and not h.bug:
        return (f"broken by refspec's planted variant {variant} (a negative control; sglang {label} is the upstream "
                f"side)")
    return f"broken by sglang {label}"


def headline_line(h: Headline, label: str, i: int, n: int, variant: str | None = None) -> str:
    """``== FINDING 1 of 2: TR-014 (upstream behaviour) broken by sglang 0.4.7, when bs >= 2 ...``
    (``variant``: refspec's bug variant switched on, :func:`broken_by`)."""
    f = h.finding
    at = f" at {f.where[0].rsplit('/', 1)[-1]}:{f.where[1]}" if f.where else ""
    via = f" (run from {f.via[0].rsplit('/', 1)[-1]}:{f.via[1]})" if f.via else ""
    if f.field is None:
        values = f"upstream raised: {f.theirs}"
    elif f.field == "kernel:scheduler_metadata":
        values = f"{f.field}: the kernel call passes {f.ours} | planned by {f.theirs}"
    else:
        values = f"{f.field}: refspec {f.ours} | upstream {f.theirs}"
    bug = f"; {by_key(h.bug).marker}" if h.bug else ""
    return (f"== FINDING {i} of {n}: {h.rule} ({h.level}) {broken_by(h, label, variant)} in {_n(h.count, 'result')}, "
            f"{h.condition}{bug}; smallest case {h.case()}: {values}; upstream line{at}{via}")


def _site_rel(at: tuple[str, int]) -> tuple[str, int]:
    """A recorded caller ``(absolute file, line)`` as ``(file relative to the folder holding sglang/, line)``."""
    f = at[0]
    i = f.rfind("/sglang/")
    return (f[i + 1:] if i >= 0 else f), int(at[1])


#: ``Finding.ours`` when upstream raised or returned nothing: refspec's side of that result
BUILT = "the metadata built"
_AT = re.compile(r" at ((?:\S*/)?sglang/\S+?\.py):(\d+)")
#: the backend hook's line an upstream exception's text names (``upstream_common.describe``)
_RUN_FROM = re.compile(r"^[^:]* at \S+?\.py:\d+ \(run from (\S+?\.py):(\d+)\)")


def find(row: Row, target=None, executed=None) -> None:
    """Fill ``row.findings``: each undocumented diff and the upstream error with its rule ID and
    level (:func:`rules.rule_for`) and the upstream line in ``target``'s code: the traceback's
    line for an error; for a field the executed line that wrote it (:func:`rules.ran` over
    ``executed``, the lines that ran while upstream built this result), else, when none did or
    nothing was traced, the line :func:`rules.locate` reads statically (``Finding.how`` says which)."""
    row.findings.clear()
    shape = getattr(target, "shape", None)
    files = (rules.FA, *((shape.kernels,) if shape and shape.kernels and shape.kernels != rules.FA else ()))

    def where(fld):
        if target is None:
            return None, STATIC, None
        w = rules.ran(target.site, executed, fld)
        if w is not None:
            return (w[0], w[1]), RAN, (None if w[2] is None else (rules.FA, w[2]))
        return rules.locate(target.site, files, shape.hooks, row.mode, row.phase, fld, executed), STATIC, None

    def url(w):
        return rules.link(target, *w) if w else None

    if row.gap:  # refspec's adapter cannot drive this here: no rule is broken (the upstream line that read it)
        m = _AT.search(row.gap)
        w = (m.group(1)[m.group(1).rfind("sglang/"):], int(m.group(2))) if m else None
        row.findings.append(Finding(ADAPTER, "adapter gap", None, BUILT, row.gap, w, url(w), how=TRACEBACK))
    if row.error and is_gap(row.error):  # (a caller that did not sort it out: the same)
        row.gap, row.error = row.error, None
        return find(row, target, executed)
    if row.error:
        m = _AT.search(row.error)
        w, how, _ = ((m.group(1)[m.group(1).rfind("sglang/"):], int(m.group(2))), TRACEBACK, None) if m \
            else where(None)
        src = os.path.join(target.site, w[0]) if m and target is not None else None
        stmt = rules.statement(src, w[1]) if src else ""
        fld = rules.computed_field(src, w[1], row.mode) if src else None
        rid, note = rules.error_rule(row.mode, row.phase, row.error, stmt, fld)
        r = _RUN_FROM.search(row.error) if m else None
        via = (rules.FA, int(r.group(2))) if r and rules.FA.endswith("/" + r.group(1).rsplit("/", 1)[-1]) else None
        row.findings.append(Finding(rid, rules.level(rid), None, BUILT, row.error, w, url(w), note, how, via=via,
                                    via_url=url(via)))
    for d in row.undocumented:
        rid = rules.rule_for(row.mode, row.phase, d.field, d.short_table, d.out_of_pool, d.stale)
        w, how, via = where(d.field) if d.at is None else (_site_rel(d.at), RAN, None)
        row.findings.append(Finding(rid, rules.level(rid), d.field, d.ours, d.theirs, w, url(w), how=how, via=via,
                                    via_url=url(via), padded=d.padded))


def _cell(rows: list[Row]) -> str:
    ids = rules.by_cause({f.rule for r in rows for f in r.findings})
    bugs = sorted({b for r in rows if not r.ok for b in (r.bug, *r.also) if b})
    likes = sorted({r.like for r in rows if not r.ok and r.like and not r.bug})
    tag = f" [{','.join(ids)}{''.join(', ' + by_key(b).marker for b in bugs)}" \
          f"{''.join(', matches known upstream bug ' + b for b in likes)}]" if ids else ""
    if any(r.error for r in rows):
        return "ERROR" + tag
    bad = sorted({d.field for r in rows for d in r.undocumented})
    if bad:
        return "DIFFERS: " + ",".join(bad) + tag
    doc = sorted({d.documented for r in rows for d in r.diffs})
    return "same" + (f" (+{','.join(doc)})" if doc else "")


def finding_line(r: Row, f: Finding) -> str:
    """``DIFFERS decode/P4/B3/bs4 replay: MD-003 (upstream behaviour) cache_seqlens_int32: refspec .. |
    upstream .. (upstream sglang/...py:123)``."""
    where = f"{r.job} {r.phase}" + ("" if r.step is None else f" step {r.step}")
    via = f", run from {f.via[0].rsplit('/', 1)[-1]}:{f.via[1]}" if f.via else ""
    at = f" (upstream {f.where[0]}:{f.where[1]}{via}{', ' + HOW[f.how] if HOW[f.how] else ''})" if f.where else ""
    if f.rule == ADAPTER:
        return f"  ADAPTER GAP {where}: {GAP_WORDS}: {f.theirs}"
    bug = f" [{', '.join(by_key(b).marker for b in (r.bug, *r.also))}]" if r.bug else (
        f" [{by_key(r.like).hint}; still a failure here]" if r.like else "")
    if f.field is None:
        return f"  ERROR {where}: {f.rule} ({f.level}): {f.note or 'upstream exception'}: {f.theirs}{at}{bug}"
    if f.field == "kernel:scheduler_metadata":  # upstream against itself: the call and what planned it
        return (f"  DIFFERS {where}: {f.rule} ({f.level}) {f.field}: the kernel call passes {f.ours} | its "
                f"scheduler_metadata was planned by {f.theirs}{at}{bug}")
    return f"  DIFFERS {where}: {f.rule} ({f.level}) {f.field}: refspec {f.ours} | upstream {f.theirs}{at}{bug}"


def table(rows: list[Row], pin: str, verbose: bool = False, target=None, limit: int = 12) -> str:
    """Default: one line per failing (mode, step, P, phase) group, then up to ``limit`` findings
    (rule, level, values, upstream line).  ``verbose``: every group, every finding, and every
    documented difference with both values."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        if r.pin == pin:
            groups[(r.label, r.page_size, r.phase)].append(r)
    shown = {k: v for k, v in groups.items() if verbose or not all(r.ok for r in v)}
    if not shown:
        return ""
    w = max([len(k[0]) for k in shown] + [4])
    lines = [f"{'mode':<{w}}  {'P':>3}  {'phase':<13} cases  result"]
    for (label, P, phase), rs in shown.items():
        lines.append(f"{label:<{w}}  {P:>3}  {phase:<13} {len(rs):>5}  {_cell(rs)}")
    out = []
    # the rows no known upstream bug explains first: a known bug never pushes a new finding out of the preview
    for r in sorted(rows, key=lambda r: r.bug is not None):
        if r.pin != pin or (r.ok and not (verbose and r.diffs)):
            continue
        if verbose:
            where = f"{r.job} {r.phase}" + ("" if r.step is None else f" step {r.step}")
            out += [f"  documented {where}: {d.field}: refspec {d.ours} | upstream {d.theirs} ({d.documented})"
                    for d in r.diffs if d.documented]
        out += [finding_line(r, f) for f in r.findings]
    mine = [r for r in rows if r.pin == pin]
    n_find = sum(len(r.findings) for r in mine)
    if not verbose and n_find > limit:
        out = [x for x in out if not x.startswith("  documented")][:limit]
        out.append(more_line(n_find - limit, mine))
    return "\n".join(lines + out)


def docs_base(base_url: str = "") -> tuple[str, str]:
    """``(prefix, how)`` for the spec links of a report (:func:`refspec.harness.docs_links.docs_base`,
    the repository URL read through this module's :func:`repository_url`)."""
    return docs_links.docs_base(base_url, repository_url())


def markdown(out, command: str = "", base_url: str = "") -> str:
    """A review comment: per target, the rules broken (ID, level, spec link), then each distinct
    finding with both values and the upstream line (a permalink for a release).  Spec links are
    absolute per :func:`docs_base` (``base_url``: ``--base-url`` / ``$REFSPEC_DOCS_URL``); the
    footer says where they point."""
    base, how = docs_base(base_url)
    lines = ["### refspec conformance", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += variant_md(getattr(out, "variant", None))
    lines += [x.removeprefix("== ")[0].upper() + x.removeprefix("== ")[1:] + "." for x in skipped_lines(out)]
    lines += [""] if getattr(out, "skipped", None) else []
    for label in dict.fromkeys(r.pin for r in out.rows):
        lines += _target_md(out.rows, label, base)
    lines += unreachable_md(out)
    lines.append(f"<sub>{how[0].upper()}{how[1:]}.</sub>")
    return "\n".join(lines)


def _target_md(rows: list[Row], label: str, base: str) -> list[str]:
    """One target's part of :func:`markdown`: its summary line, then :func:`_rules_md` of its findings."""
    s = summary(rows, label)
    known_bug = f", {s['known_bug']} of them on known upstream bugs" if s["known_bug"] else ""
    gaps = f", {s['gaps']} adapter gaps ({GAP_WORDS})" if s["gaps"] else ""
    lines = [f"**sglang {label}**: {s['cases']} cases compared, {s['undocumented']} failing{known_bug}{gaps} "
             f"({s['same']} identical, {s['documented']} with only documented differences).", ""]
    hs = headlines(rows, label)
    for i, h in enumerate(hs, 1):
        f = h.finding
        at = f" at {_at(f.where, f.url)}" if f.where else ""
        values = (f"upstream raised `{f.theirs}`" if f.field is None else
                  f"`{f.field}`: refspec `{f.ours}`, upstream `{f.theirs}`")
        bug = f" ({_bug_link(h.bug)})" if h.bug else ""
        lines.append(f"{i}. **{h.rule}** ({h.level}){bug}, {_n(h.count, 'result')}, {h.condition}; smallest case "
                     f"{h.case()}: {values}; upstream line{at}")
    if hs:
        lines.append("")
    return lines + _rules_md([r for r in rows if r.pin == label and r.findings], base)


def distinct(rows: list[Row]) -> dict[tuple, list[tuple[Row, Finding]]]:
    """The findings of ``rows`` (the adapter's left out) grouped as the report lists them: one
    bullet per (rule, field, upstream line, mode, phase), rules cause first (:func:`rules.by_cause`),
    each group's findings in row order."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        for f in r.findings:
            if f.rule != ADAPTER:
                groups[(f.rule, f.field, f.where, r.mode, r.phase)].append((r, f))
    order = {rid: i for i, rid in enumerate(rules.by_cause({k[0] for k in groups}))}
    return dict(sorted(groups.items(), key=lambda kv: order[kv[0][0]]))


def more_line(n_more: int, rows: list[Row], of: str = "") -> str:
    """The console's ``... N more findings`` line: how many findings in all and how many distinct
    ones the report writes (:func:`distinct`)."""
    total = sum(len(r.findings) for r in rows)
    k = len(distinct(rows))
    return (f"  ... {n_more} more findings {of}({total} in all, {k} distinct by rule, field, upstream line, mode "
            f"and phase: -v prints all {total}, --report FILE.md writes the {k} distinct ones)")


def _rules_md(mine: list[Row], base: str, verdict: bool = True) -> list[str]:
    """The findings of the failing rows ``mine``: the rules broken (ID, level, spec link, how many
    results break each), each distinct finding (:func:`distinct`) with both values and the upstream
    line, the closing words (the rules cause first; the known bugs).  ``verdict`` False (every row on
    a known upstream bug): no "this code violates" line, the known bugs named with their PR."""
    if not mine:
        return []
    lines: list[str] = []
    groups = distinct(mine)
    by_rule: dict[str, list] = defaultdict(list)
    for (rid, *_), items in groups.items():
        by_rule[rid] += items
    adapter = [(r, f) for r in mine for f in r.findings if f.rule == ADAPTER]
    if adapter:
        texts = list(dict.fromkeys(f.theirs[:200] for _, f in adapter))
        lines += [f"**Adapter gap** ({GAP_WORDS}): {len(adapter)} results not compared, e.g. `{texts[0]}`"
                  + (f" ({len(texts)} distinct)" if len(texts) > 1 else "") + ".", ""]
    if not by_rule:
        return lines
    lines += ["| rule | level | failing results | fields |", "|---|---|---|---|"]
    for rid, items in by_rule.items():
        f0 = items[0][1]
        fields = sorted({f.field or "upstream error" for _, f in items})
        n = len({id(r) for r, _ in items})  # results (rows), as the summary counts them; not findings
        lines.append(f"| [{rid}]({spec_link(rid, base)}) {rules.RULES[rid].title} | {f0.level} | {n} | "
                     f"{', '.join(fields)} |")
    total = sum(len(items) for items in groups.values())
    lines += ["", f"{_n(len(groups), 'distinct finding')} of {total} (one example per rule, field, upstream line, "
                  f"mode and phase):", ""]
    for items in groups.values():
        r, f = items[0]
        rid = f.rule
        at = _at(f.where, f.url) if f.where or f.url else "unknown"
        at += f", run from {_at(f.via, f.via_url)}" if f.via else ""
        at += f" ({HOW[f.how]})" if f.where and HOW[f.how] else ""
        bug = f" [{_bug_link(r.bug)}]" if r.bug else (f" [{_hint_link(r.like)}; still a failure here]" if r.like
                                                       else "")
        like = f" ({len(items)} findings like it)" if len(items) > 1 else ""
        step = "" if r.step is None else f" step {r.step}"
        if f.field is None:
            values = f"{f.note or 'upstream exception'}: refspec builds the metadata, upstream `{f.theirs}`"
        elif f.field == "kernel:scheduler_metadata":
            values = f"`{f.field}`: the kernel call passes `{f.ours}`, planned by `{f.theirs}`"
        else:
            values = f"`{f.field}`: refspec `{f.ours}`, upstream `{f.theirs}`"
        lines.append(f"- **{rid}** ({f.level}), {r.mode} P = {r.page_size} {r.phase}{step} (`{r.job}`): {values}; "
                     f"upstream line {at}{bug}{like}")
    lines.append("")
    verb = "does not follow" if any(f.level == "refspec hardening" for items in by_rule.values()
                                    for _, f in items) else "violates"
    if verdict:
        lines.append(f"> this code {verb} " + ", ".join(f"**{rid}**" for rid in by_rule) +
                     " (cause first: the rule of the field the others are derived from; `python -m refspec cite ID` "
                     "prints each rule with its sources).")
    for i, key in enumerate(sorted({r.bug for r in mine if r.bug})):
        b = by_key(key)
        rids = rules.by_cause({f.rule for r in mine if r.bug == key for f in r.findings})
        n = sum(r.bug == key for r in mine)
        if verdict or i:
            lines.append(">")
        lines.append(f"> {', '.join(f'**{x}**' for x in rids)} in {n} of these results: the {_bug_link(key)} "
                     f"(status: {b.status}); a known bug reproduced is still a broken rule.")
    lines.append("")
    return lines


def _at(where: tuple[str, int] | None, url: str | None) -> str:
    """A Markdown upstream line: the permalink for a release, else the local ``file:line``."""
    if where and url and url.startswith("http"):
        return f"[`{where[0]}:{where[1]}`]({url})"
    return f"`{url}`" if url else "unknown"


def _hint_link(key: str) -> str:
    """``matches known upstream bug `X` (introduced by [sglang#15469](...), fixed by [sglang#27360](...))``."""
    b = by_key(key)
    hist = ", ".join(f"{w} by [sglang#{n}](https://github.com/sgl-project/sglang/pull/{n})"
                     for w, n in (("introduced", b.introduced), ("fixed", b.fixed_by)) if n)
    return f"matches known upstream bug `{b.key}`" + (f" ({hist})" if hist else "")


def _bug_link(key: str) -> str:
    """``known upstream bug context-wall-page-table ([sglang#35985](https://...))`` for a Markdown report."""
    b = by_key(key)
    return f"known upstream bug `{b.key}`" + (f" ([{b.ref}]({b.url}))" if b.issue else "")


def summary(rows: list[Row], pin: str) -> dict:
    mine = [r for r in rows if r.pin == pin]
    return {"cases": len(mine), "same": sum(not r.diffs and not r.error for r in mine),
            "documented": sum(bool(r.diffs) and r.ok for r in mine),
            "undocumented": sum(r.broken for r in mine), "known_bug": sum(bool(r.bug) for r in mine),
            "gaps": sum(r.gap is not None and not r.broken for r in mine)}


def bugs_table(keys: set[str], rows: list[Row] = ()) -> str:
    """The known upstream bugs ``keys``: rule, status (fixed by / open PR), what, the lines its
    failing ``rows`` cite in the code under review (where it was recognised there), then the
    upstream lines at the releases it was reproduced at (said to be those releases' lines)."""
    lines = []
    for b in BUGS:
        if b.key not in keys:
            continue
        where = (f"reproduced at {', '.join(b.pins)}; recognised on any code by its signature (a page table "
                 f"below the kernel bound, only live pages missing)") if b.signature else f"at {', '.join(b.pins)}"
        lines.append(f"  {b.key}" + (f" ({b.ref})" if b.issue else "") + f": breaks {b.rule}"
                     + (f" (also {', '.join(b.also)})" if b.also else "") + f" {where}")
        lines.append(f"      {b.what}")
        lines.append(f"      status: {b.status}")
        here = {}
        for r in rows:
            if b.key in (r.bug, *r.also):
                for f in r.findings:
                    if f.where and (r.bug == b.key and not r.also or f.rule == b.rule):
                        here.setdefault((r.pin, f.where, f.via), f.url)
        for (pin, (rel, n), via), url in here.items():
            run_from = f", run from {via[0].split('/')[-1]}:{via[1]}" if via else ""
            lines.append(f"      in the code under review, sglang {pin}: {rel.split('/')[-1]}:{n}{run_from}  {url}")
        reviewed = {r.pin for r in rows}
        for pin, f, line in b.upstream:
            whose = "the line recorded for this bug" if pin in reviewed else "not the code under review"
            lines.append(f"      at the release {pin} ({whose}): {f.split('/')[-1]}:{line}  "
                         f"{link(pin, f, line)}")
    return "\n".join(lines)


def known_table(used: set[str] | None = None) -> str:
    """The documented-differences table (the ``used`` keys marked), with upstream links."""
    lines = []
    for k in KNOWN:
        mark = "*" if used and k.key in used else " "
        lines.append(f"{mark} {k.key}: {'/'.join(k.fields)} in {'/'.join(k.modes)} at {'/'.join(k.phases)} "
                     f"({', '.join(k.pins)})")
        for pin, f, line in k.upstream:
            lines.append(f"      upstream {pin} {f.split('/')[-1]}:{line}  {link(pin, f, line)}")
        lines.append(f"      refspec: {k.refspec}")
        lines.append(f"      harmless: {k.why}")
    return "\n".join(lines)


# -- a PR-scoped review (``--baseline SPEC``): what the code under test changes against a baseline --

NEW_FAILURE = "new failure"  #: fails under test; passes on the baseline
#: fails on both, and under test by a (rule, field) pair the baseline's row does not break (the set grew): a new
#: failure, its new pairs named (the pairs it no longer breaks, if any, said too)
NEWLY_BROKEN = "newly broken on a failing row"
NEW_DIFFERS = "new, DIFFERS"  #: a result only the code under test has (a new phase, mode, case), failing
NEW_SAME = "new, same"  #: a result only the code under test has, agreeing
PRE_EXISTING = "pre-existing"  #: fails on both by the same rules and fields
FIXED = "fixed"  #: fails on the baseline, passes under test
#: fails on both, and under test by fewer (rule, field) pairs, none new (the set shrank): not a failure of this change
PARTLY_FIXED = "partly fixed"
UNCHANGED = "unchanged"  #: passes on both
GONE = "only on the baseline"  #: a result the code under test no longer has (a mode or phase it dropped)
GAP = "adapter gap"  #: refspec cannot drive the code under test here (no rule broken; not compared)
#: the order the changes are listed in
CHANGES = (NEW_FAILURE, NEWLY_BROKEN, NEW_DIFFERS, GAP, FIXED, PARTLY_FIXED, NEW_SAME, GONE, PRE_EXISTING, UNCHANGED)
#: the changes that fail a ``--baseline`` run (exit 1)
FAILING = (NEW_FAILURE, NEWLY_BROKEN, NEW_DIFFERS)


@dataclass(frozen=True)
class Change:
    """What one result (a job's phase and draft step) is under test against the baseline."""

    status: str  #: one of :data:`CHANGES`
    row: Row  #: the code under test's row (the baseline's for :data:`GONE`)
    base: Row | None  #: the baseline's row of the same result, None if it has none

    @property
    def fails(self) -> bool:
        """A new failure (``--baseline``'s exit 1); one on a known upstream bug too, named as known."""
        return self.status in FAILING

    @property
    def added(self) -> set[tuple[str, str | None]]:
        """The (rule, field) pairs the row breaks under test and the baseline's row does not (:func:`broken`)."""
        return broken(self.row) - (broken(self.base) if self.base is not None else set())

    @property
    def removed(self) -> set[tuple[str, str | None]]:
        """The (rule, field) pairs the baseline's row breaks and the row under test no longer does."""
        return (broken(self.base) if self.base is not None else set()) - broken(self.row)

    @property
    def shown(self) -> Row:
        """The row as this change's findings list it: a :data:`NEWLY_BROKEN` row with only its new
        (rule, field) pairs' findings (the others fail on the baseline too); any other row as it is."""
        if self.status != NEWLY_BROKEN:
            return self.row
        added = self.added
        return replace(self.row, findings=[f for f in self.row.findings if (f.rule, f.field) in added])


def broken(row: Row) -> set[tuple[str, str | None]]:
    """The (rule, field) pairs a row fails by (field None: upstream raised; adapter gaps left out)."""
    return {(f.rule, f.field) for f in row.findings if f.rule != ADAPTER}


def changes(base_rows: list[Row], test_rows: list[Row]) -> list[Change]:
    """Match each result of the code under test with the baseline's by (job, phase, step), the job
    id naming mode, page size and case, and classify it (:data:`CHANGES`).  A row failing on
    both is pre-existing only when it breaks the same (rule, field) pairs as the baseline's row: a
    PR that makes a failing row fail in one more way is a new failure (:data:`NEWLY_BROKEN`), one
    that removes some of its pairs and adds none partly fixes it (:data:`PARTLY_FIXED`).  A row refspec cannot drive
    under test (an adapter gap, no rule broken) is :data:`GAP`; a baseline row that was only a gap
    counts as no baseline result.  The rows are the existing comparison's
    (:func:`refspec.conformance.run.rows_for`), known upstream bugs included."""
    base = {(r.job, r.phase, r.step): r for r in base_rows}
    seen, out = set(), []
    for r in test_rows:
        key = (r.job, r.phase, r.step)
        seen.add(key)
        b = base.get(key)
        if b is not None and b.gap and not b.broken:
            b = None
        if r.gap and not r.broken:
            status = GAP
        elif b is None:
            status = NEW_DIFFERS if r.broken else NEW_SAME
        elif not r.broken:
            status = FIXED if b.broken else UNCHANGED
        else:
            grew, shrank = broken(r) - broken(b), broken(b) - broken(r)
            status = (NEW_FAILURE if not b.broken else NEWLY_BROKEN if grew else PARTLY_FIXED if shrank
                      else PRE_EXISTING)
        out.append(Change(status, r, b))
    out += [Change(GONE, b, b) for key, b in base.items() if key not in seen]
    return out


def pairs_text(pairs) -> str:
    """``MD-003 (kernel:cache_seqlens), ML-005 (mla:out, mla:out[padded])``: (rule, field) pairs by
    rule, cause first; a field None is ``upstream error``."""
    by: dict[str, set[str]] = defaultdict(set)
    for rid, fld in pairs:
        by[rid].add(fld or "upstream error")
    return ", ".join(f"{rid} ({', '.join(sorted(by[rid]))})" for rid in rules.by_cause(set(by)))


def rule_ids(rows: list[Row]) -> str:
    """``MD-008, CG-004`` and the known bugs' keys of failing ``rows``."""
    ids = rules.by_cause({f.rule for r in rows for f in r.findings})
    bugs = sorted({by_key(r.bug).marker for r in rows if r.bug})
    return ", ".join(ids + bugs)


def change_counts(chs: list[Change]) -> dict[str, int]:
    return {k: sum(c.status == k for c in chs) for k in CHANGES}


def change_summary(chs: list[Change], test: str, baseline: str) -> str:
    """``sglang @ pr against the baseline sglang @ base: 3 new failures [MD-008], 0 fixed, ...``."""
    n = change_counts(chs)
    gone = pairs_text({p for c in chs if c.status == PARTLY_FIXED for p in c.removed})
    fails = [c.shown for c in chs if c.fails]  # a newly broken row: its new pairs only
    known = [r for r in fails if r.bug]
    return (f"sglang {test} against the baseline sglang {baseline}: {_n(len(fails), 'new failure')}"
            + (f" [{rule_ids(fails)}]" if fails else "")
            + (f" ({len(known)} of them on known upstream bugs)" if known else "")
            + (f" ({n[NEWLY_BROKEN]} of them {NEWLY_BROKEN})" if n[NEWLY_BROKEN] else "")
            + f", {n[FIXED]} fixed"
            + (f", {n[PARTLY_FIXED]} partly fixed [no longer {gone}]" if n[PARTLY_FIXED] else "")
            + f", {_n(n[NEW_SAME] + n[NEW_DIFFERS], 'new result')} ({n[NEW_SAME]} same, "
              f"{n[NEW_DIFFERS]} DIFFERS), {n[PRE_EXISTING]} pre-existing, {n[UNCHANGED]} unchanged"
            + (f", {n[GONE]} only on the baseline" if n[GONE] else "")
            + (f", {_n(n[GAP], 'adapter gap')} ({GAP_WORDS})" if n[GAP] else ""))


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def checked_lines(chs: list[Change]) -> list[str]:
    """What the code under test's comparison checks that the baseline's did not, and the reverse, from
    the rows' kernel counts (:func:`kernel_lines`): PA-013 (a kernel call handed a
    ``scheduler_metadata``, checked against the ``get_scheduler_metadata`` call that made it) and the
    kernel's real arguments, in how many results each is now / no longer checked.  A result's status
    (:data:`CHANGES`) says whether it agrees; this says what a change in the code made comparable:
    0.5.11's scheduler_metadata precompute agrees, yet its calls are checked by PA-013 only there."""
    live = [c for c in chs if c.status != GONE]
    lines = []

    def new_in(rows: list[Change]) -> str:
        k = sum(c.base is None for c in rows)
        return f"; {k} of them new results" if k else ""

    now = [c for c in live if c.row.sched_checked and (c.base is None or not c.base.sched_checked)]
    if now:
        calls = sum(c.row.sched_checked for c in now)
        lines.append(f"PA-013 now checked in {_n(len(now), 'result')} (scheduler_metadata, new in this code: "
                     f"{_n(calls, 'kernel call')} handed one, each checked against the get_scheduler_metadata call "
                     f"that made it; the baseline's calls there were handed none{new_in(now)})")
    gone = [c for c in live if c.base is not None and c.base.sched_checked and not c.row.sched_checked]
    if gone:
        lines.append(f"PA-013 no longer checked in {_n(len(gone), 'result')} (the baseline's kernel calls there were "
                     f"handed a scheduler_metadata, this code's are not)")
    now = [c for c in live if c.row.kernel_calls and (c.base is None or not c.base.kernel_calls)]
    if now:
        lines.append(f"kernel arguments now compared in {_n(len(now), 'result')} (the baseline's forward recorded "
                     f"no kernel call there{new_in(now)})")
    gone = [c for c in live if c.base is not None and c.base.kernel_calls and not c.row.kernel_calls]
    if gone:
        lines.append(f"kernel arguments no longer compared in {_n(len(gone), 'result')} (this code's forward "
                     f"recorded no kernel call there; the baseline's did)")
    return lines


def kernel_lines(out, side: str = "") -> list[str]:
    """One line per target: how many results compared the kernel's real arguments (upstream's
    forward run with a recorder in place of the kernel, :mod:`refspec.conformance.recorder`), how
    many calls were handed a ``scheduler_metadata`` checked against its ``get_scheduler_metadata``
    call (PA-013), and which results compared none, and why."""
    lines = []
    for label in dict.fromkeys(r.pin for r in out.rows):
        mine = [r for r in out.rows if r.pin == label and not r.mode.startswith("mla_")]  # (MLA: its own line)
        if not mine:
            continue
        done = [r for r in mine if r.kernel_calls]
        calls, sched = sum(r.kernel_calls for r in done), sum(r.sched_checked for r in done)
        trees = sum(r.mode.startswith("tree_") for r in mine)
        sched_said = (f"{sched} of them handed a scheduler_metadata, checked against the get_scheduler_metadata "
                      f"call that made it (PA-013)" if sched else
                      "no kernel call was recorded, so PA-013 is not checked here" if not done else
                      "no call was handed a scheduler_metadata (this code computes none on these paths), so PA-013 "
                      "is not checked here")
        lines.append(f"== {side}kernel arguments: sglang {label}: {len(done)} of {len(mine)} results compared the "
                     f"{calls} flash_attn_with_kvcache calls the forward really makes ({', '.join(KERNEL_ARG_NAMES)}); "
                     f"{sched_said}"
                     + (f"; not compared: {trees} top-k > 1 results (the cascade's two calls and merge are not "
                        f"recorded yet)" if trees else "")
                     + ("; idle runs no kernel" if any(r.mode == "idle" for r in mine) else ""))
    return lines


def variant_md(variant: str | None) -> list[str]:
    """The report's note on refspec's bug ``variant`` switched on (``--variant``), or nothing."""
    if not variant:
        return []
    return [f"refspec's bug variant `{variant}` was switched on (`--variant`, a negative control): the rules below "
            f"not named as known upstream bugs are broken by refspec's planted defect, not by sglang.", ""]


def skipped_lines(out, side: str = "") -> list[str]:
    """One line per target that skips requested modes (``Outcome.skipped``: several targets, each
    with its own subset of ``--modes``, or a group such as ``mla``): which, and why."""
    lines = []
    for label, skip in (getattr(out, "skipped", None) or {}).items():
        by_why: dict[str, list[str]] = defaultdict(list)
        for mode, why in skip.items():
            by_why[why].append(mode)
        lines += [f"== {side}not compared on sglang {label} (requested by --modes, which it lacks): "
                  f"{', '.join(modes)}: {why}" for why, modes in by_why.items()]
    return lines


def unreachable_lines(out, side: str = "") -> list[str]:
    """One line per target and reason: the jobs not run because upstream's own code never builds
    their batch, counted and named (``== not reachable upstream: ...``); ``out``: a
    :class:`refspec.conformance.run.Outcome`."""
    groups: dict = {}
    for label, job, why, *_ in getattr(out, "unreachable", ()):
        groups.setdefault((label, why), []).append(job)
    def named(jobs):
        return ", ".join(jobs) if len(jobs) <= 8 else f"{', '.join(jobs[:6])}, ... {len(jobs) - 6} more"

    return [f"== {side}not reachable upstream: sglang {label}: {len(jobs)} job{'' if len(jobs) == 1 else 's'} not run "
            f"({named(jobs)}): {why}" for (label, why), jobs in groups.items()]


def mirror_lines(out, side: str = "") -> list[str]:
    """One line per target whose ``/no-cpu-mirrors`` results ran: why their CPU mirrors are None
    (:func:`refspec.conformance.install.mirror_reason`)."""
    lines = []
    for label, t in out.targets.items():
        n = sum(r.pin == label and r.job.endswith(f"/{cases.NO_MIRROR_TAG}") for r in out.rows)
        why = install.mirror_reason(t.site) if n and t is not None else None
        if why:
            lines.append(f"== {side}no CPU mirrors: sglang {label}: {n} `/{cases.NO_MIRROR_TAG}` result"
                         f"{'' if n == 1 else 's'} ran "
                         f"DRAFT_EXTEND_V2 with seq_lens_cpu / extend_seq_lens_cpu None: {why}")
    return lines


def unreachable_md(out) -> list[str]:
    """Markdown lines for ``out.unreachable`` (:func:`unreachable_lines`) and for the results run
    without CPU mirrors (:func:`mirror_lines`)."""
    said = unreachable_lines(out) + (mirror_lines(out) if getattr(out, "targets", None) else [])
    return [x.removeprefix("== ")[0].upper() + x.removeprefix("== ")[1:] + "." for x in said] + ([""] if said else [])


def _absent(c: Change, last: dict | None) -> bool:
    """A new, agreeing result of a mode the baseline does not run (``last``: mode -> why)."""
    return bool(last) and c.status == NEW_SAME and c.row.mode in last


def absent_lines(last: dict | None) -> list[str]:
    """``tree_verify, tree_draft_decode not run on the baseline: <why>``, one line per reason."""
    by_why: dict[str, list[str]] = defaultdict(list)
    for mode, why in (last or {}).items():
        by_why[why].append(mode)
    return [f"{', '.join(modes)} not run on the baseline: {why}" for why, modes in by_why.items()]


def _change_groups(chs: list[Change], verbose: bool = False, last: dict | None = None) -> dict[tuple, list[Change]]:
    """Changes grouped by (status, mode label, P, phase), in :data:`CHANGES` order; the unchanged
    and the pre-existing only with ``verbose``; the new agreeing results of the modes in ``last``
    (mode -> why the baseline does not run it) after all the others."""
    groups: dict[tuple, list[Change]] = defaultdict(list)
    for c in sorted(chs, key=lambda c: (_absent(c, last), CHANGES.index(c.status))):
        if verbose or c.status not in (UNCHANGED, PRE_EXISTING):
            groups[(c.status, c.row.label, c.row.page_size, c.row.phase)].append(c)
    return groups


def _change_cell(status: str, cs: list[Change]) -> str:
    if status in (FIXED, GONE):  # what the baseline showed
        return "baseline: " + _cell([c.base for c in cs])
    if status == PARTLY_FIXED:  # the pairs gone, then what still fails (on the baseline too)
        return f"no longer {pairs_text({p for c in cs for p in c.removed})}; still " + _cell([c.row for c in cs])
    if status == NEWLY_BROKEN:  # the new pairs; the row failed on the baseline already
        gone = {p for c in cs for p in c.removed}
        return (f"now also {pairs_text({p for c in cs for p in c.added})}" +
                (f", no longer {pairs_text(gone)}" if gone else "") + "; " + _cell([c.row for c in cs]))
    return _cell([c.row for c in cs])


def pre_existing_line(chs: list[Change]) -> str:
    """One line: how many results fail on both, by which rules (and known bugs); '' if none."""
    pre = [c.row for c in chs if c.status == PRE_EXISTING]
    if not pre:
        return ""
    bugs = sum(bool(r.bug) for r in pre)
    return (f"pre-existing: {_n(len(pre), 'result')} {'fails' if len(pre) == 1 else 'fail'} on the baseline too "
            f"[{rule_ids(pre)}]"
            + (f" ({bugs} on known upstream bugs)" if bugs else "") + "; they do not fail this run")


def changes_table(chs: list[Change], verbose: bool = False, limit: int = 12, last: dict | None = None) -> str:
    """Console: one line per changed (status, mode, P, phase) group, then the findings of the new
    failures (up to ``limit``; every one with ``verbose``), the pre-existing line, the unchanged count.
    ``last`` (mode -> why the baseline does not run it): those modes' new agreeing groups come
    after the others, under one line saying why (:func:`absent_lines`)."""
    groups = _change_groups(chs, verbose, last)
    lines, said = [], False
    if groups:
        w = max([len(k[1]) for k in groups] + [4])
        s = max(len(k[0]) for k in groups)
        lines.append(f"{'change':<{s}}  {'mode':<{w}}  {'P':>3}  {'phase':<13} cases  result")
        for (status, label, P, phase), cs in groups.items():
            if not said and _absent(cs[0], last):
                lines += absent_lines(last)
                said = True
            lines.append(f"{status:<{s}}  {label:<{w}}  {P:>3}  {phase:<13} {len(cs):>5}  {_change_cell(status, cs)}")
    if not said:
        lines += absent_lines(last)
    new = [c.shown for c in chs if c.fails]
    new.sort(key=lambda r: r.bug is not None)  # a known upstream bug never pushes a new finding out of the preview
    found = [finding_line(r, f) for r in new for f in r.findings]
    found += [finding_line(c.row, f) for c in chs if c.status == GAP for f in c.row.findings if f.rule == ADAPTER]
    if not verbose and len(found) > limit:
        found = found[:limit] + [more_line(len(found) - limit, new, "of new failures ")]
    lines += found
    pre = pre_existing_line(chs)
    if pre:
        lines.append(f"  {pre}")
    lines.append(f"  unchanged: {_n(change_counts(chs)[UNCHANGED], 'result')}")
    return "\n".join(lines)


def _steps(rows: list[Row]) -> str:
    steps = sorted({r.step for r in rows if r.step is not None})
    return ", ".join(map(str, steps)) if steps else "-"


#: a --baseline report lists at most this many new-failure groups one by one; more are collapsed per
#: (change, mode, phase, rules) as the other changes are, with every group below them in a block
TOP_ROWS = 6


def collapsed_changes(groups: dict[tuple, list[Change]]) -> list[str]:
    """The changed groups that are not new failures (fixed, new and agreeing, only on the baseline),
    one table row per (change, mode, phase, rules): the page sizes, cases (the tree's k, S) and draft
    steps it covers listed in one cell each, so a PR that fixes a hundred rows reads as a few lines
    (``review_markdown`` lists every group after it, collapsed)."""
    merged: dict[tuple, list[Change]] = defaultdict(list)
    for (status, _label, _P, phase), cs in groups.items():
        rows = [c.base if status in (FIXED, GONE) else c.row for c in cs]
        ids = ",".join(rules.by_cause({f.rule for r in rows for f in r.findings})) or "-"
        if status in (PARTLY_FIXED, NEWLY_BROKEN):  # the pairs that changed, the others after them
            moved = {p for c in cs for p in (c.removed if status == PARTLY_FIXED else c.added)}
            ids = (f"{'no longer' if status == PARTLY_FIXED else 'now also'} {pairs_text(moved)}; still "
                   + ",".join(rules.by_cause({f.rule for r in rows for f in r.findings
                                              if (f.rule, f.field) not in moved})))
        merged[(status, cs[0].row.mode, phase, ids)].extend(cs)
    out = ["| change | mode | phase | rules | P | cases | steps | results |", "|---|---|---|---|---|---|---|---|"]
    for (status, mode, phase, ids), cs in merged.items():
        rows = [c.row for c in cs]
        ps = ", ".join(map(str, sorted({r.page_size for r in rows})))
        shapes = ", ".join(sorted({r.shape for r in rows}))
        where = " (baseline)" if status in (FIXED, GONE) and ids != "-" else ""
        out.append(f"| {status} | {mode} | {phase} | {ids}{where} | {ps} | {shapes} | {_steps(rows)} | {len(cs)} |")
    return out


def review_markdown(rev, command: str = "", base_url: str = "") -> str:
    """The review comment of a ``--baseline`` run (``rev``: :class:`refspec.conformance.run.Review`):
    first what this PR changes (the counts, the changed groups, the rules and findings of the new
    failures as :func:`markdown` writes them, the pre-existing line), then both full comparisons
    in a collapsed block."""
    base, how = docs_base(base_url)
    chs = rev.changes
    test, baseline = (next(iter(o.targets), "?") for o in (rev.test, rev.baseline))
    lines = ["### refspec conformance: what this PR changes", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += [f"**{change_summary(chs, test, baseline)}**.", ""]
    checked = checked_lines(chs)
    lines += [f"Newly checked: {'; '.join(checked)}.", ""] if checked else []
    lines += variant_md(getattr(rev.test, "variant", None))
    said = skipped_lines(rev.test, "under test: ")
    lines += [x.removeprefix("== ")[0].upper() + x.removeprefix("== ")[1:] + "." for x in said] + ([""] if said else [])
    last = getattr(rev, "not_on_baseline", None)
    lines += [x + "." for x in absent_lines(last)] + ([""] if last else [])
    groups = _change_groups(chs, last=last)
    top = {k: cs for k, cs in groups.items() if k[0] in FAILING}
    rest = {k: cs for k, cs in groups.items() if k not in top}
    if top:
        table = ["| change | mode | P | phase | results | result |", "|---|---|---|---|---|---|"]
        table += [f"| {status} | {label} | {P} | {phase} | {len(cs)} | {_change_cell(status, cs)} |"
                  for (status, label, P, phase), cs in top.items()]
        short = collapsed_changes(top)
        if len(top) > TOP_ROWS and len(short) < len(table):  # many groups of few findings: one row per rule set
            lines += short + ["", f"<details><summary>Every new-failure group ({len(top)})</summary>", ""]
            lines += table + ["", "</details>", ""]
        else:
            lines += table + [""]
    new = [c.shown for c in chs if c.fails and c.shown.findings]
    if any(not r.bug for r in new):
        lines += ["New failures:", ""] + _rules_md(new, base)
    elif new:  # every new result is on a known upstream bug: still a broken rule, named as known (with its PR)
        lines += ["New failures, each on a known upstream bug (a known bug this change reaches in more results; "
                  "the rule it breaks is named with the bug's PR):", ""] + _rules_md(new, base, verdict=False)
    gap = [c.row for c in chs if c.status == GAP]
    if gap:
        lines += _rules_md(gap, base, verdict=False)
    pre = pre_existing_line(chs)
    if pre:
        lines += [pre[0].upper() + pre[1:] + " (not this change).", ""]
    if rest:
        lines += ["Other changes (each row one change, mode, phase and rule set; every group in the block "
                  "below):", ""] + collapsed_changes(rest) + [""]
        lines += [f"<details><summary>Every other changed group ({len(rest)})</summary>", "",
                  "| change | mode | P | phase | results | result |", "|---|---|---|---|---|---|"]
        for (status, label, P, phase), cs in rest.items():
            lines.append(f"| {status} | {label} | {P} | {phase} | {len(cs)} | {_change_cell(status, cs)} |")
        lines += ["", "</details>", ""]
    lines += unreachable_md(rev.test)
    lines += ["<details><summary>Both full comparisons</summary>", ""]
    for out in (rev.test, rev.baseline):
        for label in dict.fromkeys(r.pin for r in out.rows):
            lines += _target_md(out.rows, label, base)
        said = kernel_lines(out)
        lines += [x.removeprefix("== ")[0].upper() + x.removeprefix("== ")[1:] + "." for x in said] + \
            ([""] if said else [])
    lines += ["</details>", "", f"<sub>{how[0].upper()}{how[1:]}.</sub>"]
    return "\n".join(lines)
