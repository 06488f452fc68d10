"""The probes of the MLA variants (:mod:`refspec.mutants.mla_variants`): the FA3 wing's MLA branch,
eager and under graph replay, with every kernel call recorded.

Same contract as :mod:`refspec.mutants.probes`: ``run(env, found, validate)`` drives the
production wing (``validate`` passed to its backend) and appends what the suite-side checks see to
``found``; a production error propagates.  Every expected value comes from the scenario's own
numbers and the rules as written, never from the seam a variant replaces:

* **the kernel call** (recorded at ``refspec.fa3.kernel.attention``, checked *before* the kernel
  runs, so a call the emulator then refuses is still named by the rule it breaks):
  ML-003, the cache operands are ``[NP, P, 1, D - Dv]`` and ``[NP, P, 1, Dv]`` views of the
  pool's row storage (``c_kv`` at the row's first element, ``k_rope`` Dv elements later) with
  strides ``(D P, D, D, 1)``, Dv the *layer's* ``v_head_dim``; ML-005, ``qv`` is given,
  ``[T, H, Dv]``, and ``q`` is ``[T, H, D - Dv]``; ML-007, ``softmax_scale`` is the hand formula
  ``(Dn + Dr)^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2`` of the scenario's dims;
* **the store** (ML-002): after the forward, each live token's slot holds ``[k | k_rope]`` and
  slot 0 holds the sentinel written there before (a padded graph row must not change it);
* **the output**: T1 (TOL-002) against the fp32 oracle (absorbed MLA by slot,
  :class:`~refspec.oracle.backend.OracleBackend`) of a fresh build with every variant off; a
  replay that misses names CG-002, or TOL-002 when eager FA3 misses too.

Scenarios: DeepSeek-V3's attention dims (R 512, Dr 64, the YaRN scale 0.1352) and 4 heads,
3 requests; the split probe's pool declares the same 576-wide row as R 500 + Dr 76 under a layer
that reads it as 512 / 64 (the only way upstream's split and the pool's can differ).  On CUDA the
probes run only where the FA3 build has the hdim 64 / 512 kernel; elsewhere they report "not run"
with the ML-013 refusal.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from refspec.core.mla import DEEPSEEK_V3_DIMS, DEEPSEEK_V3_ROPE_SCALING, MLADims
from refspec.core.modes import ForwardMode as M
from refspec.core.tolerance import t1
from refspec.fa3 import kernel
from refspec.harness.mla_scenario import MLABuilt, MLAScenario
from refspec.mutants import variants
from refspec.mutants.checks import Env, ProbeUnavailable, Symptom
from refspec.mutants.replace import replaced

SENTINEL0 = -3.0  #: written into slot 0 before a graph probe: the store must leave it there (ML-002)


@dataclass(frozen=True)
class MLACase:
    """One MLA probe scenario: ``mode``, ``page_size``, ``lens`` (as :class:`MLAScenario`), the pool's
    ``dims``, the ``rope_scaling``, extra scenario fields, and ``v_head_dim``: the absorbed layer's
    split point when it is not the pool's ``kv_lora_rank`` (then ``q`` / ``q_rope`` are drawn for it)."""

    label: str
    mode: M
    page_size: int
    lens: tuple
    dims: MLADims = DEEPSEEK_V3_DIMS
    rope_scaling: dict | None = None
    v_head_dim: int | None = None
    draft_step: int | None = None

    def build(self, env: Env) -> MLABuilt:
        """The scenario on the probe's device and dtype (``ProbeUnavailable`` where MLA is refused)."""
        if env.device != "cpu":
            problem = kernel.mla_kernel_problem(env.provider, "qv")
            if problem:
                raise ProbeUnavailable(f"MLA on this GPU's FA3 is refused (ML-013): {problem}")
        b = MLAScenario(self.mode, self.page_size, list(self.lens), dims=self.dims, rope_scaling=self.rope_scaling,
                        draft_step=self.draft_step, dtype=env.dtype, device=env.device, seed=self.page_size).build()
        if self.v_head_dim is not None:
            Dv, D = self.v_head_dim, self.dims.kv_cache_dim
            g = torch.Generator(device=env.device).manual_seed(99)
            T, H = b.q.shape[:2]
            b.layer = dataclasses.replace(b.layer, v_head_dim=Dv)
            b.q = torch.randn(T, H, Dv, generator=g, device=env.device).to(env.dtype)
            b.q_rope = torch.randn(T, H, D - Dv, generator=g, device=env.device).to(env.dtype)
        return b

    def scale(self) -> float:
        """ML-007 by hand: ``(Dn + Dr)^-0.5``, times ``mscale^2`` under YaRN."""
        s = (self.dims.qk_nope_head_dim + self.dims.qk_rope_head_dim) ** -0.5
        if self.rope_scaling:
            m = 0.1 * self.rope_scaling["mscale_all_dim"] * math.log(self.rope_scaling["factor"]) + 1
            s *= m * m
        return s


