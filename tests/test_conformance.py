"""The conformance harness's own logic, without upstream installed (part of ``make test``).

The field comparison, the documented-differences matcher and table, the report table and the
raising stubs are checked on hand-written inputs; the runs against SGLang itself are in
``test_conformance_upstream.py`` (marker ``conformance``, run by ``make conformance``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from refspec.conformance import compare as compare_mod
from refspec.conformance import known
from refspec.conformance.compare import KERNEL_FIELDS, Diff, compare
from refspec.conformance.report import Row, summary, table

i32 = lambda *x: torch.tensor(x, dtype=torch.int32)


def md(K, cu_q, table_rows, max_q=1, max_k=0):
    """Metadata fields for K (tokens per row) with ``cu_seqlens_k`` written out by hand."""
    cu_k = [0]
    for k in K:
        cu_k.append(cu_k[-1] + k)
    return {"cache_seqlens_int32": i32(*K), "cu_seqlens_q": i32(*cu_q), "cu_seqlens_k": i32(*cu_k),
            "max_seq_len_q": max_q, "max_seq_len_k": max_k, "page_table": torch.tensor(table_rows, dtype=torch.int32)}


# P = 4, K = [5, 9]: rows read 2 and 3 pages; column 3 of row 0 and column 3 of row 1 are dead
OURS = md([5, 9], [0, 1, 2], [[7, 3, 11, 0], [2, 9, 4, 0]])


def test_identical_metadata_has_no_difference():
    assert compare(OURS, md([5, 9], [0, 1, 2], [[7, 3, 11, 0], [2, 9, 4, 0]]), page_size=4) == []


def test_a_live_page_difference_names_the_row_and_both_values():
    theirs = md([5, 9], [0, 1, 2], [[7, 3, 11, 0], [2, 8, 4, 0]])  # row 1, page 1 of 3 differs
    (d,) = compare(OURS, theirs, page_size=4)
    assert (d.field, d.ours, d.theirs) == ("page_table[live]", "row 1: [2, 9, 4]", "row 1: [2, 8, 4]")


def test_dead_columns_and_a_wider_table_are_the_dead_field_only():
    theirs = md([5, 9], [0, 1, 2], [[7, 3, 0, 0, 0], [2, 9, 4, 0, 0]])  # row 0 column 2 is dead (K=5: 2 pages)
    assert [d.field for d in compare(OURS, theirs, page_size=4)] == ["page_table[dead]"]


def test_each_kernel_scalar_and_vector_is_compared():
    theirs = md([5, 10], [0, 1, 2], [[7, 3, 11, 0], [2, 9, 4, 0]], max_q=2, max_k=64)
    fields = [d.field for d in compare(OURS, theirs, page_size=4)]
    assert fields == ["cache_seqlens_int32", "cu_seqlens_k", "max_seq_len_q", "max_seq_len_k"]


def test_upstream_buffers_longer_than_the_batch_are_cut_not_compared():
    theirs = dict(md([5, 9, 1], [0, 1, 2, 3], [[7, 3, 11, 0], [2, 9, 4, 0], [0, 0, 0, 0]]))
    assert compare(OURS, theirs, page_size=4) == []


def test_a_missing_upstream_row_is_a_live_difference():
    theirs = md([5], [0, 1], [[7, 3, 11, 0]])
    assert "page_table[live]" in [d.field for d in compare(OURS, theirs, page_size=4)]


@pytest.mark.parametrize("field", ["cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "max_seq_len_q",
                                   "max_seq_len_k"])
def test_a_field_upstream_did_not_return_differs_and_is_named(field):
    """A key absent on one side is a difference ('missing' on that side), never a KeyError or a skip."""
    theirs = {k: v for k, v in OURS.items() if k != field}
    (d,) = compare(OURS, theirs, page_size=4)
    assert (d.field, d.theirs) == (field, "missing")
    (d,) = compare(OURS, dict(OURS, **{field: None}), page_size=4)  # present but None: the same
    assert (d.field, d.theirs) == (field, "missing")


def test_a_missing_page_table_is_a_live_difference():
    theirs = {k: v for k, v in OURS.items() if k != "page_table"}
    (d,) = compare(OURS, theirs, page_size=4)
    assert (d.field, d.ours, d.theirs) == ("page_table[live]", "width 4", "missing")


def test_a_shorter_upstream_vector_differs():
    theirs = dict(OURS, cu_seqlens_q=i32(0, 1))  # bs + 1 = 3 entries needed
    (d,) = compare(OURS, theirs, page_size=4)
    assert (d.field, d.theirs) == ("cu_seqlens_q", "[0, 1]")


def test_documented_differences_match_only_their_pin_mode_and_phase():
    assert known.match("0.5.23", "decode", "replay", "max_seq_len_k").key == "replay-max-k-context"
    assert known.match("0.5.23", "decode", "eager", "max_seq_len_k") is None
    assert known.match("0.5.12.post1", "decode", "replay", "page_table[dead]") is None
    for f in KERNEL_FIELDS:
        assert known.match("0.5.23", "decode", "replay", f) is None


def test_a_kernel_read_field_cannot_be_documented():
    with pytest.raises(ValueError, match="read by the kernel"):
        known.Known("x", ("cu_seqlens_q",), ("decode",), ("replay",), ("0.5.23",), (), "", "")
    with pytest.raises(ValueError, match="read by the kernel"):  # not even at capture: replay keeps it
        known.Known("x", ("cu_seqlens_q",), ("verify",), ("capture",), ("0.5.23",), (), "", "")


def test_every_documented_difference_cites_an_upstream_line_of_its_pins():
    for k in known.KNOWN:
        assert k.upstream and {pin for pin, _, _ in k.upstream} <= set(k.pins), k.key
        assert all(f.startswith("python/sglang/") and line > 0 for _, f, line in k.upstream), k.key
    assert "eagle_worker_common.py:65" in known.source("0.5.23", "tree_draft_decode", "eager", "tree:tail_copy")
    assert ":944" in known.source("0.5.23", "tree_draft_decode", "eager", "prefix:cu_seqlens_k")  # the FA builder
    assert known.link("0.5.23", known.FA, 741) == (
        "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/"
        "flashattention_backend.py#L741")


def test_table_cells_say_same_documented_differs_and_error_with_the_rule_and_its_level():
    from refspec.conformance.report import find

    rows = [Row("0.5.23", "decode/P4/a", "decode", 4, "a", "eager", None),
            Row("0.5.23", "decode/P4/a", "decode", 4, "a", "replay", None,
                [Diff("max_seq_len_k", "0", "320", "replay-max-k-context")]),
            Row("0.5.23", "verify/P4/a", "verify", 4, "a", "replay", None,
                [Diff("cu_seqlens_q", "[0, 4]", "[0, 1]")]),
            Row("0.5.23", "idle/P4/a", "idle", 4, "a", "eager", None, error="RuntimeError at sglang/x.py:1: boom")]
    for r in rows:
        find(r)
    lines = table(rows, "0.5.23", verbose=True).splitlines()
    assert lines[1].split()[-1] == "same"
    assert lines[2].endswith("same (+replay-max-k-context)")
    assert lines[3].endswith("DIFFERS: cu_seqlens_q [CG-002]")
    assert lines[4].endswith("ERROR [MD-003]")
    assert "CG-002 (upstream behaviour) cu_seqlens_q: refspec [0, 4] | upstream [0, 1]" in lines[6]
    assert ("MD-003 (upstream behaviour): upstream exception (the mode's rule: no field was compared): "
            "RuntimeError at sglang/x.py:1: boom (upstream sglang/x.py:1)") in lines[7]
    assert "documented decode/P4/a replay: max_seq_len_k: refspec 0 | upstream 320 (replay-max-k-context)" in lines[5]
    assert summary(rows, "0.5.23") == {"cases": 4, "same": 1, "documented": 1, "undocumented": 2, "known_bug": 0,
                                       "gaps": 0}
    short = table(rows, "0.5.23").splitlines()  # default: only the failing groups and the findings
    assert [x.split()[0] for x in short] == ["mode", "verify", "idle", "DIFFERS", "ERROR"]


def test_stubs_hand_out_placeholders_at_import_and_raise_at_run_time():
    script = textwrap.dedent("""
        from refspec.conformance import stubs
        stubs.install(["refspec_absent_pkg"])
        from refspec_absent_pkg.sub import thing          # import time: a placeholder
        logger = thing.get_logger("x")                     # import-time call: another one
        class Derived(thing): pass                         # import-time subclass
        stubs.provide("refspec_absent_pkg.sub", "kernel")
        import refspec_absent_pkg.sub as sub
        kernel = sub.kernel                                # bound explicitly: storable
        stubs.arm()
        for what, fn in [("call", lambda: kernel()), ("read", lambda: kernel.x), ("module read", lambda: sub.other),
                         ("call", lambda: thing()), ("instance", lambda: Derived()), ("truth", lambda: bool(thing)),
                         ("import", lambda: __import__("refspec_absent_pkg.fresh"))]:
            try:
                fn()
            except stubs.StubUsed:
                continue
            raise SystemExit(f"{what} of a stub did not raise")
        print("ok", len(stubs.handed_out()))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "ok" and int(proc.stdout.split()[1]) >= 3


