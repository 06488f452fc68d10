"""Tree traces are checked on load and in replay (refspec.traces.tree_checks): every
page id lies in the recorded pool and outside page 0 (PA-011 / PA-008), and every accepted path is
the greedy walk over the recorded node tokens and target predictions, emitting the request's
output tokens (TR-006; the root is the committed last token, TR-003).

The recordings are test_tree_trace's (a tiny random-init model, v1 and v2, k = 2, N = 4, S = 3,
P = 4) and the committed SmolLM2 tree traces.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
from test_tree_trace import (BUDGETS, COMMITTED, COMMITTED_V2, PROMPTS, P, _path_off_tree, failures, recorded,
                             recorded_v2)

from refspec.traces.replay_tree import replay_tree_trace
from refspec.cli.replay import main as replay_main
from refspec.traces.chain import check_trace, load_trace, save_trace
from refspec.traces.tree import from_runs
from refspec.traces.tree_checks import greedy_path


def entries(t):
    """(round index, request's position in the round, entry, a, index of the root in output_ids)."""
    done = {r["rid"]: 0 for r in t["requests"]}
    for i, rd in enumerate(t["rounds"]):
        for b, (rid, e, a) in enumerate(zip(rd["rids"], rd["tree"], rd["num_accept_tokens"])):
            yield i, b, e, a, done[rid]
            done[rid] += a


@pytest.mark.spec("TR-006")
def test_greedy_path_by_hand():
    # TR-006's worked example: tokens [root, 10, 11, 20, 21, 22, 30], parents [-1, 0, 0, 1, 1, 2, 3]
    par, tok = [-1, 0, 0, 1, 1, 2, 3], [5, 10, 11, 20, 21, 22, 30]
    assert greedy_path(par, tok, [10, 21, 0, 0, 99, 0, 0]) == [0, 1, 4]  # root -> 10 -> 21 (10's 2nd child)
    assert greedy_path(par, tok, [12, 0, 0, 0, 0, 0, 0]) == [0]  # no child of the root is 12: n = 0
    assert greedy_path(par, tok, [11, 0, 22, 0, 0, 7, 0]) == [0, 2, 5]
    assert greedy_path([-1, 0, 0], [5, 10, 10], [10, 1, 2]) == [0, 1]  # equal siblings: the first in node order
    assert greedy_path([-1, 0, 2], [5, 10, 10], [10, 10, 10]) == [0, 1]  # a hand-edited cycle ends the walk


@pytest.mark.spec("TR-003", "TR-006", "PA-008", "PA-011")
@pytest.mark.parametrize("rec", [recorded, recorded_v2], ids=["v1", "v2"])
def test_recorded_tree_trace_holds_the_pool_and_each_trees_tokens(rec):
    """By hand, per request-round: the root token is the committed last output token, the path
    takes at each node a child whose token is the target's prediction there (the first such
    child) and stops where no child is, the round's output is the path's tokens + the bonus; every
    slot and page lies in pages 1 .. num_pages - 1."""
    t = rec()
    NP, outs = t["config"]["num_pages"], {r["rid"]: r["output_ids"] for r in t["requests"]}
    assert isinstance(NP, int) and NP >= 2
    for i, b, e, a, s in entries(t):
        o, tok, pred, par, path = (outs[t["rounds"][i]["rids"][b]], e["draft_tokens"], e["target_predict"],
                                   e["parents"], e["accept_path"])
        assert tok[0] == o[s]
        for cur, nxt in zip(path, path[1:]):
            assert par[nxt] == cur and tok[nxt] == pred[cur]
            assert not any(par[c] == cur and tok[c] == pred[cur] for c in range(1, nxt))
        assert not any(par[c] == path[-1] and tok[c] == pred[path[-1]] for c in range(1, len(par)))
        emitted = o[s + 1:s + 1 + a]
        assert emitted == ([tok[j] for j in path[1:]] + [pred[path[-1]]])[:len(emitted)] and emitted
        pages = [x // P for x in from_runs(e["req_to_token"]) + [y for br in e["draft_cache_loc"] for y in br]
                 + e.get("moved_to", [])] + e["page_table"]
        assert all(0 < pg < NP for pg in pages)


def _set(path, value):
    """A tamper that writes ``value`` at ``path`` (keys / indices from the trace root)."""
    def fn(t):
        x = t
        for k in path[:-1]:
            x = x[k]
        x[path[-1]] = value(x[path[-1]]) if callable(value) else value
    return fn


_E = ("rounds", 0, "tree", 0)
PAGE_TAMPERS = [  # (tamper, v2 recording?, the ID and field the load error must name)
    (_set(_E + ("req_to_token", 0, 0), 10**9), False, "[PA-011] req_to_token[0]"),
    (_set(_E + ("req_to_token", 0, 1), 10**9), True, "[PA-011] req_to_token[0]"),  # v2: a run past the pool
    (_set(_E + ("req_to_token", 0, 0), 0), False, "[PA-008] req_to_token[0]"),
    (_set(_E + ("page_table", 0), 0), False, "[PA-008] page_table[0]"),
    (_set(_E + ("page_table", 0), -3), False, "[PA-011] page_table[0]"),
    (_set(_E + ("draft_cache_loc", 1, 2), 10**9), False, "[PA-011] draft_cache_loc[1][2]"),
    (_set(_E + ("draft_cache_loc", 0, 0), P - 1), False, "[PA-008] draft_cache_loc[0][0]"),
    (_set(_E + ("req_pool_index",), 0), False, "[PA-008] req_pool_index = 0"),
    (_set(_E + ("req_pool_index",), 10**9), False, "[PA-011] req_pool_index"),
    (_set(_E + ("moved_to", 0), 1), True, "[PA-008] moved_to[0]"),
    (_set(_E + ("moved_to", 0), 10**9), True, "[PA-011] moved_to[0]"),
    (_set(_E + ("page_table", 0), 13.0), False, "[PA-011] page_table[0]"),  # a float is no page id
    (_set(_E + ("req_to_token", 0, 0), "52"), False, "[PA-011] req_to_token[0]"),
]


@pytest.mark.spec("PA-008", "PA-011")
@pytest.mark.parametrize("tamper,v2,named", PAGE_TAMPERS, ids=[f"{i}-{n.split()[0][1:-1]}-{n.split()[1]}"
                                                                for i, (_, _v, n) in enumerate(PAGE_TAMPERS)])
def test_a_page_id_outside_the_pool_or_in_page_0_fails_on_load_and_in_replay(tmp_path, tamper, v2, named):
    t = copy.deepcopy(recorded_v2() if v2 else recorded())
    tamper(t)
    with pytest.raises(ValueError, match=re.escape(named)):
        check_trace(t)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(t))
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert named in str(err.value) and "\n" not in str(err.value) and str(path) in str(err.value)
    rep = replay_tree_trace(t, graphed=False)  # the pool is the recorded one: no giant allocation
    assert not rep.ok and named.split()[0] in failures(rep) and not rep.rounds[0].worst  # round 0 not run
    assert all(not r.failures for r in rep.rounds[1:])  # only the edited round fails