def _reference(env: Env, case: MLACase):
    """(fp32 oracle, its low-precision run or None) of a fresh build, every variant off; memoised."""
    key = ("mla", case.label, env.dtype)
    if key not in env._refs:
        with variants.disabled():
            b = case.build(env)
            low = None if env.dtype == torch.float32 else b.run_oracle(upcast=False)
            env._refs[key] = (b.run_oracle(), low)
    return env._refs[key]


def _once(found: list, kind: str, inv: str, detail: str) -> None:
    """Append a Symptom unless one of this kind and ID is already there (a probe makes many calls)."""
    if not any(s.kind == kind and s.inv_id == inv for s in found):
        found.append(Symptom(kind, inv, detail))


def check_call(found: list, kw: dict, b: MLABuilt, scale: float) -> None:
    """One recorded ``kernel.attention`` call of the MLA branch against ML-003 / ML-005 / ML-007 (module doc)."""
    pool, layer = b.pool, b.layer
    row = pool.get_key_buffer(layer.layer_id)
    D, Dv, P, NP = pool.kv_cache_dim, layer.v_head_dim, pool.page_size, pool.num_pages
    k, v = kw["k_cache"], kw["v_cache"]
    start, elt = row.data_ptr(), row.element_size()
    views = [("k_cache (k_rope)", k, (NP, P, 1, D - Dv), start + Dv * elt),
             ("v_cache (c_kv)", v, (NP, P, 1, Dv), start)]
    for name, t, shape, ptr in views:
        if tuple(t.shape) != shape or t.stride() != (D * P, D, D, 1) or t.data_ptr() != ptr:
            _once(found, "check", "ML-003", f"{name} {tuple(t.shape)} strides {t.stride()} at element "
                  f"{(t.data_ptr() - start) // elt} of the pool's row storage; the rule: {shape} strides "
                  f"{(D * P, D, D, 1)} at element {(ptr - start) // elt} (the row split at the layer's "
                  f"v_head_dim {Dv})")
    q, qv = kw["q"], kw.get("qv")
    T, H = q.shape[:2]
    if qv is None or tuple(qv.shape) != (T, H, Dv) or tuple(q.shape) != (T, H, D - Dv):
        _once(found, "check", "ML-005", f"q {tuple(q.shape)}, qv {None if qv is None else tuple(qv.shape)}; the "
              f"absorbed call takes q = q_rope [T, H, {D - Dv}] and qv = the absorbed q_nope [T, H, {Dv}]")
    s = kw.get("softmax_scale")
    if s is None or abs(s - scale) > 1e-9 * scale:
        _once(found, "check", "ML-007", f"softmax_scale {s!r} (None: FA3's default (D + Dv)^-0.5 = "
              f"{D ** -0.5:.4f} with qv); the layer's (Dn + Dr)^-0.5 * mscale^2 is {scale:.4f}")


@contextmanager
def recorded(found: list, b: MLABuilt, scale: float):
    """Inside the block every ``kernel.attention`` call is checked (:func:`check_call`), then run."""
    real = kernel.attention

    def attention(**kw):
        check_call(found, kw, b, scale)
        return real(**kw)
    with replaced(real, attention):
        yield


def check_store(found: list, b: MLABuilt, q_tokens: int | None = None) -> None:
    """ML-002 after the forward: each live token's slot holds ``[k | k_rope]`` (the pool's dtype);
    slot 0 still holds :data:`SENTINEL0`."""
    row = b.pool.get_key_buffer(b.layer.layer_id)
    loc = b.fb.out_cache_loc.long()
    want = torch.cat([b.k, b.k_rope], dim=-1).to(row.dtype)
    live = loc != 0
    if not torch.equal(row[loc[live]], want[live]):
        _once(found, "check", "ML-002", "a live token's slot does not hold its [k_nope | k_rope] row")
    if not bool((row[0] == SENTINEL0).all()):
        bad = row[0, 0][row[0, 0] != SENTINEL0]
        _once(found, "check", "ML-002", f"slot 0 (the padding slot) was written: {bad.numel()} of its "
              f"{row.shape[-1]} values changed (e.g. {float(bad[0]):.3g})")


