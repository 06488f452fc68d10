"""What the conformance comparison (``refspec.conformance.compare``) must refuse, and what it must let through.

The mutation run (``make mutation``, benchmarks/mutation.py) mutates the comparison against this
file and test_conformance.py: each test states one difference ``compare`` / ``compare_parts``
must report (a field missing on one side, a shorter tensor, a live page-table row that differs, a
width difference, dead columns, a tree field only one side has, a part missing), with the exact
printed values, or one agreement it must not report.  Hand-built dicts, no upstream.

Worked batch: P = 4, K = [5, 9] (rows read 2 and 3 pages), a table 4 columns wide.
"""

from __future__ import annotations

import torch

from refspec.conformance.compare import MISSING, Diff, _show, base_field, compare, compare_parts, live_pages

i32 = lambda *x: torch.tensor(x, dtype=torch.int32)


def md(K=(5, 9), cu_q=(0, 1, 2), rows=((7, 3, 11, 0), (2, 9, 4, 0)), max_q=1, max_k=16):
    cu_k = [0]
    for k in K:
        cu_k.append(cu_k[-1] + k)
    return {"cache_seqlens_int32": i32(*K), "cu_seqlens_q": i32(*cu_q), "cu_seqlens_k": i32(*cu_k),
            "max_seq_len_q": max_q, "max_seq_len_k": max_k,
            "page_table": torch.tensor(rows, dtype=torch.int32)}


def diffs(ours, theirs, P=4):
    return [(d.field, d.ours, d.theirs, d.short_table) for d in compare(ours, theirs, P)]


# ---- helpers ----
def test_base_field_drops_only_the_part():
    assert base_field("expand:cu_seqlens_k") == "cu_seqlens_k"
    assert base_field("cu_seqlens_k") == "cu_seqlens_k"
    assert base_field("a:b:c") == "c"  # the last colon


