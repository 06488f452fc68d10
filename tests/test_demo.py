"""The real-model demo (SmolLM2-135M-Instruct on MT-Bench, fp32 CPU): speculative == greedy,
production == oracle, the demo's table and answer, the seed's bug live, record -> replay.

Every reference here is computed independently of the code under test: plain greedy decoding
(:func:`refspec.oracle.loop.greedy`, dense KV, one token per forward) and the tokenizer's
``decode``.  Short runs (2 prompts, <= 12 new tokens); the weights load once per process.
"""

from __future__ import annotations

import functools

import pytest

from refspec.cli import demo, record, replay
from refspec.real import assets

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(bool(assets.missing_reason()), reason=str(assets.missing_reason())),
]

BUDGETS = [8, 5]


@functools.lru_cache(maxsize=None)
def setup():
    from refspec.real.run import chat_prompts, load_target, pick_questions

    model, _ = load_target()
    qs = pick_questions(2)
    return model, qs, chat_prompts(qs)


@functools.lru_cache(maxsize=None)
def baseline(budgets=tuple(BUDGETS)) -> list[list[int]]:
    from refspec.oracle.loop import greedy
    from refspec.real import EOS_ID

    model, _, prompts = setup()
    return [greedy(model, p, m, EOS_ID).tokens for p, m in zip(prompts, budgets)]


@functools.lru_cache(maxsize=None)
def oracle(version):
    from refspec.real import EOS_ID
    from refspec.real.eagle_head import real_draft
    from refspec.real.run import DEFAULT_DRAFT
    from refspec.speculative import generate

    model, _, prompts = setup()
    return generate(model, prompts, backend="oracle", version=version, draft=real_draft(DEFAULT_DRAFT, model),
                    num_steps=3,
                    max_new_tokens=BUDGETS, eos=EOS_ID)


@pytest.mark.spec("SD-002", "TOL-001", "SD-003", "KV-006")
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_real_model_spec_equals_greedy_and_production_equals_oracle(version, page_size):
    from refspec.real import EOS_ID
    from refspec.real.eagle_head import real_draft
    from refspec.real.run import DEFAULT_DRAFT
    from refspec.speculative import generate

    model, _, prompts = setup()
    ora = oracle(version)
    assert ora.tokens == baseline(), "oracle loop differs from plain greedy"
    res = generate(model, prompts, backend="fa3", version=version, page_size=page_size, graphs=True,
                   draft=real_draft(DEFAULT_DRAFT, model), num_steps=3, max_new_tokens=BUDGETS, eos=EOS_ID,
                   capture_bs=(1, 2))
    assert res.tokens == baseline(), "production loop differs from plain greedy (SD-002)"
    assert res.accepts == ora.accepts, "production accept counts differ from the oracle loop"
    assert all(1 <= a <= 4 for acc in res.accepts for a in acc)
    assert any(a > 1 for acc in res.accepts for a in acc), "the trained head should accept some drafts"
    assert all(t.graph for t in res.trace), "every round should replay graphs (batch <= 2 captured)"
    assert res.free_pages[0] == res.free_pages[1]


def test_demo_main_prints_table_and_answer(capsys):
    from refspec.real import decode

    rc = demo.main(["--prompts", "2", "--max-new-tokens", "5,3", "--page-sizes", "4", "--draft", "early-exit:4",
                    "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("path"))
    assert all(h in lines[head] for h in demo.HEADER)
    rows = [l.split() for l in lines[head + 2: head + 8]]
    assert [r[0] for r in rows] == ["greedy", "graph", "oracle", "oracle", "production", "production"]
    assert [r[-2:] for r in rows[4:]] == [["yes", "yes"]] * 2
    assert [r[1:4] for r in rows[4:]] == [["4", "2", "v1"], ["4", "2", "v2"]]
    assert rows[1][1:5] == ["greedy", "4", "2", "-"] and rows[1][-3:] == ["1.00", "yes", "-"]  # the speed baseline
    assert all(float(r[-3]) > 0 for r in rows[4:])  # x graph greedy (refspec.cli._timing.speedup)
    assert "the bench's timing" in out
    assert "KV accounting audited" in out
    assert decode(baseline((5, 3))[0], skip_special=True) in out, "the printed answer is not the greedy answer"


@pytest.mark.spec("PA-002")
def test_bug_demo_seed_page_table_is_flagged_and_corrupts_text():
    from refspec.cli._demo_bug import run_bug_demo
    from refspec.real import EOS_ID, decode

    model, qs, prompts = setup()
    lines: list[str] = []
    rc = run_bug_demo(model, qs, prompts, BUDGETS, "seed-page-table", page_size=4, eos=EOS_ID, progress=False,
                      out=lines.append)
    text = "\n".join(lines)
    assert rc == 0, text
    assert "[PA-002]" in text and "stopped by InvariantError" in text
    correct = [l.split(":", 1)[1].strip() for l in text.splitlines() if l.strip().startswith("correct :")]
    buggy = [l.split(":", 1)[1].strip() for l in text.splitlines() if l.strip().startswith("with bug:")]
    assert correct == [repr(decode(b, skip_special=True)) for b in baseline()]
    assert len(buggy) == 2 and buggy != correct


@pytest.mark.spec("SD-008", "TOL-001")
def test_record_then_replay_round_trip(tmp_path):
    path = tmp_path / "trace.json"
    assert record.main(["--out", str(path), "--prompts", "2", "--max-new-tokens", "6,4", "--max-batch", "1",
                        "--version", "v1", "--page-size", "2", "--check"]) == 0
    from refspec.traces.chain import load_trace

    t = load_trace(path)
    assert [len(r["prompt_ids"]) for r in t["requests"]] == [len(p) for p in setup()[2]]
    assert [rd["rids"] for rd in t["rounds"]][0] == [0] and any(rd["joined"] == [1] for rd in t["rounds"][1:])
    md = tmp_path / "replay.md"
    rc = replay.main([str(path), "--tiny", "--out", str(md)])
    assert rc == 0, md.read_text()
    assert "**PASS**" in md.read_text()


@pytest.mark.spec("SD-003", "TR-019")
def test_demo_topk_prints_the_tree_rounds_accept_lengths(capsys):
    rc = demo.main(["--prompts", "2", "--max-new-tokens", "5,3", "--page-sizes", "4", "--versions", "v1",
                    "--draft", "early-exit:4", "--topk", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [l.split() for l in out.splitlines() if l.startswith("production tree")]
    assert rows[0][-2:] == ["yes", "yes"]  # == greedy, == the oracle tree loop
    (line,) = [l for l in out.splitlines() if l.startswith("production tree v1 k=2 N=4 P=4: accept length per round")]
    per = [float(x) for x in line.split(":")[-1].split()]
    assert per and all(1.0 <= x <= 4.0 for x in per)  # a in [1, Sd + 1] for every request of every round


@pytest.mark.spec("TR-004")
def test_record_topk_then_replay_round_trip(tmp_path):
    path = tmp_path / "tree.json"
    assert record.main(["--out", str(path), "--prompts", "2", "--max-new-tokens", "6,4", "--max-batch", "1",
                        "--topk", "2", "--page-size", "2", "--check", "--no-progress"]) == 0
    from refspec.traces.chain import is_tree_trace, load_trace

    t = load_trace(path)
    assert is_tree_trace(t) and t["config"]["topk"] == 2 and t["config"]["num_draft_tokens"] == 4
    md = tmp_path / "replay.md"
    assert replay.main([str(path), "--out", str(md)]) == 0, md.read_text()
    assert "**PASS**" in md.read_text()
