"""The GPU-speed pieces, checked on CPU against the readable references.

* :class:`refspec.model.fused.FusedLlama` (fused q/k/v and gate/up projections, compiled
  non-attention regions on CUDA) against the readable :class:`~refspec.model.llama.LlamaModel`
  it is built from: same logits to fp32 rounding, same greedy tokens, through the dense
  backend and through the paged FA3 wing;
* :func:`refspec.speculative.greedy.production_greedy` (paged KV, FA3 DECODE under graphs)
  against the oracle's plain greedy (dense KV): the same tokens, bitwise in fp32, every page
  freed (SD-002's baseline, KV-006).
"""

from __future__ import annotations

import pytest
import torch

from refspec.model.fused import FusedLlama
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV
from refspec.oracle.loop import greedy
from refspec.speculative.api import generate
from refspec.speculative.greedy import production_greedy


def _model(seed=0, **kw):
    return init_random_(LlamaModel(tiny_config(**kw)), seed=seed).eval()


PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38], [27, 18]]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_matches_readable_logits(tied):
    m = _model(tie_word_embeddings=tied)
    f = FusedLlama(m)
    assert not f.compiled  # CPU: eager fused math
    c = m.config
    ids = torch.tensor(PROMPTS[1])
    out = []
    for model in (m, f):
        kv = DenseKV(c.num_hidden_layers, len(ids), c.num_key_value_heads, c.head_dim)
        out.append(model(ids, DenseBatch.span(0, len(ids)), DenseBackend(kv)))
    (l0, h0), (l1, h1) = out
    assert torch.allclose(h0, h1, atol=1e-5, rtol=1e-5), (h0 - h1).abs().max()
    assert torch.allclose(l0, l1, atol=1e-4, rtol=1e-5), (l0 - l1).abs().max()
    assert torch.equal(l0.argmax(-1), l1.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_table_is_the_readable_one_bitwise(dtype):
    """The precomputed inverse frequencies + the table region (eager on CPU) give the readable
    ``rope_cos_sin``'s cos / sin bit for bit, for contiguous and strided (draft-step) positions."""
    m = _model()
    f = FusedLlama(m)
    for pos in (torch.tensor([0, 3, 17, 100, 4095]), torch.arange(40).view(8, 5)[:, 2]):
        for a, b in zip(m.rope(pos, dtype), f.rope(pos, dtype)):
            assert a.dtype == b.dtype == dtype and torch.equal(a, b)


def test_fused_shares_the_reference_weights():
    m = _model()
    f = FusedLlama(m)
    assert f.reference[0] is m and f.model is m.model
    q = m.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(f.wqkv[0][: q.shape[0]], q)


@pytest.mark.spec("SD-002")
@pytest.mark.parametrize("P", [1, 4, 16])
def test_fused_production_spec_loop_is_greedy(P):
    """The production loop on the fused model (early-exit draft, graphs) == plain greedy of the readable model."""
    m = _model()
    f = FusedLlama(m)
    ref = [greedy(m, p, 12).tokens for p in PROMPTS]
    res = generate(f, PROMPTS, backend="fa3", version="v2", page_size=P, graphs=True, draft="early-exit:1",
                   max_new_tokens=12)
    assert res.tokens == ref


@pytest.mark.spec("SD-002", "KV-006")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("P", [1, 4, 16])
def test_production_greedy_equals_oracle_greedy(P, graphs):
    m = _model()
    budgets = [10, 4, 7]
    ref = [greedy(m, p, n).tokens for p, n in zip(PROMPTS, budgets)]
    run = production_greedy(m, PROMPTS, budgets, page_size=P, graphs=graphs, capture_bs=(1, 2, 4))
    assert run.tokens == ref
    assert run.free_pages[0] == run.free_pages[1]
    assert run.syncs == run.steps + 1  # one read per step, plus the prefill token
    if graphs:
        assert run.graph_steps == run.steps and run.eager_steps == 0


def test_production_greedy_stops_at_eos():
    m = _model()
    full = greedy(m, PROMPTS[0], 10).tokens
    eos = full[3]
    run = production_greedy(m, [PROMPTS[0]], [10], eos=eos, page_size=4)
    assert run.tokens[0] == full[: full.index(eos) + 1]


@pytest.mark.spec("SD-002", "KV-006")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_production_greedy_eos_in_a_batch_drops_the_late_step(graphs):
    """Overlap: request 0 emits EOS mid-run while the others go on.  Its EOS is read after the
    next step was launched, so that step's token for it is dropped; the others' tokens equal the
    oracle's, and every page comes back (the dropped step's slot included)."""
    m = _model()
    budgets = [10, 10, 6]
    ref = [greedy(m, p, n).tokens for p, n in zip(PROMPTS, budgets)]
    eos = ref[0][3]
    want = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    assert len(want[0]) == 4 and len(want[1]) > 4  # the case is what it says: one early stop
    run = production_greedy(m, PROMPTS, budgets, eos=eos, page_size=4, graphs=graphs, capture_bs=(1, 2, 4))
    assert run.tokens == want
    assert run.free_pages[0] == run.free_pages[1]
    # a request stopped by EOS before its budget ran one decode step past it (launched before
    # the read); one stopped by its budget ran exactly len - 1 decode steps
    late = [len(w) - 1 + (len(w) < n) for w, n in zip(want, budgets)]
    assert run.steps == max(late)


def test_production_greedy_launches_the_next_step_before_reading_tokens(monkeypatch):
    """The k-th token read (k >= 1) happens after decode step k was launched: the host never
    waits for a step's tokens before the next step is queued (module doc, overlap)."""
    import refspec.speculative.greedy as g

    seen = []
    runs = {"steps": 0}
    orig_wait, orig_step = g.ResultCopy.wait, g.decode_batch

    def wait(self):
        seen.append(runs["steps"])
        return orig_wait(self)

    def counted(*a, **k):
        runs["steps"] += 1
        return orig_step(*a, **k)

    monkeypatch.setattr(g.ResultCopy, "wait", wait)
    monkeypatch.setattr(g, "decode_batch", counted)
    run = production_greedy(_model(), [PROMPTS[0]], [6], page_size=1, graphs=False)
    assert len(run.tokens[0]) == 6 and run.steps == 5
    # read 0 (the prefill token) after step 1 was built, ..., read 4 after step 5; the last read
    # (step 5's token) has no step after it
    assert seen == [1, 2, 3, 4, 5, 5]


def test_production_greedy_rejects_bad_input():
    m = _model()
    with pytest.raises(ValueError, match="budget"):
        production_greedy(m, [[1, 2]], [0])
    with pytest.raises(ValueError):
        production_greedy(m, [[]], [3])
