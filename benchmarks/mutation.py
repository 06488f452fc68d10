"""Mutation testing of refspec's checkers (issue 26): ``make mutation``.

The bug zoo (``python -m refspec mutants``, docs/bug-zoo.md) is the mutation test of the
production wing: named faults the checkers must catch.  This script is the mutation test of the
checkers themselves: mutmut (pinned in the ``mutation`` extra) makes single-token faults in each
module of :data:`MODULES` and runs only that module's tests against each one; a mutant the tests
do not kill is a fault the checker would let through.

Each module runs in its own scratch copy ``build/mutation/<name>/`` (the repository's top-level
entries linked in, a ``[tool.mutmut]`` section added to a copy of pyproject.toml), one mutant at a
time (``--max-children 1``), so a module's test selection is its own.  Survivors listed in
:data:`EQUIVALENT` (keyed by module and the mutated line's text, not by a line number) count as
equivalent; every other survivor fails the run.

**Reach.**  Before mutating, mutmut runs the selected tests once with every mutated function
wrapped in a trampoline that records which tests call it (its stats run); a mutant whose function
no selected test calls is never run and gets mutmut's status "no tests" (exit code 33).  Such a
mutant says nothing about the tests' strength: no test executes the code.  The report lists it as
*not reached*, per function, apart from the survivors and the equivalents, and it fails the run
too (the function needs a test that calls it, or leaves :data:`MODULES`' selection).  The bug
zoo's runner applies the same rule to its variants (``refspec/mutants/reach.py``).

The report is written to ``benchmarks/results/mutation.md``.

Usage: ``python benchmarks/mutation.py [--only NAME ...] [--keep] [--report PATH]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "build" / "mutation"
REPORT = ROOT / "benchmarks" / "results" / "mutation.md"


@dataclass(frozen=True)
class Module:
    name: str          # the report's row and the scratch folder
    path: str          # the file mutmut mutates
    tests: tuple[str, ...]  # pytest paths / node IDs that must kill its mutants
    # the functions mutated, as mutmut names them (``x_name``, ``xǁClassǁmethod``); empty: all of
    # the file.  The replay modules' check functions, not the code that runs the FA3 wing.
    functions: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    def patterns(self) -> list[str]:
        """``mutmut run`` arguments that select this module's mutants (none: every mutant)."""
        return [f"{self.module}.{f}__mutmut_*" for f in self.functions]

    def selected(self, key: str) -> bool:
        return not self.functions or any(key.startswith(f"{self.module}.{f}__mutmut_") for f in self.functions)


# The one table: which checker module is mutated, against which tests.  A module that moves
# (issue 22) is a one-line change here.
MODULES: tuple[Module, ...] = (
    Module("fa3.validate", "refspec/fa3/validate.py",
           ("tests/test_validate_refuses.py",)),
    Module("traces.chain", "refspec/traces/chain.py", ("tests/test_trace_refuses.py",)),
    Module("traces.tree_checks", "refspec/traces/tree_checks.py",
           ("tests/test_tree_trace_refuses.py",)),
    # tree.py's checks; out: TreeRecorder, mask_tree_rows and to_runs (the recording side, run by
    # the record tests in test_tree_trace.py)
    Module("traces.tree", "refspec/traces/tree.py", ("tests/test_tree_rounds_refuse.py",),
           ("x_from_runs", "x_ancestors_and_self", "x_check_tree_rounds", "x_tree_round_failures",
            "x_tree_v2_round_failures")),
    # the replays' verdicts once the runs are done: a chain replay's (_check_run) and a tree
    # replay's T1 comparison (_compare).  Out: replay_trace / replay_tree_trace and their steps
    # (_draft_decode, _verify, _compact_and_extend, replay_tree_v2, replay_tree_graphs: they run
    # the model or the FA3 wing, so test_trace.py and test_tree_trace.py replay recorded and
    # tampered traces end to end), the Markdown reports, and the ``ok`` properties (mutmut does
    # not mutate decorated functions; test_replay_verdicts.py checks them)
    Module("traces.replay", "refspec/traces/replay.py", ("tests/test_replay_verdicts.py",),
           ("x__round_tokens", "x__check_run")),
    Module("traces.replay_tree", "refspec/traces/replay_tree.py", ("tests/test_replay_verdicts.py",),
           ("x__compare",)),
    Module("conformance.compare", "refspec/conformance/compare.py",
           ("tests/test_compare_refuses.py", "tests/test_conformance.py")),
    Module("conformance.known", "refspec/conformance/known.py",
           ("tests/test_known_refuses.py", "tests/test_conformance.py")),
)

