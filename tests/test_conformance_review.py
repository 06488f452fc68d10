"""The review workflow ``python -m refspec conformance --sglang <a PR's tree> --report FILE.md``, end
to end in-process, on a tiny fake source tree whose upstream results are canned (no upstream run):
a known upstream bug recognised on a tree by its signature is a broken rule (exit 1), marked with
its PR in the console and in the report; stated with ``--expect-bugs`` it is expected (exit 0), and
any other failure fails the run either way; the label says "sglang" once, a passing run names what
it did not check, and a bad ``--report`` path stops the run before anything runs.
"""

from __future__ import annotations

import pytest
import torch

from refspec.cli.conformance import main
from refspec.conformance import install
from refspec.conformance import run as conformance
from refspec.conformance.cases import Job
from test_conformance_specs import GRAPH_FA, cli, fake_tree

WALL = "known upstream bug context-wall-page-table (sglang#35985)"
PR = "https://github.com/sgl-project/sglang/pull/35985"
i32 = lambda *rows: torch.tensor(rows, dtype=torch.int32)
# verify at the context wall, P = 16: row 0 verifies K = 65 keys = 5 pages; refspec's table has the headroom (6)
OURS = {"cache_seqlens_int32": torch.tensor([65, 24], dtype=torch.int32), "cu_seqlens_q": torch.tensor([0, 4, 8]),
        "cu_seqlens_k": torch.tensor([0, 65, 89]), "max_seq_len_q": 4, "max_seq_len_k": 0,
        "page_table": i32([1, 2, 3, 4, 5, 0], [6, 7, 0, 0, 0, 0])}
JOB = Job("verify/P16/B3/bs4/wall", "verify", 16, "B3/bs4", True, {}, {("replay", None): OURS})


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A fake graph-hooks checkout; the selection is :data:`JOB`, the worker is replaced by canned
    results (set ``tree.theirs``)."""
    monkeypatch.setattr(install, "_deps", lambda root, log: str(tmp_path / "deps"))
    co = fake_tree(tmp_path / "co", GRAPH_FA)
    state = {"theirs": None}
    monkeypatch.setattr(conformance, "select", lambda *a, **k: [JOB])
    monkeypatch.setattr(conformance, "run_worker",
                        lambda target, jobs: ({JOB.id: {("replay", None): state["theirs"]}}, {"import_s": 0.0}))
    return co, state


def review(co, tmp_path, capsys, theirs_table, state, *extra):
    state["theirs"] = dict(OURS, page_table=i32(*theirs_table))
    out = tmp_path / "review.md"
    rc = main(["--sglang", str(co), "--report", str(out), "--root", str(tmp_path / "root"), *extra])
    return rc, capsys.readouterr().out, out.read_text()


@pytest.mark.spec("CG-008")
def test_the_context_wall_on_a_source_tree_is_the_known_bug_a_broken_rule_named_with_its_pr(
        tree, tmp_path, capsys):
    co, state = tree
    rc, text, md = review(co, tmp_path, capsys, [[1, 2, 3, 4], [6, 7, 0, 0]], state)  # 4 columns < 5 live pages
    assert rc == 1, text  # a known bug reproduced is a broken rule (issue 39 item 6)
    lines = text.splitlines()
    assert lines[0].startswith(f"== sglang @ {co}: 1 cases, 0 identical, 0 with only documented differences, "
                               f"1 failing (1 on known upstream bugs)")
    assert "sglang sglang" not in text and "sglang sglang" not in md
    findings = [x for x in lines if x.startswith("  DIFFERS ")]
    assert len(findings) == 1 and all("CG-008 (kernel contract)" in x and x.endswith(f"[{WALL}]") for x in findings)
    assert "MD-007" not in text  # the dead width below the bound is the same table (reported as not read)
    assert f"== FAIL: 1 result breaks a rule [CG-008]; 1 of them reproduce known upstream bugs ({WALL})" in text
    assert "not checked by this comparison" not in text
    # the report carries the marker and the PR's link on every finding and in its closing words, and opens
    # with the headline: the rule, the bug, the smallest case, both values
    assert f"**sglang @ {co}**: 1 cases compared, 1 failing, 1 of them on known upstream bugs" in md
    assert f"1. **CG-008** (kernel contract) (known upstream bug `context-wall-page-table` ([sglang#35985]({PR}))), " \
           f"1 result, in every case compared (1); smallest case verify replay, P = 16, k = 1" in md
    items = [x for x in md.splitlines() if x.startswith("- **CG-008**")]
    assert len(items) == 1 and all(x.endswith(f"[known upstream bug `context-wall-page-table` ([sglang#35985]({PR}))]")
                                   for x in items)
    closing = [x for x in md.splitlines() if x.startswith("> **CG-008** in 1 of these results")]
    assert len(closing) == 1 and f"([sglang#35985]({PR}))" in closing[0] and "still a broken rule" in closing[0]
    # stated as expected for this code (strict expected failures, as CI states its pins'): exit 0
    rc, text, _ = review(co, tmp_path, capsys, [[1, 2, 3, 4], [6, 7, 0, 0]], state, "--expect-bugs",
                         f"@ {co}:context-wall-page-table")
    assert rc == 0 and f"== EXPECTED KNOWN UPSTREAM BUGS: sglang @ {co}: {WALL} reproduced as expected" in text
    assert text.splitlines()[-2].startswith("   not checked by this comparison: CG-001 (buffer identity: captured "
                                            "buffers rewritten in place, not rebound; the metadata's values")
    # ... and an expected bug that does not show fails the run (it disappeared: fixed, or lost)
    rc, text, _ = review(co, tmp_path, capsys, [[1, 2, 3, 4, 5, 0], [6, 7, 0, 0, 0, 0]], state, "--expect-bugs",
                         f"@ {co}:context-wall-page-table")
    assert rc == 1 and f"the expected {WALL} did not show" in text


def test_another_defect_on_the_same_tree_still_fails_and_names_no_bug(tree, tmp_path, capsys):
    co, state = tree
    rc, text, md = review(co, tmp_path, capsys, [[1, 2, 9, 4], [6, 7, 0, 0]], state)  # short AND a wrong page
    assert rc == 1 and "== FAIL" in text and "known upstream bug" not in text + md
    assert "not checked by this comparison" not in text
    rc, text, md = review(co, tmp_path, capsys, [[1, 2, 3, 4, 5, 0], [6, 7, 0, 0, 0, 0]], state)  # identical
    assert rc == 0 and "== OK" in text and "not checked by this comparison: CG-001 (buffer identity" in text


def test_a_report_path_that_cannot_be_written_stops_the_run_before_it_starts(tmp_path):
    for path, why in ((tmp_path / "no" / "such" / "r.md", f"directory {tmp_path / 'no' / 'such'} does not exist"),
                      (tmp_path, "is a directory, not a file")):
        p = cli("--sglang", "0.5.23", "--report", str(path), "--root", str(tmp_path / "root"))
        (line,) = p.stderr.strip().splitlines()
        assert p.returncode == 2 and p.stdout == "" and line.endswith(f"error: --report {path}: {why}")
    assert not (tmp_path / "root").exists()  # nothing was installed or run
