"""Draft models: what runs the draft forwards (EAGLE head, EAGLE-3 head, early-exit self-draft, small LM).

Every draft has one interface, used identically by the oracle loop and the production loop::

    logits [T, V], hidden_out [T, E] | None = draft.forward(input_ids [T], hidden [T, W] | None, fb, backend)

(W = E, or for EAGLE-3's draft prefill / extend the width of the target's aux states, below)

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
* :class:`Eagle3Draft`: EAGLE-3's head (SGLang's ``LlamaForCausalLMEagle3``): it reads the
  target's hidden states at several depths (``aux_layers``, low / middle / high), concatenated
  and projected by ``fc``, and its own hidden when drafting.
* :class:`EarlyExitDraft`: the first k target layers + the target's final norm and head
  (LayerSkip-style self-speculation); ignores ``hidden``.  Its KV pool has k layers.
* :class:`LMDraft`: any :class:`~refspec.model.llama.LlamaModel` with the target's vocabulary.
* ``"mtp"``: DeepSeek's multi-token-prediction layer for a DeepSeek (MLA) target
  (:class:`~refspec.model.deepseek_nextn.MTPDraft`; its pool is MLA too: ``mla_dims``).

**What the target hands a draft.**  ``uses_hidden`` says whether a draft reads a hidden state at
all; ``aux_layers`` (:func:`aux_layers`) which one: None = the target's last hidden ``[T, E]``
(EAGLE), a tuple = those hidden states concatenated ``[T, len * E]`` (EAGLE-3; the loops pass it
to the target's forward as ``aux``).  A draft's own ``hidden_out`` is always ``[T, E]``.

:func:`make_draft` builds a draft from a name through :data:`DRAFT_KINDS` (name -> builder), so
a new kind is one entry there.
"""

from __future__ import annotations

import torch
from torch import nn

from collections.abc import Callable

from refspec.model.deepseek import DeepseekModel
from refspec.model.deepseek_nextn import MTPDraft
from refspec.model.llama import LlamaConfig, LlamaDecoderLayer, LlamaModel, RMSNorm, check_aux, init_random_


class EagleDraft(nn.Module):
    """EAGLE-1-shaped draft head (random init unless trained weights are loaded; module doc: how it
    differs from SGLang's ``LlamaForCausalLMEagle``).

    Shapes: ``input_ids [T]`` int64, ``hidden [T, E]`` (E = target hidden size) ->
    ``logits [T, V]``, ``hidden_out [T, E]`` (pre-norm output of its decoder layer).
    """

    uses_hidden = True
    aux_layers = None  #: reads the target's last hidden

    def __init__(self, target: LlamaModel, seed: int = 1):
        super().__init__()
        cfg: LlamaConfig = llama_target(target, "EagleDraft")
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


