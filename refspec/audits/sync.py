"""Count the host <-> device synchronizations of a production run, by site and by loop phase.

Two probes, both wrapped around :meth:`Engine.run`:

* :func:`host_reads` (any device): every Python-level read of a tensor's values
  (``tolist``, ``item``, ``int()``, ``float()``, ``bool()``, ``__index__``), by call site
  ``(file, function)``.  On a GPU each read of a *device* tensor is a sync; on the CPU it shows
  which sites read values at all, so a test can pin the set of sites to those that read host
  data (the allocator's mirror, the CPU length bounds, the pinned result buffer).
* :func:`cuda_syncs` (CUDA): ``torch.cuda.set_sync_debug_mode("warn")``, under which PyTorch
  warns at every synchronizing CUDA call (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize``
  behind a blocking copy, ``.item()``, ``nonzero``, a copy from pageable memory, ...); each
  warning is attributed to the innermost ``refspec`` frame and to the loop phase (``launch k``:
  building and launching round k; ``commit k``: reading and applying it; ``prefill``).
  ``Event.synchronize`` (the counted result read, :class:`~refspec.core.transfer.ResultCopy`)
  is not a warned call: it is counted in ``Engine.syncs`` instead.

* :func:`profiled_syncs` (CUDA, ``--profiler``): the blocking CUDA runtime calls
  (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ...) counted by ``torch.profiler``.

``python -m refspec.audits.sync --device cuda`` runs a random-init model of
SmolLM2-135M's shapes (v2, overlap, graphs, validation off) and prints both tables; exit 1 when a
``launch`` phase synchronized (``--strict``).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
import warnings
from collections import Counter

import torch

READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


def _site(frames) -> tuple[str, str]:
    """The innermost frame inside the refspec package (not this module): ``(path, function)``."""
    for f in reversed(frames):
        name = f.filename.replace("\\", "/")
        if "/refspec/" in name and not name.endswith("audits/sync.py"):
            return name.split("/refspec/", 1)[1], f.name
    return "<outside refspec>", ""


@contextlib.contextmanager
def host_reads():
    """Count value reads of tensors by call site while active: yields a ``Counter`` of
    ``(path, function, method)``.  Patches ``torch.Tensor`` methods; restores them on exit."""
    seen: Counter = Counter()
    orig = {n: getattr(torch.Tensor, n) for n in READS}

    def wrap(name, f):
        def read(self, *a, **k):
            fr = sys._getframe(1)
            path = fr.f_code.co_filename.replace("\\", "/")
            seen[(path.split("/refspec/", 1)[-1], fr.f_code.co_name, name)] += 1
            return f(self, *a, **k)
        return read

    for n, f in orig.items():
        setattr(torch.Tensor, n, wrap(n, f))
    try:
        yield seen
    finally:
        for n, f in orig.items():
            setattr(torch.Tensor, n, f)


@contextlib.contextmanager
def phases(eng):
    """Label the engine's loop phases: yields a dict whose ``"now"`` is the current phase."""
    from refspec.speculative import overlap, rounds

    state = {"now": "setup"}
    saved = (overlap.launch, overlap.finish, rounds.round_v1, rounds.round_v2, eng._prefill, eng._round)

    def labelled(label, f):
        def run(*a, **k):
            before = state["now"]
            state["now"] = label(a)
            try:
                return f(*a, **k)
            finally:
                state["now"] = before
        return run

    overlap.launch = labelled(lambda a: f"launch {a[0].rounds_launched}", saved[0])
    overlap.finish = labelled(lambda a: f"commit {a[0].trace.__len__()}", saved[1])
    rounds.round_v1 = labelled(lambda a: f"launch {a[0].rounds_launched}", saved[2])  # v1 reads inside: launch
    rounds.round_v2 = labelled(lambda a: state["now"] if state["now"].startswith("launch")
                               else f"launch {a[0].rounds_launched}", saved[3])
    eng._prefill = labelled(lambda a: "prefill", saved[4])
    eng._round = labelled(lambda a: f"commit {eng.rounds_launched}", saved[5])  # non-overlap: read inside
    try:
        yield state
    finally:
        overlap.launch, overlap.finish, rounds.round_v1, rounds.round_v2 = saved[:4]
        del eng._prefill, eng._round


