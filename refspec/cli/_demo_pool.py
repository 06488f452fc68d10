"""Run the demo's independent runs in worker processes, one core each.

On a CPU the demo is ~150 CPU-seconds of single-threaded model work in 7 runs that share nothing
but the model (:mod:`refspec.cli._demo_runs`).  A second torch thread in one process gains little
(171 -> 151 s on 2 cores); a second process gains 2x (measured: a run takes the same wall time
alone and beside another run): benchmarks/results/cpu_demo_profile.md.  So the parent hands the
runs to ``jobs`` spawned processes:

* the model goes to each worker once, as a ``Process`` argument: ``torch.multiprocessing``
  pickles its tensors as handles to shared memory (``model.share_memory()``), so no worker
  reloads the GGUF and the 540 MB of fp32 weights exist once;
* the runs go out longest first over a task queue (:func:`~refspec.cli._demo_runs.longest_first`);
* every message comes back over one event queue: ``("tokens", i, n)`` for the progress bar,
  ``("done", i, outcome)``, ``("invariant", i, (ID, detail))`` or ``("error", i, traceback)``.

Errors: an :class:`~refspec.core.invariants.InvariantError` in a worker is raised again in the
parent with the same ID and detail (so the same message); any other exception is raised again
as is (a RuntimeError with its type and message if it does not pickle), the worker's traceback
as its ``__cause__``; a worker that dies raises RuntimeError.  On an error or Ctrl-C the parent
terminates its workers and joins them before it returns, and so on SIGTERM (exit status 143);
the workers ignore SIGINT (the parent owns Ctrl-C) and exit by themselves if the parent is gone.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import traceback

from refspec.core.invariants import InvariantError
from refspec.real.run import TokenBar


def run_in_processes(fn, model, calls: list[dict], order: list[int], *, jobs: int, threads: int = 1,
                     bar=None) -> list:
    """``[fn(model, bar=..., **calls[i]) for i in range(len(calls))]``, computed by ``jobs`` workers.

    ``fn`` must be a module-level function (workers import it by name) whose result pickles;
    ``order``: the indices in the order to start them; ``threads``: torch threads per worker.
    ``bar``: the parent's :class:`~refspec.real.run.TokenBar` (or None): each worker's token
    counts go to its :meth:`add`, and its postfix shows ``runs done / total``.  Raises what a
    worker raised (InvariantError: same ID and detail), or RuntimeError if a worker died.
    """
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    model.share_memory()  # the workers map these pages: one copy of the weights
    tasks, events = ctx.Queue(), ctx.Queue()
    jobs = max(1, min(jobs, len(calls)))
    for i in order:
        tasks.put((i, calls[i]))
    for _ in range(jobs):
        tasks.put(None)  # one stop sign per worker: a worker never waits on an empty queue
    procs = [ctx.Process(target=_worker, args=(fn, model, threads, tasks, events, os.getpid()),
                         name=f"refspec-demo-{w}", daemon=True) for w in range(jobs)]
    results: dict[int, object] = {}
    quiet = False  # the previous wait found a worker gone and no message
    old_term = _exit_on_sigterm()
    try:
        for p in procs:
            p.start()
        if bar is not None:
            bar.note(f"runs 0/{len(calls)} ({jobs} processes)")
        while len(results) < len(calls):
            try:
                kind, i, payload = events.get(timeout=1.0)
            except queue.Empty:
                gone = _gone(procs)
                if gone and quiet:  # a second empty wait: its last message, if any, has been read
                    raise RuntimeError(gone) from None
                quiet = bool(gone)
                continue
            quiet = False
            if kind == "tokens":
                if bar is not None:
                    bar.add(payload)
            elif kind == "done":
                results[i] = payload
                if bar is not None:
                    bar.note(f"runs {len(results)}/{len(calls)} ({jobs} processes)")
            elif kind == "invariant":  # rebuilt from (ID, detail): the same message as in one process
                raise InvariantError(*payload[0]) from WorkerTraceback(payload[1])
            else:
                raise payload[0] from WorkerTraceback(payload[1])
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return [results[i] for i in range(len(calls))]


def _exit_on_sigterm():
    """In the main thread: SIGTERM raises SystemExit(143) (so the ``finally`` above terminates the
    workers, as for Ctrl-C) and the previous handler is returned; elsewhere None (no change)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def term(signum, frame):
        raise SystemExit(128 + signum)
    return signal.signal(signal.SIGTERM, term)


class WorkerTraceback(Exception):
    """The ``__cause__`` of an error raised again in the parent: the worker's traceback, as text."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def _picklable(e: Exception) -> Exception:
    """``e`` if it survives pickling (so the parent raises the same type), else a RuntimeError
    with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")


def _gone(procs) -> str | None:
    """Why the runs cannot finish, if a worker died (killed, out of memory) or all have exited."""
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    if dead or all(p.exitcode == 0 for p in procs):
        p = (dead or procs)[0]
        return f"demo worker {p.name} (pid {p.pid}) exited with code {p.exitcode} before its runs were done"
    return None


class _QueueBar:
    """A worker's stand-in for :class:`~refspec.real.run.TokenBar` (its ``start_run``,
    ``observer`` and ``finish_run``, no tqdm): each count goes to the parent as ``("tokens",
    run index, n)``; exits the worker if the parent is gone."""

    observer, finish_run = TokenBar.observer, TokenBar.finish_run  # the same counting, through add

    def __init__(self, events, parent: int):
        self.events, self.parent, self.index, self._run_done = events, parent, -1, 0

    def start_run(self, label: str) -> None:
        self._run_done = 0

    def add(self, n: int) -> None:
        if os.getppid() != self.parent:  # the parent died without terminating us: stop
            os._exit(1)
        self._run_done += n
        if n:
            self.events.put(("tokens", self.index, n))


def _worker(fn, model, threads: int, tasks, events, parent: int) -> None:
    """One worker: take ``(i, kwargs)`` tasks until the stop sign; report each result or error."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which terminates us
    torch.set_num_threads(threads)
    bar = _QueueBar(events, parent)
    while (task := tasks.get()) is not None:
        i, kwargs = task
        bar.index = i
        try:
            out = fn(model, bar=bar, **kwargs)
        except InvariantError as e:  # its __init__ takes (ID, detail): send those, not the object
            events.put(("invariant", i, ((e.inv_id, e.detail), traceback.format_exc())))
            return
        except Exception as e:  # noqa: BLE001 - the parent raises it, this traceback as its cause
            events.put(("error", i, (_picklable(e), traceback.format_exc())))
            return
        events.put(("done", i, out))
