"""What the trace checks (``refspec.traces.chain``) must refuse, on a trace written by hand.

The mutation run (``make mutation``, benchmarks/mutation.py) mutates trace.py against this file:
no model runs, every number below is counted by hand.  test_trace.py checks the same rules on
recorded traces (record -> replay round trips).

The trace: Sd = 2 (a in [1, 3]), max_batch 2, vocabulary 32.

* request 0: prompt 3 tokens, budget 6, a = [2, 3] in rounds 0, 1, so L = 3, 5; it emitted
  4 tokens (an EOS: the fewest its last round can end with, 1 + 2 < 4 <= 1 + 2 + 3);
* request 1: prompt 2 tokens, budget 5, a = [1, 2, 1] in rounds 0, 1, 2, so L = 2, 3, 5; it
  emitted 5 tokens (the most, 1 + 4, and its whole budget).
"""

from __future__ import annotations

import copy
import json

import pytest

from refspec.speculative.metrics import RoundTrace
from refspec.traces.chain import (FORMAT, MAX_REPLAY_PARAMS, accept_table, check_trace, committed_rounds,
                                       dumps, is_tree_trace, largest_batch, load_trace, model_config_problem,
                                       replay_budgets, save_trace, schedule_mismatches,
                                       schedule_problem)
from refspec.traces.tree import TREE_FORMAT

MODEL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=4, vocab_size=32)


def trace() -> dict:
    return {
        "format": FORMAT, "source": {},
        "config": dict(version="v1", page_size=1, num_steps=2, draft="early-exit:1", max_batch=2, eos=None,
                       capture_bs=[1, 4], model_config=dict(MODEL)),
        "requests": [
            dict(rid=0, prompt_ids=[0, 1, 2], max_new_tokens=6, output_ids=[3, 4, 5, 31], finish_reason="eos",
                 num_accept_tokens=[2, 3]),
            dict(rid=1, prompt_ids=[31, 7], max_new_tokens=5, output_ids=[0, 8, 9, 10, 11], finish_reason="length",
                 num_accept_tokens=[1, 2, 1]),
        ],
        "rounds": [
            dict(rids=[0, 1], seq_lens=[3, 2], num_accept_tokens=[2, 1], joined=[0, 1], finished=[]),
            dict(rids=[0, 1], seq_lens=[5, 3], num_accept_tokens=[3, 2], joined=[], finished=[0]),
            dict(rids=[1], seq_lens=[5], num_accept_tokens=[1], joined=[], finished=[1]),
        ],
    }


def tampered(fn) -> dict:
    t = copy.deepcopy(trace())
    fn(t)
    return t


def refused(t, msg):
    with pytest.raises(ValueError, match=msg):
        check_trace(t)


def test_the_hand_trace_is_accepted_at_every_bound():
    """a = 1 and a = Sd + 1; output lengths at both ends of their last round and at the budget;
    a round of max_batch requests; capture_bs 1 and 2 * largest batch; tokens 0 and V - 1."""
    check_trace(trace())
    check_trace(tampered(lambda t: t["config"].update(num_steps=6, capture_bs=[4])))  # Sd = the largest budget


