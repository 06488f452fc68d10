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
