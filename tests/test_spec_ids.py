"""Meta-tests: the invariant IDs agree across code, docs and tests (docs/spec/index.md).

* (a) the IDs defined as headings in ``docs/spec/*.md`` are exactly the keys of
  ``refspec.core.invariants.INVARIANTS``, each once, on its family's page, with a complete entry;
* (b) every ID is cited by at least one test through ``@pytest.mark.spec("ID", ...)``;
* (c) every cited ID exists, and every citation can be read statically.

Citations are found by parsing ``tests/**/test_*.py`` with ``ast`` (``docs/spec_index.py``), not
by running pytest, so this file stays fast and independent of which tests can run here.
"""

from __future__ import annotations

import re
import textwrap

import pytest

import spec_index  # docs/spec_index.py (pytest's pythonpath)
from refspec.core.invariants import INVARIANTS


@pytest.fixture(scope="module")
def index() -> spec_index.Index:
    return spec_index.build_index()


def _sections() -> dict[str, str]:
    """ID -> the text of its spec entry (heading up to the next heading of any level)."""
    out = {}
    for page in sorted(spec_index.SPEC_DIR.glob("*.md")):
        current, buf = None, []
        for line in page.read_text().splitlines() + ["## end"]:
            if line.startswith("#"):
                if current:
                    out[current] = "\n".join(buf)
                m = spec_index.HEADING_RE.match(line)
                current, buf = (m.group(1) if m else None), [line]
            else:
                buf.append(line)
    return out


# ---------------------------------------------------------------- (a) docs == catalogue
def test_spec_pages_define_exactly_the_catalogue_ids():
    defined = spec_index.doc_ids()
    missing = sorted(set(INVARIANTS) - set(defined))
    extra = sorted(set(defined) - set(INVARIANTS))
    assert not missing, f"IDs of refspec/core/invariants.py with no heading in docs/spec/: {missing}"
    assert not extra, f"docs/spec/ headings with IDs unknown to refspec/core/invariants.py: {extra}"


def test_each_id_defined_once_on_its_family_page():
    for inv_id, places in spec_index.doc_ids().items():
        assert len(places) == 1, f"{inv_id} is defined {len(places)} times: {places}"
        assert places[0][0] == spec_index.family_page(inv_id), f"{inv_id} is on {places[0][0]}"


def test_spec_entries_are_complete():
    """Level, rule stated as MUST/SHOULD, a why, a worked example with numbers, a source, the tests hook."""
    problems = []
    for inv_id, text in _sections().items():
        if not re.search(r"\b(MUST|SHOULD)\b", text):
            problems.append(f"{inv_id}: no MUST/SHOULD")
        for part in ("**Level.**", "**Rule.**", "**Why.**", "**Example.**", "**Source.**"):
            if part not in text:
                problems.append(f"{inv_id}: no {part}")
        example = text.split("**Example.**", 1)[-1].split("**Source.**", 1)[0]
        if not re.search(r"\d", example):
            problems.append(f"{inv_id}: the example has no numbers")
        hooks = re.findall(r"<!--\s*refspec:tests\s+(\S+)\s*-->", text)
        if hooks != [inv_id]:
            problems.append(f"{inv_id}: tests placeholder {hooks}, expected exactly [{inv_id!r}]")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- (b) every ID is tested
def test_every_id_is_cited_by_a_test(index):
    uncovered = index.uncovered()
    assert not uncovered, (f"{len(uncovered)} invariant IDs are cited by no test "
                           f"(@pytest.mark.spec): " + ", ".join(uncovered))


# ---------------------------------------------------------------- (c) every cited ID exists
def test_every_cited_id_exists(index):
    assert not index.unknown(), f"tests cite unknown IDs: {index.unknown()}"


def test_every_citation_is_statically_readable(index):
    assert not index.problems, "\n".join(index.problems)


