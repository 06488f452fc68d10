"""The MLA forward path against upstream's own (marker ``conformance``): the MLA known bugs as
negative controls on real upstream code, and their reachability from the releases' own guards.

Each control of :data:`refspec.conformance.controls.MLA_CONTROLS` runs SGLang's own
``FlashAttentionBackend`` forward with ``use_mla`` (its own ``MLATokenToKVPool`` and EAGLE
worker code, the kernel globals recorded around refspec's emulator:
:mod:`refspec.conformance.upstream_mla`) on the release that has the bug and on the code that
fixed it, refspec's side unchanged.  It must FAIL on the first, in its listed (mode, phase)
pairs only, each failing row naming the bug's rule, and PASS on the second.  ``make
conformance`` runs this file (the last test, refspec's side of the full grid, runs in ``make
test`` too).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refspec.conformance import cases, controls, install, known, mla_forward, reach



def quiet(*_):
    pass


@pytest.fixture(scope="module")
def results() -> dict:
    return {r.control.key: r for r in controls.run_controls(controls.MLA_CONTROLS, log=quiet)}


def _failing(rows):
    return [r for r in rows if not r.ok]


@pytest.mark.conformance
@pytest.mark.spec("ML-011", "PA-011")
def test_mla_verify_expand_reads_p_paged_views_on_0523_and_conforms_with_page_size_one_views(results):
    """top-k 2, TARGET_VERIFY: 0.5.23's MLA branch hands the cascade's expand call (its table holds
    token slots) the P-paged latent views.  At P = 1 the two views coincide (no failure); at P = 4
    every phase fails on the expand call's k_cache / v_cache (and the output), by ML-011.  With the
    page-size-one views (patches/proposed/mla-verify-expand-page1.diff) every row passes."""
    res = results["mla-verify-expand-paged-view"]
    assert not res.problems(), controls.render([res])
    failing = _failing(res.buggy)
    assert {r.page_size for r in failing} == {4} and {r.phase for r in failing} == {"eager", "capture", "replay"}
    assert [r for r in res.buggy if r.page_size == 1 and r.ok]  # P = 1: the same views, conforms
    for r in failing:
        assert r.bug == "mla-verify-expand-paged-view" and {f.rule for f in r.findings} == {"ML-011"}
        fields = {d.field for d in r.undocumented}
        assert fields & {"kernel:expand.k_cache", "kernel:expand.v_cache"}, fields
    assert res.fixed and not _failing(res.fixed)


@pytest.mark.conformance
@pytest.mark.spec("ML-012")
def test_mla_pool_without_move_kv_cache_fails_on_0512_at_a_partial_tail_and_0523_moves_rows(results):
    """top-k 2 draft decode, eager: at P = 4 (a partial prefix tail page) 0.5.12.post1's own v1
    worker copies the tail into the branches with ``token_to_kv_pool.move_kv_cache``, which its
    ``MLATokenToKVPool`` lacks: AttributeError, by ML-012; at P = 1 there is no tail to copy.
    0.5.23 (sglang#26982) moves the rows refspec moves."""
    res = results["mla-pool-no-move-kv-cache"]
    assert not res.problems(), controls.render([res])
    failing = _failing(res.buggy)
    assert failing and {r.page_size for r in failing} == {4}
    assert all(r.error and "move_kv_cache" in r.error and "eagle_worker.py" in r.error for r in failing)
    assert all({f.rule for f in r.findings} == {"ML-012"} for r in failing)
    assert res.fixed and not _failing(res.fixed)


@pytest.mark.conformance
@pytest.mark.spec("ML-002")
def test_mla_store_writes_slot_0_on_0512_graphs_and_0523_skips_it(results):
    """A CUDA graph's padded rows store at out_cache_loc 0: 0.5.12.post1's MLA writer writes the
    reserved padding slot (``mla:slot0``), 0.5.23 skips it (sglang#36003); eager rows (no padding)
    conform on both."""
    res = results["mla-store-writes-slot-0"]
    assert not res.problems(), controls.render([res])
    failing = _failing(res.buggy)
    assert failing and {r.phase for r in failing} == {"capture", "replay"}
    assert all("mla:slot0" in {d.field for d in r.undocumented} for r in failing)
    assert all(r.bug == "mla-store-writes-slot-0" and "ML-002" in {f.rule for f in r.findings} for r in failing)
    assert res.fixed and not _failing(res.fixed)


def _sa(backend: str, P: int = 4, k: int = 2) -> SimpleNamespace:
    """The fields the releases' top-k guards read, for EAGLE top-k ``k`` at page size ``P`` on ``backend``
    (an MLA model's: no MLA-specific guard reads anything else, module doc of :mod:`reach`)."""
    return SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=k, speculative_num_steps=3,
                           speculative_num_draft_tokens=4, page_size=P, attention_backend=backend,
                           decode_attention_backend=None, prefill_attention_backend=None,
                           speculative_adaptive=False)


