"""EAGLE-3 (issue 41, part 2): the target's aux hidden states (low / middle / high), the
``Eagle3Draft`` that reads them, the speculative loops running it losslessly (SD-002), and
``train-draft --kind eagle3`` (features from the layers named, the training-time test on the
draft's own predictions, the loss falling, a resumed run equal to an uninterrupted one, the
head file, self-distilled rows).  CPU, the tiny random-init model, fp32."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from refspec.model.drafts import Eagle3Draft, default_aux_layers, make_draft
from refspec.model.fused import FusedLlama
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV
from refspec.real import draft_data as dd
from refspec.real.draft_train import (Features, Recipe, draft_losses, extract_features, new_head, save_head,
                                      self_distilled_rows, train)
from refspec.speculative import generate, greedy_reference

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)


@functools.lru_cache(maxsize=None)
def target() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config(max_position_embeddings=128)), seed=3).eval().requires_grad_(False)


def layer_states(model: LlamaModel, ids: torch.Tensor) -> list[torch.Tensor]:
    """Hidden state i (the input of decoder layer i; the last = the last layer's output) of one
    dense forward, read by hooks on the layers themselves, not by the code under test."""
    seen: list[torch.Tensor] = []
    hooks = [lay.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
             for lay in model.model.layers]
    hooks.append(model.model.layers[-1].register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone())))
    try:
        c = model.config
        kv = DenseKV(c.num_hidden_layers, ids.numel(), c.num_key_value_heads, c.head_dim)
        model(ids, DenseBatch.span(0, ids.numel()), DenseBackend(kv))
    finally:
        for h in hooks:
            h.remove()
    return seen


# ------------------------------------------------------------------ the target's side
def test_default_aux_layers_are_upstreams_low_middle_high():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M: upstream's [2, L // 2, L - 3]
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(2) == (0, 1, 2)  # the test model: every state it has
    assert all(len(default_aux_layers(n)) >= 2 for n in range(1, 40))


@pytest.mark.parametrize("aux", [(0, 1, 2), (1, 2), (0, 2)])
def test_aux_hidden_states_are_the_layers_named(aux):
    m = target()
    ids = torch.tensor([5, 9, 17, 3, 44, 8])
    states = layer_states(m, ids)
    c = m.config
    kv = DenseKV(c.num_hidden_layers, ids.numel(), c.num_key_value_heads, c.head_dim)
    logits, h = m(ids, DenseBatch.span(0, ids.numel()), DenseBackend(kv), aux=aux)
    assert torch.equal(h, torch.cat([states[i] for i in aux], dim=-1))
    others = [x for x in ((0, 1), (1, 2), (0, 2), (0, 1, 2)) if x != aux and len(x) == len(aux)]
    for other in others:  # negative control: another set of layers is another tensor
        assert not torch.equal(h, torch.cat([states[i] for i in other], dim=-1))
    kv2 = DenseKV(c.num_hidden_layers, ids.numel(), c.num_key_value_heads, c.head_dim)
    logits2, last = m(ids, DenseBatch.span(0, ids.numel()), DenseBackend(kv2))
    assert torch.equal(logits, logits2) and torch.equal(last, states[-1])  # aux changes only what is returned
    kv3 = DenseKV(c.num_hidden_layers, ids.numel(), c.num_key_value_heads, c.head_dim)
    _, fused = FusedLlama(m)(ids, DenseBatch.span(0, ids.numel()), DenseBackend(kv3), aux=aux)
    torch.testing.assert_close(fused, h, rtol=1e-5, atol=1e-5)  # the fused twin: T1 (fused projections)


@pytest.mark.parametrize("aux", [(), (2, 1), (1, 1), (0, 3), (-1, 1), (True, 2)])
def test_bad_aux_indices_are_refused_by_name(aux):
    m = target()
    with pytest.raises(ValueError, match="aux hidden states"):
        m(torch.tensor([1, 2]), DenseBatch.span(0, 2), DenseBackend(DenseKV(2, 2, 2, 16)), aux=aux)


def test_eagle3_needs_two_states_at_least():
    with pytest.raises(ValueError, match="at least two"):
        Eagle3Draft(target(), aux_layers=(2,))
    with pytest.raises(ValueError, match="unknown draft 'eagle4'"):
        make_draft("eagle4", target())
    with pytest.raises(ValueError, match="eagle3:PATH"):
        make_draft("eagle3:/some/file.safetensors", target())


class Spy:
    """A draft that records the ``hidden`` of every forward and delegates to ``d``."""

    def __init__(self, d):
        self.d, self.seen = d, []
        self.uses_hidden, self.aux_layers = d.uses_hidden, d.aux_layers
        self.num_layers, self.num_kv_heads, self.head_dim, self.hidden_size = 1, d.num_kv_heads, d.head_dim, 64

    def forward(self, input_ids, hidden, fb, backend):
        self.seen.append(None if hidden is None else hidden.detach().clone())
        return self.d.forward(input_ids, hidden, fb, backend)


@pytest.mark.parametrize("backend", ["oracle", "fa3", "paged-oracle"])
@pytest.mark.parametrize("aux", [(0, 1, 2), (0, 2)])
def test_the_loops_hand_the_draft_the_layers_named(backend, aux):
    """The draft prefill reads the target prefill's hidden states ``aux`` (hooks on the layers);
    the draft-decode steps read the draft's own ``[T, E]`` hidden."""
    m = target()
    prompt = [5, 9, 17, 3, 44, 8]
    states = layer_states(m, torch.tensor(prompt))
    spy = Spy(Eagle3Draft(m, aux_layers=aux))
    generate(m, [prompt], backend=backend, version="v2", draft=spy, max_new_tokens=6, page_size=4)
    first = spy.seen[0]  # the draft prefill: rows 0..p-1 read h_0..h_(p-1)
    # the dense oracle attends as the hooked dense forward does (bitwise); the paged wings round
    # their attention differently (the emulator's split-KV order), so ~1e-6 there
    tol = dict(rtol=0, atol=0) if backend == "oracle" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first, torch.cat([states[i] for i in aux], dim=-1), **tol)
    other = (2, 1, 0) if aux == (0, 1, 2) else (1, 2)  # negative control: other layers, or another order
    assert not torch.allclose(first, torch.cat([states[i] for i in other], dim=-1), rtol=1e-2, atol=1e-2)
    widths = {h.shape[-1] for h in spy.seen[1:]}
    assert widths == {64, 64 * len(aux)}, widths  # decode steps: its own; extend: the target's


