"""Multi-head latent attention (MLA): the dimensions, the softmax scale, the two layers, the path choice, the weights.

DeepSeek-V2/V3 cache one **latent row** per token instead of per-head K and V (docs/mla.md)::

    c   = kv_a_layernorm(kv_a_proj_with_mqa(x)[:R])    the latent, R = kv_lora_rank       (512)
    k_pe = RoPE(kv_a_proj_with_mqa(x)[R:])             one RoPE key shared by all heads    (64)
    row = [c | k_pe]                                   what the pool stores, R + Dr wide   (576)
    k_h = [W_UK[h] c | k_pe],  v_h = W_UV[h] c         per-head K (Dn + Dr = 192), V (Dv = 128)

Attention for query head h with ``q_h = [q_nope_h | q_pe_h]`` can run in two forms (ML-008):

* **non-absorbed** (MHA): expand every key's latent to ``k_h``, ``v_h`` and run ordinary
  attention over 192-wide keys, 128-wide values;
* **absorbed** (MQA over the latent): since ``q_nope_h . (W_UK[h] c) = (W_UK[h]^T q_nope_h) . c``,
  attend with ``q = [W_UK^T q_nope | q_pe]`` (576 wide) over the row itself, one KV head, value
  ``c`` (512 wide), then multiply the output by ``W_UV[h]``.  FA3 runs this form as
  ``flash_attn_with_kvcache(q=q_pe, k_cache=k_rope, v_cache=c_kv, qv=W_UK^T q_nope)`` (ML-005).

Which form a batch takes is the model's choice (ML-009, :func:`mla_forward_method`): SGLang runs
the non-absorbed form for a plain prefill with no cached prefix (compute-bound, few keys per
query), the absorbed one everywhere else (decode and every speculative mode: memory-bound).

Both forms use the **same scale** (ML-007): ``(Dn + Dr)^-0.5`` times ``mscale^2`` under YaRN rope
scaling, set on both layers (:func:`mla_attention_layers`) and passed to the kernel explicitly.

Upstream: ``DeepseekV2AttentionMLA`` in `srt/models/deepseek_v2.py@v0.5.23
<https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_v2.py#L2183>`_
(the two ``RadixAttention`` layers ``attn_mqa`` / ``attn_mha``), the handler in
`srt/models/deepseek_common/attention_backend_handler.py@v0.5.23
<https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_common/attention_backend_handler.py#L108>`_.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from numbers import Real

import torch

from refspec.core.args import count, int_list, tensor
from refspec.core.batch import ForwardBatch
from refspec.core.invariants import require
from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode


@dataclass(frozen=True)
class MLADims:
    """MLA head dimensions (HF / SGLang config names), in elements.

    ``kv_lora_rank`` R: the latent ``c``; ``qk_rope_head_dim`` Dr: the RoPE part of q and k (one
    ``k_pe`` shared by all heads); ``qk_nope_head_dim`` Dn: the per-head non-RoPE part of q and k;
    ``v_head_dim`` Dv: the per-head value.  Raises ValueError for a dim that is not an int >= 1.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            count(f"MLADims.{name}", getattr(self, name), 1)

    @property
    def kv_cache_dim(self) -> int:
        """R + Dr: the width of the pool's row (576 for DeepSeek-V3, ML-001)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Dn + Dr: the per-head q / k width of the non-absorbed form (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


#: DeepSeek-V2 / V3 / R1: R = 512, Dr = 64, Dn = 128, Dv = 128 (a row of 576; the dims FA3's
#: 64 / 512 ``qv`` kernel and 192 / 128 prefill kernel are built for, ML-006)
DEEPSEEK_V3_DIMS = MLADims(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
#: DeepSeek-V3's ``rope_scaling`` (YaRN, factor 40, mscale_all_dim 1): scale 192^-0.5 * 1.3689^2 = 0.1352
DEEPSEEK_V3_ROPE_SCALING = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: ``0.1 * mscale * ln(scale) + 1`` for a context stretched by
    ``scale`` > 1, else 1.  DeepSeek-V3: ``yarn_get_mscale(40, 1) = 1.3689``.

    Upstream: ``yarn_get_mscale``, `configs/model_config.py@v0.5.23
    <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/configs/model_config.py#L2617>`_.
    Raises ValueError naming ``scale`` / ``mscale`` if either is not a finite real number (upstream
    would return nan / inf, or a TypeError)."""
    scale, mscale = finite_number("scale", scale), finite_number("mscale", mscale)
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def finite_number(name: str, x) -> float:
    """``x`` as a float if it is a finite real number (not a bool); ValueError naming ``name`` otherwise."""
    if isinstance(x, bool) or not isinstance(x, Real) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return float(x)


