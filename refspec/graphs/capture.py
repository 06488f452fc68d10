"""CUDA graphs, real and emulated: what a capture freezes (CG-001, CG-006); the runner that pads
batches into them is :mod:`refspec.graphs.runner` (CG-005, CG-007).

**What a graph freezes.**  A captured CUDA graph replays the recorded kernel launches with the
*addresses* of every buffer that existed before capture and the *values* of every host scalar
(``max_seqlen_q``, page-table width, ``causal``) of that moment.  Replay re-reads only device
memory.  So replay-time metadata must be *written into* the capture-time buffers; a rebound
Python attribute is invisible to the graph (CG-001), and a bigger live query than the frozen
``max_seqlen_q`` is undefined (CG-006).

**The emulated graph (CPU).**  :class:`EmulatedGraph` gives the same contract without a GPU.
Every launch that takes metadata goes through :func:`launch`, which names its arguments:
``static`` tensors (pre-existing buffers: KV pools, metadata, runner inputs) are recorded *by
identity* at capture and reused at replay whatever the live code passes; ``scalars`` are
recorded *by value*; ``live`` tensors are activations computed inside the graph and are taken
from the current run (a real graph recomputes them into the same internal buffers).  Hence, on
CPU exactly as on a GPU: rebinding a buffer instead of writing into it silently replays the stale
buffer, and the emulator kernel raises if a live query outgrows the frozen ``max_seqlen_q``.
The emulated graph freezes only :func:`launch` arguments: the host Python between two launches
(index arithmetic, ``.tolist()``, a branch on a value) runs again at every replay, where a real
graph would replay only the kernels it recorded, so host code inside a captured forward can pass
here and still be wrong under CUDA.  On CUDA, :func:`launch` is a plain call and
``torch.cuda.CUDAGraph`` does the freezing.
Kernel entry points are wrapped once, where they are defined (:func:`recordable`), so that a
forward reads as plain calls.
"""

from __future__ import annotations

import functools
import gc

import torch


class EmulatedGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` with the same freezing rules (module doc)."""

    _current: "EmulatedGraph | None" = None

    def __init__(self):
        self._tape: list[tuple] = []
        self._fn = None
        self._replaying = False
        self._cursor = 0

    def capture(self, fn):
        """Run ``fn()`` once, recording its launches; returns its output (garbage by design)."""
        EmulatedGraph._current, self._replaying, self._tape = self, False, []
        try:
            out = fn()
        finally:
            EmulatedGraph._current = None
        self._fn = fn
        return out

    def replay(self):
        """Re-run the captured callable with every launch's static args and scalars frozen."""
        if self._fn is None:
            raise RuntimeError("EmulatedGraph.replay before capture")
        EmulatedGraph._current, self._replaying, self._cursor = self, True, 0
        try:
            out = self._fn()
            if self._cursor != len(self._tape):
                raise RuntimeError(f"replay made {self._cursor} launches, capture made {len(self._tape)}")
        finally:
            EmulatedGraph._current = None
        return out


def launch(kernel, *, live: dict | None = None, static: dict | None = None, scalars: dict | None = None):
    """Call ``kernel(**live, **static, **scalars)`` as a graph-recordable launch (module doc)."""
    live, static, scalars = live or {}, static or {}, scalars or {}
    g = EmulatedGraph._current
    if g is None:
        return kernel(**live, **static, **scalars)
    if not g._replaying:
        g._tape.append((kernel, static, scalars))
        return kernel(**live, **static, **scalars)
    kernel0, static0, scalars0 = g._tape[g._cursor]
    g._cursor += 1
    if kernel0 is not kernel:
        raise RuntimeError(f"replay launch {g._cursor - 1}: {kernel.__name__} where capture had {kernel0.__name__}")
    return kernel0(**live, **static0, **scalars0)


def recordable(kernel, *, static: tuple[str, ...]):
    """``kernel`` as a graph-recordable launch, called with keyword arguments only: the ``static``
    ones are recorded by identity (graph buffers), every other tensor is live, every other value
    (sizes, flags, the provider) a scalar recorded by value, as a CUDA graph freezes it."""
    static = frozenset(static)

    @functools.wraps(kernel)
    def call(**kw):
        live, frozen, scalars = {}, {}, {}
        for name, x in kw.items():
            (frozen if name in static else live if isinstance(x, torch.Tensor) else scalars)[name] = x
        return launch(kernel, live=live, static=frozen, scalars=scalars)
    return call


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the :class:`EmulatedGraph` interface.

    Capture follows the usual recipe: two warm-up runs on a side stream, then capture into a
    memory pool shared by all graphs of one runner.  The cyclic garbage collector is paused
    during capture: a collection inside the capture can destroy an unreachable older graph (or
    free its pool), a CUDA call that is forbidden while a stream captures and that invalidates
    the capture ("operation failed due to a previous error during capture"; seen on the H200
    before this rule, intermittently).  It is not *run* before each capture: once
    ``torch.compile`` has run, a full collection took 0.21-0.29 s on the H200 host, per graph
    (9 per engine in the demo: 3 phases x 3 batch sizes).  SGLang instead collects once and
    ``gc.freeze()``-s around its whole capture loop (``freeze_gc`` in
    ``python/sglang/srt/model_executor/runner/base_cuda_graph_runner.py``, v0.5.23); pausing
    is enough for the rule above.
    """

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.output = None

    def capture(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.output = fn()
        finally:
            gc.enable()
        return self.output

    def replay(self):
        self.graph.replay()
        return self.output


def make_graph(device: torch.device, pool=None):
    """A real CUDA graph on CUDA devices, an emulated one elsewhere."""
    return CudaGraph(pool) if torch.device(device).type == "cuda" else EmulatedGraph()
