"""``python -m refspec cite``: from a review comment "violates CG-004" to the rule, its level,
its upstream sources and its tests in one command (issue 16); bad input is one line, exit 2."""

from __future__ import annotations

import re
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
    assert out.startswith("**CG-008** — graph page tables have at least ceil(max K_b / P) columns")
    # released upstream code breaks it (the context wall): the level says so, and quoting it is a bug report
    assert "*kernel contract*" in out and "Released SGLang breaks it:" in out and "is a bug report" in out
    assert "v0.5.23" in out and "sglang#35985" in out and "PA-003" in out
    assert "docs/spec/graphs.md#cg-008" in out
    # the upstream sources as links a reader can open
    assert "](https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/" \
           "flashattention_backend.py#L2432)" in out
    assert "](https://github.com/sgl-project/sglang/pull/29665)" in out
    # a test known (by reading tests/test_cases_graphs.py) to carry @pytest.mark.spec("CG-008")
    assert "- **Shown by:** `pytest 'tests/test_cases_graphs.py::test_case_B07_" in out  # a public case first
    assert "> violates **CG-008** (kernel contract:" in out


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
    assert "- **Shown by:** no test yet" in cite.render("PA-001", [])


def test_list_by_level(capsys):
    rc, out, _ = run(capsys, "--list", "--level", "hardening")
    ids = [r.split()[0] for r in out.strip().splitlines()]
    assert rc == 0 and {"CG-005", "CG-010"} <= set(ids)
    # CG-008 is a kernel contract that released upstream breaks (the context wall), not a hardening
    assert "CG-004" not in ids and "PA-003" not in ids and "CG-008" not in ids
    assert cli.main(["cite", "--list", "--level", "nope"]) == 2  # one error line (refspec.cli._args)
    err = capsys.readouterr().err
    assert "invalid choice" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- issue 23: paste-ready, lookups
def test_markdown_block_for_a_github_comment(capsys):
    """The block the issue asks for: statement, level, upstream permalinks at a tag, rule page, a test."""
    rc, out, _ = run(capsys, "CG-004", "--format", "markdown")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == f"**CG-004** — {RULES['CG-004'].title}"
    assert "- **Level:** *upstream behaviour*: " in out
    upstream = next(x for x in lines if x.startswith("- **Upstream:** "))
    links = re.findall(r"\]\((https://[^)]+)\)", upstream)
    assert links and all(re.search(r"/blob/v\d+\.\d+\.\d+(\.post\d+)?/.+#L\d+$", u) for u in links), upstream
    assert "- **History:** [sglang@160a06cab (#15207)](https://github.com/sgl-project/sglang/commit/160a06cab)" in out
    # no --base-url: the rule page is an absolute link under the repository's blob (pyproject's Repository URL)
    assert "- **Rule page:** [`docs/spec/graphs.md#cg-004`](https://github.com/refspec/refspec/blob/main/docs/spec/"\
           "graphs.md#cg-004)" in out
    shown = next(x for x in lines if x.startswith("- **Shown by:** "))
    node = re.search(r"`pytest '([^']+)'`", shown).group(1)
    path, _, name = node.partition("::")
    assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text()  # a real test of this repository
    assert "CG-004" in (ROOT / path).read_text()
    assert lines[-1].startswith("> violates **CG-004** (upstream behaviour: ")


def test_text_format_has_no_markdown(capsys):
    rc, out, _ = run(capsys, "PA-003", "--format", "text")
    assert rc == 0 and out.startswith("PA-003 — page_table has at least")
    assert "**" not in out and "](" not in out and "`" not in out
    assert "  Upstream: flash-attention/hopper/flash_api.cpp:mha_fwd@fa4-v4.0.0.beta27 <https://github.com/" \
           "Dao-AILab/flash-attention/blob/fa4-v4.0.0.beta27/hopper/flash_api.cpp#L768>" in out


def test_base_url_makes_docs_links_absolute(capsys, monkeypatch):
    base = "https://github.com/someone/refspec/blob/v0.2.0"
    rc, out, _ = run(capsys, "PA-003", "--base-url", base + "/")
    assert rc == 0
    page = "docs/spec/paging-attention.md#pa-003"
    assert f"- **Rule page:** [`{page}`]({base}/{page})" in out
    assert f"]({base}/docs/kernel-facts.md#page-table-columns)" in out
    assert out.rstrip().endswith(f"See {base}/docs/spec/paging-attention.md#pa-003.")
    monkeypatch.setenv(cite.BASE_URL_ENV, base)
    rc, out, _ = run(capsys, "PA-003")
    assert f"]({base}/docs/spec/paging-attention.md#pa-003)" in out


def test_tests_flag_lists_every_citing_test(capsys):
    import spec_index  # docs/spec_index.py (pytest's pythonpath)
    cited = spec_index.build_index().tests["CG-004"]
    rc, out, _ = run(capsys, "CG-004", "--tests")
    assert rc == 0 and "more:" not in out
    assert sum(f"`{t}`" in out or f"'{t}'" in out for t in cited) == len(cited) > 1


@pytest.mark.parametrize("argv", [["page_table"], ["--grep", "page_table"], ["--grep", "PAGE_TABLE"]])
def test_lookup_by_field_lists_the_rules_that_mention_it(capsys, argv):
    rc, out, err = run(capsys, *argv)
    assert rc == 0 and not err
    ids = [r.split()[0] for r in out.strip().splitlines()]
    # rules known (by reading their titles) to name page_table
    assert {"PA-002", "PA-003", "MD-007"} <= set(ids)
    assert "SD-010" not in ids  # "top-k = 1: N = Sd + 1 draft tokens ..." has no page table
    assert ids == [i for i in RULES if i in ids]  # catalogue order, each once


def test_lookup_by_a_term_only_in_the_spec_entry(capsys):
    """``extend_seq_lens`` is in CG-004's title; ``align_evict_mask_to_page_size`` only in KV-004's entry."""
    rc, out, _ = run(capsys, "--grep", "align_evict_mask_to_page_size")
    assert rc == 0 and "KV-004" in out.split()
    assert "align_evict_mask_to_page_size" not in RULES["KV-004"].title


def test_lookup_without_a_match_is_one_line(capsys):
    rc, out, err = run(capsys, "--grep", "no_such_field_xyz")
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and "no rule mentions" in err


def test_level_alone_lists_that_level(capsys):
    rc, out, _ = run(capsys, "--level", "kernel")
    ids = [r.split()[0] for r in out.strip().splitlines()]
    assert rc == 0 and ids == [i for i, r in RULES.items() if str(r.level) == "kernel contract"]
    rc, out, _ = run(capsys, "req_pool_indices", "--level", "hardening")
    assert rc == 0 and "CG-005" in out.split() and {r.split()[0] for r in out.strip().splitlines()} <= {
        i for i, r in RULES.items() if str(r.level) == "refspec hardening"}