def _compare(env, found, out, case, inv, what) -> bool:
    ref, low = _reference(env, case)
    v = t1(out, ref, low)
    if not v.ok:
        found.append(Symptom("mismatch", inv, f"{what} vs the MLA oracle: {v}", v.err, v.pct))
    return v.ok


def _eager(b: MLABuilt, env: Env, validate: bool):
    be = b.fa3_backend(env.provider, validate)
    be.init_forward_metadata(b.fb)
    return be.forward(b.q, b.k, b.k, b.layer, b.fb, q_rope=b.q_rope, k_rope=b.k_rope)


def eager_probe(case: MLACase):
    """Eager FA3 on an MLA pool: the recorded call (ML-003 / ML-005 / ML-007), the store (ML-002),
    then the output vs the oracle (TOL-002)."""
    def run(env, found, validate):
        b = case.build(env)
        b.pool.get_key_buffer(0)[0] = SENTINEL0
        with recorded(found, b, case.scale()):
            out = _eager(b, env, validate)
        check_store(found, b)
        _compare(env, found, out, case, "TOL-002", f"eager FA3 {case.label}")
    return run


def graph_probe(case: MLACase, capture_bs=(4,)):
    """Capture once, replay the live batch padded into ``capture_bs`` (a padded row stores at
    out_cache_loc 0): the recorded calls, the store (slot 0 keeps its sentinel, ML-002), the
    output vs the oracle (CG-002, or TOL-002 when eager FA3 misses too)."""
    def run(env, found, validate):
        b = case.build(env)
        b.pool.get_key_buffer(0)[0] = SENTINEL0
        with recorded(found, b, case.scale()):
            runner = b.graph_runner(capture_bs=capture_bs, provider=env.provider, validate=validate)
            out = b.run_fa3_graph(runner)
        check_store(found, b)
        n = len(found)
        if not _compare(env, found, out, case, "CG-002", f"replay of {b.fb.batch_size} in Bg={max(capture_bs)}"):
            if not _eager_matches(env, case):
                found[n].inv_id = "TOL-002"  # eager is wrong too: not a replay-only bug
    return run


def _eager_matches(env: Env, case: MLACase) -> bool:
    """Whether eager FA3 (validation off, the current variants on) matches the oracle."""
    try:
        b = case.build(env)
        return _compare(env, [], _eager(b, env, False), case, "TOL-002", "eager")
    except Exception:  # noqa: BLE001 - any failure means "does not match"
        return False


LENS = (5, 17, 70)  #: partial last pages at P = 4 and 16, one request over several pages
VERIFY = MLACase("verify", M.TARGET_VERIFY, 16, LENS, rope_scaling=DEEPSEEK_V3_ROPE_SCALING)
DECODE = MLACase("decode", M.DECODE, 4, LENS, rope_scaling=DEEPSEEK_V3_ROPE_SCALING)
#: the pool declares the 576-wide row as 500 + 76; the layer reads it as 512 / 64 (docstring)
SPLIT = MLACase("split", M.TARGET_VERIFY, 16, LENS, dims=MLADims(kv_lora_rank=500, qk_rope_head_dim=76,
                                                                  qk_nope_head_dim=128, v_head_dim=128),
                v_head_dim=512)

_verify = ("MLA TARGET_VERIFY eager P=16, DeepSeek dims, YaRN scale", eager_probe(VERIFY))
_decode = ("MLA DECODE replay P=4, B=3 in Bg=4, DeepSeek dims", graph_probe(DECODE))

#: variant name -> (label, run) pairs (:mod:`refspec.mutants.probes` wraps them as ``Probe`` s)
MLA_PROBES = {
    "mla-split-at-kv-lora-rank": [("MLA TARGET_VERIFY eager P=16, layer v_head_dim 512 over a pool of 500 + 76",
                                   eager_probe(SPLIT))],
    "mla-scale-fa3-default": [_verify, _decode],
    "mla-views-as-contiguous": [_verify, _decode],
    "mla-qv-dropped": [_verify, _decode],
    "mla-store-writes-slot-0": [_decode],
}