def check_rope_scaling(rope_scaling) -> None:
    """The HF ``rope_scaling`` entries the MLA scale reads are well formed: None or a dict whose
    ``factor`` (if given) is a finite number > 0 and whose ``mscale_all_dim`` (if given) is a
    finite number (or False, upstream's default); a missing ``factor`` is upstream's 1.0, with
    upstream's warning (a ``UserWarning`` here).  refspec hardening: upstream's
    ``yarn_get_mscale`` returns mscale 1 for any factor <= 1, so a factor of 0 or -40 (a broken
    config: no context is stretched by a non-positive factor) would pass silently as "no YaRN".
    Raises ValueError naming the entry."""
    if rope_scaling is None:
        return
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be None or a dict (HF config), got {type(rope_scaling).__name__} "
                         f"{rope_scaling!r}")
    kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
    applies = (kind != "default" and rope_scaling.get("apply_yarn_scaling", True)
               and rope_scaling.get("apply_scale", True))
    if applies and "factor" not in rope_scaling:  # upstream's words (compute_mla_mscale_scaling)
        warnings.warn("rope_scaling missing 'factor', defaulting to 1.0 (no YaRN stretch). Check model accuracy.",
                      stacklevel=3)
    if "factor" in rope_scaling and finite_number("rope_scaling['factor']", rope_scaling["factor"]) <= 0:
        raise ValueError(f"rope_scaling['factor'] must be > 0 (the context stretch; YaRN needs > 1), got "
                         f"{rope_scaling['factor']!r}")
    if rope_scaling.get("mscale_all_dim", False) is not False:
        finite_number("rope_scaling['mscale_all_dim']", rope_scaling["mscale_all_dim"])


def mla_softmax_scale(dims: MLADims, rope_scaling: dict | None = None) -> float:
    """The MLA softmax scale (ML-007): ``(Dn + Dr)^-0.5``, times ``mscale^2`` under YaRN.

    ``rope_scaling`` is the HF config's dict (None: no scaling).  As SGLang: a dict with
    ``apply_yarn_scaling`` False, ``apply_scale`` False or ``rope_type`` / ``type`` "default" keeps
    the base scale; otherwise ``mscale = yarn_get_mscale(factor, mscale_all_dim)`` (factor default
    1.0, mscale_all_dim default 0, which gives mscale 1).  Note what it is not: FA3's default
    scale with ``qv`` is ``(D + Dv)^-0.5 = 576^-0.5 = 0.0417`` (the absorbed layer's head_dim),
    wrong by the factor ``sqrt(576 / 192)`` even without YaRN; so the scale always goes to the
    kernel explicitly.  DeepSeek-V3: ``192^-0.5 * 1.3689^2 = 0.1352``.

    Upstream: ``DeepseekV2AttentionMLA.__init__`` (``self.scaling = self.qk_head_dim**-0.5``, then
    ``compute_mla_mscale_scaling``), `deepseek_v2.py@v0.5.23
    <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_v2.py#L2059>`_;
    `compute_mla_mscale_scaling@v0.5.23
    <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/configs/model_config.py#L2623>`_.
    Raises ValueError naming ``dims`` (not an :class:`MLADims`) or a malformed ``rope_scaling``
    entry (:func:`check_rope_scaling`).
    """
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims must be an MLADims, got {type(dims).__name__} {dims!r}")
    check_rope_scaling(rope_scaling)
    base = dims.qk_head_dim ** -0.5
    if not rope_scaling or not rope_scaling.get("apply_yarn_scaling", True):
        return base
    if (rope_scaling.get("rope_type") or rope_scaling.get("type")) == "default" or \
            not rope_scaling.get("apply_scale", True):
        return base
    mscale = yarn_get_mscale(rope_scaling.get("factor", 1.0), float(rope_scaling.get("mscale_all_dim", False)))
    return base * mscale * mscale