@pytest.mark.parametrize("fn,msg", [
    (lambda t: t.update(format="refspec-trace/2"), r"format 'refspec-trace/2', expected 'refspec-trace/1' or "),
    (lambda t: t.pop("format"), "format None"),
    (lambda t: t["config"].pop("eos"), r"config lacks \['eos'\]"),
    (lambda t: t.pop("config"), r"config lacks \['version', 'page_size'"),
    (lambda t: t["config"].update(version="v3"), "config version = 'v3': 'v1' or 'v2'"),
    (lambda t: t["config"].update(num_steps=0), "config num_steps = 0: an int >= 1"),
    (lambda t: t["config"].update(page_size=0), "config page_size = 0: an int >= 1"),
    (lambda t: t["config"].update(num_steps=7), r"config num_steps = 7: an int 1 \.\. 6 \(the largest budget"),
    (lambda t: t["config"].update(num_steps=2.0), r"config num_steps = 2.0: an int"),
    (lambda t: t["config"].update(model_config=[8]), r"config model_config = \[8\]: a dict"),
    (lambda t: t["requests"][0]["prompt_ids"].__setitem__(1, 32), r"request 0: prompt_ids holds a token outside the "
                                                                   r"vocabulary 0 \.\. 31"),
    (lambda t: t["requests"][1]["output_ids"].__setitem__(4, -1), "request 1: output_ids holds a token outside"),
    (lambda t: t["requests"][1]["output_ids"].__setitem__(4, 1.0), r"requests\[1\].output_ids = \[0, 8, 9, 10, 1.0\]: "
     "a list of ints"),
    (lambda t: t["config"].update(max_batch=0), r"config max_batch = 0: an int >= 1"),
    (lambda t: t["config"].update(max_batch=1.5), r"config max_batch = 1.5: an int >= 1"),
    (lambda t: t["config"].update(capture_bs=[1, 5]), r"config capture_bs = \[1, 5\]: a non-empty list of graph batch "
                                                      r"sizes 1 \.\. 4"),
    (lambda t: t["config"].update(capture_bs=[0]), r"config capture_bs = \[0\]"),
    (lambda t: t["config"].update(capture_bs=[]), r"config capture_bs = \[\]"),
    (lambda t: t["config"].update(capture_bs=(1,)), r"config capture_bs = \(1,\)"),
    (lambda t: t["config"].update(capture_bs=[1.0]), r"config capture_bs = \[1.0\]"),
    (lambda t: t["requests"][1].update(rid=2), "request ids must be 0..B-1 in order"),
    (lambda t: t["requests"].reverse(), "request ids must be 0..B-1 in order"),
    (lambda t: t["rounds"][1].pop("joined"), "round 1: needs aligned rids / seq_lens / num_accept_tokens"),
    (lambda t: t["rounds"][1]["seq_lens"].pop(), "round 1: needs aligned"),
    (lambda t: t["rounds"][1]["num_accept_tokens"].pop(), "round 1: needs aligned"),
    (lambda t: t["rounds"][2]["rids"].append(0), "round 2: needs aligned"),
    (lambda t: t["config"].update(max_batch=1, capture_bs=[1]), r"round 0: 2 requests > max_batch 1"),
    (lambda t: t["rounds"][2]["rids"].__setitem__(0, 5), r"round 2: unknown rid 5 \(the requests are rids 0\.\.1\)"),
    (lambda t: t["rounds"][1]["num_accept_tokens"].__setitem__(0, 4),
     r"round 1: rid 0 accepts a = 4, outside \[1, N = num_steps \+ 1 = 3\]"),
    (lambda t: t["rounds"][0]["num_accept_tokens"].__setitem__(1, 0),
     r"round 0: rid 1 accepts a = 0, outside \[1, N = num_steps \+ 1 = 3\]"),
    (lambda t: t["rounds"][2]["finished"].append(0), r"round 2: finished \[1, 0\] not all in the batch \[1\]"),
    (lambda t: t["requests"][1]["num_accept_tokens"].append(1), r"request 1: rounds give a = \[1, 2, 1\], the "
                                                                 r"request lists \[1, 2, 1, 1\]"),
    (lambda t: t["rounds"][1]["seq_lens"].__setitem__(1, 4), r"request 1 round 1: seq_len 4, expected 3 \(prompt "),
    (lambda t: t["rounds"][0]["seq_lens"].__setitem__(0, 2), r"request 0 round 0: seq_len 2, expected 3"),
    (lambda t: t["requests"][1].update(max_new_tokens=4), r"request 1: 5 output tokens, budget 4"),
    (lambda t: t["requests"][0].update(output_ids=[]), r"request 0: 0 output tokens, budget 6"),
    (lambda t: t["requests"][0]["output_ids"].pop(), r"request 0: 3 output tokens do not end in its last round "
                                                     r"\(a = \[2, 3\]\)"),
    (lambda t: t["requests"][0]["output_ids"].extend([1, 1, 1]), "request 0: 7 output tokens, budget 6"),
    (lambda t: t["requests"][1]["output_ids"].pop(), r"request 1: 4 output tokens do not end in its last round "
                                                     r"\(a = \[1, 2, 1\]\)"),  # its last round starts after 1 + 1 + 2
    (lambda t: (t["requests"][1].update(max_new_tokens=6), t["requests"][1]["output_ids"].append(1)),
     r"request 1: 6 output tokens do not end in its last round \(a = \[1, 2, 1\]\)"),
    (lambda t: t["rounds"][1]["finished"].clear(), r"request 0: finished in rounds \[\], its last round is 1"),
    (lambda t: t["rounds"][0]["finished"].append(1), r"request 1: finished in rounds \[0, 2\], its last round is 2"),
])
def test_check_trace_refuses(fn, msg):
    refused(tampered(fn), f"^trace: {msg}" if not msg.startswith("^") else msg)


