"""The bug zoo is caught: every variant of ``refspec.mutants.variants.VARIANTS`` is detected on CPU, by the ID
its docs name, while the same probe with no variant on passes (``python -m refspec mutants``).

One module-scoped run of all probes (a few seconds) feeds the per-variant tests, so a failure
names the variant; the harness itself is tested on variants it must *not* call caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from refspec.cli.mutants import main as mutants_main
from refspec.fa3 import graph_metadata, metadata
from refspec.mutants import replacements, variants
from refspec.mutants import runner as mutants
from refspec.mutants.checks import Symptom
from refspec.mutants.probes import PROBES, Probe
from refspec.mutants.replace import NoCallSite, replaced
from refspec.mutants.mla_variants import MLA_VARIANTS
from refspec.mutants.tree_variants import TREE_VARIANTS

#: IDs of ``caught_by`` that only a real kernel can show (the emulator refuses the input first)
DEVICE_ONLY_IDS: dict[str, set[str]] = {}


@pytest.fixture(scope="module")
def report() -> mutants.Report:
    return mutants.run("cpu")


def results(report, name) -> list[mutants.ProbeResult]:
    return report.variants()[name]


def assert_caught(report, name, validated_ids, symptom_ids):
    """Every probe of ``name``: baselines pass, the validated run names one of ``validated_ids``,
    the validation-off run shows every ID of ``symptom_ids``."""
    for r in results(report, name):
        why = "\n".join(mutants.format_report(mutants.Report("cpu", [r]), verbose=True).splitlines()[2:])
        assert r.baseline_ok, f"{name} / {r.probe.label}: the probe fails with no variant on\n{why}"
        assert r.caught_by.first_id in validated_ids, f"{name} / {r.probe.label}\n{why}"
        assert set(symptom_ids) <= set(r.symptom.ids), f"{name} / {r.probe.label}\n{why}"


def test_every_variant_is_caught_on_cpu_and_every_baseline_passes(report):
    assert report.total == len(variants.VARIANTS) and set(PROBES) == set(variants.VARIANTS)
    text = mutants.format_report(report, verbose=True)
    assert all(r.baseline_ok for r in report.results), text
    assert sorted(report.caught) == sorted(variants.VARIANTS), text
    assert report.silent == [], text
    assert text.splitlines()[-1] == f"caught {len(variants.VARIANTS)}/{len(variants.VARIANTS)}"


@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_variant_docs_name_what_catches_it(report, name):
    """``Bug.caught_by`` is accurate (the validated run's ID is listed) and complete (every listed
    ID is seen by some run on CPU, save the device-only ones)."""
    bug = variants.VARIANTS[name]
    seen = report.observed_ids(name)
    for r in results(report, name):
        assert r.caught, mutants.format_report(mutants.Report("cpu", [r]), verbose=True)
        assert r.symptom.detected or bug.only_with_validation, \
            f"{name} / {r.probe.label}: no symptom with validation off"
    assert set(bug.caught_by) - DEVICE_ONLY_IDS.get(name, set()) <= seen, (bug.caught_by, seen)
    assert bug.changes and bug.source and bug.symptom and bug.seam


# ---- one test per family: a failure names the variant and the rule -------------------------

@pytest.mark.spec("PA-002", "CG-002")
def test_section_2_3_seed_page_table_reads_wrong_pages_not_a_crash(report):
    assert_caught(report, "seed-page-table", {"PA-002"}, {"CG-002", "PA-002"})
    for r in results(report, "seed-page-table"):  # finite garbage (#5090), no error
        worst = max(s.err for s in r.symptom.symptoms if s.kind == "mismatch")
        assert r.symptom.error is None and 0 < worst < float("inf")


@pytest.mark.spec("CG-003", "CG-004", "CG-002")
@pytest.mark.parametrize("name,inv", [("de-v1-uniform-cu-q", "CG-003"), ("de-v1-accept-off-by-one", "CG-003"),
                                      ("de-v2-packed-cu-q", "CG-004")])
def test_section_4_6_draft_extend_cu_seqlens_q_variants(report, name, inv):
    assert_caught(report, name, {inv}, {"CG-002", inv})


@pytest.mark.spec("MD-005", "MD-008")
def test_case_B05_v2_double_counted_k_eager_and_replay(report):
    assert_caught(report, "de-v2-k-double-count", {"MD-005"}, {"MD-008", "TOL-002"})


@pytest.mark.spec("CG-001", "CG-002")
@pytest.mark.parametrize("name", ["replay-rebind-page-table", "replay-rebind-cache-seqlens"])
def test_case_B11_rebound_buffers_are_caught_by_address_stability(report, name):
    assert_caught(report, name, {"CG-001"}, {"CG-001", "CG-002"})


@pytest.mark.spec("CG-005")
def test_case_B04_stale_padded_rows_overwrite_kv_outside_the_batch(report):
    assert_caught(report, "stale-padded-rows", {"CG-005"}, {"CG-005"})
    (r,) = results(report, "stale-padded-rows")
    assert any(s.kind == "mismatch" for s in r.symptom.symptoms)  # a KV value really changed


@pytest.mark.spec("CG-010", "CG-005")
def test_cases_B03_B10_padded_seq_lens_zero_give_an_empty_causal_span(report):
    assert_caught(report, "pad-seq-lens-zero", {"CG-010"}, {"CG-010", "CG-005"})


@pytest.mark.spec("CG-005")
def test_case_B18_padded_rows_must_read_the_dummy_page(report):
    assert_caught(report, "pad-rows-live-page", {"CG-005"}, {"CG-005"})


@pytest.mark.spec("CG-006", "PA-010")
def test_case_B08_frozen_max_seqlen_q_too_small(report):
    """Validated: the graph rule CG-006 is named (before PA-010, issue 23); unvalidated: the emulated
    kernel refuses the frozen scalar with PA-010."""
    assert_caught(report, "capture-max-seqlen-q-small", {"CG-006"}, {"PA-010"})


@pytest.mark.spec("CG-008")
def test_case_B07_page_table_width_at_the_context_wall(report):
    assert_caught(report, "page-table-width-from-context", {"CG-008"}, {"CG-008"})


@pytest.mark.spec("KV-004", "KV-003")
def test_free_last_committed_page_lets_another_request_overwrite_committed_kv(report):
    assert_caught(report, "free-last-committed-page", {"KV-004", "KV-003"}, {"KV-003"})
    first, grown = results(report, "free-last-committed-page")
    assert first.caught_by.first_id == "KV-004" and "KV-004" in first.symptom.ids
    assert grown.caught_by.first_id == "KV-003"  # a grown history double-frees the page


@pytest.mark.spec("MD-005", "MD-003")
def test_v1_draft_extend_attending_rejected_drafts(report):
    assert_caught(report, "de-v1-attend-rejected", {"MD-005"}, {"MD-003", "TOL-002"})


@pytest.mark.spec("MD-002", "PA-004")
def test_case_B14_verify_as_decode_fails_the_horizon_probe(report):
    assert_caught(report, "verify-as-decode", {"MD-002"}, {"PA-004", "MD-002"})


@pytest.mark.spec("MD-005")
def test_case_B20_step_major_draft_locations(report):
    assert_caught(report, "draft-loc-step-major", {"MD-005"}, {"MD-005"})
    eager, paired = results(report, "draft-loc-step-major")
    assert "TOL-002" in eager.symptom.ids  # FA3 on the wrong slots vs the correct reference
    # both wings on the same wrong batch: the paged oracle's own INV-TAIL refuses it
    assert [s.kind for s in paired.symptom.symptoms] == ["check"] and paired.symptom.ids == ["MD-005"]


@pytest.mark.spec("PA-004", "TOL-002")
@pytest.mark.parametrize("name", ["fa3-window-minus-one", "emulator-window-edge"])
def test_window_off_by_one_in_the_fa3_wing_and_in_the_emulator(report, name):
    assert_caught(report, name, {"PA-004"}, {"PA-004"})


@pytest.mark.spec("MD-006")
def test_replay_that_skips_validate_batch_is_caught(report):
    """Graph replay must validate the live batch (a bad CPU mirror) before it builds metadata."""
    (r,) = results(report, "replay-skips-validate-batch")
    assert r.baseline_ok and r.caught_by.first_id == "MD-006"
    assert not r.symptom.detected and not r.silent  # it only removes a check: nothing to see unvalidated


@pytest.mark.spec("MD-005", "TOL-002")
def test_positions_one_early_in_the_shared_core_is_caught_by_the_comparison(report):
    """The builders shift both out_cache_loc and positions, consistently with req_to_token: the
    paged oracle accepts the batch, and with validation off only its disagreement with FA3 shows."""
    assert_caught(report, "positions-one-early", {"MD-005"}, {"TOL-002"})
    for r in results(report, "positions-one-early"):
        assert [s.kind for s in r.symptom.symptoms] == ["mismatch"] and r.symptom.error is None


# ---- the FA3 top-k > 1 variants (refspec.mutants.tree_variants), in the same run ------------

@pytest.mark.spec("TR-004", "TR-011", "TR-012", "TR-015", "TR-018", "TR-019")
@pytest.mark.parametrize("name,validated,symptoms", [
    ("tree-mask-sibling-visible", {"TR-004", "TR-019"}, {"TR-004", "TR-011", "TR-012", "TR-019"}),
    ("expand-reads-prefix-twice", {"TR-011"}, {"TR-011", "TR-012"}),
    ("lse-merge-no-rescale", {"TR-012"}, {"TR-012"}),
    ("branch-no-tail-copy", {"TR-015", "TR-019"}, {"TR-015", "TR-019"}),
    ("draft-expand-unsliced-cache-loc", {"TR-018"}, {"TR-018"}),
    ("graph-mask-sibling-visible", {"TR-011", "TR-019"}, {"TR-011", "TR-012", "TR-019"}),
    ("expand-seqlens-all-nodes", {"TR-011"}, {"TR-011", "TR-012"}),
    ("expand-table-from-row-start", {"TR-011"}, {"TR-011", "TR-012"}),
])
def test_tree_variant_is_listed_applied_and_caught(report, name, validated, symptoms):
    assert name in TREE_VARIANTS and variants.VARIANTS[name] is TREE_VARIANTS[name]
    assert all(r.probe.label.startswith("TREE_") for r in results(report, name))
    for r in results(report, name):  # every probe passes with no variant on (baseline) and fires with it
        assert r.baseline_ok and r.caught_by.first_id in validated
    seen = {i for r in results(report, name) for i in r.symptom.ids}
    assert symptoms <= seen, (name, seen)
    for r in results(report, name):  # the table row: the variant, its probe, the catching ID, baseline pass
        row = mutants.format_report(mutants.Report("cpu", [r])).splitlines()[2]
        assert row.startswith(name[:29]) and r.caught_by.first_id in row and row.endswith("pass")


def test_tree_and_mla_variants_count_in_the_caught_line(report):
    text = mutants.format_report(report)
    n = len(variants.CHAIN_VARIANTS) + 8 + 5  # 8 top-k > 1 variants, 5 MLA variants
    assert set(TREE_VARIANTS) | set(MLA_VARIANTS) <= set(report.caught) and report.total == n
    assert text.splitlines()[-1] == f"caught {n}/{n}"


# ---- the MLA variants (refspec.mutants.mla_variants), in the same run ------------------------

@pytest.mark.spec("ML-002", "ML-003", "ML-005", "ML-007")
@pytest.mark.parametrize("name,validated,symptoms", [
    ("mla-split-at-kv-lora-rank", {"ML-003"}, {"ML-003", "ML-005"}),
    ("mla-scale-fa3-default", {"ML-007"}, {"ML-007", "TOL-002"}),
    ("mla-views-as-contiguous", {"ML-003"}, {"ML-003", "TOL-002"}),
    ("mla-qv-dropped", {"ML-005"}, {"ML-005", "TOL-002"}),
    ("mla-store-writes-slot-0", {"ML-002"}, {"ML-002"}),
])
def test_mla_variant_is_caught_by_the_rule_it_breaks(report, name, validated, symptoms):
    """Each MLA variant is named, with validation on, by the ML- rule it breaks (the recorded kernel
    call, or the store), before the output comparison or the emulator's own refusal."""
    assert variants.VARIANTS[name] is MLA_VARIANTS[name]
    assert all(r.probe.label.startswith("MLA ") for r in results(report, name))
    assert_caught(report, name, validated, symptoms)