# ------------------------------------------------------------------ a trained tiny head, lossless
@functools.lru_cache(maxsize=None)
def distilled() -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (4,), generator=g).tolist() for _ in range(40)]
    return self_distilled_rows(target(), prompts, max_new_tokens=28, eos=None, batch=20, page_size=4, row_len=32,
                               min_len=8)


@functools.lru_cache(maxsize=None)
def trained(kind: str = "eagle3") -> dict:
    rows, lengths = distilled()
    return train(target(), rows, lengths, Recipe(kind=kind, steps=30, batch_rows=8, heldout_rows=8, warmup=5, lr=3e-3))


@functools.lru_cache(maxsize=None)
def head():
    return trained()["head"].eval().requires_grad_(False)


PROMPTS = [[3, 5, 7, 9, 11], [60, 2, 33], [100, 101, 7, 7, 40, 41, 42, 9, 12]]
BUDGETS = [14, 9, 16]


@functools.lru_cache(maxsize=None)
def baseline() -> list[list[int]]:
    ref = greedy_reference(target(), PROMPTS, BUDGETS)
    return [ref[i][len(p):] for i, p in enumerate(PROMPTS)]


@functools.lru_cache(maxsize=None)
def oracle(version: str):
    return generate(target(), PROMPTS, backend="oracle", version=version, draft=head(), max_new_tokens=BUDGETS)


LOOPS = [("v1", False, 1, False), ("v1", False, 4, True), ("v2", False, 4, False), ("v2", False, 1, True),
         ("v2", True, 4, True), ("v2", True, 16, False)]


@pytest.mark.spec("SD-002", "TOL-001", "KV-006")
@pytest.mark.parametrize("version,overlap,page_size,graphs", LOOPS,
                         ids=[f"{v}{'-overlap' if o else ''}-P{P}-{'graph' if g else 'eager'}" for v, o, P, g in LOOPS])
def test_production_loop_with_an_eagle3_head_is_lossless_and_equals_the_oracle(version, overlap, page_size, graphs):
    res = generate(target(), PROMPTS, backend="fa3", version=version, overlap=overlap, page_size=page_size,
                   graphs=graphs, draft=head(), max_new_tokens=BUDGETS)
    assert res.tokens == baseline(), "speculative output differs from plain greedy (SD-002)"
    ora = oracle(version)
    assert ora.tokens == baseline(), "the oracle loop with the eagle3 head is not lossless"
    assert res.accepts == ora.accepts and res.drafts == ora.drafts  # the same features reached the draft
    assert res.free_pages[0] == res.free_pages[1]
    if graphs:
        assert any(t.graph for t in res.trace), "no round replayed a graph"