def test_a_request_in_no_round_has_nothing_to_check_per_round():
    """A request that never ran (0 rounds, a = []) is only held to its budget: the round rules
    (its last round, where it finished) need a round."""
    t = tampered(lambda t: t["requests"].append(dict(rid=2, prompt_ids=[1], max_new_tokens=2, output_ids=[1],
                                                     finish_reason="length", num_accept_tokens=[])))
    check_trace(t)


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "vocab_size"])
@pytest.mark.parametrize("value", [0, None, "8", 8.0])
def test_model_config_refuses_a_size_that_is_no_positive_int(key, value):
    mc = dict(MODEL, **{key: value})
    if value is None:
        del mc[key]
    assert model_config_problem(mc) == f"config model_config.{key} = {mc.get(key)!r}: an int >= 1"


def test_model_config_accepts_size_1_and_refuses_ungrouped_heads():
    assert model_config_problem(dict(MODEL, num_key_value_heads=2)) is None
    assert model_config_problem({k: 1 for k in MODEL}) is None
    assert model_config_problem(dict(MODEL, num_attention_heads=3, num_key_value_heads=2)) == (
        "config model_config: num_attention_heads 3 is not a multiple of num_key_value_heads 2 (GQA)")


def _at(params: int) -> dict:
    """Sizes E 2, I 3, L 2, H 4, Hkv 2, D 5 (per layer, by hand: attention E (H + 2 Hkv) D = 80 and
    H D E = 40, MLP 3 E I = 18, so 276 for 2 layers) and the vocabulary V (V E) giving ``params``."""
    assert (params - 276) % 2 == 0
    return dict(hidden_size=2, intermediate_size=3, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=5, vocab_size=(params - 276) // 2)


def test_model_config_parameter_count_is_the_llama_count():
    """At the limit the model is accepted, 2 parameters more it is refused: any other count of
    the same sizes lands on the wrong side of one of the two."""
    assert MAX_REPLAY_PARAMS == 10**9
    assert model_config_problem(_at(10**9)) is None
    assert model_config_problem(_at(10**9 + 2)) == (
        "config model_config describes a 1e+09-parameter model; a replay builds it at random in fp32 and refuses "
        "more than 1e+09 (SmolLM2-135M: 1.35e+08)")


def test_model_config_is_checked_by_check_trace():
    refused(tampered(lambda t: t["config"]["model_config"].update(num_key_value_heads=3)), "^trace: .*GQA")


def test_largest_batch_is_the_smaller_of_max_batch_and_the_requests():
    t = trace()
    assert largest_batch(t) == 2
    t["config"]["max_batch"] = 1
    assert largest_batch(t) == 1
    t["config"]["max_batch"] = 9
    assert largest_batch(t) == 2
    # capture_bs is bounded by 2 * largest_batch, not by max_batch
    check_trace(tampered(lambda t: t["config"].update(max_batch=9)))
    refused(tampered(lambda t: t["config"].update(max_batch=9, capture_bs=[5])),
            r"config capture_bs = \[5\]: .* 1 \.\. 4")


def test_is_tree_trace_reads_the_format():
    assert not is_tree_trace(trace())
    assert is_tree_trace({"format": TREE_FORMAT})
    assert not is_tree_trace({})


def test_replay_budgets_and_accept_table():
    assert replay_budgets(trace()) == [4, 5]
    assert accept_table(trace()) == {0: [2, 3], 1: [1, 2, 1]}


def _rounds(t):
    return [RoundTrace(k, list(rd["rids"]), list(rd["seq_lens"]), list(rd["num_accept_tokens"]), [],
                       list(rd["joined"]), list(rd["finished"])) for k, rd in enumerate(t["rounds"])]


def test_committed_rounds_drops_only_the_all_dropped_overlap_rounds():
    rs = _rounds(trace())
    empty = RoundTrace(9, [], [], [], [], [], [])
    dropped = RoundTrace(9, [], [], [], [], [], [], discarded=[0])
    assert committed_rounds(rs + [empty]) == rs + [empty]
    assert committed_rounds(rs[:1] + [dropped] + rs[1:]) == rs


@pytest.mark.parametrize("key", ["rids", "seq_lens", "num_accept_tokens", "joined", "finished"])
def test_schedule_mismatches_names_every_field_of_every_round(key):
    t = trace()
    rs = _rounds(t)
    assert schedule_mismatches(t, rs) == []
    setattr(rs[2], key, [7])
    assert schedule_mismatches(t, rs) == [f"round 2: {key} [7] != trace {t['rounds'][2][key]}"]
    setattr(rs[0], key, [7])
    assert len(schedule_mismatches(t, rs)) == 2


def test_schedule_mismatches_counts_rounds_after_dropping_the_overlap_ones():
    t = trace()
    rs = _rounds(t)
    assert schedule_mismatches(t, rs[:2]) == ["2 rounds replayed, the trace has 3"]
    assert schedule_mismatches(t, rs + rs[:1]) == ["4 rounds replayed, the trace has 3"]
    assert schedule_mismatches(t, rs + [RoundTrace(3, [], [], [], [], [], [], discarded=[1])]) == []


def test_dumps_is_json_with_one_request_and_one_round_per_line():
    t = trace()
    text = dumps(t)
    assert json.loads(text) == t
    lines = text.splitlines()
    assert len(lines) == 1 + 1 + 2 + 1 + 1 + 3 + 1
    assert lines[0].startswith('{"format": ') and lines[0].endswith(",")
    assert '"requests"' not in lines[0] and '"rounds"' not in lines[0]  # each once, on its own lines
    assert lines[1] == ' "requests": [' and lines[5] == ' "rounds": ['
    assert lines[2].startswith('  {"rid":0,') and lines[3].startswith('  {"rid":1,')
    assert lines[4] == " ],"
    assert lines[-1] == " ]}"
    empty = dict(t, requests=[], rounds=[])
    assert dumps(empty).splitlines()[1:] == [' "requests": [],', ' "rounds": []}']


def test_save_and_load_round_trip(tmp_path):
    """save_trace makes the missing folders, and saves again into a folder that exists."""
    path = save_trace(trace(), tmp_path / "a" / "b" / "t.json")
    assert path == tmp_path / "a" / "b" / "t.json"
    assert save_trace(trace(), str(tmp_path / "a" / "b" / "u.json")) == tmp_path / "a" / "b" / "u.json"
    assert path.read_text(encoding="utf-8") == dumps(trace())
    assert load_trace(path) == trace()
    assert load_trace(str(path)) == trace()


def test_save_trace_refuses_an_inconsistent_trace(tmp_path):
    with pytest.raises(ValueError, match="^trace: request ids"):
        save_trace(tampered(lambda t: t["requests"].reverse()), tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("text,msg", [
    ("{not json", r"trace {path}: not JSON refspec can read \("),
    ("1" * 5000, r"trace {path}: not JSON refspec can read \("),
    ("[1, 2]", r"trace {path}: expected a JSON object with format 'refspec-trace/1', got list"),
])
def test_load_trace_refuses_what_is_no_trace_object(tmp_path, text, msg):
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(ValueError, match="^" + msg.format(path=p)):
        load_trace(p)


@pytest.mark.parametrize("fn,msg", [
    (lambda t: t["requests"].reverse(), "request ids must be 0..B-1 in order"),
    (lambda t: t["requests"][0].pop("output_ids"), r"requests\[0\].output_ids = None: a list of ints"),
    (lambda t: t["config"].update(num_steps="2"), r"config num_steps = '2': an int >= 1"),
    (lambda t: t["rounds"][0].update(rids=[0, 9]), r"round 0: unknown rid 9"),
    (lambda t: t.update(rounds=[5]), r"rounds: a list of round objects"),
])
def test_load_trace_names_the_file_and_the_problem(tmp_path, fn, msg):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(tampered(fn)))
    with pytest.raises(ValueError, match=f"^trace {p}: {msg}"):
        load_trace(p)


def test_load_trace_lets_a_missing_file_raise_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "none.json")


