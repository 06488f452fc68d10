"""A fast twin of :class:`~refspec.model.llama.LlamaModel` for the production loop on a GPU.

Same weights, same interface (``forward(input_ids, fb, backend, num_layers=None) -> (logits,
hidden)``), same attention backend call per layer; what changes is how the work *around*
attention is launched:

=============================  ==================================  ==============================
per layer                      readable :class:`LlamaModel`        :class:`FusedLlama`
=============================  ==================================  ==============================
RMSNorm                        6 elementwise ops                   fused (compiled)
q / k / v projections          3 matmuls                           1 matmul over ``[Wq; Wk; Wv]``
RoPE on q and k                a chain of elementwise ops each     fused (compiled); k and v come
                                                                   out as one ``[2, T, Hkv, D]``
attention                      ``backend.forward`` (store + FA3)   the same call, not compiled;
                                                                   the store is one scatter for k
                                                                   and v (:class:`KVPool`)
o_proj + residual + RMSNorm    matmul + 7 elementwise ops          matmul + 1 fused kernel
residual + next RMSNorm        3 + 6 elementwise ops               1 fused kernel (``post_pre``)
gate / up projections          2 matmuls                           1 matmul over ``[Wgate; Wup]``
SiLU * up, down, residual      3 elementwise ops + matmul          1 fused kernel + matmul
=============================  ==================================  ==============================

Per forward, the RoPE table (cos / sin ``[T, D]`` of ``positions``) is one compiled region over
the inverse frequencies computed once at construction (the readable model recomputes them
each forward: arange, divide, power, reciprocal, then the angle, cat, cos, sin and two casts,
11 launches per forward, 4 forwards a round), with the same fp32 formula: eager, the same
bits; compiled, cos / sin may differ by an fp32 ulp (vectorised math), which the cast to bf16
almost always rounds away (the fused model's contract is T1 against the readable one anyway).

The compiled parts are ``torch.compile`` (inductor) functions with dynamic shapes, one per
kind of region (before attention, after attention, the LM head), shared by every layer: the
attention call stays a plain Python call between them, so the FA3 kernel (or the emulator)
and its metadata are exactly those of the readable model, and the whole forward can still be
captured in a CUDA graph (compilation happens in the graph runner's warm-up runs, never during
capture).  Compilation is on by default on CUDA only; on CPU the same fused math runs eagerly
(tests compare it with the readable model there).

The readable model stays the reference: :class:`FusedLlama` holds it (``.reference``), shares
its modules (``.model``, ``.config``, ``logits``, ``run_layers`` for an EAGLE head), and only
adds the concatenated weights.  Fusing the projections changes the order of floating-point
work, so the two agree to rounding (tolerance tier T1 on activations), not bitwise.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from refspec.model.llama import LlamaModel, capture_states, check_aux


#: inductor options of the compiled regions.  ``pattern_matcher`` off: inductor's post-grad
#: pattern ``add(inp, mm(a, b)) -> addmm(inp, a, b)`` (``addmm`` in
#: ``torch/_inductor/fx_passes/post_grad.py``) would turn both residual adds of a layer into a
#: cuBLAS addmm, and ATen's addmm first *copies* ``inp`` into its output (``beta != 0``): two
#: device copies per layer forward, ~200 extra nodes per round in the CUDA graphs (measured on
#: the H200, benchmarks/results/h200_round4.md).  Unfused, each matmul writes its bf16 output
#: and the residual add runs inside the next RMSNorm kernel, which is also the readable model's
#: rounding (matmul rounded to bf16, then the add).
COMPILE_OPTIONS = {"pattern_matcher": False}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm``: normalise in fp32, cast back, then scale (as :class:`~refspec.model.llama.RMSNorm`)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, heads, D]`` by ``cos, sin [T, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]


class FusedLlama(LlamaModel):
    """``FusedLlama(model)``: the fast twin of a loaded :class:`LlamaModel` (module doc).

    Args:
        model: the readable model (its modules are shared, not copied).
        compile: ``torch.compile`` the non-attention regions; default True on CUDA, False
            elsewhere.
    Shapes: as :meth:`LlamaModel.forward`: ``input_ids [T]`` -> ``logits [T, V]``, ``hidden [T, E]``.
    """

    def __init__(self, model: LlamaModel, compile: bool | None = None):
        nn.Module.__init__(self)
        self.config = model.config
        self.model = model.model  # shared submodules: embedding, layers, final norm
        if not model.config.tie_word_embeddings:
            self.lm_head = model.lm_head
        self.reference = [model]  # a list: not registered twice as a submodule
        c = model.config
        H, Hkv, D, I = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
        eps = c.rms_norm_eps
        with torch.no_grad():
            self.wqkv = [torch.cat([lay.self_attn.q_proj.weight, lay.self_attn.k_proj.weight,
                                    lay.self_attn.v_proj.weight]) for lay in model.model.layers]
            self.wgu = [torch.cat([lay.mlp.gate_proj.weight, lay.mlp.up_proj.weight]) for lay in model.model.layers]
        split = (H * D, Hkv * D, Hkv * D)

        def pre(h, ln_w, wqkv, cos, sin):
            """input_layernorm -> one q/k/v matmul -> RoPE on q and k; ``(q, kv)`` with k, v
            stacked ``[2, T, Hkv, D]`` so the KV store is one scatter (KVPool.set_kv_buffer)."""
            T = h.shape[0]
            q, k, v = F.linear(_rms(h, ln_w, eps), wqkv).split(split, dim=-1)
            return _rope(q.view(T, H, D), cos, sin), torch.stack((_rope(k.view(T, Hkv, D), cos, sin),
                                                                  v.view(T, Hkv, D)))

        def post(h, o, wo, ln_w, wgu, wdown):
            """o_proj + residual -> post_attention_layernorm -> one gate/up matmul -> SiLU * up -> down + residual."""
            h = h + F.linear(o.reshape(h.shape[0], H * D), wo)
            g, u = F.linear(_rms(h, ln_w, eps), wgu).split((I, I), dim=-1)
            return h + F.linear(F.silu(g) * u, wdown)

        def post_pre(h, o, wo, ln_w, wgu, wdown, next_ln_w, next_wqkv, cos, sin):
            """Layer i's ``post`` and layer i + 1's ``pre`` in one region: the residual add and the
            next input_layernorm become one kernel."""
            h = post(h, o, wo, ln_w, wgu, wdown)
            return (h, *pre(h, next_ln_w, next_wqkv, cos, sin))

        def head(h, norm_w, lm_w):
            return F.linear(_rms(h, norm_w, eps), lm_w)

        def rope_table(positions, inv_freq, dtype):
            """:func:`~refspec.model.llama.rope_cos_sin` with ``inv_freq`` given: the same fp32 steps."""
            ang = positions.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((ang, ang), dim=-1)
            return emb.cos().to(dtype), emb.sin().to(dtype)

        dev = next(model.parameters()).device
        # the readable rope_cos_sin's inverse frequencies, once (same expression, same device)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
        if compile is None:
            compile = dev.type == "cuda"
        wrap = (lambda f: torch.compile(f, dynamic=True, options=COMPILE_OPTIONS)) if compile else (lambda f: f)
        self._pre, self._post, self._post_pre, self._head = wrap(pre), wrap(post), wrap(post_pre), wrap(head)
        self._rope_table = wrap(rope_table)
        self.compiled = bool(compile)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[T, D]`` of ``positions [T]``, compiled, from the precomputed ``inv_freq``."""
        return self._rope_table(positions, self.inv_freq, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, compiled: ``[T, E]`` -> ``[T, V]``."""
        return self._head(hidden, self.model.norm.weight, self.lm_head_weight)

    def forward(self, input_ids, fb, backend, num_layers: int | None = None, aux: tuple[int, ...] | None = None):
        """As :meth:`LlamaModel.forward` (``num_layers`` k: the first k layers, an early-exit draft;
        ``aux``: the concatenated hidden states an EAGLE-3 draft reads, :func:`~refspec.model.llama.capture_states`)."""
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        if aux is not None:
            check_aux(aux, len(layers))
        states = []
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(fb.positions, h.dtype)
        q, kv = self._pre(h, layers[0].input_layernorm.weight, self.wqkv[0], cos, sin)
        for i, lay in enumerate(layers):
            if aux is not None and i in aux:
                states.append(h)
            o = backend.forward(q, kv[0], kv[1], lay.self_attn.layer, fb)
            w = (h, o, lay.self_attn.o_proj.weight, lay.post_attention_layernorm.weight, self.wgu[i],
                 lay.mlp.down_proj.weight)
            if i + 1 < len(layers):
                h, q, kv = self._post_pre(*w, layers[i + 1].input_layernorm.weight, self.wqkv[i + 1], cos, sin)
            else:
                h = self._post(*w)
        return self.logits(h), (h if aux is None else capture_states(states, h, aux, len(layers)))