def cuda_syncs(eng) -> Counter:
    """Run ``eng`` under ``set_sync_debug_mode("warn")``: ``Counter`` of ``(phase, path, function)``."""
    seen: Counter = Counter()
    with phases(eng) as state, warnings.catch_warnings():
        warnings.simplefilter("always")

        def hook(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                seen[(state["now"], *_site(traceback.extract_stack()))] += 1

        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.run()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


RUNTIME_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profiled_syncs(eng) -> Counter:
    """Run ``eng`` under ``torch.profiler`` (CPU + CUDA activities): ``Counter`` of the CUDA
    runtime calls that block the host (:data:`RUNTIME_SYNCS`; ``cudaEventSynchronize`` is the
    counted result read), whole run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.run()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.name in RUNTIME_SYNCS)


def _per_phase(seen: Counter) -> Counter:
    kinds = Counter()
    for (phase, *_), n in seen.items():
        kinds[phase.split()[0]] += n
    return kinds


def audit_workload(dev: torch.device, tiny: bool, batch: int):
    """(model, prompts) of the audits: a random-init model of SmolLM2-135M's shapes (or the tiny
    test config), bf16 on CUDA and fp32 elsewhere, and ``batch`` seeded random prompts of
    24, 32, 40, ... tokens."""
    from refspec.model.llama import LlamaConfig, LlamaModel, init_random_, tiny_config

    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                          tie_word_embeddings=True, max_position_embeddings=8192)
    cfg = tiny_config() if tiny else smollm2
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = init_random_(LlamaModel(cfg), seed=0).to(dev, dtype).eval()
    g = torch.Generator().manual_seed(0)
    return model, [torch.randint(0, cfg.vocab_size, (24 + 8 * i,), generator=g).tolist() for i in range(batch)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m refspec.audits.sync", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--version", default="v2", choices=["v1", "v2"])
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="auto: the engine default (on for v2 on CUDA)")
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1,
                    help="k > 1: the EAGLE tree engine (TreeEngine; overlap only with --overlap on, v2)")
    ap.add_argument("--num-draft-tokens", type=int, default=None,
                    help="N tree nodes per request with --topk > 1 (default 2k)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test config instead of SmolLM2's shapes")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a launch phase synchronized")
    ap.add_argument("--profiler", action="store_true",
                    help="count blocking CUDA runtime calls with torch.profiler instead of sync debug warnings")
    ns = ap.parse_args(argv)
    from refspec.model.drafts import make_draft
    from refspec.speculative.engine import Engine

    dev = torch.device(ns.device)
    model, prompts = audit_workload(dev, ns.tiny, ns.batch)
    cfg = model.config
    ctx = max(map(len, prompts)) + ns.max_new_tokens
    engine, tree_kw = Engine, {}
    if ns.topk > 1:
        from refspec.speculative.tree.engine import TreeEngine
        engine, tree_kw = TreeEngine, dict(topk=ns.topk, num_draft_tokens=ns.num_draft_tokens or 2 * ns.topk)
    eng = engine(model, make_draft("early-exit:" + str(cfg.num_hidden_layers * 5 // 6), model), version=ns.version,
                 num_steps=ns.num_steps, page_size=ns.page_size, max_context=ctx, max_batch=ns.batch, graphs=True,
                 capture_bs=sorted({1, 2, 4, 8, ns.batch}), validate=False,
                 overlap={"auto": None, "on": True, "off": False}[ns.overlap], **tree_kw)
    for i, p in enumerate(prompts):
        eng.add_request(i, p, ns.max_new_tokens)
    runtime = Counter()
    with host_reads() as reads:
        if dev.type == "cuda" and ns.profiler:
            runtime, seen = profiled_syncs(eng), Counter()
        elif dev.type == "cuda":
            seen = cuda_syncs(eng)
        else:
            eng.run()
            seen = Counter()
    rounds = eng.rounds_launched
    print(f"device {dev}, {ns.version}, topk {ns.topk}, overlap {eng.overlap}, B = {ns.batch}, rounds {rounds}")
    print(f"counted reads (Engine.syncs): {dict(eng.syncs)}  -> model-result reads per round "
          f"{(eng.syncs['post_round'] + eng.syncs['in_round']) / max(rounds, 1):.2f}")
    print("\nvalue reads by site (any device; on a GPU those of device tensors are syncs):")
    for (path, fn, how), n in sorted(reads.items(), key=lambda x: -x[1]):
        print(f"  {n:6d}  {path}:{fn} ({how})")
    if runtime:
        print(f"\nblocking CUDA runtime calls (torch.profiler), whole run: {dict(runtime)}; per round "
              f"{ {k: round(v / max(rounds, 1), 2) for k, v in runtime.items()} }")
    elif dev.type == "cuda":
        per = _per_phase(seen)
        print(f"\nsynchronizing CUDA calls (set_sync_debug_mode warn): {sum(seen.values())} total; by phase kind "
              f"{dict(per)}; launch phases per round {per['launch'] / max(rounds, 1):.2f}")
        for (phase, path, fn), n in sorted(seen.items(), key=lambda x: (x[0][0].split()[0], -x[1]))[:60]:
            print(f"  {n:6d}  {phase:12s} {path}:{fn}")
        if ns.strict and per["launch"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