def _result(t, trace=True):
    from refspec.speculative.metrics import GenerateResult, RequestResult
    reqs = [RequestResult(r["rid"], list(r["output_ids"]), list(r["num_accept_tokens"]), [],
                          finish_reason=r["finish_reason"]) for r in t["requests"]]
    return GenerateResult(reqs, "fa3", "v1", trace=_rounds(t) if trace else None)


def test_trace_from_result_writes_the_hand_trace():
    from refspec.traces.chain import trace_from_result
    t = trace()
    prompts, budgets = [r["prompt_ids"] for r in t["requests"]], [r["max_new_tokens"] for r in t["requests"]]
    rounds = _rounds(t) + [RoundTrace(3, [], [], [], [], [], [], discarded=[1])]  # an overlap round dropped
    res = _result(t)
    res.trace = rounds
    got = trace_from_result(res, prompts, budgets, t["config"], source={"by": "hand"})
    assert got == dict(t, source={"by": "hand"})
    qs = [dict(question_id=81, category="writing", turns=["x"]), dict(question_id=82, category="math")]
    got = trace_from_result(_result(t), prompts, budgets, t["config"], questions=qs)
    assert [(r["question_id"], r["category"]) for r in got["requests"]] == [(81, "writing"), (82, "math")]
    assert "turns" not in got["requests"][0] and got["source"] == {}