@pytest.mark.spec("ML-002")
def test_mla_store_writing_slot_0_leaves_the_real_rows_right(report):
    """#36003's symptom is not in this batch's outputs (no real row reads slot 0) but in the pool:
    only the store check sees it."""
    (r,) = results(report, "mla-store-writes-slot-0")
    assert [(s.kind, s.inv_id) for s in r.symptom.symptoms] == [("check", "ML-002")] and r.symptom.error is None


@pytest.mark.spec("ML-003")
def test_the_split_variant_is_invisible_where_kv_lora_rank_is_v_head_dim():
    """Why its probe needs a layer whose v_head_dim differs from the pool's kv_lora_rank: on a
    DeepSeek layer (both 512) the variant runs (its seam is called) and changes nothing."""
    from refspec.mutants.mla_probes import VERIFY, eager_probe

    obs = mutants.observe(Probe("DeepSeek verify", eager_probe(VERIFY)), mutants.Env(), True,
                          "mla-split-at-kv-lora-rank")
    assert obs.calls >= 1 and not obs.detected, obs.describe()


@pytest.mark.spec("ML-003", "ML-005", "ML-007")
def test_the_mla_call_checks_refuse_a_copy_a_missing_qv_and_the_default_scale():
    """Negative controls for the probes' recorded-call check, no variant involved: the right call
    passes; a ``.contiguous()`` copy of a view (right values, not the pool), a call without ``qv``
    and FA3's default scale are each named by their rule."""
    from refspec.fa3.mla import mla_kv_views
    from refspec.mutants.mla_probes import VERIFY, check_call

    env = mutants.Env()
    b = VERIFY.build(env)
    k, v = mla_kv_views(b.pool, b.layer)
    good = dict(q=b.q_rope, k_cache=k, v_cache=v, qv=b.q, softmax_scale=VERIFY.scale())
    found = []
    check_call(found, good, b, VERIFY.scale())
    assert found == [] and abs(VERIFY.scale() - 0.1352) < 5e-5
    for bad, inv in ((dict(v_cache=v.contiguous()), "ML-003"), (dict(qv=None), "ML-005"),
                     (dict(softmax_scale=None), "ML-007")):
        found = []
        check_call(found, {**good, **bad}, b, VERIFY.scale())
        assert [s.inv_id for s in found] == [inv], (bad.keys(), found)