def mla_attention_layers(layer_id: int, num_heads: int, dims: MLADims, scaling: float,
                         logit_cap: float = 0.0) -> tuple[AttentionLayer, AttentionLayer]:
    """One MLA layer's two attention layers, SGLang's ``attn_mqa`` and ``attn_mha``: ``(absorbed, mha)``.

    * absorbed (``attn_mqa``): H heads over ONE KV head, ``head_dim = R + Dr`` (576),
      ``v_head_dim = R`` (512): the backend's paged ``qv`` path (ML-005);
    * mha (``attn_mha``): H heads over H KV heads, ``head_dim = Dn + Dr`` (192),
      ``v_head_dim = Dv`` (128): the non-absorbed prefill (ML-010).

    Both carry ``scaling`` (:func:`mla_softmax_scale`, ML-007) and share ``layer_id`` (one KV row
    per layer serves both).  Upstream: `deepseek_v2.py@v0.5.23
    <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_v2.py#L2183>`_.
    Raises: ValueError naming ``layer_id`` / ``num_heads`` (not an int >= 0 / >= 1) or ``dims``;
    InvariantError ML-007 for a ``scaling`` that is not a finite number > 0 (None included: the
    scale is always explicit).
    """
    count("layer_id", layer_id)
    count("num_heads", num_heads, 1)
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims must be an MLADims, got {type(dims).__name__} {dims!r}")
    check_scale(scaling, f"mla_attention_layers(layer_id={layer_id})")
    absorbed = AttentionLayer(layer_id, num_heads, 1, dims.kv_cache_dim, scaling=scaling, logit_cap=logit_cap,
                              v_head_dim=dims.kv_lora_rank)
    mha = AttentionLayer(layer_id, num_heads, num_heads, dims.qk_head_dim, scaling=scaling, logit_cap=logit_cap,
                         v_head_dim=dims.v_head_dim)
    return absorbed, mha


def check_scale(scaling, who: str) -> None:
    """ML-007: ``scaling`` is an explicit softmax scale, a finite number > 0 (what
    :func:`mla_softmax_scale` returns); None (the head-dim default) and nan / inf / <= 0 are refused."""
    require(scaling is not None, "ML-007", lambda: f"{who} has no scaling: the default head_dim^-0.5 of the "
            "absorbed layer is FA3's qv default (D + Dv)^-0.5, not MLA's (Dn + Dr)^-0.5 * mscale^2 (set it with "
            "mla_softmax_scale)")
    ok = not isinstance(scaling, bool) and isinstance(scaling, Real) and math.isfinite(scaling) and scaling > 0
    require(ok, "ML-007", lambda: f"{who}: scaling {scaling!r}; the MLA scale (Dn + Dr)^-0.5 * mscale^2 "
            "(mla_softmax_scale) is a finite number > 0")


class AttnForwardMethod(Enum):
    """The attention form of one MLA forward (SGLang's ``AttnForwardMethod``, the MLA-relevant three)."""

    MHA_ONE_SHOT = "mha_one_shot"  #: non-absorbed, every key of every request in one varlen call (ML-010)
    MHA_CHUNKED_KV = "mha_chunked_kv"  #: non-absorbed, the prefix in chunks merged by LSE (not modelled)
    MLA = "mla"  #: absorbed, paged, the qv kernel (ML-005)