def test_trace_from_result_refuses_a_run_without_rounds_a_short_config_or_bad_tree_rounds():
    from refspec.traces.chain import trace_from_result
    t = trace()
    prompts, budgets = [r["prompt_ids"] for r in t["requests"]], [r["max_new_tokens"] for r in t["requests"]]
    with pytest.raises(ValueError, match=r"^only a production run \(backend 'fa3' / 'paged-oracle'\) has a "):
        trace_from_result(_result(t, trace=False), prompts, budgets, t["config"])
    cfg = {k: v for k, v in t["config"].items() if k not in ("eos", "draft")}
    with pytest.raises(ValueError, match=r"^config lacks \['draft', 'eos'\]$"):
        trace_from_result(_result(t), prompts, budgets, cfg)
    with pytest.raises(ValueError, match=r"^2 recorded tree rounds for 3 committed rounds$"):
        trace_from_result(_result(t), prompts, budgets, t["config"], tree_rounds=[[], []])
    with pytest.raises(ValueError, match=r"^trace: request 1: 5 output tokens, budget 4"):
        trace_from_result(_result(t), prompts, [6, 4], t["config"])


def test_trace_from_result_with_tree_rounds_writes_a_tree_trace():
    """Tree rounds make a tree trace (TREE_FORMAT, one ``tree`` list per round), which
    check_trace then holds to the tree rules: empty entries are refused by name."""
    from refspec.traces.chain import trace_from_result
    t = trace()
    prompts, budgets = [r["prompt_ids"] for r in t["requests"]], [r["max_new_tokens"] for r in t["requests"]]
    cfg = dict(t["config"], topk=2, num_draft_tokens=4, num_pages=10)
    with pytest.raises(ValueError, match=r"^trace: round 0 request 0: tree entry lacks \["):
        trace_from_result(_result(t), prompts, budgets, cfg, tree_rounds=[[{}, {}], [{}, {}], [{}]])
    with pytest.raises(ValueError, match=r"^trace: a tree trace needs config topk >= 2"):
        trace_from_result(_result(t), prompts, budgets, t["config"], tree_rounds=[[{}, {}], [{}, {}], [{}]])


