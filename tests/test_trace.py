"""Traces (refspec.traces.chain, record, replay): a recorded schedule replays exactly on another model.

A tiny random-init model stands in for SmolLM2 here (the real-model round trip is in
test_demo.py): 3 requests with different budgets and an EOS that ends one request inside a
round, ``max_batch = 2`` so the third joins mid-run.  The replay forces the recorded a per
request-round and must reproduce batch membership, seq_lens, a, joins and finishes round for
round (SD-008: L grows by a), with production == oracle loop == plain greedy in fp32 (TOL-001).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import random
from pathlib import Path

import pytest
import torch

from refspec.mutants import variants
from refspec.traces import replay as replay_mod
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.loop import greedy
from refspec.cli.record import record
from refspec.cli.replay import main as replay_main
from refspec.traces.replay import replay_trace
from refspec.speculative.metrics import RoundTrace
from refspec.traces.chain import check_trace, dumps, load_trace, save_trace, schedule_mismatches

COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "mtbench_smollm2.json"
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (5, 11, 7)]
BUDGETS = [14, 9, 12]


@functools.lru_cache(maxsize=None)
def model() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=4).eval()


@functools.lru_cache(maxsize=None)
def eos_token() -> int:
    """A token request 0 emits at step 6 of its greedy run (not earlier): an EOS mid-run."""
    out = greedy(model(), PROMPTS[0], BUDGETS[0]).tokens
    return next(t for i, t in enumerate(out) if i >= 6 and t not in out[:i])


@functools.lru_cache(maxsize=None)
def recorded() -> dict:
    return record(model(), None, PROMPTS, BUDGETS, version="v1", page_size=2, draft="early-exit:1", max_batch=2,
                  eos=eos_token(), capture_bs=(1, 2), check=True)


@functools.lru_cache(maxsize=None)
def recorded_overlap() -> dict:
    """The same run under the overlap loop (v2): the EOS of request 0 is read one round late."""
    return record(model(), None, PROMPTS, BUDGETS, version="v2", page_size=2, draft="early-exit:1", max_batch=2,
                  eos=eos_token(), capture_bs=(1, 2), check=True, overlap=True)


def tampered(fn) -> dict:
    t = copy.deepcopy(recorded())
    fn(t)
    return t


@pytest.mark.spec("SD-008", "SD-003")
def test_recorded_trace_has_joins_eos_and_consistent_lengths():
    t = recorded()
    reqs, rounds = t["requests"], t["rounds"]
    assert reqs[0]["finish_reason"] == "eos" and reqs[0]["output_ids"][-1] == eos_token()
    assert len(reqs[0]["output_ids"]) < BUDGETS[0]
    assert any(2 in rd["joined"] for rd in rounds[1:]), "request 2 must join after a slot frees (max_batch 2)"
    assert all(len(rd["rids"]) <= 2 for rd in rounds)
    for r in reqs:  # hand rule: L_(k+1) = L_k + a_k, starting at the prompt length
        Ls = [L for rd in rounds for rid, L in zip(rd["rids"], rd["seq_lens"]) if rid == r["rid"]]
        a = r["num_accept_tokens"]
        assert Ls == [len(r["prompt_ids"]) + sum(a[:k]) for k in range(len(a))]


@pytest.mark.spec("SD-008", "SD-002", "TOL-001", "KV-006")
@pytest.mark.parametrize("versions,page_sizes", [(None, None), (["v1", "v2"], [1, 3, 16])],
                         ids=["as-recorded", "other-versions-and-page-sizes"])
def test_round_trip_replays_schedule_exactly(tmp_path, versions, page_sizes):
    path = save_trace(recorded(), tmp_path / "t.json")
    trace = load_trace(path)
    assert trace == json.loads(json.dumps(recorded()))
    rep = replay_trace(trace, versions=versions, page_sizes=page_sizes)
    assert len(rep.runs) == len(versions or [1]) * len(page_sizes or [1])
    for run in rep.runs:
        assert run.ok, (run.version, run.page_size, run.schedule, run.tokens)
        assert run.rounds == len(trace["rounds"]) and all(x["match"] for x in run.per_round)
        assert run.graph_replays > 0
    assert rep.ok


@pytest.mark.spec("SD-008", "SD-002", "SD-009", "KV-006")
def test_overlap_trace_round_trips_and_reuses_a_freed_slot_one_round_later():
    """Under overlap request 0's EOS (round f) is read after round f + 1 was launched with it,
    so request 2 takes its slot in round f + 2 instead of f + 1; every token is the same and the
    overlap trace replays exactly under overlap (the config says so) at two page sizes."""
    plain, over = recorded(), recorded_overlap()
    assert over["config"]["overlap"] is True and "overlap" in plain["config"] and not plain["config"]["overlap"]
    assert [r["output_ids"] for r in over["requests"]] == [r["output_ids"] for r in plain["requests"]]

    def first(t, key, rid):
        return next(k for k, rd in enumerate(t["rounds"]) if rid in rd[key])
    f = first(plain, "finished", 0)
    assert first(over, "finished", 0) == f
    assert first(plain, "joined", 2) == f + 1 and first(over, "joined", 2) == f + 2
    rep = replay_trace(over, page_sizes=[2, 4])
    for run in rep.runs:
        assert run.ok, (run.page_size, run.schedule, run.tokens)
        assert run.rounds == len(over["rounds"]) and all(x["match"] for x in run.per_round)
    assert rep.ok


@pytest.mark.spec("TOL-001")
def test_replay_with_the_draft_models_own_tokens():
    rep = replay_trace(recorded(), drafter="model", versions=["v2"], page_sizes=[4])
    assert rep.ok and "production == oracle loop: yes" in rep.runs[0].tokens


@pytest.mark.spec("TOL-003")
def test_replay_bf16_uses_t2_against_fp32_greedy():
    rep = replay_trace(recorded(), dtype=torch.bfloat16, page_sizes=[4])
    assert rep.runs[0].tokens.startswith("T2 vs fp32 greedy")
    assert not rep.runs[0].schedule and rep.runs[0].oracle_accepts_ok
    with pytest.raises(ValueError, match="fp32"):
        replay_trace(recorded(), dtype=torch.bfloat16, drafter="model")


def test_replay_exits_nonzero_when_production_breaks(tmp_path):
    """The seed's page-table bug at P = 4: the replay reports what stopped production, exit 1."""
    path = save_trace(recorded(), tmp_path / "t.json")
    with variants.enabled("seed-page-table"):
        rc = replay_main([str(path), "--page-sizes", "4", "--out", str(tmp_path / "r.md")])
    assert rc == 1
    md = (tmp_path / "r.md").read_text()
    assert "production raised" in md and "**FAIL**" in md