def test_scoped_stubs_serve_only_the_listed_statements_of_the_listed_modules(tmp_path):
    """``stubs.for_importers`` (the 0.4.x .. 0.5.3 ``vllm`` fallbacks): the listed statement of the
    listed module gets a stub; a probe in that same module, and the same statement in another
    module, still find the package absent (ImportError), so upstream's ``except ImportError``
    paths run as on a machine without it; at run time even the listed statement raises."""
    pkg = tmp_path / "fakesg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "norm.py").write_text(textwrap.dedent("""
        from refspec_absent_lib.layers.norm import RMSNorm          # listed: a stub
        try:
            import refspec_absent_lib                                # a probe, not listed
            HAVE = True
        except ImportError:
            HAVE = False
    """))
    (pkg / "other.py").write_text("from refspec_absent_lib.layers.norm import RMSNorm\n")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from refspec.conformance import stubs
        stubs.for_importers({{"fakesg.norm": {{"refspec_absent_lib.layers.norm.RMSNorm"}}}})
        import fakesg.norm as n
        assert n.HAVE is False, "the probe found the stubbed package"
        assert "refspec_absent_lib" not in sys.modules
        try:
            import fakesg.other
            raise SystemExit("an unlisted importer got the stub")
        except ModuleNotFoundError:
            pass
        stubs.arm()
        try:
            n.RMSNorm()
            raise SystemExit("calling the stub did not raise")
        except stubs.StubUsed:
            pass
        sys.modules.pop("fakesg.norm")
        try:
            import fakesg.norm
            raise SystemExit("the listed statement did not raise at run time")
        except stubs.StubUsed:
            print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr + proc.stdout


def test_the_docs_page_reprints_every_documented_difference_with_its_links():
    page = (Path(__file__).parent.parent / "docs" / "conformance.md").read_text()
    for k in known.KNOWN:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{k.key}` |")), None)
        assert row is not None, f"docs/conformance.md has no row for {k.key}"
        for pin, f, line in k.upstream:
            assert known.link(pin, f, line) in row, (k.key, pin, line)


def test_an_upstream_error_or_a_missing_phase_is_a_failure_never_same():
    from refspec.conformance.cases import Job
    from refspec.conformance.run import rows_for

    ref = {("eager", None): OURS, ("replay", None): OURS}
    jobs = [Job("decode/P4/x", "decode", 4, "x", True, {}, ref), Job("verify/P4/x", "verify", 4, "x", True, {}, ref)]
    results = {"decode/P4/x": "StubUsed at sglang/x.py:3: read of sgl_kernel.flash_attn.foo",
               "verify/P4/x": {("eager", None): OURS}}  # no replay result
    rows = rows_for("0.5.23", jobs, results)
    assert [(r.job, r.phase, r.ok) for r in rows] == [("decode/P4/x", "eager", False), ("decode/P4/x", "replay", False),
                                                      ("verify/P4/x", "eager", True), ("verify/P4/x", "replay", False)]
    assert "no replay" in rows[3].error and rows[3].broken
    # a stub used at run time: refspec cannot drive that code there (an adapter gap: not compared, no rule broken)
    assert rows[0].gap.startswith("StubUsed") and rows[0].error is None and not rows[0].broken


# ---- top-k > 1: parts, the tree part, the documented-difference guard, the cases ----
def tree_result(prefix, expand, tree=None):
    out = {"prefix": prefix, "expand": expand}
    if tree is not None:
        out["tree"] = tree
    return out


def test_tree_parts_are_compared_each_under_its_own_page_size():
    from refspec.conformance.compare import compare_parts

    # verify expand: slots on the page-size-1 view, K = [1, 2]: row 1 reads 2 slots, its column 2 is dead
    expand = md([1, 2], [0, 1, 2], [[40, 41, 42], [40, 42, 41]])
    ours = tree_result(OURS, expand)
    theirs = tree_result(OURS, md([1, 2], [0, 1, 2], [[40, 41, 42], [40, 42, 99]]))
    assert [d.field for d in compare_parts(ours, theirs, 4, 1)] == ["expand:page_table[dead]"]
    theirs = tree_result(OURS, md([1, 2], [0, 1, 2], [[40, 41, 42], [40, 41, 41]]))
    (d,) = compare_parts(ours, theirs, 4, 1)
    assert (d.field, d.ours, d.theirs) == ("expand:page_table[live]", "row 1: [40, 42]", "row 1: [40, 41]")
    # the same expand compared at P = 4 would read one page per row: the slot difference is then dead
    assert [d.field for d in compare_parts(ours, theirs, 4, 4)] == ["expand:page_table[dead]"]


def test_the_tree_part_is_compared_exactly_and_a_missing_tree_differs():
    from refspec.conformance.compare import compare_parts

    mask = torch.tensor([True, True, False, True])
    ours = tree_result(OURS, OURS, {"custom_mask": mask, "positions": torch.tensor([5, 6])})
    same = tree_result(OURS, OURS, {"custom_mask": mask.clone(), "positions": torch.tensor([5, 6])})
    assert compare_parts(ours, same, 4, 4) == []
    other = tree_result(OURS, OURS, {"custom_mask": torch.tensor([True, True, True, True]),
                                     "positions": torch.tensor([5, 6])})
    assert [d.field for d in compare_parts(ours, other, 4, 4)] == ["tree:custom_mask"]
    assert [d.field for d in compare_parts(ours, tree_result(OURS, OURS), 4, 4)] == ["tree:custom_mask",
                                                                                    "tree:positions"]


def test_a_tree_field_or_part_only_upstream_returns_differs():
    """compare_parts walks the union of both sides' tree fields, and a part upstream lacks is named."""
    from refspec.conformance.compare import compare_parts

    mask = torch.tensor([True, False])
    ours = tree_result(OURS, OURS, {"custom_mask": mask})
    theirs = tree_result(OURS, OURS, {"custom_mask": mask.clone(), "retrive_index": torch.tensor([0, 1])})
    (d,) = compare_parts(ours, theirs, 4, 4)
    assert (d.field, d.ours, d.theirs) == ("tree:retrive_index", "missing", "[0, 1]")
    (d,) = compare_parts(ours, {"prefix": OURS, "tree": {"custom_mask": mask}}, 4, 4)
    assert (d.field, d.theirs) == ("expand:*", "missing")


