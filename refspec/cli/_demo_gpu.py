"""``python -m refspec demo --device cuda``: the main job on a Hopper GPU with the real model.

SmolLM2-135M-Instruct in bf16 on the GPU, the same MT-Bench batch as the CPU demo, and every
path of the CPU table plus the two baselines speculation is measured against:

=========================  =====================================================================
row                        what runs
=========================  =====================================================================
greedy, eager              plain greedy of the readable bf16 model (dense KV, one request at a
                           time, the oracle's loop): the reference tokens and their margins
greedy, production         :func:`~refspec.speculative.greedy.production_greedy` on the fused
                           model: paged KV, FA3 DECODE replayed from a CUDA graph ("graph greedy")
oracle loop v1 / v2        the dense oracle speculative loop, readable bf16 model
production v1 / v2, P      the production loop on the fused model (:mod:`refspec.model.fused`):
                           real FA3, CUDA graphs
=========================  =====================================================================

Exactness is tier T2 (TOL-003): tokens equal except where the baseline's top-2 logit margin is
below delta, against the bf16 eager greedy and against an fp32 greedy of the same weights;
delta = 2 x the largest |bf16 - fp32| logit difference of a teacher-forced pass over the fp32
greedy text (measured in this run).  "== oracle (T0)" says whether the production tokens equal
the oracle loop's exactly; in bf16 the two attention implementations round differently, so this
column informs and T2 decides.  Each production configuration runs twice: with metadata
validation and the per-round KV audit on (the checks), and with both off (the tokens/s).
tokens/s counts completion tokens from the first prefill on (graph capture and compilation
excluded), for every row alike; "x graph greedy" / "x eager greedy" divide by the baselines'
tokens/s from the same run.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from refspec.traces.replay import teacher_forced_err
from refspec.core.tolerance import t2
from refspec.model.fused import FusedLlama
from refspec.oracle.loop import greedy
from refspec.speculative import generate
from refspec.audits.kv import audit_kv
from refspec.speculative.greedy import production_greedy

HEADER = ("path", "P", "B", "version", "accept length", "tokens/s", "x graph greedy", "x eager greedy",
          "T2 vs bf16 greedy", "T2 vs fp32 greedy", "== oracle (T0)")


@dataclass
class GpuRow:
    path: str
    P: int | None
    B: int
    version: str | None
    accept_length: float
    tokens: int
    seconds: float
    t2_bf16: bool | None = None
    t2_fp32: bool | None = None
    eq_oracle: bool | None = None
    base_graph: float = 0.0  #: graph-greedy tokens/s of the run
    base_eager: float = 0.0

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds

    def cells(self) -> list[str]:
        yn = lambda b: "-" if b is None else ("yes" if b else "NO")
        return [self.path, "-" if self.P is None else str(self.P), str(self.B), self.version or "-",
                f"{self.accept_length:.2f}", f"{self.tok_per_s:.1f}", f"{self.tok_per_s / self.base_graph:.2f}",
                f"{self.tok_per_s / self.base_eager:.2f}", yn(self.t2_bf16), yn(self.t2_fp32), yn(self.eq_oracle)]


def format_gpu_table(rows: list[GpuRow]) -> str:
    cells = [list(HEADER)] + [r.cells() for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    fmt = lambda c: "  ".join(x.ljust(w[i]) if i == 0 else x.rjust(w[i]) for i, x in enumerate(c))
    return "\n".join([fmt(cells[0]), "  ".join("-" * n for n in w)] + [fmt(c) for c in cells[1:]])


def _sync():
    torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def _t2(tokens, refs, delta) -> bool:
    return all(t2(t, g.tokens, g.margins, delta=delta)[0] for t, g in zip(tokens, refs))


@dataclass
class GpuDemo:
    rows: list[GpuRow]
    notes: list[str]
    outputs: dict  #: (version, P) -> GenerateResult of the validated run
    kv_ok: bool

    @property
    def ok(self) -> bool:
        return self.kv_ok and all(x is not False for r in self.rows for x in (r.t2_bf16, r.t2_fp32))


def run_gpu_matrix(m32, prompts, max_new, *, page_sizes, versions, draft, num_steps, eos, capture_bs, topk=1,
                   num_draft_tokens=None) -> GpuDemo:
    """Every row of the module table (``m32``: the readable fp32 model on the GPU); ``topk`` > 1 adds
    the EAGLE tree rows per version (N = ``num_draft_tokens``, default 2k): oracle tree and production tree."""
    B = len(prompts)
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    fast = FusedLlama(m16)
    g16, s16 = _timed(lambda: [greedy(m16, p, m, eos) for p, m in zip(prompts, max_new)])
    g32 = [greedy(m32, p, m, eos) for p, m in zip(prompts, max_new)]
    delta = 2 * max(teacher_forced_err(m32, m16, list(p) + g.tokens) for p, g in zip(prompts, g32))
    check = lambda toks: (_t2(toks, g16, delta), _t2(toks, g32, delta))
    P0 = max(page_sizes)
    production_greedy(fast, prompts[:1], [2], page_size=P0, validate=False)  # compile outside the timings
    gg = production_greedy(fast, prompts, max_new, page_size=P0, eos=eos, validate=False, capture_bs=capture_bs)
    eager = GpuRow("greedy, eager", None, B, None, 1.0, sum(len(g.tokens) for g in g16), s16,
                   *check([g.tokens for g in g16]))
    graph = GpuRow("greedy, production", P0, B, None, 1.0, sum(map(len, gg.tokens)), gg.seconds, *check(gg.tokens))
    rows = [eager, graph]
    from refspec.real.eagle_head import real_draft

    kw = dict(draft=real_draft(draft, m16), num_steps=num_steps, max_new_tokens=max_new, eos=eos)
    oracle = {}
    for v in versions:
        res, s = _timed(lambda: generate(m16, prompts, backend="oracle", version=v, **kw))
        oracle[v] = res
        rows.append(GpuRow("oracle loop", None, B, v, res.accept_length, sum(map(len, res.tokens)), s,
                           *check(res.tokens)))
    audited, outputs, kv_ok = [0], {}, True

    def audit(event, eng, **info):
        if event == "round_end":
            audit_kv(eng)
            audited[0] += 1

    for P in page_sizes:
        for v in versions:
            checked = generate(fast, prompts, backend="fa3", version=v, page_size=P, graphs=True, observer=audit,
                               capture_bs=capture_bs, **kw)
            kv_ok &= checked.free_pages[0] == checked.free_pages[1]
            start = {}

            def clock(event, eng, **info):
                if event == "prefill" and "t" not in start:
                    _sync()
                    start["t"] = time.perf_counter()
            res = generate(fast, prompts, backend="fa3", version=v, page_size=P, graphs=True, validate=False,
                           observer=clock, capture_bs=capture_bs, **kw)
            _sync()
            outputs[(v, P)] = checked
            rows.append(GpuRow("production", P, B, v, res.accept_length, sum(map(len, res.tokens)),
                               time.perf_counter() - start["t"], *check(checked.tokens),
                               eq_oracle=checked.tokens == oracle[v].tokens))
    for tv in versions if topk > 1 else ():  # the tree rounds run non-overlapped (docs/spec/tree.md)
        tkw = dict(kw, version=tv, topk=topk, num_draft_tokens=num_draft_tokens or 2 * topk)
        label = f"{tv} k={topk} N={tkw['num_draft_tokens']}"
        ora, s = _timed(lambda: generate(m16, prompts, backend="oracle", **tkw))
        rows.append(GpuRow("oracle tree", None, B, label, ora.accept_length, sum(map(len, ora.tokens)), s,
                           *check(ora.tokens)))
        for P in page_sizes:
            checked = generate(fast, prompts, backend="fa3", page_size=P, graphs=True, observer=audit,
                               capture_bs=capture_bs, **tkw)
            kv_ok &= checked.free_pages[0] == checked.free_pages[1]
            start = {}

            def tree_clock(event, eng, **info):
                if event == "prefill" and "t" not in start:
                    _sync()
                    start["t"] = time.perf_counter()
            res = generate(fast, prompts, backend="fa3", page_size=P, graphs=True, validate=False,
                           observer=tree_clock, capture_bs=capture_bs, **tkw)
            _sync()
            outputs[(label, P)] = checked
            rows.append(GpuRow("production tree", P, B, label, res.accept_length, sum(map(len, res.tokens)),
                               time.perf_counter() - start["t"], *check(checked.tokens),
                               eq_oracle=checked.tokens == ora.tokens))
    for r in rows:
        r.base_graph, r.base_eager = graph.tok_per_s, eager.tok_per_s
    notes = [f"T2 delta {delta:.3g} logits (2 x the max |bf16 - fp32| teacher-forced logit error of this run)",
             f"KV accounting audited after each of {audited[0]} validated production rounds; every page freed "
             f"at the end (KV-006): {'yes' if kv_ok else 'NO'}"]
    return GpuDemo(rows, notes, outputs, kv_ok)
