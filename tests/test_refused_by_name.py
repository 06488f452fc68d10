"""Bad input refused by name (issue 22, item 6): each input below was found by trying a public
entry point with a bad value, and each did something else before (its docstring says what).

One vocabulary: a ``ValueError`` naming the field (``refspec.core.args``), or an
:class:`~refspec.core.invariants.InvariantError` (a ``ValueError`` too) naming the rule.  The tree
arguments have one check (``refspec.core.args.tree_args``): every entry point that takes them
refuses the same bad N with the same rule.  A trace is checked on load, chain and tree alike, for
the three hand edits a tree replay (which does not re-run the scheduler) could not see.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refspec.core.args import tree_args
from refspec.core.invariants import InvariantError
from refspec.harness.teacher_forced import teacher_forced_tree_accepts
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.tree_loop import speculative_tree_greedy
from refspec.speculative.api import generate, greedy_reference
from refspec.speculative.engine import Engine
from refspec.traces.chain import check_trace, load_trace

TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "traces"
PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0)  # vocab 128


# ---------------------------------------------------------------- generate / Engine
def test_early_exit_with_a_bad_k_names_the_draft(model):
    """Was ``invalid literal for int() with base 10: 'x'``."""
    with pytest.raises(ValueError, match=r"draft 'early-exit:x': early-exit:k needs an int k"):
        generate(model, PROMPTS, draft="early-exit:x", max_new_tokens=2)


@pytest.mark.parametrize("arrivals", [[0, None], [0, 1.5], [0, -1], [0]], ids=["none", "float", "negative", "short"])
def test_arrivals_name_the_argument(model, arrivals):
    """``[0, None]`` was a bare TypeError; ``[0, 1.5]`` was accepted (request 1 joined at step 2)."""
    with pytest.raises(ValueError, match=r"^arrivals"):
        generate(model, PROMPTS, arrivals=arrivals, max_new_tokens=2)


@pytest.mark.parametrize("prompt,field", [([1.5, 2], "prompt"), ("12", "prompt"), ([], "the prompt is empty")])
def test_add_request_refuses_a_prompt_that_is_not_token_ids(model, prompt, field):
    """``[1.5, 2]`` silently decoded ``[1, 2]`` (only the range was checked)."""
    eng = Engine(model, make_draft("eagle", model), max_context=32)
    with pytest.raises(ValueError, match=rf"request 0: {field}"):
        eng.add_request(0, prompt, 4)
    assert eng.waiting == []


@pytest.mark.parametrize("kw,field", [({"max_new_tokens": 2.0}, "max_new_tokens"), ({"arrival": 0.5}, "arrival")])
def test_add_request_refuses_non_int_counts(model, kw, field):
    eng = Engine(model, make_draft("eagle", model), max_context=32)
    with pytest.raises(ValueError, match=rf"request 0: {field} must be an int"):
        eng.add_request(0, [1, 2], **{"max_new_tokens": 4, **kw})


@pytest.mark.parametrize("eos", [999, -1, 2.0], ids=["past-vocab", "negative", "float"])
def test_greedy_reference_refuses_the_eos_generate_refuses(model, eos):
    """``greedy_reference(..., eos=999)`` ran where ``generate`` refused that eos."""
    with pytest.raises(ValueError, match=r"eos must be None or a token id in \[0, vocab_size = 128\)"):
        greedy_reference(model, PROMPTS, 2, eos=eos)
    with pytest.raises(ValueError, match=r"eos must be None or a token id"):
        generate(model, PROMPTS, eos=eos, max_new_tokens=2)


# ---------------------------------------------------------------- one tree-argument check
@pytest.mark.spec("TR-002")
def test_every_entry_point_refuses_a_too_large_tree_by_the_same_rule(model):
    """k = 2, Sd = 2: N - 1 <= 2 + 1*4 = 6, so N = 8 breaks TR-002 in the oracle tree loop, the
    production TreeEngine, generate and teacher-forced tree acceptance alike (before: TR-002 vs a plain ValueError)."""
    from refspec.speculative.tree.engine import TreeEngine

    calls = {
        "tree_args": lambda: tree_args(2, 2, 8),
        "generate": lambda: generate(model, PROMPTS, backend="oracle", topk=2, num_steps=2, num_draft_tokens=8,
                                     max_new_tokens=2),
        "oracle tree loop": lambda: speculative_tree_greedy(model, make_draft("eagle", model), [1, 2], num_steps=2,
                                                            topk=2, num_draft_tokens=8, max_new_tokens=2),
        "TreeEngine": lambda: TreeEngine(model, make_draft("eagle", model), topk=2, num_steps=2, num_draft_tokens=8),
        "teacher-forced tree": lambda: teacher_forced_tree_accepts(model, make_draft("eagle", model), [1, 2],
                                                                   [1, 2] + [3] * 10, topk=2, num_steps=2,
                                                                   num_draft_tokens=8, max_new_tokens=2),
    }
    for name, call in calls.items():
        with pytest.raises(InvariantError, match=r"^\[TR-002\].*N = 8") as e:
            call()
        assert e.value.inv_id == "TR-002", name
    assert tree_args(2, 2, 7) == 7 and tree_args(1, 3) == 4  # the bound itself is allowed; k = 1: N = Sd + 1


@pytest.mark.spec("SD-010")
def test_a_chain_with_another_n_is_sd_010():
    with pytest.raises(InvariantError, match=r"^\[SD-010\]"):
        tree_args(1, 3, 3)
    with pytest.raises(ValueError, match=r"^topk \(k\) must be an int >= 1"):
        tree_args(0, 3, 4)
    with pytest.raises(ValueError, match=r"^num_steps \(Sd\) must be an int >= 1"):
        tree_args(2, 1.0, 4)


def test_tree_engine_needs_two_branches(model):
    from refspec.speculative.tree.engine import TreeEngine

    with pytest.raises(ValueError, match=r"topk must be >= 2.*Engine"):
        TreeEngine(model, make_draft("eagle", model), topk=1, num_steps=3, num_draft_tokens=4)


# ---------------------------------------------------------------- traces, checked on load
def _trace(name: str) -> dict:
    return json.loads((TRACES / name).read_text())


def _refused(trace: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_trace(trace)


@pytest.mark.parametrize("field,value,match", [
    ("page_size", "4", r"config page_size = '4': an int >= 1"),
    ("num_steps", True, r"config num_steps = True: an int >= 1"),
    ("max_batch", 4.0, r"config max_batch = 4.0: an int >= 1"),
    ("version", 2, r"config version = 2: 'v1' or 'v2'"),
])
def test_a_config_field_of_the_wrong_type_is_named(field, value, match):
    """``page_size: "4"`` ended in ``malformed (TypeError: '<' not supported ...)``, naming no field."""
    t = _trace("mtbench_smollm2.json")
    t["config"][field] = value
    _refused(t, match)


def test_a_seq_len_written_as_a_string_is_named():
    """Was refused as ``seq_len 66, expected 66``."""
    t = _trace("mtbench_smollm2.json")
    t["rounds"][0]["seq_lens"][0] = str(t["rounds"][0]["seq_lens"][0])
    _refused(t, r"round 0: seq_lens = \['53', .*a list of ints")


def test_a_request_field_of_the_wrong_type_is_named():
    t = _trace("mtbench_smollm2.json")
    t["requests"][1]["max_new_tokens"] = "96"
    _refused(t, r"requests\[1\]\.max_new_tokens = '96': an int")


def test_load_trace_names_the_file_and_the_field(tmp_path):
    t = _trace("mtbench_smollm2_tree.json")
    t["config"]["page_size"] = "4"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t))
    with pytest.raises(ValueError, match=rf"^trace {path}: config page_size = '4'"):
        load_trace(path)


TRACE_FILES = ["mtbench_smollm2.json", "mtbench_smollm2_tree.json", "mtbench_smollm2_tree_v2.json"]


def _first_round(t, pred) -> int:
    return next(k for k, rd in enumerate(t["rounds"]) if pred(k, rd))


@pytest.mark.parametrize("name", TRACE_FILES)
def test_the_committed_traces_are_schedules_the_engine_makes(name):
    """The negative controls below start from these: they load as they are."""
    check_trace(_trace(name))


@pytest.mark.parametrize("name", TRACE_FILES)
def test_a_reversed_batch_order_is_refused(name):
    t = _trace(name)
    k = _first_round(t, lambda k, rd: len(rd["rids"]) > 1)
    for key in ("rids", "seq_lens", "num_accept_tokens") + (("tree",) if "tree" in t["rounds"][k] else ()):
        t["rounds"][k][key].reverse()
    _refused(t, rf"round {k}: batch .* the engine runs the unfinished requests of the round before .* in that order")


@pytest.mark.parametrize("name", TRACE_FILES)
def test_a_join_moved_to_a_later_round_is_refused(name):
    t = _trace(name)
    k = _first_round(t, lambda k, rd: k > 0 and rd["joined"] and k + 1 < len(t["rounds"]))
    rid = t["rounds"][k]["joined"].pop()
    t["rounds"][k + 1]["joined"].append(rid)
    _refused(t, rf"round {k}: batch .*{rid}")


@pytest.mark.parametrize("name", TRACE_FILES)
def test_a_raised_max_batch_is_refused(name):
    t = _trace(name)
    t["config"]["max_batch"] += 1
    _refused(t, r"slots held while requests \[.*\] wait .*max_batch is not the recording's")


def test_a_join_listed_after_the_request_ran_is_refused():
    """The second half of a moved join on its own: ``joined`` naming a request an earlier round ran."""
    t = _trace("mtbench_smollm2.json")
    t["rounds"][1]["joined"] = [0]
    _refused(t, r"round 1: joined \[0\], which ran in an earlier round")


def test_a_trace_recorded_with_the_overlap_loop_is_a_schedule(model):
    """The overlap loop's schedule (finishes seen one round late, admission counts the rows the
    launch still held) passes the load checks: recorded here, at max_batch 2 of 4 requests."""
    from refspec.real import CONFIG_KEYS
    from refspec.traces.chain import trace_from_result

    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    budgets = [6, 9, 4, 7]
    res = generate(model, prompts, backend="fa3", version="v2", overlap=True, draft="early-exit:1",
                   drafter="perfect", max_batch=2, max_new_tokens=budgets, num_steps=2)
    cfg = dict(version="v2", page_size=1, num_steps=2, draft="early-exit:1", max_batch=2, eos=None, capture_bs=[1, 2],
               model_config={k: getattr(model.config, k) for k in CONFIG_KEYS}, overlap=True)
    t = trace_from_result(res, prompts, budgets, cfg)  # runs check_trace
    assert any(rd["joined"] for rd in t["rounds"][1:]), "no late join: the schedule checks saw nothing"