# ---- reach: each variant's replacement ran in the run that caught it (issue 42) -------------

def test_every_variant_reaches_its_seam_and_the_table_says_how_often(report):
    text = mutants.format_report(report)
    assert report.not_reached == [] and sorted(report.reached) == sorted(variants.VARIANTS), text
    assert text.splitlines()[-2] == f"seam reached {report.total}/{report.total} (seam calls: validation on / off)"
    head = text.splitlines()[0]
    assert head.index("caught by") < head.index("seam calls") < head.index("symptom")
    for r in report.results:
        assert r.caught_by.calls >= 1, (r.variant.name, r.probe.label)
        row = mutants.format_report(mutants.Report("cpu", [r])).splitlines()[2]
        assert f" {r.caught_by.calls} / {r.symptom.calls} " in row, row


@pytest.mark.spec("TR-011", "TR-018")
@pytest.mark.parametrize("name", ["graph-mask-sibling-visible", "expand-seqlens-all-nodes",
                                  "expand-table-from-row-start"])
def test_graphed_verify_variants_are_called_by_the_captured_graph(report, name):
    """Their replacement runs inside the verify graph: at capture and at the replay (the CPU's
    emulated graph re-runs the captured function), so at least twice in the graph probe."""
    (r,) = [r for r in results(report, name) if r.probe.label.startswith("TREE_VERIFY graph")]
    assert r.caught_by.calls >= 2 and r.symptom.calls >= 2 and r.caught


