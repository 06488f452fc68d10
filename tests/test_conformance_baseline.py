"""``python -m refspec conformance --baseline SPEC --sglang SPEC``: a PR-scoped review, end to end
in-process on two tiny fake source trees whose upstream results are canned (no upstream run).

The baseline tree has no staged draft-extend replay, the PR tree has one (``stage_draft_extend_metadata``),
so the PR's grid has a ``replay-staged`` phase the baseline's lacks.  A planted new failure is
reported as new and exits 1; a difference on both is pre-existing and does not fail; a fix is
reported as fixed; the staged phase shows as new (same, or DIFFERS and exit 1); a known upstream
bug new in the PR is marked as such and does not fail; ``--baseline`` without exactly one
``--sglang`` SPEC is a one-line exit 2.  The expected rule IDs are written out here.
"""

from __future__ import annotations

import pytest
import torch

from refspec.cli.conformance import main
from refspec.conformance import install
from refspec.conformance import run as conformance
from refspec.conformance.cases import Job
from test_conformance_specs import GRAPH_FA, cli, fake_tree

i32 = lambda *rows: torch.tensor(rows, dtype=torch.int32)
# refspec's side of every result: two rows, K = 65 and 24 at P = 16 (5 and 2 live pages)
OURS = {"cache_seqlens_int32": torch.tensor([65, 24], dtype=torch.int32), "cu_seqlens_q": torch.tensor([0, 4, 8]),
        "cu_seqlens_k": torch.tensor([0, 65, 89]), "max_seq_len_q": 4, "max_seq_len_k": 0,
        "page_table": i32([1, 2, 3, 4, 5, 0], [6, 7, 0, 0, 0, 0])}
VERIFY = "verify/P16/B3/bs4"
DE = "draft_extend_v2/P16/B3/bs4"
BASE_FA = GRAPH_FA.replace("    def stage_draft_extend_metadata(self, forward_batch):\n        pass\n", "")


def jobs_of(target, page_sizes, modes, topks, variant=None, edges=None):
    """The selection of both trees: a verify job (replay) and a draft-extend-v2 job (replay, and
    replay-staged where the tree stages it, as the real job builder does)."""
    de = {("replay", None): OURS}
    if target.shape.staged:
        de[("replay-staged", None)] = OURS
    jobs = [Job(VERIFY, "verify", 16, "B3/bs4", True, {}, {("replay", None): OURS}),
            Job(DE, "draft_extend_v2", 16, "B3/bs4", True, {}, de)]
    return [j for j in jobs if j.mode in modes]


@pytest.fixture
def trees(tmp_path, monkeypatch):
    """(baseline tree, PR tree, planted): ``planted[(tree, job, phase)]`` overrides upstream's
    canned result (else identical to refspec's)."""
    monkeypatch.setattr(install, "_deps", lambda root, log: str(tmp_path / "deps"))
    base = fake_tree(tmp_path / "base", BASE_FA)
    pr = fake_tree(tmp_path / "pr", GRAPH_FA)
    planted: dict = {}
    monkeypatch.setattr(conformance, "_jobs", jobs_of)

    def worker(target, jobs):
        tree = "base" if target.site == str(base / "python") else "pr"
        planted.setdefault("ran", []).append(tree)
        return {j.id: {k: planted.get((tree, j.id, k[0]), OURS) for k in j.refspec} for j in jobs}, {"import_s": 0.0}

    monkeypatch.setattr(conformance, "run_worker", worker)
    return base, pr, planted


def review(trees, tmp_path, capsys, *more, swap=False):
    base, pr, _ = trees
    out = tmp_path / "review.md"
    if swap:
        base, pr = pr, base
    rc = main(["--baseline", str(base), "--sglang", str(pr), "--page-sizes", "16", "--report", str(out),
               "--root", str(tmp_path / "root"), *more])
    return rc, capsys.readouterr().out, out.read_text()


def changed(text: str) -> list[str]:
    """The changes table's rows (status first)."""
    return [x for x in text.splitlines() if x.startswith(("new", "fixed", "only on", "partly"))]


