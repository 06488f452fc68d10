"""What the documented-difference guards (``refspec.conformance.known``) must refuse, and what they let through.

The mutation run (``make mutation``, benchmarks/mutation.py) mutates known.py against this file
and test_conformance.py: each test states one entry the ``Known`` guard must refuse (a kernel-read
field, a guard wider than its reason: a phase set that mixes capture and replay, a citation on a
field it does not excuse, the verify tree) or let through, that ``match`` answers only for its
pin / mode / phase / field, that ``Bug.matches`` explains a failing row only on its mode, phase
and fields (or error) and, unless the bug has a signature (``short_table``), only on its code, and
the exact links and sources a report prints.  No upstream.
"""

from __future__ import annotations

import re

import pytest

from refspec.conformance import known
from refspec.conformance.known import BUGS, FA, Bug, Known, bug, link, match, patched, source

T = ("tree_draft_decode",)


def entry(fields, phases=("replay",), modes=("decode",), unread=""):
    return Known("k1", tuple(fields), modes, tuple(phases), ("0.5.23",), (), "", "", unread=unread)


def refused(what):
    return pytest.raises(ValueError, match=what)


# ---- the Known guard ----
def test_an_unread_field_is_documentable_in_any_phase():
    for phases in (("eager",), ("capture",), ("replay",), ("capture", "replay")):
        for f in ("max_seq_len_k", "page_table[dead]", "prefix:page_table[dead]", "expand:max_seq_len_k"):
            assert entry([f], phases).fields == (f,)


@pytest.mark.parametrize("field", ["cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "max_seq_len_q",
                                   "page_table[live]", "prefix:cu_seqlens_q", "expand:page_table[live]"])
def test_a_kernel_read_field_is_refused_outside_capture(field):
    for phases in (("eager",), ("replay",), ("replay-staged",), ("eager", "replay")):
        with refused(rf"^k1: {re.escape(field)} is read by the kernel; a difference there is a bug, never a documented "
                     r"difference \(only its capture-time contents may differ\)$"):
            entry([field], phases)


@pytest.mark.parametrize("field", ["cache_seqlens_int32", "cu_seqlens_k", "page_table[live]",
                                   "prefix:cache_seqlens_int32", "expand:cu_seqlens_k"])
def test_capture_contents_of_a_rewritten_buffer_are_documentable_only_at_capture_alone(field):
    assert entry([field], ("capture",)).phases == ("capture",)
    # a phase set that mixes capture with a phase that runs the kernel is wider than the reason
    for phases in (("capture", "replay"), ("replay", "capture"), ("capture", "eager"), ("capture", "capture")):
        with refused(re.escape(f"{field} is read by the kernel")):
            entry([field], phases)


@pytest.mark.parametrize("field", ["cu_seqlens_q", "max_seq_len_q", "expand:cu_seqlens_q"])
def test_a_kernel_field_replay_does_not_rewrite_is_refused_even_at_capture(field):
    with refused(re.escape(f"{field} is read by the kernel")):
        entry([field], ("capture",))


def test_a_citation_excuses_cu_seqlens_k_only():
    assert entry(["cu_seqlens_k"], ("eager", "replay"), T, unread="flash_api.cpp:929").unread
    assert entry(["expand:cu_seqlens_k"], ("replay",), T, unread="x").fields == ("expand:cu_seqlens_k",)
    with refused("expand:cu_seqlens_k is read by the kernel"):  # no citation
        entry(["expand:cu_seqlens_k"], ("replay",), T)
    for f in ("cache_seqlens_int32", "cu_seqlens_q", "max_seq_len_q", "page_table[live]", "prefix:page_table[live]"):
        with refused(re.escape(f"{f} is read by the kernel")):
            entry([f], ("replay",), T, unread="a citation")


def test_every_field_of_an_entry_is_guarded_not_only_the_first():
    with refused("cu_seqlens_q is read by the kernel"):
        entry(["max_seq_len_k", "cu_seqlens_q"])
    with refused("tree:positions is the verify tree itself"):
        entry(["max_seq_len_k", "tree:positions"])


@pytest.mark.parametrize("phases", [("eager",), ("capture",), ("replay",)])
def test_a_tree_field_is_never_documentable(phases):
    for f in ("tree:custom_mask", "tree:cu_seqlens_k", "tree:max_seq_len_k"):
        with refused(rf"^k1: {re.escape(f)} is the verify tree itself; a difference there is a bug$"):
            entry([f], phases, ("tree_verify",), unread="a citation")