@pytest.mark.spec("SD-002", "TR-006")
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_tree_loops_with_an_eagle3_head_are_lossless(version):
    kw = dict(version=version, draft=head(), max_new_tokens=BUDGETS, topk=2, num_draft_tokens=4)
    ora = generate(target(), PROMPTS, backend="oracle", **kw)
    res = generate(target(), PROMPTS, backend="fa3", page_size=4, graphs=True, **kw)
    assert ora.tokens == baseline() and res.tokens == baseline()
    assert res.accepts == ora.accepts


def test_teacher_forced_accepts_of_an_eagle3_head_are_the_oracle_loops():
    from refspec.harness.teacher_forced import teacher_forced_accepts

    ref = greedy_reference(target(), PROMPTS, [b + 3 for b in BUDGETS])
    ora = oracle("v2")
    for i, p in enumerate(PROMPTS):
        assert teacher_forced_accepts(target(), head(), p, ref[i], num_steps=3, max_new_tokens=BUDGETS[i]) == \
            ora.requests[i].accepts


# ------------------------------------------------------------------ train-draft --kind eagle3
def test_training_features_are_the_layers_named():
    m = target()
    rows, _ = distilled()
    ids = torch.from_numpy(rows[:3].astype(np.int64))
    hidden, greedy = extract_features(m, ids, batch=2, aux=(0, 2))
    for r in range(3):  # SDPA over whole rows vs the dense oracle's attention: rounding apart
        states = layer_states(m, ids[r])
        torch.testing.assert_close(hidden[r], torch.cat([states[0], states[2]], dim=-1), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(hidden[r], torch.cat([states[1], states[2]], dim=-1), rtol=1e-2, atol=1e-2)
    online = Features(m, ids, aux=(0, 2), online=True)  # the target run per batch, as eagle3 trains
    idx = torch.tensor([2, 0])
    h2, g2 = online(idx)
    torch.testing.assert_close(h2, hidden[idx], rtol=1e-4, atol=1e-4)
    assert torch.equal(g2, greedy[idx])


def test_recipe_defaults_and_refusals_per_kind():
    r = Recipe(kind="eagle3", unroll=4)
    assert r.step_weights == pytest.approx((1.0, 0.8, 0.64, 0.512)) and r.hidden_weight == 0.0
    e = Recipe()
    assert e.step_weights == (1.0, 0.8, 0.6) and e.hidden_weight == 0.1  # the committed head's recipe
    with pytest.raises(ValueError, match="hidden_weight must be 0 for kind eagle3"):
        Recipe(kind="eagle3", hidden_weight=0.1)
    with pytest.raises(ValueError, match="aux_layers is for kind eagle3"):
        Recipe(aux_layers=(0, 1))
    with pytest.raises(ValueError, match="kind must be one of"):
        Recipe(kind="medusa")


def test_training_time_test_feeds_each_step_the_drafts_own_hidden():
    """Step 0 reads the target's aux states; step s >= 1 at index j reads the draft's own output
    of step s - 1 at index j - 1 (zeros at j = 0), as its decode step does.  Negative control:
    the target's features are not what steps >= 1 read."""
    m = target()
    rows, lengths = distilled()
    ids = torch.from_numpy(rows[:2].astype(np.int64))
    recipe = Recipe(kind="eagle3", unroll=3, aux_layers=(0, 1, 2))
    feats, greedy = extract_features(m, ids, aux=recipe.aux_layers)
    h = new_head(m, 0, recipe)
    calls = []
    real = h.forward

    def spy(input_ids, hidden, fb, backend):
        logits, out = real(input_ids, hidden, fb, backend)
        calls.append((hidden.detach().clone(), out.detach().clone()))
        return logits, out

    h.forward = spy
    draft_losses(h, ids, torch.from_numpy(lengths[:2].astype(np.int64)), feats, greedy, recipe)
    R, n = 2, ids.shape[1] - 1
    assert len(calls) == 3
    assert torch.equal(calls[0][0], feats[:, :n].reshape(R * n, -1))
    for s in (1, 2):
        prev = calls[s - 1][1].view(R, n, -1)
        want = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1).reshape(R * n, -1)
        assert torch.equal(calls[s][0], want), s
        assert calls[s][0].shape[-1] == 64 and not torch.equal(calls[s][0], calls[0][0][:, :64])


