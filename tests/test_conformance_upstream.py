"""Negative controls against SGLang's own backend (marker ``conformance``: ``make conformance``).

These install the pinned releases (``refspec.conformance.install``, cached in ``.conformance/``)
and run upstream in a worker, so they are not part of ``make test``.  Each known-wrong refspec
variant must make the comparison fail *and* name the field it breaks, in the modes and phases
where the bug lives, and nowhere else; the same cases without the variant conform.
"""

from __future__ import annotations

import pytest
import torch

from refspec.conformance import compare, run

pytestmark = pytest.mark.conformance


def failing(out) -> dict[tuple[str, str], set[str]]:
    """(mode, phase) -> the undocumented fields that differ there."""
    got: dict[tuple[str, str], set[str]] = {}
    for r in out.rows:
        assert r.error is None, f"{r.job} {r.phase}: upstream raised: {r.error}"
        for d in r.undocumented:
            got.setdefault((r.mode, r.phase), set()).add(d.field)
    return got


def quiet(*_):
    pass


#: upstream results shared by the tests (keyed by the inputs' digest: a variant that changes only
#: refspec's metadata reuses them; one that changes the inputs runs the worker again)
UPSTREAM: dict = {}
NEW = {"pins": ("0.5.23",), "page_sizes": (1, 4), "modes": ("decode", "verify", "draft_decode", "draft_extend_v2"),
       "log": quiet, "cache": UPSTREAM}
OLD = {"pins": ("0.5.12.post1",), "page_sizes": (4,), "modes": ("draft_extend",), "log": quiet, "cache": UPSTREAM}


@pytest.fixture(scope="module")
def clean_new():
    out = run.run(**NEW)
    assert out.ok, run.render(out)
    return out


@pytest.mark.spec("MD-005")
def test_draft_extend_v2_double_count_fails_on_cache_seqlens(clean_new):
    """#26512: ``cache_seqlens = seq_lens + N`` in DRAFT_EXTEND_V2 (seq_lens already counts N)."""
    out = run.run(variant="de-v2-k-double-count", **NEW)
    assert out.info["0.5.23"]["reused"] == len({r.job for r in out.rows})  # same inputs, refspec side differs
    assert not out.ok
    got = failing(out)
    assert set(got) == {("draft_extend_v2", p) for p in ("eager", "capture", "replay", "replay-staged")}
    assert all("cache_seqlens_int32" in f and "cu_seqlens_k" not in f for f in got.values())
    # cu_seqlens_k differs too, but the paged kernel call does not read it: shown, never a failure (issue 39)
    k_diffs = [d for r in out.rows for d in r.diffs if d.field == "cu_seqlens_k"]
    assert k_diffs and all(d.documented == "not read by the FA3 kernel" for d in k_diffs)
    assert "cache_seqlens_int32" in out.failing_fields()


@pytest.mark.spec("PA-002")
def test_seed_page_table_fails_on_the_live_page_table_only_for_paged_replay(clean_new):
    """The seed's page table (token slots copied as page ids) at verify / draft-decode replay."""
    out = run.run(variant="seed-page-table", **NEW)
    got = failing(out)
    assert set(got) == {("verify", "replay"), ("draft_decode", "replay")}
    assert all(f == {"page_table[live]"} for f in got.values())
    assert {r.page_size for r in out.rows if not r.ok} == {4}  # P = 1: slots are page ids, so it conforms


@pytest.mark.spec("CG-003")
def test_v1_accept_length_rule_is_checked_against_the_legacy_replay_hook():
    """v1 DRAFT_EXTEND replay ``cu_seqlens_q`` from n instead of a = n + 1, against 0.5.12.post1."""
    clean = run.run(**OLD)
    assert clean.ok and {r.phase for r in clean.rows} == {"eager", "capture", "replay"}
    got = failing(run.run(variant="de-v1-accept-off-by-one", **OLD))
    # the variant replaces graph_metadata.draft_extend_rows, which only replay reads (the live
    # accept lengths; capture freezes the uniform W layout, as upstream's capture hook does)
    assert got == {("draft_extend", "replay"): {"cu_seqlens_q"}}