def test_live_pages_is_the_ceiling_in_pages():
    assert [live_pages(k, 4) for k in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert live_pages(torch.tensor(5), 4) == 2 and isinstance(live_pages(torch.tensor(5), 4), int)
    assert [live_pages(k, 1) for k in (0, 3)] == [0, 3]


def test_a_diff_is_undocumented_and_not_short_by_default():
    d = Diff("f", "a", "b")
    assert d.documented is None and d.short_table is False


def test_a_printed_value_is_whole_up_to_60_characters_then_cut_to_57_and_an_ellipsis():
    sixty = [1] * 20  # "[1, 1, ..., 1]": 3 * 20 = 60 characters
    assert _show(torch.tensor(sixty)) == str(sixty)
    sixty_one = [1] * 19 + [10]
    assert _show(torch.tensor(sixty_one)) == str(sixty_one)[:57] + "..."
    assert _show(7) == "7" and _show("x") == "x"
    # compare prints upstream's vector cut to the batch, then shortened
    ours = md(K=(1,) * 20, cu_q=range(21), rows=[(7, 0)] * 20)
    (d,) = compare(ours, dict(ours, cache_seqlens_int32=i32(*sixty_one, 5, 5)), 4)
    assert (d.field, d.ours, d.theirs) == ("cache_seqlens_int32", str(sixty), str(sixty_one)[:57] + "...")


# ---- vectors and scalars ----
def test_identical_fields_and_longer_upstream_buffers_agree():
    assert compare(md(), md(), 4) == []
    longer = md(K=(5, 9, 3), cu_q=(0, 1, 2, 9), rows=((7, 3, 11, 0), (2, 9, 4, 0), (1, 1, 1, 1)))
    assert compare(md(), longer, 4) == []


def test_a_vector_missing_on_either_side_differs_and_says_which():
    for f in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k"):
        theirs = {k: v for k, v in md().items() if k != f}
        got = diffs(md(), theirs)
        assert got[0][:3] == (f, _show(md()[f]), MISSING), f
    ours = dict(md(), cu_seqlens_q=None)
    assert diffs(ours, md()) == [("cu_seqlens_q", MISSING, "[0, 1, 2]", False)]
    assert diffs(dict(ours), dict(ours)) == [("cu_seqlens_q", MISSING, MISSING, False)]  # both missing: still refused


def test_a_shorter_vector_on_either_side_differs_and_prints_the_batch_cut():
    assert diffs(md(), dict(md(), cu_seqlens_k=i32(0, 5))) == [("cu_seqlens_k", "[0, 5, 14]", "[0, 5]", False)]
    assert diffs(dict(md(), cu_seqlens_k=i32(0, 5)), md()) == [("cu_seqlens_k", "[0, 5]", "[0, 5, 14]", False)]
    # upstream's longer buffer that differs inside the batch prints only the batch's entries
    assert diffs(md(), dict(md(), cu_seqlens_q=i32(0, 2, 3, 4))) == [("cu_seqlens_q", "[0, 1, 2]", "[0, 2, 3]", False)]
    # the live region is refspec's K: upstream's other K is a difference of that field alone
    assert diffs(md(), dict(md(), cache_seqlens_int32=i32(5, 8, 1))) == [
        ("cache_seqlens_int32", "[5, 9]", "[5, 8]", False)]


def test_entries_past_the_batch_are_cut_on_our_side_too():
    # a padded buffer on refspec's side: only cache_seqlens' bs and bs + 1 entries are the batch
    ours = dict(md(), cu_seqlens_q=i32(0, 1, 2, 2), cu_seqlens_k=i32(0, 5, 14, 14))
    assert compare(ours, md(), 4) == []
    assert diffs(ours, dict(md(), cu_seqlens_q=i32(0, 1, 3))) == [("cu_seqlens_q", "[0, 1, 2]", "[0, 1, 3]", False)]


def test_the_last_entry_of_each_vector_is_compared():
    assert [d.field for d in compare(md(), dict(md(), cu_seqlens_q=i32(0, 1, 3)), 4)] == ["cu_seqlens_q"]
    assert [d.field for d in compare(md(), dict(md(), cu_seqlens_k=i32(0, 5, 15)), 4)] == ["cu_seqlens_k"]
    assert [d.field for d in compare(md(), dict(md(), cache_seqlens_int32=i32(5, 10)), 4)] == ["cache_seqlens_int32"]


def test_a_scalar_that_differs_or_is_missing_on_either_side_is_named():
    assert diffs(md(), md(max_q=2)) == [("max_seq_len_q", "1", "2", False)]
    assert diffs(md(), md(max_k=17)) == [("max_seq_len_k", "16", "17", False)]
    for f in ("max_seq_len_q", "max_seq_len_k"):
        v = str(md()[f])
        assert diffs(md(), {k: x for k, x in md().items() if k != f}) == [(f, v, MISSING, False)]
        assert diffs(md(), dict(md(), **{f: None})) == [(f, v, MISSING, False)]
        assert diffs({k: x for k, x in md().items() if k != f}, md()) == [(f, MISSING, v, False)]
        assert diffs(dict(md(), **{f: None}), md()) == [(f, MISSING, v, False)]
        # neither side returned it: still refused, never compared as equal (was skipped when both lacked the key)
        neither = {k: x for k, x in md().items() if k != f}
        assert diffs(neither, neither) == [(f, MISSING, MISSING, False)]
        assert diffs(dict(md(), **{f: None}), neither) == [(f, MISSING, MISSING, False)]


# ---- the page table ----
def test_a_page_table_missing_on_either_side_is_a_live_difference_that_names_the_other_width():
    no_pt = {k: v for k, v in md().items() if k != "page_table"}
    assert diffs(md(), no_pt) == [("page_table[live]", "width 4", MISSING, False)]
    assert diffs(no_pt, md(rows=((7, 3, 11), (2, 9, 4)))) == [("page_table[live]", MISSING, "width 3", False)]
    assert diffs(md(), dict(md(), page_table=None)) == [("page_table[live]", "width 4", MISSING, False)]
    # the earlier fields' differences are kept beside it
    assert [d[0] for d in diffs(md(), dict(no_pt, max_seq_len_q=3))] == ["max_seq_len_q", "page_table[live]"]


def test_a_live_row_that_differs_is_reported_with_its_live_pages_only():
    theirs = md(rows=((7, 3, 11, 0), (2, 9, 5, 0)))  # row 1's third live page
    assert diffs(md(), theirs) == [("page_table[live]", "row 1: [2, 9, 4]", "row 1: [2, 9, 5]", False)]
    theirs = md(rows=((7, 4, 11, 0), (2, 9, 4, 0)))  # row 0's second (last live) page
    assert diffs(md(), theirs) == [("page_table[live]", "row 0: [7, 3]", "row 0: [7, 4]", False)]


def test_the_first_differing_live_row_is_the_one_printed():
    theirs = md(rows=((8, 3, 11, 0), (2, 8, 4, 0)))
    assert diffs(md(), theirs) == [("page_table[live]", "row 0: [7, 3]", "row 0: [8, 3]", False)]


def test_a_missing_upstream_row_is_a_live_difference_printed_missing():
    theirs = md(K=(5,), cu_q=(0, 1), rows=((7, 3, 11, 0),))
    assert diffs(md(), dict(md(), page_table=theirs["page_table"])) == [
        ("page_table[live]", "row 1: [2, 9, 4]", "row 1: missing", False)]


def test_an_upstream_table_narrower_than_the_live_pages_is_a_short_live_difference():
    theirs = md(rows=((7, 3), (2, 9)))  # row 1 reads 3 pages
    assert diffs(md(), theirs) == [
        ("page_table[live]", "row 1: [2, 9, 4]", "row 1: [2, 9] (2 columns < 3 live pages)", True),
        # the common columns agree; the width is below the bound
        ("page_table[dead]", "width 4, rows differing []", "width 2 (< 3 pages, the kernel bound)", True)]


def test_our_table_narrower_than_the_live_pages_differs():
    ours = md(rows=((7, 3), (2, 9)))
    assert [d[0] for d in diffs(ours, md())] == ["page_table[live]", "page_table[dead]"]


def test_a_table_exactly_as_wide_as_the_live_pages_agrees_live_and_differs_in_width_only():
    narrow = md(rows=((7, 3, 11), (2, 9, 4)))
    assert diffs(md(), narrow) == [("page_table[dead]", "width 4, rows differing []", "width 3", False)]
    assert diffs(narrow, narrow) == []
    # a live row that differs in an exactly-wide table is not short
    other = md(rows=((7, 3, 11), (2, 9, 5)))
    assert diffs(narrow, other) == [("page_table[live]", "row 1: [2, 9, 4]", "row 1: [2, 9, 5]", False)]


def test_dead_columns_that_differ_name_their_rows_at_the_same_width():
    theirs = md(rows=((7, 3, 12, 1), (2, 9, 4, 0)))  # row 0: columns 2 and 3 are dead
    assert diffs(md(), theirs) == [("page_table[dead]", "width 4, rows differing [0]", "width 4", False)]
    theirs = md(rows=((7, 3, 11, 0), (2, 9, 4, 1)))  # row 1: column 3, the last
    assert diffs(md(), theirs) == [("page_table[dead]", "width 4, rows differing [1]", "width 4", False)]


def test_a_wider_upstream_table_with_zero_dead_columns_still_differs_in_width():
    theirs = md(rows=((7, 3, 11, 0, 0), (2, 9, 4, 0, 0)))
    assert diffs(md(), theirs) == [("page_table[dead]", "width 4, rows differing []", "width 5", False)]


def test_a_padded_row_of_zero_keys_reads_no_page():
    ours = md(K=(5, 0), cu_q=(0, 1, 1), rows=((7, 3, 0, 0), (0, 0, 0, 0)))
    theirs = dict(ours, page_table=torch.tensor([[7, 3, 0, 0], [9, 9, 9, 9]], dtype=torch.int32))
    assert diffs(ours, theirs) == [("page_table[dead]", "width 4, rows differing [1]", "width 4", False)]


def test_the_page_size_sets_the_live_region():
    # at P = 8 row 0 (K = 5) reads 1 page and row 1 (K = 9) 2: column 2 of row 1 becomes dead
    theirs = md(rows=((7, 3, 11, 0), (2, 9, 5, 0)))
    assert diffs(md(), theirs, P=8) == [("page_table[dead]", "width 4, rows differing [1]", "width 4", False)]
    theirs = md(rows=((7, 4, 11, 0), (2, 9, 4, 0)))
    assert diffs(md(), theirs, P=8) == [("page_table[dead]", "width 4, rows differing [0]", "width 4", False)]


# ---- top-k > 1: the parts and the tree ----
def parts(prefix=None, expand=None, tree=None):
    out = {"prefix": md() if prefix is None else prefix, "expand": md() if expand is None else expand}
    if tree is not None:
        out["tree"] = tree
    return out


def pdiffs(ours, theirs, P=4, EP=1):
    return [(d.field, d.ours, d.theirs, d.short_table) for d in compare_parts(ours, theirs, P, EP)]


def test_parts_without_a_tree_on_either_side_agree():
    assert compare_parts(parts(), parts(), 4, 4) == []
    assert compare_parts({"prefix": md(), "expand": md()}, {"prefix": md(), "expand": md()}, 4, 4) == []


def test_a_missing_part_is_named_and_the_other_part_is_still_compared():
    theirs = {"expand": md(max_q=3)}  # no prefix part
    assert pdiffs(parts(), theirs, EP=4) == [("prefix:*", "present", MISSING, False),
                                            ("expand:max_seq_len_q", "1", "3", False)]
    theirs = {"prefix": md(max_q=3), "expand": None}
    assert pdiffs(parts(), theirs, EP=4) == [("prefix:max_seq_len_q", "1", "3", False),
                                            ("expand:*", "present", MISSING, False)]


def test_a_part_difference_keeps_its_values_and_short_table_flag():
    theirs = parts(expand=md(rows=((7, 3), (2, 9))))
    got = pdiffs(parts(), theirs, EP=4)
    assert got == [("expand:page_table[live]", "row 1: [2, 9, 4]", "row 1: [2, 9] (2 columns < 3 live pages)", True),
                   ("expand:page_table[dead]", "width 4, rows differing []",
                    "width 2 (< 3 pages, the kernel bound)", True)]
    assert all(d.documented is None for d in compare_parts(parts(), theirs, 4, 4))


def test_each_part_uses_its_own_page_size():
    theirs = parts(prefix=md(rows=((7, 3, 11, 0), (2, 9, 5, 0))))  # prefix row 1 page 2: live at 4, dead at 8
    assert [d[0] for d in pdiffs(parts(), theirs, P=4, EP=8)] == ["prefix:page_table[live]"]
    assert [d[0] for d in pdiffs(parts(), theirs, P=8, EP=4)] == ["prefix:page_table[dead]"]
    theirs = parts(expand=md(rows=((7, 3, 11, 0), (2, 9, 5, 0))))
    assert [d[0] for d in pdiffs(parts(), theirs, P=8, EP=4)] == ["expand:page_table[live]"]
    assert [d[0] for d in pdiffs(parts(), theirs, P=4, EP=8)] == ["expand:page_table[dead]"]


def test_a_tree_field_only_one_side_has_differs_with_missing_on_the_other():
    t = {"positions": torch.tensor([5, 6])}
    assert pdiffs(parts(tree=t), parts(), EP=4) == [("tree:positions", "[5, 6]", MISSING, False)]
    assert pdiffs(parts(), parts(tree=t), EP=4) == [("tree:positions", MISSING, "[5, 6]", False)]
    assert pdiffs(parts(tree={}), parts(tree=t), EP=4) == [("tree:positions", MISSING, "[5, 6]", False)]


def test_tree_fields_are_compared_by_shape_and_value_not_dtype():
    mask = torch.tensor([True, False, True])
    as_u8 = parts(tree={"custom_mask": mask.to(torch.uint8)})
    assert compare_parts(parts(tree={"custom_mask": mask}), as_u8, 4, 4) == []
    as_i64 = parts(tree={"positions": torch.tensor([5, 6])})
    assert compare_parts(parts(tree={"positions": i32(5, 6)}), as_i64, 4, 4) == []
    # the same values in another shape differ
    assert pdiffs(parts(tree={"positions": i32(5, 6)}), parts(tree={"positions": i32(5, 6).view(2, 1)}), EP=4) == [
        ("tree:positions", "[5, 6]", "[[5], [6]]", False)]
    assert pdiffs(parts(tree={"positions": i32(5, 6)}), parts(tree={"positions": i32(5, 7)}), EP=4) == [
        ("tree:positions", "[5, 6]", "[5, 7]", False)]


def test_tree_fields_are_reported_in_name_order_after_the_parts():
    ours = parts(tree={"retrive_index": i32(0), "draft_tokens": i32(1)})
    theirs = parts(prefix=md(max_q=2), tree={"retrive_index": i32(9), "draft_tokens": i32(2)})
    assert [d[0] for d in pdiffs(ours, theirs, EP=4)] == [
        "prefix:max_seq_len_q", "tree:draft_tokens", "tree:retrive_index"]


def test_rows_with_no_keys_set_no_bound_a_zero_width_upstream_table_is_not_below_it():
    """K = 0 everywhere (no page read): the bound is 0 pages, so a 0-column upstream table only
    differs in width (documented), never "below the kernel bound"."""
    ours = md(K=(0, 0))
    theirs = dict(ours, page_table=torch.zeros((2, 0), dtype=torch.int32))
    assert diffs(ours, theirs) == [("page_table[dead]", "width 4, rows differing []", "width 0", False)]
