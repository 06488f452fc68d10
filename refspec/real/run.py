"""Set-up shared by ``demo``, ``record`` and ``replay``: the real model, MT-Bench prompts, budgets,
CPU threads and a token progress bar.

* :func:`load_target`: SmolLM2-135M-Instruct (``refspec.real.load_smollm2``) in a
  :class:`~refspec.model.llama.LlamaModel`, strict HF-name load, eval mode, no grad.
* :func:`pick_questions`: MT-Bench first turns, round-robin over the 8 categories (writing,
  roleplay, reasoning, math, ...) unless one category is asked for.
* :func:`chat_prompts`: ChatML token ids (default system turn, then the user turn, then the
  ``<|im_start|>assistant\\n`` cue), :func:`refspec.real.chat_ids`.
* :func:`budgets`: one ``max_new_tokens`` per request, staggered so that requests leave the
  batch at different rounds.
* :func:`set_threads`: intra-op threads, 1 by default (on 2 shared cores two threads measured
  4-10x slower than one as soon as anything else ran).
* :class:`TokenBar`: a tqdm bar counted in generated tokens; its :meth:`observer` plugs into
  the engine's ``observer`` hook.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from refspec.model.llama import LlamaConfig, LlamaModel

DEFAULT_DRAFT = "eagle"  #: the trained EAGLE head (refspec.real.eagle_head); early-exit:K stays available
RECORD_DRAFT = "early-exit:25"  #: what the committed MT-Bench trace was recorded with (record's default)
DEFAULT_NUM_STEPS = 3  #: Sd


def load_target(dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, float]:
    """SmolLM2-135M-Instruct as a :class:`LlamaModel` and the seconds the load took.

    Shapes: 30 layers, hidden 576, H = 9 / Hkv = 3, D = 64, vocab 49 152, tied head.
    Raises :class:`refspec.real.RealAssetsMissing` (with the install command) if the GGUF or the
    ``gguf`` package is missing.
    """
    from refspec.real import load_smollm2

    t = time.perf_counter()
    cfg, state = load_smollm2(dtype)
    model = LlamaModel(LlamaConfig.from_dict(cfg))
    model.load_state_dict(state, strict=True)
    model.to(dtype).eval().requires_grad_(False)
    return model, time.perf_counter() - t


def pick_questions(n: int, category: str | None = None) -> list[dict]:
    """``n`` MT-Bench questions: the first ``n`` of ``category``, or round-robin over the
    categories in file order (q 81 writing, q 91 roleplay, q 101 reasoning, q 111 math, ...).

    Each item: ``{"question_id", "category", "prompt"}`` (the first turn).  ValueError if fewer
    than ``n`` exist.
    """
    from refspec.real import CATEGORIES, mtbench_questions

    if category is not None:
        qs = mtbench_questions(category)
    else:
        per_cat = [mtbench_questions(c) for c in CATEGORIES]
        qs = [cat[i] for i in range(max(map(len, per_cat))) for cat in per_cat if i < len(cat)]
    if n > len(qs):
        raise ValueError(f"asked for {n} MT-Bench questions, {len(qs)} available")
    return [{k: q[k] for k in ("question_id", "category", "prompt")} for q in qs[:n]]


def chat_prompts(questions: list[dict]) -> list[list[int]]:
    """ChatML prompt token ids of each question (``refspec.real.chat_ids``): B lists of ints."""
    from refspec.real import chat_ids

    return [chat_ids(q["prompt"]) for q in questions]


def budgets(n: int, spec: str | int) -> list[int]:
    """One ``max_new_tokens`` per request (tokens).

    Shapes: returns n ints.  ``spec``: ``"40,32,24"`` (cycled over the n requests) or one int M,
    staggered as ``M, M - s, M - 2s, ...`` with ``s = M // (2n)`` (the last gets about M / 2).
    ValueError if a budget would be < 1, or if a list has more values than there are requests
    (the extra ones would be silently unused).
    """
    if isinstance(spec, str) and "," in spec:
        vals = [int(x) for x in spec.split(",") if x.strip()]
        if len(vals) > n:
            raise ValueError(f"{len(vals)} max_new_tokens values for {n} requests: give at most {n} "
                             f"(a shorter list is cycled)")
        out = [vals[i % len(vals)] for i in range(n)]
    else:
        m = int(spec)
        step = m // (2 * n) if n > 1 else 0
        out = [m - i * step for i in range(n)]
    if min(out, default=1) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {out}")
    return out


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads (default 1) and return the number set.

    One thread by default: this model's matmuls are small, and on a shared 2-core machine two
    threads measured 4-10x *slower* than one as soon as anything else ran (spin-waiting
    threads); ``--threads 2`` is worth trying only on an idle machine.
    """
    torch.set_num_threads(max(1, threads or 1))
    return torch.get_num_threads()


class TokenBar:
    """A tqdm bar in generated tokens over several runs (``total`` = their summed budgets).

    ``observer`` counts the production engine's tokens as rounds end; :meth:`add` counts a
    finished request of a per-request loop; :meth:`finish_run` tops the bar up to the run's
    full budget (a request that stopped at EOS used less of it).
    """

    def __init__(self, total: int, desc: str = "tokens", disable: bool = False):
        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, disable=disable,
                        dynamic_ncols=True, mininterval=0.5)
        self._run_done = 0

    def start_run(self, label: str) -> None:
        self.note(label)
        self._run_done = 0

    def note(self, text: str) -> None:
        """Show ``text`` after the bar (the run going on, or runs done / total)."""
        self.bar.set_postfix_str(text)

    def add(self, n: int) -> None:
        self.bar.update(n)
        self._run_done += n

    def observer(self, event: str, engine, **info) -> None:
        """Engine hook: counts the prefill token of each joined request and each round's output."""
        if event == "prefill":
            self.add(len(info["reqs"]))
        elif event == "round_end":
            self.add(sum(r.emitted[-1] for r in info["reqs"]))

    def finish_run(self, budget: int) -> None:
        self.add(max(0, budget - self._run_done))

    def close(self) -> None:
        self.bar.close()


def capture_sizes(B: int) -> tuple[int, ...]:
    """The graph batch sizes the demos capture for B requests: 1, 2, 4, 8 below 2B (so the
    live batch and every batch it shrinks to as requests finish replay padded, CG-007)."""
    return tuple(b for b in (1, 2, 4, 8) if b < 2 * B)


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where token lists ``a`` and ``b`` differ (the shorter length if one is a
    prefix of the other), or None when they are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