@pytest.mark.conformance
@pytest.mark.spec("ML-011", "ML-012")
@pytest.mark.parametrize("pin, line", [("0.5.23", "speculative_hook.py:1278"), ("0.5.12.post1", "server_args.py:3842")])
def test_mla_topk_gt1_paged_fa3_passes_the_releases_own_guards(pin, line):
    """MLA + EAGLE top-k 2 + P 4 on fa3 is reachable at both pins: the one guard on the pair
    (0.5.23 ``_PAGE_TREE_SPEC_BACKENDS``; 0.5.12.post1 ``["flashinfer", "fa3"]``) lets fa3 through,
    evaluated by Python from the release's own file (:func:`reach.verdict`).  Negative control: the
    same configuration on flashmla is refused by that very line."""
    site = install.resolve(pin, log=quiet).site
    why, _ = reach.verdict(site, _sa("fa3"))
    assert why is None
    why, _ = reach.verdict(site, _sa("flashmla"))
    assert why and line in why and "raises" in why
    assert reach.verdict(site, _sa("flashmla", P=1))[0] is None  # page size 1: no such guard
    assert {b.key for b in known.BUGS if b.key.startswith("mla-")} >= {"mla-verify-expand-paged-view",
                                                                        "mla-pool-no-move-kv-cache"}


def test_the_full_mla_grid_fits_its_lengths_in_the_context():
    """``--mla-grid full`` reaches B = 5 at P = 64 (L up to 3P - 1 = 191): the job's upstream
    ``context_len`` grows to a multiple of the default that holds L + N, and its ``req_to_token``
    rows are that wide plus SGLang's headroom (the job built at 64 failed refspec's own KV-003
    check: seq_len 195 past the req_to_token width 135)."""
    job = mla_forward.flat_job("mla_decode", 64, "B5/bs8")
    L = cases.lengths(64, 5)
    assert job.inputs["context_len"] == 256 >= max(L) + cases.N
    assert job.inputs["req_to_token"].shape[1] >= max(L) + cases.N
    assert mla_forward.flat_job("mla_decode", 16).inputs["context_len"] == mla_forward.CONTEXT  # the default grid


# ---- replay buffers, adapter gaps and the output's cause (no upstream needed) ----

def _finding(field, rule, padded=False, where=("sglang/srt/x.py", 1)):
    from refspec.conformance import report, rules

    return report.Finding(rule, rules.level(rule), field, "a", "b", where, None, padded=padded)


def _row(mode, P, phase, findings):
    from refspec.conformance import report

    return report.Row("x", f"{mode}/P{P}", mode, P, "k2", phase, 0, findings=list(findings))