# Survivors that are equivalent: (module name, the mutated line as mutmut writes it, stripped)
# -> why no test can tell it from the original.  Line text, not numbers: an edit elsewhere in the
# file keeps the key.
EQUIVALENT: dict[tuple[str, str], str] = {
    ("fa3.validate", 'require(-(-Kb / P) <= pt.shape[1], "PA-003",'):
        "for an integer width w, K / P <= w exactly when ceil(K / P) <= w (the message keeps the ceil)",
    # make mutation runs on a CPU: the default device is the CPU, where row lives
    ("fa3.validate", "p = torch.arange(Kb, device=None)"):
        "on a CPU the default device is row's device (only a CUDA run tells them apart: the gpu tests)",
    ("fa3.validate", "p = torch.arange(Kb, )"):
        "on a CPU the default device is row's device (only a CUDA run tells them apart: the gpu tests)",
    **{("traces.chain", line): "dumps is json.dumps text (ensure_ascii: pure ASCII), which every "
       "ASCII-compatible encoding, the locale's included, writes as the same bytes"
       for line in ('path.write_text(dumps(trace), encoding=None)', 'path.write_text(dumps(trace), )',
                    'path.write_text(dumps(trace), encoding="UTF-8")')},
    ("traces.chain", 'text = Path(path).read_text(encoding="UTF-8")'): "codec names are case-insensitive",
    **{("traces.chain", line): "under a UTF-8 locale (this machine's C.UTF-8, CI's) the default is UTF-8; "
       "elsewhere a non-ASCII file would tell them apart"
       for line in ('text = Path(path).read_text(encoding=None)', 'text = Path(path).read_text()',
                    'text = Path(path).read_text(, )')},
    **{("traces.chain", line): "get's default is None, and bool(None) is bool(False): a config without "
       "overlap is no overlap either way"
       for line in ('rounds, overlap = trace["rounds"], bool(trace["config"].get("overlap", None))',
                    'rounds, overlap = trace["rounds"], bool(trace["config"].get("overlap", ))')},
    ("traces.tree_checks", "if not 0 <= page < num_pages:"):
        "page 0 has returned its PA-008 line just above, so 0 <= page and 0 < page agree here",
    ("traces.tree_checks", 'elif not 0 <= r <= cfg["max_batch"]:'):
        "r == 0 took the PA-008 branch just above, so 0 <= r and 0 < r agree in the elif",
    **{("traces.tree_checks", line): "a field group's label is never read (the loop unpacks it into _)"
       for line in (
           'fields = [("XXpage_tableXX", [(f"page_table[{j}]", p, p) for j, p in enumerate(entry["page_table"])])]',
           'fields = [("PAGE_TABLE", [(f"page_table[{j}]", p, p) for j, p in enumerate(entry["page_table"])])]',
           'fields.append(("XXdraft_cache_locXX", [(f"draft_cache_loc[{t}][{j}]", s, s // P)',
           'fields.append(("DRAFT_CACHE_LOC", [(f"draft_cache_loc[{t}][{j}]", s, s // P)',
           'fields.append(("XXmoved_toXX", [(f"moved_to[{j}]", s, s // P) for j, s in enumerate(entry["moved_to"])]))',
           'fields.append(("MOVED_TO", [(f"moved_to[{j}]", s, s // P) for j, s in enumerate(entry["moved_to"])]))',
       )},
    **{("traces.tree", line): "at P = 1, L % P is 0 already"
       for line in ("lp = L % P if (P > 1) or True else 0", "lp = L % P if P >= 1 else 0")},
    ("traces.tree", "lp = L % P if P > 1 else 1"):
        "lp cancels in the step positions (L - lp + t*npp*P + lp + j), and at P = 1 npp = S does not read it",
    **{("traces.tree", line): "at P = 1 (lp = 0), ceil((lp + S) / P) is S"
       for line in ("npp = -(-(lp + S) // P) if (P > 1) or True else S", "npp = -(-(lp + S) // P) if P >= 1 else S")},
    ("traces.tree", "R = max(k * S, N) if (P == 1) and False else max(-(-(P - 1 + S) // P) * P * k, N)"):
        "at P = 1, ceil((P - 1 + S) / P) * P * k is S * k",
    ("traces.tree", "if covered != L + N and not (v2 and covered >= L + N):"):
        "covered == L + N passes the first test already",
    ("traces.replay_tree", "low = None if (q.dtype == torch.float32) and False else "
     "attention_over_slots(q, k, v, slots, upcast=False)"):
        "for fp32 q, upcast=False computes in fp32 too: the reference's own numbers, a budget base of 0 either way",
    ("traces.replay_tree", "low = None if q.dtype == torch.float32 else attention_over_slots(q, k, v, slots, "
     "upcast=None)"):
        "attention_over_slots reads upcast as a truth value: None is False",
    ("conformance.compare", 'side = lambda d: MISSING if d.get("page_table") is None else '
     'f"width {d[\'page_table\'].shape[+1]}"'):
        "a page table is 2-D [rows, width]: shape[+1] and shape[-1] are the same axis",
    **{("conformance.compare", line): "a side shorter than n gives a shorter _vec(x, n) list, which the value "
       "comparison in the same condition already refuses"
       for line in (
           "if a is None or b is None or b.numel() < n and a.numel() < n or _vec(a, n) != _vec(b, n):",
           "if b.shape[0] <= r or b.shape[1] < m and a.shape[1] < m or _vec(a[r, :m], m) != _vec(b[r, :m], m):",
       )},
    **{("conformance.compare", line): "the slice already holds at most that many entries, so cutting it to "
       "all of them (None) changes nothing"
       for line in (
           "if b.shape[0] <= r or b.shape[1] < m or a.shape[1] < m or _vec(a[r, :m], None) != _vec(b[r, :m], m):",
           "if b.shape[0] <= r or b.shape[1] < m or a.shape[1] < m or _vec(a[r, :m], m) != _vec(b[r, :m], None):",
           "if b.shape[0] > r and _vec(a[r, m:], None) != _vec(b[r, m:], b.shape[1]):",
           "if b.shape[0] > r and _vec(a[r, m:], a.shape[1]) != _vec(b[r, m:], None):",
           "if b.shape[0] > r and _vec(a[r, m:w], None) != _vec(b[r, m:w], w):  # the dead columns both tables have",
           "if b.shape[0] > r and _vec(a[r, m:w], w) != _vec(b[r, m:w], None):  # the dead columns both tables have",
       )},
    ("conformance.compare", "if a is None and b is None or a != b:"):
        "exactly one side None makes a != b true as well; both None is the and-branch",
    ("conformance.known", 'def source(pin: str, mode: str, phase: str, field: str = "XXXX") -> str:'):
        "neither '' nor 'XXXX' is a TREE_SOURCES key: both look up the mode's builder",
}

