"""Optional token-level probes (``python -m refspec mutants --engine``): the whole speculative loop.

Each probe runs :func:`refspec.speculative.api.generate` on the production loop (FA3 wing, emulator on
CPU) with the variant on and compares it with the oracle loop (dense, per request) on a tiny
random Llama, fp32, so token streams compare bit for bit (TOL-001):

* ``tokens differ`` (SD-002): the emitted text is no longer the target's greedy text;
* ``accepts differ`` (same text): the per-round accept counts differ from the oracle loop's.
  The ID names the rule broken: SD-004 (v1 draft extend's kept row), SD-005 (v2), SD-009
  (a request's drafts depend on the batch), SD-001 (the target's verify predictions changed).

These are what a user of the engine would see.  They need the engine (:mod:`refspec.speculative`); they
run on CPU only: on the GPU the loop runs in bf16, where token streams follow the T2 rule
(TOL-003, margins) rather than bit equality, which the engine's own GPU tests cover.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.mutants import variants
from refspec.mutants.checks import Env, ProbeUnavailable, Symptom
from refspec.mutants.probes import Probe
from refspec.real.run import first_diff

PROMPTS = [[1, 5, 9, 3, 7], [2, 4, 6, 8, 10, 12, 14, 16, 18], [11, 13]]
BUDGETS = [12, 9, 14]  #: unequal, so requests finish apart and the batch shrinks (padded replays)
DRAFT = "early-exit:2"  #: accepts 1..N, mixed
NUM_STEPS = 3


class EngineUnavailable(ProbeUnavailable):
    """The engine cannot run here (a probe reports this as 'not run')."""


def _model(env: Env):
    key = ("engine-model", env.device)
    if key not in env._refs:
        from refspec.model.llama import LlamaModel, init_random_, tiny_config
        env._refs[key] = init_random_(LlamaModel(tiny_config()), seed=0).eval()
    return env._refs[key]


def _oracle(env: Env, version: str):
    key = ("engine-oracle", env.device, version)
    if key not in env._refs:
        from refspec.speculative.api import generate
        with variants.disabled():
            env._refs[key] = generate(_model(env), PROMPTS, backend="oracle", version=version, num_steps=NUM_STEPS,
                                      max_new_tokens=BUDGETS, draft=DRAFT)
    return env._refs[key]


def engine_probe(version: str, graphs: bool, accept_id: str, page_size: int = 2):
    """Production loop vs oracle loop; ``accept_id`` names the rule an accept-count change breaks."""
    def run(env, found, validate):
        if env.device != "cpu" or env.dtype != torch.float32:
            raise EngineUnavailable("token streams compare bit for bit in fp32 on CPU only (TOL-001)")
        try:
            from refspec.speculative.api import generate
        except ImportError as e:  # the engine is optional for the attention-level zoo
            raise EngineUnavailable(f"engine unavailable: {e}") from e
        ref = _oracle(env, version)
        out = generate(_model(env), PROMPTS, backend="fa3", version=version, page_size=page_size, graphs=graphs,
                       num_steps=NUM_STEPS, max_new_tokens=BUDGETS, draft=DRAFT, validate=validate,
                       capture_bs=(4,), provider=env.provider)
        for rid, (got, want) in enumerate(zip(out.tokens, ref.tokens)):
            if got != want:
                i = first_diff(got, want)
                found.append(Symptom("tokens", "SD-002", f"request {rid}: tokens differ from token {i} on "
                                     f"({got[i:i + 4]} vs {want[i:i + 4]})"))
        if not found and out.accepts != ref.accepts:  # same text, different drafts
            found.append(Symptom("accepts", accept_id, f"accept counts {out.accepts}, oracle loop {ref.accepts}"))
    return run


def _label(version, graphs):
    return f"engine {version} {'graphs' if graphs else 'eager'} P=2, 3 requests (tokens / accepts)"


#: variant -> its token-level probe: (version, graphs, the ID an accept-count change breaks).
#: Variants with no token-level symptom here are absent: pad-seq-lens-zero and pad-rows-live-page
#: (padded rows only), page-table-width-from-context (no request near the context wall).
_ENGINE = {
    "seed-page-table": ("v1", True, "SD-001"),
    "de-v1-uniform-cu-q": ("v1", True, "SD-004"),
    "de-v1-accept-off-by-one": ("v1", True, "SD-004"),
    "de-v1-attend-rejected": ("v1", False, "SD-004"),
    "de-v2-packed-cu-q": ("v2", True, "SD-005"),
    "de-v2-k-double-count": ("v2", False, "SD-005"),
    "replay-rebind-page-table": ("v1", True, "SD-001"),
    "replay-rebind-cache-seqlens": ("v1", True, "SD-001"),
    "stale-padded-rows": ("v1", True, "SD-001"),
    "capture-max-seqlen-q-small": ("v1", True, "SD-001"),
    "free-last-committed-page": ("v1", False, "SD-001"),
    "verify-as-decode": ("v1", False, "SD-001"),
    "draft-loc-step-major": ("v1", False, "SD-009"),
}
ENGINE_PROBES: dict[str, list[Probe]] = {
    name: [Probe(_label(v, g), engine_probe(v, g, acc))] for name, (v, g, acc) in _ENGINE.items()}
