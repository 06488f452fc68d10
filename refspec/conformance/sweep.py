"""``python -m refspec conformance --sweep``: every SGLang release with the FA3 backend, measured.

Lists the releases on the package index (``pip index versions sglang``) from
:data:`FIRST` (0.4.4.post2, the first with ``layers/attention/flashattention_backend.py``) to
:data:`LAST`, and for each one: installs it (``pip install --no-deps``, into
``<root>/sweep/sglang-<V>``, removed again after its row unless it is a pinned release), reads its
API shape (:func:`refspec.conformance.install.detect`), runs the comparison on the sweep grid
(:data:`PAGE_SIZES`, :data:`TOPKS`, every mode its shape has), and records for each rule
whether it holds, differs (on which fields), does not apply (no compared field of that code maps
to it), or why the release cannot be driven.  One worker at a time.

The table goes into ``docs/versions.md`` between :data:`BEGIN` and :data:`END`, with the command,
the date and the time it took.  Each release's entry is kept in ``<root>/sweep/sweep.json`` with
a fingerprint of the code that produced it (:func:`fingerprint`: the conformance package's
files and the sweep grid); a rerun reuses the entries whose fingerprint matches and measures the
rest, so a sweep stopped by its time bound resumes where it stopped.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict

from packaging.version import Version

from refspec.conformance import install, report, rules
from refspec.conformance import run as conformance
from refspec.conformance.compare import KERNEL_ARGS, KERNEL_FIELDS, OTHER_FIELDS, PARTS

FIRST, LAST = "0.4.4.post2", "0.5.23"
PAGE_SIZES = (1, 4)  #: the sweep grid (every mode of the release at these page sizes)
TOPKS = (2,)
#: the edge jobs' page sizes: the context wall (P = 16), the long tree chains (P = 2) and the small tree
#: batches (P = 1), where the known upstream bugs show (``known.BUGS``; the precision check needs them)
EDGES = (1, 2, 16)
WORKER_TIMEOUT = 600  #: seconds one release's worker may take
BEGIN, END = "<!-- sweep:begin -->", "<!-- sweep:end -->"
DOC = os.path.join(conformance.REPO, "docs", "versions.md")
RESULTS = "sweep.json"  #: per-release results kept under <root>/sweep (a rerun of one release replaces its entry)
TREE_PART_FIELDS = tuple(rules.TREE_PART)


def fingerprint() -> str:
    """SHA-256 (16 hex digits) of what can change a cell: the sweep grid and every module of this
    package but this one.  ``install`` is hashed whole: its shape detection calls helpers (the
    reachability guards, the accept-length and draft ``out_cache_loc`` layouts) whose change moves
    cells, and a list of them drifts (a reused entry would then be of other code)."""
    import hashlib

    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(repr((PAGE_SIZES, TOPKS, EDGES)).encode())
    for name in sorted(os.listdir(here)):
        if name.endswith(".py") and name != "sweep.py":
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def releases(first: str = FIRST, last: str = LAST) -> list[str]:
    """The sglang versions on the index in [first, last], oldest first (``pip index versions``)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True, text=True,
                          check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("Available versions:")), None)
    if line is None:
        raise RuntimeError(f"pip index versions sglang gave no version list:\n{proc.stderr[-1000:]}")
    vs = [v.strip() for v in line.split(":", 1)[1].split(",")]
    return sorted((v for v in vs if Version(first) <= Version(v) <= Version(last)), key=Version)