def test_check_trace_accepts_v2_and_one_draft_step():
    check_trace(tampered(lambda t: t["config"].update(version="v2")))
    one = tampered(lambda t: t["config"].update(num_steps=1))  # Sd = 1: a in [1, 2], request 0's a = 3 is out
    refused(one, r"^trace: round 1: rid 0 accepts a = 3, outside \[1, N = num_steps \+ 1 = 2\]")
    for r in one["rounds"]:
        r["num_accept_tokens"] = [min(a, 2) for a in r["num_accept_tokens"]]
    one["requests"][0]["num_accept_tokens"] = [2, 2]
    one["rounds"][1]["seq_lens"] = [5, 3]
    one["requests"][0]["output_ids"] = [3, 4, 5, 31]
    check_trace(one)


def test_check_trace_of_no_requests_bounds_num_steps_by_1():
    """No request: the largest budget counts as 1 (num_steps 2 is refused by name); such a trace
    then has no batch a graph could hold (capture_bs 1 .. 0)."""
    empty = tampered(lambda t: t.update(requests=[], rounds=[]))
    refused(empty, r"^trace: config num_steps = 2: an int 1 \.\. 1 \(the largest budget")
    empty["config"]["num_steps"] = 1
    refused(empty, r"^trace: config capture_bs = \[1, 4\]: a non-empty list of graph batch sizes 1 \.\. 0 ")


# schedule_problem (the schedule a tree replay cannot re-run), on schedules written by hand:
# three requests, max_batch 2.  The good one: round 0 runs 0 and 1 (2 waits, the batch is full)
# and finishes 0; round 1 carries 1 and admits 2, finishes 1; round 2 carries 2.

def schedule(*rounds, **config):
    return dict(config=dict(max_batch=2, **config),
                rounds=[dict(rids=r, joined=j, finished=f) for r, j, f in rounds])


GOOD = (([0, 1], [0, 1], [0]), ([1, 2], [2], [1]), ([2], [], [2]))
HELD = "slots held while requests {} wait (admission fills the batch): max_batch is not the recording's"


def test_schedule_problem_accepts_the_engines_schedules():
    assert schedule_problem(schedule(*GOOD)) is None
    # request 1 finished by its prefill: it joined round 0 without running, its row counted as held
    assert schedule_problem(schedule(([0], [0, 1], [0]), ([2], [2], [2]))) is None
    assert schedule_problem(schedule()) is None


