"""Teacher-forced acceptance (issue 25, refspec.harness.teacher_forced): on a fixed text (the
target's greedy continuation) it gives the accept lengths of the oracle loop's rounds exactly, for
chain drafts of every kind, v1 and v2; a draft that knows the text accepts every draft;
a draft that is never right accepts none; bad input is refused by name."""

from __future__ import annotations

import pytest
import torch

from refspec.harness.teacher_forced import round_lengths, teacher_forced_accepts
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative import generate
from refspec.speculative.api import greedy_reference

PROMPTS = [[3, 5, 7, 9], [1, 2, 3, 4, 5, 6, 7]]
M = 30


def _model(seed):
    return init_random_(LlamaModel(tiny_config()), seed=seed).eval().requires_grad_(False)


@pytest.mark.spec("SD-001", "SD-004", "SD-005")
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("draft", ["eagle", "eagle3", "early-exit:1"])
@pytest.mark.parametrize("Sd", [1, 3, 4])
def test_teacher_forced_accepts_are_the_oracle_loops(seed, draft, Sd):
    m = _model(seed)
    d = make_draft(draft, m, seed=seed)
    ref = greedy_reference(m, PROMPTS, [M + Sd] * len(PROMPTS))
    for version in ("v1", "v2"):
        res = generate(m, PROMPTS, backend="oracle", version=version, draft=d, num_steps=Sd, max_new_tokens=M)
        for i, p in enumerate(PROMPTS):
            tf = teacher_forced_accepts(m, d, p, ref[i], num_steps=Sd, max_new_tokens=M)
            assert tf == res.requests[i].accepts, (version, i)


def test_eos_stops_the_walk_as_the_loop_stops():
    m = _model(2)
    d = make_draft("early-exit:1", m)
    ref = greedy_reference(m, PROMPTS[:1], [M + 3])
    eos = ref[0][len(PROMPTS[0]) + 7]  # a token of the greedy text: the run stops at its first occurrence
    res = generate(m, PROMPTS[:1], backend="oracle", draft=d, num_steps=3, max_new_tokens=M, eos=eos)
    assert teacher_forced_accepts(m, d, PROMPTS[0], ref[0], num_steps=3, max_new_tokens=M, eos=eos) == \
        res.requests[0].accepts


def test_a_draft_that_knows_the_text_accepts_every_draft():
    """Draft KV index j consumes t_(j+1) and must propose t_(j+2): a draft reading that from the
    text is always right, so every round accepts Sd + 1 (and the indexing of the rounds is checked)."""
    m = _model(0)
    ref = greedy_reference(m, PROMPTS[:1], [M + 3])
    text = torch.tensor(ref[0] + [0, 0])

    class Knows:
        num_layers, num_kv_heads, head_dim, uses_hidden = 1, 2, 16, False

        def forward(self, input_ids, hidden, fb, backend):
            return torch.nn.functional.one_hot(text[fb.positions + 2], 128).float(), None

    n = round_lengths(m, Knows(), ref[0], len(PROMPTS[0]), 3)
    assert n == [3] * len(n)
    acc = teacher_forced_accepts(m, Knows(), PROMPTS[0], ref[0], num_steps=3, max_new_tokens=M)
    assert acc == [4] * len(acc) and 1 + 4 * (len(acc) - 1) < M <= 1 + 4 * len(acc)


def test_a_draft_that_is_never_right_accepts_nothing():
    m = _model(0)
    ref = greedy_reference(m, PROMPTS[:1], [M + 3])
    wrong = max(set(range(128)) - set(ref[0]))  # a token the text never contains

    class Wrong:
        num_layers, num_kv_heads, head_dim, uses_hidden = 1, 2, 16, False

        def forward(self, input_ids, hidden, fb, backend):
            return torch.nn.functional.one_hot(torch.full_like(input_ids, wrong), 128).float(), None

    acc = teacher_forced_accepts(m, Wrong(), PROMPTS[0], ref[0], num_steps=3, max_new_tokens=M)
    assert acc == [1] * (M - 1)  # one token per round after the prefill's root


@pytest.mark.parametrize("kw, match", [
    ({"prompt": []}, "prompt must be non-empty"),
    ({"num_steps": 0}, "num_steps"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"reference": [9, 9, 9, 9, 1, 2, 3] * 10}, "reference must start with the prompt"),
    ({"reference": [3, 5, 7, 9, 1, 2]}, "needs max_new_tokens \\+ num_steps"),
])
def test_bad_input_is_refused_by_name(kw, match):
    m = _model(0)
    args = dict(prompt=PROMPTS[0], reference=PROMPTS[0] + [1] * 40, num_steps=3, max_new_tokens=10)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        teacher_forced_accepts(m, make_draft("early-exit:1", m), args.pop("prompt"), args.pop("reference"), **args)
