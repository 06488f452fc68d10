"""Replay a recorded chain schedule through the production path (FA3 wing, CUDA graphs on) and the
oracle loop: the library half of ``python -m refspec replay`` (:mod:`refspec.cli.replay`).

An instrument: a learner reading the reference can skip this module.

The real weights never travel (they cannot reach the GPU machine): the target is a random-init
:class:`~refspec.model.llama.LlamaModel` of the trace's ``model_config`` (SmolLM2-135M's shapes),
``init_random_`` so greedy margins are O(1).  Acceptance is scripted from the trace
(:mod:`refspec.traces.chain` says why that reproduces the schedule on any model), and the draft *tokens*
come from the ``perfect`` drafter (the target's own greedy continuation; the draft model's
forwards still run on them) so that every forced a keeps the output equal to plain greedy
decoding.  ``--drafter model`` uses the draft model's argmax instead (fp32 only: the output is
then not greedy, so only T0 against the oracle loop is defined).

Per (version, page size), a run passes when:

* **schedule**: every round's batch membership, ``seq_lens``, ``num_accept_tokens``, joins and
  finishes equal the trace (T0), and the oracle loop's per-request a equal it too;
* **tokens**: fp32: production == oracle loop == plain greedy, bitwise (TOL-001), round by
  round; bf16 / fp16: production vs the fp32 greedy baseline under T2 (TOL-003) with
  delta = max(1e-2, 2x the bf16-vs-fp32 teacher-forced logit error), as ``tests/test_gpu_spec.py``;
* **KV**: the free-page count returns to its start (KV-006).

A **tree trace** (top-k > 1, recorded by ``record --topk K``) is detected by its format and
replayed round by round at the attention level instead (:mod:`refspec.traces.replay_tree`): its
KV layout was recorded at one page size, and its trees come from the recorded draft, so
``--versions`` / ``--page-sizes`` / ``--drafter`` / ``--draft`` / ``--tiny`` / ``--num-layers``
do not apply to it.

On a Hopper GPU the provider is the real FA3 kernel (auto-selected) and the graphs are
``torch.cuda.CUDAGraph``; elsewhere the emulator and emulated graphs.  Exit status 1 on any
mismatch.  ``--num-layers`` / ``--draft`` shrink the model for quick CPU checks (the schedule
does not depend on the model; ``--tiny`` keeps only the vocabulary).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from refspec.core.tolerance import T2_DELTA, t2
from refspec.fa3.kernel import select_provider
from refspec.model.llama import LlamaConfig, LlamaModel, init_random_
from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV
from refspec.oracle.loop import greedy
from refspec.speculative import generate
from refspec.traces.chain import accept_table, committed_rounds, largest_batch, replay_budgets, schedule_mismatches

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunCheck:
    """One replayed (version, page size): schedule and token verdicts, graph use, timing."""

    version: str
    page_size: int
    rounds: int
    schedule: list[str]  #: mismatch lines (empty: equal to the trace)
    oracle_accepts_ok: bool
    tokens_ok: bool
    tokens: str  #: how tokens were compared and the verdict
    kv_ok: bool
    graph_replays: int
    eager_forwards: int
    seconds: float
    per_round: list[dict] = field(default_factory=list)  #: round k -> fields + "match"

    @property
    def ok(self) -> bool:
        return not self.schedule and self.oracle_accepts_ok and self.tokens_ok and self.kv_ok


@dataclass
class ReplayReport:
    trace_path: str
    device: str
    dtype: str
    provider: str
    model: str
    drafter: str
    runs: list[RunCheck]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    def to_markdown(self) -> str:
        yes = lambda b: "yes" if b else "**NO**"
        lines = [f"# Replay of `{self.trace_path}`", "",
                 f"device `{self.device}`, dtype `{self.dtype}`, FA3 provider `{self.provider}`, graphs on; "
                 f"model: {self.model}; drafter `{self.drafter}`", "",
                 "| version | P | rounds | schedule == trace | oracle a == trace | tokens | KV-006 | graph replays "
                 "| eager forwards | s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.runs:
            lines.append(f"| {r.version} | {r.page_size} | {r.rounds} | {yes(not r.schedule)} | "
                         f"{yes(r.oracle_accepts_ok)} | {yes(r.tokens_ok)}: {r.tokens} | {yes(r.kv_ok)} | "
                         f"{r.graph_replays} | {r.eager_forwards} | {r.seconds:.1f} |")
        for r in self.runs:
            lines += [f"- {r.version} P={r.page_size}: {m}" for m in r.schedule[:10]]
        if self.runs:
            r = self.runs[0]
            lines += ["", f"## Per round ({r.version}, P={r.page_size})", "",
                      "| round | batch (rids) | seq_lens | a | joined | finished | graphs | match |",
                      "|---|---|---|---|---|---|---|---|"]
            for k, x in enumerate(r.per_round):
                lines.append(f"| {k} | {x['rids']} | {x['seq_lens']} | {x['num_accept_tokens']} | {x['joined']} | "
                             f"{x['finished']} | {','.join(x['graph']) or 'eager'} | {yes(x['match'])} |")
        lines += ["", f"**{'PASS' if self.ok else 'FAIL'}**", ""]
        return "\n".join(lines)


#: ``--tiny``: SmolLM2's vocabulary (the prompts' ids) on a 2-layer, hidden-64 body
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def random_target(model_config: dict, *, seed: int, device, overrides: dict | None = None) -> LlamaModel:
    """fp32 random-init target of the trace's HF config, with ``overrides`` (e.g. :data:`TINY`)."""
    cfg = LlamaConfig.from_dict({**model_config, **(overrides or {})})
    return init_random_(LlamaModel(cfg), seed=seed).to(device).eval().requires_grad_(False)