@pytest.mark.parametrize("rounds,max_batch,msg", [
    (GOOD, 3, "round 0: 2 of max_batch 3 " + HELD.format([2])),
    ((([0], [0, 1], [0]), ([2], [2], [2])), 3, "round 0: 2 of max_batch 3 " + HELD.format([2])),
    ((([0], [0], [0]), ([1], [1], [1]), ([2], [2], [2])), 2, "round 0: 1 of max_batch 2 " + HELD.format([1, 2])),
    ((([0, 1], [0, 1], [0]), ([1, 2], [2, 1], [1]), ([2], [], [2])), 2,
     "round 1: joined [1], which ran in an earlier round (a request joins in its first round)"),
    ((([0, 1], [0, 1], [0]), ([2, 1], [2], [1]), ([2], [], [2])), 2,
     "round 1: batch [2, 1]; the engine runs the unfinished requests of the round before [1], then those joining "
     "now [2], in that order"),
    ((([1, 0], [1, 0], [0]), ([1, 2], [2], [1]), ([2], [], [2])), 2,
     "round 0: batch [1, 0]; the engine runs the unfinished requests of the round before [], then those joining "
     "now [0, 1], in that order"),
    ((([0, 1], [0, 1], [0]), ([2], [2], [2])), 2,
     "round 1: batch [2]; the engine runs the unfinished requests of the round before [1], then those joining now "
     "[2], in that order"),
])
def test_schedule_problem_names_the_round(rounds, max_batch, msg):
    t = schedule(*rounds)
    t["config"]["max_batch"] = max_batch
    assert schedule_problem(t) == msg


def test_schedule_problem_counts_the_rows_the_overlap_loop_still_holds():
    """Round 1 runs request 1 only while 2 waits: the overlap loop still holds request 0's row
    (finished by round 0, known one round late), so the batch is full; without overlap it is not."""
    rounds = (([0, 1], [0, 1], [0]), ([1], [], [1]), ([2], [2], [2]))
    assert schedule_problem(schedule(*rounds, overlap=True)) is None
    assert schedule_problem(schedule(*rounds)) == "round 1: 1 of max_batch 2 " + HELD.format([2])
    assert schedule_problem(schedule(*rounds, overlap=False)) == "round 1: 1 of max_batch 2 " + HELD.format([2])


def test_check_trace_refuses_a_schedule_problem():
    """check_trace gives schedule_problem's line (in the hand trace both requests run from round 0,
    so nothing waits: a late join is what can be wrong)."""
    refused(tampered(lambda t: t["rounds"][1]["joined"].append(1)),
            r"^trace: round 1: joined \[1\], which ran in an earlier round \(a request joins in its first round\)$")


@pytest.mark.parametrize("fn,msg", [
    (lambda t: t.update(requests=[5]), "requests: a list of request objects"),
    (lambda t: t.update(requests={"0": {}}), "requests: a list of request objects"),
    (lambda t: t["requests"][0].update(rid="0"), "requests[0].rid = '0': an int"),
    (lambda t: t["requests"][1].update(max_new_tokens=5.0), "requests[1].max_new_tokens = 5.0: an int"),
    (lambda t: t["rounds"][2].update(finished=[1.0]), "round 2: finished = [1.0]: a list of ints"),
])
def test_field_problem_names_the_field(fn, msg):
    with pytest.raises(ValueError) as e:
        check_trace(tampered(fn))
    assert str(e.value) == f"trace: {msg}"


def test_load_trace_names_a_malformed_field_by_its_python_error(tmp_path):
    """A tree entry whose req_to_token is no list of runs: the check meets a TypeError, which
    load_trace reports as malformed, naming the file and the error."""
    t = trace()
    t.update(format=TREE_FORMAT)
    t["config"].update(topk=2, num_draft_tokens=4, num_pages=10)
    keys = ("req_pool_index", "req_to_token", "page_table", "parents", "positions", "mask", "accept_path",
            "draft_cache_loc", "draft_tokens", "target_predict")
    for rd in t["rounds"]:
        rd["tree"] = [dict.fromkeys(keys, 5) for _ in rd["rids"]]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    with pytest.raises(ValueError) as e:
        load_trace(p)
    assert str(e.value) == f"trace {p}: malformed (TypeError: 'int' object is not iterable)"
