"""What the tree-round checks of ``refspec.traces.tree`` must refuse, on a tree trace written by
hand: :func:`check_tree_rounds` (shapes, then page ids and acceptance; the first violation is a
ValueError), :func:`tree_round_failures` (TR-003 / TR-004 / TR-005 / TR-006 / PA-002 / TR-015, one
line each) and :func:`tree_v2_round_failures` (TR-020 / TR-021).  No model runs; every slot, page
and token below is counted by hand (test_tree_trace.py checks recorded traces).  The mutation run
(``make mutation``) mutates tree.py against this file.

The trace: P = 4, k = 2, S = 2, N = 4, max_batch 2, num_pages 10 (pages 1 .. 9, slots 4 .. 39).

* request 0, row 1, prompt 5 tokens, a = [2, 2] in rounds 0 and 1 (L = 5, 7);
  output [50, 60, 99, 62, 98];
* request 1, row 2, prompt 2 tokens, a = [1] in round 0 (L = 2); output [40, 41].

Request 0's tree (both rounds): parents [-1, 0, 0, 1] (depths 0, 1, 1, 2).  Round 0: root 50,
the target predicts 60 at the root (node 1) and 99 at node 1 (no child has it): path [0, 1],
emitted [60, 99].  Round 1: root 99, draft tokens [99, 61, 62, 71], the target predicts 62 at the
root (node 2, a leaf) and 98 there: path [0, 2], emitted [62, 98].  Request 1's tree: parents
[-1, 0, 1, 0], the target predicts 41 at the root, which no child has: path [0], emitted [41].
"""

from __future__ import annotations

import copy

import pytest

from refspec.core.invariants import InvariantError
from refspec.traces.chain import check_trace
from refspec.traces.tree import (TREE_FORMAT, ancestors_and_self, check_tree_rounds, from_runs, tree_round_failures,
                                 tree_v2_round_failures)

MODEL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=4, vocab_size=128)
MASK4 = ["1000", "1100", "1010", "1101"]  # parents [-1, 0, 0, 1]


def r0_req0() -> dict:
    """L = 5: positions 0 .. 8 at slots 4 .. 12 (pages 1, 2, 3); table [1, 2]; lp = 1: branch 0 at
    slot 9 (page 2, after the tail slot 8), branch 1 at slot 21 (page 5, offset 1)."""
    return dict(req_pool_index=1, req_to_token=[[4, 9]], page_table=[1, 2], parents=[-1, 0, 0, 1],
                positions=[5, 6, 6, 7], mask=list(MASK4), accept_path=[0, 1], draft_cache_loc=[[9, 10], [21, 22]],
                draft_tokens=[50, 60, 61, 70], target_predict=[60, 99, 0, 0])


def r0_req1() -> dict:
    """L = 2: positions 0 .. 5 at slots 28 .. 33 (pages 7, 8); table [7]; lp = 2: branch 0 at slot
    30, branch 1 at slot 38 (page 9, offset 2)."""
    return dict(req_pool_index=2, req_to_token=[[28, 6]], page_table=[7], parents=[-1, 0, 1, 0],
                positions=[2, 3, 4, 3], mask=["1000", "1100", "1110", "1001"], accept_path=[0],
                draft_cache_loc=[[30, 31], [38, 39]], draft_tokens=[40, 50, 51, 52], target_predict=[41, 0, 0, 0])


def r1_req0() -> dict:
    """L = 7: positions 0 .. 10 at slots 4 .. 14; table [1, 2]; lp = 3: branch 0 at slot 11 (after
    the tail 8, 9, 10), branch 1 at slot 27 (page 6, offset 3)."""
    return dict(req_pool_index=1, req_to_token=[[4, 11]], page_table=[1, 2], parents=[-1, 0, 0, 1],
                positions=[7, 8, 8, 9], mask=list(MASK4), accept_path=[0, 2], draft_cache_loc=[[11, 12], [27, 28]],
                draft_tokens=[99, 61, 62, 71], target_predict=[62, 0, 98, 0])