@pytest.mark.spec("ML-002", "TR-018", "ML-005", "ML-011")
def test_an_mla_output_difference_takes_the_rule_of_its_cause():
    """``mla_forward.attribute``: padded rows differing beside a slot-0 write are ML-002 (they read slot
    0), a live output beside a differing table takes the table's rule (TR-018) and its line, the
    output alone keeps its own rule, never ML-011 at P = 1 (the P-paged views are the page-size-1
    views there).  Negative controls: at P = 4 the lone cascade output stays ML-011; an output whose
    row shows nothing else is not renamed."""
    padded = _row("mla_decode", 1, "replay", [_finding("kernel:cache_seqlens", "CG-001"),
                                               _finding("mla:out[padded]", "ML-005", padded=True),
                                               _finding("mla:slot0", "ML-002", where=("sglang/srt/y.py", 907))])
    mla_forward.attribute(padded)
    assert [f.rule for f in padded.findings] == ["CG-001", "ML-002", "ML-002"]
    assert padded.findings[1].where == ("sglang/srt/y.py", 907)
    live = _row("mla_tree_draft_decode", 1, "replay", [
        _finding("expand:page_table[live]", "TR-018", where=("sglang/srt/fa.py", 1656)),
        _finding("mla:out", "ML-011"), _finding("mla:slot0", "ML-002")])
    mla_forward.attribute(live)
    assert [f.rule for f in live.findings] == ["TR-018", "TR-018", "ML-002"]
    assert live.findings[1].where == ("sglang/srt/fa.py", 1656)
    for P, rule in ((1, "ML-005"), (4, "ML-011")):
        alone = _row("mla_tree_verify", P, "eager", [_finding("mla:out", "ML-011")])
        mla_forward.attribute(alone)
        assert [f.rule for f in alone.findings] == [rule], P
    flat = _row("mla_decode", 4, "eager", [_finding("mla:out", "ML-005")])
    mla_forward.attribute(flat)
    assert [f.rule for f in flat.findings] == ["ML-005"]


@pytest.mark.spec("CG-001", "MD-003")
def test_a_stale_mla_replay_buffer_is_cg_001_by_the_mha_route_and_cites_where_the_replay_writes_it():
    """An MLA replay's kernel ``cache_seqlens`` differing while the metadata agrees is marked stale
    (``mla_forward.diffs``) and goes, as on the MHA path, through ``rules.rule_for(..., stale=True)`` to
    CG-001; its line is found where the replay wrote the metadata field (``kernel:cache_seqlens`` reads
    ``cache_seqlens_int32``).  Negative control: the same difference unmarked is MD-003 (the K rule)."""
    from refspec.conformance import rules

    for mode in ("mla_decode", "decode"):
        assert rules.rule_for(mode, "replay", "kernel:cache_seqlens", stale=True) == "CG-001", mode
        assert rules.rule_for(mode, "replay", "kernel:cache_seqlens") == "MD-003", mode
    assert rules.rule_for("mla_tree_draft_decode", "replay", "kernel:prefix.cache_seqlens", stale=True) == "CG-001"
    line = "    metadata.cache_seqlens_int32 = seq_lens.to(torch.int32)"
    pat = rules._field_pattern("kernel:cache_seqlens")
    assert pat is not None and any(owner == "metadata" for _, owner in pat.matches(line))
    assert rules._field_pattern("kernel:causal") is None
    job = mla_forward.flat_job("mla_decode", 1)
    ours = job.refspec[("replay", None)]
    theirs = {k: v for k, v in ours.items()}
    call = dict(ours[mla_forward.KERNEL][0])
    k = call["args"]["cache_seqlens"]
    call["args"] = dict(call["args"], cache_seqlens=dict(k, tensor=torch.ones_like(k["tensor"])))
    theirs[mla_forward.KERNEL] = [call]
    (d,) = [d for d in mla_forward.diffs(job, "replay", ours, theirs, 3) if d.field.startswith("kernel:")]
    assert d.field == "kernel:cache_seqlens" and d.stale and d.at is None
    (e,) = [d for d in mla_forward.diffs(job, "eager", job.refspec[("eager", None)], dict(
        job.refspec[("eager", None)], **{mla_forward.KERNEL: [dict(call, args=dict(
            job.refspec[("eager", None)][mla_forward.KERNEL][0]["args"],
            cache_seqlens=dict(k, tensor=torch.zeros(3, dtype=k["tensor"].dtype))))]}), 3)
        if d.field.startswith("kernel:")]
    assert not e.stale  # eager: the call is the live one, nothing captured


