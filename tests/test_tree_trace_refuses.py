"""What the tree-trace checks (``refspec.traces.tree_checks``) must refuse, on entries
written by hand (no model runs; test_tree_trace_checks.py checks recorded traces).  The mutation
run (``make mutation``) mutates tree_trace_checks.py against this file.

Config: P = 4, num_pages = 10 (pages 1 .. 9 can be given out, slots 4 .. 39), max_batch = 2.
"""

from __future__ import annotations

import pytest

from refspec.traces.tree_checks import (acceptance_failures, greedy_path, page_id_failures,
                                                   pool_size_problem, recording_pool_pages, round_tokens)

CFG = dict(page_size=4, num_pages=10, max_batch=2)


def entry(**kw):
    """A request-round in row 2: keys at slots 4 .. 9 (one run), table pages [1, 2], draft slots
    in pages 3 and 9 (the last page of the pool)."""
    e = dict(req_pool_index=2, req_to_token=[[4, 6]], page_table=[1, 2], draft_cache_loc=[[12, 13], [36, 39]])
    e.update(kw)
    return e


def test_a_request_round_inside_the_pool_passes():
    assert page_id_failures(entry(), CFG) == []
    assert page_id_failures(entry(req_pool_index=1, moved_to=[4, 39]), CFG) == []
    assert page_id_failures(entry(req_to_token=[[4, 36]]), CFG) == []  # slots 4 .. 39: pages 1 .. 9


@pytest.mark.parametrize("kw,line", [
    (dict(req_pool_index=0), "[PA-008] req_pool_index = 0 is the reserved dummy row of req_to_token"),
    (dict(req_pool_index=3), "[PA-011] req_pool_index = 3 is not a row of req_to_token (rows 1 .. max_batch = 2)"),
    (dict(req_pool_index=-1), "[PA-011] req_pool_index = -1 is not a row of req_to_token (rows 1 .. max_batch = 2)"),
    (dict(req_to_token=[[3, 2]]), "[PA-008] req_to_token[0] = [3, 2] lies in page 0, the reserved dummy page never "
                                  "given to a request"),
    (dict(req_to_token=[[4, 4], [36, 5]]), "[PA-011] req_to_token[1] = [36, 5] names page 10, outside the recorded "
                                           "pool (num_pages = 10: pages 1 .. 9 can be given out)"),
    (dict(req_to_token=[[-4, 9]]), "[PA-011] req_to_token[0] = [-4, 9] names page -1, outside the recorded pool "
                                   "(num_pages = 10: pages 1 .. 9 can be given out)"),
    (dict(page_table=[1, 0]), "[PA-008] page_table[1] = 0 lies in page 0, the reserved dummy page never given to a "
                              "request"),
    (dict(page_table=[1, 10]), "[PA-011] page_table[1] = 10 names page 10, outside the recorded pool (num_pages = "
                               "10: pages 1 .. 9 can be given out)"),
    (dict(draft_cache_loc=[[12, 13], [36, 40]]), "[PA-011] draft_cache_loc[1][1] = 40 names page 10, outside the "
                                                 "recorded pool (num_pages = 10: pages 1 .. 9 can be given out)"),
    (dict(draft_cache_loc=[[3]]), "[PA-008] draft_cache_loc[0][0] = 3 lies in page 0, the reserved dummy page never "
                                  "given to a request"),
    (dict(moved_to=[8, 2]), "[PA-008] moved_to[1] = 2 lies in page 0, the reserved dummy page never given to a "
                            "request"),
    (dict(moved_to=[40]), "[PA-011] moved_to[0] = 40 names page 10, outside the recorded pool (num_pages = 10: "
                          "pages 1 .. 9 can be given out)"),
])
def test_page_id_failures_names_the_field_and_the_rule(kw, line):
    assert page_id_failures(entry(**kw), CFG) == [line]