def trace(version="v1") -> dict:
    """The module doc's trace.  Its pool: width = 5 + 5 (longest prompt + largest budget) + 4 + R,
    R = max(ceil((P - 1 + S) / P) = 2 pages * 4 * k, N) = 16, so 30 tokens = 8 pages + 1 per row:
    1 + 2 * 9 = 19 pages at most; num_pages 10 is inside it."""
    t = {
        "format": TREE_FORMAT, "source": {},
        "config": dict(version=version, page_size=4, num_steps=2, draft="early-exit:1", max_batch=2, eos=None,
                       capture_bs=[1, 2], model_config=dict(MODEL), topk=2, num_draft_tokens=4, num_pages=10),
        "requests": [
            dict(rid=0, prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=5, output_ids=[50, 60, 99, 62, 98],
                 finish_reason="length", num_accept_tokens=[2, 2]),
            dict(rid=1, prompt_ids=[6, 7], max_new_tokens=2, output_ids=[40, 41], finish_reason="length",
                 num_accept_tokens=[1]),
        ],
        "rounds": [
            dict(rids=[0, 1], seq_lens=[5, 2], num_accept_tokens=[2, 1], joined=[0, 1], finished=[1],
                 tree=[r0_req0(), r0_req1()]),
            dict(rids=[0], seq_lens=[7], num_accept_tokens=[2], joined=[], finished=[0], tree=[r1_req0()]),
        ],
    }
    if version == "v2":  # moved_to: the first a verify slots; kept_row a - 1
        for e, moved, kept in zip([*t["rounds"][0]["tree"], *t["rounds"][1]["tree"]],
                                  ([9, 10], [30], [11, 12]), (1, 0, 1)):
            e.update(moved_to=moved, kept_row=kept)
    return t


def tampered(fn, version="v1") -> dict:
    t = copy.deepcopy(trace(version))
    fn(t)
    return t


def refusal(t) -> str:
    """The one message check_tree_rounds gives ``bad`` (which raises, as check_trace's does)."""
    msgs = []

    def bad(msg):
        msgs.append(msg)
        raise ValueError(msg)

    with pytest.raises(ValueError):
        check_tree_rounds(t, bad)
    assert len(msgs) == 1
    return msgs[0]


def E(t, i, b):
    return t["rounds"][i]["tree"][b]


def test_from_runs_and_ancestors_by_hand():
    assert from_runs([[4, 3], [20, 1], [9, 2]]) == [4, 5, 6, 20, 9, 10]
    assert from_runs([]) == []
    assert ancestors_and_self([-1, 0, 0, 1], 3) == [0, 1, 3]
    assert ancestors_and_self([-1, 0, 0, 1], 0) == [0]
    assert ancestors_and_self([-1, 0, 1, 2, -1], 3) == [0, 1, 2, 3]
    assert ancestors_and_self([-1, 0, 1, 2, -1], 4) == [0, 4]  # an orphan: itself and the root


def test_ancestors_refuse_a_parent_that_does_not_precede_its_child():
    with pytest.raises(InvariantError, match=r"\[TR-003\].*node 1's parent 2 does not precede it"):
        ancestors_and_self([-1, 2, 1], 1)
    with pytest.raises(InvariantError, match=r"\[TR-003\].*node 2's parent 2 does not precede it"):
        ancestors_and_self([-1, 0, 2], 2)  # its own parent: the walk would never end


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_hand_trace_passes_every_check(version):
    t = trace(version)
    check_trace(t)  # the schedule and, through check_tree_rounds, the tree rounds
    check_tree_rounds(t, lambda m: pytest.fail(m))
    cfg = t["config"]
    for rd in t["rounds"]:
        for e, L, a in zip(rd["tree"], rd["seq_lens"], rd["num_accept_tokens"]):
            assert tree_round_failures(e, L, a, cfg) == []


def test_check_tree_rounds_accepts_one_draft_step_without_branch_slots():
    """S = 1: no draft decode runs, so draft_cache_loc holds no branch (R shrinks: 1 page * 4 * 2 = 8)."""
    def one_step(t):
        t["config"]["num_steps"] = 1
        for rd in t["rounds"]:
            for e in rd["tree"]:
                e["draft_cache_loc"] = []
    check_tree_rounds(tampered(one_step), lambda m: pytest.fail(m))
    assert refusal(tampered(lambda t: (one_step(t), E(t, 0, 1).__setitem__("draft_cache_loc", [[30], [38]])))) == \
        "round 0 request 1: draft_cache_loc needs 0 branches of S = 1 slots"


def test_check_tree_rounds_accepts_a_longer_v2_row():
    """v2 rows hold the whole reserve: more than L + N positions is fine there, not in v1."""
    check_tree_rounds(tampered(lambda t: E(t, 0, 1).__setitem__("req_to_token", [[28, 7]]), "v2"),
                      lambda m: pytest.fail(m))


def cfg_of(**kw):
    def fn(t):
        t["config"].update(kw)
    return fn


def entry_set(i, b, key, value):
    def fn(t):
        E(t, i, b)[key] = value
    return fn


def entry_del(i, b, key):
    def fn(t):
        del E(t, i, b)[key]
    return fn


NEEDS = ("a tree trace needs config topk >= 2, num_draft_tokens >= 2 and num_pages (the recording engine's KV pool), "
         "got ")
SHAPE = "parents / positions / mask need N = 4 entries (mask: N strings of N 0/1)"