def test_a_tree_kernel_field_is_documentable_only_as_unread_cu_seqlens_k_with_a_citation():
    T = ("tree_draft_decode",)
    with pytest.raises(ValueError, match="read by the kernel"):
        known.Known("x", ("expand:cu_seqlens_k",), T, ("replay",), ("0.5.23",), (), "", "")
    known.Known("x", ("expand:cu_seqlens_k",), T, ("replay",), ("0.5.23",), (), "", "", unread="flash_api.cpp:929")
    for f in ("expand:cache_seqlens_int32", "prefix:page_table[live]", "prefix:cu_seqlens_q"):
        with pytest.raises(ValueError, match="read by the kernel"):
            known.Known("x", (f,), T, ("replay",), ("0.5.23",), (), "", "", unread="a citation")
    with pytest.raises(ValueError, match="the verify tree itself"):
        known.Known("x", ("tree:custom_mask",), ("tree_verify",), ("capture",), ("0.5.23",), (), "", "")
    k = known.match("0.5.23", "tree_draft_decode", "replay", "expand:cu_seqlens_k")
    assert k.key == "tree-draft-expand-cu-k" and "kernel-facts.md#cu-seqlens-k-new" in k.unread
    assert known.match("0.5.23", "tree_verify", "replay", "expand:cu_seqlens_k") is None  # verify rewrites it
    assert known.match("0.5.12.post1", "tree_draft_decode", "replay", "expand:cu_seqlens_k").key == k.key
    assert known.match("0.5.23", "tree_draft_decode", "replay", "expand:page_table[dead]") is None  # sliced there
    # 0.5.12.post1's unsliced scatter is a known upstream bug (TR-018), never a documented difference
    assert known.match("0.5.12.post1", "tree_draft_decode", "replay", "expand:page_table[dead]") is None