# ---- match ----
def test_match_answers_only_for_its_pin_mode_phase_and_field():
    k = match("0.5.23", "decode", "replay", "max_seq_len_k")
    assert k.key == "replay-max-k-context"
    assert match("0.5.23", "decode", "replay-staged", "max_seq_len_k").key == "replay-max-k-context"
    assert match("0.5.12.post1", "decode", "replay", "max_seq_len_k").key == "replay-max-k-mirror"  # another pin
    assert match("0.5.23", "verify", "replay", "max_seq_len_k") is None  # a mode it does not list
    assert match("0.5.23", "decode", "eager", "max_seq_len_k") is None  # a phase it does not list
    assert match("0.5.23", "decode", "replay", "max_seq_len_q") is None  # a field it does not list
    assert match("0.5.24", "decode", "replay", "max_seq_len_k") is None  # a pin it does not list
    assert match(known.WALL_FIXED, "decode", "replay", "max_seq_len_k") is None  # patched code is its own pin
    assert match("0.5.23", "decode", "replay", "prefix:max_seq_len_k") is None  # the part is part of the field


def test_match_returns_the_entry_that_lists_the_field_among_several():
    k = match("0.5.12.post1", "verify", "capture", "cu_seqlens_k")
    assert k.key == "capture-contents-legacy" and k.fields == ("cache_seqlens_int32", "cu_seqlens_k")
    assert match("0.5.12.post1", "verify", "capture", "cache_seqlens_int32") is k
    assert match("0.5.12.post1", "verify", "replay", "cu_seqlens_k") is None  # capture only
    assert match("0.5.23", "verify", "capture", "cu_seqlens_k") is None  # legacy only
    # later entries are reached too: the last entry of the table
    assert match("0.5.12.post1", "tree_draft_decode", "eager", "expand:cu_seqlens_k").key == "tree-draft-expand-cu-k"


def test_match_finds_the_first_entry_when_two_could_explain_a_field():
    # tree-prefix-table-width and no other entry lists prefix:page_table[dead]: every (mode, phase) of it
    for mode in ("tree_verify", "tree_draft_decode"):
        for phase in ("capture", "replay"):
            assert match("0.5.23", mode, phase, "prefix:page_table[dead]").key == "tree-prefix-table-width"
        assert match("0.5.23", mode, "eager", "prefix:page_table[dead]") is None


# ---- Bug.matches and bug ----
B = Bug("b1", "XX-001", (), ("0.5.23",), ("verify",), ("replay",), ("page_table[live]", "page_table[dead]"),
        "out of bounds", (), "open", "")
NO_ERROR = Bug("b2", "XX-002", (), ("0.5.23",), ("verify",), ("replay",), ("page_table[live]",), "", (), "open", "")


def test_a_bug_explains_a_row_whose_undocumented_fields_are_its_fields():
    assert B.matches("0.5.23", "verify", "replay", ["page_table[live]"], None) is True
    assert B.matches("0.5.23", "verify", "replay", ["page_table[dead]", "page_table[live]"], None) is True  # all
    assert B.matches("0.5.23", "verify", "replay", ["page_table[live]", "cu_seqlens_q"], None) is False  # one more
    assert B.matches("0.5.23", "verify", "replay", [], None) is False  # nothing failed: not this bug


def test_a_bug_explains_only_rows_of_its_code_mode_and_phase():
    ok = (["page_table[live]"], None)
    assert B.matches("0.5.12.post1", "verify", "replay", *ok) is False
    assert B.matches(patched("0.5.23", "fix"), "verify", "replay", *ok) is False
    assert B.matches("0.5.23", "decode", "replay", *ok) is False
    assert B.matches("0.5.23", "verify", "eager", *ok) is False
    err = (["page_table[live]"], "IndexError: index 2 is out of bounds")
    assert B.matches("0.5.12.post1", "verify", "replay", *err) is False
    assert B.matches("0.5.23", "decode", "replay", *err) is False
    assert B.matches("0.5.23", "verify", "eager", *err) is False