# ---------------------------------------------------------------- the scanner itself
SAMPLE = '''
import pytest
from pytest import mark

pytestmark = pytest.mark.spec("TOL-001")
BOTH = ("PA-001", "PA-002")

@pytest.mark.spec("CG-004", "MD-002")
def test_a():
    pass

@pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.spec("KV-003")), 2])
def test_b(x):
    pass

@mark.spec(*BOTH)
def test_c():
    pass

def helper_not_a_test():
    pass

@pytest.mark.spec("SD-001")
class TestGroup:
    @pytest.mark.spec("SD-002")
    def test_d(self):
        pass

    def test_e(self):
        pass
'''


def test_scanner_reads_every_citation_form(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_sample.py").write_text(textwrap.dedent(SAMPLE))
    (tests / "test_broken.py").write_text("import pytest\n@pytest.mark.spec(get_ids())\ndef test_x(): pass\n")
    idx = spec_index.build_index(tests)
    f = "tests/test_sample.py"
    assert idx.tests["CG-004"] == [f"{f}::test_a"]
    assert idx.tests["MD-002"] == [f"{f}::test_a"]
    assert idx.tests["KV-003"] == [f"{f}::test_b"]
    assert idx.tests["PA-001"] == idx.tests["PA-002"] == [f"{f}::test_c"]
    assert idx.tests["SD-001"] == [f"{f}::TestGroup::test_d", f"{f}::TestGroup::test_e"]
    assert idx.tests["SD-002"] == [f"{f}::TestGroup::test_d"]
    # the module-level pytestmark applies to every test of the module
    assert len(idx.tests["TOL-001"]) == 5
    assert not any("helper" in n for nodes in idx.tests.values() for n in nodes)
    assert len(idx.problems) == 1 and "test_broken.py" in idx.problems[0] and "get_ids()" in idx.problems[0]


def test_scanner_flags_unknown_ids(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text('import pytest\n@pytest.mark.spec("CG-999")\ndef test_x(): pass\n')
    idx = spec_index.build_index(tests)
    assert idx.unknown() == {"CG-999": ["tests/test_x.py::test_x"]}
    assert "CG-999" not in idx.uncovered()


# ---------------------------------------------------------------- levels in code
def test_every_rule_has_a_level_and_the_error_text_ends_with_it():
    from refspec.core.invariants import RULES, InvariantError
    from refspec.core.sources import Level

    assert list(RULES) == list(INVARIANTS)
    for inv_id, rule in RULES.items():
        assert isinstance(rule.level, Level) and rule.sources, inv_id
        assert INVARIANTS[inv_id] == rule.title
    e = InvariantError("CG-008", "replay needs 5 pages, the buffer has 4")
    assert str(e) == ("[CG-008] graph page tables have at least ceil(max K_b / P) columns; replay checks the pages "
                      "fit: replay needs 5 pages, the buffer has 4 [kernel contract]")
    assert e.rule is RULES["CG-008"] and e.inv_id == "CG-008"
    assert str(InvariantError("PA-003", "x")).endswith(": x [kernel contract]")
    assert str(InvariantError("CG-009", "x")).endswith(": x [refspec hardening]")
    assert str(InvariantError("MD-008", "x")).endswith(": x [upstream behaviour]")


def test_the_context_wall_is_one_defect_one_level_and_a_bug_report_against_released_code():
    """CG-008 (the graph buffers) and PA-003 (the kernel's table) name the same defect: one level,
    the same statement of which releases break it and which PR fixes it, cross-referenced; the
    conformance run's known bug names CG-008 with PA-003."""
    from refspec.conformance import known
    from refspec.core.invariants import RULES
    from refspec.core.sources import Level, Rule, doc

    cg, pa = RULES["CG-008"], RULES["PA-003"]
    assert cg.level is pa.level is Level.KERNEL
    assert cg.violated_by == pa.violated_by and "v0.5.23" in cg.violated_by and "#35985" in cg.violated_by
    assert "PA-003" in cg.violated_by and "CG-008" in pa.violated_by
    b = next(b for b in known.BUGS if b.key == "context-wall-page-table")
    assert (b.rule, b.also) == ("CG-008", ("PA-003",))
    with pytest.raises(ValueError, match="not a bug"):
        Rule("x", Level.HARDENING, (doc("versions.md"),), upstream="y", violated_by="z")