def test_the_context_wall_is_recognised_by_its_signature_on_any_code_the_other_bugs_only_at_their_pins():
    wall = ("verify", "replay", ["page_table[live]"], None, True)  # True: upstream's table is below the bound
    # the wall's signature (a table below the kernel bound, only live pages missing) is the defect itself:
    # the pins, a patched pin, another release, a wheel and a source tree (a PR branch) alike
    for code in ("0.5.23", "0.5.12.post1", known.WALL_FIXED, "0.5.19", "sglang-0.5.20-cp311-none.whl", "@ /src/sglang"):
        b = known.bug(code, *wall)
        assert b is not None and (b.key, b.rule) == ("context-wall-page-table", "CG-008"), code
    # a table narrower than refspec's but at or above the kernel bound drops no live page: not the bug, anywhere
    for code in ("0.5.23", "@ /src/sglang"):
        assert known.bug(code, "verify", "replay", ["page_table[live]"], None) is None
        assert known.bug(code, "verify", "replay", ["page_table[dead]"], None) is None
        assert known.bug(code, "verify", "replay", ["page_table[live]", "cu_seqlens_q"], None, True) is None  # more
        assert known.bug(code, "verify", "replay", [], None) is None
        assert known.bug(code, "verify", "eager", ["page_table[live]"], None, True) is None  # not a graph phase
    # the bugs without a signature stay at the code they were reproduced on
    err = "RuntimeError at sglang-0.5.12.post1/...flashattention_backend.py:3017: index 2 is out of bounds"
    assert known.bug("0.5.12.post1", "tree_draft_decode", "replay", [], err).rule == "TR-018"
    assert known.bug("0.5.23", "tree_draft_decode", "replay", [], err) is None  # fixed there (#27360)
    assert known.bug("@ /src/sglang", "tree_draft_decode", "replay", [], err) is None
    assert known.bug("0.5.12.post1", "tree_draft_decode", "replay", [], "KeyError: x") is None
    de = ("draft_extend_v2", "eager", ["cache_seqlens_int32", "cu_seqlens_k"], None)
    assert known.bug("0.5.23", *de) is None and known.bug(known.DE_V2_DOUBLE_COUNT, *de).rule == "MD-008"
    assert known.bug("@ /src/sglang", *de) is None  # a K defect on other code may be any K defect