def test_an_exception_raised_in_refspecs_own_adapter_is_a_worded_adapter_gap_with_a_repository_path():
    """An exception no upstream frame raised or ran into (refspec's adapter failing: here a ``KeyError``
    in ``upstream_mla.partial_tail`` on a job without its batch) is described as an adapter gap, its
    file relative to the checkout (never a local absolute path).  Negative control: upstream's own
    AttributeError (0.5.12.post1's missing ``move_kv_cache``) stays upstream's (not a gap)."""
    from refspec.conformance import report, upstream_mla
    from refspec.conformance.upstream_common import REPO, describe

    with pytest.raises(KeyError) as e:
        upstream_mla.partial_tail({"page_size": 4, "eager": {}})
    text = describe(e.value)
    assert text.startswith("AdapterGap at refspec/conformance/upstream_mla.py:"), text
    assert "refspec's adapter raised KeyError" in text and REPO not in text and report.is_gap(text)
    assert not report.is_gap("AttributeError at sglang/srt/speculative/eagle_worker.py:729: no move_kv_cache")


@pytest.mark.spec("TR-015")
def test_a_tail_copy_is_needed_only_where_a_prefix_ends_inside_a_page():
    """``upstream_mla.partial_tail``: never at P = 1 (0.4.x's worker has no tail copy and needs none
    there), at P = 4 only when some L % 4 != 0."""
    from refspec.conformance.upstream_mla import partial_tail

    job = lambda P, L: {"page_size": P, "eager": {"seq_lens_cpu": torch.tensor(L)}}  # noqa: E731
    assert not partial_tail(job(1, [5, 7, 9]))
    assert partial_tail(job(4, [8, 5])) and not partial_tail(job(4, [8, 12]))


# ---- against 0.4.7 / 0.4.7.post1 (markers conformance and releases: make sweep) ----

FA = install.FA
MLA_047 = ("mla_decode", "mla_tree_verify", "mla_tree_draft_decode")


@pytest.fixture(scope="module")
def at_047():
    from refspec.conformance import run

    return run.run(sglang=["0.4.7", "0.4.7.post1"], page_sizes=(1,), modes=MLA_047, log=quiet)