def test_replay_flags_the_round_of_a_wrong_token(monkeypatch):
    """One production token flipped (request 1, output token 3): tokens fail, and exactly the
    round that emitted it is marked as not matching; the schedule itself still matches."""
    real = replay_mod.generate

    def flipped(*args, **kw):
        res = real(*args, **kw)
        if kw["backend"] == "fa3":
            res.requests[1].tokens[3] ^= 1
        return res
    monkeypatch.setattr(replay_mod, "generate", flipped)
    run = replay_trace(recorded()).runs[0]
    assert not run.ok and not run.tokens_ok and not run.schedule
    req1 = recorded()["requests"][1]
    k1 = next(k for k in range(len(req1["num_accept_tokens"])) if 1 + sum(req1["num_accept_tokens"][:k + 1]) > 3)
    rounds_of_1 = [k for k, rd in enumerate(recorded()["rounds"]) if 1 in rd["rids"]]
    assert [k for k, x in enumerate(run.per_round) if not x["match"]] == [rounds_of_1[k1]]


@pytest.mark.parametrize("what,fn,msg", [
    ("format", lambda t: t.update(format="other/9"), "format"),
    ("seq_len", lambda t: t["rounds"][1]["seq_lens"].__setitem__(0, t["rounds"][1]["seq_lens"][0] + 1), "seq_len"),
    ("a>N", lambda t: t["rounds"][0]["num_accept_tokens"].__setitem__(0, 5), "outside"),
    ("late-finish", lambda t: t["rounds"][-1]["finished"].clear(), "finished"),
    ("output-length", lambda t: t["requests"][1]["output_ids"].append(0), "output tokens"),
    ("batch", lambda t: t["config"].update(max_batch=1), "max_batch"),
    ("batch-type", lambda t: t["config"].update(max_batch="2"), "max_batch"),
    ("capture-huge", lambda t: t["config"].update(capture_bs=[1, 10**9]), "capture_bs"),
    ("capture-zero", lambda t: t["config"].update(capture_bs=[0, 2]), "capture_bs"),
    ("capture-empty", lambda t: t["config"].update(capture_bs=[]), "capture_bs"),
    ("capture-type", lambda t: t["config"].update(capture_bs="1,2"), "capture_bs"),
    ("layers-huge", lambda t: t["config"]["model_config"].update(num_hidden_layers=10**9), "parameter model"),
    ("vocab-huge", lambda t: t["config"]["model_config"].update(vocab_size=10**12), "parameter model"),
    ("hidden-type", lambda t: t["config"]["model_config"].update(hidden_size="64"), "hidden_size"),
    ("heads-ungrouped", lambda t: t["config"]["model_config"].update(
        num_key_value_heads=t["config"]["model_config"]["num_attention_heads"] + 1), "GQA"),
    ("steps-huge", lambda t: t["config"].update(num_steps=10**9), "num_steps"),
    ("prompt-token", lambda t: t["requests"][0]["prompt_ids"].__setitem__(0, 10**12), "vocabulary"),
    ("output-token", lambda t: t["requests"][1]["output_ids"].__setitem__(0, -1), "vocabulary"),
])
def test_check_trace_rejects_inconsistent_files(what, fn, msg):
    with pytest.raises(ValueError, match=msg):
        check_trace(tampered(fn))