@pytest.mark.parametrize("fn,msg", [
    (cfg_of(topk=1), NEEDS + "{'topk': 1, 'num_draft_tokens': 4, 'num_pages': 10}"),
    (cfg_of(num_draft_tokens=1), NEEDS + "{'topk': 2, 'num_draft_tokens': 1, 'num_pages': 10}"),
    (lambda t: t["config"].pop("num_pages"), NEEDS + "{'topk': 2, 'num_draft_tokens': 4, 'num_pages': None}"),
    (lambda t: t["config"].pop("topk"), NEEDS + "{'topk': None, 'num_draft_tokens': 4, 'num_pages': 10}"),
    (lambda t: t["config"].pop("num_draft_tokens"), NEEDS + "{'topk': 2, 'num_draft_tokens': None, 'num_pages': 10}"),
    (cfg_of(version="v3"), "tree rounds are recorded from the v1 or v2 tree engine, config says 'v3'"),
    (cfg_of(num_pages=20), "config num_pages = 20: not the pool the recording engine gives these requests (an int, "
                           "2 .. 19 pages, page 0 included); a replay allocates num_pages"),
    (lambda t: t["rounds"][1].pop("tree"), "round 1: 'tree' must hold one entry per request of rids"),
    (lambda t: t["rounds"][0].__setitem__("tree", {"0": r0_req0()}), "round 0: 'tree' must hold one entry per "
                                                                      "request of rids"),
    (lambda t: t["rounds"][0]["tree"].pop(), "round 0: 'tree' must hold one entry per request of rids"),
    (lambda t: t["rounds"][1]["tree"].append(r0_req1()), "round 1: 'tree' must hold one entry per request of rids"),
    (entry_del(0, 1, "mask"), "round 0 request 1: tree entry lacks ['mask']"),
    (lambda t: (E(t, 1, 0).pop("req_pool_index"), E(t, 1, 0).pop("target_predict")),
     "round 1 request 0: tree entry lacks ['req_pool_index', 'target_predict']"),
    (entry_set(0, 1, "req_to_token", [[28, 0], [28, 6]]), "round 0 request 1: req_to_token runs are "
                                                          "[first_slot, count] with count >= 1"),
    (entry_set(0, 1, "req_to_token", [[28, 6.0]]), "round 0 request 1: req_to_token runs are [first_slot, count] "
                                                   "with count >= 1"),
    (entry_set(0, 1, "req_to_token", [[28, 5]]), "round 0 request 1: req_to_token runs cover 5 positions, expected "
                                                 "L + N = 6"),
    (entry_set(0, 1, "req_to_token", [[28, 7]]), "round 0 request 1: req_to_token runs cover 7 positions, expected "
                                                 "L + N = 6"),
    (entry_set(1, 0, "page_table", [1, 2, 3]), "round 1 request 0: page_table has 3 pages, ceil(L / P) = 2"),
    (entry_set(0, 1, "page_table", []), "round 0 request 1: page_table has 0 pages, ceil(L / P) = 1"),
    (entry_set(0, 1, "parents", [-1, 0, 1]), f"round 0 request 1: {SHAPE}"),
    (entry_set(0, 1, "positions", [2, 3, 4, 3, 5]), f"round 0 request 1: {SHAPE}"),
    (entry_set(0, 1, "mask", ["1000", "1100", "1110"]), f"round 0 request 1: {SHAPE}"),
    (entry_set(0, 1, "mask", ["1000", "1100", "11100", "1001"]), f"round 0 request 1: {SHAPE}"),
    (entry_set(0, 1, "mask", ["1000", "1100", "111", "1001"]), f"round 0 request 1: {SHAPE}"),
    (entry_set(0, 1, "mask", ["1000", "1100", "1120", "1001"]), f"round 0 request 1: {SHAPE}"),
    (entry_set(1, 0, "accept_path", [0, 2, 3]), "round 1 request 0: accept_path has 3 nodes, a = 2"),
    (entry_set(0, 1, "accept_path", []), "round 0 request 1: accept_path has 0 nodes, a = 1"),
    (entry_set(0, 1, "draft_cache_loc", [[30, 31]]), "round 0 request 1: draft_cache_loc needs 2 branches of S = 2 "
                                                     "slots"),
    (entry_set(0, 1, "draft_cache_loc", [[30, 31], [38]]), "round 0 request 1: draft_cache_loc needs 2 branches of "
                                                           "S = 2 slots"),
    (entry_set(0, 1, "draft_cache_loc", [[30, 31, 32], [38, 39]]), "round 0 request 1: draft_cache_loc needs 2 "
                                                                   "branches of S = 2 slots"),
    (entry_set(0, 1, "draft_tokens", [40, 50, 51]), "round 0 request 1: draft_tokens and target_predict need N = 4 "
                                                    "tokens (one per node)"),
    (entry_set(0, 1, "target_predict", [41, 0, 0, 0, 0]), "round 0 request 1: draft_tokens and target_predict need "
                                                          "N = 4 tokens (one per node)"),
    # the rules, after every shape: page ids (PA-008 / PA-011) first, then acceptance (TR-003 / TR-006)
    (entry_set(0, 1, "page_table", [0]), "round 0 request 1: [PA-008] page_table[0] = 0 lies in page 0, the reserved "
                                         "dummy page never given to a request"),
    (entry_set(1, 0, "draft_cache_loc", [[11, 12], [40, 41]]),
     "round 1 request 0: [PA-011] draft_cache_loc[1][0] = 40 names page 10, outside the recorded pool (num_pages = "
     "10: pages 1 .. 9 can be given out)"),
    (entry_set(1, 0, "draft_tokens", [98, 61, 62, 71]),
     "round 1 request 0: [TR-003] draft_tokens[0] = 98: the root must be the committed last token output_ids[2] = 99"),
    (entry_set(0, 1, "target_predict", [52, 0, 0, 0]),
     "round 0 request 1: [TR-006] accept_path [0] is not the greedy walk [0, 3] over the recorded draft_tokens "
     "[40, 50, 51, 52] / target_predict [52, 0, 0, 0] (from the root, the first child whose token is the target's "
     "prediction at the current node)"),
    (lambda t: (E(t, 1, 0).__setitem__("draft_tokens", [98, 61, 62, 71]), E(t, 1, 0).__setitem__("page_table", [1, 0])),
     "round 1 request 0: [PA-008] page_table[1] = 0 lies in page 0, the reserved dummy page never given to a request"),
])
def test_check_tree_rounds_refuses(fn, msg):
    assert refusal(tampered(fn)) == msg


