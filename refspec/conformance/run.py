"""Orchestration: install the pins, build the jobs, run upstream in a worker, compare, report.

:func:`run` is the API (the CLI and the tests call it); it returns :class:`Outcome` whose
``ok`` is False on any undocumented difference or upstream error.
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
from dataclasses import dataclass

import torch

from refspec.conformance import cases, install, known, report, tree_cases
from refspec.conformance.compare import compare, compare_parts

#: conformance modes per pin (0.5.23 has no DRAFT_EXTEND v1)
PIN_MODES = {
    "0.5.23": ("decode", "extend", "extend_prefix", "verify", "draft_decode", "draft_extend_v2", "idle",
               *tree_cases.MODES),
    "0.5.12.post1": ("decode", "extend", "extend_prefix", "verify", "draft_decode", "draft_extend",
                     "draft_extend_v2", *tree_cases.MODES),  # no IDLE: upstream_0512 module doc
}
#: pins whose backend has the staged draft-extend replay (``stage_draft_extend_metadata``)
STAGED_REPLAY = ("0.5.23",)
#: pins where upstream builds the verify tree itself (its Triton tree kernel); elsewhere the worker
#: uses the job's tree and the ``tree`` part is not compared (``upstream_tree.run_legacy``)
OWN_TREE = ("0.5.23",)
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


@dataclass
class Outcome:
    rows: list[report.Row]
    info: dict  #: pin -> worker info (import / run seconds, interpreter check, ...)
    seconds: dict  #: install / pin timings

    @property
    def ok(self) -> bool:
        """Every row agrees (or differs only as documented): False on a known upstream bug too."""
        return all(r.ok for r in self.rows)

    @property
    def unexplained(self) -> list[report.Row]:
        """Failing rows that no known upstream bug explains (what makes the CLI exit 1)."""
        return [r for r in self.rows if not r.ok and r.bug is None]

    def bugs(self) -> set[str]:
        """The known upstream bugs (:data:`refspec.conformance.known.BUGS` keys) that rows showed."""
        return {r.bug for r in self.rows if r.bug}

    def failing_fields(self) -> set[str]:
        return {d.field for r in self.rows for d in r.undocumented} | ({"ERROR"} if any(r.error for r in self.rows)
                                                                        else set())


def run_worker(pin: str, path: list[str], jobs: list[cases.Job]) -> tuple[dict, dict]:
    """Run upstream ``pin`` on ``jobs`` in a subprocess; ``(results by job id, worker info)``.

    The worker runs with ``TRITON_INTERPRET=1`` (Triton kernels in the interpreter) and
    ``TORCHDYNAMO_DISABLE=1`` (upstream's ``@torch.compile`` functions, e.g.
    ``draft_decode_set_expand_metadata``, run as the plain PyTorch they are written in).

    Raises: RuntimeError with the worker's stderr if it fails as a whole (import error, ...).
    """
    with tempfile.TemporaryDirectory(prefix="refspec-conformance-") as tmp:
        jobs_path, out_path = os.path.join(tmp, "jobs.pt"), os.path.join(tmp, "out.pt")
        torch.save([(j.id, dict(j.inputs, mode=j.mode)) for j in jobs], jobs_path)
        env = dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=os.pathsep.join([*path, REPO]),
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, "-m", "refspec.conformance.worker", pin, jobs_path, out_path],
                              env=env, capture_output=True, text=True, cwd=REPO, check=False)
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"conformance worker for sglang {pin} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        out = torch.load(out_path, weights_only=False)
    return out["results"], out["info"]


def rows_for(pin: str, jobs: list[cases.Job], results: dict, code: str | None = None) -> list[report.Row]:
    """Compare every (job, phase, step) of ``jobs`` with upstream's ``results``.

    ``pin`` is the release the code is (its documented differences, its adapter); ``code`` the
    code that ran (default ``pin``; a patched copy: :func:`refspec.conformance.known.patched`),
    against which a failing row is matched with the known upstream bugs (``Row.bug``).
    """
    code = code or pin
    rows = []
    for j in jobs:
        theirs = results.get(j.id, "no result from the worker")
        for (phase, step), ours in j.refspec.items():
            row = report.Row(pin, j.id, j.mode, j.page_size, j.shape, phase, step)
            got = theirs.get((phase, step)) if isinstance(theirs, dict) else None
            if got is None or isinstance(got, str):  # a phase's own upstream error is its result
                missing = theirs if isinstance(theirs, str) else f"upstream gave no {phase} step {step} result"
                row.error = got or missing
            else:
                if "prefix" in ours:  # top-k > 1: the verify expand table holds slots (page size 1)
                    if pin not in OWN_TREE:
                        ours = {part: v for part, v in ours.items() if part != "tree"}
                    raw = compare_parts(ours, got, j.page_size, 1 if j.mode == "tree_verify" else j.page_size)
                else:
                    raw = compare(ours, got, j.page_size)
                for d in raw:
                    k = known.match(pin, j.mode, phase, d.field)
                    row.diffs.append(d if k is None else type(d)(d.field, d.ours, d.theirs, k.key))
            if not row.ok:
                b = known.bug(code, j.mode, phase, [d.field for d in row.undocumented], row.error)
                row.bug = None if b is None else b.key
            rows.append(row)
    return rows


def digest(inputs: dict) -> str:
    """SHA-256 of a job's inputs (every tensor's bytes, dtype and shape; every list and scalar)."""
    buf = io.BytesIO()
    torch.save(inputs, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _upstream(pin: str, path: list[str], jobs: list[cases.Job], cache: dict | None) -> tuple[dict, dict]:
    """Upstream's results for ``jobs``; with ``cache``, a job whose inputs are byte-identical to
    one already run on ``pin`` reuses that result (upstream sees only the inputs); ``info`` is
    then the last worker's for that pin, plus ``reused`` (how many jobs did not run again)."""
    if cache is None:
        return run_worker(pin, path, jobs)
    keys = {j.id: (pin, digest(dict(j.inputs, mode=j.mode))) for j in jobs}
    todo = [j for j in jobs if keys[j.id] not in cache]
    info = dict(cache.get(("worker info", pin), {}), reused=len(jobs) - len(todo))
    if todo:
        results, fresh = run_worker(pin, path, todo)
        cache[("worker info", pin)] = fresh
        info.update(fresh)
        cache.update({keys[j.id]: results[j.id] for j in todo if j.id in results})
    return {j.id: cache[keys[j.id]] for j in jobs if keys[j.id] in cache}, info