def test_the_staged_phase_only_the_pr_has_is_new_and_same_and_the_run_passes(trees, tmp_path, capsys):
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 0, text
    base, pr, _ = trees
    assert f"== changes: sglang @ {pr} against the baseline sglang @ {base}: 0 new failures, 0 fixed, 1 new result " \
           f"(1 same, 0 DIFFERS), 0 pre-existing, 2 unchanged" in text
    (row,) = changed(text)
    assert row.split() == ["new,", "same", "draft_extend_v2", "16", "replay-staged", "1", "same"]
    assert "  unchanged: 2 results" in text and "== OK: no new failure against the baseline" in text
    # each side says how many results compared the kernel's real arguments (none here: canned results)
    for side, tree, n in (("baseline", base, 2), ("under test", pr, 3)):
        assert (f"== {side}: kernel arguments: sglang @ {tree}: 0 of {n} results compared the 0 "
                f"flash_attn_with_kvcache calls") in text, text
    assert text.count("no kernel call was recorded, so PA-013 is not checked here") == 2, text
    assert md.startswith("### refspec conformance: what this PR changes\n")
    assert "| new, same | draft_extend_v2 | 16 | replay-staged | 1 | same |" in md


def test_a_planted_new_failure_is_new_and_exits_1(trees, tmp_path, capsys):
    _, _, planted = trees
    planted[("pr", VERIFY, "replay")] = dict(OURS, cache_seqlens_int32=torch.tensor([66, 24], dtype=torch.int32))
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 1, text
    assert "1 new failure [MD-011]" in text and "== FAIL: 1 new failure against the baseline" in text
    row, staged = changed(text)  # the staged phase is new in the PR in every test
    assert staged.split()[:2] == ["new,", "same"]
    assert row.split()[:7] == ["new", "failure", "verify", "16", "replay", "1", "DIFFERS:"]
    assert row.endswith("cache_seqlens_int32 [MD-011]")
    # the upstream line is read from the code under test: canned results carry no executed lines, so it is
    # read statically (and said so): no write of the field there, the replay hook's def line
    _, pr, _ = trees
    fa = pr / "python" / install.FA
    line = next(i for i, x in enumerate(fa.read_text().splitlines(), 1) if "def init_forward_metadata_out_graph" in x)
    findings = [x for x in text.splitlines() if x.startswith("  DIFFERS ")]
    assert findings == [f"  DIFFERS {VERIFY} replay: MD-011 (upstream behaviour) cache_seqlens_int32: refspec "
                        f"[65, 24] | upstream [66, 24] (upstream {install.FA}:{line}, not traced, read statically)"]
    # the report: what this PR changes first, with the rule ID and the per-finding line
    head = md.split("<details>")[0]
    assert "**MD-011**" in head and f"verify P = 16 replay (`{VERIFY}`): `cache_seqlens_int32`: refspec `[65, 24]`, " \
                                    f"upstream `[66, 24]`; upstream line `{fa}:{line}` (not traced, read " \
                                    "statically)" in head
    assert "| new failure | verify | 16 | replay | 1 | DIFFERS: cache_seqlens_int32 [MD-011] |" in head


def test_a_difference_on_both_is_pre_existing_and_does_not_fail(trees, tmp_path, capsys):
    _, _, planted = trees
    wrong = dict(OURS, max_seq_len_q=5)
    planted[("base", VERIFY, "replay")] = planted[("pr", VERIFY, "replay")] = wrong
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 0, text
    assert "0 new failures, 0 fixed" in text and "1 pre-existing, 1 unchanged" in text
    assert "  pre-existing: 1 result fails on the baseline too [CG-006]; they do not fail this run" in text
    assert not [x for x in text.splitlines() if x.startswith("  DIFFERS ")]  # not listed as a finding of the PR
    assert "Pre-existing: 1 result fails on the baseline too [CG-006]; they do not fail this run (not this change)." \
           in md.split("<details>")[0]
    # both sides' full comparison still shows it, in the collapsed block
    full = md.split("<details><summary>Both full comparisons")[1]
    assert full.count("- **CG-006** (upstream behaviour), verify P = 16 replay") == 2