@pytest.mark.parametrize("fn,msg", [
    (entry_del(0, 0, "moved_to"), "round 0 request 0: tree entry lacks ['moved_to']"),
    (entry_del(1, 0, "kept_row"), "round 1 request 0: tree entry lacks ['kept_row']"),
    (entry_set(0, 1, "req_to_token", [[28, 5]]), "round 0 request 1: req_to_token runs cover 5 positions, expected "
                                                 "at least L + N = 6"),
    (entry_set(0, 1, "kept_row", 0.0), "round 0 request 1: a v2 entry needs kept_row (an int) and moved_to (a = 1 "
                                       "slots)"),
    (entry_set(0, 1, "moved_to", [30, 31]), "round 0 request 1: a v2 entry needs kept_row (an int) and moved_to "
                                            "(a = 1 slots)"),
    (entry_set(1, 0, "moved_to", [11]), "round 1 request 0: a v2 entry needs kept_row (an int) and moved_to "
                                        "(a = 2 slots)"),
    (entry_set(1, 0, "moved_to", [11, 3]), "round 1 request 0: [PA-008] moved_to[1] = 3 lies in page 0, the reserved "
                                           "dummy page never given to a request"),
])
def test_check_tree_rounds_refuses_v2(fn, msg):
    assert refusal(tampered(fn, "v2")) == msg


def test_a_v1_entry_needs_no_v2_keys():
    """moved_to / kept_row are v2 keys: a v1 entry without them passes, with them they are ignored
    apart from their page ids."""
    t = trace()
    assert "moved_to" not in E(t, 0, 0)
    assert refusal(tampered(entry_set(0, 0, "moved_to", [2]))).startswith("round 0 request 0: [PA-008] moved_to[0]")


# tree_round_failures: one entry, its L and a, and the config's P and N

CFG = dict(page_size=4, num_draft_tokens=4)
TR003 = "[TR-003] parents {}: node 0 is the root (-1) and every parent precedes its child"


def failures(fn=None, entry=r0_req0, L=5, a=2, cfg=CFG):
    e = entry()
    if fn is not None:
        fn(e)
    return tree_round_failures(e, L, a, cfg)


def setk(key, value):
    return lambda e: e.__setitem__(key, value)


@pytest.mark.parametrize("par", [[0, 0, 0, 1], [-1, 0, 2, 1], [-1, 0, 3, 1], [-1, 0, 0, -2], [-1, 0, 0, 4],
                                 [-2, 0, 0, 1]])
def test_tree_round_failures_refuses_a_malformed_tree_and_stops_there(par):
    """The mask, positions and path rules need a tree: a bad one is the only line (the mask and
    positions, still those of the good tree, are not compared to it)."""
    assert failures(setk("parents", par)) == [TR003.format(par)]