def test_upstream_replay_kernels_run_in_tritons_interpreter_and_stubs_were_armed(clean_new):
    old = run.run(**OLD)
    for pin, out in (("0.5.23", clean_new), ("0.5.12.post1", old)):
        info = out.info[pin]
        kernels = info["replay kernels in Triton's interpreter"]
        assert kernels and all(kernels.values()), (pin, kernels)
        assert info["placeholders"] > 0


# ---- top-k > 1 (refspec.conformance.tree_cases) ----
TREE = {"pins": ("0.5.23",), "page_sizes": (1, 4), "modes": ("tree_verify", "tree_draft_decode"), "topks": (2, 4),
        "log": quiet, "cache": UPSTREAM}
TREE_KEYS = {"tree-expand-max-k", "tree-replay-prefix-max-k", "tree-prefix-table-width", "tree-capture-contents",
             "tree-draft-prefix-cu-k", "tree-draft-expand-cu-k"}


@pytest.fixture(scope="module")
def clean_tree():
    out = run.run(**TREE)
    assert out.ok, run.render(out)
    return out


@pytest.mark.spec("TR-010", "TR-011", "TR-013", "TR-014", "TR-016", "TR-018")
def test_tree_metadata_conforms_and_every_kernel_read_field_is_identical(clean_tree):
    """Every kernel-read field of both parts is bitwise upstream's at eager and padded replay; the
    differences are only the documented tree ones; upstream's own tree equals refspec's."""
    rows = clean_tree.rows
    assert {(r.mode, r.phase) for r in rows} == {(m, p) for m in TREE["modes"] for p in ("eager", "capture", "replay")}
    shapes = {r.job.split("/", 1)[1] for r in rows}
    # (k, P), plus bs = 1 and bs = 2 at k = 2, P = 1 (the smallest cases a "bs >= 2" headline needs)
    assert shapes == {f"k{k}/P{P}" for k in (2, 4) for P in (1, 4)} | {"k2/B1/P1", "k2/B2/P1"}
    assert len(rows) == len(shapes) * (1 + 2) * 3  # shapes x (verify + 2 draft steps) x phases
    used = {d.documented for r in rows for d in r.diffs}
    assert used <= TREE_KEYS
    for r in rows:
        if r.phase != "capture":
            assert not [d for d in r.diffs if d.field.split(":")[1] in ("cache_seqlens_int32", "cu_seqlens_q",
                                                                          "max_seq_len_q", "page_table[live]")], r
    info = clean_tree.info["0.5.23"]
    assert info["tree kernels in Triton's interpreter"] == {"sgl_build_tree_kernel_efficient_triton": True,
                                                            "verify_tree_greedy_kernel_triton": True,
                                                            "assign_draft_cache_locs_contiguous": True}
    accepted = [r for r in rows if r.mode == "tree_verify" and r.phase == "eager"]
    assert accepted and all(not [d for d in r.diffs if d.field.startswith("tree:")] for r in accepted)


@pytest.mark.spec("TR-011", "TR-004")
def test_tree_mask_sibling_visible_fails_on_the_verify_expand_part_only(clean_tree):
    """A node that also sees its siblings: verify expand K and live slots differ from upstream's."""
    out = run.run(variant="tree-mask-sibling-visible", **TREE)
    assert out.info["0.5.23"]["reused"] == len({r.job for r in out.rows})  # upstream's side is unchanged
    got = failing(out)
    assert set(got) == {("tree_verify", "eager"), ("tree_verify", "replay")}
    for fields in got.values():
        assert {"expand:cache_seqlens_int32", "expand:page_table[live]"} <= fields
        assert all(f.startswith("expand:") for f in fields)


@pytest.mark.spec("TR-013")
def test_draft_prefix_reading_the_partial_page_fails_on_prefix_cache_seqlens_at_p_gt_1(clean_tree):
    """The pre-#7725 prefix rule K = L (the partial tail page shared by every branch), applied
    in this test only, at every binding of ``draft_prefix_seqlens``."""
    from refspec.fa3 import tree_metadata as tm
    from refspec.mutants.replace import replaced

    whole_pages_too = lambda seq_lens, page_size: seq_lens.to(torch.int32)  # noqa: E731
    with replaced(tm.draft_prefix_seqlens, whole_pages_too):
        out = run.run(**TREE)
    got = failing(out)
    assert set(got) == {("tree_draft_decode", "eager"), ("tree_draft_decode", "replay")}
    assert all(fields == {"prefix:cache_seqlens_int32"} for fields in got.values())
    assert {r.page_size for r in out.rows if not r.ok} == {4}  # P = 1: lp = 0, the rule is the same


