"""Adversarial inputs at the EAGLE-3 entry points (issue 41): drafts, head files, train-draft.

Each test is one input that, before this file, raised a bare error (``AttributeError``,
``TypeError``, ``SafetensorError``, ``UnpicklingError``, a shape ``RuntimeError``) or was accepted
silently; the docstring says which.  Now it raises a ``ValueError`` (or its subclass
:class:`~refspec.real.eagle_head.HeadMismatch`) naming the argument or the file.  The command
line's refusals of ``train-draft`` flags are in ``tests/test_cli_errors.py`` (CASES).

CPU, the tiny random-init models; the whole file runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math

import numpy as np
import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.model.deepseek import DeepseekModel, tiny_deepseek_config
from refspec.model.deepseek_nextn import MTPDraft
from refspec.model.drafts import Eagle3Draft, EagleDraft, make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.real.draft_train import Recipe, save_head, train
from refspec.real.eagle_head import HeadMismatch, head_kind, load_head, real_draft
from refspec.speculative import generate


@contextlib.contextmanager
def value_error(word: str, cls=ValueError):
    """A ValueError (of ``cls``, never an InvariantError) whose message names ``word``."""
    with pytest.raises(cls, match=word) as info:
        yield info
    assert not isinstance(info.value, InvariantError), str(info.value)


@functools.lru_cache(maxsize=None)
def llama() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config(max_position_embeddings=64)), seed=3).eval().requires_grad_(False)


@functools.lru_cache(maxsize=None)
def deepseek() -> DeepseekModel:
    return init_random_(DeepseekModel(tiny_deepseek_config()), seed=0).eval().requires_grad_(False)


# ================================================================ drafts
@pytest.mark.parametrize("make", [lambda t: Eagle3Draft(t), lambda t: EagleDraft(t)], ids=["eagle3", "eagle"])
def test_an_eagle_head_on_a_deepseek_target_is_refused_by_name(make):
    """Before: AttributeError ('DeepseekConfig' object has no attribute 'num_key_value_heads');
    ``make_draft("eagle3", deepseek)`` already named it, the classes did not."""
    with value_error("drafts for a LlamaModel target, got DeepseekModel.*'mtp'"):
        make(deepseek())
    assert make(llama()).num_layers == 1  # the valid target


@pytest.mark.parametrize("aux", [3, None.__class__, 2.5])
def test_aux_layers_that_are_no_sequence_are_named(aux):
    """Before: TypeError ('int' object is not iterable), naming neither aux nor the layers."""
    with value_error("aux hidden states must be a sequence of ints"):
        Eagle3Draft(llama(), aux_layers=aux)
    assert Eagle3Draft(llama(), aux_layers=(0, 2)).aux_layers == (0, 2)


def test_a_draft_object_of_another_width_is_refused_before_the_loop():
    """Before: an MTP draft built for a DeepSeek target of hidden size 32, handed to one of 64,
    failed mid-loop with RuntimeError ('The size of tensor a (32) must match the size of tensor
    b (64)').  A draft of the right width (another target's MTP layer of the same sizes) is
    accepted: the loop stays lossless, whatever the draft proposes."""
    narrow = init_random_(DeepseekModel(tiny_deepseek_config(hidden_size=32)), seed=0)
    with value_error("reads hidden states of width 32, the target's are 64"):
        make_draft(MTPDraft(narrow), deepseek())
    with value_error("reads hidden states of width 32, the target's are 64"):
        generate(deepseek(), [[1, 2, 3]], max_new_tokens=2, draft=MTPDraft(narrow))
    same = init_random_(DeepseekModel(tiny_deepseek_config()), seed=5)
    plain = generate(deepseek(), [[1, 2, 3]], max_new_tokens=4, draft="mtp").tokens
    assert generate(deepseek(), [[1, 2, 3]], max_new_tokens=4, draft=MTPDraft(same)).tokens == plain


# ================================================================ head files
@functools.lru_cache(maxsize=None)
def head3() -> Eagle3Draft:
    return Eagle3Draft(llama(), aux_layers=(0, 2), seed=4)


def saved(tmp_path, name="h3.safetensors"):
    path = tmp_path / name
    save_head(head3(), path, {"note": "test"})
    return path


@pytest.mark.parametrize("content", [lambda b: b[:len(b) // 2], lambda b: b"hello world", lambda b: b""],
                         ids=["truncated", "garbage", "empty"])
def test_an_unreadable_head_file_is_named(tmp_path, content):
    """Before: safetensors' SafetensorError ('Error while deserializing header: ...'), naming no
    file; through ``--draft eagle3:PATH`` a traceback-free line but not a HeadMismatch."""
    good = saved(tmp_path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content(good.read_bytes()))
    with value_error(rf"{bad}: not a readable safetensors file", HeadMismatch):
        real_draft(f"eagle3:{bad}", llama())
    assert isinstance(real_draft(f"eagle3:{good}", llama()), Eagle3Draft)  # the valid file


@pytest.mark.parametrize("aux", ["a,b", ",", "2;15"])
def test_a_head_file_with_malformed_aux_layers_metadata_is_named(tmp_path, aux):
    """Before: ValueError ("invalid literal for int() with base 10: 'a'"), naming no file."""
    from safetensors.torch import save_file

    path = tmp_path / "aux.safetensors"
    save_file({k: v.contiguous() for k, v in head3().state_dict().items()}, str(path),
              metadata={"format": "pt", "structure": "refspec Eagle3Draft", "aux_layers": aux})
    with value_error(f"{path}: metadata aux_layers", HeadMismatch):
        head_kind(path)


@pytest.mark.parametrize("card,word", [("{not json", "is not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_a_broken_card_beside_a_head_file_is_named(tmp_path, card, word):
    """Before: JSONDecodeError naming no file; a JSON list raised AttributeError ('.get')."""
    path = saved(tmp_path)
    path.with_suffix(".json").write_text(card)
    with value_error(rf"h3.json: the head's card {word}", HeadMismatch):
        load_head(llama(), path)


def test_a_head_for_a_deepseek_target_and_a_folder_as_head_are_named(tmp_path):
    """Before: AttributeError (DeepseekConfig has no num_key_value_heads) for ``eagle3:PATH`` with a
    DeepSeek target; OSError ('No such device') for a folder given as PATH."""
    path = saved(tmp_path)
    with value_error("drafts for a LlamaModel target, got DeepseekModel", HeadMismatch):
        real_draft(f"eagle3:{path}", deepseek())
    with value_error("no such head file", FileNotFoundError):
        real_draft(f"eagle3:{tmp_path}", llama())


# ================================================================ train-draft: Recipe and checkpoints
@pytest.mark.parametrize("kw,word", [
    (dict(unroll=0), "unroll must be an int >= 1"),  # before: 'unroll=0 needs that many step_weights'
    (dict(unroll="3"), "unroll must be an int >= 1"),  # before: TypeError in range()
    (dict(unroll=4), "kind 'eagle' has step_weights .* for at most 3"),  # before: named no way out on the CLI
    (dict(lr=float("nan")), "lr must be a finite number"),  # before: trained to NaN silently
    (dict(lr=-1e-3), "lr must be > 0"),  # before: gradient ascent, silently
    (dict(final_lr=2.0), r"final_lr .* \[0, 1\]"),  # before: a decay that grows the LR
    (dict(warmup=-1), "warmup must be an int >= 0"),  # before: a warm-up LR of (step + 1) / -1 < 0
    (dict(heldout_rows=0), "heldout_rows must be an int >= 1"),  # before: an evaluation dividing by 0 (nan)
    (dict(kind="eagle3", aux_layers=(2, 2)), r"aux_layers \(2, 2\).*strictly increasing"),  # before: after loading
    (dict(kind="eagle3", aux_layers=(15, 2)), r"aux_layers \(15, 2\)"),  # the target, in train()
    (dict(kind="eagle3", aux_layers=(5,)), "at least two"),
    (dict(kind="eagle3", aux_layers=(-1, 2)), "indices >= 0"),
    (dict(kind="eagle3", aux_layers="2,15"), "aux_layers '2,15'"),
], ids=["unroll-0", "unroll-str", "unroll-4-eagle", "lr-nan", "lr-negative", "final-lr", "warmup", "heldout-0",
        "aux-repeat", "aux-unsorted", "aux-one", "aux-negative", "aux-str"])
def test_recipe_refuses_settings_it_cannot_train_with(kw, word):
    with value_error(word):
        Recipe(**kw)
    assert Recipe(kind="eagle3", unroll=5, aux_layers=[2, 15, 27]).aux_layers == (2, 15, 27)  # the valid one


def _rows():
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 128, (12, 16), generator=g).numpy().astype(np.uint16)
    return rows, np.full(12, 16, dtype=np.int32)


def test_resuming_from_a_file_that_is_no_checkpoint_names_it(tmp_path):
    """Before: ``--resume --checkpoint`` naming a head file (or a truncated checkpoint) raised
    UnpicklingError / RuntimeError from torch.load ('invalid load key'), naming no file."""
    rows, lengths = _rows()
    r = Recipe(steps=2, batch_rows=4, heldout_rows=4, warmup=1)
    head = saved(tmp_path)
    with value_error(f"{head}: not a train-draft checkpoint"):
        train(llama(), rows, lengths, r, checkpoint=head, resume=True)
    ck = tmp_path / "h.ckpt"
    train(llama(), rows, lengths, r, checkpoint=ck, stop_at=0)
    ck.write_bytes(ck.read_bytes()[:100])
    with value_error(f"{ck}: not a train-draft checkpoint"):
        train(llama(), rows, lengths, r, checkpoint=ck, resume=True)
    torch.save({"step": 3}, ck)  # a pickle, but not what save_checkpoint writes
    with value_error("not a train-draft checkpoint .no head, opt, order, recipe, log"):
        train(llama(), rows, lengths, r, checkpoint=ck, resume=True)


def test_resuming_a_checkpoint_of_the_other_kind_names_the_kind(tmp_path):
    """An eagle checkpoint resumed as eagle3 is refused naming ``kind`` (and what follows from it),
    before a step runs; the same kind resumes (positive control)."""
    rows, lengths = _rows()
    eagle = Recipe(steps=2, batch_rows=4, heldout_rows=4, warmup=1)
    ck = tmp_path / "e.ckpt"
    assert train(llama(), rows, lengths, eagle, checkpoint=ck, stop_at=0)["step"] == 0
    other = Recipe(kind="eagle3", steps=2, batch_rows=4, heldout_rows=4, warmup=1, aux_layers=(0, 2))
    with value_error("different recipe .*kind: 'eagle' there, 'eagle3' here"):
        train(llama(), rows, lengths, other, checkpoint=ck, resume=True)
    assert train(llama(), rows, lengths, eagle, checkpoint=ck, resume=True)["step"] == 2


def test_the_committed_card_still_reads():
    """The card loader's new refusals leave the shipped head's card readable (positive control)."""
    from refspec.real.eagle_head import HEAD_FILE, head_card

    card = head_card(HEAD_FILE)
    assert isinstance(card, dict) and len(card["sha256"]) == 64
    assert json.loads(HEAD_FILE.with_suffix(".json").read_text()) == card


# ================================================================ the shared timing rule (refspec/cli/_timing.py)
def test_speedup_over_an_empty_greedy_window_is_nan_not_a_crash():
    """Before: ZeroDivisionError ('float division by zero') when the greedy run emitted nothing after
    its prefill (every budget 1: 1 token per request, all of it the prefill's), so ``demo
    --max-new-tokens 1`` died in its table.  Now the ratio is NaN, as an empty window's rate is."""
    from refspec.cli import _timing

    assert math.isnan(_timing.speedup(_timing.Timed(3, 1.0), _timing.Timed(0, 1.0)))
    assert math.isnan(_timing.speedup(_timing.Timed(3, 1.0), _timing.Timed(0, 0.0)))
    assert _timing.speedup(_timing.Timed(30, 2.0), _timing.Timed(10, 1.0)) == pytest.approx(1.5)  # the valid case


def test_demo_rows_print_a_dash_for_values_a_one_token_run_does_not_have():
    """``python -m refspec demo --max-new-tokens 1`` (every token is the prefill's): before, the
    table died with ZeroDivisionError (the ratio above), then with TypeError ('unsupported format
    string passed to NoneType.__format__': no verify round, so no accept length).  Now such cells
    print "-"; a normal row prints its numbers (positive control)."""
    from refspec.cli._demo_gpu import GpuRow
    from refspec.cli.demo import Row

    empty = Row("spec", 4, 1, "v2", None, 0, 0.0, spec_eq_greedy=True, x_graph=float("nan"))
    assert empty.cells()[4:7] == ["-", "-", "-"]
    assert Row("spec", 4, 1, "v2", 2.5, 30, 2.0, x_graph=1.5).cells()[4:7] == ["2.50", "15.0", "1.50"]
    assert GpuRow("spec", 4, 1, "v2", None, 0, 0.0, x_graph=float("nan")).cells()[4:7] == ["-", "-", "-"]
    assert GpuRow("spec", 4, 1, "v2", 2.5, 30, 2.0, x_graph=1.5).cells()[4:7] == ["2.50", "15.0", "1.50"]
