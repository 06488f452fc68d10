"""The mutants runner (``python -m refspec mutants``, :mod:`refspec.cli.mutants`): prove that
every wrong variant of :mod:`refspec.mutants.variants` is caught.

For each variant and each of its probes (:mod:`refspec.mutants.probes`) four runs:

=================  ===========  =====================================================================
run                variant      must
=================  ===========  =====================================================================
baseline, on       off          see nothing, with production validation on (the probe discriminates)
baseline, off      off          see nothing, with validation off
caught by          on           raise a named ``InvariantError`` (or an independent check fires)
                                whose ID is listed in the variant's ``Bug.caught_by``, having called
                                the variant's replacement at least once (its *reach*)
symptom            on           with validation off, show what the bug does: an output differing
                                from the oracle beyond tolerance, a KV value overwritten, an emulator
                                contract error or guard, a crash, or (padding-only variants) an
                                independent padded-row check
=================  ===========  =====================================================================

A variant is *caught* when at least one of its probes ran and every probe that ran passed both
baselines and, validated, called the replacement and named an ID of ``caught_by``.  The reach is
counted by :mod:`refspec.mutants.reach` (``variants.enabled`` wraps every replacement in a
counter): the table's *seam calls* column prints, per probe, the calls in the validated and the
validation-off run; a probe whose validated run never called the seam is "NOT REACHED" and its
variant is not caught, whatever ID it saw (the catch came from elsewhere, or the probe drives a
path the seam is not on).  A variant whose validation-off run shows
nothing is reported as *silent* (the bug would go unnoticed without validation on that device),
unless it is a variant that only removes a check (``Variant.only_with_validation``).
The command exits 1 unless every variant is caught.

``--device cuda`` runs the same probes in bf16 through the real FA3 kernel and real CUDA graphs.
``--engine`` adds token-level probes (:mod:`refspec.mutants.engine_probes`: whole spec loops,
"tokens / accepts differ" from the oracle loop; CPU fp32 only).  A probe that cannot run on the
device is listed as "not run" with the reason, never as a pass.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refspec.mutants import variants
from refspec.core.invariants import InvariantError
from refspec.mutants.checks import Env, ProbeUnavailable, Symptom
from refspec.mutants.engine_probes import ENGINE_PROBES
from refspec.mutants.probes import PROBES, Probe


@dataclass
class Observation:
    """What one run saw: suite-side ``symptoms`` and/or the exception the production wing raised."""

    symptoms: list[Symptom] = field(default_factory=list)
    error: BaseException | None = None
    skipped: str | None = None
    calls: int | None = None  #: calls of the variant's replacement in this run (None: no variant on)

    @property
    def detected(self) -> bool:
        return bool(self.symptoms) or self.error is not None

    @property
    def ids(self) -> list[str]:
        """Invariant IDs seen, in the order seen (a production error ends the run, so it is last)."""
        ids = [s.inv_id for s in self.symptoms]
        if isinstance(self.error, InvariantError):
            ids.append(self.error.inv_id)
        return list(dict.fromkeys(ids))

    @property
    def first_id(self) -> str | None:
        """The ID of the first detection (None if nothing, or only a crash naming no invariant)."""
        return self.ids[0] if self.ids else None

    def describe(self) -> str:
        """One cell: each (kind, ID) once with its worst error, mismatches first, then the error."""
        if self.skipped:
            return f"not run: {self.skipped}"
        worst: dict[tuple[str, str], Symptom] = {}
        for s in self.symptoms:
            k = (s.kind, s.inv_id)
            if k not in worst or (s.err or 0) > (worst[k].err or 0):
                worst[k] = s
        parts = []
        order = {"mismatch": 0, "tokens": 1, "accepts": 2}
        for s in sorted(worst.values(), key=lambda s: order.get(s.kind, 3)):
            if s.kind in ("tokens", "accepts"):
                parts.append(f"{s.kind} differ [{s.inv_id}]")
            elif s.kind != "mismatch":
                parts.append(f"check [{s.inv_id}]")
            elif s.err is None or s.err == float("inf"):
                parts.append(f"mismatch [{s.inv_id}] non-finite")
            else:
                x = "" if s.pct is None else f" ({s.pct / 100:.3g}x budget)"
                parts.append(f"mismatch [{s.inv_id}] err {s.err:.3g}{x}")
        if isinstance(self.error, InvariantError):
            parts.append(f"error [{self.error.inv_id}]")
        elif self.error is not None:
            parts.append(f"crash {type(self.error).__name__}: {str(self.error).splitlines()[0][:60]}")
        return "; ".join(parts) or "nothing"

    def details(self) -> list[str]:
        """Every symptom's and the error's full message (``--verbose``)."""
        lines = [f"{s.kind} [{s.inv_id}] {s.detail}" for s in self.symptoms]
        if self.error is not None:
            lines.append(f"{type(self.error).__name__}: {self.error}")
        return lines


def observe(probe: Probe, env: Env, validate: bool, variant: str | None) -> Observation:
    """Run ``probe`` once (``variant`` on, or none) and record what it saw and, with a variant, how
    often its replacement ran (``calls``; None if it could not be applied)."""
    obs = Observation()
    reach: dict = {}
    try:
        with variants.enabled(*([variant] if variant else [])) as reach:
            probe.run(env, obs.symptoms, validate)
    except ProbeUnavailable as e:  # EngineUnavailable, or an MLA probe on a build without the MLA kernel
        obs.skipped = str(e)
    except Exception as e:  # noqa: BLE001 - a crash is an observation
        obs.error = e
    if variant in reach:
        obs.calls = reach[variant].calls
    return obs


@dataclass
class ProbeResult:
    variant: variants.Variant
    probe: Probe
    baseline_on: Observation
    baseline_off: Observation
    caught_by: Observation
    symptom: Observation

    @property
    def skipped(self) -> str | None:
        """Why the probe could not run here (None: it ran)."""
        return next((o.skipped for o in (self.baseline_on, self.baseline_off, self.caught_by, self.symptom)
                     if o.skipped), None)

    @property
    def baseline_ok(self) -> bool:
        return not self.baseline_on.detected and not self.baseline_off.detected \
            and not self.baseline_on.skipped and not self.baseline_off.skipped

    @property
    def reached(self) -> bool:
        """The validated run with the variant on called its replacement (:mod:`refspec.mutants.reach`)."""
        return bool(self.caught_by.calls)

    @property
    def caught(self) -> bool:
        return self.baseline_ok and self.reached and self.caught_by.first_id in self.variant.caught_by

    @property
    def silent(self) -> bool:
        """Nothing seen with validation off (never for a variant that only removes a check)."""
        return not self.variant.only_with_validation and not self.symptom.skipped and not self.symptom.detected


@dataclass
class Report:
    device: str
    results: list[ProbeResult]

    def variants(self) -> dict[str, list[ProbeResult]]:
        out: dict[str, list[ProbeResult]] = {}
        for r in self.results:
            out.setdefault(r.variant.name, []).append(r)
        return out

    @property
    def caught(self) -> list[str]:
        """Variants with at least one probe that ran, every probe that ran catching them."""
        return [n for n, rs in self.variants().items()
                if any(not r.skipped for r in rs) and all(r.caught for r in rs if not r.skipped)]

    @property
    def total(self) -> int:
        return len(self.variants())

    @property
    def silent(self) -> list[str]:
        return [n for n, rs in self.variants().items() if any(r.silent for r in rs)]

    @property
    def not_reached(self) -> list[str]:
        """Variants with a probe that ran but never called the replacement in its validated run."""
        return [n for n, rs in self.variants().items() if any(not r.skipped and not r.reached for r in rs)]

    @property
    def reached(self) -> list[str]:
        """Variants whose every probe that ran called the replacement (validated run)."""
        return [n for n, rs in self.variants().items()
                if any(not r.skipped for r in rs) and all(r.reached for r in rs if not r.skipped)]

    def observed_ids(self, name: str) -> set[str]:
        """Every invariant ID any run of the variant ``name`` saw."""
        return {i for r in self.variants()[name] for o in (r.caught_by, r.symptom) for i in o.ids}


def device_reason(device: str) -> str | None:
    """Why probes cannot run on ``device`` (None: they can)."""
    if device == "cpu":
        return None
    from refspec.fa3.kernel import provider_status
    status = provider_status()["fa3"]
    return None if status == "available" else f"real FA3 unavailable: {status}"


def run(device: str = "cpu", only: list[str] | None = None, low_precision: bool | None = None,
        engine: bool = False) -> Report:
    """Run every probe of the chosen variants (all by default) four times; see the module doc.

    ``low_precision=True`` runs in bf16 on CPU too (default: bf16 on CUDA only).  ``engine``
    adds the token-level probes of :mod:`refspec.mutants.engine_probes` (slow: whole loops).
    Raises: RuntimeError if a variant is already applied (an enclosing ``variants.enabled``), KeyError
    for an unknown name.
    """
    if variants.active():
        raise RuntimeError(f"variants {sorted(variants.active())} already on (inside variants.enabled?): "
                           f"baselines would fail")
    names = list(only or variants.VARIANTS)
    for n in names:
        if n not in variants.VARIANTS:
            raise KeyError(f"unknown variant {n!r}; known: {sorted(variants.VARIANTS)}")
    env, reason, results = Env(device, low_precision), device_reason(device), []
    for n in names:
        probes = (PROBES.get(n) or [Probe("(no probe)", _no_probe)]) + (ENGINE_PROBES.get(n, []) if engine else [])
        for p in probes:
            if reason:
                skip = Observation(skipped=reason)
                results.append(ProbeResult(variants.VARIANTS[n], p, skip, skip, skip, skip))
                continue
            results.append(ProbeResult(variants.VARIANTS[n], p, observe(p, env, True, None),
                                       observe(p, env, False, None), observe(p, env, True, n),
                                       observe(p, env, False, n)))
    return Report(device, results)


def _no_probe(env, found, validate):
    raise LookupError("no probe registered for this variant in refspec.mutants.probes.PROBES")


def _caught_cell(r: ProbeResult) -> str:
    o = r.caught_by
    if o.skipped:
        return "not run"
    if not r.baseline_ok:
        return "BASELINE FAILS"
    if not r.reached:
        return "NOT REACHED" + (f" (saw {o.first_id})" if o.first_id else "")
    if o.first_id in r.variant.caught_by:
        return o.first_id
    if o.first_id:
        return f"WRONG ID {o.first_id} (docs: {', '.join(r.variant.caught_by)})"
    return "MISSED" + ("" if o.error is None else f" ({o.describe()})")


def _calls_cell(r: ProbeResult) -> str:
    """The replacement's calls in the validated / validation-off runs ("-": not run or not applied)."""
    if r.skipped:
        return "-"
    return " / ".join("-" if o.calls is None else str(o.calls) for o in (r.caught_by, r.symptom))