@torch.no_grad()
def teacher_forced_err(m32, low, seq: list[int]) -> float:
    """max |logits(low) - logits(fp32)| over a dense teacher-forced pass on ``seq`` (T2's delta).

    Shapes: ``seq`` T token ids -> one float (logit units), from two ``[T, V]`` logit tensors.
    """
    c, dev = m32.config, next(m32.parameters()).device
    out = []
    for m in (m32, low):
        kv = DenseKV(c.num_hidden_layers, len(seq), c.num_key_value_heads, c.head_dim,
                     dtype=next(m.parameters()).dtype, device=dev)
        out.append(m(torch.tensor(seq, device=dev), DenseBatch.span(0, len(seq), dev), DenseBackend(kv))[0].float())
    return float((out[0] - out[1]).abs().max())


def _round_tokens(tokens: list[int], emitted: list[int]) -> list[list[int]]:
    """A request's output cut per verify round (token 0 is the prefill token)."""
    out, i = [], 1
    for e in emitted:
        out.append(tokens[i:i + e])
        i += e
    return out


def replay_trace(trace: dict, *, device="cpu", dtype=torch.float32, versions=None, page_sizes=None, seed=0,
                 overrides=None, draft=None, drafter="perfect", trace_path="", progress=None) -> ReplayReport:
    """Replay ``trace`` (module doc) for every version x page size; returns the report.

    Shapes: B = the trace's requests, each run forced to the recorded a per request-round;
    budgets are the recorded output lengths (tokens); ``dtype`` is the production model's
    (the greedy baseline and the oracle loop stay fp32 on ``device``).

    Args: ``versions`` / ``page_sizes`` default to the trace's own; ``draft`` overrides the
    trace's draft spec; ``overrides`` change the model config (quick CPU checks: the schedule
    does not depend on the model); ``drafter`` "perfect" or "model"; ``progress(label)`` is
    called per run.
    Raises ValueError for ``drafter="model"`` in a low precision (no greedy baseline for T2).
    """
    cfg = trace["config"]
    if drafter not in ("perfect", "model"):
        raise ValueError(f"drafter must be 'perfect' or 'model', got {drafter!r}")
    if drafter == "model" and dtype != torch.float32:
        raise ValueError("--drafter model needs fp32: its output is not greedy, so T2 has no baseline margins")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    m32 = random_target(cfg["model_config"], seed=seed, device=device, overrides=overrides)
    low = m32 if dtype == torch.float32 else copy.deepcopy(m32).to(dtype)
    prompts = [r["prompt_ids"] for r in trace["requests"]]
    budgets, table = replay_budgets(trace), accept_table(trace)
    accepts = [table[i] for i in range(len(prompts))]
    draft = draft or cfg["draft"]
    base = [greedy(m32, p, b) for p, b in zip(prompts, budgets)]  # eos off: budgets end every request
    ref = {i: p + g.tokens for i, (p, g) in enumerate(zip(prompts, base))}
    delta = T2_DELTA
    if dtype != torch.float32:
        delta = max(T2_DELTA, 2 * max(teacher_forced_err(m32, low, s) for s in ref.values()))
    kw = dict(draft=draft, drafter=None if drafter == "model" else "perfect", reference=ref,
              num_steps=cfg["num_steps"], max_new_tokens=budgets, accept=table)
    runs = []
    for v in versions or [cfg["version"]]:
        ora = generate(m32, prompts, backend="oracle", version=v, **kw)
        for P in page_sizes or [cfg["page_size"]]:
            if progress:
                progress(f"{v} P={P}")
            t = time.perf_counter()
            try:
                prod = generate(low, prompts, backend="fa3", version=v, page_size=P, graphs=True,
                                max_batch=largest_batch(trace), capture_bs=tuple(cfg["capture_bs"]),
                                overlap=v == "v2" and cfg.get("overlap", False), **kw)  # the recorded loop
            except Exception as e:  # a check (InvariantError) or a crash inside the production path
                runs.append(RunCheck(v, P, 0, [f"production raised {type(e).__name__}: {e}"], ora.accepts == accepts,
                                     False, "not compared", False, 0, 0, time.perf_counter() - t))
                continue
            runs.append(_check_run(trace, v, P, prod, ora, base, dtype, delta, drafter, time.perf_counter() - t))
    model = (f"random init (seed {seed}) {m32.config.num_hidden_layers} layers, hidden {m32.config.hidden_size}, "
             f"vocab {m32.config.vocab_size}; draft `{draft}`")
    return ReplayReport(trace_path, str(device), str(dtype).replace("torch.", ""),
                        select_provider(torch.device(device)), model, drafter, runs)


