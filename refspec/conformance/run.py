"""Orchestration: resolve the targets, build the jobs, run upstream in a worker, compare, report.

:func:`run` is the API (the CLI and the tests call it); it returns :class:`Outcome` whose
``ok`` is False on any undocumented difference or upstream error.  Each target's modes, its
staged draft-extend replay and whether upstream builds its own verify tree come from its
:class:`~refspec.conformance.install.Shape` (read from the code), never from a version string.
A selection that compares nothing for a target (a mode it lacks, a page size or top-k no case
of it uses) raises :class:`NoCases`.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from refspec.conformance import cases, install, known, lines, mla_forward, names, report, rules, tree_cases
from refspec.conformance.compare import (KERNEL_ALIASES, SCHED_KEY, UNREAD, Diff, compare, compare_parts,
                                         kernel_diffs, unread_by)
from refspec.conformance.report import mirror_lines, unreachable_lines

WORKER_TIMEOUT: float | None = None  #: seconds a worker may run (None: no limit; the sweep sets one)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variant(name: str | None):
    """The one place that applies a refspec bug variant (refspec's side only; a negative control).

    Returns a context manager; ``None`` -> no variant.  Raises KeyError for an unknown name.
    A name of :data:`refspec.mutants.tree_variants.TREE_VARIANTS` applies that top-k > 1 variant.
    """
    if name is None:
        return nullcontext()
    from refspec.mutants import tree_variants, variants

    if name in tree_variants.TREE_VARIANTS:
        return tree_variants.apply_variant(name)
    return variants.enabled(name)


class NoCases(ValueError):
    """The selection compares nothing (or asks for a mode / page size / top-k a target has no case of)."""


#: the documented differences (:data:`refspec.conformance.known.KNOWN`) were established per adapter
#: on the release it was written against; other code driven by that adapter is matched against them
KNOWN_AS = {"graph": install.PINS[0], "legacy": install.PINS[1]}


def known_as(target) -> str:
    """The pin whose documented differences apply to ``target`` (a Target, or a pin string)."""
    return target if isinstance(target, str) else KNOWN_AS[target.shape.hooks]


def _label(target) -> str:
    return target if isinstance(target, str) else target.label


def _own_tree(target) -> bool:
    return target == install.PINS[0] if isinstance(target, str) else target.shape.own_tree


@dataclass
class Outcome:
    rows: list[report.Row]
    info: dict  #: target label -> worker info (import / run seconds, interpreter check, ...)
    seconds: dict  #: install / per-target timings
    targets: dict = field(default_factory=dict)  #: label -> install.Target
    #: (target label, job id, why, job) of the jobs not compared: upstream's own code never builds that batch
    #: (its runner, or its guards refusing or rewriting the configuration)
    unreachable: list = field(default_factory=list)
    #: target label -> {mode: why} of the requested modes (``--modes``) that target does not compare: a group's
    #: (``--modes mla``) modes it lacks, and with several targets any it lacks (each takes its own subset)
    skipped: dict = field(default_factory=dict)
    variant: str | None = None  #: the refspec bug variant switched on (a negative control: the defect is refspec's)

    @property
    def ok(self) -> bool:
        """Every row agrees (or differs only as documented): False on a known upstream bug, and on an
        adapter gap, too."""
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[report.Row]:
        """Rows that break a rule (a known upstream bug's included: item 6 of issue 39)."""
        return [r for r in self.rows if r.broken]

    @property
    def unexplained(self) -> list[report.Row]:
        """Failing rows that no known upstream bug (:data:`known.BUGS`) explains."""
        return [r for r in self.rows if r.broken and r.bug is None]

    @property
    def gaps(self) -> list[report.Row]:
        """Rows refspec's adapter could not drive, in whole or in their kernel part (no rule broken)."""
        return [r for r in self.rows if r.gap]

    def bugs(self) -> set[str]:
        """The known upstream bugs (:data:`known.BUGS` keys) that rows showed."""
        return {b for r in self.rows for b in (r.bug, *r.also) if b}

    def failing_fields(self) -> set[str]:
        return {d.field for r in self.rows for d in r.undocumented} | ({"ERROR"} if any(r.error for r in self.rows)
                                                                        else set())


def run_worker(target: install.Target, jobs: list[cases.Job]) -> tuple[dict, dict]:
    """Run upstream ``target`` on ``jobs`` in a subprocess; ``(results by job id, worker info)``.

    The worker runs with ``TRITON_INTERPRET=1`` (Triton kernels in the interpreter) and
    ``TORCHDYNAMO_DISABLE=1`` (upstream's ``@torch.compile`` functions, e.g.
    ``draft_decode_set_expand_metadata``, run as the plain PyTorch they are written in), and
    ``PYTHONDONTWRITEBYTECODE=1`` (nothing is written into a source tree used in place).

    Raises: RuntimeError with the worker's stderr if it fails as a whole (import error, ...).
    """
    with tempfile.TemporaryDirectory(prefix="refspec-conformance-") as tmp:
        jobs_path, out_path = os.path.join(tmp, "jobs.pt"), os.path.join(tmp, "out.pt")
        torch.save([(j.id, dict(j.inputs, mode=j.mode)) for j in jobs], jobs_path)
        env = dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1", PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join([*target.paths, REPO]), PYTHONWARNINGS="ignore",
                   REFSPEC_SHAPE=target.shape.to_json(), REFSPEC_REVERT_FIX=target.revert_fix or "")
        try:
            proc = subprocess.run([sys.executable, "-m", "refspec.conformance.worker", target.label, jobs_path,
                                   out_path], env=env, capture_output=True, text=True, cwd=REPO, check=False,
                                  timeout=WORKER_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"conformance worker for sglang {target.label} ran past {WORKER_TIMEOUT} s") from None
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"conformance worker for sglang {target.label} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        out = torch.load(out_path, weights_only=False)
    return out["results"], out["info"]


def rows_for(target, jobs: list[cases.Job], results: dict) -> list[report.Row]:
    """Compare every (job, phase, step) of ``jobs`` with upstream's ``results`` (``target``: an
    :class:`install.Target`, or a pinned release's version string): the metadata fields, and where
    both sides ran the forward, the kernel calls (:func:`compare.kernel_diffs`).  A field the FA3
    call does not read is reported, never a failure (:data:`compare.UNREAD`).  An adapter gap
    (:func:`report.is_gap`) is the row's ``gap``, not an error."""
    rows = []
    pin, label = known_as(target), _label(target)
    for j in jobs:
        theirs = results.get(j.id, "no result from the worker")
        if unreachable_why(theirs):  # the release's own guards refuse this configuration: no row (Outcome.unreachable)
            continue
        sched = theirs.get(SCHED_KEY) if isinstance(theirs, dict) else None
        for (phase, step), ours in j.refspec.items():
            row = report.Row(label, j.id, j.mode, j.page_size, j.shape, phase, step, topk=j.inputs.get("topk", 1),
                             num_steps=j.inputs.get("num_steps"), batch=_batch(j, phase))
            got = theirs.get((phase, step)) if isinstance(theirs, dict) else None
            if got is None or isinstance(got, str):  # a phase's own upstream error is its result
                missing = theirs if isinstance(theirs, str) else f"upstream gave no {phase} step {step} result"
                text = got or missing
                if report.is_gap(text):
                    row.gap = text
                else:
                    row.error = text
            else:
                mla = mla_forward.is_mla(j.mode)
                if mla:  # the MLA forward path: metadata, kernel calls, output, store (mla_forward.diffs)
                    raw = mla_forward.diffs(j, phase, ours, got, _batch(j, phase))
                    row.kernel_calls = sum(c["name"].startswith("flash_attn") for c in got.get(cases.KERNEL) or ()
                                           if isinstance(c, dict))
                elif "prefix" in ours:  # top-k > 1: the verify expand table holds slots (page size 1)
                    if not _own_tree(target):
                        ours = {part: v for part, v in ours.items() if part != "tree"}
                    B, k, N = _batch(j, "eager"), j.inputs.get("topk", 1), j.inputs.get("num_draft_tokens", 1)
                    real = None if B is None else {"prefix": B, "expand": B * N} if j.mode == "tree_verify" else \
                        {"prefix": B * k, "expand": B * k}
                    raw = compare_parts(ours, got, j.page_size, 1 if j.mode == "tree_verify" else j.page_size, real)
                else:
                    raw = compare(ours, got, j.page_size, real=_batch(j, "eager"))
                handed: set[str] = set()
                if not mla:  # (mla_forward.diffs compares the MLA calls' arguments itself)
                    handed = _handed_right(ours.get(cases.KERNEL), got.get(cases.KERNEL), j.page_size, sched)
                    raw += _kernel(row, ours.get(cases.KERNEL), got.get(cases.KERNEL), raw, j.page_size, sched)
                calls = got.get(cases.KERNEL)
                if isinstance(calls, list):
                    calls = [c for c in calls if c["name"].startswith("flash_attn")]
                for d in raw:
                    k = known.match(pin, mla_forward.base_mode(j.mode), phase, d.field, d)
                    if k is None and (unread_by(calls, d.field) or d.field in handed):
                        d = replace(d, documented=UNREAD)
                    row.diffs.append(d if k is None else replace(d, documented=k.key))
            report.find(row, target if not isinstance(target, str) else None,
                        got.get(lines.EXECUTED) if isinstance(got, dict) else None)
            mla_forward.attribute(row)  # an MLA output difference named by its cause (mla:slot0, a table, ...)
            if row.broken:  # a known upstream bug (by its signature, or at its pins): its rule names the row
                b = known.bug(label, j.mode, phase, [d.field for d in row.undocumented], row.error,
                              known.below_bound(row.undocumented))
                cover = known.cover(label, j.mode, phase, row.undocumented) if b is None and \
                    mla_forward.is_mla(j.mode) and row.error is None else None
                if cover:  # an MLA result showing two known bugs (each field is one's): each finding names its own
                    keys = list(dict.fromkeys(c.key for _, c in cover))
                    row.bug, row.also = keys[0], tuple(keys[1:])
                    by = {f: c for f, c in cover}
                    row.findings = [f if f.rule == report.ADAPTER or f.field not in by else
                                    replace(f, rule=by[f.field].rule, level=rules.level(by[f.field].rule))
                                    for f in row.findings]
                elif b is not None:
                    row.bug = b.key
                    row.findings = [f if f.rule == report.ADAPTER else
                                    replace(f, rule=b.rule, level=rules.level(b.rule)) for f in row.findings]
                else:
                    like = known.resembles(label, j.mode, phase, [d.field for d in row.undocumented], row.error,
                                           known.below_bound(row.undocumented))
                    row.like = like.key if like is not None else None
            rows.append(row)
    return rows


#: the key of a job's upstream result when the release's own guards refuse or rewrite its configuration
#: (``upstream_common.UNREACHABLE``, :mod:`refspec.conformance.reach`)
UNREACHABLE = "unreachable"


def unreachable_why(result) -> str | None:
    """Why the release's own code never runs a job (its result's :data:`UNREACHABLE` text), or None."""
    return result.get(UNREACHABLE) if isinstance(result, dict) else None


def _batch(j: cases.Job, phase: str) -> int | None:
    """The requests in the batch ``phase`` hands the backend: the live batch eager, the graph's (padded) at capture
    and replay."""
    if phase != "eager" and "bs" in j.inputs:
        return int(j.inputs["bs"])
    d = j.inputs.get("eager")
    return int(d["req_pool_indices"].numel()) if d is not None else None


def _handed_right(ours, theirs, page_size: int, sched) -> set[str]:
    """The kernel-read metadata fields whose value the kernel does not take from the metadata: where
    both sides' calls were recorded and the call upstream made agrees with refspec's on the argument
    read from that field (``max_seqlen_q=1`` passed as a literal while the metadata holds 0, 0.4.x's
    decode), the field's own difference is not what the kernel reads (reported, not a failure)."""
    if not isinstance(ours, list) or not isinstance(theirs, list):
        return set()
    if [c["name"] for c in ours if c["name"].startswith("flash_attn")] != \
            [c["name"] for c in theirs if c["name"].startswith("flash_attn")]:
        return set()
    differ = {d.field.removeprefix("kernel:") for d in kernel_diffs(ours, theirs, page_size, sched)}
    return {field for arg, field in KERNEL_ALIASES.items() if arg not in differ}


def _kernel(row: report.Row, ours, theirs, metadata: list, page_size: int, sched) -> list:
    """The ``kernel:`` diffs of one result (:func:`compare.kernel_diffs`), without those that only
    repeat a metadata field's difference (the same values: the metadata finding cites the line
    that wrote them); a forward that raised is one ``kernel:calls`` diff (upstream's exception) or
    the row's adapter gap.  None on either side: no forward ran (not compared)."""
    if ours is None or theirs is None:
        return []
    if isinstance(theirs, str):
        if report.is_gap(theirs):
            row.gap = row.gap or theirs
            return []
        return [Diff("kernel:calls", "the kernel call", f"upstream's forward raised: {theirs}")]
    seen = {(d.field, d.ours, d.theirs) for d in metadata}
    out = []
    row.kernel_calls = sum(c["name"].startswith("flash_attn") for c in theirs)
    row.sched_checked = sum(c["name"].startswith("flash_attn") and c["args"].get("scheduler_metadata") is not None
                            for c in theirs)
    differing = {d.field for d in metadata}
    for d in kernel_diffs(ours, theirs, page_size, sched):
        field = KERNEL_ALIASES.get(d.field.removeprefix("kernel:"))
        if field is not None and (field, d.ours, d.theirs) in seen:
            continue
        if field is not None and field != "max_seq_len_q" and field not in differing and \
                row.phase in rules.GRAPH_PHASES:
            d = replace(d, stale=True)  # the metadata is right, the captured buffer the graph reads is not
        out.append(d)
    return out


def digest(inputs: dict) -> str:
    """SHA-256 of a job's inputs (every tensor's bytes, dtype and shape; every list and scalar)."""
    buf = io.BytesIO()
    torch.save(inputs, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _upstream(target: install.Target, jobs: list[cases.Job], cache: dict | None) -> tuple[dict, dict]:
    """Upstream's results for ``jobs``; with ``cache``, a job whose inputs are byte-identical to
    one already run on ``target`` reuses that result (upstream sees only the inputs); ``info`` is
    then the last worker's for that target, plus ``reused`` (how many jobs did not run again)."""
    if cache is None:
        return run_worker(target, jobs)
    pin = (target.site, target.revert_fix)
    keys = {j.id: (pin, digest(dict(j.inputs, mode=j.mode))) for j in jobs}
    todo = [j for j in jobs if keys[j.id] not in cache]
    info = dict(cache.get(("worker info", pin), {}), reused=len(jobs) - len(todo))
    if todo:
        results, fresh = run_worker(target, todo)
        cache[("worker info", pin)] = fresh
        info.update(fresh)
        cache.update({keys[j.id]: results[j.id] for j in todo if j.id in results})
    return {j.id: cache[keys[j.id]] for j in jobs if keys[j.id] in cache}, info


def targets(sglang, root: str | None = None, log=print, revert_fix: str | None = None) -> list[install.Target]:
    """Resolve SPEC strings (or :class:`install.Target` objects, kept as they are)."""
    return [t if isinstance(t, install.Target) else install.resolve(t, root, log, revert_fix) for t in sglang]


def select(target: install.Target, page_sizes, modes, topks, variant: str | None = None,
           edges=None, mla_grid: str = "default", several: bool = False) -> list[cases.Job]:
    """The jobs of ``target``'s modes (restricted to ``modes`` if given) at ``page_sizes`` / ``topks``,
    and the edge jobs (the context wall, long chains, small tree batches) at ``edges`` (default:
    ``page_sizes``; the sweep adds the edges where the known upstream bugs show to a smaller grid).
    The MLA modes (``mla_*``, :mod:`refspec.conformance.mla_forward`) are the target's modes through
    the MLA forward path, on ``mla_grid`` (:func:`mla_forward.grid`: ``default``, ``full``, ``off``).
    ``modes`` may hold groups (``mla``: :data:`names.GROUPS`); which of them ``target`` takes:
    :func:`wanted` (``several``: one of several targets, which takes its own subset).

    Raises: NoCases naming what was asked for and what the code has, when a given mode is not
    compared on this code (:func:`wanted`), or a page size / top-k yields no case, or nothing is
    selected at all.
    """
    have = (*target.shape.modes, *mla_forward.modes_for(target))
    modes = wanted(target, modes, several)[0]
    pm = [m for m in have if (modes is None and (mla_grid != "off" or not mla_forward.is_mla(m))) or
          (modes is not None and m in modes)]
    jobs = _jobs(target, page_sizes, pm, topks, variant, edges) + _mla_jobs(page_sizes, pm, variant, mla_grid)
    if not jobs:
        raise NoCases(f"sglang {target.label}: no case compares modes {', '.join(pm)} at page sizes "
                      f"{', '.join(map(str, page_sizes))} (tree modes: page sizes "
                      f"{', '.join(map(str, tree_cases.PAGE_SIZES))})")
    empty = [m for m in (modes or ()) if m not in {j.mode for j in jobs}]
    if empty:
        raise NoCases(f"sglang {target.label}: mode {', '.join(empty)} has no case at page sizes "
                      f"{', '.join(map(str, page_sizes))} (tree modes compare page sizes "
                      f"{', '.join(map(str, tree_cases.PAGE_SIZES))})")
    unused = [P for P in page_sizes if P not in {j.page_size for j in jobs}]
    if unused and not all(mla_forward.is_mla(m) for m in pm):  # (the MLA grid is its own: mla_forward.grid)
        raise NoCases(f"sglang {target.label}: page size {', '.join(map(str, unused))} has no case in modes "
                      f"{', '.join(pm)} (tree modes compare page sizes {', '.join(map(str, tree_cases.PAGE_SIZES))})")
    if any(m in tree_cases.MODES for m in pm):
        used = {j.shape for j in jobs if j.mode in tree_cases.MODES}
        unused = [k for k in topks if f"k{k}" not in used]
        if unused:
            raise NoCases(f"sglang {target.label}: top-k {', '.join(map(str, unused))} has no tree case at page "
                          f"sizes {', '.join(map(str, page_sizes))} (top-k values: "
                          f"{', '.join(map(str, tree_cases.TOPKS))})")
    return jobs


def wanted(target: install.Target, modes, several: bool = False) -> tuple[list[str] | None, dict[str, str]]:
    """``(the modes target compares, {mode: why} of the requested ones it skips)`` for ``--modes``
    ``modes`` (None: every mode it has, nothing skipped).  A group (``mla``, :data:`names.GROUPS`)
    stands for those of its modes the code has; a mode named outright that the code lacks is a
    usage error on one target, and skipped (said) when ``several`` targets each take their own
    subset of the requested modes.

    Raises: NoCases naming the code, the lacking modes and why (:func:`_why_not`) when a mode named
    outright is lacking on one target, or when the target takes none of the requested modes."""
    if modes is None:
        return None, {}
    have = (*target.shape.modes, *mla_forward.modes_for(target))
    named = {m for m in modes if m not in names.GROUPS}
    take, skip, lack = [], {}, []
    for m in names.expand(modes):
        if m in have:
            take.append(m)
        elif several or m not in named:
            skip[m] = _why_not(target, [mla_forward.base_mode(m)]).lstrip("; ") or "not among its modes"
        else:
            lack.append(m)
    if lack:
        raise NoCases(f"sglang {target.label} is not compared on {', '.join(lack)} (its modes: {', '.join(have)}"
                      f"{_why_not(target, [mla_forward.base_mode(m) for m in lack])})")
    if not take:
        raise NoCases(f"sglang {target.label} compares none of the requested modes {', '.join(modes)} (its modes: "
                      f"{', '.join(have)}{_why_not(target, [mla_forward.base_mode(m) for m in skip])})")
    return take, skip


def _mla_jobs(page_sizes, modes, variant: str | None = None, mla_grid: str = "default") -> list[cases.Job]:
    """The MLA jobs (:mod:`refspec.conformance.mla_forward`) of the ``mla_*`` modes among ``modes`` on
    ``mla_grid`` (its page sizes among ``page_sizes``), refspec's side under ``variant``."""
    mla = tuple(m for m in modes if mla_forward.is_mla(m))
    if not mla or mla_grid == "off":
        return []
    with _variant(variant):
        return mla_forward.build_jobs(*mla_forward.grid(mla_grid, page_sizes), modes=mla)


def _jobs(target: install.Target, page_sizes, modes, topks, variant: str | None = None,
          edges=None) -> list[cases.Job]:
    """The jobs of ``modes`` (all of them modes of ``target``) at ``page_sizes`` / ``topks`` (the edge
    jobs at ``edges``, default ``page_sizes``), with ``target``'s staged draft-extend replay where its
    shape has one; no guard (:func:`select` has them).  (The ``mla_*`` modes: :func:`_mla_jobs`.)"""
    edges = page_sizes if edges is None else edges
    with _variant(variant):
        flat, tree = [m for m in modes if m in cases.MODES], [m for m in modes if m in tree_cases.MODES]
        jobs = cases.build_jobs(flat, page_sizes, staged=target.shape.staged)
        jobs += cases.edge_jobs(flat, edges, staged=target.shape.staged)
        if not target.shape.cpu_mirrors:  # upstream's worker publishes no seq_lens_cpu here
            jobs += cases.without_mirrors(jobs)
        cases.mark_unreachable(jobs, target.shape.idle_unreachable)
        jobs = cases.mark_graph_unreachable(jobs, target.shape.draft_extend_graph_unreachable)
        jobs += tree_cases.build_jobs(tree, page_sizes, topks)
        jobs += tree_cases.edge_jobs(tree, edges, topks)
    return jobs


def _why_not(target: install.Target, lack: list[str]) -> str:
    s, why = target.shape, []
    if s.no_draft_decode and any(m in ("draft_decode", "tree_draft_decode") for m in lack):
        why.append(s.no_draft_decode)
    if "draft_extend" in lack and not s.draft_extend_v1:
        why.append("ForwardMode has no DRAFT_EXTEND (v1)")
    if "draft_extend_v2" in lack and not s.draft_extend_v2:
        why.append("ForwardMode has no DRAFT_EXTEND_V2")
    if "idle" in lack and s.hooks == "legacy":
        why.append("the legacy-hooks releases build no metadata for an empty batch")
    if any(m in tree_cases.MODES for m in lack):
        why.append("no top-k > 1 path" if not s.topk else
                   f"upstream's own tree builder is missing ({s.tree_missing or ', '.join(install.OWN_TREE_FILES)})")
    return "; " + "; ".join(why) if why else ""


def run(sglang=install.PINS, page_sizes=cases.PAGE_SIZES, modes=None, variant: str | None = None,
        root: str | None = None, log=print, cache: dict | None = None, topks=tree_cases.TOPKS,
        revert_fix: str | None = None, pins=None, edges=None, mla_grid: str = "default") -> Outcome:
    """The whole comparison, for each SPEC of ``sglang`` (:func:`install.resolve`: a release,
    a wheel file or a source tree; or an already resolved Target).  ``modes`` restricts every
    target's mode list (None: all its shape has); ``topks`` the top-k values of the tree modes;
    ``revert_fix`` an upstream fix toggle reverted on every target; ``pins`` is the old name of
    ``sglang``; ``mla_grid`` the MLA forward path's grid (``default``, ``full``, ``off``:
    :func:`mla_forward.grid`).  With several targets each compares its own subset of ``modes``
    (those it has; the others are ``Outcome.skipped``, said in the output); a group (``mla``)
    takes the modes the code has on any number of targets (:func:`wanted`).

    ``cache`` (a dict kept by the caller) lets several runs share upstream's results for
    byte-identical inputs: a refspec variant that leaves the inputs unchanged costs no worker.

    Raises: install.UnsupportedSpec (a spec it cannot install or drive), NoCases (module doc).
    """
    t0 = time.perf_counter()
    tgts = targets(pins if pins is not None else sglang, root, log, revert_fix)
    seconds = {"install": round(time.perf_counter() - t0, 1)}
    several = len(tgts) > 1  # each target takes its own subset of the requested modes
    plans = [(t, select(t, page_sizes, modes, topks, variant, edges, mla_grid, several))
             for t in tgts]  # every NoCases first
    out = _compare(plans, cache, seconds, t0)
    out.skipped = {t.label: skip for t in tgts if (skip := wanted(t, modes, several)[1])}
    out.variant = variant
    return out


def _compare(plans, cache: dict | None, seconds: dict, t0: float) -> Outcome:
    """Run upstream on each ``(target, jobs)`` of ``plans`` and compare: the :class:`Outcome`."""
    rows, info, unreachable = [], {}, []
    for t, jobs in plans:
        tt = time.perf_counter()
        unreachable += [(t.label, j.id, j.unreachable, j) for j in jobs if j.unreachable]
        jobs = [j for j in jobs if not j.unreachable]
        if not jobs:  # a baseline without any of the selected modes (review): no worker
            info[t.label] = {}
            continue
        results, info[t.label] = _upstream(t, jobs, cache)
        unreachable += [(t.label, j.id, unreachable_why(results.get(j.id)), j) for j in jobs
                        if unreachable_why(results.get(j.id))]
        rows += rows_for(t, jobs, results)
        seconds[t.label] = round(time.perf_counter() - tt, 1)
    seconds["total"] = round(time.perf_counter() - t0, 1)
    return Outcome(rows, info, seconds, {t.label: t for t, _ in plans}, unreachable)


def not_on_baseline(base: install.Target, test_jobs: list[cases.Job]) -> dict[str, str]:
    """``{mode: why}`` for the modes of ``test_jobs`` the baseline's shape does not compare."""
    have = (*base.shape.modes, *mla_forward.modes_for(base))
    lack = [m for m in dict.fromkeys(j.mode for j in test_jobs) if m not in have]
    return {m: _why_not(base, [mla_forward.base_mode(m)]).lstrip("; ") or "not among its modes" for m in lack}


@dataclass
class Review:
    """A PR-scoped comparison (:func:`review`): the baseline's and the code under test's
    outcomes on the same grid, and what changed between them (:func:`report.changes`)."""

    baseline: Outcome
    test: Outcome
    changes: list[report.Change]
    not_on_baseline: dict = field(default_factory=dict)  #: mode -> why the baseline does not run it

    @property
    def new_failures(self) -> list[report.Change]:
        """Rows failing under test that pass or do not exist on the baseline (or fail there by
        fewer rules), known upstream bugs included (named as known): the CLI's exit 1."""
        return [c for c in self.changes if c.fails]

    @property
    def gaps(self) -> list[report.Change]:
        """Results refspec cannot drive on the code under test (no rule broken): exit 3 without a new failure."""
        return [c for c in self.changes if c.status == report.GAP]

    @property
    def exit_code(self) -> int:
        return EXIT_FAIL if self.new_failures else EXIT_GAP if self.gaps else EXIT_OK


def review(baseline, sglang, page_sizes=cases.PAGE_SIZES, modes=None, variant: str | None = None,
           root: str | None = None, log=print, cache: dict | None = None, topks=tree_cases.TOPKS,
           revert_fix: str | None = None, mla_grid: str = "default") -> Review:
    """Compare the code under test ``sglang`` and the ``baseline`` (each one SPEC as :func:`run`
    takes it, or a resolved Target) on the same grid, and what changed between them.

    The grid is the code under test's (:func:`select`, with its guards); the baseline runs the
    same jobs where it has the mode (its own shape: a staged replay only where it has one), so a
    phase or mode only the code under test has shows as new.  ``revert_fix`` applies to the code
    under test only.  Both targets are resolved before any worker runs.

    Raises: install.UnsupportedSpec (either spec), NoCases (the selection, on the code under test).
    """
    t0 = time.perf_counter()
    base = targets([baseline], root, log)[0]
    test = targets([sglang], root, log, revert_fix)[0]
    seconds = {"install": round(time.perf_counter() - t0, 1)}
    jobs = select(test, page_sizes, modes, topks, variant, mla_grid=mla_grid)
    have = (*base.shape.modes, *mla_forward.modes_for(base))
    on_base = [m for m in have if (modes is None and (mla_grid != "off" or not mla_forward.is_mla(m))) or
               (modes is not None and m in names.expand(modes))]
    base_jobs = _jobs(base, page_sizes, on_base, topks, variant) + _mla_jobs(page_sizes, on_base, variant, mla_grid)
    t1 = time.perf_counter()
    base_out = _compare([(base, base_jobs)], cache, dict(seconds), t0)
    test_out = _compare([(test, jobs)], cache, dict(seconds), t1)
    base_out.variant = test_out.variant = variant
    skip = wanted(test, modes)[1]
    test_out.skipped = {test.label: skip} if skip else {}
    return Review(base_out, test_out, report.changes(base_out.rows, test_out.rows), not_on_baseline(base, jobs))


def render(out: Outcome, verbose: bool = False, expect: dict[str, set[str]] | None = None) -> str:
    """Every target's summary line and table, each failing row with its rule, level, both values
    and the upstream line; with ``verbose`` also the documented-differences table; last the
    :func:`verdict` (``expect``: the known bugs expected per target, strict)."""
    parts = []
    for label in dict.fromkeys(r.pin for r in out.rows):
        s = report.summary(out.rows, label)
        inf = out.info.get(label, {})
        t = out.targets.get(label)
        how = f", {t.shape.hooks} hooks" if t is not None else ""
        parts.append(f"== sglang {label}: {s['cases']} cases, {s['same']} identical, {s['documented']} with only "
                     f"documented differences, {s['undocumented']} failing"
                     + (f" ({s['known_bug']} on known upstream bugs)" if s["known_bug"] else "")
                     + (f", {s['gaps']} adapter gaps" if s["gaps"] else "") + " "
                     f"(worker: import {inf.get('import_s')} s, run {inf.get('run_s')} s{how})")
        hs = report.headlines(out.rows, label)
        parts += [report.headline_line(h, label, i, len(hs), out.variant) for i, h in enumerate(hs, 1)]
        if verbose:
            for k, v in inf.items():
                if k.startswith(("replay kernels", "tree kernel")):
                    parts.append(f"   {k}: {v}")
        tab = report.table(out.rows, label, verbose, out.targets.get(label))
        if tab:
            parts.append(tab)
    parts += report.skipped_lines(out)
    parts += unreachable_lines(out)
    parts += mirror_lines(out)
    parts += report.kernel_lines(out)
    parts += mla_forward.console_lines(out)
    if verbose:
        used = {d.documented for r in out.rows for d in r.diffs if d.documented}
        parts.append("== documented differences (* = seen in this run)")
        parts.append(report.known_table(used))
    if out.bugs():
        parts.append("== known upstream bugs reproduced (their rows above name the rule)")
        parts.append(report.bugs_table(out.bugs(), out.rows))
    code, said = verdict(out, expect)
    parts += said
    parts.append(f"   timings {out.seconds}")
    if code in (EXIT_OK, EXIT_GAP):
        unchecked = ", ".join(f"{rid} ({why})" for rid, why in report.NOT_BY_VALUES)
        parts.append(f"   not checked by this comparison: {unchecked}")
    return "\n".join(parts)


#: exit statuses of a comparison (``python -m refspec conformance``); 2 is a usage error (refspec.cli)
EXIT_OK, EXIT_FAIL, EXIT_GAP = 0, 1, 3


def parse_expected(text: str) -> dict[str, set[str]]:
    """``--expect-bugs LABEL:KEY[,LABEL:KEY...]`` -> ``{target label: {known bug key, ...}}``
    (:func:`names.parse_expected` against :data:`known.BUGS`' keys).

    Raises: ValueError naming an item without ``:`` or a key :data:`known.BUGS` does not have."""
    return names.parse_expected(text, {b.key for b in known.BUGS})


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _ids(rows) -> str:
    """The rule IDs the rows break, cause first (adapter gaps left out)."""
    return ", ".join(rules.by_cause({f.rule for r in rows for f in r.findings if f.rule != report.ADAPTER}))


def _breaks(k: int) -> str:
    return "1 result breaks" if k == 1 else f"{k} results break"


def verdict(out: Outcome, expect: dict[str, set[str]] | None = None) -> tuple[int, list[str]]:
    """``(exit status, the closing lines)`` of a comparison (issue 39 item 6).

    * 0 ``OK``: no rule broken on the inputs upstream can reach, nothing refspec could not drive;
    * 1 ``FAIL``: a rule broken -- a known upstream bug reproduced is a broken rule too, named as
      known with its PR; with ``expect`` (``{target: {bug key}}``, CI's stated known bugs at its
      pins: strict expected failures) the run passes only when each target's failing rows are all
      on its expected bugs and every expected bug shows (one that disappears fails the run: it was
      fixed, or the comparison lost it);
    * 3 ``ADAPTER GAP``: no rule broken, but some results refspec cannot drive yet (their upstream
      reads something the adapter does not lay out).
    """
    lines, code = [], EXIT_OK
    failures, gaps = out.failures, out.gaps
    if expect is not None:
        labels = list(dict.fromkeys(r.pin for r in out.rows))
        for label in labels:
            want = expect.get(label, set())
            mine = [r for r in failures if r.pin == label]
            shown = {b for r in mine for b in (r.bug, *r.also) if b}
            other = [r for r in mine if r.bug not in want or any(b not in want for b in r.also)]
            for key in sorted(want - shown):
                b = known.by_key(key)
                lines.append(f"== FAIL: sglang {label}: the expected {b.marker} did not show (fixed upstream, or lost "
                             f"by the comparison): update --expect-bugs and known.BUGS")
                code = EXIT_FAIL
            if other:
                code = EXIT_FAIL
                lines.append(f"== FAIL: sglang {label}: {_breaks(len(other))} a rule not among the expected known "
                             f"bugs [{_ids(other)}]")
            elif want and want <= shown:
                lines.append(f"== EXPECTED KNOWN UPSTREAM BUGS: sglang {label}: "
                             f"{', '.join(known.by_key(k).marker for k in sorted(want))} reproduced as expected, "
                             f"nothing else fails")
        unknown = sorted(set(expect) - set(labels))
        if unknown:
            lines.append(f"== FAIL: --expect-bugs names {', '.join(unknown)}, which this run does not compare")
            code = EXIT_FAIL
        if code == EXIT_OK and gaps:
            code = EXIT_GAP
    elif failures:
        code = EXIT_FAIL
        bugs = [r for r in failures if r.bug]
        named = ", ".join(sorted({known.by_key(b).marker for r in bugs for b in (r.bug, *r.also)}))
        lines.append(f"== FAIL: {_breaks(len(failures))} a rule [{_ids(failures)}]"
                     + (f"; {len(bugs)} of them reproduce known upstream bugs ({named})" if bugs else "")
                     + (f"; refspec's bug variant {out.variant} is on (a negative control): the defect is refspec's "
                        f"planted one, the run failing is the control working" if out.variant and len(bugs) <
                        len(failures) else ""))
    elif gaps:
        code = EXIT_GAP
    if gaps:
        lines.append(f"== ADAPTER GAP: {_n(len(gaps), 'result')} not compared ({report.GAP_WORDS})"
                     + ("" if code == EXIT_GAP else "; the failures above stand"))
    if code == EXIT_OK:
        lines.append("== OK: no rule broken on the inputs upstream can reach")
    return code, lines


def render_review(rev: Review, verbose: bool = False) -> str:
    """A ``--baseline`` run: each side's summary line (with ``verbose``, each side's whole
    :func:`render`), then what the code under test changes (:func:`report.changes_table`) and the
    verdict: FAIL on a new failure no known upstream bug explains."""
    parts = []
    for side, out in (("baseline", rev.baseline), ("under test", rev.test)):
        if verbose:
            parts.append(f"==== {side}")
            parts.append(render(out, verbose))
            continue
        for label in out.targets:
            s = report.summary(out.rows, label)
            parts.append(f"== {side}: sglang {label}: {s['cases']} cases, {s['same']} identical, {s['documented']} "
                         f"with only documented differences, {s['undocumented']} failing"
                         + (f" ({s['known_bug']} on known upstream bugs)" if s["known_bug"] else ""))
    for side, out in (("baseline: ", rev.baseline), ("under test: ", rev.test)):
        if not verbose:
            parts += (report.skipped_lines(out, side) + unreachable_lines(out, side) + mirror_lines(out, side)
                      + report.kernel_lines(out, side))
    test, base = next(iter(rev.test.targets)), next(iter(rev.baseline.targets))
    parts.append(f"== changes: {report.change_summary(rev.changes, test, base)}")
    parts += [f"== newly checked: {x}" for x in report.checked_lines(rev.changes)]
    parts.append(report.changes_table(rev.changes, verbose, last=rev.not_on_baseline))
    bugs = {c.row.bug for c in rev.changes if c.row.bug and c.status != report.UNCHANGED}
    if bugs:
        parts.append("== known upstream bugs reproduced (their rows above name the rule)")
        parts.append(report.bugs_table(bugs, [c.row for c in rev.changes if c.status != report.UNCHANGED]))
    n, g = len(rev.new_failures), len(rev.gaps)
    verdict = (f"FAIL: {n} new failure{'' if n == 1 else 's'} against the baseline" if n
               else f"ADAPTER GAP: no new failure against the baseline; {_n(g, 'result')} not compared under test "
                    f"({report.GAP_WORDS})" if g
               else "OK: no new failure against the baseline")
    seconds = {"baseline": rev.baseline.seconds.get("total"), "under test": rev.test.seconds.get("total")}
    parts.append(f"== {verdict} (timings {seconds})")
    return "\n".join(parts)
