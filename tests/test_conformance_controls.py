"""Known upstream bugs as negative controls against real upstream code (marker ``conformance``).

Each control (:data:`refspec.conformance.controls.CONTROLS`) runs the same jobs on the upstream
code that has the bug and on the code that fixed it -- releases from the index, or a release with
a stored PR diff applied (``refspec/conformance/patches/``) -- with refspec's production side
unchanged.  It must FAIL on the first, in the listed (mode, phase) pairs only, every failing row
naming the rule, and PASS on the second.  ``make conformance`` runs this file.
"""

from __future__ import annotations

import pytest

from refspec.conformance import controls, known, patches

pytestmark = pytest.mark.conformance


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def results() -> dict:
    return {r.control.key: r for r in controls.run_controls(log=quiet)}


def _rows(res, pin_rows):
    return [r for r in pin_rows if not r.ok]


@pytest.mark.spec("CG-008", "PA-003")
def test_context_wall_drops_a_live_page_on_0523_and_not_with_the_35985_change(results):
    """context 64, P = 16, req_to_token 64 + 4 + N wide, L = [61, 20, 30]: verify and draft extend
    reach K = 65 (5 pages).  0.5.23's graph table has 4 columns; with #35985's change it has 5."""
    res = results["context-wall-page-table"]
    assert not res.problems(), controls.render([res])
    live = [d for r in _rows(res, res.buggy) if r.phase != "capture" for d in r.undocumented]
    assert live and {d.field for d in live} == {"page_table[live]"}
    assert all(d.ours.count(",") == 4 and d.theirs.count(",") == 3 for d in live)  # 5 pages vs upstream's 4
    assert {d.field for r in _rows(res, res.buggy) if r.phase == "capture" for d in r.undocumented} == \
        {"page_table[dead]"}  # the capture-time table is narrower: the same defect, before any live page
    assert all(r.bug == "context-wall-page-table" for r in _rows(res, res.buggy))
    assert res.control.bug.rule == "CG-008" and res.control.bug.also == ("PA-003",)


@pytest.mark.spec("TR-018")
def test_unsliced_draft_expand_scatter_raises_on_0512_at_six_steps_and_0523_conforms(results):
    """top-k 2, P = 2, num_steps 6: 0.5.12.post1's replay scatters all six steps' pages into the
    decode_length + 1 wide expand table and raises; 0.5.23 (the #27360 slice) conforms."""
    res = results["draft-expand-unsliced-scatter"]
    assert not res.problems(), controls.render([res])
    failing = _rows(res, res.buggy)
    assert failing and all(r.error and "out of bounds" in r.error for r in failing)
    assert all("flashattention_backend.py" in r.error for r in failing)  # the line is read from upstream's code
    assert {r.step for r in failing} == {0, 1, 2, 3, 4}
    assert not [r for r in res.buggy if r.phase != "replay" and not r.ok]  # eager and capture conform


@pytest.mark.spec("MD-008")
def test_26512_double_count_fails_on_cache_seqlens_against_the_patched_release(results):
    """0.5.23 with #26512's change applied: DRAFT_EXTEND_V2 cache_seqlens = seq_lens + N (seq_lens
    already counts the N draft tokens): [L + 2N] where refspec and 0.5.23 have [L + N]."""
    res = results["draft-extend-v2-double-count"]
    assert not res.problems(), controls.render([res])
    failing = _rows(res, res.buggy)
    assert all("cache_seqlens_int32" in {d.field for d in r.undocumented} for r in failing)
    for r in failing:
        d = next(d for d in r.undocumented if d.field == "cache_seqlens_int32")
        ours, theirs = eval(d.ours), eval(d.theirs)  # noqa: S307 -- printed int lists
        assert [t - o for o, t in zip(ours, theirs)] == [4] * len(ours)  # + N = 4 once more


def test_every_known_bug_has_a_control_and_every_patch_names_its_pr():
    assert {c.key for c in controls.CONTROLS} == {b.key for b in known.BUGS}
    for name in patches.names():
        h = patches.load(name).header
        assert h["PR"].startswith("https://github.com/sgl-project/sglang/pull/"), name
        assert h["Base"] and h["Provenance"] and h["Expect"], name
        assert patches.load(name).files == ["sglang/srt/layers/attention/flashattention_backend.py"]
