"""Probes for the variants the architecture audit (issue 13) added: windows, replay validation,
and the shared core seen by both wings.

* :func:`window_probe`: eager FA3 with a left window against the oracle (PA-004); ``provider``
  pins the emulator for the emulator's own variant, on any device.
* :func:`replay_validation_probe`: graph replay must refuse a live batch whose CPU mirror
  ``seq_lens_cpu`` is out of step with ``seq_lens`` (MD-006) before building metadata from it.
* :func:`paired_probe`: a shared-core variant changes the batch *both* wings read, so the probe
  builds one grown-rows batch (:mod:`refspec.harness.grown`) with the variant on and runs the
  paged oracle and the FA3 path on that same batch: the oracle's own checks (MD-005, MD-012)
  or the comparison must see it, not a reference built without the variant.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.core.invariants import InvariantError
from refspec.core.tolerance import t1
from refspec.harness.grown import GrownScenario
from refspec.mutants.checks import Symptom, compare


def window_probe(case_fn, provider: str | None = None):
    """Eager FA3 (``provider``, default the device's) vs the oracle; a mismatch names PA-004."""
    def run(env, found, validate):
        case = case_fn(env)
        b = case.build()
        out = b.run_fa3(provider or env.provider, validate)
        compare(env, found, out, case, inv="PA-004", what=f"eager FA3 ({provider or env.provider}), window "
                f"{case.sc.window_left}")
    return run


def replay_validation_probe(case_fn, capture_bs=(4,)):
    """Validated: replay a batch whose ``seq_lens_cpu`` runs one token ahead of ``seq_lens``; the
    replay must raise MD-006 (else a ``check`` Symptom MD-006).  Unvalidated: replay the correct
    batch and compare with the oracle (nothing to see: the variant only removes a check)."""
    def run(env, found, validate):
        case = case_fn(env)
        b = case.build()
        runner = b.graph_runner(capture_bs=capture_bs, provider=env.provider, validate=validate)
        inputs = {"q": b.q, "k": b.k, "v": b.v}
        if not validate:
            compare(env, found, runner.replay(b.fb, inputs), case, inv="CG-002", what="replay")
            return
        bad = b.fb.replace(seq_lens_cpu=b.fb.seq_lens_cpu + 1)
        try:
            runner.replay(bad, inputs)
        except InvariantError as e:
            if e.inv_id == "MD-006":
                return  # the replay checked the live batch before using it
            raise
        found.append(Symptom("check", "MD-006", f"replay ran a batch whose seq_lens_cpu "
                             f"{bad.seq_lens_cpu.tolist()} is not a mirror of seq_lens {bad.seq_lens.tolist()}"))
    return run


def grown(mode, page_size, **kw):
    """``env -> GrownScenario`` on the probe's device and dtype."""
    return lambda env: GrownScenario(mode, page_size, device=env.device, dtype=env.dtype, **kw)


def paired_probe(grown_fn):
    """Both wings on one batch built with the current variants on (module doc).

    The oracle's InvariantError becomes a ``check`` Symptom (it is the suite's reference, not
    the production wing); FA3 runs with ``validate``; outputs compare under T1 (TOL-002), the
    budget from the oracle's own low-precision run on the same batch."""
    def run(env, found, validate):
        b = grown_fn(env).build()
        try:
            ref = b.run_oracle()
            ref_low = None if env.dtype == torch.float32 else b.run_oracle(upcast=False)
        except InvariantError as e:
            found.append(Symptom("check", e.inv_id, f"paged oracle refuses the batch: {e}"))
            ref = None
        out = b.run_fa3(env.provider, validate)
        if ref is not None:
            v = t1(out, ref, ref_low)
            if not v.ok:
                found.append(Symptom("mismatch", "TOL-002", f"FA3 vs the paged oracle on the same batch: {v}",
                                     v.err, v.pct))
    return run
