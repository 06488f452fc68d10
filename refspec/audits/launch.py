"""Count the host's work per round: torch ops dispatched outside the CUDA graphs, by site.

On a GPU every torch op the host dispatches on a device tensor is at least one kernel launch
(a few microseconds of host time each, plus Python around it), while a CUDA-graph replay is one
launch whatever it holds.  :func:`host_ops` counts exactly that, on any device:

* every aten op dispatched while the probe is active (a ``TorchDispatchMode``), by call site
  ``(path, function)`` = the innermost ``refspec`` frame, and by op name;
* a graph replay (``EmulatedGraph.replay`` / ``CudaGraph.replay``) as ONE op, ``graph_replay``,
  at the runner that replays it: the ops inside an emulated replay (the model, on CPU) are not
  counted, as on a GPU where they are the graph's own kernels.

So on a CPU the count of a round is the count of host launches the same round makes on a GPU
(tensor factories from host lists included: on a GPU those are the pinned staging copies), and
a test can pin it (``tests/test_launch_audit.py``).  Phases are those of
:func:`refspec.audits.sync.phases`: ``launch k`` (building and launching round k) and
``commit k`` (reading and applying it).

``python -m refspec.audits.launch --device cpu --tiny`` prints ops per round by
site (v2, overlap, graphs, validation off); ``--device cuda`` the same on the GPU, where each
op on a device tensor is a kernel launch or a copy.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refspec.graphs import capture
from refspec.audits.sync import audit_workload, phases

#: ops that never reach a device (metadata only: views, shape queries); not counted
_FREE = ("aten::view", "aten::_unsafe_view", "aten::alias", "aten::detach", "aten::t", "aten::expand",
         "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::split", "aten::split_with_sizes",
         "aten::unbind", "aten::as_strided", "aten::transpose", "aten::permute", "aten::reshape", "aten::chunk",
         "aten::narrow", "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
         "aten::is_pinned")


#: helpers whose ops are charged to their caller (the host -> device copies of core/transfer.py)
_TRANSPARENT = {("core/transfer.py", "h2d"), ("core/transfer.py", "h2d_many")}


def _site(frame) -> tuple[str, str]:
    """Innermost frame inside the refspec package, not this module nor a
    :data:`_TRANSPARENT` helper: ``(path, function)``."""
    f = frame
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/refspec/" in name and not name.endswith(("audits/launch.py", "audits/sync.py")):
            site = name.split("/refspec/", 1)[1], f.f_code.co_name
            if site not in _TRANSPARENT:
                return site
        f = f.f_back
    return "<outside refspec>", ""


class _Count(TorchDispatchMode):
    def __init__(self, seen: Counter, state: dict):
        super().__init__()
        self.seen, self.state = seen, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not self.state["paused"] and name not in _FREE:
            self.seen[(self.state["now"](), *_site(sys._getframe(1)), name.removeprefix("aten::"))] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_ops(now=lambda: ""):
    """Count host-dispatched ops while active: yields a ``Counter`` of ``(phase, path, function,
    op)`` (module doc); ``now()`` names the current phase.  Graph replays count once each."""
    seen: Counter = Counter()
    state = {"paused": False, "now": now}
    saved = {cls: cls.replay for cls in (capture.EmulatedGraph, capture.CudaGraph)}

    def counted(orig):
        def replay(self):
            if not state["paused"]:
                seen[(now(), *_site(sys._getframe(1)), "graph_replay")] += 1
            paused, state["paused"] = state["paused"], True
            try:
                return orig(self)
            finally:
                state["paused"] = paused
        return replay

    for cls, orig in saved.items():
        cls.replay = counted(orig)
    try:
        with _Count(seen, state):
            yield seen
    finally:
        for cls, orig in saved.items():
            cls.replay = orig


@contextlib.contextmanager
def host_time():
    """CPU seconds (this thread) of the overlap loop's launch and commit phases minus the graph replays in
    them (a CPU proxy of the host's share of a round): yields ``{"launch": s, "commit": s}``,
    filled as the loop runs.  Not under :func:`host_ops` (its stack walks dominate)."""
    from refspec.speculative import overlap

    out, replay_s = {"launch": 0.0, "commit": 0.0}, [0.0]
    saved = overlap.launch, overlap.finish, capture.EmulatedGraph.replay, capture.CudaGraph.replay

    def timed(kind, f):
        def run(*a, **k):
            t, r = time.thread_time(), replay_s[0]
            try:
                return f(*a, **k)
            finally:
                out[kind] += time.thread_time() - t - (replay_s[0] - r)
        return run

    def untimed(orig):
        def replay(self):
            t = time.thread_time()
            try:
                return orig(self)
            finally:
                replay_s[0] += time.thread_time() - t
        return replay

    overlap.launch, overlap.finish = timed("launch", saved[0]), timed("commit", saved[1])
    capture.EmulatedGraph.replay, capture.CudaGraph.replay = untimed(saved[2]), untimed(saved[3])
    try:
        yield out
    finally:
        overlap.launch, overlap.finish, capture.EmulatedGraph.replay, capture.CudaGraph.replay = saved


def round_ops(eng) -> Counter:
    """Run ``eng`` under :func:`host_ops` with its loop phases labelled: a ``Counter`` of
    ``(phase kind, path, function, op)``, phase kind "launch" / "commit" / "prefill" / "setup"."""
    with phases(eng) as state:
        with host_ops(lambda: state["now"].split()[0]) as seen:
            eng.run()
    return seen


def per_round(ops: Counter, rounds: int, phase: str = "launch") -> float:
    """Ops per round of one phase kind."""
    return sum(n for (ph, *_), n in ops.items() if ph == phase) / max(rounds, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m refspec.audits.launch",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="the tiny test config instead of SmolLM2's shapes")
    ap.add_argument("--top", type=int, default=40)
    ns = ap.parse_args(argv)
    from refspec.model.drafts import make_draft
    from refspec.speculative.engine import Engine

    dev = torch.device(ns.device)
    model, prompts = audit_workload(dev, ns.tiny, ns.batch)
    cfg = model.config
    def engine():
        eng = Engine(model, make_draft("early-exit:" + str(max(1, cfg.num_hidden_layers * 5 // 6)), model),
                     version="v2", num_steps=3, page_size=ns.page_size, max_context=max(map(len, prompts)) +
                     ns.max_new_tokens, max_batch=ns.batch, graphs=True, capture_bs=sorted({1, 2, 4, 8, ns.batch}),
                     validate=False, overlap=True)
        for i, p in enumerate(prompts):
            eng.add_request(i, p, ns.max_new_tokens)
        return eng

    eng = engine()
    with host_time() as host_s:
        eng.run()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    eng = engine()
    ops = round_ops(eng)
    rounds = eng.rounds_launched
    print(f"device {dev}, v2 overlap, B = {ns.batch}, rounds {rounds}")
    if dev.type == "cpu":
        print("note: a CPU run counts the ops the host dispatches (the same count as on the GPU); its "
              "milliseconds say nothing about a GPU's host time (bench --sections host measures that)")
    print("host CPU ms per round outside graph replays: " +
          ", ".join(f"{k} {1e3 * v / max(rounds, 1):.2f}" for k, v in host_s.items()))
    for ph in ("launch", "commit"):
        print(f"host ops per round, {ph}: {per_round(ops, rounds, ph):.1f}")
    by_site: Counter = Counter()
    for (ph, path, fn, op), n in ops.items():
        if ph in ("launch", "commit"):
            by_site[(ph, f"{path}:{fn}", op)] += n
    for (ph, site, op), n in by_site.most_common(ns.top):
        print(f"  {n / max(rounds, 1):7.2f}  {ph:7s} {site:55s} {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
