"""Result rows and the printed table (mode x P x phase -> same / differs)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from refspec.conformance.compare import Diff
from refspec.conformance.known import BUGS, KNOWN, link, source


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
    bug: str | None = None  #: the known upstream bug (``known.BUGS`` key) this failing row shows

    @property
    def label(self) -> str:
        mode = f"{self.mode} {self.shape}" if self.mode.startswith("tree_") else self.mode  # shape: k2, k4, k8
        return mode if self.step is None else f"{mode} s={self.step}"

    @property
    def undocumented(self) -> list[Diff]:
        return [d for d in self.diffs if d.documented is None]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.undocumented


def _bug_tag(rows: list[Row]) -> str:
    """`` [RULE, upstream bug KEY]`` when every failing row of the cell is one known bug."""
    keys = {r.bug for r in rows if not r.ok}
    if len(keys) != 1 or None in keys:
        return ""
    b = next(x for x in BUGS if x.key in keys)
    return f" [{b.rule}, upstream bug {b.key}]"


def _cell(rows: list[Row]) -> str:
    if any(r.error for r in rows):
        return "ERROR" + _bug_tag(rows)
    bad = sorted({d.field for r in rows for d in r.undocumented})
    if bad:
        return "DIFFERS: " + ",".join(bad) + _bug_tag(rows)
    doc = sorted({d.documented for r in rows for d in r.diffs})
    return "same" + (f" (+{','.join(doc)})" if doc else "")


def table(rows: list[Row], pin: str, verbose: bool = False) -> str:
    """One line per (mode, step, P, phase), shapes merged; then every failure in full (and, with
    ``verbose``, every documented difference with both values)."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        if r.pin == pin:
            groups[(r.label, r.page_size, r.phase)].append(r)
    w = max([len(k[0]) for k in groups] + [4])
    lines = [f"{'mode':<{w}}  {'P':>3}  {'phase':<13} cases  result"]
    for (label, P, phase), rs in groups.items():
        lines.append(f"{label:<{w}}  {P:>3}  {phase:<13} {len(rs):>5}  {_cell(rs)}")
    for r in rows:
        if r.pin != pin or (r.ok and not (verbose and r.diffs)):
            continue
        where = f"{r.job} {r.phase}" + ("" if r.step is None else f" step {r.step}")
        if verbose:
            lines += [f"  documented {where}: {d.field}: refspec {d.ours} | upstream {d.theirs} ({d.documented})"
                      for d in r.diffs if d.documented]
        tag = ""
        if r.bug:
            b = next(x for x in BUGS if x.key == r.bug)
            tag = f" [{b.rule}{''.join(', ' + a for a in b.also)}: known upstream bug {b.key}]"
        if r.error:
            lines.append(f"  ERROR {where}: {r.error}{tag}")
        for d in r.undocumented:
            lines.append(f"  DIFFERS {where}: {d.field}: refspec {d.ours} | upstream {d.theirs} "
                         f"(upstream {source(r.pin, r.mode, r.phase, d.field)}){tag}")
    return "\n".join(lines)


def summary(rows: list[Row], pin: str) -> dict:
    mine = [r for r in rows if r.pin == pin]
    return {"cases": len(mine), "same": sum(not r.diffs and not r.error for r in mine),
            "documented": sum(bool(r.diffs) and r.ok for r in mine),
            "undocumented": sum(not r.ok for r in mine), "known_bug": sum(bool(r.bug) for r in mine)}


def bugs_table(keys: set[str]) -> str:
    """The known upstream bugs ``keys``: rule, status (fixed by / open PR), what, upstream lines."""
    lines = []
    for b in BUGS:
        if b.key not in keys:
            continue
        lines.append(f"  {b.key}: breaks {b.rule}" + (f" (also {', '.join(b.also)})" if b.also else "")
                     + f" at {', '.join(b.pins)}")
        lines.append(f"      {b.what}")
        lines.append(f"      status: {b.status}")
        for pin, f, line in b.upstream:
            lines.append(f"      upstream {pin} {f.split('/')[-1]}:{line}  {link(pin, f, line)}")
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