@pytest.mark.conformance
@pytest.mark.releases
@pytest.mark.spec("CG-001", "ML-002", "TR-018", "TR-014")
def test_mla_replay_at_047_reads_the_runners_static_buffers_and_names_each_output_by_its_cause(at_047):
    """0.4.7's decode replay binds ``cache_seqlens_int32 = seq_lens.to(torch.int32)``, an alias of the
    runner's int32 static buffer the replay hook is handed (written in place), so the replayed MLA call
    reads the replay's lengths: no ``kernel:cache_seqlens`` difference, no MD-003 / CG-001.  What fails
    there is 0.4.7's slot-0 store (ML-002) and, for top-k 2 draft decode, its expand table (TR-014
    eager, TR-018 replay, each step cited at its line); the outputs take those rules, never ML-011 at
    P = 1.  0.4.7.post1 runs the same tree draft decode with no adapter gap (no tail page at P = 1)
    and conforms there."""
    rows = [r for r in at_047.rows if r.pin == "0.4.7"]
    assert rows and not any(r.gap or r.error for r in rows), [(r.job, r.gap, r.error) for r in rows if r.gap or r.error]
    found = [(r, f) for r in rows for f in r.findings]
    assert not [f for _, f in found if f.field and f.field.startswith("kernel:")]
    assert {f.rule for _, f in found} == {"ML-002", "TR-014", "TR-018"}
    decode = [r for r in rows if r.mode == "mla_decode" and r.phase == "replay"]
    assert decode and {f.rule for r in decode for f in r.findings} == {"ML-002"}
    tr018 = [(r.step, f.where) for r, f in found if f.rule == "TR-018" and f.field == "expand:page_table[live]"]
    assert sorted(tr018) == [(0, (FA, 1656)), (1, (FA, 1656))]
    outs = [(r, f) for r, f in found if f.field in mla_forward.OUT_FIELDS]
    assert outs and all(f.rule != "ML-011" for _, f in outs)
    table = {"eager": "TR-014", "replay": "TR-018"}
    assert all(f.rule == ("ML-002" if f.field == "mla:out[padded]" else table[r.phase]) for r, f in outs)
    post = [r for r in at_047.rows if r.pin == "0.4.7.post1" and r.mode == "mla_tree_draft_decode"]
    assert len(post) == 6 and not any(r.gap or r.error for r in post)
    assert all(r.ok for r in post if r.phase == "eager") and not any(f.rule == "TR-018" for r in post
                                                                    for f in r.findings)


@pytest.mark.conformance
@pytest.mark.releases
@pytest.mark.spec("CG-001")
def test_a_capture_bound_to_a_private_buffer_that_the_047_replay_rebinds_is_cg_001_on_mha_and_mla():
    """Negative control of the static-buffer model: 0.4.7 with a planted mutant
    (``patches/mutants/decode-capture-private-cache-seqlens.diff``) whose decode capture binds
    ``cache_seqlens_int32`` to a tensor of its own; the replay's ``normal_decode_set_medadata``
    rebinds the field (L2071) instead of writing into it, so the graph's kernel reads the
    capture-time lengths.  Both paths report it at replay only, as CG-001 on
    ``kernel:cache_seqlens``; the MLA finding cites the rebinding line."""
    from refspec.conformance import run

    t = controls.Code("0.4.7", ("decode-capture-private-cache-seqlens",)).target(log=quiet)
    out = run.run(sglang=[t], page_sizes=(1,), modes=("decode", "mla_decode"), log=quiet)
    stale = {(r.mode, r.phase, f.field, f.rule, f.where) for r in out.rows for f in r.findings if f.rule == "CG-001"}
    assert {(m, p) for m, p, *_ in stale} == {("decode", "replay"), ("mla_decode", "replay")}, stale
    assert all(fld == "kernel:cache_seqlens" for _, _, fld, _, _ in stale)
    assert ("mla_decode", "replay", "kernel:cache_seqlens", "CG-001", (FA, 2071)) in stale
    assert not any(f.rule in ("MD-003",) for r in out.rows for f in r.findings)


@pytest.mark.spec("ML-002")
def test_the_live_and_the_padded_rows_of_an_output_are_two_fields():
    """``mla_forward.mla_diffs``: live rows differing (``mla:out``) and a graph's padded rows differing
    (``mla:out[padded]``) are reported apart, so a fix of the live rows' cause (0.4.7.post1's expand
    table) leaves the padded rows' slot-0 difference under its own field, as on the baseline.  Negative
    control: equal outputs give no ``mla:out*`` diff."""
    a = torch.zeros(4, 2, 8)
    b = a.clone()
    assert not [d for d in mla_forward.mla_diffs({"out": a}, {"out": b}, 3)]
    b[1] += 1
    b[3] += 2
    ds = mla_forward.mla_diffs({"out": a}, {"out": b}, 3)
    assert [(d.field, d.padded) for d in ds] == [("mla:out", False), ("mla:out[padded]", True)]
    assert ds[0].ours.startswith("rows 1 of 4") and ds[1].ours.startswith("rows 3 of 4")