def format_report(rep: Report, verbose: bool = False) -> str:
    rows = [("variant", "probe", "caught by (validation on)", "seam calls", "symptom (validation off)", "baseline")]
    for r in rep.results:
        base = "not run" if r.skipped else "pass" if r.baseline_ok else (
            r.baseline_on.describe() if r.baseline_on.detected else r.baseline_off.describe())
        symptom = "n/a: it removes a check" if r.variant.only_with_validation and not r.symptom.detected \
            else r.symptom.describe()
        rows.append((r.variant.name, r.probe.label, _caught_cell(r), _calls_cell(r), symptom, base))
    w = [min(max(len(row[i]) for row in rows), cap) for i, cap in enumerate((29, 58, 27, 10, 90, 40))]
    lines = ["  ".join(c[: w[i]].ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    if rep.silent:
        lines.append(f"silent without validation on {rep.device}: {', '.join(rep.silent)}")
    if rep.not_reached:
        lines.append(f"NOT REACHED (the seam was never called in the run that caught it; not a catch): "
                     f"{', '.join(rep.not_reached)}")
    if verbose:
        for r in rep.results:
            for what, o in (("baseline, validation on", r.baseline_on), ("baseline, validation off", r.baseline_off),
                            ("caught by", r.caught_by), ("symptom", r.symptom)):
                lines += [f"  {r.variant.name} | {r.probe.label} | {what}: {d}" for d in o.details()]
    lines.append(f"seam reached {len(rep.reached)}/{rep.total} (seam calls: validation on / off)")
    lines.append(f"caught {len(rep.caught)}/{rep.total}")
    return "\n".join(lines)
