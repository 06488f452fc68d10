"""The demo's table as a list of independent runs, and one run executed on its own.

``python -m refspec demo`` decodes one batch several times: plain greedy, graph greedy (the
production path's greedy, the speed baseline), the oracle loop per version, the production loop
per (version, page size), and with ``--topk`` the oracle tree loop and the production tree loop.
No run reads another's output: each is a function of (model, prompts, budgets, draft, its own
settings), so they can run in any order, in any process (:mod:`refspec.cli._demo_pool`).  The
comparisons of the table (spec == greedy, production == oracle, x graph greedy) are made
afterwards, by :func:`refspec.cli.demo.run_matrix`, once every run is back.

* :class:`DemoRun`: what one run is (its table ``path``, version, page size, tree shape).
* :func:`plan_runs`: the runs of a table, in table order.
* :func:`longest_first`: the order to hand them to workers so that two workers finish together.
* :func:`execute_run`: run one, return a picklable :class:`RunOutcome`.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from refspec.cli._timing import Timed, time_greedy, time_spec
from refspec.oracle.loop import greedy
from refspec.real.run import TokenBar, capture_sizes
from refspec.speculative import generate
from refspec.audits.kv import audit_kv
from refspec.speculative.metrics import GenerateResult


@dataclass(frozen=True)
class DemoRun:
    """One run of the table.

    ``path``: ``"greedy"``, ``"graph greedy"``, ``"oracle loop"``, ``"production"``, ``"oracle tree"``
    or ``"production tree"`` (the table's first column); ``version`` "v1" / "v2" (None for greedy);
    ``page_size`` P in tokens per page (graph greedy and production runs); ``topk`` / ``num_draft_tokens``
    k and N of the tree runs (1 / None for the chain).
    """

    path: str
    version: str | None = None
    page_size: int | None = None
    topk: int = 1
    num_draft_tokens: int | None = None

    @property
    def table_version(self) -> str | None:
        """The table's version cell: ``v1``, or ``v1 k=2 N=4`` for a tree run."""
        if self.topk == 1:
            return self.version
        return f"{self.version} k={self.topk} N={self.num_draft_tokens}"

    @property
    def label(self) -> str:
        """What the progress bar shows while the run is going (``production v1 P=4``)."""
        v = self.version if self.path == "production tree" else self.table_version
        return " ".join(str(x) for x in (self.path, v, None if self.page_size is None else f"P={self.page_size}")
                        if x is not None)

    @property
    def key(self) -> tuple:
        """The key of :attr:`refspec.cli.demo.DemoResult.outputs`: ``(table version, P)``."""
        return (self.table_version, self.page_size)


def plan_runs(page_sizes=(1, 4), versions=("v1", "v2"), topk: int = 1,
              num_draft_tokens: int | None = None) -> list[DemoRun]:
    """The table's runs in table order: greedy; graph greedy at the largest page size; the oracle
    loop per version; production per page size, then per version; with ``topk`` > 1, per version
    the oracle tree and production tree per page size (N defaults to 2k)."""
    runs = [DemoRun("greedy"), DemoRun("graph greedy", page_size=max(page_sizes))]
    runs += [DemoRun("oracle loop", v) for v in versions]
    runs += [DemoRun("production", v, P) for P in page_sizes for v in versions]
    if topk > 1:
        N = num_draft_tokens or 2 * topk
        for v in versions:
            runs.append(DemoRun("oracle tree", v, None, topk, N))
            runs += [DemoRun("production tree", v, P, topk, N) for P in page_sizes]
    return runs


#: Measured CPU seconds of the default demo's runs (benchmarks/results/cpu_demo_profile.md): the
#: oracle loops (one request at a time) ~27, production ~20, greedy ~8.  Higher = handed out first.
_COST = {"oracle tree": 4, "oracle loop": 3, "production tree": 2, "production": 1, "greedy": 0, "graph greedy": 0}


def longest_first(runs: list[DemoRun]) -> list[int]:
    """Indices of ``runs``, the longest first (oracle, then production, the greedy runs last), so
    that the last run to start is a short one and the workers finish at about the same time."""
    return sorted(range(len(runs)), key=lambda i: -_COST[runs[i].path])


@dataclass
class RunOutcome:
    """What one run hands back (plain lists and ints: picklable, it crosses processes).

    ``tokens``: B lists of generated token ids, prompt order.  ``result``: the full
    :class:`~refspec.speculative.metrics.GenerateResult` (accepts, requests with
    ``finish_reason``, ``free_pages``, the per-round trace); None for the greedy runs.  ``seconds``:
    the run's own wall time (prefill and graph capture included).  ``timed``: the graph-greedy and
    production runs' decode window (:mod:`refspec.cli._timing`, the bench's timing: prefill,
    capture and the bar / KV audit excluded), None for the others.  ``rounds_audited``:
    production rounds checked by ``audit_kv`` (0 for greedy and the oracle loops).
    """

    run: DemoRun
    tokens: list[list[int]]
    result: GenerateResult | None
    seconds: float
    rounds_audited: int = 0
    timed: Timed | None = None

    @property
    def accept_length(self) -> float:
        """SD-003 accept length; 1.0 for greedy (one token per forward)."""
        return 1.0 if self.result is None else self.result.accept_length


def execute_run(model, run: DemoRun, prompts, max_new, *, draft, num_steps, eos=None,
                bar: TokenBar | None = None) -> RunOutcome:
    """Run ``run`` on ``model`` and return its :class:`RunOutcome`.

    Shapes: ``prompts`` B lists of token ids; ``max_new`` B budgets (tokens).  The production
    runs use the FA3 wing with graphs (emulated off Hopper), validation on, and ``audit_kv``
    after every round.  ``bar`` (a :class:`~refspec.real.run.TokenBar` or anything with its
    ``start_run`` / ``add`` / ``observer`` / ``finish_run``) counts the tokens as they come.
    Raises :class:`~refspec.core.invariants.InvariantError` if the FA3 validation or the KV audit
    trips, or for a tree shape that breaks TR-002.
    """
    from refspec.real.eagle_head import real_draft

    bar = bar or TokenBar(0, disable=True)
    kw = dict(draft=real_draft(draft, model), num_steps=num_steps, max_new_tokens=list(max_new), eos=eos,
              version=run.version)
    if run.topk > 1:
        kw.update(topk=run.topk, num_draft_tokens=run.num_draft_tokens)
    audited = [0]

    def observer(event, eng, **info):
        bar.observer(event, eng, **info)
        if event == "round_end":
            audit_kv(eng)
            audited[0] += 1

    bar.start_run(run.label)
    t = time.perf_counter()
    res = window = None
    if run.path == "graph greedy":  # validated as the production runs are
        g, window = time_greedy(model, prompts, max_new, page_size=run.page_size, eos=eos,
                                capture_bs=capture_sizes(len(prompts)), validate=True)
        tokens = g.tokens
        bar.add(sum(map(len, tokens)))
    elif run.path == "greedy":
        tokens = []
        for p, m in zip(prompts, max_new):
            tokens.append(greedy(model, p, m, eos).tokens)
            bar.add(len(tokens[-1]))
    elif run.path == "oracle loop":
        reqs = []
        for i, (p, m) in enumerate(zip(prompts, max_new)):  # one request at a time anyway: a smooth bar
            r = generate(model, [p], backend="oracle", **{**kw, "max_new_tokens": [m]}).requests[0]
            r.rid = i
            reqs.append(r)
            bar.add(len(r.tokens))
        res = GenerateResult(reqs, "oracle", run.version)
    elif run.path == "oracle tree":
        res = generate(model, prompts, backend="oracle", **kw)
        bar.add(sum(map(len, res.tokens)))
    else:  # production, production tree: the bar and the KV audit run with the window's clock paused
        res, window = time_spec(model, prompts, max_new, instrument=observer, page_size=run.page_size, graphs=True,
                                capture_bs=capture_sizes(len(prompts)),
                                **{k: v for k, v in kw.items() if k != "max_new_tokens"})
    seconds = time.perf_counter() - t
    bar.finish_run(sum(max_new))
    return RunOutcome(run, tokens if res is None else res.tokens, res, seconds, audited[0], window)
