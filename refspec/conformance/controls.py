"""Known upstream bugs as negative controls against real upstream code.

Each :class:`Control` runs the same jobs on two pieces of upstream code: one that has the bug
(a release, or a release with a stored PR diff applied: :mod:`refspec.conformance.patches`)
and one that fixed it.  The control holds when the buggy code FAILS -- DIFFERS or an upstream
ERROR, in exactly the (mode, phase) pairs listed, every failing row naming the rule of its
:data:`refspec.conformance.known.BUGS` entry -- and the fixed code PASSES (every row identical
or documented).  refspec's side is the same production code in both runs (no variant): only
upstream's code changes.

``tests/test_conformance_controls.py`` pins every control (``make conformance``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from refspec.conformance import cases, install, known, mla_forward, patches, report, tree_cases
from refspec.conformance.run import rows_for, run_worker, select


@dataclass(frozen=True)
class Code:
    """Upstream code: release ``pin`` with stored ``patches`` applied in order."""

    pin: str
    patches: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return known.patched(self.pin, *self.patches)

    def target(self, root: str | None = None, log=print) -> install.Target:
        """The release resolved (installed if missing); with patches, a patched copy of it driven as a
        source tree (its links point at the local files, not the release tag), labelled :attr:`label`."""
        t = install.resolve(self.pin, root, log)
        if not self.patches:
            return t
        tree = install.resolve(patches.patched_copy(t.site, self.patches, log=log), root, log)
        return replace(tree, label=self.label, version=self.pin)


@dataclass(frozen=True)
class Control:
    key: str  #: the :data:`known.BUGS` entry
    buggy: Code
    fixed: Code
    jobs: Callable[[install.Target], list[cases.Job]]
    fails: frozenset  #: the (mode, phase) pairs that must fail on the buggy code

    @property
    def bug(self) -> known.Bug:
        return next(b for b in known.BUGS if b.key == self.key)


def _grid(t: install.Target) -> list[cases.Job]:
    """The whole default MHA grid of ``t`` (what ``python -m refspec conformance`` runs on it, less
    the ``mla_*`` modes, whose known bugs have controls of their own and fail on 0.5.23 with or
    without #35985): the context-wall control holds only if the wall's rows are the sole failures
    on the buggy code and a fix that reads the headroom (#35985) passes every row, no IndexError
    anywhere."""
    return [j for j in select(t, cases.PAGE_SIZES, None, tree_cases.TOPKS)
            if not j.unreachable and not j.mode.startswith("mla_")]


def _long_tree(t: install.Target) -> list[cases.Job]:
    return tree_cases.build_jobs(("tree_draft_decode",), (2,), (2,), num_steps=(6,))


def _de_v2(t: install.Target) -> list[cases.Job]:
    return cases.build_jobs(("draft_extend_v2",), (1, 4), ("B3/bs4",), staged=t.shape.staged)


def _mla_verify(t: install.Target) -> list[cases.Job]:
    return mla_forward.build_jobs((1, 4), modes=("mla_tree_verify",))


def _mla_move(t: install.Target) -> list[cases.Job]:
    """Eager top-k 2 draft decode at P = 1 (no tail to copy) and P = 4 (a partial tail: the move):
    the graph phases would also show 0.5.12.post1's slot-0 write (its own control)."""
    return [mla_forward.tree_job("mla_tree_draft_decode", P, 7 * P + 3, graphs=False) for P in (1, 4)]


#: the MLA modes a CUDA graph captures at top-k = 1 (where a padded row's store reaches slot 0)
MLA_GRAPHED = ("mla_decode", "mla_verify", "mla_draft_decode", "mla_draft_extend_v2")


def _mla_slot0(t: install.Target) -> list[cases.Job]:
    return mla_forward.build_jobs((4,), modes=MLA_GRAPHED)


NEW, OLD = Code("0.5.23"), Code("0.5.12.post1")
CONTROLS: tuple[Control, ...] = (
    Control("context-wall-page-table", NEW, Code("0.5.23", ("pr35985-page-table-width",)), _grid,
            frozenset({("verify", "replay"), ("draft_decode", "replay"), ("draft_extend_v2", "replay"),
                       ("draft_extend_v2", "replay-staged"), ("draft_extend_v2", "eager")})),
    Control("draft-expand-unsliced-scatter", OLD, NEW, _long_tree, frozenset({("tree_draft_decode", "replay")})),
    Control("draft-extend-v2-double-count", Code("0.5.23", ("pr26512-draft-extend-v2-double-count",)), NEW, _de_v2,
            frozenset({("draft_extend_v2", "eager")})),
)
#: the MLA forward path's known bugs (:mod:`refspec.conformance.mla_forward`: upstream's own MLA forward, pool
#: and worker), pinned by ``tests/test_conformance_mla.py``
MLA_CONTROLS: tuple[Control, ...] = (
    Control("mla-verify-expand-paged-view", NEW, Code("0.5.23", ("mla-verify-expand-page1",)), _mla_verify,
            frozenset({("mla_tree_verify", "eager"), ("mla_tree_verify", "capture"), ("mla_tree_verify", "replay")})),
    Control("mla-pool-no-move-kv-cache", OLD, NEW, _mla_move, frozenset({("mla_tree_draft_decode", "eager")})),
    Control("mla-store-writes-slot-0", OLD, NEW, _mla_slot0,
            frozenset((m, ph) for m in MLA_GRAPHED for ph in ("capture", "replay"))),
)


@dataclass
class Result:
    control: Control
    buggy: list[report.Row]
    fixed: list[report.Row]

    def failing(self, rows) -> set[tuple[str, str]]:
        return {(r.mode, r.phase) for r in rows if not r.ok}

    def problems(self) -> list[str]:
        """Why the control does not hold (empty: it holds)."""
        c, out = self.control, []
        got = self.failing(self.buggy)
        if got != set(c.fails):
            out.append(f"{c.buggy.label}: failing (mode, phase) {sorted(got)}, expected {sorted(c.fails)}")
        unnamed = [f"{r.job} {r.phase}" for r in self.buggy if not r.ok and r.bug != c.key]
        if unnamed:
            out.append(f"{c.buggy.label}: rows failing without the {c.key} ({c.bug.rule}) attribution: {unnamed}")
        bad = [f"{r.job} {r.phase}" + ("" if r.step is None else f" step {r.step}") for r in self.fixed if not r.ok]
        if bad:
            out.append(f"{c.fixed.label}: must pass, fails at {bad}")
        return out


def run_controls(controls=CONTROLS, root: str | None = None, log=print, workers: int = 2) -> list[Result]:
    """Run every control; one upstream worker per distinct code (``workers`` at a time)."""
    codes = list(dict.fromkeys(code for c in controls for code in (c.buggy, c.fixed)))
    tgts = {code: code.target(root, log) for code in codes}
    want: dict[Code, list[cases.Job]] = {code: [] for code in codes}
    for c in controls:
        for code in (c.buggy, c.fixed):
            have = {j.id for j in want[code]}
            want[code] += [j for j in c.jobs(tgts[code]) if j.id not in have]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {code: pool.submit(run_worker, tgts[code], jobs) for code, jobs in want.items()}
        rows = {code: rows_for(tgts[code], want[code], futures[code].result()[0]) for code in codes}
    out = []
    for c in controls:
        ids = {j.id for j in c.jobs(tgts[c.buggy])}, {j.id for j in c.jobs(tgts[c.fixed])}
        out.append(Result(c, [r for r in rows[c.buggy] if r.job in ids[0]],
                          [r for r in rows[c.fixed] if r.job in ids[1]]))
    return out


def render(results: list[Result]) -> str:
    """One paragraph per control: verdict, rule, both codes, the buggy code's failing rows."""
    lines = []
    for res in results:
        c, b = res.control, res.control.bug
        verdict = "holds" if not res.problems() else "DOES NOT HOLD"
        lines.append(f"== control {c.key} [{b.rule}]: {verdict}: fails on {c.buggy.label} "
                     f"({len([r for r in res.buggy if not r.ok])} rows), passes on {c.fixed.label} "
                     f"({len([r for r in res.fixed if not r.ok])} failing of {len(res.fixed)})")
        lines += [f"   {p}" for p in res.problems()]
        lines.append(report.table(res.buggy, c.buggy.label))
    return "\n".join(lines)