def test_page_id_failures_gives_one_line_per_field_the_first_bad_item():
    e = entry(req_pool_index=0, req_to_token=[[0, 1], [40, 1]], page_table=[0, 11], draft_cache_loc=[[1], [50]],
              moved_to=[1, 99])
    assert [x.split(" = ")[0] for x in page_id_failures(e, CFG)] == [
        "[PA-008] req_pool_index", "[PA-008] req_to_token[0]", "[PA-008] page_table[0]",
        "[PA-008] draft_cache_loc[0][0]", "[PA-008] moved_to[0]"]


@pytest.mark.parametrize("kw,field,value", [
    (dict(req_pool_index=1.0), "req_pool_index", "1.0"),
    (dict(req_to_token=[[4, "6"]]), "req_to_token[0]", "'6'"),
    (dict(page_table=[1, 2.0]), "page_table[1]", "2.0"),
    (dict(draft_cache_loc=[[12], [None]]), "draft_cache_loc[1][0]", "None"),
    (dict(moved_to=[4, True]), "moved_to[1]", "True"),
])
def test_page_id_failures_refuses_ids_that_are_not_ints(kw, field, value):
    assert page_id_failures(entry(**kw), CFG) == [f"[PA-011] {field} = {value}: slot, page and row ids are ints"]


def tree_cfg(**kw):
    cfg = dict(page_size=4, topk=2, num_steps=3, num_draft_tokens=4, max_batch=2, num_pages=None)
    cfg.update(kw)
    return cfg


def test_recording_pool_pages_by_hand():
    """Longest prompt 7 + largest budget 9 = 16; R = alloc_len_per_decode(2, 3, 4, 4) = 2 pages * 4
    * 2 = 16 (npp = ceil((3 + 3) / 4) = 2); width 16 + 4 + 16 = 36 tokens = 9 pages, + 1 each; 2 rows,
    + page 0: 1 + 2 * 10 = 21."""
    t = dict(config=tree_cfg(), requests=[dict(prompt_ids=[1] * 7, max_new_tokens=3),
                                          dict(prompt_ids=[1] * 2, max_new_tokens=9)])
    assert recording_pool_pages(t) == 21
    t["requests"][0]["prompt_ids"].append(1)  # width 37: 10 pages
    assert recording_pool_pages(t) == 23
    t["config"]["max_batch"] = 3
    assert recording_pool_pages(t) == 1 + 3 * 11
    assert recording_pool_pages(dict(config=tree_cfg(page_size=1, max_batch=1), requests=[])) == 1 + (4 + 6 + 1)


@pytest.mark.parametrize("n,ok", [(2, True), (21, True), (1, False), (22, False), (0, False), (21.0, False),
                                  (None, False)])
def test_pool_size_problem_bounds_num_pages_by_the_recording_pool(n, ok):
    t = dict(config=tree_cfg(num_pages=n), requests=[dict(prompt_ids=[1] * 7, max_new_tokens=3),
                                                     dict(prompt_ids=[1] * 2, max_new_tokens=9)])
    if n is None:
        del t["config"]["num_pages"]
    why = pool_size_problem(t)
    assert (why is None) == ok
    if not ok:
        assert why == (f"config num_pages = {n}: not the pool the recording engine gives these requests (an int, "
                       f"2 .. 21 pages, page 0 included); a replay allocates num_pages")


# TR-006's worked tree: tokens [root 5, 10, 11, 20, 21, 22, 30], parents [-1, 0, 0, 1, 1, 2, 3]
PAR, TOK = [-1, 0, 0, 1, 1, 2, 3], [5, 10, 11, 20, 21, 22, 30]


def test_greedy_path_walks_the_first_matching_child():
    assert greedy_path(PAR, TOK, [10, 21, 0, 0, 99, 0, 0]) == [0, 1, 4]
    assert greedy_path(PAR, TOK, [10, 20, 0, 30, 0, 0, 0]) == [0, 1, 3, 6]  # down to the last node
    assert greedy_path(PAR, TOK, [12, 0, 0, 0, 0, 0, 0]) == [0]
    assert greedy_path([-1, 0, 0], [5, 10, 10], [10, 1, 2]) == [0, 1]
    assert greedy_path([-1, 0], [5, 10], [10, 7]) == [0, 1]