def test_an_upstream_error_is_a_bug_only_when_it_carries_the_bugs_error_text():
    assert B.matches("0.5.23", "verify", "replay", [], "RuntimeError: index 2 is out of bounds for dim 1") is True
    assert B.matches("0.5.23", "verify", "replay", ["page_table[live]"], "KeyError: 'x'") is False  # fields unused
    # a bug with no error text explains no error (the empty string is in every message)
    assert NO_ERROR.matches("0.5.23", "verify", "replay", ["page_table[live]"], "RuntimeError: x") is False
    assert NO_ERROR.matches("0.5.23", "verify", "replay", [], "") is False
    assert NO_ERROR.matches("0.5.23", "verify", "replay", ["page_table[live]"], None) is True


def test_bug_returns_the_first_matching_bug_or_none():
    wall = ("verify", "replay", ["page_table[dead]", "page_table[live]"], None, True)  # below the kernel bound
    assert bug("0.5.23", *wall) is BUGS[0]
    assert bug("0.5.23", *wall[:4]) is None  # the same fields with upstream's table at or above the bound
    assert bug(known.DE_V2_DOUBLE_COUNT, "draft_extend_v2", "eager", ["max_seq_len_k"], None) is BUGS[2]
    assert bug(known.DE_V2_DOUBLE_COUNT, "draft_extend_v2", "replay", ["page_table[live]"], None, True) is BUGS[0]
    assert bug(known.DE_V2_DOUBLE_COUNT, "draft_extend_v2", "replay", ["page_table[dead]"], None) is BUGS[2]
    assert bug("0.5.23", "verify", "eager", ["page_table[dead]"], None, True) is None


# ---- patched, link, source ----
def test_patched_code_is_the_pin_and_its_patches_joined_by_plus():
    assert patched("0.5.23") == "0.5.23"
    assert patched("0.5.23", "a") == "0.5.23+a"
    assert patched("0.5.23", "a", "b") == "0.5.23+a+b"
    assert known.WALL_FIXED == "0.5.23+pr35985-page-table-width"


def test_a_link_is_the_file_line_at_the_release_tag():
    assert link("0.5.12.post1", "python/x/y.py", 7) == "https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/x/y.py#L7"


def test_a_source_is_the_builders_file_name_line_and_link():
    assert source("0.5.23", "decode", "eager") == (
        f"flashattention_backend.py:995 https://github.com/sgl-project/sglang/blob/v0.5.23/{FA}#L995")
    assert source("0.5.12.post1", "decode", "eager", "max_seq_len_k") == (
        f"flashattention_backend.py:352 https://github.com/sgl-project/sglang/blob/v0.5.12.post1/{FA}#L352")
    assert source("0.5.23", "tree_verify", "eager", "tree:positions") == (
        "eagle_utils.py:138 https://github.com/sgl-project/sglang/blob/v0.5.23/"
        "python/sglang/srt/speculative/eagle_utils.py#L138")
    # a tree field's own source wins over the mode's, at either pin
    assert source("0.5.12.post1", "tree_verify", "replay", "tree:tail_copy").startswith("eagle_worker_common.py:65 ")
    with pytest.raises(KeyError):
        source("0.5.23", "no_such_mode", "eager")


# ---- the kernel bound (CG-008): a dead-width difference is documented only at or above it ----
def dead(width_only=True, short=False):
    from refspec.conformance.compare import Diff
    return Diff("page_table[dead]", "width 6, rows differing []", "width 4", width_only=width_only, short_table=short)


def test_a_table_width_entry_documents_only_a_width_difference_at_or_above_the_bound():
    for pin in ("0.5.23", "0.5.12.post1"):
        for mode, phase in (("verify", "capture"), ("draft_decode", "replay"), ("draft_extend_v2", "replay-staged")):
            if (mode, phase) == ("draft_extend_v2", "replay-staged") and pin != "0.5.23":
                continue
            assert match(pin, mode, phase, "page_table[dead]", dead()).key == "graph-table-headroom"
            assert match(pin, mode, phase, "page_table[dead]", dead(short=True)) is None  # a live page dropped
    assert match("0.5.12.post1", "verify", "replay", "page_table[dead]", dead(width_only=False)) is None  # contents
    assert match("0.5.12.post1", "verify", "replay", "page_table[dead]") is None  # no diff: no width to judge
    assert match("0.5.23", "verify", "eager", "page_table[dead]", dead()) is None  # graph buffers only
    # below the bound no entry documents it, not even one that lists the field without at_bound
    assert match("0.5.23", "verify", "replay", "page_table[dead]", dead(width_only=False)).key == "replay-dead-columns"
    assert match("0.5.23", "verify", "replay", "page_table[dead]", dead(width_only=False, short=True)) is None


