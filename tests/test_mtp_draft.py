"""DeepSeek's MTP (NextN) layer as the draft kind ``"mtp"`` (refspec.model.deepseek_nextn): SGLang's
names and checkpoint mapping, its input (``cat[enorm(embed), hnorm(hidden)]``, in that order), the
shared embedding and head, its MLA pool, and a negative control: the two halves swapped change the
drafts and the acceptance, never the output (SD-002)."""

from __future__ import annotations

import pytest
import torch

from mla_kit import BUDGETS, PROMPTS, accepting_mtp, baseline, reference, target
from refspec.core.batch import extend_batch
from refspec.core.kv_cache import KVPool, MLAKVPool
from refspec.model.deepseek_nextn import MTPDraft, nextn_param_name
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative import generate
from refspec.speculative.engine import Engine

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

DECODER = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
           "self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
           "mlp.down_proj", "input_layernorm", "post_attention_layernorm")

#: DeepSeek-V3's MTP layer in its checkpoint (``model.layers.61.*``, the dense-MLP names; MoE
#: experts aside), as its ``model.safetensors.index.json`` lists them
HF_LAYER_61 = ["model.layers.61.embed_tokens.weight", "model.layers.61.enorm.weight", "model.layers.61.hnorm.weight",
               "model.layers.61.eh_proj.weight", "model.layers.61.shared_head.norm.weight",
               "model.layers.61.shared_head.head.weight"] + [f"model.layers.61.{n}.weight" for n in DECODER]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_names_are_sglangs_and_the_checkpoint_maps_onto_them():
    """The draft's parameters are SGLang's ``DeepseekV3ForCausalLMNextN`` module names; the checkpoint's
    ``model.layers.61.*`` maps onto exactly them (the NextN-only weights to ``model.``, the decoder
    layer's to ``model.decoder.``), the shared embedding and head to nothing."""
    d = MTPDraft(target())
    names = set(d.state_dict())
    assert names == {"model.enorm.weight", "model.hnorm.weight", "model.eh_proj.weight",
                     "model.shared_head.norm.weight"} | {f"model.decoder.{n}.weight" for n in DECODER}
    mapped = {nextn_param_name(n, 61) for n in HF_LAYER_61}
    assert mapped - {None} == names and None in mapped
    assert nextn_param_name("model.layers.61.shared_head.head.weight", 61) is None
    assert nextn_param_name("model.layers.61.embed_tokens.weight", 61) is None
    assert nextn_param_name("model.layers.60.self_attn.kv_b_proj.weight", 61) is None  # a target layer
    assert nextn_param_name("model.layers.61.self_attn.kv_a_layernorm.weight", 61) == \
        "model.decoder.self_attn.kv_a_layernorm.weight"
    E = target().config.hidden_size
    assert d.state_dict()["model.eh_proj.weight"].shape == (E, 2 * E)
    assert (d.num_layers, d.mla_dims, d.uses_hidden) == (1, target().config.mla_dims, True)


