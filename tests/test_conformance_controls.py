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
    """The whole default grid, every case's req_to_token rows SGLang's headroom wide.  0.5.23: only
    the context wall (context 64, P = 16, 4 graph columns) fails, where K > 64 needs 5 pages --
    verify K = L + N (B3: L = 61 -> 65; B5: L = 64 -> 68), draft decode K = L + s + 1 (B5 only:
    L = 64 -> 65, 66 at steps 0 and 1), draft extend v2 K = L + N (both shapes, replay and staged
    replay), and its eager ``/no-cpu-mirrors`` rows (no ``seq_lens_cpu``: the eager table is
    ``req_to_token[:, :max_context_len]``): 2 + 2 + 2 + 2 + 2 = 10 rows; decode (K = L <= 64) and
    every capture (a one-page dummy batch) stay at or above the bound.  With #35985's change (5
    columns) every row passes."""
    res = results["context-wall-page-table"]
    assert not res.problems(), controls.render([res])
    failing = _rows(res, res.buggy)
    assert len(failing) == 10 and all(r.job.endswith(("/wall", "/wall/no-cpu-mirrors")) for r in failing)
    assert sorted(r.job for r in failing if r.phase == "eager") == ["draft_extend_v2/P16/B3/bs4/wall/no-cpu-mirrors",
                                                                  "draft_extend_v2/P16/B5/bs8/wall/no-cpu-mirrors"]
    assert {(r.job.split("/")[2], r.mode, r.step) for r in failing} == {
        ("B3", "verify", None), ("B5", "verify", None), ("B5", "draft_decode", 0), ("B5", "draft_decode", 1),
        ("B3", "draft_extend_v2", None), ("B5", "draft_extend_v2", None)}
    live = [d for r in failing for d in r.undocumented if d.field == "page_table[live]"]
    assert len(live) == 10 and all(d.short_table for d in live)
    assert all(d.ours.count(",") == 4 and d.theirs.count(",") == 3 and "(4 columns <" in d.theirs
               for d in live)  # refspec's 5 live pages, upstream's 4
    assert all(r.bug == "context-wall-page-table" and {f.rule for f in r.findings} == {"CG-008"} for r in failing)
    assert res.control.bug.rule == "CG-008" and res.control.bug.also == ("PA-003",)
    # the wall's captures differ only in width, at or above the bound: documented, not the bug
    caps = [r for r in res.buggy if r.job.endswith("/wall") and r.phase == "capture"]
    assert caps and all(r.ok and "graph-table-headroom" in {d.documented for d in r.diffs} for r in caps)
    # the #35985 change over the whole grid: no failing row, no upstream exception
    assert len(res.fixed) == len(res.buggy) and not [r for r in res.fixed if not r.ok or r.error]


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
    assert {c.key for c in controls.CONTROLS + controls.MLA_CONTROLS} == {b.key for b in known.BUGS}
    for name in patches.names():
        h = patches.load(name).header
        assert h["PR"].startswith("https://github.com/sgl-project/sglang/pull/"), name
        assert h["Base"] and h["Provenance"] and h["Expect"], name
        assert patches.load(name).files == ["sglang/srt/layers/attention/flashattention_backend.py"]