WALL_OURS = {"cache_seqlens_int32": torch.tensor([65, 24], dtype=torch.int32), "cu_seqlens_q": torch.tensor([0, 4, 8]),
             "cu_seqlens_k": torch.tensor([0, 65, 89]), "max_seq_len_q": 4, "max_seq_len_k": 0,
             "page_table": torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 0, 0, 0, 0]], dtype=torch.int32)}


def wall_row(code, theirs_table, ours=WALL_OURS):
    from refspec.conformance.cases import Job
    from refspec.conformance.run import rows_for

    theirs = dict(WALL_OURS, page_table=torch.tensor(theirs_table, dtype=torch.int32))
    job = Job("verify/P16/B3/bs4/wall", "verify", 16, "B3/bs4", True, {}, {("replay", None): ours})
    (row,) = rows_for(code, [job], {job.id: {("replay", None): theirs}})
    return row


@pytest.mark.spec("CG-008")
def test_a_wall_row_names_the_bug_and_cg_008_on_both_page_table_fields_at_a_pin_and_on_a_tree():
    for code in ("0.5.23", known.WALL_FIXED, "@ /src/sglang"):
        row = wall_row(code, [[1, 2, 3, 4], [6, 7, 0, 0]])  # 4 columns < the 5 live pages of row 0
        assert not row.ok and row.bug == "context-wall-page-table"
        # the live field names the defect under CG-008, whichever code; the dead width below the bound is
        # the same table, never read past its live pages (reported, not a second finding)
        assert [(f.field, f.rule) for f in row.findings] == [("page_table[live]", "CG-008")]
        assert [d.documented for d in row.diffs if d.field == "page_table[dead]"] == [compare_mod.UNREAD]
        cell = table([row], code)
        assert "known upstream bug context-wall-page-table (sglang#35985)" in cell and "MD-007" not in cell


def test_a_different_defect_in_the_page_table_is_not_excused_as_the_wall_on_any_code():
    for code in ("0.5.23", "@ /src/sglang"):
        # upstream's table is below the bound AND a page it has is wrong (9 for 3): not only truncated
        row = wall_row(code, [[1, 2, 9, 4], [6, 7, 0, 0]])
        assert not row.ok and row.bug is None and "page_table[live]" in {d.field for d in row.undocumented}
        # a wrong page id within the bound: PA-002, never the wall
        row = wall_row(code, [[1, 2, 3, 4, 5, 0], [6, 8, 0, 0, 0, 0]])
        assert row.bug is None and {f.rule for f in row.findings} == {"PA-002"}
        # a refspec bug variant that over-counts K makes upstream's table look short, but K differs too
        over = dict(WALL_OURS, cache_seqlens_int32=torch.tensor([81, 24], dtype=torch.int32),
                    cu_seqlens_k=torch.tensor([0, 81, 105]))  # 6 pages where upstream's K = 65 reads 5
        row = wall_row(code, [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]], ours=over)
        live = next(d for d in row.diffs if d.field == "page_table[live]")
        assert live.short_table and live.truncated  # the table alone looks like the wall ...
        assert not row.ok and row.bug is None  # ... but cache_seqlens differs: unexplained


