"""Rows grown over several speculative rounds, attended by both wings, and the independent oracle.

:class:`refspec.harness.grown.GrownScenario` replays a server-like history (N verify slots per
round, rejections, v1 ``free_tail`` or v2 over-allocation, a request finishing and its pages
handed out again, shuffled pages) and then runs one forward of every mode, at P in {1, 4, 16}.

The second half shows why the paged oracle reads only the batch's inputs: a variant in the
*shared core* (the batch builders, the allocator) changes the batch both wings read.  With
validation off, the paged oracle must still refuse it with its own named check or disagree
with the FA3 path; before issue 13 it agreed with FA3 exactly.
"""

from __future__ import annotations

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode as M
from refspec.core.tolerance import assert_t1, t1
from refspec.harness.grown import MODES, GrownScenario
from refspec.mutants import variants
from refspec.oracle.backend import oracle_metadata


def _label(mode, step):
    return "draft_decode" if step is not None else mode.name.lower()


CASES = [pytest.param(mode, step, P, v, id=f"{_label(mode, step)}-P{P}-{v}")
         for mode, step in MODES for P in (1, 4, 16) for v in ("v1", "v2")]


@pytest.mark.spec("PA-001", "PA-002", "PA-004", "KV-004", "KV-005", "TOL-002")
@pytest.mark.parametrize("mode,step,P,version", CASES)
def test_grown_rows_oracle_equals_fa3_eager_and_graphed(mode, step, P, version):
    sc = GrownScenario(mode, P, version=version, draft_step=step, seed=P)
    b = sc.build()
    assert sc.reused, "no page was handed out twice: the history tests nothing"
    for r, K in zip(b.fb.req_pool_indices.tolist(), b.K):
        b.kv.check_page_contiguous(r, K)  # INV-PAGE survives the history (PA-001)
    ref = b.run_oracle()
    assert bool(torch.isfinite(ref).all())
    assert_t1(b.run_fa3(provider="emulator"), ref, None, f"{sc} eager")
    if mode != M.EXTEND:  # EXTEND is not graphed
        assert_t1(sc.build().run_fa3_graph(provider="emulator"), ref, None, f"{sc} graph")


@pytest.mark.spec("MD-003")
@pytest.mark.parametrize("mode,step,P,version", CASES[::5])
def test_oracle_lengths_from_positions_equal_the_fa3_formula(mode, step, P, version):
    """K_b = last position + 1 (the oracle's reading) equals the FA3 wing's ``cache_seqlens``
    (``seq_lens + delta``) on grown rows; the two are derived independently."""
    b = GrownScenario(mode, P, version=version, draft_step=step).build()
    tw = oracle_metadata(b.fb, b.kv.req_to_token)
    b.run_fa3()
    assert tw.cache_seqlens == b.extra["metadata"].cache_seqlens_int32.tolist() == b.K


@pytest.mark.spec("PA-004", "MD-003")
@pytest.mark.parametrize("mode,step,P,version", CASES[1::7])
def test_the_paged_oracle_reads_no_builder_derived_field(mode, step, P, version, monkeypatch):
    """``seq_lens`` (the FA3 wing's K formula input) set to nonsense and ``q_lens_cpu`` removed:
    the paged oracle's output is bitwise unchanged, so it cannot inherit a wrong formula."""
    b = GrownScenario(mode, P, version=version, draft_step=step).build()
    ref = b.run_oracle()
    b.fb = b.fb.replace(seq_lens=b.fb.seq_lens * 0 + 999, seq_lens_cpu=b.fb.seq_lens_cpu * 0 + 999)

    def gone(self):
        raise AssertionError("the oracle called ForwardBatch.q_lens_cpu")
    monkeypatch.setattr(type(b.fb), "q_lens_cpu", gone)
    assert torch.equal(b.run_oracle(), ref)


# ---- shared-core variants: the comparison (or the oracle's own check) catches them ----------

SHARED_CORE = {  # variant -> the grown scenarios that run it (mode, draft step, P, version)
    "positions-one-early": [(M.TARGET_VERIFY, None, 4, "v1"), (M.DECODE, None, 16, "v2"),
                            (M.DRAFT_EXTEND, None, 1, "v1"), (M.DECODE, 1, 4, "v2")],
    "draft-loc-step-major": [(M.DECODE, 1, 4, "v2"), (M.DECODE, 0, 1, "v1")],
    "free-last-committed-page": [(M.TARGET_VERIFY, None, 4, "v1"), (M.DRAFT_EXTEND, None, 16, "v1")],
}


def both_wings(mode, step, P, version):
    """Build with the current variants on, run the paged oracle and FA3 (validation off) on the
    same batch: ``("refused", id)`` or ``("compared", within T1?)``."""
    try:
        b = GrownScenario(mode, P, version=version, draft_step=step).build()
        ref = b.run_oracle()
    except InvariantError as e:
        return "refused", e.inv_id
    out = b.run_fa3(provider="emulator", validate=False)
    return "compared", t1(out, ref).ok


@pytest.mark.spec("MD-005", "MD-012", "KV-003", "TOL-002")
@pytest.mark.parametrize("name,case", [(n, c) for n, cs in SHARED_CORE.items() for c in cs],
                         ids=lambda x: x if isinstance(x, str) else f"{_label(x[0], x[1])}-P{x[2]}-{x[3]}")
def test_shared_core_variant_is_seen_by_the_paged_oracle(name, case):
    assert both_wings(*case) == ("compared", True), "the scenario fails without the variant"
    with variants.enabled(name):
        seen = both_wings(*case)
    assert seen in {("refused", "MD-005"), ("refused", "MD-012"), ("refused", "KV-003"), ("compared", False)}, seen
    if name == "positions-one-early":  # consistent with req_to_token: only the comparison can see it
        assert seen == ("compared", False)
    if name == "draft-loc-step-major":  # out_cache_loc of another request: the oracle's INV-TAIL
        assert seen == ("refused", "MD-005")


@pytest.mark.spec("MD-005", "SD-002")
def test_engine_with_paged_oracle_attention_refuses_the_step_major_draft_layout():
    """The audit's probe, at the level of the whole loop: with ``draft-loc-step-major`` on and
    validation off, the production loop with paged-oracle attention used to agree with the FA3
    loop exactly (both attended the same wrong slots).  Now its own INV-TAIL check stops it."""
    from refspec.model.llama import LlamaModel, init_random_, tiny_config
    from refspec.speculative.api import generate
    model = init_random_(LlamaModel(tiny_config()), seed=0).eval()
    kw = {"version": "v1", "page_size": 2, "num_steps": 3, "max_new_tokens": [8, 6], "draft": "early-exit:2",
          "validate": False}
    prompts = [[1, 5, 9, 3, 7], [2, 4, 6, 8, 10, 12]]
    clean = generate(model, prompts, backend="paged-oracle", **kw)
    assert clean.tokens == generate(model, prompts, backend="fa3", **kw).tokens
    with variants.enabled("draft-loc-step-major"), pytest.raises(InvariantError) as e:
        generate(model, prompts, backend="paged-oracle", **kw)
    assert e.value.inv_id == "MD-005" and "out_cache_loc" in str(e.value)
