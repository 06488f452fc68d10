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
from refspec.conformance.compare import KERNEL_FIELDS, OTHER_FIELDS, PARTS

FIRST, LAST = "0.4.4.post2", "0.5.23"
PAGE_SIZES = (1, 4)  #: the sweep grid (every mode of the release at these page sizes)
TOPKS = (2,)
WORKER_TIMEOUT = 600  #: seconds one release's worker may take
BEGIN, END = "<!-- sweep:begin -->", "<!-- sweep:end -->"
DOC = os.path.join(conformance.REPO, "docs", "versions.md")
RESULTS = "sweep.json"  #: per-release results kept under <root>/sweep (a rerun of one release replaces its entry)
TREE_PART_FIELDS = tuple(rules.TREE_PART)


def fingerprint() -> str:
    """SHA-256 (16 hex digits) of what can change a cell: the sweep grid, every module of this
    package but this one and ``install`` (whose downloads and stamps cannot), and of ``install``
    the shape detection (its functions' source and the tables they read)."""
    import hashlib
    import inspect

    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(repr((PAGE_SIZES, TOPKS)).encode())
    for name in sorted(os.listdir(here)):
        if name.endswith(".py") and name not in ("sweep.py", "install.py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    for fn in (install.detect, install.methods, install._enum_members, install.toggles):
        h.update(inspect.getsource(fn).encode())
    h.update(repr((install.ADAPTERS, install.KERNEL_FILES, install.OWN_TREE_FILES, install.BASE_MODES,
                   install.TREE_MODES, install.Shape.__dataclass_fields__.keys())).encode())
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
    """The rules a compared row checks (every compared field's rule)."""
    fields = [*KERNEL_FIELDS, *OTHER_FIELDS]
    if row.mode.startswith("tree_"):
        fields = [f"{p}:{f}" for p in PARTS for f in fields]
        if own_tree and row.phase == "eager" and row.step in (None, 0):
            fields += [f"tree:{f}" for f in TREE_PART_FIELDS]
    out = {rules.rule_for(row.mode, row.phase, f) for f in fields}
    out |= {rules.rule_for(row.mode, row.phase, f, short_table=True) for f in fields if "page_table[live]" in f}
    return out


def measure(version: str, root: str, log=print) -> dict:
    """One release's entry: ``{"version", "shape", "status", "rules": {ID: cell}, "seconds"}``."""
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
        out = conformance.run([tgt], PAGE_SIZES, None, topks=TOPKS, log=log)
    except (RuntimeError, conformance.NoCases) as e:
        lines = [x for x in str(e).splitlines() if x.strip()]
        entry["status"] = "cannot drive: worker failed: " + (lines[-1] if lines else type(e).__name__)[:300]
        _drop(sroot, version, keep)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        return entry
    cov, bad, gaps, skip = set(), defaultdict(set), set(), set()
    for r in out.rows:
        cov |= covered(r, tgt.shape.own_tree)
        for f in r.findings:
            if f.rule == report.ADAPTER:  # refspec's adapter failed there: those rules are not measured
                gaps.add(f.theirs.split(":")[0] + ": " + f.theirs.rsplit(": ", 1)[-1][:120])
                cov -= covered(r, tgt.shape.own_tree)
                skip |= covered(r, tgt.shape.own_tree)
                continue
            bad[f.rule].add(f.field or "upstream error")
    cov -= skip
    entry["rules"] = {rid: ("differs: " + ", ".join(sorted(bad[rid]))) if rid in bad else "holds" for rid in cov}
    if gaps:
        entry["adapter"] = sorted(gaps)
    s = {k: sum(1 for r in out.rows if ok(r)) for k, ok in (("cases", lambda r: True), ("failing", lambda r: not r.ok))}
    entry["status"] = f"{s['cases']} cases, {s['failing']} failing"
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


def cell(text: str | None) -> str:
    if text is None:
        return "n/a"
    if text == "holds":
        return "holds"
    return text.replace("differs: ", "differs on ").replace("|", "\\|")


def table(entries: list[dict]) -> str:
    ids = sorted({rid for e in entries for rid in e["rules"]}, key=_rule_key)
    head = "| release | shape | result | " + " | ".join(ids) + " |"
    lines = [head, "|" + "---|" * (3 + len(ids))]
    for e in entries:
        if e["status"].startswith(("cannot drive", "not measured")):
            lines.append(f"| {e['version']} | {e['shape'] or ''} | {e['status'].replace('|', '/')} | "
                         + " | ".join("–" for _ in ids) + " |")
        else:
            note = f"; not driven: {'; '.join(e['adapter'])}" if e.get("adapter") else ""
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
        f"{', '.join(map(str, PAGE_SIZES))}, top-k {', '.join(map(str, TOPKS))} (tree modes); a cell is *holds* "
        f"(every compared field governed by that rule is equal, or differs only as documented), *differs on F*, or "
        f"*n/a* (no compared field of that release maps to the rule); a release it cannot drive says why.",
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
    (module doc), write the table into docs/versions.md; 0."""
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
    return 0