@pytest.mark.spec("TR-016", "TR-006")
def test_sibling_blind_greedy_acceptance_fails_on_the_accepted_path_only(clean_tree):
    """Acceptance that follows only each node's first child (the sibling lists ignored), applied in
    this test only: the accepted path differs from upstream's Triton ``verify_tree_greedy``."""
    from refspec.mutants.replace import replaced
    from refspec.speculative.tree import build as tree_build

    original = tree_build.verify_tree_greedy

    def first_child_only(cand, ri, next_token, next_sibling, target_predict, n):
        return original(cand, ri, next_token, torch.full_like(next_sibling, -1), target_predict, n)

    with replaced(tree_build.verify_tree_greedy, first_child_only):
        out = run.run(**TREE)
    assert out.info["0.5.23"]["reused"] == len({r.job for r in out.rows})
    got = failing(out)
    assert set(got) == {("tree_verify", "eager")}
    assert got[("tree_verify", "eager")] <= {"tree:predicts", "tree:accept_index", "tree:accept_token_num"}
    assert "tree:accept_index" in got[("tree_verify", "eager")]


@pytest.mark.spec("TR-015")
def test_no_tail_copy_fails_on_the_branch_tail_copies_against_upstreams_prepare_for_draft(clean_tree):
    """A KV-layout bug (no metadata field changes): the lp tail tokens are not copied into branches
    t >= 1.  Caught by the draft ``tree`` part, which holds upstream's own slot assignment and
    tail copies (``eagle_worker_common.prepare_for_draft``), at P > 1 only."""
    out = run.run(variant="branch-no-tail-copy", **TREE)
    got = failing(out)
    assert got == {("tree_draft_decode", "eager"): {"tree:tail_copy"}}
    assert {(r.page_size, r.step) for r in out.rows if not r.ok} == {(4, 0)}


@pytest.mark.spec("TR-018", "PA-007")
def test_unsliced_draft_expand_replay_at_s3_reaches_only_dead_columns_reported_as_not_read(clean_tree):
    """#25077 without its slice: at S = 3 the extra pages land in dead columns, which the kernel never
    reads (PA-007): the difference is reported (documented as not read by the FA3 kernel), at
    draft-decode replay and nowhere else, and is not a failure; the same scatter raises once a branch
    spans more pages (S = 6, P = 2: the known bug's control, tests/test_conformance_controls.py)."""
    out = run.run(variant="draft-expand-unsliced-cache-loc", **TREE)
    assert out.ok, run.render(out)
    unread = {(r.mode, r.phase) for r in out.rows for d in r.diffs
              if d.documented == compare.UNREAD and d.field == "expand:page_table[dead]"}
    assert unread == {("tree_draft_decode", "replay")}


@pytest.mark.spec("TR-018", "TR-013", "TR-014")
def test_the_legacy_pin_at_s3_differs_from_upstream_only_in_dead_expand_columns():
    """0.5.12.post1 predates #27360's slice: its draft expand replay scatters all S steps.  At S = 3
    the extra pages land in dead columns only: no row fails (they are reported as not read, at
    replay, step 0, P > 1); the same scatter raises at S = 6, P = 2, the known bug
    draft-expand-unsliced-scatter (tests/test_conformance_controls.py, and CI's expected known bugs)."""
    out = run.run(pins=("0.5.12.post1",), page_sizes=(1, 4), modes=("tree_verify", "tree_draft_decode"), topks=(2,),
                  log=quiet, cache=UPSTREAM)
    assert out.ok, run.render(out)
    dead = {(r.mode, r.phase, r.step, r.page_size) for r in out.rows for d in r.diffs
            if d.field == "expand:page_table[dead]" and d.documented == compare.UNREAD}
    assert dead == {("tree_draft_decode", "replay", 0, 4)}
    assert not [d for r in out.rows for d in r.diffs if d.field.startswith("tree:")]  # its tree is refspec's