def test_schedule_mismatches_names_round_and_field():
    t = recorded()
    rounds = [RoundTrace(k, rd["rids"], rd["seq_lens"], rd["num_accept_tokens"], [], rd["joined"], rd["finished"])
              for k, rd in enumerate(t["rounds"])]
    assert schedule_mismatches(t, rounds) == []
    rounds[2] = dataclasses.replace(rounds[2], num_accept_tokens=[9] * len(rounds[2].rids))
    assert schedule_mismatches(t, rounds) == [
        f"round 2: num_accept_tokens {[9] * len(rounds[2].rids)} != trace {t['rounds'][2]['num_accept_tokens']}"]
    assert "rounds replayed" in schedule_mismatches(t, rounds[:-1])[0]


def test_dumps_one_line_per_request_and_round():
    text = dumps(recorded())
    assert json.loads(text) == json.loads(json.dumps(recorded()))
    assert len(text.splitlines()) == 1 + 2 + len(recorded()["requests"]) + len(recorded()["rounds"]) + 2


@pytest.mark.spec("SD-008", "TOL-001")
def test_committed_mtbench_trace_replays_on_cpu(tmp_path):
    """The committed SmolLM2 / MT-Bench trace on a tiny body with SmolLM2's vocabulary (the
    schedule does not depend on the model; the full random-init SmolLM2 replays the same way in
    ~100 s on one core, and on the GPU in tests/test_gpu_trace.py)."""
    trace = load_trace(COMMITTED)
    assert COMMITTED.stat().st_size < 64 * 1024
    assert trace["source"]["checked_against_greedy"] is True
    assert any(rd["joined"] for rd in trace["rounds"][1:]), "later requests join as earlier ones finish"
    out = tmp_path / "replay.md"
    rc = replay_main([str(COMMITTED), "--tiny", "--out", str(out)])
    md = out.read_text()
    assert rc == 0, md
    assert "**PASS**" in md and md.count("| yes |") >= len(trace["rounds"])


def test_a_huge_max_batch_replays_with_the_engine_the_requests_need():
    """``max_batch`` above the number of requests admits the same requests: replay sizes its
    engine by ``min(max_batch, requests)`` (``largest_batch``), so a hand-edited 10**9 replays
    the same schedule instead of allocating a pool for 10**9 rows; its graphs stay bounded by
    the capture_bs check (1 .. 2 x that batch)."""
    t = record(model(), None, PROMPTS, BUDGETS, version="v1", page_size=2, draft="early-exit:1",
               max_batch=len(PROMPTS), eos=eos_token(), capture_bs=(1, 2, 4))
    t["config"]["max_batch"] = 10**9
    check_trace(t)
    rep = replay_trace(t)
    assert rep.runs and all(r.ok for r in rep.runs)
    # on the recorded() trace (max_batch 2 < 3 requests) the same edit is a different schedule claim
    rep = replay_trace(tampered(lambda t: t["config"].update(max_batch=10**9)))
    assert not rep.runs[0].ok and rep.runs[0].schedule


