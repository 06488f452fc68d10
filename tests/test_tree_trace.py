"""Tree traces (refspec.traces.tree, record --topk, replay): a recorded top-k > 1 run's
rounds re-run through the FA3 tree wing against the oracle, and a tampered recording fails by ID.

A tiny random-init model stands in for SmolLM2 (3 requests, ``max_batch = 2`` so the third joins
mid-run, k = 2, N = 4, S = 3, P = 4: branch tails are copied), recorded from the v1 and the v2
tree round; the committed SmolLM2 tree traces (v1 and v2) replay too.
"""

from __future__ import annotations

import copy
import functools
import json
import random
from pathlib import Path

import pytest
import torch

from refspec.traces.replay_tree import replay_tree_trace
from refspec.cli.record import record
from refspec.cli.replay import main as replay_main
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.traces.chain import check_trace, is_tree_trace, load_trace, save_trace
from refspec.traces.tree import TREE_FORMAT, ancestors_and_self, from_runs, mask_tree_rows, to_runs

COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "mtbench_smollm2_tree.json"
COMMITTED_V2 = COMMITTED.with_name("mtbench_smollm2_tree_v2.json")
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (5, 11, 7)]
BUDGETS = [14, 9, 12]
K, N, S, P = 2, 4, 3, 4


@functools.lru_cache(maxsize=None)
def recorded() -> dict:
    m = init_random_(LlamaModel(tiny_config()), seed=4).eval()
    return record(m, None, PROMPTS, BUDGETS, version="v1", page_size=P, num_steps=S, draft="early-exit:1",
                  max_batch=2, capture_bs=(1, 2), check=True, topk=K, num_draft_tokens=N)


@functools.lru_cache(maxsize=None)
def recorded_v2() -> dict:
    m = init_random_(LlamaModel(tiny_config()), seed=4).eval()
    return record(m, None, PROMPTS, BUDGETS, version="v2", page_size=P, num_steps=S, draft="early-exit:1",
                  max_batch=2, capture_bs=(1, 2), check=True, topk=K, num_draft_tokens=N)


def tampered(fn, v2=False) -> dict:
    t = copy.deepcopy(recorded_v2() if v2 else recorded())
    fn(t)
    return t


def failures(report) -> str:
    return "\n".join(f for r in report.rounds for f in r.failures)


def test_runs_and_mask_rows_by_hand():
    assert to_runs([3, 4, 5, 9, 10, 12]) == [[3, 3], [9, 2], [12, 1]]
    assert from_runs([[3, 3], [9, 2], [12, 1]]) == [3, 4, 5, 9, 10, 12]
    # two requests, L = 1 and 2, N = 2: rows [prefix | tree]; request 1 starts at N * (L_0 + N) = 6
    flat = [1, 1, 0, 1, 1, 1] + [1, 1, 1, 0, 1, 1, 0, 1]
    assert mask_tree_rows([bool(x) for x in flat], [1, 2], 2) == [["10", "11"], ["10", "01"]]
    assert ancestors_and_self([-1, 0, 1, 0, -1], 2) == [0, 1, 2]
    assert ancestors_and_self([-1, 0, 1, 0, -1], 4) == [0, 4]  # an orphan sees the root and itself