def test_tree_rows_are_labelled_with_their_top_k():
    rows = [Row("0.5.23", "tree_draft_decode/k4/P4", "tree_draft_decode", 4, "k4", "replay", 1),
            Row("0.5.23", "tree_verify/k2/P1", "tree_verify", 1, "k2", "eager", None)]
    assert [r.label for r in rows] == ["tree_draft_decode k4 s=1", "tree_verify k2"]


def test_tree_jobs_carry_the_draft_results_and_refspecs_padded_static_batch():
    from refspec.conformance import tree_cases as tc

    jobs = tc.build_jobs(page_sizes=(4,), topks=(2,))
    assert [j.id for j in jobs] == ["tree_verify/k2/P4", "tree_draft_decode/k2/P4"]
    verify, draft = jobs
    assert set(verify.refspec) == {(p, None) for p in ("eager", "capture", "replay")}
    assert set(draft.refspec) == {(p, s) for p in ("eager", "capture", "replay") for s in (0, 1)}
    assert set(verify.refspec[("eager", None)]) == {"prefix", "expand", "tree"}
    assert set(verify.inputs["tree"]) == {"score_list", "token_list", "parents_list", "verified_id", "target_predict"}
    branches = draft.refspec[("eager", 0)]["tree"]  # the branch slots and the tail copies (TR-015)
    assert torch.equal(branches["out_cache_loc"], draft.inputs["eager"]["out_cache_loc"])
    tgt = branches["tail_copy"][:, 0].tolist()
    assert tgt == sorted(tgt) and "tree" not in draft.refspec[("eager", 1)]
    N, B, bs = 4, tc.B, tc.BS
    rep = verify.inputs["replay"]
    assert rep["req_pool_indices"][B:].tolist() == [0] * (bs - B) and rep["seq_lens"][B:].tolist() == [1] * (bs - B)
    L = verify.inputs["eager"]["seq_lens"].tolist()
    live_mask = sum(N * (x + N) for x in L)
    assert rep["custom_mask"].numel() == live_mask + (bs - B) * N * (1 + N)  # padded requests: L = 1
    assert draft.inputs["replay"]["out_cache_loc"].numel() == bs * 2 * tc.S  # [bs, k, S]
    # req_to_token rows carry SGLang 0.5.23's headroom (allocation_sizing.py:96): P = 4 > 1 and top-k 2 reserve
    # 2 * (((4 - 1) + 3 + 4 - 1) // 4 = 2 pages * 4 * 2 = 16 tokens) + 4 - 1 = 35 > 4 + N = 8 columns past context 64
    assert (verify.inputs["context_len"], verify.inputs["req_to_token"].shape[1]) == (64, 64 + 35)


def test_every_default_grid_case_carries_sglangs_headroom():
    """SGLang 0.5.23 (allocation_sizing.py:96-116): 4 + N, and for P > 1 at least 2 * max(num_steps, N) + P - 1
    (top-k 1): N = 4, S = 3 -> P = 1: 8, P = 2: 9, P = 16: 23, P = 64: 71; S = 6 (N = 7) at P = 2: 2 * 7 + 1 = 15."""
    from refspec.conformance import cases

    for P, extra in ((1, 8), (2, 9), (16, 23), (64, 71)):
        (job,) = cases.build_jobs(("decode",), (P,), ("B3/bs4",))
        assert (job.inputs["context_len"], job.inputs["req_to_token"].shape[1]) == (320, 320 + extra), P
    wall = [j for j in cases.edge_jobs(("verify",), (16,)) if j.id.endswith("/wall")]
    assert wall and all(j.inputs["req_to_token"].shape[1] == 64 + 23 for j in wall)
    long = [j for j in cases.edge_jobs(("verify",), (2,)) if j.id.endswith("/S6")]
    assert long and all(j.inputs["req_to_token"].shape[1] == 320 + 15 for j in long)