# mutmut's exit-code classes (mutmut.stats.status_by_exit_code): killed, timeout (also a kill:
# the tests did not pass), the rest are not kills.
KILLED = {"killed", "timeout", "caught by type check"}
#: mutmut's status of a mutant whose function no selected test called in its stats run (exit code 33)
NOT_REACHED = "no tests"


def function_of(key: str) -> str:
    """The mutated function of a mutmut key: ``refspec.traces.replay.x__check_run__mutmut_7`` ->
    ``_check_run``; a method (``xǁClassǁname__mutmut_3``) -> ``Class.name``."""
    name = key.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
    if name.startswith("xǁ"):
        return ".".join(name.split("ǁ")[1:])
    return name.removeprefix("x_")


def _scratch(mod: Module, keep: bool) -> Path:
    d = SCRATCH / mod.name
    if d.exists() and not keep:
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    skip = {".git", ".venv", "build", "site", "pyproject.toml", "mutants", "setup.cfg"}
    for entry in ROOT.iterdir():
        link = d / entry.name
        if entry.name in skip or entry.name.endswith(".egg-info") or link.exists() or link.is_symlink():
            continue
        link.symlink_to(entry)
    tests = ", ".join(json.dumps(t) for t in mod.tests)
    (d / "pyproject.toml").write_text(
        (ROOT / "pyproject.toml").read_text()
        + "\n[tool.mutmut]\n"
        + 'source_paths = ["refspec"]\n'
        + f"only_mutate = [{json.dumps(mod.path)}]\n"
        + f"pytest_add_cli_args_test_selection = [{tests}]\n"
        # -p no:cacheprovider: no .pytest_cache writes (the project's addopts still apply);
        # mutation_gc (benchmarks/mutation_gc.py, on PYTHONPATH): gc.freeze() in each forked test
        # process; no:unraisableexception: its five gc.collect() per session over torch's heap
        + 'pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "mutation_gc", "-p", "no:unraisableexception", '
          '"-q"]\n'
        # torch in the test process: fork workers from a clean server, not from the stats run
        + 'process_isolation = "forkserver"\n'
        + "use_git_change_detection = false\n"
        # tests that read the docs pages (test_conformance.py reads docs/conformance.md) run in mutants/
        + 'also_copy = ["docs"]\n'
    )
    return d