def test_failing_on_both_by_one_more_rule_is_a_new_failure(trees, tmp_path, capsys):
    _, _, planted = trees
    planted[("base", VERIFY, "replay")] = dict(OURS, max_seq_len_q=5)
    planted[("pr", VERIFY, "replay")] = dict(OURS, max_seq_len_q=5,
                                             cache_seqlens_int32=torch.tensor([66, 24], dtype=torch.int32))
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 1 and "1 new failure [MD-011] (1 of them newly broken on a failing row)" in text
    assert "0 pre-existing" in text
    (row,) = [x for x in changed(text) if x.startswith("newly broken")]
    assert "now also MD-011 (cache_seqlens_int32); DIFFERS: cache_seqlens_int32,max_seq_len_q [MD-011,CG-006]" in row
    assert "| newly broken on a failing row | verify | 16 | replay | 1 | now also MD-011" in md


def test_failing_on_both_by_one_rule_fewer_is_partly_fixed_and_passes(trees, tmp_path, capsys):
    """The reverse of the test above: the (rule, field) set shrank, none added: not pre-existing, not a failure."""
    _, _, planted = trees
    planted[("base", VERIFY, "replay")] = dict(OURS, max_seq_len_q=5,
                                               cache_seqlens_int32=torch.tensor([66, 24], dtype=torch.int32))
    planted[("pr", VERIFY, "replay")] = dict(OURS, max_seq_len_q=5)
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 0, text
    assert "0 new failures, 0 fixed, 1 partly fixed [no longer MD-011 (cache_seqlens_int32)]" in text
    assert "0 pre-existing" in text
    assert "| partly fixed | verify | replay | no longer MD-011 (cache_seqlens_int32); still CG-006 |" in md


def test_a_fix_is_reported_as_fixed(trees, tmp_path, capsys):
    _, _, planted = trees
    planted[("base", VERIFY, "replay")] = dict(OURS, max_seq_len_q=5)
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 0, text
    assert "0 new failures, 1 fixed" in text
    rows = changed(text)
    assert len(rows) == 2 and rows[0].split()[:5] == ["fixed", "verify", "16", "replay", "1"]
    assert rows[0].endswith("baseline: DIFFERS: max_seq_len_q [CG-006]")
    assert "| fixed | verify | 16 | replay | 1 | baseline: DIFFERS: max_seq_len_q [CG-006] |" in md


def test_a_failure_in_the_phase_only_the_pr_has_is_new_differs_and_exits_1(trees, tmp_path, capsys):
    _, _, planted = trees
    planted[("pr", DE, "replay-staged")] = dict(OURS, cache_seqlens_int32=torch.tensor([61, 20], dtype=torch.int32))
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 1, text
    assert "1 new failure [MD-008]" in text and "(0 same, 1 DIFFERS)" in text
    (row,) = changed(text)
    assert row.split()[:7] == ["new,", "DIFFERS", "draft_extend_v2", "16", "replay-staged", "1", "DIFFERS:"]
    assert "| new, DIFFERS | draft_extend_v2 | 16 | replay-staged | 1 | DIFFERS: cache_seqlens_int32 [MD-008] |" in md
    assert "- **MD-008** (upstream behaviour), draft_extend_v2 P = 16 replay-staged" in md


def test_a_known_upstream_bug_new_in_the_pr_is_a_new_failure_named_as_known(trees, tmp_path, capsys):
    """A change that makes a result hit a known upstream bug breaks that bug's rule there: a new
    failure (exit 1, issue 39 item 6), named as the known bug with its PR, not as this change's own
    defect ("this code violates" is not said); only what fails on the baseline too is set apart."""
    _, _, planted = trees
    planted[("pr", VERIFY, "replay")] = dict(OURS, page_table=i32([1, 2, 3, 4], [6, 7, 0, 0]))  # 4 columns < 5 pages
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 1, text
    assert "1 new failure [CG-008, known upstream bug context-wall-page-table (sglang#35985)] (1 of them on known " \
           "upstream bugs), 0 fixed" in text
    assert "== FAIL: 1 new failure against the baseline" in text and "context-wall-page-table (sglang#35985): " \
                                                                       "breaks CG-008" in text
    top = md.split("<details>")[0]  # what a reviewer pastes: the rule, named as the known bug
    assert "[known upstream bug `context-wall-page-table`" in top
    assert "New failures, each on a known upstream bug" in top and "this code violates" not in top
    planted[("base", VERIFY, "replay")] = planted[("pr", VERIFY, "replay")]  # on the baseline too: set apart
    rc, text, _ = review(trees, tmp_path, capsys)
    assert rc == 0 and "0 new failures, 0 fixed" in text and "1 pre-existing" in text