def test_tree_round_failures_accepts_orphans():
    """An orphan (-1 past node 0) sees itself and the root, at depth 1."""
    def orphan(e):
        e.update(parents=[-1, 0, -1, 1], mask=["1000", "1100", "1010", "1101"], positions=[5, 6, 6, 7])
    assert failures(orphan) == []


@pytest.mark.parametrize("i,row,got,want", [
    (3, "1111", [0, 1, 2, 3], [0, 1, 3]),  # a sibling (node 2) visible
    (1, "0100", [1], [0, 1]),  # the root hidden
    (2, "1000", [0], [0, 2]),  # itself hidden
    (0, "0000", [], [0]),
])
def test_tree_round_failures_names_a_wrong_mask_row(i, row, got, want):
    def fn(e):
        e["mask"][i] = row
    assert failures(fn) == [f"[TR-004] node {i}: the stored mask row sees tree nodes {got}; itself, its ancestors "
                            f"and the root are {want}"]


def test_tree_round_failures_gives_one_line_per_wrong_row_and_position():
    def fn(e):
        e["mask"][1], e["mask"][3] = "1110", "0001"
        e["positions"] = [5, 6, 7, 6]
    assert failures(fn) == [
        "[TR-004] node 1: the stored mask row sees tree nodes [0, 1, 2]; itself, its ancestors and the root are [0, 1]",
        "[TR-004] node 3: the stored mask row sees tree nodes [3]; itself, its ancestors and the root are [0, 1, 3]",
        "[TR-005] node 2: position 7, L + depth = 5 + 1",
        "[TR-005] node 3: position 6, L + depth = 5 + 2",
    ]


@pytest.mark.parametrize("positions,node,p,depth", [([4, 6, 6, 7], 0, 4, 0), ([5, 6, 6, 8], 3, 8, 2),
                                                     ([5, 5, 6, 7], 1, 5, 1)])
def test_tree_round_failures_names_a_position_that_is_not_l_plus_depth(positions, node, p, depth):
    assert failures(setk("positions", positions)) == [f"[TR-005] node {node}: position {p}, L + depth = 5 + {depth}"]


@pytest.mark.parametrize("path,a", [([1], 1), ([0, 0], 2), ([0, 1, 2], 3), ([0, 3], 2), ([0, 1], 3),
                                    ([0, 1, 3], 2), ([], 0)])
def test_tree_round_failures_refuses_a_path_off_the_parent_links(path, a):
    """[0, 1, 3] follows the links but is not a = 2 nodes long; [] does not start at the root."""
    assert failures(setk("accept_path", path), a=a) == [
        f"[TR-006] accept_path {path} must start at the root and follow parent links ({a} nodes)"]


def test_tree_round_failures_accepts_a_three_node_path():
    assert failures(setk("accept_path", [0, 1, 3]), a=3) == []


@pytest.mark.parametrize("pt,line", [
    ([1, 3], "[PA-002] page_table[1] = 3 gives slot 12 for position 4, req_to_token holds 8 (P=4)"),
    ([2, 2], "[PA-002] page_table[0] = 2 gives slot 8 for position 0, req_to_token holds 4 (P=4)"),
])
def test_tree_round_failures_names_the_first_position_the_page_table_misplaces(pt, line):
    assert failures(setk("page_table", pt)) == [line]


def test_tree_round_failures_reads_the_page_table_over_the_whole_prefix_only():
    """Positions 0 .. L-1 only: the verify slots (positions 5 .. 8, at slots 30 .. 33 here) are not
    the page table's.  Position 4 at slot 16 (page 4) needs page_table[1] = 4."""
    row = dict(req_to_token=[[4, 4], [16, 1], [30, 4]], draft_cache_loc=[[17, 18], [21, 22]])
    assert failures(lambda e: e.update(row)) == [
        "[PA-002] page_table[1] = 2 gives slot 8 for position 4, req_to_token holds 16 (P=4)"]
    assert failures(lambda e: e.update(row, page_table=[1, 4])) == []


def test_tree_round_failures_at_page_size_1():
    """P = 1: page ids are slots, lp = 0 (no tail to continue), each branch in its own page."""
    def fn(e):
        e.update(page_table=[4, 5, 6, 7, 8], draft_cache_loc=[[30, 31], [33, 34]])
    assert failures(fn, cfg=dict(page_size=1, num_draft_tokens=4)) == []

    def same(e):
        e.update(page_table=[4, 5, 6, 7, 8], draft_cache_loc=[[30, 31], [30, 34]])
    assert failures(same, cfg=dict(page_size=1, num_draft_tokens=4)) == [
        "[TR-015] branch step-0 slots [30, 30]: each at offset L mod P = 0 of its own page, branch 0 continuing the "
        "committed tail (slots [])"]