def _check_run(trace, v, P, prod, ora, base, dtype, delta, drafter, secs) -> RunCheck:
    rounds = committed_rounds(prod.trace)
    sched = schedule_mismatches(trace, rounds)
    want_a = [r["num_accept_tokens"] for r in trace["requests"]]
    if prod.accepts != want_a:
        sched.append(f"per-request a {prod.accepts} != trace {want_a}")
    bad_rounds = {int(m.split(":")[0].split()[1]) for m in sched if m.startswith("round ")}
    if dtype == torch.float32:
        # round by round: the k-th round of each request, production vs oracle loop (T0)
        pr = {r.rid: _round_tokens(r.tokens, r.emitted) for r in prod.requests}
        orr = {r.rid: _round_tokens(r.tokens, r.emitted) for r in ora.requests}
        seen: dict[int, int] = {}
        for k, rd in enumerate(rounds):
            for rid in rd.rids:
                i = seen.get(rid, 0)
                seen[rid] = i + 1
                if pr[rid][i:i + 1] != orr[rid][i:i + 1]:
                    bad_rounds.add(k)
        same_oracle = prod.tokens == ora.tokens
        is_greedy = prod.tokens == [g.tokens for g in base]
        ok = same_oracle and (is_greedy or drafter == "model")
        how = (f"T0 production == oracle loop: {'yes' if same_oracle else 'no'}"
               + (f", == greedy: {'yes' if is_greedy else 'no'}" if drafter == "perfect" else ""))
    else:
        verdicts = [t2(prod.tokens[i], g.tokens, g.margins, delta=delta) for i, g in enumerate(base)]
        ok = all(v_ok for v_ok, _ in verdicts)
        forgiven = sum("forgiven" in why for _, why in verdicts)
        how = f"T2 vs fp32 greedy (delta {delta:.3g}): " + (
            f"{len(verdicts) - forgiven} equal, {forgiven} forgiven near-tie" if ok else
            "; ".join(f"request {i}: {why}" for i, (v_ok, why) in enumerate(verdicts) if not v_ok))
    per_round = [{"rids": t.rids, "seq_lens": t.seq_lens, "num_accept_tokens": t.num_accept_tokens,
                  "joined": t.joined, "finished": t.finished, "graph": t.graph, "match": k not in bad_rounds}
                 for k, t in enumerate(rounds)]
    graph = sum(n for (_, how_), n in prod.forwards.items() if how_ == "graph")
    eager = sum(n for (ph, how_), n in prod.forwards.items() if how_ == "eager" and "prefill" not in ph)
    return RunCheck(v, P, len(rounds), sched, ora.accepts == want_a, ok, how,
                    prod.free_pages[0] == prod.free_pages[1], graph, eager, secs, per_round)