def test_a_new_failure_beside_a_known_bug_keeps_the_verdict(trees, tmp_path, capsys):
    """Negative control for the test above: one result off any known bug, and the verdict is back."""
    _, _, planted = trees
    planted[("pr", VERIFY, "replay")] = dict(OURS, cache_seqlens_int32=torch.tensor([66, 24], dtype=torch.int32))
    rc, text, md = review(trees, tmp_path, capsys)
    top = md.split("<details>")[0]
    assert rc == 1 and "New failures:" in top and "> this code violates" in top


def test_a_phase_the_code_under_test_drops_is_counted_as_only_on_the_baseline(trees, tmp_path, capsys):
    rc, text, _ = review(trees, tmp_path, capsys, swap=True)  # the staged tree is the baseline now
    assert rc == 0, text
    assert "0 new results (0 same, 0 DIFFERS), 0 pre-existing, 2 unchanged, 1 only on the baseline" in text
    (row,) = changed(text)
    assert row.split() == ["only", "on", "the", "baseline", "draft_extend_v2", "16", "replay-staged", "1",
                           "baseline:", "same"]


def test_a_mode_the_baseline_lacks_is_new_and_runs_no_baseline_worker(trees, tmp_path, capsys, monkeypatch):
    base, pr, planted = trees
    fake_tree(base, BASE_FA, modes="")  # the baseline's ForwardMode has no DRAFT_EXTEND_V2
    rc, text, _ = review(trees, tmp_path, capsys, "--modes", "draft_extend_v2")
    assert rc == 0, text
    assert planted["ran"] == ["pr"]
    assert f"== baseline: sglang @ {base}: 0 cases" in text and "2 new results (2 same, 0 DIFFERS)" in text


def test_verbose_prints_both_full_comparisons_first(trees, tmp_path, capsys):
    _, _, planted = trees
    planted[("base", VERIFY, "replay")] = planted[("pr", VERIFY, "replay")] = dict(
        OURS, max_seq_len_q=5)
    rc, text, _ = review(trees, tmp_path, capsys, "-v")
    lines = text.splitlines()
    assert rc == 0 and lines[0] == "==== baseline" and "==== under test" in lines
    # each side's own table, then the changes table with the pre-existing group shown too
    assert sum(x.startswith(f"  DIFFERS {VERIFY} replay: CG-006") for x in lines) == 2
    assert any(x.split()[:5] == ["pre-existing", "verify", "16", "replay", "1"] for x in lines)


@pytest.mark.parametrize("args, words", [
    (["--baseline", "0.5.23"], "needs exactly one --sglang SPEC, the code under test (got none)"),
    (["--baseline", "0.5.23", "--sglang", "0.5.23,0.5.12.post1"],
     "needs exactly one --sglang SPEC, the code under test (got 2: 0.5.23,0.5.12.post1)"),
    (["--baseline", "0.5.12.post1,0.5.23", "--sglang", "0.5.23"], "names 2 SPECs; the baseline is one SPEC"),
    (["--baseline", "0.5.12.post1", "--sglang", "0.5.23", "--sweep"], "not with --sweep"),
])
def test_baseline_without_exactly_one_sglang_spec_is_a_one_line_exit_2(tmp_path, args, words):
    p = cli(*args, "--root", str(tmp_path / "root"))
    (line,) = p.stderr.strip().splitlines()
    assert p.returncode == 2 and p.stdout == "" and "--baseline" in line and words in line
    assert not (tmp_path / "root").exists()  # refused before anything was installed or run