def llama_target(target, draft: str) -> LlamaConfig:
    """The config of ``target`` if it is a :class:`~refspec.model.llama.LlamaModel` (the EAGLE heads
    are Llama decoder layers over its embedding and head); ValueError naming ``draft`` otherwise."""
    if not isinstance(target, LlamaModel):
        hint = " (a DeepSeek target's draft is 'mtp', its MTP layer)" if isinstance(target, DeepseekModel) else ""
        raise ValueError(f"{draft} drafts for a LlamaModel target, got {type(target).__name__}{hint}")
    return target.config


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high hidden states for a target of ``num_layers`` L layers:
    upstream's ``[2, L // 2, L - 3]`` (``set_eagle3_layers_to_capture``,
    `models/llama.py@v0.5.12.post1 L805 <https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/models/llama.py#L805>`_;
    (2, 15, 27) for SmolLM2-135M's 30) when those are three distinct indices (L >= 7); for a
    shallower target (the 2-layer test model) the embeddings, the middle and the last output,
    ``(0, L // 2, L)`` without repeats, so there are always at least two."""
    L = num_layers
    if 2 < L // 2 < L - 3:
        return (2, L // 2, L - 3)
    return tuple(sorted({0, L // 2, L}))


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """EAGLE-3's one decoder layer: attention over ``[input_layernorm(embed); hidden_norm(h)]``
    (q / k / v projections from 2E), the residual stream ``h``, then the Llama MLP.

    Shapes: ``embeds, h [T, E]`` -> ``[T, E]`` (pre-norm).  Upstream: the input layer of
    ``llama_eagle3.LlamaDecoderLayer``
    (`models/llama_eagle3.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/llama_eagle3.py#L46>`_).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, layer_id=0)
        E, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = self.self_attn
        a.q_proj = nn.Linear(2 * E, H * D, bias=False)
        a.k_proj = nn.Linear(2 * E, Hkv * D, bias=False)
        a.v_proj = nn.Linear(2 * E, Hkv * D, bias=False)
        self.hidden_norm = RMSNorm(E, cfg.rms_norm_eps)

    def forward(self, embeds, h, cos, sin, fb, backend):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        h = h + self.self_attn(x, cos, sin, fb, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft head over ``aux_layers`` of the target (random init unless trained weights are loaded).

    ``forward(input_ids, hidden, fb, backend)``: ``hidden`` is either the target's aux hidden
    states ``[T, len(aux_layers) * E]`` (draft prefill and draft extend; projected to E by ``fc``)
    or the draft's own ``hidden_out`` ``[T, E]`` (draft decode), told apart by width as upstream
    does (``hidden_states.shape[-1] != embeds.shape[-1]``, ``llama_eagle3.LlamaModel.forward``,
    `L237 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/llama_eagle3.py#L237>`_).
    Then :class:`Eagle3DecoderLayer`, RMSNorm and the LM head.  Returns ``logits [T, V]`` and
    ``hidden_out [T, E]`` (the layer's pre-norm output, upstream's ``hidden_states_to_aux``).

    Differences from upstream, as for :class:`EagleDraft`: the LM head is the target's (tied,
    shared), where EAGLE-3 trains its own over a reduced draft vocabulary (``d2t``); ``fc`` has
    no bias (upstream's default); no ``fc_norm`` / ``norm_before_fc`` options.

    Args: ``aux_layers``: strictly increasing hidden-state indices of the target, at least two
    (i = the input of decoder layer i; default :func:`default_aux_layers`).
    Raises ValueError for fewer than two or a bad index, or a target that is not a
    :class:`~refspec.model.llama.LlamaModel` (a DeepSeek target's draft is ``"mtp"``).
    """

    uses_hidden = True

    def __init__(self, target: LlamaModel, aux_layers: tuple[int, ...] | None = None, seed: int = 1):
        super().__init__()
        cfg: LlamaConfig = llama_target(target, "Eagle3Draft")
        layers = default_aux_layers(cfg.num_hidden_layers) if aux_layers is None else aux_layers
        self.aux_layers = check_aux(layers, cfg.num_hidden_layers)
        if len(self.aux_layers) < 2:  # one state of width E could not be told from the draft's own
            raise ValueError(f"EAGLE-3 reads at least two target hidden states, got aux_layers={self.aux_layers}")
        self._target = [target]
        E = cfg.hidden_size
        self.fc = nn.Linear(len(self.aux_layers) * E, E, bias=False)
        self.layer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(E, cfg.rms_norm_eps)
        init_random_(self, seed=seed)
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        self.num_layers, self.num_kv_heads, self.head_dim = 1, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size = E

    def forward(self, input_ids, hidden, fb, backend):
        t = self._target[0]
        embeds = t.model.embed_tokens(input_ids)
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's aux states (extend), not the draft's own (decode)
            hidden = self.fc(hidden)
        cos, sin = t.rope(fb.positions, hidden.dtype)
        h = self.layer(embeds, hidden, cos, sin, fb, backend)
        return nn.functional.linear(self.norm(h), t.lm_head_weight), h


class EarlyExitDraft:
    """The first ``k`` layers of the target, then its final norm and head (ignores ``hidden``)."""

    uses_hidden = False
    aux_layers = None

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
    aux_layers = None

    def __init__(self, lm: LlamaModel):
        cfg = lm.config
        self.lm = lm
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size = cfg.hidden_size

    def forward(self, input_ids, hidden, fb, backend):
        return self.lm.forward(input_ids, fb, backend)


def aux_layers(draft) -> tuple[int, ...] | None:
    """The target hidden states ``draft`` reads (module doc): its ``aux_layers`` (EAGLE-3), or None
    for the target's last hidden (EAGLE; also a draft object without the attribute)."""
    return getattr(draft, "aux_layers", None) if draft.uses_hidden else None


def target_hidden_size(draft, target: LlamaModel) -> int:
    """Width of the target hidden a draft's extend reads: ``len(aux_layers) * E``, else E."""
    aux = aux_layers(draft)
    return target.config.hidden_size * (len(aux) if aux else 1)


def _eagle(target, arg: str, seed: int):
    if arg:
        raise ValueError(f"draft 'eagle:{arg}': eagle takes no argument (a trained head: refspec.real.eagle_head)")
    return EagleDraft(target, seed=seed)


def _eagle3(target, arg: str, seed: int):
    if arg:
        raise ValueError(f"draft 'eagle3:{arg}': a random-init eagle3 takes no argument; a trained head file "
                         f"(eagle3:PATH) is loaded by refspec.real.eagle_head.real_draft")
    return Eagle3Draft(target, seed=seed)


def _early_exit(target, arg: str, seed: int):
    if not (arg == "" or (arg.isascii() and arg.isdigit())):
        raise ValueError(f"draft 'early-exit:{arg}': early-exit:k needs an int k (layers of the target)")
    return EarlyExitDraft(target, int(arg or 1))


def _mtp(target, arg: str, seed: int):
    if arg:
        raise ValueError(f"draft 'mtp:{arg}': 'mtp' takes no argument")
    return MTPDraft(target, seed=seed)


#: draft kinds by name: ``name -> builder(target, arg, seed)`` for the spec ``"name"`` / ``"name:arg"``
DRAFT_KINDS: dict[str, Callable[[LlamaModel, str, int], object]] = {
    "eagle": _eagle,
    "eagle3": _eagle3,
    "early-exit": _early_exit,
    "mtp": _mtp,
}


def make_draft(spec, target: LlamaModel, seed: int = 1):
    """A draft from a spec: a name of :data:`DRAFT_KINDS` (``"eagle"``, ``"eagle3"``,
    ``"early-exit"`` / ``"early-exit:k"``, default k = 1; ``"mtp"``, DeepSeek's MTP layer, for a
    :class:`~refspec.model.deepseek.DeepseekModel` target: :class:`~refspec.model.deepseek_nextn.MTPDraft`),
    a :class:`LlamaModel` (small-LM draft), or an object that already has the draft interface.
    Raises ValueError naming the spec otherwise (a named draft that does not fit the target's
    architecture too, or a draft object reading hidden states of another width than the target's)."""
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        if name not in DRAFT_KINDS:
            raise ValueError(f"unknown draft {spec!r} ({', '.join(DRAFT_KINDS)}, or a model)")
        if isinstance(target, DeepseekModel) and name != "mtp":
            raise ValueError(f"draft {spec!r}: a DeepSeek (MLA) target takes draft 'mtp' (its MTP layer)")
        return DRAFT_KINDS[name](target, arg, seed)
    if isinstance(spec, LlamaModel):
        if spec.config.vocab_size != target.config.vocab_size:
            raise ValueError("a small-LM draft must share the target's vocabulary")
        return LMDraft(spec)
    if not (callable(getattr(spec, "forward", None)) and all(hasattr(spec, a) for a in
                                                             ("num_layers", "num_kv_heads", "head_dim"))):
        raise ValueError(f"draft must be one of {', '.join(DRAFT_KINDS)}, a LlamaModel or a draft object "
                         f"(forward, num_layers, num_kv_heads, head_dim), got {type(spec).__name__} {spec!r}")
    E = target.config.hidden_size
    if getattr(spec, "uses_hidden", False) and getattr(spec, "hidden_size", E) != E:
        raise ValueError(f"draft {type(spec).__name__} reads hidden states of width {spec.hidden_size}, the target's "
                         f"are {E} wide (a draft built for another target?)")
    return spec
