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
validation and the per-round KV audit on (the checks, and the warm-up of its shapes), and with
both off (the tokens/s).  The tokens/s of graph greedy and of the production rows are the
bench's (:mod:`refspec.cli._timing`): over the decode window (after the prefill, every token
after each request's first; graph capture and compilation outside, graph greedy timed on its
second run of the same workload), and "x graph greedy" is :func:`~refspec.cli._timing.speedup`
of the two.  The eager greedy and oracle rows are timed over their whole run (prefill included,
one request at a time): they show exactness, not speed, and get no ratio.

Until issue 41 graph greedy was timed from before its prefill, on its first run at these
shapes, while the production rows started after their prefill on their second run: the demo
printed production v2 at 1.6x graph greedy on an H100 where the bench measured ~1.0x.

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
from refspec.cli import _timing
from refspec.cli._timing import time_greedy, time_spec

HEADER = ("path", "P", "B", "version", "accept length", "tokens/s", "x graph greedy",
          "T2 vs bf16 greedy", "T2 vs fp32 greedy", "== oracle (T0)")


@dataclass
class GpuRow:
    path: str
    P: int | None
    B: int
    version: str | None
    accept_length: float | None  #: None without a verify round ("-", as every missing value)
    tokens: int
    seconds: float
    t2_bf16: bool | None = None
    t2_fp32: bool | None = None
    eq_oracle: bool | None = None
    x_graph: float | None = None  #: :func:`~refspec.cli._timing.speedup` over graph greedy (decode-window rows)

    @property
    def tok_per_s(self) -> float:
        """Tokens per second; NaN for an empty window (``--max-new-tokens 1``)."""
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def cells(self) -> list[str]:
        yn = lambda b: "-" if b is None else ("yes" if b else "NO")
        num = lambda x, f: "-" if x is None or x != x else format(x, f)  # noqa: E731 - None or NaN: "-"
        return [self.path, "-" if self.P is None else str(self.P), str(self.B), self.version or "-",
                num(self.accept_length, ".2f"), num(self.tok_per_s, ".1f"), num(self.x_graph, ".2f"),
                yn(self.t2_bf16), yn(self.t2_fp32), yn(self.eq_oracle)]


def format_gpu_table(rows: list[GpuRow]) -> str:
    cells = [list(HEADER)] + [r.cells() for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    fmt = lambda c: "  ".join(x.ljust(w[i]) if i == 0 else x.rjust(w[i]) for i, x in enumerate(c))
    return "\n".join([fmt(cells[0]), "  ".join("-" * n for n in w)] + [fmt(c) for c in cells[1:]])


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    """Whole-run wall time (the eager greedy and oracle rows)."""
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
                   num_draft_tokens=None, clock=time.perf_counter) -> GpuDemo:
    """Every row of the module table (``m32``: the readable fp32 model, on the GPU for the demo;
    the code runs on a CPU too, where it is tested); ``topk`` > 1 adds the EAGLE tree rows per
    version (N = ``num_draft_tokens``, default 2k): oracle tree and production tree.  ``clock``:
    the decode windows' clock (:mod:`refspec.cli._timing`)."""
    B = len(prompts)
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    fast = FusedLlama(m16)
    g16, s16 = _timed(lambda: [greedy(m16, p, m, eos) for p, m in zip(prompts, max_new)])
    g32 = [greedy(m32, p, m, eos) for p, m in zip(prompts, max_new)]
    delta = 2 * max(teacher_forced_err(m32, m16, list(p) + g.tokens) for p, g in zip(prompts, g32))
    check = lambda toks: (_t2(toks, g16, delta), _t2(toks, g32, delta))
    P0 = max(page_sizes)
    # graph greedy: its second run of this very workload is timed (the first compiles and loads)
    gg, g_time = time_greedy(fast, prompts, max_new, page_size=P0, eos=eos, capture_bs=capture_bs, clock=clock)
    eager = GpuRow("greedy, eager", None, B, None, 1.0, sum(len(g.tokens) for g in g16), s16,
                   *check([g.tokens for g in g16]))
    graph = GpuRow("greedy, production", P0, B, None, 1.0, g_time.tokens, g_time.seconds, *check(gg.tokens),
                   x_graph=_timing.speedup(g_time, g_time))
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
            # the checked run just before is this configuration's warm-up (the same shapes)
            res, t = time_spec(fast, prompts, max_new, warmup=0, clock=clock, version=v, page_size=P, graphs=True,
                               validate=False, capture_bs=capture_bs,
                               **{k: x for k, x in kw.items() if k != "max_new_tokens"})
            outputs[(v, P)] = checked
            rows.append(GpuRow("production", P, B, v, res.accept_length, t.tokens, t.seconds,
                               *check(checked.tokens), eq_oracle=checked.tokens == oracle[v].tokens,
                               x_graph=_timing.speedup(t, g_time)))
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
            res, t = time_spec(fast, prompts, max_new, warmup=0, clock=clock, page_size=P, graphs=True,
                               validate=False, capture_bs=capture_bs,
                               **{k: x for k, x in tkw.items() if k != "max_new_tokens"})
            outputs[(label, P)] = checked
            rows.append(GpuRow("production tree", P, B, label, res.accept_length, t.tokens, t.seconds,
                               *check(checked.tokens), eq_oracle=checked.tokens == ora.tokens,
                               x_graph=_timing.speedup(t, g_time)))
    notes = [f"T2 delta {delta:.3g} logits (2 x the max |bf16 - fp32| teacher-forced logit error of this run)",
             f"KV accounting audited after each of {audited[0]} validated production rounds; every page freed "
             f"at the end (KV-006): {'yes' if kv_ok else 'NO'}"]
    return GpuDemo(rows, notes, outputs, kv_ok)