def test_the_run_applies_a_tree_variant_by_name_and_rejects_an_unknown_one():
    from refspec.conformance.run import _variant
    from refspec.fa3 import tree_metadata as tm

    original = tm.verify_mask_rows
    with _variant("tree-mask-sibling-visible"):
        assert tm.verify_mask_rows is not original
    assert tm.verify_mask_rows is original
    with pytest.raises(KeyError):
        with _variant("no-such-variant"):
            pass


def test_the_tree_part_is_compared_only_where_upstream_built_the_tree():
    from refspec.conformance.cases import Job
    from refspec.conformance.run import rows_for

    expand = md([1, 2], [0, 1, 2], [[40, 41, 42], [40, 42, 41]])  # verify expand: slots (page size 1)
    ref = {("eager", None): tree_result(OURS, expand, {"positions": torch.tensor([5, 6])})}
    job = Job("tree_verify/k2/P4", "tree_verify", 4, "k2", True, {}, ref)
    results = {"tree_verify/k2/P4": {("eager", None): tree_result(OURS, expand)}}  # upstream gave no tree
    (new,) = rows_for("0.5.23", [job], results)
    (old,) = rows_for("0.5.12.post1", [job], results)
    assert [d.field for d in new.undocumented] == ["tree:positions"] and old.ok and not old.diffs


def test_a_dead_width_difference_says_whether_upstream_is_below_the_kernel_bound():
    """OURS: P = 4, K = [5, 9]: rows read 2 and 3 pages, the kernel bound is 3 columns."""
    from refspec.conformance.run import rows_for
    from refspec.conformance.cases import Job

    wider = md([5, 9], [0, 1, 2], [[7, 3, 11, 0, 0, 0], [2, 9, 4, 0, 0, 0]])  # refspec's 6 columns (headroom)
    at_bound = md([5, 9], [0, 1, 2], [[7, 3, 11], [2, 9, 4]])  # upstream's 3 columns: the bound
    (d,) = compare(wider, at_bound, page_size=4)
    assert (d.field, d.width_only, d.short_table) == ("page_table[dead]", True, False)
    below = md([5, 9], [0, 1, 2], [[7, 3], [2, 9]])  # 2 columns: row 1's third page is dropped
    ds = compare(wider, below, page_size=4)
    assert [(x.field, x.short_table) for x in ds] == [("page_table[live]", True), ("page_table[dead]", True)]
    assert ds[1].theirs == "width 2 (< 3 pages, the kernel bound)"
    assert ds[0].truncated  # row 1 lacks its third page only: the two pages upstream has agree
    wrong = compare(wider, md([5, 9], [0, 1, 2], [[7, 3], [2, 8]]), page_size=4)  # ... and row 1's page 1 is wrong
    assert (wrong[0].short_table, wrong[0].truncated) == (True, False)
    assert not compare(wider, md([5, 9], [0, 1, 2], [[7, 3, 11], [2, 9, 5]]), page_size=4)[0].truncated  # in bound
    content = md([5, 9], [0, 1, 2], [[7, 3, 5], [2, 9, 4]])  # row 0's dead column 2 differs
    (d,) = compare(wider, content, page_size=4)
    assert (d.width_only, d.short_table, d.ours) == (False, False, "width 6, rows differing [0]")
    # through the run: at the bound documented (graph-table-headroom), below it the known bug with CG-008
    for theirs, doc, bug in ((at_bound, "graph-table-headroom", None), (below, None, "context-wall-page-table")):
        job = Job("verify/P4/B3/bs4", "verify", 4, "B3/bs4", True, {}, {("capture", None): wider})
        (row,) = rows_for("0.5.12.post1", [job], {job.id: {("capture", None): theirs}})
        assert row.ok == (bug is None) and row.bug == bug
        assert [x.documented for x in row.diffs if x.field == "page_table[dead]"] == [doc or compare_mod.UNREAD]
        assert {f.rule for f in row.findings} == (set() if bug is None else {"CG-008"})


def test_an_upstream_index_error_past_a_tables_width_names_cg_008_otherwise_the_modes_rule():
    from refspec.conformance import rules

    err = "IndexError at sglang/x.py:9: index 320 is out of bounds for dimension 1 with size 320"
    stmt = "page_indices = self.req_to_token[req_pool_indices[:, None], strided[:max_seq_pages]]"
    assert rules.error_rule("draft_extend_v2", "replay", err, stmt)[0] == "CG-008"
    assert rules.error_rule("draft_extend_v2", "eager", err, stmt)[0] == "CG-008"
    assert rules.error_rule("tree_draft_decode", "eager", err, "x = self.page_table[0, 5]")[0] == "CG-008"
    rid, note = rules.error_rule("draft_extend_v2", "replay", err, "y = self.other[0, 320]")  # another tensor
    assert rid == "CG-004" and "upstream exception" in note and "mode's rule" in note
    assert rules.error_rule("verify", "replay", "KeyError at sglang/x.py:9: 'x'", stmt)[0] == "CG-002"
    assert rules.error_rule("verify", "eager", err.replace("dimension 1", "dimension 0"), stmt)[0] == "MD-011"