def covered(row, own_tree: bool) -> set[str]:
    """The rules a compared row checks (every compared field's rule, and where its forward's kernel
    call was compared, every kernel argument's: PA-004, PA-009, PA-011, PA-012, and PA-013 where a
    scheduler_metadata was checked)."""
    fields = [*KERNEL_FIELDS, *OTHER_FIELDS]
    if row.mode.startswith("tree_"):
        fields = [f"{p}:{f}" for p in PARTS for f in fields]
        if own_tree and row.phase == "eager" and row.step in (None, 0):
            fields += [f"tree:{f}" for f in TREE_PART_FIELDS]
    out = {rules.rule_for(row.mode, row.phase, f) for f in fields}
    out |= {rules.rule_for(row.mode, row.phase, f, short_table=True) for f in fields if "page_table[live]" in f}
    if getattr(row, "kernel_calls", 0):  # the kernel's own arguments were compared too
        out |= {rules.rule_for(row.mode, row.phase, f"kernel:{a}") for a in KERNEL_ARGS if a != "scheduler_metadata"}
        if row.sched_checked:
            out.add(rules.rule_for(row.mode, row.phase, "kernel:scheduler_metadata"))
    return out


def _cell() -> dict:
    return {"differs": {}, "compared": set(), "unreachable": set(), "gap": set()}


def cells(out, own_tree: bool) -> dict:
    """``{rule: cell}`` of one release's comparison: per rule the page sizes its compared rows cover
    (``compared``), the fields that differ and at which page sizes (``differs``), the page sizes of
    the jobs upstream's own code never runs (``unreachable``: its guards refuse the configuration,
    its runner never builds the batch) and of the results refspec could not drive (``gap``)."""
    from refspec.conformance.report import Row

    out_cells: dict = defaultdict(_cell)
    for r in out.rows:
        if r.gap and not r.broken:
            for rid in covered(r, own_tree):
                out_cells[rid]["gap"].add(r.page_size)
            continue
        for rid in covered(r, own_tree):
            out_cells[rid]["compared"].add(r.page_size)
        for f in r.findings:
            if f.rule != report.ADAPTER:
                out_cells[f.rule]["differs"].setdefault(f.field or "upstream error", set()).add(r.page_size)
    for label, _jid, _why, job in out.unreachable:
        phases = list(job.refspec) or [("capture", None), ("replay", None)]
        for phase, step in phases:
            for rid in covered(Row(label, job.id, job.mode, job.page_size, job.shape, phase, step), own_tree):
                out_cells[rid]["unreachable"].add(job.page_size)
    return {rid: {"differs": {f: sorted(P) for f, P in c["differs"].items()},
                  **{k: sorted(c[k]) for k in ("compared", "unreachable", "gap")}}
            for rid, c in out_cells.items()}


def measure(version: str, root: str, log=print) -> dict:
    """One release's entry: ``{"version", "shape", "status", "rules": {ID: cell}, "seconds"}`` (:func:`cells`)."""
    t0 = time.perf_counter()
    entry = {"version": version, "rules": {}, "shape": None}
    sroot = os.path.join(root, "sweep")
    keep = version in install.PINS
    try:
        tgt = install.resolve(version, root, log=log, releases_root=None if keep else sroot)
    except (install.UnsupportedSpec, RuntimeError) as e:
        msg = str(e).splitlines()[0]
        entry["status"] = "cannot drive: " + msg.split(": cannot drive this API shape: ")[-1]
        site = os.path.join(sroot, f"sglang-{version}")
        entry["shape"] = _shape_text(install.detect(site)) if os.path.isdir(site) else None
        _drop(sroot, version, keep)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        return entry
    entry["shape"] = _shape_text(tgt.shape)
    try:
        conformance.WORKER_TIMEOUT = WORKER_TIMEOUT
        out = conformance.run([tgt], PAGE_SIZES, None, topks=TOPKS, log=log, edges=EDGES)
    except (RuntimeError, conformance.NoCases) as e:
        lines = [x for x in str(e).splitlines() if x.strip()]
        entry["status"] = "cannot drive: worker failed: " + (lines[-1] if lines else type(e).__name__)[:300]
        _drop(sroot, version, keep)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        return entry
    entry["rules"] = cells(out, tgt.shape.own_tree)
    gaps = sorted({" ".join(r.gap.split(": ", 1)[-1].split())[:140] for r in out.rows if r.gap})
    if gaps:
        entry["adapter"] = gaps
    failing = [r for r in out.rows if r.broken]
    bugs = sorted({r.bug for r in failing if r.bug})
    entry["status"] = (f"{len(out.rows)} cases, {len(failing)} failing"
                       + (f" ({', '.join(bugs)})" if bugs else "")
                       + (f", {len(out.unreachable)} jobs not reachable upstream" if out.unreachable else "")
                       + (f", {sum(bool(r.gap) for r in out.rows)} adapter gaps" if gaps else ""))
    _drop(sroot, version, keep)
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    return entry


