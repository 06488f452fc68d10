"""Time what a learner runs first (behind benchmarks/results/cpu_learner_times.md, issue 43).

    .venv/bin/python benchmarks/learner_times.py [--only check-quick,01,05] [--out FILE]

Runs, one after the other, each in a fresh process from the repository root with this
interpreter: ``python -m refspec check --quick`` and every tutorial as a script
(``python tutorials/NN_name.py``).  For each: exit status, wall seconds and CPU seconds (user +
system of the child and its children, ``resource.getrusage``).  CPU seconds are the work; on a
shared machine the wall time also measures the other jobs, so the machine's load average before
and after is recorded too.  Writes the Markdown table (``--out``, default
``benchmarks/results/cpu_learner_times.md``); with ``--only`` it rewrites just those rows of an
existing table.  The run-time sentences of the tutorials, ``check --help`` and the README quote
these rows, and ``tests/test_runtime_claims.py`` holds them to the table.

An instrument: a learner reading the reference can skip this file.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "cpu_learner_times.md"
#: the table's header: one row per item
HEADER = "| item | command | exit | wall s | CPU s | load before / after | date | commit |"
ROW = re.compile(r"^\| (\S+) \| `([^`]+)` \| (-?\d+) \| (\d+) \| (\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", re.M)


def items() -> dict[str, list[str]]:
    """item name -> argv after the interpreter: ``check-quick``, then ``01`` .. for each tutorial."""
    out = {"check-quick": ["-m", "refspec", "check", "--quick"]}
    for p in sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py")):
        out[p.name[:2]] = [p.relative_to(ROOT).as_posix()]
    return out


def measure(argv: list[str]) -> tuple[int, float, float]:
    """(exit status, wall s, CPU s) of ``python argv`` run from the repository root, with this
    checkout first on ``PYTHONPATH`` (a script's own folder comes first otherwise)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    rc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rc, wall, cpu


def parse(text: str) -> dict[str, tuple]:
    """The table's rows: item -> (command, exit, wall s, CPU s, load, date, commit)."""
    return {m.group(1): (m.group(2), int(m.group(3)), int(m.group(4)), int(m.group(5)),
                         *(g.strip() for g in m.group(6, 7, 8))) for m in ROW.finditer(text)}


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{model}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}"


def _commit() -> str:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def render(rows: dict[str, tuple], header: list[str]) -> str:
    lines = ["# What a learner runs first, timed on a CPU (issue 43)", "", *header, "", HEADER,
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {k} | `{r[0]}` | {' | '.join(str(x) for x in r[1:])} |" for k, r in rows.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated items (check-quick, 01, ...): rewrite just these rows")
    ap.add_argument("--out", type=Path, default=OUT)
    ns = ap.parse_args(argv)
    todo = items()
    if ns.only:
        unknown = set(ns.only.split(",")) - set(todo)
        if unknown:
            ap.error(f"--only: unknown item(s) {sorted(unknown)}; known: {', '.join(todo)}")
        todo = {k: v for k, v in todo.items() if k in ns.only.split(",")}
    rows = parse(ns.out.read_text()) if ns.only and ns.out.is_file() else {}
    commit = _commit()
    for name, args in todo.items():
        load0 = os.getloadavg()[0]
        rc, wall, cpu = measure(args)
        cmd = "python " + " ".join(args)
        rows[name] = (cmd, rc, round(wall), round(cpu), f"{load0:.1f} / {os.getloadavg()[0]:.1f}",
                      date.today().isoformat(), commit)
        print(f"{name:12s} exit {rc}  wall {wall:6.1f} s  CPU {cpu:6.1f} s  ({cmd})", flush=True)
    order = list(items())
    rows = {k: rows[k] for k in order if k in rows}
    header = [
        "Command: `.venv/bin/python benchmarks/learner_times.py` (`--only 01,06` re-times some rows); each item "
        "is a fresh process from the repository root, one after the other.",
        "",
        f"Machine: {_machine()}, shared with other jobs (the load average, 1 minute, before and after each "
        "item).  CPU s (user + system) is the work; wall s also measures the other jobs.",
        "",
        "`check-quick` is `python -m refspec check --quick`; `01` .. are the tutorials run as scripts "
        "(tutorial 08's section 6 with SGLang 0.5.23 already installed in `.conformance/`).  The run-time "
        "sentences in the tutorials, in `check --help` and in the README quote these rows "
        "(`tests/test_runtime_claims.py`).",
    ]
    ns.out.write_text(render(rows, header))
    return 0 if all(r[1] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