#: ``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD``: a summed prefix this long (tokens) goes back to the MHA form
CHUNKED_PREFIX_CACHE_THRESHOLD = 8192
#: ``SGLANG_MAX_KV_CHUNK_CAPACITY``: above this many keys (summed ``seq_lens``) MHA is chunked
MAX_KV_CHUNK_CAPACITY = 128 * 1024


def mla_forward_method(fb: ForwardBatch, *, disable_chunked_prefix_cache: bool = False,
                       deterministic: bool = False) -> AttnForwardMethod:
    """ML-009: which form SGLang's DeepSeek model runs this batch in, on the FA3 backend.

    The non-absorbed MHA form when all of these hold, else the absorbed MLA form:

    * the mode is EXTEND (a plain prefill: no speculative mode, no decode);
    * the summed prefix ``sum(seq_lens - extend_seq_lens)`` (tokens) is 0, or at least
      :data:`CHUNKED_PREFIX_CACHE_THRESHOLD` with the chunked prefix cache on;
    * deterministic inference is off (it pins the absorbed form on fa3).

    Then MHA_ONE_SHOT when the batch's summed ``seq_lens`` is at most
    :data:`MAX_KV_CHUNK_CAPACITY`, else MHA_CHUNKED_KV.  Not modelled (SGLang also pins MLA for
    them): a prefill under a CUDA graph and context parallelism.  Example: EXTEND with prefixes
    [0, 0] -> MHA_ONE_SHOT; [0, 5] -> MLA (5 < 8192); TARGET_VERIFY -> MLA.

    Upstream: ``_handle_attention_backend`` / ``handle_attention_fa3``, `attention_backend_handler.py@v0.5.23
    <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_common/attention_backend_handler.py#L108>`_
    (the same rule at v0.5.12.post1, L72).  Raises ValueError if ``fb`` is no ForwardBatch, or an
    EXTEND batch lacks ``extend_seq_lens_cpu`` or holds other than one length ``0 <= e_b <= seq_lens[b]``
    per request (a malformed list could sum the prefixes to 0 and pick MHA for a batch with one).
    """
    if not isinstance(fb, ForwardBatch):
        raise ValueError(f"mla_forward_method takes a ForwardBatch, got {type(fb).__name__}")
    if deterministic or fb.forward_mode != ForwardMode.EXTEND:
        return AttnForwardMethod.MLA
    if fb.extend_seq_lens_cpu is None:
        raise ValueError("mla_forward_method: an EXTEND batch needs extend_seq_lens_cpu (its prefixes are "
                         "seq_lens - extend_seq_lens)")
    seq = [int(x) for x in fb.seq_lens_cpu.tolist()]
    ext = int_list("extend_seq_lens_cpu", fb.extend_seq_lens_cpu, length=len(seq), least=0)
    if any(e > s for s, e in zip(seq, ext)):
        raise ValueError(f"extend_seq_lens_cpu {ext} exceeds seq_lens {seq}: a request extends by at most its length")
    prefix = sum(s - e for s, e in zip(seq, ext))
    if not (prefix == 0 or (prefix >= CHUNKED_PREFIX_CACHE_THRESHOLD and not disable_chunked_prefix_cache)):
        return AttnForwardMethod.MLA
    return AttnForwardMethod.MHA_ONE_SHOT if sum(seq) <= MAX_KV_CHUNK_CAPACITY else AttnForwardMethod.MHA_CHUNKED_KV


# ---- the weight layout: kv_b_proj split into W_UK / W_UV, absorbed and brought back (ML-008) ----