TR015 = ("[TR-015] branch step-0 slots {}: each at offset L mod P = 1 of its own page, branch 0 continuing the "
         "committed tail (slots [8])")


@pytest.mark.parametrize("loc", [
    [[10, 11], [21, 22]],  # branch 0 at offset 2
    [[9, 10], [20, 21]],  # branch 1 at offset 0
    [[9, 10], [22, 23]],  # branch 1 at offset 2
    [[13, 14], [21, 22]],  # branch 0 at offset 1, but of another page than the tail's
    [[9, 10], [9, 11]],  # both branches in page 2
    [[9, 10], [21, 22], [21, 23]],  # a third branch in branch 1's page
])
def test_tree_round_failures_names_misplaced_branch_slots(loc):
    assert failures(setk("draft_cache_loc", loc)) == [TR015.format([b[0] for b in loc])]


def test_tree_round_failures_at_a_page_boundary_has_no_tail():
    """L = 8 (a multiple of P): lp = 0, every branch starts a fresh page; the table covers 2 pages."""
    def fn(e):
        e.update(req_to_token=[[4, 12]], positions=[8, 9, 9, 10], draft_cache_loc=[[16, 17], [24, 25]])
    assert failures(fn, L=8) == []

    def off(e):
        e.update(req_to_token=[[4, 12]], positions=[8, 9, 9, 10], draft_cache_loc=[[16, 17], [25, 26]])
    assert failures(off, L=8) == [
        "[TR-015] branch step-0 slots [16, 25]: each at offset L mod P = 0 of its own page, branch 0 continuing the "
        "committed tail (slots [])"]


def test_tree_round_failures_without_branches_checks_no_slots():
    assert failures(setk("draft_cache_loc", [])) == []


def test_tree_round_failures_reads_n_from_the_config():
    """With N = 3 the mask's last column is not read: node 3's row [0, 1, 3] is then seen as [0, 1]."""
    assert failures(cfg=dict(page_size=4, num_draft_tokens=3)) == [
        "[TR-004] node 3: the stored mask row sees tree nodes [0, 1]; itself, its ancestors and the root are [0, 1, 3]"]


def test_tree_round_failures_lists_every_rule_broken_in_order():
    def fn(e):
        e.update(mask=["1000", "1100", "1110", "1101"], positions=[5, 6, 6, 6], accept_path=[0, 3],
                 page_table=[1, 9], draft_cache_loc=[[9, 10], [22, 23]])
    assert [x.split("]")[0] + "]" for x in failures(fn)] == ["[TR-004]", "[TR-005]", "[TR-006]", "[PA-002]", "[TR-015]"]


# tree_v2_round_failures.  P = 4, k = 2, S = 2, N = 4, L = 5, a = 2: R = max(ceil((P - 1 + S) / P)
# = 2 pages * P * k, N) = 16, so the row holds 21 positions (slots 4 .. 24: slot = 4 + position).
# lp = 1, npp = ceil((lp + S) / P) = 1: branch t, step j at position 4 + 4t + 1 + j, i.e. branch 0
# at positions 5, 6 (slots 9, 10), branch 1 at 9, 10 (slots 13, 14).  moved_to: the first a verify
# slots 9, 10; kept_row a - 1 = 1.

V2CFG = dict(page_size=4, num_draft_tokens=4, topk=2, num_steps=2)


def v2_entry(**kw):
    e = dict(req_to_token=[[4, 21]], draft_cache_loc=[[9, 10], [13, 14]], moved_to=[9, 10], kept_row=1)
    e.update(kw)
    return e


def v2(L=5, a=2, cfg=V2CFG, **kw):
    return tree_v2_round_failures(v2_entry(**kw), L, a, cfg)


def test_the_hand_v2_entry_passes():
    assert v2() == []
    assert v2(req_to_token=[[4, 22]]) == []  # a longer row is fine
    assert v2(req_to_token=[[4, 4], [100, 17]], draft_cache_loc=[[101, 102], [105, 106]], moved_to=[101, 102]) == []