def test_record_keeps_only_graphs_a_round_can_use():
    """One prompt: capture_bs (1, 2, 4) is cut to the sizes up to 2 x min(max_batch, prompts)."""
    t = record(model(), None, PROMPTS[:1], BUDGETS[:1], version="v1", page_size=2, draft="early-exit:1",
               max_batch=2, capture_bs=(1, 2, 4))
    assert t["config"]["capture_bs"] == [1, 2]
    check_trace(t)


def test_replay_no_progress_drops_the_progress_lines(tmp_path, capsys):
    """``replay --no-progress`` (as ``record --no-progress``): no ``replaying ...`` lines on stderr."""
    path = save_trace(recorded(), tmp_path / "t.json")
    assert replay_main([str(path), "--out", str(tmp_path / "a.md")]) == 0
    assert [x for x in capsys.readouterr().err.splitlines() if x.startswith("replaying")] == ["replaying v1 P=2 ..."]
    assert replay_main([str(path), "--no-progress", "--out", str(tmp_path / "b.md")]) == 0
    err = capsys.readouterr().err
    assert "replaying" not in err and err.startswith("replay took ")
    assert (tmp_path / "a.md").read_text().count("**PASS**") == (tmp_path / "b.md").read_text().count("**PASS**") == 1


@pytest.mark.parametrize("fn,message", [
    # before: "round 0: unknown rid 0 or a = 9 outside [1, 4]", though rid 0 exists
    (lambda t: t["rounds"][0]["num_accept_tokens"].__setitem__(0, 9),
     "trace: round 0: rid 0 accepts a = 9, outside [1, N = num_steps + 1 = 4]"),
    (lambda t: t["rounds"][0]["rids"].__setitem__(1, 99),
     "trace: round 0: unknown rid 99 (the requests are rids 0..5)"),
    # before: only seen indirectly (request 1's rounds no longer match its accepts)
    (lambda t: t["rounds"][0]["rids"].__setitem__(1, 0),
     "trace: duplicate rid 0 in round 0: rids [0, 0, 2, 3] (a request runs at most once a round)"),
], ids=["a-outside", "unknown-rid", "duplicate-rid"])
def test_check_trace_names_the_round_problem_exactly(fn, message):
    t = load_trace(COMMITTED)  # 6 requests, Sd = 3; round 0 runs rids [0, 1, 2, 3]
    fn(t)
    with pytest.raises(ValueError) as e:
        check_trace(t)
    assert str(e.value) == message


def _tiny_workload(monkeypatch):
    """``record``'s command line on the tiny model of this file (no real assets needed)."""
    import refspec.cli.record as record_mod

    monkeypatch.setattr(record_mod, "real_workload",
                        lambda ns: (None, BUDGETS, model(), 0.0, [list(p) for p in PROMPTS]))
    return record_mod


def test_record_check_prints_its_verdict(tmp_path, monkeypatch, capsys):
    """Before: ``record --check`` printed no sign that the greedy check ran."""
    record_mod = _tiny_workload(monkeypatch)
    argv = ["--out", str(tmp_path / "t.json"), "--check", "--no-eos", "--no-progress", "--draft", "early-exit:1",
            "--page-size", "2"]
    assert record_mod.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"wrote {tmp_path / 't.json'} (") and len(out) == 2
    assert out[1] == "checked against greedy: equal (all 3 requests give plain greedy decoding's tokens, SD-002)"
    assert record_mod.main(argv[:2] + argv[3:]) == 0  # without --check: no verdict line
    assert "checked against greedy" not in capsys.readouterr().out


def test_record_check_failure_says_what_differs(tmp_path, monkeypatch, capsys):
    record_mod = _tiny_workload(monkeypatch)
    real = record_mod.greedy

    def off_by_one(m, prompt, max_new, eos=None):  # request 1's greedy text changed: the check must fail
        res = real(m, prompt, max_new, eos)
        if prompt == PROMPTS[1]:
            res.tokens[0] ^= 1
        return res
    monkeypatch.setattr(record_mod, "greedy", off_by_one)
    rc = record_mod.main(["--out", str(tmp_path / "t.json"), "--check", "--no-eos", "--no-progress",
                          "--draft", "early-exit:1", "--page-size", "2"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and not (tmp_path / "t.json").exists()
    assert err == ("python -m refspec record: check failed: requests [1]: speculative output differs from greedy "
                   "(SD-002); no trace written\n")
