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
    # a public case first, and of those the one that cites CG-008 alone (tests/test_mutants.py, read by hand:
    # @pytest.mark.spec("CG-008"); tests/test_cases_graphs.py's B07 cites CG-008 and MD-010)
    assert "- **Shown by:** `pytest 'tests/test_mutants.py::test_case_B07_page_table_width_at_the_context_wall'`" in out
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


# ---------------------------------------------------------------- the rule word for word, labels, the first test
def _rule_paragraph_from_page(page: str, inv_id: str) -> str:
    """The ``**Rule.**`` paragraph under ``### ID`` on ``docs/spec/<page>``, lines joined by one space
    (read here, independently of ``cite.spec_entries``)."""
    lines = (ROOT / "docs" / "spec" / page).read_text().splitlines()
    start = next(n for n, x in enumerate(lines) if x.startswith(f"### {inv_id} "))
    first = next(n for n in range(start + 1, len(lines)) if lines[n].startswith("**Rule.**"))
    assert not any(x.startswith("#") for x in lines[start + 1:first]), "the Rule paragraph is in the next entry"
    end = next(n for n in range(first, len(lines)) if not lines[n].strip())
    return " ".join(x.strip() for x in lines[first:end])


@pytest.mark.parametrize("inv_id, fragment", [
    ("ML-011", "with the `qv` call's arguments, `causal=False`, the LSE returned, and merge them (TR-012)"),
    ("ML-011", "the draft-decode expand call reads the P-paged views (its table holds pages)"),
    ("ML-012", "with all sources read before any target is written"),
])
def test_cite_prints_the_rule_paragraph_word_for_word(capsys, inv_id, fragment):
    """The reviewer's report: ``cite ML-011`` / ``ML-012`` printed the title only, a paraphrase."""
    rule = _rule_paragraph_from_page("mla.md", inv_id)
    assert fragment in rule and fragment not in RULES[inv_id].title  # the title alone would miss it
    rc, out, _ = run(capsys, inv_id)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == f"**{inv_id}** — {RULES[inv_id].title}" and lines[1] == ""
    assert lines[2] == rule  # the paragraph itself, right under the title
    assert fragment in lines[2]
    # the review line keeps the one-line title
    assert lines[-1].startswith(f"> violates **{inv_id}** ({RULES[inv_id].level}: {RULES[inv_id].title}): ")
    rc, out, _ = run(capsys, inv_id, "--format", "text")
    plain = rule.replace("**", "").replace("`", "")
    assert rc == 0 and out.splitlines()[2] == plain and fragment.replace("`", "") in plain
    assert "`" not in out.splitlines()[2] and "**" not in out.splitlines()[2]


def test_every_rule_has_its_rule_paragraph():
    for inv_id in RULES:
        assert cite.rule_paragraph(inv_id).startswith("**Rule.** "), inv_id
        assert "\n" not in cite.rule_paragraph(inv_id), inv_id


def test_rule_paragraph_links_leave_docs_spec():
    """ML-013's entry links ``../mla.md``: relative to docs/spec/, so printed as docs/mla.md (or under a base)."""
    text = "[MLA](../mla.md#the-gpu-build) and [TR-020](tree.md#tr-020)"
    entry = {"XX-001": f"### XX-001 — t\n\n**Rule.** See {text}.\n\n**Why.** x\n"}
    orig = cite.spec_entries
    try:
        cite.spec_entries = lambda: entry
        assert cite.rule_paragraph("XX-001") == ("**Rule.** See [MLA](docs/mla.md#the-gpu-build) and "
                                                 "[TR-020](docs/spec/tree.md#tr-020).")
        assert cite.rule_paragraph("XX-001", "https://h/b", markdown=False) == (
            "Rule. See MLA <https://h/b/docs/mla.md#the-gpu-build> and TR-020 <https://h/b/docs/spec/tree.md#tr-020>.")
    finally:
        cite.spec_entries = orig


