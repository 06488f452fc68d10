"""The test-suite side of the mutant harness: references, output comparisons, independent checks.

Nothing here reads a variant's replacement or the production metadata builders' formulas (the
references are computed under :func:`refspec.mutants.variants.disabled`): every expected value
comes from the oracle wing (``oracle_metadata``, ``OracleBackend``), from the stated padding
fills (docs/spec/graphs.md#cg-005), or from a hand formula (the horizon probe, case B14).  A probe
reports what it sees as :class:`Symptom` s in a list (``found``); an exception raised by the
production wing (an ``InvariantError`` from a validator, the emulator or a guard, or a crash)
propagates instead and is recorded by the runner.

Shapes as everywhere: B requests, Bg padded graph batch, T query tokens, ``q [T, H, D]``,
``k, v [T, Hkv, D]``, P page size.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from refspec.mutants import variants
from refspec.core.batch import ForwardBatch
from refspec.oracle.backend import OracleBackend, oracle_metadata
from refspec.harness.scenario import Built, Scenario
from refspec.core.tolerance import t1


class ProbeUnavailable(RuntimeError):
    """A probe cannot run here (the runner reports it as "not run" with this reason, never as a pass)."""


@dataclass
class Symptom:
    """One detection by a suite-side check.

    ``kind``: ``"mismatch"`` (an output or KV value differs; ``err`` is the worst absolute error,
    ``pct`` that error as % of the tolerance budget), ``"check"`` (an independent invariant
    check failed), ``"tokens"`` / ``"accepts"`` (the spec loop's emitted tokens / accept counts
    differ from the oracle loop's).  ``inv_id``: the invariant the detection violates.
    """

    kind: str
    inv_id: str
    detail: str
    err: float | None = None
    pct: float | None = None


@dataclass
class Env:
    """Where probes run: ``cpu`` (fp32, emulator, emulated graphs) or ``cuda`` (bf16, real FA3,
    real CUDA graphs); ``low_precision=True`` runs the CPU emulator in bf16 too (the T1 path).
    ``_refs`` memoises oracle outputs per (case, selection)."""

    device: str = "cpu"
    low_precision: bool | None = None  #: bf16 (default: on CUDA only)
    _refs: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        low = self.device != "cpu" if self.low_precision is None else self.low_precision
        return torch.bfloat16 if low else torch.float32

    @property
    def provider(self) -> str:
        return "emulator" if self.device == "cpu" else "fa3"

    def scenario(self, mode, **kw) -> Scenario:
        return Scenario(mode, device=self.device, dtype=self.dtype, **kw)


@dataclass
class Case:
    """A scenario plus an optional deterministic set-up run after every ``build()``."""

    label: str
    sc: Scenario
    prepare: object = None  #: ``(Built) -> None``

    def build(self) -> Built:
        b = self.sc.build()
        if self.prepare is not None:
            self.prepare(b)
        return b


def take(b: Built, idx: list[int]) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Requests ``idx`` (in that order) of ``b``'s live batch: ``(fb, q, k, v)``, same cache.

    Shapes: per-request fields ``[len(idx)]``; ``out_cache_loc`` / ``positions`` ``[T']`` and
    ``q [T', H, D]``, ``k, v [T', Hkv, D]`` for the T' query tokens of those requests."""
    fb = b.fb
    cu = [0, *accumulate(fb.q_lens_cpu())]
    dev = fb.out_cache_loc.device
    tok = torch.cat([torch.arange(cu[i], cu[i + 1], device=dev) for i in idx])
    r = torch.as_tensor(idx, device=dev)
    per_req = lambda t: None if t is None else t[r]  # noqa: E731
    per_cpu = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
    sub = fb.replace(req_pool_indices=per_req(fb.req_pool_indices), seq_lens=per_req(fb.seq_lens),
                     seq_lens_cpu=fb.seq_lens_cpu[torch.as_tensor(idx)], out_cache_loc=fb.out_cache_loc[tok],
                     positions=fb.positions[tok], extend_seq_lens=per_req(fb.extend_seq_lens),
                     extend_seq_lens_cpu=per_cpu(fb.extend_seq_lens_cpu),
                     num_accept_tokens=per_req(fb.num_accept_tokens),
                     num_accept_tokens_cpu=per_cpu(fb.num_accept_tokens_cpu))
    return sub, b.q[tok], b.k[tok], b.v[tok]


def live(b: Built, idx: list[int] | None):
    """``(fb, q, k, v)``: the whole live batch (``idx`` None) or the requests ``idx``."""
    return (b.fb, b.q, b.k, b.v) if idx is None else take(b, idx)


def oracle(env: Env, case: Case, idx: list[int] | None = None, upcast: bool = True) -> torch.Tensor:
    """The oracle's output on a fresh build of ``case`` (every variant off), memoised.

    Shapes: ``[T, H, D]`` for the T query tokens of the batch (of requests ``idx`` if given);
    fp32 math unless ``upcast=False`` (the T1 budget run), in the scenario's dtype."""
    key = (case.label, repr(case.sc), None if idx is None else tuple(idx), upcast)
    if key not in env._refs:
        with variants.disabled():
            b = case.build()
            fb, q, k, v = live(b, idx)
            be = OracleBackend(b.pool, b.kv, upcast=upcast)
            be.init_forward_metadata(fb)
            env._refs[key] = be.forward(q, k, v, b.layer, fb)
    return env._refs[key]


def compare(env: Env, found: list, out: torch.Tensor, case: Case, idx=None, inv="TOL-002", what="") -> bool:
    """T1 (TOL-002) of ``out [T, H, D]`` against the fp32 oracle (and, in bf16, the oracle's own
    bf16 run for the budget).  Appends a ``mismatch`` Symptom naming ``inv`` when out of budget;
    returns whether it was within budget."""
    ref = oracle(env, case, idx)
    ref_low = None if env.dtype == torch.float32 else oracle(env, case, idx, upcast=False)
    v = t1(out, ref, ref_low)
    if not v.ok:
        found.append(Symptom("mismatch", inv, f"{what} vs oracle: {v}", v.err, v.pct))
    return v.ok


def check_metadata(found: list, md, fb: ForwardBatch, req_to_token: torch.Tensor, P: int, replay: bool) -> None:
    """Real rows of FA3 metadata ``md`` against the oracle twin of the live batch ``fb``.

    q_b (MD-002; v1 draft extend MD-009; replay CG-003 / CG-004), K_b (MD-003; verify MD-011,
    draft decode MD-010, v2 draft extend MD-008), INV-TAIL of ``fb.out_cache_loc`` (MD-005),
    and the page table reproducing ``req_to_token`` below the oracle's K_b (PA-002).
    """
    tw, m, B = oracle_metadata(fb), fb.forward_mode, fb.batch_size
    cu = md.cu_seqlens_q[: B + 1].tolist()
    q = [cu[b + 1] - cu[b] for b in range(B)]
    if m.is_draft_extend(include_v2=True) and replay:
        q_id = "CG-003" if m.is_draft_extend() else "CG-004"
    else:
        q_id = "MD-009" if m.is_draft_extend() else "MD-002"
    if cu[0] != 0 or q != tw.q_lens:
        found.append(Symptom("check", q_id, f"q lens {q} (cu_seqlens_q {cu}), oracle twin {tw.q_lens}"))
    K = md.cache_seqlens_int32[:B].tolist()
    k_id = ("MD-008" if m.is_draft_extend_v2() else "MD-011" if m.is_target_verify()
            else "MD-010" if fb.is_draft_decode else "MD-003")
    if K != tw.cache_seqlens:
        found.append(Symptom("check", k_id, f"cache_seqlens {K}, oracle twin {tw.cache_seqlens}"))
    loc, pt = fb.out_cache_loc.tolist(), md.page_table
    for b, (r, Kb, qb) in enumerate(zip(tw.req_pool_indices, tw.cache_seqlens, tw.q_lens)):
        row = req_to_token[r, :Kb].long()
        tail, mine = row[Kb - qb:].tolist(), loc[tw.cu_seqlens_q[b]:tw.cu_seqlens_q[b + 1]]
        if mine != tail:
            found.append(Symptom("check", "MD-005", f"request {b}: out_cache_loc {mine} != req_to_token tail {tail}"))
        if pt.shape[1] * P < Kb:
            found.append(Symptom("check", "PA-003", f"request {b}: K={Kb} needs {-(-Kb // P)} pages, "
                                 f"width {pt.shape[1]}"))
            continue
        p = torch.arange(Kb, device=row.device)
        if not torch.equal(pt[b, p // P].long() * P + p % P, row):
            found.append(Symptom("check", "PA-002", f"request {b}: page_table row != req_to_token[{r}, :{Kb}]"))


def check_padding(found: list, runner, n_real: int, n_real_tokens: int, bs: int) -> None:
    """Padded rows ``n_real..bs-1`` of the static batch against the fills of docs/spec/graphs.md#cg-005 (CG-005)
    and their metadata against K >= q (CG-010), independent of the runner's own fill logic."""
    fb, W = runner.static[bs], runner.W
    fill = W if runner.mode.is_draft_extend(include_v2=True) else 1
    rp, sl = fb.req_pool_indices[n_real:bs].tolist(), fb.seq_lens[n_real:bs].tolist()
    loc = fb.out_cache_loc[n_real_tokens:bs * W].tolist()
    if any(rp) or any(x != fill for x in sl) or any(loc):
        found.append(Symptom("check", "CG-005", f"padded rows {n_real}..{bs - 1}: req_pool_indices {rp}, "
                             f"seq_lens {sl} (fill {fill}), nonzero padded out_cache_loc {[x for x in loc if x][:4]}"))
    for backend in runner.backends:
        md, P = backend.forward_metadata, backend.page_size
        K = md.cache_seqlens_int32[n_real:bs].tolist()
        cu = md.cu_seqlens_q[: bs + 1].tolist()
        q = [cu[b + 1] - cu[b] for b in range(n_real, bs)]
        if any(k < x for k, x in zip(K, q)):
            found.append(Symptom("check", "CG-010", f"padded rows: K {K} < q {q} (empty causal span)"))
        pages = [md.page_table[b, : -(-k // P)].tolist() for b, k in zip(range(n_real, bs), K)]
        if any(any(row) for row in pages):
            found.append(Symptom("check", "CG-005", f"padded rows read pages {pages}, not the dummy page 0"))


def check_frozen_q(found: list, runner, fb: ForwardBatch, bs: int) -> None:
    """CG-006: the ``max_seqlen_q`` frozen at capture is the mode's bound (1 for decode, N for
    verify, W = Sd + 1 for draft extend) and covers every live request's query rows."""
    m = runner.mode
    bound = 1 if m.is_decode() else runner.N if m.is_target_verify() else runner.W
    for backend in runner.backends:
        frozen = backend.forward_metadata.max_seq_len_q
        if frozen != bound or max(fb.q_lens_cpu(), default=0) > frozen:
            found.append(Symptom("check", "CG-006", f"{m.name} graph bs={bs}: frozen max_seqlen_q {frozen}, "
                                 f"mode bound {bound}, live q lens {fb.q_lens_cpu()}"))


def check_buffers(found: list, backend, key) -> None:
    """CG-001: every captured metadata tensor of ``key = (mode, bs)`` is a view of the
    preallocated graph buffers (``init_cuda_graph_state``), so replay writes reach the graph."""
    gs = backend.graph_state
    md, _ = gs.captured[key]
    for name, buf in (("cache_seqlens_int32", gs.cache_seqlens), ("cu_seqlens_q", gs.cu_seqlens_q),
                      ("cu_seqlens_k", gs.cu_seqlens_k), ("page_table", gs.page_table)):
        t = getattr(md, name)
        if t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
            found.append(Symptom("check", "CG-001", f"{name} is not a view of its graph buffer (rebound)"))


def kv_snapshot(pool) -> list[torch.Tensor]:
    return [t.clone() for t in pool.k_buffer + pool.v_buffer]


def check_kv_writes(found: list, pool, before: list[torch.Tensor], allowed_slots: torch.Tensor, P: int) -> None:
    """A forward writes only its own ``out_cache_loc`` slots and the dummy page 0 (CG-005,
    PA-009): every other slot of every pool buffer is unchanged (NaN == NaN).

    Shapes: ``before``: clones of the pool's ``[NP, P, Hkv, D]`` K then V buffers (from
    :func:`kv_snapshot`); ``allowed_slots [T]`` int64 (slots)."""
    keep = torch.ones(before[0].shape[0] * P, dtype=torch.bool, device=before[0].device)
    keep[:P] = False
    keep[allowed_slots.long()] = False
    for old, new in zip(before, pool.k_buffer + pool.v_buffer):
        o, n = old.flatten(0, 1)[keep].float(), new.flatten(0, 1)[keep].float()
        diff = (o != n) & ~(torch.isnan(o) & torch.isnan(n))
        if bool(diff.any()):
            slots = keep.nonzero().flatten()[diff.flatten(1).any(1)].tolist()
            err = float((o - n).abs().nan_to_num(float("inf")).max())
            found.append(Symptom("mismatch", "CG-005", f"slots {slots[:6]} outside this batch were overwritten", err))
            return