@pytest.mark.spec("TR-003", "TR-004", "TR-005", "TR-006", "PA-002")
def test_recorded_tree_trace_carries_each_rounds_kernel_inputs():
    t = recorded()
    assert t["format"] == TREE_FORMAT and is_tree_trace(t)
    assert t["config"]["topk"] == K and t["config"]["num_draft_tokens"] == N and t["config"]["version"] == "v1"
    check_trace(t)
    assert any(2 in rd["joined"] for rd in t["rounds"][1:])
    for rd in t["rounds"]:
        for e, L, a in zip(rd["tree"], rd["seq_lens"], rd["num_accept_tokens"]):
            slots = from_runs(e["req_to_token"])
            assert len(slots) == L + N and len(e["page_table"]) == -(-L // P)
            assert e["mask"][0] == "1" + "0" * (N - 1) and e["positions"][0] == L and e["parents"][0] == -1
            assert len(e["accept_path"]) == a and e["accept_path"][0] == 0
            assert len(e["draft_cache_loc"]) == K and all(len(b) == S for b in e["draft_cache_loc"])
            for p in range(L):  # PA-002 by hand
                assert e["page_table"][p // P] * P + p % P == slots[p]


@pytest.mark.spec("TR-008", "TR-010", "TR-012", "TR-015", "TR-017", "TR-019")
def test_record_then_replay_round_trip(tmp_path):
    path = save_trace(recorded(), tmp_path / "tree.json")
    loaded = load_trace(path)
    assert loaded == json.loads(json.dumps(recorded()))
    rep = replay_tree_trace(loaded, trace_path=str(path))
    assert rep.ok, rep.to_markdown()
    assert len(rep.rounds) == len(loaded["rounds"])
    assert all(set(r.worst) == {"draft", "verify", "extend"} and max(r.worst.values()) < 100 for r in rep.rounds)


@pytest.mark.spec("TOL-002")
def test_low_precision_replay_uses_the_t1_budget():
    """bf16 through the emulator (the path a CUDA replay takes): T1 against the fp32 oracle with
    the oracle's own bf16 run as the budget, every phase of every round."""
    rep = replay_tree_trace(recorded(), dtype=torch.bfloat16)
    assert rep.ok and rep.dtype == "bfloat16", rep.to_markdown()
    assert max(max(r.worst.values()) for r in rep.rounds) > 1  # bf16 rounding shows, within budget


def _sibling_visible(t):
    """The first recorded node with a sibling sees it in its stored mask row."""
    for rd in t["rounds"]:
        for e in rd["tree"]:
            par = e["parents"]
            for i in range(1, N):
                sib = next((j for j in range(1, N) if j != i and par[j] == par[i] and par[i] >= 0), None)
                if sib is not None:
                    row = list(e["mask"][i])
                    row[sib] = "1"
                    e["mask"][i] = "".join(row)
                    return
    raise AssertionError("no node with a sibling in the recorded trees")


def _page_changed(t):
    e = next(e for rd in t["rounds"] for e in rd["tree"] if len(e["page_table"]) >= 2)
    e["page_table"][1] += 1


def _path_off_tree(t):
    e = next(e for rd in t["rounds"] for e, a in zip(rd["tree"], rd["num_accept_tokens"]) if a >= 2)
    e["accept_path"][1] = next(i for i in range(1, N) if e["parents"][i] != 0)


def _position_shifted(t):
    t["rounds"][0]["tree"][0]["positions"][1] += 1


def _branch_slot_moved(t):
    e = next(e for rd in t["rounds"] for e, L in zip(rd["tree"], rd["seq_lens"]) if L % P)
    e["draft_cache_loc"][1][0] += 1


def _self_parent(t):
    """A node made its own parent (a cycle): the ancestor walk must stop and name TR-003, not hang."""
    e = t["rounds"][0]["tree"][0]
    e["parents"][N - 1] = N - 1


@pytest.mark.spec("TR-004", "PA-002", "TR-005", "TR-015", "TR-003")
@pytest.mark.parametrize("tamper,ids", [(_sibling_visible, ["TR-004", "TR-012"]), (_page_changed, ["PA-002", "TR-010"]),
                                        (_position_shifted, ["TR-005"]),
                                        (_branch_slot_moved, ["TR-015"]), (_self_parent, ["TR-003"])])
def test_tampered_tree_trace_fails_replay_naming_the_invariant(tamper, ids):
    t = tampered(tamper)
    check_trace(t)  # shapes are intact: only the rules are broken
    rep = replay_tree_trace(t)
    text = failures(rep)
    assert not rep.ok
    for inv in ids:
        assert f"[{inv}]" in text, text
    assert "FAIL" in rep.to_markdown()


@pytest.mark.spec("TR-004")
def test_replay_cli_detects_a_tree_trace(tmp_path, capsys):
    good = save_trace(recorded(), tmp_path / "tree.json")
    assert replay_main([str(good)]) == 0
    assert "tree trace" in capsys.readouterr().out
    bad = save_trace(tampered(_sibling_visible), tmp_path / "bad.json")
    assert replay_main([str(bad), "--out", str(tmp_path / "r.md")]) == 1
    assert "[TR-004]" in capsys.readouterr().out and "[TR-004]" in (tmp_path / "r.md").read_text()
    assert replay_main([str(good), "--page-sizes", "1"]) == 2  # the layout was recorded at one P
    assert "not for a tree trace" in capsys.readouterr().err


def test_malformed_tree_entries_are_refused():
    for fn, msg in [(lambda t: t["rounds"][0]["tree"].pop(), "one entry per request"),
                    (lambda t: t["rounds"][0]["tree"][0]["mask"].pop(), "mask"),
                    (lambda t: t["rounds"][0]["tree"][0]["draft_tokens"].pop(), "draft_tokens and target_predict"),
                    (lambda t: t["rounds"][0]["tree"][0]["req_to_token"][0].__setitem__(1, 0), "count >= 1"),
                    (lambda t: t["rounds"][0]["tree"][0]["accept_path"].append(1), "accept_path"),
                    (lambda t: t["config"].pop("topk"), "topk")]:
        with pytest.raises(ValueError, match=msg):
            check_trace(tampered(fn))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_record_refuses_tree_with_overlap(version):
    m = init_random_(LlamaModel(tiny_config()), seed=4).eval()
    with pytest.raises(ValueError, match="overlap schedule is not implemented"):
        record(m, None, PROMPTS[:1], BUDGETS[:1], version=version, page_size=P, draft="early-exit:1", topk=2,
               overlap=True)


# R = alloc_len_per_decode at k = 2, S = 3, P = 4, N = 4, by hand: a branch spans at most
# ceil((P - 1 + S) / P) = 2 pages, so R = max(2 pages * 4 * k, N) = 16 positions (TR-020)
R = 16


@pytest.mark.spec("TR-020", "TR-021", "TR-008", "TR-012", "TR-019")
def test_v2_record_then_replay_round_trip(tmp_path):
    t = recorded_v2()
    assert t["format"] == TREE_FORMAT and t["config"]["version"] == "v2"
    check_trace(t)
    for rd in t["rounds"]:
        for e, L, a in zip(rd["tree"], rd["seq_lens"], rd["num_accept_tokens"]):
            slots = from_runs(e["req_to_token"])
            assert len(slots) >= L + R and len(set(slots)) == len(slots)  # the reserve, distinct slots
            assert {x for b in e["draft_cache_loc"] for x in b} <= set(slots)  # branch slots inside it
            assert e["draft_cache_loc"][0] == slots[L:L + S]  # branch 0 continues the row at L
            assert e["moved_to"] == slots[L:L + a] and e["kept_row"] == a - 1
    path = save_trace(t, tmp_path / "tree_v2.json")
    loaded = load_trace(path)
    assert loaded == json.loads(json.dumps(t))
    rep = replay_tree_trace(loaded, trace_path=str(path))
    assert rep.ok, rep.to_markdown()
    assert len(rep.rounds) == len(t["rounds"]) and rep.graphs
    assert all(set(r.worst) == {"draft", "verify", "extend"} and max(r.worst.values()) < 100 for r in rep.rounds)
    assert replay_main([str(path)]) == 0


def _kept_row_moved(t):
    """The kept draft-extend row one past a - 1: the row that saw one window token too many."""
    e = next(e for rd in t["rounds"] for e, a in zip(rd["tree"], rd["num_accept_tokens"]) if a < N)
    e["kept_row"] += 1


def _moved_to_changed(t):
    """The path's first node 'moved' into the next verify slot instead of the first."""
    e, L = next((e, L) for rd in t["rounds"] for e, L, a in zip(rd["tree"], rd["seq_lens"],
                                                                  rd["num_accept_tokens"]) if a < N)
    e["moved_to"][0] = from_runs(e["req_to_token"])[L + N - 1]


def _branch_outside_reserve(t):
    """Branch 1's last draft slot replaced by a slot of the pool (past page 0) the row does not hold
    (a slot outside the pool is PA-011, refused on load: tests/test_tree_trace_checks.py)."""
    e = t["rounds"][0]["tree"][0]
    held = set(from_runs(e["req_to_token"]))
    e["draft_cache_loc"][1][-1] = next(s for s in range(P, t["config"]["num_pages"] * P) if s not in held)


@pytest.mark.spec("TR-020", "TR-021")
@pytest.mark.parametrize("tamper,ids", [(_kept_row_moved, ["TR-021"]), (_moved_to_changed, ["TR-020"]),
                                        (_branch_outside_reserve, ["TR-020"])])
def test_tampered_v2_tree_trace_fails_replay_naming_the_invariant(tamper, ids):
    t = tampered(tamper, v2=True)
    check_trace(t)  # shapes are intact: only the rules are broken
    rep = replay_tree_trace(t, graphed=False)
    text = failures(rep)
    assert not rep.ok and "FAIL" in rep.to_markdown()
    for inv in ids:
        assert f"[{inv}]" in text, text


@pytest.mark.spec("TR-019", "TR-020", "TR-021", "TR-006", "PA-011")
@pytest.mark.parametrize("path,version", [(COMMITTED, "v1"), (COMMITTED_V2, "v2")])
def test_committed_smollm2_tree_trace_replays_on_cpu(path, version):
    """Loads (page ids in the recorded pool, every path the target's greedy walk) and replays."""
    t = load_trace(path)
    assert is_tree_trace(t) and t["source"]["checked_against_greedy"] and path.stat().st_size < 200_000
    assert t["config"]["version"] == version
    torch.set_num_threads(1)
    rep = replay_tree_trace(t, trace_path=str(path))
    assert rep.ok, rep.to_markdown()


@pytest.mark.parametrize("argv,msg", [(["--num-draft-tokens", "4"], "needs --topk"),
                                      (["--topk", "2", "--num-steps", "1", "--num-draft-tokens", "5"], "TR-002")])
def test_record_cli_refuses_bad_tree_flags_before_loading_the_model(tmp_path, capsys, argv, msg):
    from refspec.cli.record import main as record_main
    assert record_main(["--out", str(tmp_path / "t.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("path,tamper,inv", [
    pytest.param(COMMITTED, _sibling_visible, "TR-004", id="v1", marks=pytest.mark.spec("TR-012", "TOL-002")),
    pytest.param(COMMITTED_V2, _kept_row_moved, "TR-021", id="v2",
                 marks=pytest.mark.spec("TR-020", "TR-021", "TOL-002")),
])
def test_gpu_replays_the_committed_tree_trace_with_real_fa3(path, tamper, inv):
    """On Hopper: bf16 through the real FA3 kernel, T1 against the fp32 slot oracle, every round
    (v2: DRAFT_EXTEND_V2 over N rows included); a tampered trace (v1: a sibling visible in the
    mask; v2: the kept row moved) still fails by ID."""
    t = load_trace(path)
    rep = replay_tree_trace(t, device="cuda", dtype=torch.bfloat16, trace_path=str(path))
    assert rep.provider != "emulator", "on Hopper the real FA3 kernel must be selected"
    assert rep.ok, rep.to_markdown()
    bad = copy.deepcopy(t)
    tamper(bad)
    assert f"[{inv}]" in failures(replay_tree_trace(bad, device="cuda", dtype=torch.bfloat16))


@pytest.mark.spec("TR-018")
def test_graph_replay_that_does_not_write_metadata_in_place_fails(monkeypatch):
    """Each round also replays verify and draft decode through the production tree graphs; a
    replay whose metadata write into the captured buffers is lost (the prefix page table, the one
    part replay writes; the rest is the graph's own work) reads the capture-time batch."""
    rep = replay_tree_trace(recorded())
    assert rep.graphs and all(r.graphs == ["verify", "draft"] for r in rep.rounds), rep.to_markdown()
    from refspec.speculative.tree import graphs as tree_graphs
    monkeypatch.setattr(tree_graphs, "replay_page_table", lambda *a: None)
    rep = replay_tree_trace(recorded())
    assert not rep.ok and "[TR-018] tree verify: graph replay" in failures(rep)
    monkeypatch.undo()  # and a graph that does not write its prefix lengths itself
    monkeypatch.setattr(tree_graphs, "write_prefix_lengths", lambda pre, K: None)
    rep = replay_tree_trace(recorded())
    assert not rep.ok and "[TR-018] tree verify: graph replay" in failures(rep)
    assert replay_tree_trace(recorded(), graphed=False).ok  # eager alone does not see it