def tree_entry(path, pred=(10, 21, 0, 0, 99, 0, 0)):
    return dict(parents=PAR, draft_tokens=TOK, target_predict=list(pred), accept_path=path)


def test_acceptance_passes_the_greedy_path_and_its_tokens():
    """Path 0 -> 1 -> 4 emits 10, 21 and the bonus 99 (target_predict at node 4); a last round
    cut by its budget emits a prefix of them."""
    e = tree_entry([0, 1, 4])
    assert acceptance_failures(e, 5, [10, 21, 99], 3) == []
    assert acceptance_failures(e, 5, [10], 3) == []
    assert acceptance_failures(e, 5, [], 3) == []


def test_acceptance_refuses_a_root_that_is_not_the_committed_token():
    assert acceptance_failures(tree_entry([0, 1, 4]), 6, [10, 21, 99], 3) == [
        "[TR-003] draft_tokens[0] = 5: the root must be the committed last token output_ids[3] = 6"]


def test_acceptance_refuses_a_path_that_is_not_the_greedy_walk():
    out = acceptance_failures(tree_entry([0, 1, 3]), 5, [10, 20, 0], 3)
    assert out == [
        f"[TR-006] accept_path [0, 1, 3] is not the greedy walk [0, 1, 4] over the recorded draft_tokens {TOK} / "
        f"target_predict [10, 21, 0, 0, 99, 0, 0] (from the root, the first child whose token is the target's "
        f"prediction at the current node)"]


@pytest.mark.parametrize("emitted", [[10, 21, 98], [10, 22], [11], [10, 21, 99, 1]])
def test_acceptance_refuses_output_tokens_the_path_does_not_give(emitted):
    assert acceptance_failures(tree_entry([0, 1, 4]), 5, emitted, 3) == [
        f"[TR-006] the round emitted output_ids[4:{4 + len(emitted)}] = {emitted}; accept_path [0, 1, 4] gives its "
        f"draft tokens + the bonus = [10, 21, 99]"]


@pytest.mark.parametrize("path", [[0, 7], [0, -1], [0, 1.0]])
def test_acceptance_stops_at_a_path_off_the_tree(path):
    """A node id outside the tree cannot give tokens: the walk line is the one failure."""
    out = acceptance_failures(tree_entry(path), 5, [10, 21, 99], 3)
    assert len(out) == 1 and out[0].startswith(f"[TR-006] accept_path {path} is not the greedy walk")


def test_round_tokens_by_hand():
    """Request 0 (a = 2, 3) and 1 (a = 1, 2, 1): the root is output_ids[sum of earlier a]."""
    t = dict(requests=[dict(rid=0, output_ids=[3, 4, 5, 31]), dict(rid=1, output_ids=[0, 8, 9, 10, 11])],
             rounds=[dict(rids=[0, 1], num_accept_tokens=[2, 1]), dict(rids=[1, 0], num_accept_tokens=[2, 3]),
                     dict(rids=[1], num_accept_tokens=[1])])
    assert round_tokens(t) == [
        [(3, [4, 5], 0), (0, [8], 0)],
        [(8, [9, 10], 1), (5, [31], 2)],
        [(10, [11], 3)],
    ]


def test_greedy_path_never_walks_back_to_an_earlier_node():
    """Node 1 names node 2 as its parent (a hand edit against TR-003's order): from node 2 the
    walk looks only at later nodes, so it stops although node 1's token matches."""
    assert greedy_path([-1, 2, 0], [5, 10, 20], [20, 0, 10]) == [0, 2]


def test_acceptance_root_index_defaults_to_the_first_output_token():
    e = tree_entry([0, 1, 4])
    assert acceptance_failures(e, 6, [10, 21, 98]) == [
        "[TR-003] draft_tokens[0] = 5: the root must be the committed last token output_ids[0] = 6",
        "[TR-006] the round emitted output_ids[1:4] = [10, 21, 98]; accept_path [0, 1, 4] gives its draft tokens "
        "+ the bonus = [10, 21, 99]"]
