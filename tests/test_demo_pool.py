"""The demo's runs in worker processes (``demo --jobs 2``, :mod:`refspec.cli._demo_pool`) give the
same table as one after the other in one process (``--jobs 1``), and a worker's failure reaches
the parent.

A random-init tiny model (fp32, CPU, the FA3 emulator), the eagle draft, chain and tree rows.  The
reference for the parallel table is the serial table (same rows, tokens, accept counts, pages,
audited rounds); the serial one is itself checked against plain greedy by its own columns and by
tests/test_tree_fa3_loop.py::test_demo_matrix_topk_rows.
"""

from __future__ import annotations

import multiprocessing

import pytest

from refspec.cli.demo import run_matrix
from refspec.cli._demo_runs import longest_first, plan_runs
from refspec.core.invariants import InvariantError
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.real.run import TokenBar

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 3, 3]]
BUDGETS = [18, 12, 15]
MATRIX = dict(page_sizes=(1, 16), versions=("v1", "v2"), draft="eagle", num_steps=3, topk=2, num_draft_tokens=4)


@pytest.fixture(scope="module")
def model():
    return init_random_(LlamaModel(tiny_config()), seed=0).eval()


class CountingBar(TokenBar):
    """The demo's bar, not drawn, summing what it is given."""

    def __init__(self):
        super().__init__(0, disable=True)
        self.total = 0

    def add(self, n):
        super().add(n)
        self.total += n


def _table(res):
    """Everything of a DemoResult but the wall times."""
    rows = [(r.path, r.page_size, r.batch, r.version, r.accept_length, r.tokens, r.spec_eq_greedy, r.prod_eq_oracle)
            for r in res.rows]
    outs = {k: (o.tokens, o.accepts, o.free_pages, o.round_accept_lengths, [q.finish_reason for q in o.requests])
            for k, o in res.outputs.items()}
    return rows, res.greedy_tokens, outs, res.rounds_audited, res.kv_ok


def test_two_processes_give_the_serial_table(model):
    bars = CountingBar(), CountingBar()
    serial = run_matrix(model, PROMPTS, BUDGETS, jobs=1, bar=bars[0], **MATRIX)
    parallel = run_matrix(model, PROMPTS, BUDGETS, jobs=2, bar=bars[1], **MATRIX)
    assert _table(parallel) == _table(serial)
    n_runs = 2 + 2 + 2 * 2 + 2 * (1 + 2)  # greedy x 2, oracle per version, production per (v, P), tree rows
    assert [r.path for r in parallel.rows].count("production tree") == 4 and len(parallel.rows) == n_runs
    assert serial.ok and parallel.rounds_audited > 0
    # the bar: each run tops up to the batch's budget, whichever process ran it
    assert bars[0].total == bars[1].total == n_runs * sum(BUDGETS)
    assert bars[1].bar.postfix.startswith(f"runs {n_runs}/{n_runs}")
    assert multiprocessing.active_children() == []  # every worker joined


def _raised_serial_and_parallel(model, exc_type, **kw):
    """The exceptions ``run_matrix`` raises with ``jobs=1`` and ``jobs=2`` on the same matrix."""
    got = []
    for jobs in (1, 2):
        with pytest.raises(exc_type) as e:
            run_matrix(model, PROMPTS, BUDGETS, jobs=jobs, **kw)
        got.append(e)
    return got


def test_a_workers_invariant_error_reaches_the_parent_with_its_id(model):
    """N = 99 breaks TR-002's bound (N - 1 <= k + (Sd-1) k^2 = 2 + 2*4 = 10): the tree runs raise, in a worker."""
    serial, parallel = _raised_serial_and_parallel(model, InvariantError, **dict(
        MATRIX, versions=("v1",), page_sizes=(1,), num_draft_tokens=99))
    assert parallel.value.inv_id == "TR-002"
    assert str(parallel.value) == str(serial.value)
    assert "N = 99" in str(parallel.value)
    assert multiprocessing.active_children() == []  # the other worker was stopped and joined


def test_a_workers_other_error_is_raised_again_with_its_traceback(model):
    """page_size 0 is a ValueError of ``generate``: the same type and message as in one process."""
    from refspec.cli._demo_pool import WorkerTraceback

    serial, parallel = _raised_serial_and_parallel(model, ValueError, **dict(
        MATRIX, versions=("v1",), page_sizes=(0,), topk=1))
    assert str(parallel.value) == str(serial.value) == "page_size must be an int >= 1, got 0"
    cause = parallel.value.__cause__
    assert isinstance(cause, WorkerTraceback) and "Traceback" in str(cause) and "_check_args" in str(cause)
    assert multiprocessing.active_children() == []


def test_longest_runs_go_first():
    runs = plan_runs((1, 4), ("v1", "v2"))
    order = [runs[i].path for i in longest_first(runs)]
    assert order == ["oracle loop"] * 2 + ["production"] * 4 + ["greedy", "graph greedy"]
    assert [runs[i].label for i in longest_first(runs)][:3] == ["oracle loop v1", "oracle loop v2", "production v1 P=1"]


def _children(pid: int) -> list[int]:
    """Linux: the pids whose parent is ``pid`` (from /proc)."""
    import os

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_sigterm_to_the_parent_alone_stops_its_workers():
    """``kill -TERM <demo pid>`` (not the process group): the parent terminates and joins its
    workers before it exits with 143, as it does on Ctrl-C; no worker outlives it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from refspec.real import missing_reason

    if not sys.platform.startswith("linux") or missing_reason() is not None:
        pytest.skip(missing_reason() or "reads /proc")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-m", "refspec", "demo", "--no-progress", "--jobs", "2"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, workers = time.monotonic() + 120, []
        while time.monotonic() < deadline and p.poll() is None:
            workers = [c for c in _children(p.pid) if "refspec-demo" in open(f"/proc/{c}/cmdline").read()
                       or "spawn_main" in open(f"/proc/{c}/cmdline").read()]
            if len(workers) >= 2:
                break
            time.sleep(0.5)
        assert len(workers) >= 2, "the demo's two workers never started"
        time.sleep(2)  # inside the runs
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 143
        assert all(not os.path.exists(f"/proc/{w}") or "Z" in open(f"/proc/{w}/stat").read().split()[2]
                   for w in workers), "a worker outlived the parent"
    finally:
        if p.poll() is None:
            p.kill()
