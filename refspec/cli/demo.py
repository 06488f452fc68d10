"""``python -m refspec demo``: SmolLM2-135M-Instruct answers MT-Bench prompts, and speculative
decoding is shown lossless through both wings.

One batch of ChatML-formatted MT-Bench first turns (default 4, round-robin over categories), each
with its own ``max_new_tokens`` and EOS ``<|im_end|>`` so requests leave at different rounds, is
decoded by

1. plain greedy decoding (the baseline, :func:`refspec.oracle.loop.greedy`, dense KV), and graph
   greedy (:func:`~refspec.speculative.greedy.production_greedy`: the production path's greedy,
   the speed baseline);
2. the oracle speculative loop, v1 and v2 (dense, one request at a time);
3. the production loop (:func:`refspec.speculative.generate`, ``backend="fa3"``): paged KV, the FA3
   wing with CUDA graphs -- the real kernel and ``torch.cuda.CUDAGraph`` on Hopper, the contract
   emulator and emulated graphs elsewhere -- for v1 and v2 at each page size, with the
   metadata validation on and the KV accounting audited after every round.

The draft is the trained EAGLE head that ships with refspec (:mod:`refspec.real.eagle_head`:
one decoder layer over the target's embedding and hidden states, real rejections), Sd = 3;
``--draft early-exit:K`` drafts with the model's own first K of 30 layers instead.  Printed: a
progress bar, the table (page size, batch, version, accept length, tokens/s, x graph greedy,
spec == greedy?, production == oracle?), one answer in full.  The graph-greedy and production
rows' tokens/s and their "x graph greedy" are the bench's (:mod:`refspec.cli._timing`: over the
decode window, prefill, capture and the bar / KV audit excluded); the greedy and oracle rows'
tokens/s are over their whole run.  On a CPU speculation buys no speed (see the README); the
table shows acceptance and exactness.  Exit status 1 if any check fails.

The runs are independent (:mod:`refspec.cli._demo_runs`); on a CPU they run in ``--jobs``
worker processes (default min(2, cores), :mod:`refspec.cli._demo_pool`), two at a time with one
core each on a 2-core machine, and are compared once all are back.  A row's tokens/s is that
run's own tokens over its own time, as in a serial run (``--jobs 1``): running beside
another single-threaded run on the other core does not slow it down.

``--bug NAME`` (e.g. ``seed-page-table``) runs :mod:`refspec.cli._demo_bug` instead.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

from refspec.cli._args import (PROG, ArgumentParser, budget_spec, choice_list, device_name, real_workload,
                               draft_spec, int_list, positive_int, run)
from refspec.cli._demo_runs import RunOutcome, execute_run, longest_first, plan_runs
from refspec.cli import _timing
from refspec.fa3.kernel import select_provider
from refspec.core.invariants import InvariantError
from refspec.real.run import (DEFAULT_DRAFT, DEFAULT_NUM_STEPS, TokenBar, capture_sizes, set_threads)

HEADER = ("path", "page size", "batch", "version", "accept length", "tokens/s", "x graph greedy",
          "spec == greedy?", "production == oracle?")


@dataclass
class Row:
    """One line of the table; ``spec_eq_greedy`` / ``prod_eq_oracle`` / ``x_graph`` None where not
    applicable.  ``tokens`` / ``seconds``: the decode window's where the run has one
    (:attr:`~refspec.cli._demo_runs.RunOutcome.timed`), else the whole run's.  A value that does
    not exist prints "-": no accept length without a verify round, no rate over an empty window
    (``--max-new-tokens 1``: every token is the prefill's)."""

    path: str
    page_size: int | None
    batch: int
    version: str | None
    accept_length: float | None
    tokens: int
    seconds: float
    spec_eq_greedy: bool | None = None
    prod_eq_oracle: bool | None = None
    x_graph: float | None = None  #: :func:`~refspec.cli._timing.speedup` over the graph-greedy run

    def cells(self) -> list[str]:
        yn = lambda b, na: na if b is None else ("yes" if b else "NO")
        num = lambda x, f: "-" if x is None or x != x else format(x, f)  # noqa: E731 - None or NaN: "-"
        rate = self.tokens / self.seconds if self.seconds > 0 else None
        return [self.path, "-" if self.page_size is None else str(self.page_size), str(self.batch),
                self.version or "-", num(self.accept_length, ".2f"), num(rate, ".1f"), num(self.x_graph, ".2f"),
                yn(self.spec_eq_greedy, "(baseline)"), yn(self.prod_eq_oracle, "-")]


@dataclass
class DemoResult:
    rows: list[Row]
    greedy_tokens: list[list[int]]
    outputs: dict  #: (version, page size) -> production GenerateResult
    rounds_audited: int  #: production rounds checked by ``audit_kv``
    kv_ok: bool  #: every production run gave all its pages back (KV-006)

    @property
    def ok(self) -> bool:
        return self.kv_ok and all(x is not False for r in self.rows for x in (r.spec_eq_greedy, r.prod_eq_oracle))


def format_table(rows: list[Row]) -> str:
    """Fixed-width text table with :data:`HEADER`."""
    cells = [list(HEADER)] + [r.cells() for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    fmt = lambda c: "  ".join(x.ljust(w[i]) if i == 0 else x.rjust(w[i]) for i, x in enumerate(c))
    return "\n".join([fmt(cells[0]), "  ".join("-" * n for n in w)] + [fmt(c) for c in cells[1:]])


def run_matrix(model, prompts, max_new, *, page_sizes=(1, 4), versions=("v1", "v2"), draft=DEFAULT_DRAFT,
               num_steps=DEFAULT_NUM_STEPS, eos=None, bar: TokenBar | None = None, topk: int = 1,
               num_draft_tokens: int | None = None, jobs: int = 1, threads: int = 1) -> DemoResult:
    """Greedy, graph greedy, the oracle loop per version, the production loop per (page size, version).

    Shapes: ``prompts`` B lists of token ids; ``max_new`` B budgets (tokens).  tokens/s: the
    decode window of :mod:`refspec.cli._timing` for graph greedy and the production runs (the
    bench's timing), each run's whole wall time for greedy and the oracle loops.  ``topk`` > 1
    adds the EAGLE tree (N = ``num_draft_tokens``), per version: the oracle tree loop and the
    production tree loop per page size (docs/spec/tree.md).
    The runs are independent (:mod:`refspec.cli._demo_runs`): ``jobs`` = 1 runs them here, one
    after the other; ``jobs`` > 1 in that many worker processes of ``threads`` torch threads each
    (:mod:`refspec.cli._demo_pool`; the model's tensors move to shared memory).  Either way the
    comparisons are made here once all are back, and the rows come in the same order.
    Raises :class:`~refspec.core.invariants.InvariantError` if the FA3 validation or the
    per-round KV audit trips (in a worker too: same ID, same message).
    """
    runs = plan_runs(page_sizes, versions, topk, num_draft_tokens)
    kw = dict(prompts=prompts, max_new=max_new, draft=draft, num_steps=num_steps, eos=eos)
    if jobs > 1:
        from refspec.cli._demo_pool import run_in_processes

        done = run_in_processes(execute_run, model, [dict(kw, run=r) for r in runs], longest_first(runs),
                                jobs=jobs, threads=threads, bar=bar)
    else:
        done = [execute_run(model, r, bar=bar, **kw) for r in runs]
    return compare_runs(done)


def compare_runs(done: list[RunOutcome]) -> DemoResult:
    """The table from the runs' outcomes (table order, greedy first): spec == greedy for every
    speculative row (and graph greedy); production == oracle (same tokens, same accept count every
    round) against the oracle run of the same version and tree shape; x graph greedy
    (:func:`~refspec.cli._timing.speedup` of the decode windows) for every production row;
    KV-006 for every production run."""
    base = done[0].tokens
    oracle = {o.run.table_version: o.result for o in done if o.run.path.startswith("oracle")}
    graph = next((o.timed for o in done if o.run.path == "graph greedy"), None)
    rows, outputs = [], {}
    for o in done:
        r, B = o.run, len(o.tokens)
        tokens, seconds = (o.timed.tokens, o.timed.seconds) if o.timed else (sum(map(len, o.tokens)), o.seconds)
        row = Row(r.path, r.page_size, B, r.table_version, o.accept_length, tokens, seconds)
        if o.timed is not None and graph is not None:
            row.x_graph = _timing.speedup(o.timed, graph)
        if r.path != "greedy":
            row.spec_eq_greedy = o.tokens == base
        if r.path.startswith("production"):
            ora = oracle[r.table_version]
            row.prod_eq_oracle = o.tokens == ora.tokens and o.result.accepts == ora.accepts
            outputs[r.key] = o.result
        rows.append(row)
    kv_ok = all(r.free_pages[0] == r.free_pages[1] for r in outputs.values() if r.free_pages)  # KV-006
    return DemoResult(rows, base, outputs, sum(o.rounds_audited for o in done), kv_ok)


def tree_round_lines(outputs: dict) -> list[str]:
    """One line per production tree run of ``outputs`` (key ``(label, P)`` with a ``k=`` label):
    its accept length per round, the mean a over the round's requests
    (:attr:`~refspec.speculative.metrics.GenerateResult.round_accept_lengths`)."""
    lines = []
    for (label, P), res in outputs.items():
        if " k=" not in str(label) or not res.round_accept_lengths:
            continue
        per = res.round_accept_lengths
        lines.append(f"production tree {label} P={P}: accept length per round (mean a over the batch, "
                     f"{len(per)} rounds): {' '.join(f'{x:.2f}' for x in per)}")
    return lines


def _check_tree_flags(ns) -> None:
    """Usage errors (exit 2) before the model loads, as ``record`` has them, plus ``--bug`` with
    k > 1 (the bug demo runs the chain loop)."""
    from refspec.cli._args import CLIError, check_tree_flags

    check_tree_flags(ns)
    if ns.topk > 1 and ns.bug:
        raise CLIError("--bug shows a chain variant (top-k = 1); drop --topk")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 if every check passes, 1 if one fails, 2 on a usage error (one line)."""
    return run(_main, argv, f"{PROG} demo")


def _main(argv) -> int:
    from refspec.mutants import variants
    from refspec.real.prompts import CATEGORIES

    ap = ArgumentParser(
        prog=f"{PROG} demo",
        description="SmolLM2-135M-Instruct on MT-Bench: greedy vs the oracle loop vs the production "
                    "loop (FA3, graphs); --bug NAME shows a bug variant live.")
    ap.add_argument("--prompts", type=positive_int(), metavar="N", default=4,
                    help="MT-Bench questions in the batch (default 4)")
    ap.add_argument("--category", choices=CATEGORIES, help="take the questions from this MT-Bench category only")
    ap.add_argument("--max-new-tokens", type=budget_spec, metavar="M[,M...]", default="40,32,24,16",
                    help="new tokens per request: a comma-separated list (cycled over the requests) or one "
                         "int M (staggered: M, less, ..., about M/2); default 40,32,24,16")
    ap.add_argument("--page-sizes", type=int_list(1, "page sizes"), default=[1, 4], metavar="P[,P...]",
                    help="page sizes of the production runs, comma-separated (default 1,4)")
    ap.add_argument("--versions", type=choice_list(["v1", "v2"], "versions"), default=["v1", "v2"],
                    metavar="V[,V...]", help="speculative-decoding versions, comma-separated (default v1,v2)")
    ap.add_argument("--draft", type=draft_spec, metavar="SPEC", default=DEFAULT_DRAFT,
                    help="the draft: eagle (default: the trained head, refspec/real/heads), eagle3:PATH (an EAGLE-3 "
                         "head trained by train-draft --kind eagle3) or early-exit:K (the target's first K of 30 "
                         "layers)")
    ap.add_argument("--num-steps", type=positive_int(), metavar="SD", default=DEFAULT_NUM_STEPS,
                    help="draft steps per round, Sd (default 3)")
    ap.add_argument("--topk", type=positive_int(), metavar="K", default=1,
                    help="k > 1 adds EAGLE tree rows (per --versions; default 1: the chain only)")
    ap.add_argument("--num-draft-tokens", type=positive_int(2), metavar="N",
                    help="tree nodes verified per round with --topk, root included (default 2k)")
    ap.add_argument("--bug", choices=sorted(variants.CHAIN_VARIANTS), metavar="NAME",
                    help="show one bug-zoo variant live instead, e.g. seed-page-table (names: "
                         "python -m refspec mutants, or docs/bug-zoo.md)")
    ap.add_argument("--threads", type=positive_int(), metavar="N",
                    help="torch CPU threads per process (default 1: faster on a shared machine)")
    ap.add_argument("--jobs", type=positive_int(), metavar="N", default=default_jobs(),
                    help=f"CPU: worker processes the independent runs share (default {default_jobs()}: "
                         "min(2, CPU cores)); 1 runs them one after the other in this process")
    ap.add_argument("--device", type=functools.partial(device_name, auto=True), default="auto",
                    help="auto (default): the GPU when it is a Hopper GPU with the real FA3 kernel, else the CPU")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
    ns = ap.parse_args(argv)
    _check_tree_flags(ns)
    from refspec.real import EOS_ID, decode

    t0 = time.perf_counter()
    threads = set_threads(ns.threads)
    qs, max_new, model, load_s, prompts = real_workload(ns)
    page_sizes, versions = ns.page_sizes, ns.versions
    if _pick_device(ns.device) == "cuda" and not ns.bug:
        return _main_gpu(model, qs, prompts, max_new, page_sizes, versions, ns, load_s, t0)
    if ns.bug:
        from refspec.cli._demo_bug import run_bug_demo

        return run_bug_demo(model, qs, prompts, max_new, ns.bug, page_size=max(page_sizes), draft=ns.draft,
                            num_steps=ns.num_steps, eos=EOS_ID, progress=not ns.no_progress)
    dev = next(model.parameters()).device
    runs = plan_runs(page_sizes, versions, ns.topk, ns.num_draft_tokens)
    jobs = min(ns.jobs, len(runs))
    print(f"SmolLM2-135M-Instruct (fp32, loaded in {load_s:.1f} s); {len(runs)} runs in {jobs} process(es) x "
          f"{threads} thread(s); draft {ns.draft}, Sd = {ns.num_steps}; FA3 provider: {select_provider(dev)}, "
          f"graphs: {'CUDA' if dev.type == 'cuda' else 'emulated'}")
    for q, p, m in zip(qs, prompts, max_new):
        print(f"  q{q['question_id']} [{q['category']}] {len(p)} prompt tokens, max_new_tokens {m}: "
              f"{q['prompt'][:70]!r}{'...' if len(q['prompt']) > 70 else ''}")
    bar = TokenBar(len(runs) * sum(max_new), desc="demo", disable=ns.no_progress)
    try:
        res = run_matrix(model, prompts, max_new, page_sizes=page_sizes, versions=versions, draft=ns.draft,
                         num_steps=ns.num_steps, eos=EOS_ID, bar=bar, topk=ns.topk,
                         num_draft_tokens=ns.num_draft_tokens, jobs=jobs, threads=threads)
    except InvariantError as e:  # a validation / audit check stopped a production run
        bar.close()
        print(f"\nCHECK FAILED: {e}")
        return 1
    bar.close()
    print()
    print(format_table(res.rows))
    print("\ntokens/s of graph greedy and production: after the prefill, capture, progress bar and KV audit "
          "excluded, the bench's timing (refspec.cli._timing); greedy and oracle loop: their whole run.")
    print(f"KV accounting audited after each of {res.rounds_audited} production rounds (PA-001, KV-002, "
          f"KV-004/005, SD-008); every page freed at the end (KV-006): {'yes' if res.kv_ok else 'NO'}; "
          f"FA3 metadata validated before every kernel call.")
    for line in tree_round_lines(res.outputs):
        print(line)
    # the longest answer, from the last production run (== greedy when the table says so)
    last = res.outputs[(versions[-1], page_sizes[-1])]
    i = max(range(len(prompts)), key=lambda j: len(last.tokens[j]))
    r = last.requests[i]
    print(f"\nq{qs[i]['question_id']} [{qs[i]['category']}] {qs[i]['prompt']}\n")
    print(f"answer (production {versions[-1]}, P={page_sizes[-1]}; {len(r.tokens)} tokens, "
          f"finish: {r.finish_reason}, a per round {r.accepts}):")
    print(decode(r.tokens, skip_special=True))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s; {'all checks pass' if res.ok else 'SOME CHECKS FAILED'}")
    print(next_steps())
    return 0 if res.ok else 1


def next_steps() -> str:
    """The demo's closing lines: where a learner goes next (the README's "Learn it"), as commands
    for the Python that ran the demo (``.venv/bin/python`` under ``make demo``)."""
    import sys

    exe = os.path.relpath(sys.executable)
    exe = sys.executable if exe.startswith("..") else exe
    return (f"\nNext, the tutorials (README, \"Learn it\"; the set-up is `make demo`'s, or `make tutorials`):\n"
            f"  {exe} tutorials/01_paged_kv_cache.py\n  {exe} tutorials/03_forward_modes.py\n"
            "or open them all in JupyterLab: make lab")


def default_jobs() -> int:
    """The CPU demo's worker processes: min(2, CPU cores).  Two single-threaded processes take
    the same wall time per run as one alone on this 2-core machine, so 7 runs take ~half."""
    return max(1, min(2, os.cpu_count() or 1))


def _pick_device(asked: str) -> str:
    """``auto``: cuda when the GPU is a Hopper with the real FA3 kernel (``python -m refspec info``)."""
    if asked != "auto":
        return asked
    import torch
    return "cuda" if torch.cuda.is_available() and select_provider(torch.device("cuda")) != "emulator" else "cpu"


def _main_gpu(model, qs, prompts, max_new, page_sizes, versions, ns, load_s, t0) -> int:
    """The GPU table (:mod:`refspec.cli._demo_gpu`); exit 1 unless every T2 check and KV-006 hold."""
    import torch

    from refspec.cli._demo_gpu import format_gpu_table, run_gpu_matrix
    from refspec.real import EOS_ID, decode

    dev = torch.device("cuda")
    m32 = model.to(dev)
    print(f"SmolLM2-135M-Instruct (bf16 on {torch.cuda.get_device_name()}, loaded in {load_s:.1f} s); draft "
          f"{ns.draft}, Sd = {ns.num_steps}; FA3 provider: {select_provider(dev)}, graphs: CUDA, fused model "
          f"(torch.compile {torch.__version__})")
    for q, p, m in zip(qs, prompts, max_new):
        print(f"  q{q['question_id']} [{q['category']}] {len(p)} prompt tokens, max_new_tokens {m}")
    res = run_gpu_matrix(m32, prompts, max_new, page_sizes=page_sizes, versions=versions, draft=ns.draft,
                         num_steps=ns.num_steps, eos=EOS_ID, capture_bs=capture_sizes(len(prompts)), topk=ns.topk,
                         num_draft_tokens=ns.num_draft_tokens)
    print()
    print(format_gpu_table(res.rows))
    print()
    for n in res.notes:
        print(n)
    last = res.outputs[(versions[-1], page_sizes[-1])]
    i = max(range(len(prompts)), key=lambda j: len(last.tokens[j]))
    print(f"\nq{qs[i]['question_id']} [{qs[i]['category']}] {qs[i]['prompt']}\n")
    print(f"answer (production {versions[-1]}, P={page_sizes[-1]}, bf16, real FA3 + CUDA graphs):")
    print(decode(last.tokens[i], skip_special=True))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s; {'all checks pass' if res.ok else 'SOME CHECKS FAILED'}")
    print(next_steps())
    return 0 if res.ok else 1