def test_links_to_one_symbol_at_two_lines_get_distinct_labels(capsys):
    """ML-011 cites ``forward_extend`` twice: the MHA expand call (L1844) and the MLA one (L2034)."""
    rc, out, _ = run(capsys, "ML-011")
    upstream = next(x for x in out.splitlines() if x.startswith("- **Upstream:** "))
    pairs = re.findall(r"\[`([^`]+)`\]\((https://[^)]+)\)", upstream)
    labels = [lab for lab, _ in pairs]
    assert rc == 0 and len(pairs) == len(RULES["ML-011"].sources) - 1  # all but the PR (History)
    assert len(set(labels)) == len(labels), labels
    fe = [(lab, url) for lab, url in pairs if "forward_extend" in lab]
    assert [lab.split(":")[-1] for lab, _ in fe] == ["FlashAttentionBackend.forward_extend L1844@v0.5.23",
                                                     "FlashAttentionBackend.forward_extend L2034@v0.5.23"]
    assert all(url.endswith("#L" + lab.split(" L")[1].split("@")[0]) for lab, url in fe)
    # a label that is not repeated stays as the catalogue has it
    assert any(lab.endswith(":FlashAttentionBackend.forward_decode@v0.5.23") for lab in labels)


def test_source_labels_only_change_repeated_labels():
    from refspec.core.sources import Source
    a = Source("f.py:g@v1", "https://x/blob/v1/f.py#L10")
    b = Source("f.py:g@v1", "https://x/blob/v1/f.py#L20")
    c = Source("f.py:h@v1", "https://x/blob/v1/f.py#L30")
    d = Source("note", "https://x/blob/v1/g.py#L5")
    e = Source("note", "https://x/blob/v1/g.py#L6")
    assert cite.source_labels([a, b, c, d, e]) == ["f.py:g L10@v1", "f.py:g L20@v1", "f.py:h@v1", "note L5", "note L6"]
    assert cite.source_labels([a, c]) == ["f.py:g@v1", "f.py:h@v1"]


@pytest.mark.parametrize("inv_id, first", [
    ("ML-011", "tests/test_mla_backend.py::test_verify_expand_on_the_paged_views_reads_the_wrong_keys"),
    ("ML-012", "tests/test_conformance_mla.py::"
               "test_mla_pool_without_move_kv_cache_fails_on_0512_at_a_partial_tail_and_0523_moves_rows"),
])
def test_shown_by_names_a_test_that_reproduces_the_rule_not_the_shared_guard(capsys, inv_id, first):
    """``test_mla_topk_gt1_paged_fa3_passes_the_releases_own_guards`` (reachability, cites ML-011 and ML-012)
    sorted first by name; the first test must be one that cites the rule alone (read by hand from its module)."""
    path, _, name = first.partition("::")
    assert re.search(rf'@pytest\.mark\.spec\("{inv_id}"\)\ndef {name}\(', (ROOT / path).read_text())
    rc, out, _ = run(capsys, inv_id)
    shown = next(x for x in out.splitlines() if x.startswith("- **Shown by:** "))
    assert rc == 0 and shown.startswith(f"- **Shown by:** `pytest '{first}'`"), shown
    assert "passes_the_releases_own_guards" not in shown


def test_pick_tests_order():
    """GPU last; public cases first; fewer rules cited first; the module holding most of the rule's tests
    first; file order inside a module (this file's own tests, whose lines are known)."""
    here = "tests/test_cite.py::"
    tests = [here + "test_text_format_has_no_markdown", here + "test_cite_several_ids",
             "tests/test_gpu_x.py::test_one", "tests/test_a.py::test_case_B01_x", "tests/test_a.py::test_many",
             "tests/test_b.py::test_alone"]
    cited = {"XX-001": tests, "XX-002": ["tests/test_a.py::test_many", "tests/test_a.py::test_case_B01_x"],
             "XX-003": ["tests/test_a.py::test_many"]}
    assert cite.pick_tests(tests, cited) == [
        "tests/test_a.py::test_case_B01_x",  # a public case, though it cites two rules
        here + "test_cite_several_ids",  # cites one rule, in the module with two of its tests, defined first
        here + "test_text_format_has_no_markdown",
        "tests/test_b.py::test_alone",  # cites one rule, a module with one of its tests
        "tests/test_a.py::test_many",  # cites three rules
        "tests/test_gpu_x.py::test_one"]