def run(pins=install.PINS, page_sizes=cases.PAGE_SIZES, modes=None, variant: str | None = None,
        root: str | None = None, log=print, cache: dict | None = None, topks=tree_cases.TOPKS) -> Outcome:
    """The whole comparison.  ``modes`` restricts every pin's mode list (None: all it has);
    ``topks`` the top-k values of the tree modes.

    ``cache`` (a dict kept by the caller) lets several runs share upstream's results for
    byte-identical inputs: a refspec variant that leaves the inputs unchanged costs no worker.
    """
    t0 = time.perf_counter()
    paths = install.ensure(pins, root, log=log)
    seconds = {"install": round(time.perf_counter() - t0, 1)}
    rows, info = [], {}
    for pin in pins:
        t = time.perf_counter()
        pm = [m for m in PIN_MODES[pin] if modes is None or m in modes]
        with _variant(variant):
            flat, tree = [m for m in pm if m in cases.MODES], [m for m in pm if m in tree_cases.MODES]
            jobs = cases.build_jobs(flat, page_sizes, staged=pin in STAGED_REPLAY)
            jobs += cases.edge_jobs(flat, page_sizes, staged=pin in STAGED_REPLAY)
            jobs += tree_cases.build_jobs(tree, page_sizes, topks)
            jobs += tree_cases.edge_jobs(tree, page_sizes, topks)
        results, info[pin] = _upstream(pin, paths[pin], jobs, cache)
        rows += rows_for(pin, jobs, results)
        seconds[pin] = round(time.perf_counter() - t, 1)
    seconds["total"] = round(time.perf_counter() - t0, 1)
    return Outcome(rows, info, seconds)


def render(out: Outcome, verbose: bool = False) -> str:
    """Every pin's table and summary, then the documented differences that occurred."""
    parts = []
    for pin in dict.fromkeys(r.pin for r in out.rows):
        s = report.summary(out.rows, pin)
        inf = out.info.get(pin, {})
        parts.append(f"== sglang {pin}: {s['cases']} cases, {s['same']} identical, {s['documented']} with only "
                     f"documented differences, {s['undocumented']} failing"
                     + (f" ({s['known_bug']} on known upstream bugs)" if s["known_bug"] else "") + " "
                     f"(worker: import {inf.get('import_s')} s, run {inf.get('run_s')} s)")
        for k, v in inf.items():
            if k.startswith(("replay kernels", "tree kernel")):
                parts.append(f"   {k}: {v}")
        parts.append(report.table(out.rows, pin, verbose))
    used = {d.documented for r in out.rows for d in r.diffs if d.documented}
    parts.append("== documented differences (* = seen in this run)")
    parts.append(report.known_table(used))
    if out.bugs():
        parts.append("== known upstream bugs reproduced (failing rows above, rule named)")
        parts.append(report.bugs_table(out.bugs()))
    verdict = "OK" if out.ok else "FAIL" if out.unexplained else "KNOWN UPSTREAM BUGS ONLY"
    parts.append(f"== {verdict}: timings {out.seconds}")
    return "\n".join(parts)
