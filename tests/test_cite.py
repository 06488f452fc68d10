"""``python -m refspec cite``: from a review comment "violates CG-004" to the rule, its level,
its upstream sources and its tests in one command (issue 16); bad input is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from refspec import cli
from refspec.cli import cite
from refspec.core.invariants import RULES

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    rc = cli.main(["cite", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cite_is_a_registered_command():
    assert cli.COMMANDS["cite"][0] == "refspec.cli.cite"


def test_cite_prints_rule_level_sources_and_tests(capsys):
    rc, out, err = run(capsys, "CG-008")
    assert rc == 0 and not err
    assert out.startswith("**CG-008** — page-table buffers are sized from req_to_token.shape[1]")
    assert "*refspec hardening*" in out and "not a bug report" in out
    assert "In SGLang:" in out and "ceil(context_len / P)" in out
    assert "docs/spec/graphs.md#cg-008" in out
    # the upstream sources as links a reader can open
    assert "](https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/" \
           "flashattention_backend.py#L2432)" in out
    assert "](https://github.com/sgl-project/sglang/pull/29665)" in out
    # a test known (by reading tests/test_cases_graphs.py) to carry @pytest.mark.spec("CG-008")
    assert "`tests/test_cases_graphs.py::test_case_B07_page_table_width_at_the_context_wall`" in out
    assert "> does not follow **CG-008** (refspec hardening:" in out


def test_cite_upstream_rule_names_versions_and_conformance(capsys):
    rc, out, _ = run(capsys, "cg-004")  # case-insensitive
    assert rc == 0
    assert out.startswith("**CG-004** — DRAFT_EXTEND_V2 replay")
    assert "*upstream behaviour*" in out
    assert "`python -m refspec conformance` at v0.5.12.post1, v0.5.23" in out
    assert "> violates **CG-004**" in out
    assert "In SGLang:" not in out


def test_cite_several_ids(capsys):
    rc, out, _ = run(capsys, "PA-003", "MD-008")
    assert rc == 0
    assert out.count("**PA-003**") == 2 and out.count("**MD-008**") == 2  # heading + review line
    assert "*kernel contract*" in out and "\n---\n" in out


@pytest.mark.parametrize("token, near", [("CG-08", "CG-008"), ("md008", "MD-008"), ("SD-0007", "SD-007")])
def test_unknown_id_is_one_line_with_close_matches(capsys, token, near):
    rc, out, err = run(capsys, token)
    assert rc == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"unknown invariant {token!r}" in lines[0] and near in lines[0]


def test_unknown_id_without_close_match_points_to_the_list(capsys):
    rc, _, err = run(capsys, "nonsense")
    assert rc == 2 and "--list" in err and len(err.strip().splitlines()) == 1


def test_no_id_is_a_usage_error(capsys):
    rc, out, err = run(capsys)
    assert rc == 2 and not out and "--list" in err


def test_list_has_every_id_once_with_its_level(capsys):
    rc, out, _ = run(capsys, "--list")
    assert rc == 0
    rows = out.strip().splitlines()
    assert [r.split()[0] for r in rows] == list(RULES)
    assert {lvl for lvl in ("kernel contract", "upstream behaviour", "refspec hardening") if lvl in out} == {
        "kernel contract", "upstream behaviour", "refspec hardening"}
    assert next(r for r in rows if r.startswith("CG-010")).split("  ")[1].strip() == "refspec hardening"


def test_cli_subprocess_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "refspec", "cite", "XX-1"], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_render_without_tests_says_so():
    assert "- **Tests:** none yet" in cite.render("PA-001", [])


def test_list_by_level(capsys):
    rc, out, _ = run(capsys, "--list", "--level", "hardening")
    ids = [r.split()[0] for r in out.strip().splitlines()]
    assert rc == 0 and {"CG-005", "CG-008", "CG-010"} <= set(ids)
    assert "CG-004" not in ids and "PA-003" not in ids
    assert cli.main(["cite", "--list", "--level", "nope"]) == 2  # one error line (refspec.cli._args)
    err = capsys.readouterr().err
    assert "invalid choice" in err and len(err.strip().splitlines()) == 1