@pytest.mark.spec("PA-011")
def test_replay_cli_refuses_a_huge_page_id_in_the_committed_trace(tmp_path, capsys):
    """The fresh user's case: one hand-edited page id in the committed trace.  Replay used to size
    its pool from it and fail allocating; now the load names the rule and the field, in one line."""
    t = json.loads(COMMITTED.read_text())
    t["rounds"][0]["tree"][0]["req_to_token"][0][0] = 10**9
    bad = tmp_path / "huge.json"
    bad.write_text(json.dumps(t))
    assert replay_main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[PA-011] req_to_token[0] = [1000000000," in err, err
    assert "round 0 request 0" in err and "num_pages = " in err and "cannot allocate" not in err


def test_a_pool_larger_than_the_recording_engines_is_refused_before_anything_is_allocated(tmp_path):
    """A hand-edited num_pages = 10**9 would make the replay's allocator list 10**9 free pages."""
    t = copy.deepcopy(recorded())
    most = t["config"]["num_pages"]  # record's pool: 1 + max_batch * (ceil(width / P) + 1), width by hand:
    ctx = max(len(p) for p in PROMPTS) + max(BUDGETS)  # generate's max_context
    assert most == 1 + 2 * (-(-(ctx + 4 + 16) // P) + 1)  # + 4 + R, R = 16 at k = 2, S = 3, N = 4, P = 4 (TR-020)
    t["config"]["num_pages"] = 10**9
    with pytest.raises(ValueError, match=f"num_pages = 1000000000: not the pool .* 2 .. {most} pages"):
        check_trace(t)
    with pytest.raises(ValueError, match="num_pages = 1000000000"):
        replay_tree_trace(t)
    bad = tmp_path / "pool.json"
    bad.write_text(json.dumps(t))
    assert replay_main([str(bad)]) == 2


def test_a_tree_trace_without_num_pages_is_refused():
    t = copy.deepcopy(recorded())
    del t["config"]["num_pages"]
    with pytest.raises(ValueError, match="and num_pages"):
        check_trace(t)
    t = copy.deepcopy(recorded())
    del t["rounds"][0]["tree"][0]["target_predict"]
    with pytest.raises(ValueError, match="target_predict"):
        check_trace(t)


def _wrong_path(t):
    """The first request-round whose tree has another root-to-node path of a nodes: its
    accept_path becomes that path (a valid path of the same tree, not the target's choice).
    Returns (round, position in the round, entry, the root's index in output_ids)."""
    for i, b, e, a, s in entries(t):
        par, paths = e["parents"], [[0]]
        for _ in range(a - 1):
            paths = [p + [c] for p in paths for c in range(1, len(par)) if par[c] == p[-1]]
        other = next((p for p in paths if p != e["accept_path"]), None)
        if a >= 2 and other:
            e["accept_path"] = other
            return i, b, e, s
    raise AssertionError("no request-round with another path of a nodes")


def _path_only(t):
    _wrong_path(t)


def _path_and_outputs(t):
    """The path and the request's output tokens both edited to the wrong path (its draft tokens +
    the bonus there), the target predictions left as recorded: only the greedy walk tells."""
    i, b, e, s = _wrong_path(t)
    o = t["requests"][t["rounds"][i]["rids"][b]]["output_ids"]
    want = [e["draft_tokens"][j] for j in e["accept_path"][1:]] + [e["target_predict"][e["accept_path"][-1]]]
    n = min(len(want), len(o) - s - 1)
    o[s + 1:s + 1 + n] = want[:n]


def _root_token(t):
    t["rounds"][1]["tree"][0]["draft_tokens"][0] += 1


@pytest.mark.spec("TR-006", "TR-003")
@pytest.mark.parametrize("source", ["v1", "v2", "committed"])
@pytest.mark.parametrize("tamper,inv,says", [(_path_only, "TR-006", "is not the greedy walk"),
                                             (_path_and_outputs, "TR-006", "is not the greedy walk"),
                                             (_path_off_tree, "TR-006", "is not the greedy walk"),
                                             (_root_token, "TR-003", "the committed last token")])
def test_a_valid_but_wrong_accepted_path_fails_on_load_and_in_replay(source, tamper, inv, says):
    t = copy.deepcopy({"v1": recorded, "v2": recorded_v2}[source]() if source != "committed"
                      else json.loads(COMMITTED.read_text()))
    check_trace(t)
    tamper(t)
    with pytest.raises(ValueError, match=re.escape(f"[{inv}]")) as err:
        check_trace(t)
    assert says in str(err.value) and "\n" not in str(err.value)
    text = failures(replay_tree_trace(t, graphed=False))  # the replay names it too (its kernels still pass)
    assert f"[{inv}]" in text and says in text and "[TR-012]" not in text, text
    if tamper is _path_and_outputs:  # the outputs agree with the edited path: only the walk tells
        assert "gives its draft tokens + the bonus" not in text, text


@pytest.mark.spec("TR-006", "PA-011")
@pytest.mark.parametrize("path", [COMMITTED, COMMITTED_V2], ids=["v1", "v2"])
def test_committed_tree_traces_carry_the_pool_and_the_tokens(tmp_path, path):
    """The committed traces load (every check above passes on them) and a saved copy loads equal."""
    t = load_trace(path)
    assert t["config"]["num_pages"] >= 2
    assert all(len(e["draft_tokens"]) == len(e["target_predict"]) == t["config"]["num_draft_tokens"]
               for rd in t["rounds"] for e in rd["tree"])
    assert load_trace(save_trace(t, tmp_path / "copy.json")) == t