@pytest.mark.parametrize("kw,line", [
    (dict(req_to_token=[[4, 20]]), "[TR-020] the row holds 20 positions (20 distinct slots); the reserve is "
                                   "L + R = 5 + 16"),
    (dict(req_to_token=[[4, 20], [4, 1]]), "[TR-020] the row holds 21 positions (20 distinct slots); the reserve is "
                                           "L + R = 5 + 16"),
    (dict(draft_cache_loc=[[9, 10], [13, 15]]), "[TR-020] branch 1: draft slots [13, 15], the reserve holds [13, 14] "
                                                "at its step positions"),
    (dict(draft_cache_loc=[[8, 9], [13, 14]]), "[TR-020] branch 0: draft slots [8, 9], the reserve holds [9, 10] at "
                                               "its step positions"),
    (dict(moved_to=[10, 9]), "[TR-020] the path's KV was moved to slots [10, 9]; the first a = 2 verify slots are "
                             "[9, 10]"),
    (dict(moved_to=[9]), "[TR-020] the path's KV was moved to slots [9]; the first a = 2 verify slots are [9, 10]"),
    (dict(kept_row=2), "[TR-021] kept draft-extend row 2 of the N = 4 window rows; select_index keeps row a - 1 = 1"),
    (dict(kept_row=0), "[TR-021] kept draft-extend row 0 of the N = 4 window rows; select_index keeps row a - 1 = 1"),
])
def test_tree_v2_round_failures_names_the_rule(kw, line):
    assert v2(**kw) == [line]


def test_a_third_branch_is_read_at_its_own_reserve_positions():
    """Branch 2 (past k) sits at positions 4 + 8 + 1 + j = 13, 14: slots 17, 18.  tree_v2_round_failures
    reads every recorded branch (the count is check_tree_rounds' rule)."""
    assert v2(draft_cache_loc=[[9, 10], [13, 14], [17, 18]]) == []
    assert v2(draft_cache_loc=[[9, 10], [13, 14], [17, 19]]) == [
        "[TR-020] branch 2: draft slots [17, 19], the reserve holds [17, 18] at its step positions"]


def test_a_branch_past_the_row_is_named_with_the_missing_positions():
    """A row of 10 positions (0 .. 9): branch 1's step 1 (position 10) is not in it."""
    assert v2(req_to_token=[[4, 10]]) == [
        "[TR-020] the row holds 10 positions (10 distinct slots); the reserve is L + R = 5 + 16",
        "[TR-020] branch 1: draft slots [13, 14], the reserve holds [13, None] at its step positions"]


def test_tree_v2_round_failures_two_pages_per_branch():
    """L = 7: lp = 3, npp = ceil((3 + 2) / 4) = 2: branch t, step j at position 4 + 8t + 3 + j:
    branch 0 at 7, 8 (slots 11, 12), branch 1 at 15, 16 (slots 19, 20); the reserve L + R = 23
    positions; moved_to the a = 3 verify slots 11, 12, 13; kept_row 2."""
    e = dict(req_to_token=[[4, 23]], draft_cache_loc=[[11, 12], [19, 20]], moved_to=[11, 12, 13], kept_row=2)
    assert tree_v2_round_failures(e, 7, 3, V2CFG) == []
    e.update(req_to_token=[[4, 22]], draft_cache_loc=[[11, 12], [15, 16]])
    assert tree_v2_round_failures(e, 7, 3, V2CFG) == [
        "[TR-020] the row holds 22 positions (22 distinct slots); the reserve is L + R = 7 + 16",
        "[TR-020] branch 1: draft slots [15, 16], the reserve holds [19, 20] at its step positions"]


def test_tree_v2_round_failures_at_a_page_boundary():
    """L = 8: lp = 0, npp = ceil(2 / 4) = 1: branch t at position 8 + 4t + j (slots 12, 13 and 16, 17)."""
    e = dict(req_to_token=[[4, 24]], draft_cache_loc=[[12, 13], [16, 17]], moved_to=[12], kept_row=0)
    assert tree_v2_round_failures(e, 8, 1, V2CFG) == []
    assert tree_v2_round_failures(dict(e, draft_cache_loc=[[12, 13], [20, 21]]), 8, 1, V2CFG) == [
        "[TR-020] branch 1: draft slots [20, 21], the reserve holds [16, 17] at its step positions"]


def test_tree_v2_round_failures_at_page_size_1():
    """P = 1, k = 2, S = 3, N = 4: R = max(k * S, N) = 6; branch t, step j at position L + 3t + j.
    L = 5: row slots 100 .. 110 (slot = 100 + position)."""
    cfg = dict(page_size=1, num_draft_tokens=4, topk=2, num_steps=3)
    e = dict(req_to_token=[[100, 11]], draft_cache_loc=[[105, 106, 107], [108, 109, 110]], moved_to=[105, 106],
             kept_row=1)
    assert tree_v2_round_failures(e, 5, 2, cfg) == []
    assert tree_v2_round_failures(dict(e, req_to_token=[[100, 10]]), 5, 2, cfg) == [
        "[TR-020] the row holds 10 positions (10 distinct slots); the reserve is L + R = 5 + 6",
        "[TR-020] branch 1: draft slots [108, 109, 110], the reserve holds [108, 109, None] at its step positions"]
    assert tree_v2_round_failures(e, 5, 2, dict(cfg, num_draft_tokens=7)) == [  # R = max(6, 7)
        "[TR-020] the row holds 11 positions (11 distinct slots); the reserve is L + R = 5 + 7"]


