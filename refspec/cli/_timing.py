"""One timing rule for every tokens/s that is compared with graph greedy.

The demo's "x graph greedy" column (CPU and GPU tables), the bench's ``x_graph_greedy`` (``eagle``
section) and its ``peer`` / ``peer spec`` rows, and ``benchmarks/compare_heads.py`` all measure
with :class:`DecodeWindow` and divide with :func:`speedup`, so a ratio printed by one is a ratio
the others agree with.

**The decode window.**  A run's clock starts at its first ``prefill`` event (the engine's or
:func:`~refspec.speculative.greedy.production_greedy`'s ``observer``; the event comes after the
prefill forwards are launched, and the window synchronizes the device before reading the clock,
so the prefill is outside) and stops when the run returns (synchronized).  Its tokens are every
token emitted minus each request's first, which the prefill made.  Graph capture happens when
the engine or the greedy runner is built, before the prefill: outside.  Compilation and other
first-use costs (``torch.compile`` of a new shape, CUDA's lazy kernel loading, the caching
allocator's growth) are paid by a **warm-up run** of the identical workload first
(:func:`timed`; by default one on CUDA, none on a CPU, where nothing is compiled).  Host work of
an instrument called from the observer (the demo's progress bar and per-round KV audit) is
excluded too: :meth:`DecodeWindow.chain` pauses the clock around it.

Why (issue 41): the demo's graph-greedy row used to be timed from before its prefill, on its
first run at the demo's batch shapes (its warm-up was one prompt, two tokens), while its spec
rows were timed from after their prefill, on their second run (the validated run first), so
the demo printed spec v2 at 1.6x "graph greedy" where the bench, timing both sides alike,
measured about 1.0x.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timed:
    """``tokens`` emitted inside a decode window of ``seconds`` (module doc)."""

    tokens: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        """Tokens per second; NaN for an empty window."""
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def speedup(spec: Timed, greedy: Timed) -> float:
    """``spec``'s tokens/s over ``greedy``'s: the "x graph greedy" of the demo and the bench; NaN
    when greedy's window holds no token (every budget 1: nothing after the prefill to compare)."""
    base = greedy.tok_per_s
    return spec.tok_per_s / base if base > 0 else float("nan")


def _sync_for(device) -> Callable[[], None]:
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


class DecodeWindow:
    """The decode window of one run (module doc).

    Pass :meth:`observer` (or :meth:`chain` of it and an instrument's observer) as the run's
    ``observer``, then call :meth:`stop` with the run's tokens.  ``clock``: seconds
    (``time.perf_counter``; tests pass a fake).  Raises RuntimeError from :meth:`stop` if no
    ``prefill`` event came.
    """

    def __init__(self, device, clock: Callable[[], float] = time.perf_counter):
        self.sync, self.clock = _sync_for(device), clock
        self.t0: float | None = None
        self.paused = 0.0  #: seconds of instrument work inside the window (not counted)

    def observer(self, event: str, source=None, **info) -> None:
        if event == "prefill" and self.t0 is None:
            self.sync()
            self.t0 = self.clock()

    def chain(self, other: Callable | None) -> Callable:
        """An observer that runs this window's, then ``other`` with the clock paused."""
        def both(event, source=None, **info):
            self.observer(event, source, **info)
            if other is not None:
                t = self.clock()
                other(event, source, **info)
                if self.t0 is not None:
                    self.paused += self.clock() - t
        return both

    def stop(self, tokens: list[list[int]]) -> Timed:
        """Close the window over a run whose outputs are ``tokens`` (one list per request)."""
        self.sync()
        t1 = self.clock()
        if self.t0 is None:
            raise RuntimeError("the run emitted no 'prefill' event: its decode window never opened")
        return Timed(sum(len(t) for t in tokens) - len(tokens), t1 - self.t0 - self.paused)


def default_warmup(device) -> int:
    """Warm-up runs before the timed one: 1 on CUDA (compilation, lazy loading), 0 elsewhere."""
    return 1 if torch.device(device).type == "cuda" else 0


def timed(run: Callable, device, *, warmup: int | None = None, instrument: Callable | None = None,
          clock: Callable[[], float] = time.perf_counter):
    """``run(observer)`` ``warmup`` times (``observer`` None; default :func:`default_warmup`), then once
    inside a :class:`DecodeWindow`; returns ``(result, Timed)``.  ``run`` returns something with
    ``.tokens`` (one list per request).  ``instrument``: an observer for the timed run whose own
    time is not counted."""
    for _ in range(default_warmup(device) if warmup is None else warmup):
        run(None)
    window = DecodeWindow(device, clock)
    out = run(window.chain(instrument))
    return out, window.stop(out.tokens)


def time_greedy(model, prompts, budgets, *, page_size: int, eos=None, capture_bs=(1, 2, 4, 8), validate=False,
                warmup: int | None = None, clock: Callable[[], float] = time.perf_counter):
    """Graph greedy (:func:`~refspec.speculative.greedy.production_greedy`) timed by :func:`timed`:
    ``(GreedyRun, Timed)``."""
    from refspec.speculative.greedy import production_greedy

    dev = next(model.parameters()).device
    return timed(lambda obs: production_greedy(model, prompts, list(budgets), page_size=page_size, eos=eos,
                                               capture_bs=capture_bs, validate=validate, observer=obs),
                 dev, warmup=warmup, clock=clock)


def time_spec(model, prompts, budgets, *, warmup: int | None = None, instrument: Callable | None = None,
              clock: Callable[[], float] = time.perf_counter, **generate_kw):
    """The production loop (:func:`~refspec.speculative.generate`, ``backend="fa3"`` unless given)
    timed by :func:`timed`: ``(GenerateResult, Timed)``."""
    from refspec.speculative import generate

    dev = next(model.parameters()).device
    generate_kw.setdefault("backend", "fa3")
    return timed(lambda obs: generate(model, prompts, max_new_tokens=list(budgets), observer=obs, **generate_kw),
                 dev, warmup=warmup, instrument=instrument, clock=clock)