def _drop(sroot: str, version: str, keep: bool) -> None:
    d = os.path.join(sroot, f"sglang-{version}")
    if not keep and os.path.exists(os.path.join(d, install.STAMP)):
        shutil.rmtree(d)


def _shape_text(s: install.Shape) -> str:
    if s.hooks is None:
        return "no graph hooks" if s.missing and "FlashAttentionBackend" in s.missing else "no FA3 backend"
    bits = [f"{s.hooks} hooks"]
    bits.append("v1+v2" if s.draft_extend_v1 and s.draft_extend_v2 else "v1" if s.draft_extend_v1 else
                "v2" if s.draft_extend_v2 else "no draft extend")
    if s.topk:
        bits.append("top-k")
    if s.kernels and s.kernels != install.FA:
        bits.append(s.kernels.split("/")[-3] + "/…/metadata.py")
    elif s.kernels:
        bits.append("Triton replay")
    if s.staged:
        bits.append("staged")
    if s.toggles:
        bits.append(f"{len(s.toggles)} fix toggles")
    return ", ".join(bits)


def _ps(P) -> str:
    return ", ".join(map(str, P))


def cell(c: dict | None) -> str:
    """One table cell (:func:`cells`): *differs on F (P = ..)*, *holds*, *not reachable upstream*,
    *adapter gap* or *n/a*, with the page sizes where another status holds for part of the grid."""
    if not c:
        return "n/a"
    differs = c.get("differs") or {}
    compared, unreachable, gap = (set(c.get(k, ())) for k in ("compared", "unreachable", "gap"))
    if differs:
        at = sorted({P for Ps in differs.values() for P in Ps})
        text = f"differs on {', '.join(sorted(differs))} (P = {_ps(at)})"
    elif compared:
        text = "holds"
    elif unreachable:
        return "not reachable upstream"
    elif gap:
        return "adapter gap"
    else:
        return "n/a"
    rest = sorted(unreachable - compared)
    if rest:
        text += f"; not reachable upstream at P = {_ps(rest)}"
    if gap:
        text += f"; adapter gap at P = {_ps(sorted(gap))}"
    return text.replace("|", "\\|")


def table(entries: list[dict]) -> str:
    ids = sorted({rid for e in entries for rid in e["rules"]}, key=_rule_key)
    head = "| release | shape | result | " + " | ".join(ids) + " |"
    lines = [head, "|" + "---|" * (3 + len(ids))]
    for e in entries:
        if e["status"].startswith(("cannot drive", "not measured")):
            lines.append(f"| {e['version']} | {e['shape'] or ''} | {e['status'].replace('|', '/')} | "
                         + " | ".join("–" for _ in ids) + " |")
        else:
            note = f"; adapter gap: {'; '.join(e['adapter'])}" if e.get("adapter") else ""
            lines.append(f"| {e['version']} | {e['shape']} | {e['status']}{note.replace('|', '/')} | "
                         + " | ".join(cell(e["rules"].get(rid)) for rid in ids) + " |")
    return "\n".join(lines)


def _rule_key(rid: str):
    fam, _, n = rid.partition("-")
    return ({"PA": 0, "MD": 1, "CG": 2, "TR": 3}.get(fam, 9), int(n))