def test_eagle3_training_lowers_the_loss():
    res = trained()
    losses = [x["loss"] for x in res["log"]]
    assert res["finished"] and losses[-1] < 0.9 * losses[0], losses
    assert res["recipe"].aux_layers == (0, 1, 2)  # filled in: default_aux_layers(2)
    assert len(res["metrics"]["top1"]) == 3


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, kind):
    rows, lengths = distilled()
    r = Recipe(kind=kind, steps=12, batch_rows=8, heldout_rows=8, warmup=3, lr=3e-3)
    whole = train(target(), rows, lengths, r)
    ck = tmp_path / "h.ckpt"
    part = train(target(), rows, lengths, r, checkpoint=ck, stop_at=5)
    assert not part["finished"] and part["step"] == 5
    rest = train(target(), rows, lengths, r, checkpoint=ck, resume=True)
    assert rest["finished"] and rest["step"] == 12
    for k, v in whole["head"].state_dict().items():
        assert torch.equal(rest["head"].state_dict()[k], v), k
    assert rest["log"] == whole["log"] and rest["metrics"] == whole["metrics"]
    other = Recipe(kind=kind, steps=12, batch_rows=8, heldout_rows=8, warmup=3, lr=1e-3)
    with pytest.raises(ValueError, match="different recipe.*lr"):
        train(target(), rows, lengths, other, checkpoint=ck, resume=True)


# ------------------------------------------------------------------ the head file and the draft spec
def test_eagle3_head_file_round_trips_into_the_loops(tmp_path):
    from refspec.real.eagle_head import HeadMismatch, head_kind, load_head, real_draft

    h = head()
    path = tmp_path / "e3.safetensors"
    card = save_head(h, path, {"note": "test"})
    assert head_kind(path) == ("eagle3", (0, 1, 2))
    got = real_draft(f"eagle3:{path}", target())
    assert isinstance(got, Eagle3Draft) and got.aux_layers == (0, 1, 2)
    for k, v in h.state_dict().items():
        assert torch.equal(got.state_dict()[k], v.to(torch.bfloat16).float()), k
    res = generate(target(), PROMPTS, backend="fa3", version="v2", page_size=4, graphs=True, draft=got,
                   max_new_tokens=BUDGETS)
    assert res.tokens == baseline()
    with pytest.raises(HeadMismatch, match="holds an eagle3 head, not eagle"):
        real_draft(f"eagle:{path}", target())
    with pytest.raises(HeadMismatch, match="sha256"):
        load_head(target(), path, sha256="0" * 64)
    wide = init_random_(LlamaModel(tiny_config(hidden_size=32, head_dim=8)), seed=0)
    with pytest.raises(HeadMismatch, match="does not fit the target"):
        load_head(wide, path, sha256=card["sha256"])


def test_cli_draft_spec_takes_eagle3_and_a_head_file(tmp_path):
    import argparse

    from refspec.cli._args import draft_spec

    path = tmp_path / "e3.safetensors"
    save_head(head(), path, {})
    assert draft_spec("eagle3") == "eagle3" and draft_spec(f"eagle3:{path}") == f"eagle3:{path}"
    with pytest.raises(argparse.ArgumentTypeError, match="no head file"):
        draft_spec(f"eagle3:{tmp_path / 'absent.safetensors'}")
    with pytest.raises(argparse.ArgumentTypeError, match="choose eagle, eagle3"):
        draft_spec("eagle4")


# ------------------------------------------------------------------ self-distilled data
def test_self_distilled_rows_are_the_targets_greedy_answers():
    m = target()
    prompts = [[3, 5, 7, 9], [60, 2, 33, 8, 1]]
    rows, lengths = self_distilled_rows(m, prompts, max_new_tokens=10, eos=None, batch=1, page_size=4, row_len=16,
                                        min_len=8)
    ref = greedy_reference(m, prompts, [10, 10])
    assert [rows[i, :lengths[i]].tolist() for i in range(2)] == [ref[0][:16], ref[1][:15]]


def test_first_turn_prompts_are_read_back_out_of_the_rows():
    prefix, end, cue = [1, 50, 51, 2, 9], [2, 9], [1, 60, 9]
    convs = [prefix + [1, 70, 71, 72, 2, 9] + [1, 60, 9, 80, 81, 2, 9],  # a conversation: its first user turn
             [40, 41, 42, 43, 44, 45, 46, 47],  # the middle of one: no prefix
             prefix + [1, 70] + [73] * 20]  # a user turn that does not end inside the row
    rows, lengths = dd.token_rows(convs, row_len=16, min_len=4)
    got = dd.first_turn_prompts(rows, lengths, prefix=prefix, turn_end=end, cue=cue)
    assert got == [prefix + [1, 70, 71, 72, 2, 9] + cue]