def split_kv_b_proj(weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [H (Dn + Dv), R]`` -> ``(w_kc [H, Dn, R], w_vc [H, R, Dv])`` (views).

    Per head h the weight's rows are ``[W_UK[h] (Dn rows) ; W_UV[h] (Dv rows)]``: ``k_nope_h =
    W_UK[h] c`` and ``v_h = W_UV[h] c``.  ``w_vc`` is ``W_UV`` transposed, SGLang's layout
    (``deepseek_weight_loader.py`` at v0.5.23: ``w.unflatten(0, (-1, Dn + Dv)).split([Dn, Dv], dim=1)``).
    Raises ValueError naming ``weight`` (not a 2-D floating tensor, or rows that are not H blocks
    of Dn + Dv with Dv >= 1), ``num_heads`` or ``qk_nope_head_dim`` (not an int >= 1)."""
    H, Dn = count("num_heads", num_heads, 1), count("qk_nope_head_dim", qk_nope_head_dim, 1)
    tensor("kv_b_proj.weight", weight, dim=2, integer=False)
    rows, R = weight.shape
    if rows % H or rows // H <= Dn:
        raise ValueError(f"kv_b_proj.weight {tuple(weight.shape)}: need num_heads H = {H} blocks of "
                         f"qk_nope_head_dim Dn = {Dn} + Dv >= 1 rows each")
    w = weight.view(H, rows // H, R)
    return w[:, :Dn], w[:, Dn:].transpose(1, 2)


def _weights(w_kc, w_vc) -> tuple[int, int, int, int]:
    """``(H, Dn, R, Dv)`` of ``w_kc [H, Dn, R]`` and ``w_vc [H, R, Dv]``; ValueError naming them
    unless they are 3-D floating tensors of one H and one R (:func:`split_kv_b_proj`'s outputs)."""
    tensor("w_kc", w_kc, dim=3, integer=False)
    tensor("w_vc", w_vc, dim=3, integer=False)
    (H, Dn, R), (Hv, Rv, Dv) = w_kc.shape, w_vc.shape
    if (H, R) != (Hv, Rv):
        raise ValueError(f"w_kc {tuple(w_kc.shape)} [H, Dn, R] and w_vc {tuple(w_vc.shape)} [H, R, Dv] disagree on "
                         "H or R (swapped? split_kv_b_proj returns (w_kc, w_vc))")
    return H, Dn, R, Dv


def _shaped(name: str, t, shape: tuple, what: str) -> None:
    """ValueError naming ``name`` unless ``t`` is a floating tensor of ``shape`` (None: any size)."""
    tensor(name, t, dim=len(shape), integer=False)
    if any(want is not None and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} {tuple(t.shape)} must be {what}")


def absorb_q(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """``q_nope [T, H, Dn]`` -> ``W_UK^T q_nope`` ``[T, H, R]``: SGLang's ``q_nope_out = bmm(q_nope, w_kc)``
    (`forward_mla.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py#L586>`_).
    Raises ValueError naming ``q_nope`` / ``w_kc`` for other shapes or a non-floating tensor."""
    tensor("w_kc", w_kc, dim=3, integer=False)
    H, Dn, R = w_kc.shape
    _shaped("q_nope", q_nope, (None, H, Dn), f"[T, H = {H}, Dn = {Dn}] (w_kc is {tuple(w_kc.shape)} [H, Dn, R])")
    return torch.einsum("thd,hdr->thr", q_nope, w_kc.to(q_nope.dtype))


def latent_to_v(o: torch.Tensor, w_vc: torch.Tensor) -> torch.Tensor:
    """The absorbed output ``o [T, H, R]`` (latent space) -> ``W_UV o`` ``[T, H, Dv]``: SGLang's
    ``bmm(attn_output, w_vc)``.  Raises ValueError naming ``o`` / ``w_vc`` for other shapes."""
    tensor("w_vc", w_vc, dim=3, integer=False)
    H, R, Dv = w_vc.shape
    _shaped("o", o, (None, H, R), f"[T, H = {H}, R = {R}] (w_vc is {tuple(w_vc.shape)} [H, R, Dv])")
    return torch.einsum("thr,hrv->thv", o, w_vc.to(o.dtype))


def expand_latent(c: torch.Tensor, k_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor):
    """The non-absorbed keys and values of latent rows: ``c [S, R]``, ``k_pe [S, Dr]`` ->
    ``(k [S, H, Dn + Dr], v [S, H, Dv])`` with ``k_h = [W_UK[h] c | k_pe]`` (``k_pe`` shared by
    every head) and ``v_h = W_UV[h] c``.  Raises ValueError naming the argument for other shapes."""
    H, Dn, R, Dv = _weights(w_kc, w_vc)
    _shaped("c", c, (None, R), f"[S, R = {R}] (the latent rows; R read off w_kc {tuple(w_kc.shape)} [H, Dn, R] and "
            f"w_vc {tuple(w_vc.shape)} [H, R, Dv]: passed in the other order?)")
    _shaped("k_pe", k_pe, (c.shape[0], None), f"[S = {c.shape[0]}, Dr] (one RoPE key per latent row)")
    k_nope = torch.einsum("sr,hdr->shd", c, w_kc.to(c.dtype))
    v = torch.einsum("sr,hrv->shv", c, w_vc.to(c.dtype))
    return torch.cat([k_nope, k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1), v


# ---- the argument checks both wings run on an MLA call (the same words, as core/batch.py's shapes) ----

def check_absorbed_call(pool, layer: AttentionLayer, q, q_rope, k, k_rope) -> None:
    """The absorbed MLA call ``forward(q, k, v, layer, fb, q_rope=, k_rope=)`` is well formed.

    ``pool``: the :class:`~refspec.core.kv_cache.MLAKVPool` (its row width R + Dr, its device).
    The layer is the absorbed one (:func:`mla_attention_layers`): one KV head, ``head_dim`` the row
    width, ``v_head_dim`` inside it, an explicit ``scaling``.  ``q [T, H, Dv]`` (``q_nope``
    absorbed), ``q_rope [T, H, D - Dv]``, floating, one dtype; ``k`` (the latent, ``[T, 1, R]``)
    and ``k_rope`` (``[T, 1, Dr]``) both given (stored first) or both None (nothing to store);
    their shapes are the store's to check (ML-002).  Shapes, dtypes and devices only: no host sync.
    Raises: InvariantError ML-007 (no explicit finite scale > 0), ML-003 (the layer does not split
    the pool's row), ML-005 (q / q_rope shapes or dtypes); ValueError naming ``q`` / ``q_rope``
    (not a tensor, or not on the pool's device) or the layer's ``sliding_window_size`` (SGLang passes
    the window to the qv call; refspec does not model sliding-window MLA, DeepSeek has none).
    """
    L, row_dim = layer, pool.kv_cache_dim
    check_scale(L.scaling, f"layer {L.layer_id}")
    require(L.num_kv_heads == 1 and L.head_dim == row_dim and 0 < L.v_head_dim < L.head_dim, "ML-003",
            lambda: f"layer {L.layer_id}: num_kv_heads {L.num_kv_heads}, head_dim {L.head_dim}, v_head_dim "
            f"{L.v_head_dim}; the absorbed layer has one KV head, head_dim = the pool's row {row_dim} and "
            "0 < v_head_dim < head_dim (the split point)")
    check_window(L)
    tensor("q (the absorbed q_nope)", q)
    if q_rope is not None:
        tensor("q_rope", q_rope)
    require(q_rope is not None and q.dim() == 3 and tuple(q.shape[1:]) == (L.num_heads, L.v_head_dim)
            and tuple(q_rope.shape) == (q.shape[0], L.num_heads, L.head_dim - L.v_head_dim),
            "ML-005", lambda: f"q {tuple(q.shape)}, q_rope {None if q_rope is None else tuple(q_rope.shape)}: the "
            f"absorbed call takes q = W_UK^T q_nope [T, H = {L.num_heads}, {L.v_head_dim}] and q_rope [T, H, "
            f"{L.head_dim - L.v_head_dim}]")
    require(q.is_floating_point() and q.dtype == q_rope.dtype, "ML-005",
            lambda: f"q {q.dtype}, q_rope {q_rope.dtype}: the kernel's qv (q) and q (q_rope) share one floating dtype")
    for name, t in (("q", q), ("q_rope", q_rope)):
        on_device(name, t, pool.device)
    require((k is None) == (k_rope is None), "ML-002",
            lambda: "k (the latent) and k_rope are stored together: pass both, or neither (nothing to store)")


def check_mha_pass(layer: AttentionLayer, q, k, v, total_keys: int) -> None:
    """The non-absorbed prefill call (ML-010) is well formed: ``q [T, H, D]``, ``k [sum K, Hkv, D]``,
    ``v [sum K, Hkv, Dv]``, one floating dtype, every key of every request (prefix included:
    MHA_ONE_SHOT), an explicit scale.  ``total_keys``: ``sum K_b`` (tokens).
    Raises InvariantError ML-007 / ML-010 / PA-011 (dtypes); ValueError naming ``q`` / ``k`` / ``v`` (not tensors)
    or the layer's ``sliding_window_size`` (not modelled, as in :func:`check_absorbed_call`)."""
    L = layer
    check_scale(L.scaling, f"layer {L.layer_id}")
    check_window(L)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None or name == "q":
            tensor(name, t)
    ok = (k is not None and v is not None and q.dim() == 3 and tuple(q.shape[1:]) == (L.num_heads, L.head_dim)
          and tuple(k.shape) == (total_keys, L.num_kv_heads, L.head_dim)
          and tuple(v.shape) == (total_keys, L.num_kv_heads, L.v_head_dim))
    require(ok, "ML-010", lambda: f"q {tuple(q.shape)}, k {None if k is None else tuple(k.shape)}, v "
            f"{None if v is None else tuple(v.shape)}: the MHA pass takes q [T, {L.num_heads}, {L.head_dim}] and "
            f"k / v [sum K = {total_keys}, {L.num_kv_heads}, {L.head_dim} / {L.v_head_dim}], every key of every "
            "request (MHA_ONE_SHOT; the chunked prefix pass is not modelled)")
    require(q.is_floating_point() and q.dtype == k.dtype == v.dtype, "PA-011",
            lambda: f"q {q.dtype}, k {k.dtype}, v {v.dtype}: the MHA pass's varlen call takes one floating dtype")


def check_window(layer: AttentionLayer) -> None:
    """ValueError for an MLA layer with a sliding window: upstream passes ``window_size`` to the
    MLA kernel calls; refspec's MLA wings do not model it (DeepSeek's layers have no window), so
    they refuse it rather than attend the whole prefix silently."""
    if layer.sliding_window_size != -1:
        raise ValueError(f"layer {layer.layer_id}: sliding_window_size={layer.sliding_window_size!r}; refspec's MLA "
                         "attention has no sliding window (-1 only)")


def on_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """ValueError naming ``name`` when tensor ``t`` is not on ``device`` (the pool's)."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the MLA pool on {device}: one device for every operand")


def is_mha_pass(fb: ForwardBatch) -> bool:
    """Whether an MLA forward is the non-absorbed MHA pass (``fb.attn_attend_prefix_cache`` False,
    ML-010) rather than the absorbed path (None).

    Raises: InvariantError ML-009 for the MHA pass outside EXTEND (SGLang's backend ignores the flag
    in TARGET_VERIFY / DRAFT_EXTEND_V2 and runs them absorbed; a model that sets it there chose
    wrong); ValueError for True, SGLang's prefix-chunk pass of MHA_CHUNKED_KV, which refspec does
    not model."""
    if fb.attn_attend_prefix_cache:
        raise ValueError("attn_attend_prefix_cache=True (the prefix-chunk pass of MHA_CHUNKED_KV) is not modelled: "
                         "refspec runs MLA prefills as MHA_ONE_SHOT (k / v hold every key) or absorbed")
    if fb.attn_attend_prefix_cache is None:
        return False
    require(fb.forward_mode == ForwardMode.EXTEND, "ML-009", lambda: f"{fb.forward_mode.name} with "
            "attn_attend_prefix_cache=False: only a plain EXTEND runs the non-absorbed MHA form")
    return True