def _mutmut(d: Path, *args: str, timeout: float | None = None, log: Path | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("mutmut")
    # no plugin autoload: entry-point plugins (nbmake, benchmark, xdist, ...) cost seconds per
    # mutant's pytest start and none of the selected tests needs one
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if log is None:
        return subprocess.run([str(exe), *args], cwd=d, env=env, capture_output=True, text=True, timeout=timeout)
    with open(log, "w") as f:
        try:
            return subprocess.run([str(exe), *args], cwd=d, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"mutmut run timed out after {timeout:.0f} s (log: {log})") from None


def _statuses(d: Path, mod: Module) -> dict[str, int | None]:
    meta = d / "mutants" / (mod.path + ".meta")
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {k: c for k, c in codes.items() if mod.selected(k)}


def _mutated_line(d: Path, name: str, path: str) -> str:
    """The first added line of ``mutmut show NAME``'s diff, stripped (the EQUIVALENT key).

    In this process (mutmut's own diff, ``get_diff_for_mutant``, which ``show`` prints): a
    ``mutmut show`` process per mutant cost seconds each, minutes per run."""
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        with contextlib.chdir(d):
            out = get_diff_for_mutant(name, path=path)
    except (ImportError, OSError, ValueError):  # another mutmut layout: ask its CLI
        out = _mutmut(d, "show", name).stdout
    added = [ln[1:].strip() for ln in out.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return added[0] if added else out.strip()


def run_module(mod: Module, keep: bool, timeout: float, report_only: bool = False) -> dict:
    from mutmut.stats import status_by_exit_code

    d = _scratch(mod, keep or report_only)
    t0 = time.monotonic()
    log = d / "mutmut.log"
    if report_only:  # the verdicts of the last run in build/mutation/, classified again
        before = _statuses(d, mod)
        if not before or None in before.values():
            raise SystemExit(f"--report-only: {mod.name} has no finished run in {d}")
        return _classify(d, mod, before, None, status_by_exit_code)
    # --keep: mutmut keeps its verdicts; the survivors of the last run are run again (against
    # tests added since: a kill stays a kill when tests are only added)
    before = _statuses(d, mod) if keep else {}
    again = [k for k, c in before.items() if status_by_exit_code[c] not in KILLED]
    if not before or None in before.values():  # a fresh run, or one that did not finish
        proc = _mutmut(d, "run", "--max-children", "1", *mod.patterns(), timeout=timeout, log=log)
        again = [k for k in again if before[k] is not None]
    if again:
        proc = _mutmut(d, "run", "--max-children", "1", *again, timeout=timeout, log=log)
    elif before and None not in before.values():
        proc = subprocess.CompletedProcess([], 0)
    wall = time.monotonic() - t0
    full = d / "full_run_wall_s"  # the last full run's wall time, kept for a --keep rerun's report
    if not before or not full.exists():
        full.write_text(f"{wall:.0f}\n")
    codes = _statuses(d, mod)
    if proc.returncode != 0 or not codes:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"mutmut run failed for {mod.name} (rc {proc.returncode}, log: {log})")
    return _classify(d, mod, codes, wall if before else None, status_by_exit_code)


def _classify(d: Path, mod: Module, codes: dict, rerun_s: float | None, status_by_exit_code) -> dict:
    full = d / "full_run_wall_s"
    row = {"module": mod, "total": len(codes), "killed": 0, "equivalent": [], "survived": [], "not_reached": {},
           "wall_s": float(full.read_text()), "rerun_s": rerun_s}
    for name, code in sorted(codes.items()):
        status = status_by_exit_code[code]
        if status in KILLED:
            row["killed"] += 1
            continue
        if status == NOT_REACHED:  # no selected test calls its function: not run, not a survivor
            fn = function_of(name)
            row["not_reached"][fn] = row["not_reached"].get(fn, 0) + 1
            continue
        line = _mutated_line(d, name, mod.path)
        why = EQUIVALENT.get((mod.name, line))
        short = name.split(".")[-1]
        if why is not None and status == "survived":
            row["equivalent"].append((short, line, why))
        else:
            row["survived"].append((short, status, line))
    return row


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


class LoadSampler:
    """The machine's 1-minute load average every ``every`` seconds while the run lasts (a shared
    CPU makes wall times incomparable without it)."""

    def __init__(self, every: float = 15.0):
        self.samples, self._stop = [os.getloadavg()[0]], threading.Event()
        self._t = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._t.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> str:
        self._stop.set()
        x = self.samples
        return f"load average (1 min) over the run: mean {sum(x) / len(x):.1f}, min {min(x):.1f}, max {max(x):.1f}"


FRESH = SCRATCH / "last_fresh_run.json"  # written by a fresh run of every module (make mutation)


def _last_fresh() -> dict | None:
    return json.loads(FRESH.read_text()) if FRESH.exists() else None


def write_report(rows: list[dict], path: Path, argv: list[str], load: str = "", wall: float | None = None) -> None:
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--", "refspec", "tests") else ""
    lines = [
        "# Mutation testing of the checkers (issue 26)",
        "",
        "Written by `python benchmarks/mutation.py" + "".join(f" {a}" for a in argv) + "` (`make mutation` "
        "runs it with no arguments: a fresh run of every module); do not edit by hand.",
        "",
        f"* date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"commit `{_git('rev-parse', '--short', 'HEAD')}`{dirty}",
        f"* tool: mutmut {version('mutmut')} (`--max-children 1`, process_isolation = forkserver), "
        f"pytest {version('pytest')}, Python {platform.python_version()}, torch {version('torch')}",
        f"* machine: {os.cpu_count()} CPU(s), {platform.machine()}, this run at niceness {os.nice(0)}"
        + (f"; {load}" if load else ""),
        *([f"* wall time of this command: {wall:.0f} s ({wall / 60:.1f} min)"] if wall is not None else []),
        *([f"* the last fresh run of every module (`make mutation`): {fresh['date']} at commit `{fresh['commit']}`, "
           f"wall {fresh['wall_s']:.0f} s ({fresh['wall_s'] / 60:.1f} min), {fresh['load']}"]
          if (fresh := _last_fresh()) is not None and argv else []),
        "",
        "A mutant is *killed* when the module's tests fail (or time out) on it; *equivalent* when "
        "no test can tell it from the original (one line each below); *not reached* when no selected test "
        "calls its function (mutmut's stats run: status \"no tests\"), so it was never run; anything else "
        "*survived*.  Survivors and not-reached mutants fail the run.",
        "",
        "*wall*: the module's full run (mutant generation, the stats run, every mutant); a rerun "
        "(`--keep`) runs only the earlier survivors again, against the tests added since (a kill "
        "stays a kill when tests are only added): its time is in brackets.",
        "",
        "| module | tests | mutants | killed | equivalent | not reached | survived | score | wall |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m, non_eq = r["module"], r["total"] - len(r["equivalent"])
        score = f"{100 * r['killed'] / non_eq:.1f} %" if non_eq else "n/a"
        tests = "<br>".join(f"`{t}`" for t in m.tests)
        only = "<br>only " + ", ".join(f"`{f.split('ǁ')[-1].removeprefix('x_')}`" for f in m.functions) \
            if m.functions else ""
        lines.append(f"| `{m.path}`{only} | {tests} | {r['total']} | {r['killed']} | {len(r['equivalent'])} | "
                     f"{sum(r['not_reached'].values())} | {len(r['survived'])} | {score} | {r['wall_s']:.0f} s"
                     + (f" ({r['rerun_s']:.0f} s)" if r["rerun_s"] is not None else "") + " |")
    tot = sum(r["total"] for r in rows)
    k = sum(r["killed"] for r in rows)
    eq = sum(len(r["equivalent"]) for r in rows)
    sv = sum(len(r["survived"]) for r in rows)
    nr = sum(sum(r["not_reached"].values()) for r in rows)
    lines += [f"| **all** | | {tot} | {k} | {eq} | {nr} | {sv} | "
              f"{100 * k / max(tot - eq, 1):.1f} % | {sum(r['wall_s'] for r in rows):.0f} s |", ""]
    lines += ["## Not reached", ""] + (not_reached_lines(rows) or ["None."]) + [""]
    for title, key in (("Survivors", "survived"), ("Equivalent mutants", "equivalent")):
        items = [(r["module"].name, it) for r in rows for it in r[key]]
        lines += [f"## {title}", ""]
        if not items:
            lines += ["None.", ""]
            continue
        for mod, it in items:
            if key == "survived":
                lines.append(f"* `{mod}` `{it[0]}` ({it[1]}): `{it[2]}`")
            else:
                lines.append(f"* `{mod}` `{it[0]}`: `{it[1]}` — {it[2]}")
        lines.append("")
    path.write_text("\n".join(lines))


def not_reached_lines(rows: list[dict]) -> list[str]:
    """One Markdown line per function whose mutants no selected test reached."""
    return [f"* `{r['module'].name}` `{fn}`: {n} mutant{'s' * (n != 1)} never run: no test of "
            + ", ".join(f"`{t}`" for t in r["module"].tests) + " calls it"
            for r in rows for fn, n in sorted(r["not_reached"].items())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=None, help="module names (the MODULES table) to run")
    p.add_argument("--keep", action="store_true", help="reuse build/mutation/ (mutmut's cached results)")
    p.add_argument("--report", type=Path, default=REPORT, help="where the Markdown report goes")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per module before it counts as failed")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: classify the verdicts already in build/mutation/ and write the report")
    args = p.parse_args(argv)
    names = {m.name for m in MODULES}
    bad = set(args.only or ()) - names
    if bad:
        p.error(f"--only: unknown module(s) {sorted(bad)}; known: {sorted(names)}")
    mods = [m for m in MODULES if args.only is None or m.name in args.only]
    rows, load, t0 = [], LoadSampler(), time.monotonic()
    for m in mods:
        print(f"mutation: {m.name} ({m.path}) against {' '.join(m.tests)}", flush=True)
        r = run_module(m, args.keep, args.timeout, args.report_only)
        print(f"  {r['total']} mutants: {r['killed']} killed, {len(r['equivalent'])} equivalent, "
              f"{sum(r['not_reached'].values())} not reached, {len(r['survived'])} survived "
              f"({r['wall_s']:.0f} s)", flush=True)
        for fn, n in sorted(r["not_reached"].items()):
            print(f"  not reached: {fn} ({n} mutants; no selected test calls it)", flush=True)
        for s in r["survived"]:
            print(f"  survived {s[0]} ({s[1]}): {s[2]}", flush=True)
        rows.append(r)
    shown = list(argv if argv is not None else sys.argv[1:])
    wall, load_line = (None, "") if args.report_only else (time.monotonic() - t0, load.stop())
    if not args.keep and not args.report_only and args.only is None:  # the fresh run of every module
        FRESH.write_text(json.dumps(dict(date=f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
                                         commit=_git("rev-parse", "--short", "HEAD"), wall_s=wall, load=load_line)))
    write_report(rows, args.report, shown, load_line, wall)
    print(f"report: {args.report.relative_to(ROOT) if args.report.is_relative_to(ROOT) else args.report}")
    return 1 if any(r["survived"] or r["not_reached"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