#: 0.5.16's eager DRAFT_EXTEND_V2 q metadata as a reviewer planted it back (sglang#31364's half revert)
DE_V2_BRANCH = """
class FlashAttentionBackend:
    def init_forward_metadata(self, forward_batch):
        metadata = FlashAttentionMetadata()
        if forward_batch.forward_mode.is_draft_extend_v2():
            metadata.cache_seqlens_int32 = forward_batch.seq_lens.to(torch.int32)
            if any(forward_batch.extend_prefix_lens_cpu):
                metadata.max_seq_len_q = max(forward_batch.extend_seq_lens_cpu)
            x = helper(forward_batch)
            self.forward_metadata_spec_decode_expand.page_table = x
"""


def test_an_upstream_exception_takes_the_rule_of_the_field_its_statement_computes(tmp_path):
    """A TypeError in the ``if any(extend_prefix_lens_cpu)`` test that guards ``max_seq_len_q``
    names PA-010 (the field's rule), not the mode's K rule MD-008 that nothing compared; a
    statement that computes no compared field keeps the mode's rule."""
    from refspec.conformance import rules

    src = tmp_path / "fa.py"
    src.write_text(DE_V2_BRANCH)
    line = {k: next(i for i, x in enumerate(DE_V2_BRANCH.splitlines(), 1) if k in x)
            for k in ("if any(", "cache_seqlens_int32 =", "x = helper", "expand.page_table =", "def init")}
    assert rules.computed_field(str(src), line["if any("]) == "max_seq_len_q"
    assert rules.computed_field(str(src), line["cache_seqlens_int32 ="]) == "cache_seqlens_int32"
    assert rules.computed_field(str(src), line["x = helper"]) is None
    assert rules.computed_field(str(src), line["def init"]) is None
    assert rules.computed_field(str(src), line["expand.page_table ="], "tree_draft_decode") == "expand:page_table[live]"
    assert rules.computed_field(str(tmp_path / "missing.py"), 3) is None
    err = "TypeError at sglang/x.py:7: 'NoneType' object is not iterable"
    rid, note = rules.error_rule("draft_extend_v2", "eager", err, "", "max_seq_len_q")
    assert rid == "PA-010" and note == "upstream exception in the statement that computes max_seq_len_q"
    assert rules.error_rule("draft_extend_v2", "eager", err, "", None)[0] == "MD-008"  # no field: the mode's rule
    assert rules.error_rule("tree_draft_decode", "eager", err, "", "expand:page_table[live]")[0] == "TR-014"


def test_the_report_links_absolute_under_a_base_url_else_the_repository_blob_else_says_relative(monkeypatch):
    from types import SimpleNamespace as NS

    from refspec.conformance import report
    from refspec.conformance.report import find, markdown

    row = Row("0.5.23", "verify/P4/a", "verify", 4, "a", "replay", None, [Diff("cu_seqlens_q", "[0, 4]", "[0, 1]")])
    find(row)
    out = NS(rows=[row])
    md = markdown(out, base_url="https://example.org/refspec/blob/v1/")
    assert "[CG-002](https://example.org/refspec/blob/v1/docs/spec/graphs.md#cg-002)" in md
    assert "under https://example.org/refspec/blob/v1 (--base-url" in md.splitlines()[-1]
    monkeypatch.setattr(report, "repository_url", lambda: "https://github.com/refspec/refspec")
    md = markdown(out)
    assert "[CG-002](https://github.com/refspec/refspec/blob/main/docs/spec/graphs.md#cg-002)" in md
    monkeypatch.setattr(report, "repository_url", lambda: "")
    md = markdown(out)
    assert "[CG-002](docs/spec/graphs.md#cg-002)" in md and "repository-relative" in md.splitlines()[-1]


def test_the_repository_url_is_the_one_pyproject_declares():
    import tomllib

    from refspec.conformance.report import repository_url

    declared = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["urls"]
    assert repository_url() == declared["Repository"]
