"""Draft models: what runs the draft forwards (EAGLE head, early-exit self-draft, small LM).

Every draft has one interface, used identically by the oracle loop and the production loop::

    logits [T, V], hidden_out [T, E] | None = draft.forward(input_ids [T], hidden [T, E] | None, fb, backend)

with its own KV pool of ``draft.num_layers`` layers (``num_kv_heads``, ``head_dim``).  The
EAGLE position rule (SD-007, :mod:`refspec.speculative.engine`) applies to all of them: draft KV index
p consumes token t_(p+1) (and, for EAGLE, the target hidden h_p).

* :class:`EagleDraft`: one Llama decoder layer over ``fc([embed(token); hidden])``, sharing the
  target's embedding and LM head: EAGLE-1-*shaped*, not SGLang's ``LlamaForCausalLMEagle``
  (https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/llama_eagle.py).
  Upstream deletes layer 0's ``input_layernorm``, gives ``fc`` a bias and has no final norm (the
  layer's output goes straight to the LM head, its own when the embeddings are not tied); here
  layer 0 keeps its ``input_layernorm``, ``fc`` has no bias and a final ``norm`` precedes the
  target's head.  The model stays as it is (the trained head refspec ships has these weights), so
  an upstream EAGLE checkpoint does not load into it as is.  In draft extend ``hidden`` is the target's
  hidden at the same row; in draft decode step s it is the draft's own ``hidden_out`` of the
  previous step (or of the kept draft-extend row for step 0).
* :class:`EarlyExitDraft`: the first k target layers + the target's final norm and head
  (LayerSkip-style self-speculation); ignores ``hidden``.  Its KV pool has k layers.
* :class:`LMDraft`: any :class:`~refspec.model.llama.LlamaModel` with the target's vocabulary.
* ``"mtp"``: DeepSeek's multi-token-prediction layer for a DeepSeek (MLA) target
  (:class:`~refspec.model.deepseek_nextn.MTPDraft`; its pool is MLA too: ``mla_dims``).
"""

from __future__ import annotations

import torch
from torch import nn

from refspec.model.deepseek import DeepseekModel
from refspec.model.deepseek_nextn import MTPDraft
from refspec.model.llama import LlamaConfig, LlamaDecoderLayer, LlamaModel, RMSNorm, init_random_


class EagleDraft(nn.Module):
    """EAGLE-1-shaped draft head (random init unless trained weights are loaded; module doc: how it
    differs from SGLang's ``LlamaForCausalLMEagle``).

    Shapes: ``input_ids [T]`` int64, ``hidden [T, E]`` (E = target hidden size) ->
    ``logits [T, V]``, ``hidden_out [T, E]`` (pre-norm output of its decoder layer).
    """

    uses_hidden = True

    def __init__(self, target: LlamaModel, seed: int = 1):
        super().__init__()
        cfg: LlamaConfig = target.config
        self._target = [target]  # shared embedding / head, not a submodule (no duplicate params)
        E = cfg.hidden_size
        self.fc = nn.Linear(2 * E, E, bias=False)
        self.layer = LlamaDecoderLayer(cfg, layer_id=0)
        self.norm = RMSNorm(E, cfg.rms_norm_eps)
        init_random_(self, seed=seed)
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        self.num_layers, self.num_kv_heads, self.head_dim = 1, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size = E

    def forward(self, input_ids, hidden, fb, backend):
        t = self._target[0]
        x = self.fc(torch.cat([t.model.embed_tokens(input_ids), hidden], dim=-1))
        h = t.run_layers(x, fb, backend, [self.layer])
        return nn.functional.linear(self.norm(h), t.lm_head_weight), h


class EarlyExitDraft:
    """The first ``k`` layers of the target, then its final norm and head (ignores ``hidden``)."""

    uses_hidden = False

    def __init__(self, target: LlamaModel, k: int = 1):
        cfg = target.config
        if not 1 <= k <= cfg.num_hidden_layers:
            raise ValueError(f"early exit k={k} outside 1..{cfg.num_hidden_layers}")
        self.target, self.k = target, k
        self.num_layers, self.num_kv_heads, self.head_dim = k, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size = cfg.hidden_size

    def forward(self, input_ids, hidden, fb, backend):
        return self.target.forward(input_ids, fb, backend, num_layers=self.k)


class LMDraft:
    """A separate small language model as the draft (same vocabulary; ignores ``hidden``)."""

    uses_hidden = False

    def __init__(self, lm: LlamaModel):
        cfg = lm.config
        self.lm = lm
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size = cfg.hidden_size

    def forward(self, input_ids, hidden, fb, backend):
        return self.lm.forward(input_ids, fb, backend)


def make_draft(spec, target: LlamaModel, seed: int = 1):
    """A draft from a spec: ``"eagle"``, ``"early-exit"`` / ``"early-exit:k"`` (default k = 1),
    ``"mtp"`` (DeepSeek's MTP layer, for a :class:`~refspec.model.deepseek.DeepseekModel` target:
    :class:`~refspec.model.deepseek_nextn.MTPDraft`), a :class:`LlamaModel` (small-LM draft), or an
    object that already has the draft interface.  Raises ValueError naming the spec otherwise (a
    named draft that does not fit the target's architecture too)."""
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        if name == "mtp" or isinstance(target, DeepseekModel):
            if name != "mtp" or arg:
                raise ValueError(f"draft {spec!r}: a DeepSeek (MLA) target takes draft 'mtp' (its MTP layer), and "
                                 "'mtp' takes no argument")
            return MTPDraft(target, seed=seed)
        if name == "eagle":
            return EagleDraft(target, seed=seed)
        if name == "early-exit":
            if not (arg == "" or (arg.isascii() and arg.isdigit())):
                raise ValueError(f"draft {spec!r}: early-exit:k needs an int k (layers of the target)")
            return EarlyExitDraft(target, int(arg or 1))
        raise ValueError(f"unknown draft {spec!r} (eagle, early-exit[:k], mtp, or a model)")
    if isinstance(spec, LlamaModel):
        if spec.config.vocab_size != target.config.vocab_size:
            raise ValueError("a small-LM draft must share the target's vocabulary")
        return LMDraft(spec)
    if not (callable(getattr(spec, "forward", None)) and all(hasattr(spec, a) for a in
                                                             ("num_layers", "num_kv_heads", "head_dim"))):
        raise ValueError(f"draft must be 'eagle', 'early-exit[:k]', a LlamaModel or a draft object (forward, "
                         f"num_layers, num_kv_heads, head_dim), got {type(spec).__name__} {spec!r}")
    return spec