def test_at_bound_is_refused_on_a_field_without_a_width():
    with refused("at_bound documents a page-table width"):
        Known("k1", ("max_seq_len_k",), ("decode",), ("replay",), ("0.5.23",), (), "", "", at_bound=True)
    assert Known("k1", ("page_table[dead]",), ("decode",), ("replay",), ("0.5.23",), (), "", "", at_bound=True)


def test_the_context_wall_bug_needs_a_table_below_the_kernel_bound():
    wall = next(b for b in BUGS if b.key == "context-wall-page-table")
    assert wall.short_table and wall.rule == "CG-008" and wall.also == ("PA-003",)
    assert wall.matches("0.5.23", "verify", "replay", ["page_table[live]"], None, True) is True
    assert wall.matches("0.5.23", "verify", "replay", ["page_table[live]"], None) is False
    assert wall.matches("0.5.23", "decode", "capture", ["page_table[dead]"], None) is False
    assert B.matches("0.5.23", "verify", "replay", ["page_table[live]"], None, True) is True  # short not required


# ---- a signature bug is recognised on any code; the others only at their pins ----
SIG = Bug("b3", "XX-003", (), ("0.5.23",), ("verify",), ("replay",), ("page_table[live]",), "", (), "open", "",
          short_table=True, issue=123)


def test_a_bug_with_a_signature_matches_on_any_code_a_bug_without_one_only_on_its_pins():
    assert SIG.signature and not B.signature and not NO_ERROR.signature
    for code in ("0.5.23", "0.5.19", "@ /src/sglang", "sglang-0.5.20-py3-none-any.whl", patched("0.5.23", "fix")):
        assert SIG.matches(code, "verify", "replay", ["page_table[live]"], None, True) is True, code
        assert SIG.matches(code, "verify", "replay", ["page_table[live]"], None) is False  # the condition, anywhere
        assert SIG.matches(code, "decode", "replay", ["page_table[live]"], None, True) is False  # its modes
        assert SIG.matches(code, "verify", "capture", ["page_table[live]"], None, True) is False  # its phases
        assert SIG.matches(code, "verify", "replay", ["page_table[live]", "cu_seqlens_k"], None, True) is False
        assert NO_ERROR.matches(code, "verify", "replay", ["page_table[live]"], None, True) is (code == "0.5.23")


def test_the_only_signature_bug_is_the_context_wall():
    assert [b.key for b in BUGS if b.signature] == ["context-wall-page-table"]


def test_a_bug_names_its_sglang_pr_and_a_report_marker():
    wall = known.by_key("context-wall-page-table")
    assert (wall.ref, wall.url) == ("sglang#35985", "https://github.com/sgl-project/sglang/pull/35985")
    assert wall.marker == "known upstream bug context-wall-page-table (sglang#35985)"
    assert {b.key: b.issue for b in BUGS} == {
        "context-wall-page-table": 35985, "draft-expand-unsliced-scatter": 27360, "draft-extend-v2-double-count": 26512,
        "mla-verify-expand-paged-view": None,  # found by this comparison: no upstream PR or issue known
        "mla-pool-no-move-kv-cache": 26982, "mla-store-writes-slot-0": 36003}
    found = known.by_key("mla-verify-expand-paged-view")
    assert found.ref == "" and found.url == "" and found.marker == "known upstream bug mla-verify-expand-paged-view"
    assert NO_ERROR.marker == "known upstream bug b2" and NO_ERROR.ref == "" and NO_ERROR.url == ""
    with pytest.raises(KeyError, match="no known upstream bug 'nope'"):
        known.by_key("nope")


def test_below_bound_needs_a_short_table_and_live_pages_that_only_lack_columns():
    from refspec.conformance.compare import Diff

    live = lambda short, cut: Diff("page_table[live]", "", "", short_table=short, truncated=cut)
    assert known.below_bound([live(True, True), dead(short=True)]) is True
    assert known.below_bound([dead(short=True)]) is True  # the width alone below the bound
    assert known.below_bound([live(True, False), dead(short=True)]) is False  # a page it has is wrong too
    assert known.below_bound([live(False, False)]) is False and known.below_bound([]) is False
    assert known.below_bound([live(False, False), dead(short=True)]) is False
