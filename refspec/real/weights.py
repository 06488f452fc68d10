"""SmolLM2-135M-Instruct weights from the GGUF, as a HuggingFace-Llama state dict.

Three things separate a GGUF file from ``LlamaForCausalLM.state_dict()`` and are undone here:

1. **Quantisation.**  Linear weights are Q4_1, the embedding Q8_0, norms F32; every tensor is
   dequantised with ``gguf.quants.dequantize`` to fp32.
2. **Shape order.**  GGUF lists dims innermost-first (``attn_q`` is ``[576, 576]``, ``ffn_down``
   ``[1536, 576]``, i.e. ``[in, out]``); the reader's data array is already row-major
   ``[out, in]``, which is ``nn.Linear.weight``'s layout.  The loader checks both agree.
3. **The q/k row permutation.**  llama.cpp's converter (``convert_hf_to_gguf.py``,
   ``LlamaModel.permute``) reorders the rows of ``q_proj`` / ``k_proj`` within each head from
   HF's rotate-half layout (rows ``[0..D/2)`` = first halves, ``[D/2..D)`` = second halves) to
   llama.cpp's interleaved-pair RoPE layout (rows ``0, D/2, 1, D/2+1, ...``)::

       w.reshape(n_head, 2, D // 2, in).swapaxes(1, 2).reshape(n_head * D, in)

   :func:`unpermute_qk` applies the inverse (``reshape(n_head, D // 2, 2, in).swapaxes(1, 2)``)
   with ``n_head = 9`` for q and ``n_head = 3`` (the KV heads) for k.  Without it, rotate-half
   RoPE pairs the wrong coordinates and the logits are wrong.

The embedding is tied: GGUF has no ``output.weight``, the LM head is ``model.embed_tokens.weight``
and the returned dict has no ``lm_head.weight`` (``config["tie_word_embeddings"] is True``).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from refspec.real.assets import RealAssetsMissing, verify_gguf

#: GGUF per-layer tensor name -> HF Llama per-layer parameter name.
LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES: dict[str, str] = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}

CONFIG_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size",
    "tie_word_embeddings", "max_position_embeddings",
)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head q/k row permutation (interleaved pairs -> rotate-half halves).

    Shapes: ``w`` [n_head * D, in] -> [n_head * D, in], D = head dim (even).  Any dtype.
    ``n_head`` is 9 for ``attn_q`` and 3 (KV heads) for ``attn_k`` of SmolLM2-135M.
    Row ``h*D + j`` of the result is row ``h*D + 2*j`` (j < D/2) or ``h*D + 2*(j - D/2) + 1``
    (j >= D/2) of ``w``.  Raises ``ValueError`` if the rows do not split into ``n_head`` even heads.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        raise RealAssetsMissing(f"GGUF field {key!r} is missing from {verify_gguf()}")
    return f.contents()


def config_from_reader(reader) -> dict:
    """HF-style config dict (the keys in ``CONFIG_KEYS``) from a ``gguf.GGUFReader``'s metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise RealAssetsMissing(f"GGUF architecture is {arch!r}, expected 'llama'")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv")),
        "head_dim": int(_field(reader, "llama.rope.dimension_count")),
        # stored as float32(1e-5); its shortest float32 repr gives HF's 1e-05
        "rms_norm_eps": float(str(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
    }


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The HF Llama parameter shapes for ``config`` (name -> shape), tied embeddings assumed."""
    h, f, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    nq, nkv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq, h), "self_attn.k_proj.weight": (nkv, h),
        "self_attn.v_proj.weight": (nkv, h), "self_attn.o_proj.weight": (h, nq),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
    }
    out = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        out.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return out


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (KeyError if unknown)."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return f"{GLOBAL_NAMES[base]}.{suffix}"


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _load_fp32() -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        from refspec.real.assets import INSTALL_HINT

        raise RealAssetsMissing(f"the `gguf` package is missing; {INSTALL_HINT}") from None
    reader = gguf.GGUFReader(str(verify_gguf()))
    config = config_from_reader(reader)
    shapes = expected_shapes(config)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF dims are innermost-first: reversed, they must be the row-major [out, in] we got.
        if tuple(w.shape) != tuple(int(n) for n in reversed(t.shape)) or tuple(w.shape) != shapes.get(name):
            raise RealAssetsMissing(f"{t.name}: shape {w.shape} (GGUF {list(t.shape)}), want {shapes.get(name)}")
        tensor = torch.from_numpy(w.copy())
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        state[name] = unpermute_qk(tensor, heads[kind]) if kind in heads else tensor
    if set(state) != set(shapes):
        raise RealAssetsMissing(f"GGUF tensors missing: {sorted(set(shapes) - set(state))[:5]}")
    return config, {k: state[k] for k in shapes}  # HF parameter order


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[dict, dict[str, torch.Tensor]]:
    """SmolLM2-135M-Instruct: ``(config, state_dict)`` with HuggingFace Llama parameter names.

    Shapes (H = 9 query heads, Hkv = 3, D = 64, hidden 576, FFN 1536, vocab 49152, 30 layers):
      ``model.embed_tokens.weight`` [49152, 576] (also the LM head: tied, no ``lm_head.weight``),
      ``model.layers.{i}.self_attn.q_proj.weight`` [H*D, 576], ``k_proj`` / ``v_proj`` [Hkv*D, 576],
      ``o_proj`` [576, H*D], ``mlp.gate_proj`` / ``up_proj`` [1536, 576], ``down_proj`` [576, 1536],
      ``input_layernorm`` / ``post_attention_layernorm`` / ``model.norm`` [576].
    q/k rows are in HF rotate-half order (llama.cpp's permutation undone, see module doc).

    dtype: the fp32 dequantised dict is built once per process (~8 s on 2 CPU cores) and cached;
    other dtypes are cast copies.  For fp32 the tensors ARE the cache: treat them as read-only
    (the dict itself is a fresh copy).  ``config`` is a fresh dict with the keys in ``CONFIG_KEYS``.
    Raises :class:`RealAssetsMissing` if ``gguf`` or the pinned GGUF file is missing or differs.
    """
    with _LOCK:
        config, state = _load_fp32()
    if dtype == torch.float32:
        return dict(config), dict(state)
    return dict(config), {k: v.to(dtype) for k, v in state.items()}