def write_doc(entries: list[dict], command: str, wall_s: float, path: str = DOC) -> None:
    """Replace the part of ``path`` between the sweep markers (appended at the end if absent)."""
    with open(path) as f:
        text = f.read()
    n = len(entries)
    driven = sum(1 for e in entries if not e["status"].startswith(("cannot drive", "not measured")))
    pending = sum(1 for e in entries if e["status"].startswith("not measured"))
    date = datetime.date.today().isoformat()
    body = "\n".join([
        BEGIN,
        f"Generated by `{command}` (`make sweep`) on {date}: {n} releases, {driven} driven"
        f"{f', {pending} not measured yet (the run stopped at its time bound; a rerun resumes)' if pending else ''}, "
        f"{wall_s / 60:.0f} min of measuring (the releases' worker times summed) on 2 shared cores. Grid per "
        f"release: every "
        f"mode its API shape has, page sizes "
        f"{', '.join(map(str, PAGE_SIZES))}, top-k {', '.join(map(str, TOPKS))} (tree modes), and the edge cases "
        f"where the known upstream bugs show (the context wall at P = 16, long tree chains at P = 2, small tree "
        f"batches at P = 1); a cell is *holds* (every compared field governed by that rule is equal, or differs "
        f"only as documented or where the FA3 kernel does not read it), *differs on F (P = ..)*, *not reachable "
        f"upstream* (the release's own guards refuse or rewrite those configurations, or its runner never builds "
        f"them: nothing to compare), *adapter gap* (no rule broken; refspec cannot drive that code yet) or *n/a* "
        f"(no compared field of that release maps to the rule), with the page sizes where another status holds; "
        f"a release it cannot drive says why.",
        "",
        table(entries),
        END])
    if BEGIN in text and END in text:
        i, j = text.index(BEGIN), text.index(END) + len(END)
        text = text[:i] + body + text[j:]
    else:
        text = text.rstrip("\n") + "\n\n## Measured release history\n\n" + body + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(root: str | None = None, argv=None, versions: list[str] | None = None, log=print) -> int:
    """Measure every release (or ``versions``), reusing the stored entries of the same code
    (module doc), write the table into docs/versions.md; 0, or 1 when the table gets a known answer
    wrong (:func:`precision`, each printed)."""
    root = root or install.default_root()
    os.makedirs(os.path.join(root, "sweep"), exist_ok=True)
    store = os.path.join(root, "sweep", RESULTS)
    fp = fingerprint()
    old = {}
    if os.path.exists(store):
        with open(store) as f:
            old = {e["version"]: e for e in json.load(f) if e.get("fingerprint") == fp}
    vs = versions or releases()
    entries = []
    for v in vs:
        e = old.get(v)
        if e is None:
            e = dict(measure(v, root, log=lambda *_: None), fingerprint=fp)
            log(f"{v}: {e['status']} ({e['seconds']} s)")
        entries.append(e)
        with open(store, "w") as f:
            seen = {x["version"] for x in entries}  # keep every stored entry not measured again yet
            json.dump(entries + [x for k, x in old.items() if k not in seen], f, indent=1)
        sys.stdout.flush()
    spent = sum(e["seconds"] for e in entries)
    write_doc(entries, "python -m refspec conformance --sweep", spent)
    log(f"wrote {DOC} ({len(entries)} releases, {spent / 60:.1f} min of measuring)")
    problems = precision(entries)
    for p in problems:
        log(f"precision check: {p}")
    log("precision check: every known answer holds" if not problems else
        f"precision check: {len(problems)} known answers the table gets wrong")
    return 1 if problems else 0


# -- the precision check: the sweep against the releases whose answer is known --

#: top-k > 1 rules the page-size guards of older releases make unreachable at P > 1
TREE_RULES = ("TR-013", "TR-014", "TR-018")
#: (first, last) release ranges and what their tree cells must say at P > 1 (issue 39): ServerArgs rewrites
#: top-k to 1 (0.4.5.post3 .. 0.4.8) or refuses it for FA3 (0.5.2 .. 0.5.5.post3): not reachable upstream;
#: 0.4.9 .. 0.5.1.post3 has no guard, and the branch slots handed to the kernel as page ids are the real
#: defect sglang#7725 fixed: it must still show
GUARDED = (("0.4.5.post3", "0.4.8"), ("0.5.2", "0.5.5.post3"))
UNGUARDED = ("0.4.9", "0.5.1.post3")


