"""The release history (``make sweep`` -> ``docs/versions.md``, issue 39 item 5): each cell one of holds /
differs / not reachable upstream / adapter gap, and a precision check against the releases whose answer
is known (the pairs of issue 39 and the known-bug registry).

The check's logic runs here on synthetic sweep entries (CI); the check of the real sweep's results
(``.conformance/sweep/sweep.json``, written by ``make sweep``) is marked ``releases`` and runs in
``make sweep`` after it.
"""

from __future__ import annotations

import json
import os

import pytest

from refspec.conformance import install, sweep


def c(compared=(), differs=None, unreachable=(), gap=()):
    return {"compared": list(compared), "differs": differs or {}, "unreachable": list(unreachable), "gap": list(gap)}


def test_a_cell_says_holds_differs_not_reachable_or_adapter_gap_with_the_page_sizes():
    assert sweep.cell(c([1, 4])) == "holds"
    assert sweep.cell(c([1], unreachable=[2, 4])) == "holds; not reachable upstream at P = 2, 4"
    assert sweep.cell(c([1, 4], {"expand:page_table[live]": [1]})) == "differs on expand:page_table[live] (P = 1)"
    assert sweep.cell(c(unreachable=[4])) == "not reachable upstream"
    assert sweep.cell(c(gap=[1, 4])) == "adapter gap"
    assert sweep.cell(c([4], gap=[1])) == "holds; adapter gap at P = 1"
    assert sweep.cell(None) == "n/a"


def _known_good() -> list[dict]:
    tree_guarded = {r: c([1], unreachable=[2, 4, 16]) for r in sweep.TREE_RULES}
    return [
        {"version": "0.4.7", "rules": {**tree_guarded,
                                       "TR-014": c([1], {"expand:page_table[live]": [1]}, unreachable=[2, 4])}},
        {"version": "0.4.7.post1", "rules": dict(tree_guarded)},
        {"version": "0.4.10", "rules": {"TR-013": c([1, 4], {"prefix:cache_seqlens_int32": [4]}),
                                        "TR-014": c([1, 4]), "TR-018": c([1, 4])}},
        {"version": "0.5.3", "rules": dict(tree_guarded)},
        {"version": "0.5.4.post2", "rules": {"CG-004": c([1, 4], unreachable=[1, 4])}},
        {"version": "0.5.10.post1", "rules": {"CG-003": c([1, 4])}},
        {"version": "0.5.11", "rules": {"CG-003": c([1, 4])}},
        {"version": "0.5.12.post1", "rules": {"CG-008": c([1, 4, 16], {"page_table[live]": [16]}),
                                              "TR-018": c([1, 2, 4], {"upstream error": [2]}),
                                              # the MLA forward path's known bugs (mla_forward, known.BUGS)
                                              "ML-011": c([1, 4, 16], {"kernel:expand.k_cache": [4, 16]}),
                                              "ML-012": c([1, 4, 16], {"upstream error": [4, 16]}),
                                              "ML-002": c([1, 4, 16], {"mla:slot0": [1, 4, 16]})}},
        {"version": "0.5.23", "rules": {"CG-008": c([1, 4, 16], {"page_table[live]": [16]}),
                                        "ML-011": c([1, 4, 16], {"kernel:expand.k_cache": [4, 16]})}},
    ]


@pytest.mark.spec("TR-013", "TR-014", "CG-003", "CG-008", "TR-018")
def test_the_precision_check_passes_the_known_answers_and_catches_each_wrong_one():
    """Known answers (issue 39): guarded releases are not reachable at P > 1 for the tree rules, the real
    pre-#7725 defect still shows, 0.4.7's bs >= 2 defect shows at P = 1 and 0.4.7.post1 has none, the
    renamed accept-length fields hold, 0.5.4.post2 has no CG-004 difference, every known bug shows at its
    release.  Each planted wrong cell is named (a negative control per answer)."""
    good = _known_good()
    assert sweep.precision(good) == []
    planted = {
        ("0.5.3", "TR-014"): (c([1, 4], {"expand:page_table[live]": [4]}), "0.5.3 TR-014: differs at P = 4"),
        ("0.4.10", "TR-013"): (c([1, 4]), "0.4.10: the pre-#7725 tree defect"),
        ("0.4.7", "TR-014"): (c([1], unreachable=[2, 4]), "0.4.7 TR-014: the bs >= 2 draft expand defect"),
        ("0.4.7.post1", "TR-018"): (c([1], {"expand:page_table[live]": [1]}, unreachable=[2, 4]),
                                    "0.4.7.post1 TR-018: differs"),
        ("0.5.11", "CG-003"): (c([1, 4], {"upstream error": [1, 4]}), "0.5.11 CG-003"),
        ("0.5.4.post2", "CG-004"): (c([1, 4], {"cu_seqlens_q": [4]}), "0.5.4.post2 CG-004"),
        ("0.5.23", "CG-008"): (c([1, 4, 16]), "0.5.23 CG-008: the known upstream bug context-wall-page-table"),
        ("0.5.12.post1", "TR-018"): (c([1, 2, 4]), "0.5.12.post1 TR-018: the known upstream bug "
                                                   "draft-expand-unsliced-scatter"),
    }
    for (v, rid), (wrong, said) in planted.items():
        entries = json.loads(json.dumps(good))
        next(e for e in entries if e["version"] == v)["rules"][rid] = wrong
        problems = sweep.precision(entries)
        assert any(p.startswith(said) for p in problems), (v, rid, problems)


@pytest.mark.conformance
@pytest.mark.releases
def test_the_sweeps_results_pass_the_precision_check():
    """The real sweep (``make sweep`` writes ``.conformance/sweep/sweep.json`` first): every known answer
    holds in the measured table of docs/versions.md."""
    path = os.path.join(install.default_root(), "sweep", sweep.RESULTS)
    assert os.path.exists(path), f"no sweep results at {path}: run `make sweep`"
    with open(path) as f:
        entries = [e for e in json.load(f) if e.get("fingerprint") == sweep.fingerprint()]
    assert {"0.4.7", "0.4.7.post1", "0.5.4.post2", "0.5.11", "0.5.23"} <= {e["version"] for e in entries}, \
        "the sweep results are of other code: run `make sweep` again"
    assert sweep.precision(entries) == []