@pytest.mark.spec("TR-011")
@pytest.mark.parametrize("name", ["tree-mask-sibling-visible", "expand-reads-prefix-twice"])
def test_the_eager_verify_variants_never_reach_the_graphed_verify(name):
    """What issue 42 found, kept as a fact: the graphed verify builds its expand metadata from the
    builder's mask rows, so these two seams are never called there and change nothing; their
    descriptions say "eager", and their graphed twins are other variants."""
    from refspec.mutants.tree_probes import verify_graph_probe

    obs = mutants.observe(Probe("graphed verify", verify_graph_probe), mutants.Env(), True, name)
    assert obs.calls == 0 and not obs.detected, obs.describe()
    assert variants.VARIANTS[name].changes.startswith("eager verify")


def test_enabled_counts_every_call_and_nested_blocks_share_the_counter():
    from refspec.core.batch import draft_decode_steps_batch, draft_step_view
    from refspec.core.modes import ForwardMode
    from refspec.harness.scenario import Scenario
    b = Scenario(ForwardMode.DECODE, page_size=4, lens=[9, 5], draft_step=1).build()
    fb = draft_decode_steps_batch(b.kv, b.fb.req_pool_indices.tolist(), [9, 5], 3)
    with variants.enabled("draft-loc-step-major") as reach:
        step = reach["draft-loc-step-major"]
        assert step.calls == 0 and step.seam == "refspec.core.batch.draft_step_cut"
        draft_step_view(fb, 0, 3)
        with variants.enabled("draft-loc-step-major") as inner:
            draft_step_view(fb, 1, 3)
            assert inner["draft-loc-step-major"] is step
        with variants.disabled():
            draft_step_view(fb, 1, 3)  # the original: not counted
        assert step.calls == 2