def test_tree_v2_round_failures_reserve_is_at_least_n():
    """N = 20 > 2 pages * 4 * 2 = 16: R = N."""
    assert v2(cfg=dict(V2CFG, num_draft_tokens=20)) == [
        "[TR-020] the row holds 21 positions (21 distinct slots); the reserve is L + R = 5 + 20"]
    assert v2(cfg=dict(V2CFG, num_draft_tokens=20), req_to_token=[[4, 25]]) == []


def test_the_ancestor_walk_stops_at_the_root_whatever_its_parent_field_says():
    """The replay reads the ancestors of a tree tree_round_failures has already refused (TR-003:
    the root's parent is -1): the walk must still end at node 0, never read parents[0]."""
    assert ancestors_and_self([5, 0, 1], 2) == [0, 1, 2]
    assert ancestors_and_self([0, 0, 1], 2) == [0, 1, 2]


def test_tree_round_failures_names_the_slot_of_a_position_inside_a_page():
    """Positions 0, 1 at slots 4, 5, then 9 ..: position 2 is the first the table misplaces, at
    offset 2 of page 1 (slot 6).  The tail slot is then 11, so branch 0 cannot continue it either."""
    assert failures(setk("req_to_token", [[4, 2], [9, 7]])) == [
        "[PA-002] page_table[0] = 1 gives slot 6 for position 2, req_to_token holds 9 (P=4)",
        "[TR-015] branch step-0 slots [9, 21]: each at offset L mod P = 1 of its own page, branch 0 continuing the "
        "committed tail (slots [11])"]


def test_tree_round_failures_at_page_size_2():
    """P = 2, L = 5: lp = 1; slot = 100 + position, pages 50, 51, 52; branch 0 continues slot 104
    (page 52) at 105, branch 1 at offset 1 of page 60."""
    cfg = dict(page_size=2, num_draft_tokens=4)

    def fn(e):
        e.update(req_to_token=[[100, 9]], page_table=[50, 51, 52], draft_cache_loc=[[105, 106], [121, 122]])
    assert failures(fn, cfg=cfg) == []

    def even(e):
        e.update(req_to_token=[[100, 9]], page_table=[50, 51, 52], draft_cache_loc=[[106, 107], [120, 121]])
    assert failures(even, cfg=cfg) == [
        "[TR-015] branch step-0 slots [106, 120]: each at offset L mod P = 1 of its own page, branch 0 continuing the "
        "committed tail (slots [104])"]


def test_tree_v2_round_failures_at_page_size_2():
    """P = 2, k = 2, N = 4, L = 5 (lp = 1), slot = 100 + position.  S = 3: R = max(ceil((P - 1 + S)
    / P) = 2 pages * 2 * 2, 4) = 8; npp = ceil((lp + S) / P) = 2, so branch t, step j at position
    5 + 4t + j.  S = 2: R = 8 as well, npp = ceil(3 / 2) = 2: the same positions."""
    cfg = dict(page_size=2, num_draft_tokens=4, topk=2, num_steps=3)
    e = dict(req_to_token=[[100, 13]], draft_cache_loc=[[105, 106, 107], [109, 110, 111]], moved_to=[105, 106],
             kept_row=1)
    assert tree_v2_round_failures(e, 5, 2, cfg) == []
    assert tree_v2_round_failures(dict(e, req_to_token=[[100, 12]]), 5, 2, cfg) == [
        "[TR-020] the row holds 12 positions (12 distinct slots); the reserve is L + R = 5 + 8"]
    e2 = dict(e, draft_cache_loc=[[105, 106], [109, 110]])
    assert tree_v2_round_failures(e2, 5, 2, dict(cfg, num_steps=2)) == []
    assert tree_v2_round_failures(dict(e2, draft_cache_loc=[[105, 106], [107, 108]]), 5, 2, dict(cfg, num_steps=2)) == [
        "[TR-020] branch 1: draft slots [107, 108], the reserve holds [109, 110] at its step positions"]


def test_check_tree_rounds_takes_the_smallest_tree_and_one_slot_runs():
    """N = 2 is a tree (the root and one node): the config passes and the entries, recorded for
    N = 4, are refused by their shapes instead (the first: request 0's 9 row positions, L + N = 5 +
    2); a run of count 1 is a run."""
    assert refusal(tampered(cfg_of(num_draft_tokens=2))) == \
        "round 0 request 0: req_to_token runs cover 9 positions, expected L + N = 7"
    check_tree_rounds(tampered(entry_set(0, 1, "req_to_token", [[28, 1], [29, 5]])), lambda m: pytest.fail(m))