def test_the_input_is_enorm_embedding_then_hnorm_hidden():
    """``eh_proj``'s input is ``cat[enorm(embed(t)), hnorm(h)]``, the embedding half first, as
    ``DeepseekModelNextN.forward`` concatenates them; distinct norm weights tell the halves apart."""
    m = target()
    d = MTPDraft(m)
    with torch.no_grad():
        d.model.enorm.weight.fill_(2.0)
        d.model.hnorm.weight.fill_(3.0)
    ids = torch.tensor([5, 17, 99])
    h = torch.randn(3, m.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 7
    eps = m.config.rms_norm_eps
    want = torch.cat([2.0 * _rms(m.model.embed_tokens.weight[ids], eps), 3.0 * _rms(h, eps)], dim=-1)
    with torch.no_grad():
        got = d.eh_input(ids, h)
    assert torch.allclose(got, want, atol=1e-6)
    swapped = torch.cat([3.0 * _rms(h, eps), 2.0 * _rms(m.model.embed_tokens.weight[ids], eps)], dim=-1)
    assert not torch.allclose(got, swapped, atol=1e-2)


def test_the_embedding_and_head_are_the_targets_and_the_draft_pool_is_mla():
    """No parameter of its own for the embedding or the head (SGLang hands the draft the target's);
    the engine gives the draft a one-layer MLA pool of the target's row, and the target its own."""
    m = init_random_(type(target())(target().config), seed=4).eval()
    d = MTPDraft(m)
    ids, h = torch.tensor([1, 2]), torch.randn(2, m.config.hidden_size)
    assert not any("embed" in n or "head.weight" in n for n in d.state_dict())
    eng = Engine(m, d, num_steps=2, page_size=4, max_context=32, max_batch=1, provider="emulator")
    assert isinstance(eng.draft_pool, MLAKVPool) and isinstance(eng.target_pool, MLAKVPool)
    assert (len(eng.draft_pool.kv_buffer), len(eng.target_pool.kv_buffer)) == (1, 2)
    assert eng.draft_pool.kv_cache_dim == m.config.kv_lora_rank + m.config.qk_rope_head_dim == 272
    row = eng.kv.alloc_req()
    eng.kv.alloc_extend([row], [0], [2])
    fb = extend_batch(eng.kv, [row], [0], [2])

    def logits():
        eng.runners.draft_be.init_forward_metadata(fb)
        with torch.no_grad():
            return d.forward(ids, h, fb, eng.runners.draft_be)[0]
    before = logits()
    with torch.no_grad():
        m.lm_head.weight.mul_(-1)
    assert torch.allclose(logits(), -before, atol=1e-5), "the draft does not read the target's head"
    with torch.no_grad():
        m.model.embed_tokens.weight[1].zero_()
    assert not torch.allclose(logits()[0], -before[0], atol=1e-3), "the draft does not read the target's embedding"


def test_a_llama_target_keeps_its_mha_pools():
    m = init_random_(LlamaModel(tiny_config()), seed=0)
    eng = Engine(m, make_draft("eagle", m), num_steps=2, page_size=4, max_context=32, max_batch=1, provider="emulator")
    assert type(eng.target_pool) is KVPool and type(eng.draft_pool) is KVPool


def test_draft_kinds_fit_the_target():
    llama = init_random_(LlamaModel(tiny_config()), seed=0)
    with pytest.raises(ValueError, match="needs a DeepseekModel target"):
        make_draft("mtp", llama)
    with pytest.raises(ValueError, match="a DeepSeek \\(MLA\\) target takes draft 'mtp'"):
        make_draft("eagle", target())
    with pytest.raises(ValueError, match="'mtp' takes no argument"):
        make_draft("mtp:2", target())
    assert isinstance(make_draft("mtp", target()), MTPDraft)


class SwappedMTP(MTPDraft):
    """The negative control: ``cat[hnorm(hidden), enorm(embed)]``, the halves in the wrong order."""

    def eh_input(self, input_ids, hidden):
        m = self.model
        return torch.cat([m.hnorm(hidden), m.enorm(self._target[0].model.embed_tokens(input_ids))], dim=-1)


@pytest.mark.spec("SD-002")
def test_swapping_the_halves_changes_the_drafts_and_the_acceptance_not_the_output():
    """The same weights read with the halves swapped: other drafts, fewer than half as many drafts
    accepted (8 against 3 at these seeds), the same greedy output (the drafts never change it)."""
    m = target()
    kw = dict(backend="fa3", version="v1", page_size=4, max_new_tokens=BUDGETS, reference=reference())
    right = generate(m, PROMPTS, draft=accepting_mtp(m), **kw)
    wrong = generate(m, PROMPTS, draft=accepting_mtp(m, cls=SwappedMTP), **kw)
    assert right.tokens == wrong.tokens == baseline(5)
    assert right.drafts != wrong.drafts
    accepted = [sum(a - 1 for req in r.accepts for a in req) for r in (right, wrong)]  # draft tokens kept
    assert accepted[0] > 2 * accepted[1], f"accepted drafts: upstream order {accepted[0]}, swapped {accepted[1]}"
