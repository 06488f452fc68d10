"""DeepSeek's multi-token-prediction (MTP / NextN) layer as a draft: the draft kind ``"mtp"``.

DeepSeek-V3 ships one extra decoder layer (``model.layers.61`` in its checkpoint,
``num_nextn_predict_layers = 1``) trained to predict the token after next; SGLang runs it as the
EAGLE draft of a DeepSeek target (``DeepseekV3ForCausalLMNextN``).  For a token t at KV index p
with the target's hidden state h (the EAGLE shift of SD-007: draft KV index p consumes t_(p+1)
and h_p)::

    x = eh_proj( cat[ enorm(embed(t)), hnorm(h) ] )        the embedding first, then the hidden
    y = decoder(x)                                          ONE MLA decoder layer (its own MLA pool)
    hidden_out = shared_head.norm(y);  logits = lm_head(hidden_out)

``embed_tokens`` and ``lm_head`` are the target's, shared (SGLang's EAGLE worker hands the draft
the target's embedding and head, ``set_embed_and_head``; the checkpoint's own
``shared_head.head`` / ``embed_tokens`` copies are skipped at load).  ``h`` is the target's
hidden after its final norm (what SGLang's logits processor stores); in draft decode step s it is
the draft's own ``hidden_out`` of the previous step.  The decoder layer is
:class:`~refspec.model.deepseek.DeepseekDecoderLayer` with layer id 0 of the draft's pool, an MLA
layer like the target's (so the draft's KV is MLA too: one latent row per slot, an
:class:`~refspec.core.kv_cache.MLAKVPool` of one layer), with the target's RoPE and scale; its MLP is
dense (DeepSeek-V3's MTP layer is MoE; no MoE here, :mod:`refspec.model.deepseek`).

Parameter names are SGLang's module names (``model.enorm``, ``model.hnorm``, ``model.eh_proj``,
``model.decoder.*``, ``model.shared_head.norm``); :func:`nextn_param_name` maps a checkpoint name
(``model.layers.{N}.*``) onto them as SGLang's loader does.

Upstream: `deepseek_nextn.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_nextn.py#L163>`_
(``DeepseekModelNextN.forward``: ``torch.cat((self.enorm(hidden_states), self.hnorm(previous_hidden_states)))``),
`deepseek_weight_loader.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_common/deepseek_weight_loader.py#L319>`_
(the name mapping), `eagle_worker.py@v0.5.12.post1 <https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/speculative/eagle_worker.py#L203>`_
(the shared embedding and head).
"""

from __future__ import annotations

import torch
from torch import nn

from refspec.model.deepseek import DeepseekConfig, DeepseekDecoderLayer, DeepseekModel
from refspec.model.llama import RMSNorm, init_random_

#: the NextN-only weights: ``model.layers.{N}.<these>`` load as ``model.<these>``; every other
#: weight of the layer belongs to its decoder layer (``model.decoder.*``)
NEXTN_WEIGHTS = ("shared_head.norm", "eh_proj", "enorm", "hnorm")


def nextn_param_name(hf_name: str, num_hidden_layers: int) -> str | None:
    """A checkpoint name of the MTP layer -> this module's parameter name, or None for a weight the
    draft shares with the target (``embed_tokens``, ``shared_head.head``) or that is not the MTP
    layer's.  The MTP layer is ``model.layers.{num_hidden_layers}`` (61 for DeepSeek-V3).  SGLang's
    rule: ``model.layers.61.eh_proj.weight`` -> ``model.eh_proj.weight``,
    ``model.layers.61.self_attn.kv_b_proj.weight`` -> ``model.decoder.self_attn.kv_b_proj.weight``."""
    prefix = f"model.layers.{num_hidden_layers}."
    if not hf_name.startswith(prefix) or "shared_head.head" in hf_name or "embed_tokens" in hf_name:
        return None
    rest = hf_name[len(prefix):]
    return ("model." if any(w in rest for w in NEXTN_WEIGHTS) else "model.decoder.") + rest


class _NextNBody(nn.Module):
    """SGLang ``DeepseekModelNextN`` less the shared embedding: ``enorm``, ``hnorm``, ``eh_proj``,
    ``decoder``, ``shared_head.norm``."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        E = cfg.hidden_size
        self.enorm = RMSNorm(E, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(E, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * E, E, bias=False)
        self.decoder = DeepseekDecoderLayer(cfg, layer_id=0)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(E, cfg.rms_norm_eps)


class MTPDraft(nn.Module):
    """The MTP draft of a :class:`~refspec.model.deepseek.DeepseekModel` (module doc); random init.

    The draft interface of :mod:`refspec.model.drafts`: ``forward(input_ids [T], hidden [T, E], fb,
    backend) -> (logits [T, V], hidden_out [T, E])``, ``uses_hidden`` True, ``num_layers`` 1.  Its
    KV: ``mla_dims`` (the paged pool's latent row, ML-001), and for the dense oracle's naive form
    ``num_kv_heads`` H, ``head_dim`` Dn + Dr, ``v_head_dim`` Dv (per-head K / V).

    Args:
        target: the DeepSeek target (its embedding, head, RoPE and MLA dims are shared).
        seed: of the random init.
    Raises: ValueError if ``target`` is not a DeepSeek (MLA) model.
    """

    uses_hidden = True

    def __init__(self, target: DeepseekModel, seed: int = 1):
        if not isinstance(target, DeepseekModel):
            raise ValueError(f"draft 'mtp' is DeepSeek's MTP layer: it needs a DeepseekModel target (an MLA model), "
                             f"got {type(target).__name__}")
        super().__init__()
        cfg = target.config
        self._target = [target]  # shared embedding / head / RoPE, not a submodule (no duplicate params)
        self.model = _NextNBody(cfg)
        init_random_(self, seed=seed)
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        d = cfg.mla_dims
        self.num_layers, self.mla_dims, self.hidden_size = 1, d, cfg.hidden_size
        self.num_kv_heads, self.head_dim, self.v_head_dim = cfg.num_attention_heads, d.qk_head_dim, d.v_head_dim

    def eh_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``cat[enorm(embed(t)), hnorm(h)]`` ``[T, 2E]``: the embedding half first (upstream order)."""
        m = self.model
        return torch.cat([m.enorm(self._target[0].model.embed_tokens(input_ids)), m.hnorm(hidden)], dim=-1)

    def forward(self, input_ids, hidden, fb, backend):
        t, m = self._target[0], self.model
        x = m.eh_proj(self.eh_input(input_ids, hidden))
        cos, sin = t.rope(fb.positions)
        h = m.shared_head.norm(m.decoder(x, cos, sin, fb, backend))
        return nn.functional.linear(h, t.lm_head_weight), h