def test_a_variant_whose_seam_is_never_called_is_not_caught_and_main_fails(monkeypatch, capsys):
    """Negative control: a probe that reports the right ID whenever any variant is on, without
    ever calling the seam, is "NOT REACHED", not a catch."""
    def sees_any_variant(env, found, validate):
        if variants.active():
            found.append(Symptom("check", "CG-002", "fires whenever a variant is on"))
    _fake_variant(monkeypatch, "unreached", Probe("never calls mode_delta", sees_any_variant))
    rep = mutants.run("cpu", ["unreached"])
    (r,) = rep.results
    assert r.baseline_ok and r.caught_by.first_id == "CG-002" and r.caught_by.calls == 0
    assert rep.caught == [] and rep.not_reached == ["unreached"]
    text = mutants.format_report(rep)
    assert "NOT REACHED (saw CG-002)" in text and " 0 / 0 " in text and "NOT REACHED (the seam" in text
    assert mutants_main(["--only", "unreached"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["seam reached 0/1 (seam calls: validation on / off)", "caught 0/1"]


def test_tree_variants_run_in_low_precision_the_cuda_path():
    """``--device cuda`` runs the same tree probes in bf16 (T1 budgets); the emulator in bf16 takes
    that path here, and the fp32-only loop probe reports "not run", never a pass."""
    rep = mutants.run("cpu", sorted(TREE_VARIANTS), low_precision=True)
    assert sorted(rep.caught) == sorted(TREE_VARIANTS), mutants.format_report(rep, verbose=True)
    loops = [r for r in rep.results if r.probe.label.startswith("TREE_LOOP")]
    assert len(loops) == 3 and all(r.skipped and "CPU fp32 only" in r.skipped for r in loops)


def test_cuda_run_lists_every_tree_probe(monkeypatch):
    """Without a GPU the cuda run reports each tree probe as not run (with the reason); with one
    it runs them (``device_reason`` None) through the same loop."""
    monkeypatch.setattr(mutants, "device_reason", lambda device: "no GPU in this test")
    rep = mutants.run("cuda", sorted(TREE_VARIANTS))
    assert sorted(rep.variants()) == sorted(TREE_VARIANTS) and rep.caught == []
    assert all(r.skipped == "no GPU in this test" for r in rep.results)
    assert len(rep.results) == sum(len(PROBES[n]) for n in TREE_VARIANTS)


def test_cli_runs_a_tree_variant(capsys):
    assert mutants_main(["--only", "lse-merge-no-rescale,branch-no-tail-copy"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "caught 2/2" and any(x.startswith("lse-merge-no-rescale") and "TR-012" in x for x in out)


def test_case_B20_step_major_is_invisible_at_batch_size_1():
    """Why B20 showed only at bs=2: with one request both cuts are the same slots."""
    from refspec.core.batch import draft_decode_steps_batch, draft_step_view
    from refspec.core.modes import ForwardMode
    from refspec.harness.scenario import Scenario
    b = Scenario(ForwardMode.DECODE, page_size=4, lens=[9], draft_step=1).build()
    fb = draft_decode_steps_batch(b.kv, b.fb.req_pool_indices.tolist(), [9], 3)
    right = [draft_step_view(fb, s, 3).out_cache_loc.tolist() for s in range(2)]
    with variants.enabled("draft-loc-step-major"):
        wrong = [draft_step_view(fb, s, 3).out_cache_loc.tolist() for s in range(2)]
    assert right == wrong == [[int(b.kv.req_to_token[1, 9])], [int(b.kv.req_to_token[1, 10])]]


# ---- the harness itself -------------------------------------------------------------------

def _fake_variant(monkeypatch, name, probe):
    original = metadata.mode_delta
    same = lambda fb, step: original(fb, step)  # replaces the seam, changes nothing
    monkeypatch.setitem(variants.VARIANTS, name, variants.Variant(name, original, same, "nothing", "test", "nothing",
                                                                  ("CG-002",)))
    monkeypatch.setitem(PROBES, name, [probe])


def test_replaced_rebinds_every_import_site_and_restores_them():
    """``mode_delta`` is bound in fa3.metadata and, by ``from ... import``, in fa3.graph_metadata:
    a variant must reach both (the replay path too), and leave both as they were."""
    original = metadata.mode_delta
    calls = []

    def spy(fb, step):
        calls.append(step)
        return original(fb, step)
    with replaced(original, spy) as sites:
        assert {m.__name__ for m, _ in sites} >= {"refspec.fa3.metadata", "refspec.fa3.graph_metadata"}
        assert metadata.mode_delta is spy and graph_metadata.mode_delta is spy
        assert replacements._orig["mode_delta"] is original  # refspec.mutants is never rebound
    assert metadata.mode_delta is original and graph_metadata.mode_delta is original


def test_replaced_refuses_a_seam_with_no_call_site_and_two_variants_on_one_seam():
    with pytest.raises(NoCallSite, match="bound nowhere"), replaced(lambda: None, lambda: None):
        pass
    # both replace graph_metadata.draft_extend_rows
    with pytest.raises(NoCallSite), variants.enabled("de-v2-packed-cu-q", "de-v1-accept-off-by-one"):
        pass
    assert variants.active() == set() and graph_metadata.draft_extend_rows is replacements._orig["draft_extend_rows"]


def test_production_modules_hold_no_variant_switch():
    """No production module mentions the bug zoo's machinery (issue 13)."""
    root = Path(__file__).resolve().parents[1] / "refspec"
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] in ("mutants", "cli", "conformance"):
            continue
        text = path.read_text()
        assert "is_on(" not in text and "variants.enabled" not in text and "refspec.bugs" not in text, path


def test_a_variant_that_changes_nothing_survives_and_main_fails(monkeypatch, capsys):
    _fake_variant(monkeypatch, "no-op", PROBES["verify-as-decode"][0])
    rep = mutants.run("cpu", ["no-op"])
    assert rep.caught == [] and rep.silent == ["no-op"]
    assert "MISSED" in mutants.format_report(rep)
    assert mutants_main(["--only", "no-op"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "caught 0/1"


def test_a_probe_that_fires_without_the_variant_is_not_a_catch(monkeypatch):
    def always(env, found, validate):
        found.append(Symptom("check", "CG-002", "fires whatever the code does"))
    _fake_variant(monkeypatch, "always", Probe("always fires", always))
    rep = mutants.run("cpu", ["always"])
    assert rep.caught == [] and not rep.results[0].baseline_ok
    assert "BASELINE FAILS" in mutants.format_report(rep)


def test_cli_prints_the_table_and_the_final_line(capsys):
    from refspec.cli import main
    assert main(["mutants", "--only", "verify-as-decode,free-last-committed-page"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["variant", "probe"] and out[-1] == "caught 2/2"
    assert any(line.startswith("verify-as-decode") and "MD-002" in line for line in out)


def test_cli_rejects_an_unknown_variant_and_a_variant_already_on(capsys):
    assert mutants_main(["--only", "no-such-variant"]) == 2
    err = capsys.readouterr().err
    assert "unknown variants 'no-such-variant'" in err and "seed-page-table" in err and len(err.splitlines()) == 1
    with variants.enabled("seed-page-table"), pytest.raises(RuntimeError, match="already on"):
        mutants.run("cpu", ["seed-page-table"])
    with variants.enabled("seed-page-table"):
        with variants.disabled():
            assert variants.active() == set()
        assert variants.active() == {"seed-page-table"}


@pytest.mark.spec("TOL-002")
def test_every_variant_is_caught_in_bf16_through_the_t1_budget():
    """The GPU comparison path (bf16, budget from the oracle's own bf16 error) on the emulator."""
    rep = mutants.run("cpu", low_precision=True)
    assert sorted(rep.caught) == sorted(variants.VARIANTS) and rep.silent == [], mutants.format_report(rep, True)


@pytest.mark.spec("SD-004", "MD-005")
def test_engine_level_v1_draft_extend_attending_rejected_drafts_changes_accepts_not_text():
    """The token-level view of ``de-v1-attend-rejected`` (the optional ``--engine`` probe): the
    production loop stays lossless but its drafts, hence accept counts, leave the oracle loop's."""
    rep = mutants.run("cpu", ["de-v1-attend-rejected"], engine=True)
    (r,) = [r for r in rep.results if r.probe.label.startswith("engine")]
    text = mutants.format_report(rep, verbose=True)
    assert r.caught and r.caught_by.first_id == "MD-005", text
    assert [s.kind for s in r.symptom.symptoms] == ["accepts"] and r.symptom.ids == ["SD-004"], text


def test_engine_probes_say_why_they_do_not_run_in_bf16():
    rep = mutants.run("cpu", ["verify-as-decode"], low_precision=True, engine=True)
    engine = [r for r in rep.results if r.probe.label.startswith("engine")]
    assert engine and all(r.skipped and "fp32" in r.skipped for r in engine)
    assert rep.caught == ["verify-as-decode"]  # the attention-level probe ran and caught it
    assert "not run" in mutants.format_report(rep)


@pytest.mark.gpu
def test_every_variant_is_caught_on_cuda_with_real_fa3_and_cuda_graphs():
    from refspec.fa3.kernel import mla_kernel_problem

    rep = mutants.run("cuda")
    text = mutants.format_report(rep, verbose=True)
    ran = [r for r in rep.results if not r.skipped]
    assert ran and all(r.baseline_ok for r in ran), text
    # the probes that do not run on CUDA are the fp32 tree-loop ones and, on an FA3 build without the
    # hdim 64 / 512 kernel, the MLA ones (refused by ML-013); each says why
    mla_refused = mla_kernel_problem("fa3", "qv") is not None
    skipped = [r for r in rep.results if r.skipped]
    assert all((r.probe.label.startswith("TREE_LOOP") and "fp32" in r.skipped)
               or (mla_refused and r.variant.name in MLA_VARIANTS and "ML-013" in r.skipped) for r in skipped), text
    expected = [n for n in variants.VARIANTS if not (mla_refused and n in MLA_VARIANTS)]
    assert sorted(rep.caught) == sorted(expected), text