def _in(version: str, lo: str, hi: str) -> bool:
    return Version(lo) <= Version(version) <= Version(hi)


def _differs_at(c: dict | None, big: bool) -> set:
    """The page sizes where cell ``c`` differs (only those > 1 when ``big``)."""
    return {P for Ps in ((c or {}).get("differs") or {}).values() for P in Ps if P > 1 or not big}


def precision(entries: list[dict]) -> list[str]:
    """What the sweep gets wrong about releases whose answer is known (issue 39 item 5): [] when none.

    * 0.4.5.post3 .. 0.4.8 and 0.5.2 .. 0.5.5.post3: TR-013 / TR-014 / TR-018 never differ at P > 1
      and are not reachable upstream there;
    * 0.4.9 .. 0.5.1.post3: the real pre-#7725 defect still shows (TR-013 or TR-014 differs at P > 1);
    * 0.4.7 (the bs >= 2 draft expand defect, sglang#7239) differs on TR-014 at P = 1; 0.4.7.post1 has
      no tree rule that differs;
    * 0.5.10.post1 and 0.5.11 (accept_length renamed num_accepted_tokens, sglang#23962): CG-003 holds,
      no adapter gap; 0.5.4.post2: no CG-004 difference (its runner captures the draft extend as v1);
    * every known upstream bug (``known.BUGS``) reproduced at a release: that release's cell of the
      bug's rule differs."""
    from refspec.conformance import known

    by = {e["version"]: e for e in entries if e.get("rules")}
    out = []

    def rule(v: str, rid: str):
        return by[v]["rules"].get(rid) if v in by else None

    for v in by:
        for rid in TREE_RULES:
            c = rule(v, rid)
            if c and any(_in(v, lo, hi) for lo, hi in GUARDED):
                if _differs_at(c, True):
                    out.append(f"{v} {rid}: differs at P = {_ps(sorted(_differs_at(c, True)))}, where its own guards "
                               f"refuse top-k > 1 (expected: not reachable upstream)")
                if not [P for P in c.get("unreachable", ()) if P > 1]:
                    out.append(f"{v} {rid}: P > 1 is not said to be not reachable upstream ({cell(c)})")
        if _in(v, *UNGUARDED) and not any(_differs_at(rule(v, r), True) for r in ("TR-013", "TR-014")):
            out.append(f"{v}: the pre-#7725 tree defect (TR-013 / TR-014 at P > 1) no longer shows")
    if "0.4.7" in by and 1 not in _differs_at(rule("0.4.7", "TR-014"), False):
        out.append(f"0.4.7 TR-014: the bs >= 2 draft expand defect (sglang#7239) does not show at P = 1 "
                   f"({cell(rule('0.4.7', 'TR-014'))})")
    if "0.4.7.post1" in by:
        out += [f"0.4.7.post1 {rid}: differs ({cell(rule('0.4.7.post1', rid))}); the release has no tree defect"
                for rid in by["0.4.7.post1"]["rules"] if rid.startswith("TR-") and _differs_at(rule("0.4.7.post1", rid),
                                                                                                False)]
    for v in ("0.5.10.post1", "0.5.11"):
        c = rule(v, "CG-003")
        if v in by and (not c or c.get("differs") or c.get("gap")):
            out.append(f"{v} CG-003: {cell(c)} (expected: holds, with the release's own accept-length fields)")
    if "0.5.4.post2" in by and (rule("0.5.4.post2", "CG-004") or {}).get("differs"):
        out.append(f"0.5.4.post2 CG-004: {cell(rule('0.5.4.post2', 'CG-004'))} (its DRAFT_EXTEND_V2 graphs are "
                   f"never captured: expected no difference)")
    for b in known.BUGS:
        for v in b.pins:
            if v in by and not _differs_at(rule(v, b.rule), False):
                out.append(f"{v} {b.rule}: the known upstream bug {b.key} does not show ({cell(rule(v, b.rule))})")
    return out
