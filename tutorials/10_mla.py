# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · MLA: one latent cache, two views
#
# DeepSeek-V2 / V3 attend with **multi-head latent attention** (MLA), and SGLang runs it for
# DeepSeek on Hopper through the same FA3 backend as tutorials 02-07, with the same metadata.
# What changes is what the pool stores and how the kernel is called. This notebook shows, with
# DeepSeek-V3's attention dims (`kv_lora_rank` R = 512, `qk_rope_head_dim` Dr = 64,
# `qk_nope_head_dim` Dn = 128, `v_head_dim` Dv = 128) and a few heads:
#
# 1. why one latent row per token is all the cache needs: the **absorption identity**, computed
#    with the oracle in both forms (ML-008);
# 2. the 576-wide row and its **two strided paged views**, `c_kv` and `k_rope` (ML-001, ML-003);
# 3. the **store**: `[k_nope | k_rope]` at `out_cache_loc`, slot 0 never written (ML-002);
# 4. the **`qv` kernel call** as SGLang's FA3 backend makes it, and its **scale**
#    `(Dn + Dr)^-0.5 * mscale^2`, not FA3's default `576^-0.5` (ML-005, ML-007);
# 5. both wings equal on a verify batch, eager and replayed in a CUDA graph;
# 6. why refspec **refuses the GPU build** it has (ML-013).
#
# The math and the picture are also on the docs page "MLA: one latent cache, two views"
# (`docs/mla.md`); the rules are `docs/spec/mla.md` (`python -m refspec cite ML-003` prints one). CPU only (the FA3 wing is the contract
# emulator). Run time as a script on a shared 2-core CPU machine: 19 s wall, 8 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).
#
# **Symbols used below**: `R`, `Dr`, `Dn`, `Dv` as above; `D = R + Dr` (576) the cached row; `H`
# query heads; `P` page size [tokens]; `T` query rows; `W_UK[h]` (Dn x R) and `W_UV[h]` (Dv x R) head
# h's blocks of `kv_b_proj.weight`, stored by SGLang as `w_kc [H, Dn, R]` and `w_vc [H, R, Dv]`.

# %%
from refspec.harness.needs import needs

needs("tutorials")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import math
import sys
import types

import matplotlib.pyplot as plt
import torch

from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache, KVPool, MLAKVPool
from refspec.core.mla import (DEEPSEEK_V3_DIMS, DEEPSEEK_V3_ROPE_SCALING, absorb_q, expand_latent, latent_to_v,
                              mla_forward_method, mla_softmax_scale, split_kv_b_proj, yarn_get_mscale)
from refspec.core.modes import ForwardMode
from refspec.core.tolerance import t0, t1
from refspec.fa3 import kernel
from refspec.fa3.backend import FlashAttentionBackend
from refspec.harness.mla_scenario import MLAScenario
from refspec.harness.viz import show
from refspec.oracle.mla import mla_attention

torch.set_num_threads(1)
d = DEEPSEEK_V3_DIMS
R, Dr, Dn, Dv = d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim
D = d.kv_cache_dim
H = 4  # DeepSeek-V3 has 128 heads; 4 keep this notebook fast, nothing below depends on it
print(f"R = {R}, Dr = {Dr}, Dn = {Dn}, Dv = {Dv}: the cached row is D = R + Dr = {D} wide, "
      f"a non-absorbed head's q / k {Dn + Dr}, its v {Dv}")

# %% [markdown]
# ## 1. Why the latent cache is enough
#
# Per token the layer makes a latent `c` (R wide) and one RoPE key `k_pe` (Dr wide, shared by
# every head). Head `h`'s key and value are *defined* from them: `k_h = [W_UK[h] c | k_pe]`
# (192 wide) and `v_h = W_UV[h] c` (128 wide). So
#
# ```
# q_h . k_h = q_nope_h . (W_UK[h] c) + q_pe_h . k_pe = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe     (*)
# sum_j p_j v_h[j] = W_UV[h] (sum_j p_j c_j)                                                       (**)
# ```
#
# and attention can run in two forms with the same result (ML-008):
#
# * **non-absorbed**: expand every cached `c` to per-head `k_h`, `v_h`, then ordinary attention;
# * **absorbed**: move `W_UK` onto the query (`q = [W_UK^T q_nope | q_pe]`, 576 wide), attend the
#   cached row `[c | k_pe]` itself with ONE KV head and value `c`, then apply `W_UV` to the output.
#
# Either way the cache holds only `[c | k_pe]`. The oracle (`refspec/oracle/mla.py`) has both
# forms behind one flag, as DeepSeek-V3's own `inference/model.py` does. One request of 9 keys
# in a pool of pages of 4, three query rows at positions 6, 7, 8 (a verify of 3), keys gathered by
# slot through `req_to_token`:

# %%
g = torch.Generator().manual_seed(0)
kv_b_proj = torch.randn(H * (Dn + Dv), R, generator=g) / R ** 0.5  # HF's kv_b_proj.weight [H (Dn + Dv), R]
w_kc, w_vc = split_kv_b_proj(kv_b_proj, H, Dn)  # W_UK [H, Dn, R] and W_UV^T [H, R, Dv], views of it

kv = KVCache(max_reqs=4, max_context=16, num_pages=6, page_size=4)
pool = MLAKVPool(num_layers=1, num_pages=6, page_size=4, kv_lora_rank=R, qk_rope_head_dim=Dr)
r = kv.alloc_req()
loc = kv.alloc_extend([r], [0], [9])  # the 9 tokens' slots
pool.set_mla_kv_buffer(0, loc, torch.randn(9, 1, R, generator=g), torch.randn(9, 1, Dr, generator=g))
print("slots of the 9 keys:", loc.tolist())

q_nope, q_pe = torch.randn(3, H, Dn, generator=g), torch.randn(3, H, Dr, generator=g)
scale = mla_softmax_scale(d)  # (Dn + Dr)^-0.5: section 4
args = (pool.get_key_buffer(0), w_kc, w_vc, kv.req_to_token, [r], [0, 3], [6, 7, 8])
naive = mla_attention(q_nope, q_pe, *args, softmax_scale=scale, absorb=False)
absorbed = mla_attention(q_nope, q_pe, *args, softmax_scale=scale, absorb=True)
identity_err = float((naive - absorbed).abs().max())
print(f"non-absorbed {tuple(naive.shape)} vs absorbed {tuple(absorbed.shape)}: max |diff| = {identity_err:.1e}")

# %% [markdown]
# The same numbers, the reordered sums rounding differently (fp32). What each form reads per key:

# %%
rows9 = pool.get_key_buffer(0)[loc]  # [9, 1, 576]: what the cache holds
k9, v9 = expand_latent(rows9[:, 0, :R], rows9[:, 0, R:], w_kc, w_vc)
print(f"the cached rows {tuple(rows9.shape)}; expanded per head: k {tuple(k9.shape)}, v {tuple(v9.shape)}")
mha_per_token = 128 * (Dn + Dr + Dv)  # DeepSeek-V3's 128 heads, K and V per head
print(f"per token and layer: MLA caches {D} values; per-head K and V for 128 heads would be {mha_per_token:,} "
      f"({mha_per_token / D:.0f}x more)")
# (*) for one head and one key: the key side of the non-absorbed form, the query side of the absorbed one
c0, qn = rows9[0, 0, :R], q_nope[0, 0]
print("q_nope . (W_UK c) =", round(float(qn @ (w_kc[0] @ c0)), 5), "  (W_UK^T q_nope) . c =",
      round(float(absorb_q(q_nope, w_kc)[0, 0] @ c0), 5))

# %% [markdown]
# So SGLang runs one model in both forms: a fresh prompt (no cached prefix) takes the
# non-absorbed form, compute-bound and cheap when few keys meet each query; everything else,
# decode and every speculative mode, the absorbed one, which reads one 576-wide row per key
# (ML-009, `refspec.core.mla.mla_forward_method`, SGLang's `_handle_attention_backend`):

# %%
batches = {"EXTEND, prefixes [0, 0]": MLAScenario(ForwardMode.EXTEND, 4, [0, 0], extend_lens=[5, 3]),
           "EXTEND, prefixes [0, 6]": MLAScenario(ForwardMode.EXTEND, 4, [0, 6], extend_lens=[5, 3]),
           "DECODE": MLAScenario(ForwardMode.DECODE, 4, [7, 9]),
           "TARGET_VERIFY": MLAScenario(ForwardMode.TARGET_VERIFY, 4, [7, 9])}
forms = {name: mla_forward_method(sc.build().fb).name for name, sc in batches.items()}
for name, form in forms.items():
    print(f"{name:24s} -> {form}")

# %% [markdown]
# ## 2. One row, two views
#
# The pool (`MLAKVPool`, SGLang's `MLATokenToKVPool`) holds one buffer per layer, `[slots, 1, 576]`,
# each row `[c_kv (512) | k_rope (64)]` (ML-001). The kernel reads it as two **paged views** of the
# same storage, split at the layer's `v_head_dim` = 512 (ML-003): `c_kv` (the latent: V, and the
# second half of K through `qv`) and `k_rope` (the first half of K). Neither is contiguous:
# both advance 576 elements per slot and `576 * P` per page.

# %%
P = 4
pool2 = MLAKVPool(num_layers=1, num_pages=3, page_size=P, kv_lora_rank=R, qk_rope_head_dim=Dr)
row = pool2.get_key_buffer(0)
k_rope_view, c_kv_view = pool2.paged_views(0, v_head_dim=R)
for name, t in (("row", row), ("c_kv", c_kv_view), ("k_rope", k_rope_view)):
    print(f"{name:7s} shape {str(tuple(t.shape)):17s} strides {str(t.stride()):22s} contiguous "
          f"{t.is_contiguous()!s:5s} starts at element {(t.data_ptr() - row.data_ptr()) // row.element_size()}")
row[7, 0] = torch.arange(D, dtype=row.dtype)  # slot 7 = page 1, offset 3
print("c_kv[1, 3, 0, :3] =", c_kv_view[1, 3, 0, :3].tolist(), " k_rope[1, 3, 0, :3] =",
      k_rope_view[1, 3, 0, :3].tolist(), " (slot 7's row, read in place)")
k1, c1 = pool2.paged_views(0, v_head_dim=R, page_size=1)  # the page-size-1 views (a table of token slots)
print("page size 1: c_kv", tuple(c1.shape), "strides", c1.stride(), "(the page dim keeps the slot stride)")

# %%
fig, ax = plt.subplots(figsize=(9, 3.4))
for s in range(3 * P):
    y = -s
    if s == 0:
        ax.barh(y, D, left=0, color="0.92", hatch="//", edgecolor="0.6", height=0.8)
        ax.text(D / 2, y, "slot 0: the padding slot, never written (ML-002)", ha="center", va="center", fontsize=8)
    else:
        ax.barh(y, R, left=0, color="#4c72b0", height=0.8)
        ax.barh(y, Dr, left=R, color="#dd8452", height=0.8)
    ax.text(-8, y, f"slot {s}", ha="right", va="center", fontsize=8)
for p in range(3):
    if p:
        ax.axhline(-p * P + 0.5, color="k", lw=1.2)
    ax.text(D + 8, -p * P - (P - 1) / 2, f"page {p}", fontsize=8, va="center")
ax.text(R / 2, 1.9, "c_kv = row[..., :512]  ->  v_cache (and qv's keys)", ha="center", fontsize=9, color="#4c72b0")
ax.text(D, 1.0, "k_rope = row[..., 512:]  ->  k_cache", ha="right", fontsize=9, color="#dd8452")
ax.set_xlim(-60, D + 60)
ax.set_ylim(-3 * P + 0.3, 2.6)
ax.set_yticks([])
ax.set_xticks([0, R, D], ["0", f"{R}", f"{D}"])
ax.set_title(f"one buffer per layer [{3 * P}, 1, {D}], P = {P}: both views have strides ({D * P}, {D}, {D}, 1)",
             fontsize=10)
fig.tight_layout()
show(fig)

# %% [markdown]
# FA3 reads paged K and V through their strides (only the last dim must be contiguous), so the
# split costs nothing and the page table indexes the pool in place. It also means code that
# *assumes* contiguity (strides computed from a view's shape) reads slot `s` of `c_kv` at element
# `512 s` instead of `576 s`: the bug zoo's `mla-views-as-contiguous`.
#
# ## 3. The store: `[k_nope | k_rope]` at `out_cache_loc`, never slot 0
#
# `set_mla_kv_buffer` writes token i's row at slot `out_cache_loc[i]` before the kernel reads the
# pool (ML-002). Padded rows of a CUDA-graph replay carry `out_cache_loc = 0` (CG-005); the MLA
# writer skips them (SGLang #36003: v0.5.12.post1's writer did not, and GLM-5.2 + MTP then read NaN
# from slot 0). The MHA pool writes slot 0, which CG-005 allows:

# %%
mla_pool = MLAKVPool(1, 3, 4, kv_lora_rank=8, qk_rope_head_dim=4, fill=7.0)
mla_pool.set_mla_kv_buffer(0, torch.tensor([0, 9, 0]), torch.full((3, 1, 8), 2.0), torch.full((3, 1, 4), 3.0))
print("MLA slot 9:", mla_pool.get_key_buffer(0)[9, 0].tolist())
print("MLA slot 0:", mla_pool.get_key_buffer(0)[0, 0].tolist(), "(kept)")
mha_pool = KVPool(1, 2, 4, 1, 4, fill=7.0)
mha_pool.set_kv_buffer(0, torch.tensor([0]), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
print("MHA slot 0 after a padded row's store:", mha_pool.get_flat_kv(0)[0][0, 0].tolist())

# %% [markdown]
# ## 4. The `qv` call and its scale
#
# The absorbed form is ONE paged FA3 call with the MHA metadata (ML-004, ML-005):
#
# ```python
# flash_attn_with_kvcache(q=q_rope, k_cache=k_rope_view, v_cache=c_kv_view, qv=q_nope_absorbed,
#                         page_table=..., cache_seqlens=..., cu_seqlens_q=..., max_seqlen_q=...,
#                         softmax_scale=layer.scaling, causal=True)        # -> [T, H, 512]
# ```
#
# FA3 computes `S = scale * (q . k + qv . v)`: `qv` carries the 512-wide half of the score, read
# from the same `c_kv` that is the value. The scale is the *non-absorbed* one, `(Dn + Dr)^-0.5`,
# times `mscale^2` under YaRN (`mscale = 0.1 * mscale_all_dim * ln(factor) + 1`), passed
# explicitly: left out, FA3 uses `(D + Dv)^-0.5` of the call's own dims, 576^-0.5 (ML-007).

# %%
mscale = yarn_get_mscale(DEEPSEEK_V3_ROPE_SCALING["factor"], DEEPSEEK_V3_ROPE_SCALING["mscale_all_dim"])
ds_scale = mla_softmax_scale(d, DEEPSEEK_V3_ROPE_SCALING)
print(f"192^-0.5 = {192 ** -0.5:.4f}; mscale = {mscale:.4f}; DeepSeek-V3's scale = {ds_scale:.4f}; "
      f"FA3's default with qv = 576^-0.5 = {576 ** -0.5:.4f}")

# %% [markdown]
# A TARGET_VERIFY batch (3 requests, N = 4 drafts each, P = 16) on a latent pool, built by
# `refspec.harness.mla_scenario.MLAScenario` with DeepSeek's dims and scale. Its FA3 wing goes
# through `FlashAttentionBackend.forward(q, k, v, layer, fb, q_rope=, k_rope=)`, SGLang's
# `RadixAttention` call; we record the kernel call it makes (by wrapping `kernel.attention`, the
# entry point the backend calls):

# %%
built = MLAScenario(ForwardMode.TARGET_VERIFY, 16, [5, 17, 70], num_heads=H, dims=d,
                    rope_scaling=DEEPSEEK_V3_ROPE_SCALING).build()
calls = []
real_attention = kernel.attention
kernel.attention = lambda **kw: calls.append(kw) or real_attention(**kw)
try:
    out_fa3 = built.run_fa3()
finally:
    kernel.attention = real_attention
(call,) = calls
for name in ("q", "k_cache", "v_cache", "qv"):
    print(f"{name:8s} {str(tuple(call[name].shape)):16s} strides {call[name].stride()}")
print("softmax_scale", round(call["softmax_scale"], 4), " causal", call["causal"], " page_table",
      tuple(call["page_table"].shape), " cache_seqlens", call["cache_seqlens"].tolist())

# %% [markdown]
# The output is latent-space, `[T, H, 512]`; the model applies `W_UV` (`bmm(o, w_vc)`) to get
# `[T, H, 128]`, then `o_proj`. What the scale and `qv` are worth: the same call with FA3's default
# scale, and without `qv`, against the oracle.

# %%
ref = built.run_oracle()  # fp32 absorbed MLA over the latent rows, keys by slot
kw = {k: v for k, v in call.items() if k != "provider"}
err_default = float((kernel.flash_attn_with_kvcache(**{**kw, "softmax_scale": None}, provider="emulator")
                     - ref).abs().max())
err_no_qv = float((kernel.flash_attn_with_kvcache(**{**kw, "qv": None}, provider="emulator") - ref).abs().max())
print(f"max error vs the oracle: as called {float((out_fa3 - ref).abs().max()):.1e}; with FA3's default "
      f"scale {err_default:.2f}; without qv {err_no_qv:.2f}")

# %% [markdown]
# ## 5. Both wings, eager and replayed
#
# The MLA oracle and the FA3 wing on the verify batch (T1, TOL-002: in fp32 the budget is the
# fp32 floor, 2e-5), and the same batch through a CUDA graph captured for 4
# requests and replayed with 3 (one padded row, whose store goes to slot 0 and is skipped):

# %%
verdict = t1(out_fa3, ref)
print("FA3 wing vs oracle:", verdict)
built.pool.get_key_buffer(0)[0] = -3.0  # a sentinel in the padding slot
runner = built.graph_runner(capture_bs=(4,))
out_graph = built.run_fa3_graph(runner)
graph_same = t0(out_graph, out_fa3)
slot0_kept = bool((built.pool.get_key_buffer(0)[0] == -3.0).all())
print("graph replay == eager:", graph_same, "; slot 0 still holds the sentinel:", slot0_kept)
print("the model's next step, W_UV (bmm with w_vc):", tuple(out_fa3.shape), "->", tuple(latent_to_v(out_fa3, w_vc).shape))

# %% [markdown]
# `python -m refspec check --sections mla` runs this for every mode (the prefix-free EXTEND as the
# non-absorbed prefill, `flash_attn_varlen_func`, ML-010), P = 1, 4, 16, 64, graphs and top-k 2.
#
# ## 6. Why the GPU build is refused (ML-013)
#
# FA3 has a `qv` kernel only for q / k head dim 64 with V head dim 512 (or 256), compiled unless
# `FLASH_ATTENTION_DISABLE_HDIMDIFF64=TRUE`. The wheel refspec's GPU runs use,
# `tokenspeed-fa3==3.0.0.post20260810`, is built with that flag (and `...HDIMDIFF192`, the MLA
# prefill's 192 / 128 kernel). There a `qv` call passes FA3's host checks and lands in the
# 64 x 64 kernel, which has no `qv` path: on an H100 it returned all NaN, raising nothing (refspec
# issue 40). A silent wrong result is worse than an error, so refspec reads the build's
# configuration (`flash_attn_config.py`, which FA3's `setup.py` writes next to
# `flash_attn_interface`) and refuses MLA on such a build. The real wheel is not importable here;
# a stand-in module with the flags that wheel ships shows the refusal:

# %%
print("here, the 'fa3' provider:", kernel.mla_kernel_problem("fa3", "qv"))
stand_in = types.ModuleType("flash_attn_config")
stand_in.CONFIG = {"build_flags": {"FLASH_ATTENTION_DISABLE_HDIMDIFF64": True,
                                   "FLASH_ATTENTION_DISABLE_HDIMDIFF192": True}}
saved = sys.modules.get("flash_attn_config")
sys.modules["flash_attn_config"] = stand_in
kernel.build_flags.cache_clear()
try:
    FlashAttentionBackend(built.pool, built.kv, provider="fa3")
    refusal = None
except InvariantError as e:
    refusal = e
finally:
    if saved is None:
        sys.modules.pop("flash_attn_config", None)
    else:
        sys.modules["flash_attn_config"] = saved
    kernel.build_flags.cache_clear()
print(refusal)

# %% [markdown]
# The emulator always has the kernel (it is the contract written in PyTorch), which is why the
# CPU runs above are allowed. On a GPU, `tests/test_gpu_mla.py` skips with this reason until an
# FA3 build with the hdim 64 / 512 kernel is importable there (`docs/mla.md`, "The GPU build").
# The bug zoo has the five MLA mistakes of this notebook as named variants, each caught by the
# rule it breaks: `python -m refspec mutants --only mla-split-at-kv-lora-rank,mla-scale-fa3-default,mla-views-as-contiguous,mla-qv-dropped,mla-store-writes-slot-0`.

# %% [markdown]
# ## Exercises
#
# **10a.** Per token and layer, how many values does DeepSeek-V3's MLA pool store, and how many
# would per-head K and V take for its 128 heads (a non-absorbed K head is Dn + Dr wide, a V head
# Dv)? `answer_10a = (mla, mha)`.

# %%
answer_10a = ...

# %% [markdown]
# <details><summary>Solution 10a</summary>
#
# The row `[c | k_pe]`: R + Dr = 512 + 64 = 576. Per-head K and V: 128 x (128 + 64 + 128) =
# 40,960, 71 times more: `(576, 40960)`.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
from refspec.harness import exercises

exercises.check("10a", answer_10a, (512 + 64, 128 * ((128 + 64) + 128)), solution=(576, 40960),
                hint="the row is kv_lora_rank + qk_rope_head_dim; a head's K is qk_nope + qk_rope wide")

# %% [markdown]
# **10b.** A DeepSeek pool with P = 16. Element `[page 2, offset 5, head 0, column 10]` of the
# `c_kv` view, and the same index of the `k_rope` view: which elements of the layer's flat buffer
# `[slots * 576]` are they? `answer_10b = (c_kv_element, k_rope_element)`.

# %%
answer_10b = ...

# %% [markdown]
# <details><summary>Solution 10b</summary>
#
# Strides (576 P, 576, 576, 1) = (9216, 576, 576, 1): `c_kv` starts at element 0, so
# 2 x 9216 + 5 x 576 + 10 = 21322 (slot 37, column 10); `k_rope` starts 512 elements later:
# 21834. `(21322, 21834)`.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
slot_10b = 2 * 16 + 5  # page * P + offset
exercises.check("10b", answer_10b, (slot_10b * 576 + 10, slot_10b * 576 + 512 + 10), solution=(21322, 21834),
                hint="slot = page * P + offset; each slot is 576 elements; k_rope starts at column 512 of the row")

# %% [markdown]
# **10c.** A DeepSeek-style layer with `qk_nope_head_dim` 128, `qk_rope_head_dim` 64 and YaRN
# rope scaling with `factor` 4 and `mscale_all_dim` 1: which `softmax_scale` must the backend
# pass to the kernel (4 decimals)? `answer_10c = ...`

# %%
answer_10c = ...

# %% [markdown]
# <details><summary>Solution 10c</summary>
#
# `mscale = 0.1 x ln 4 + 1 = 1.1386`; scale = 192^-0.5 x 1.1386^2 = 0.07217 x 1.2964 = `0.0936`.
# Not 576^-0.5 (0.0417), FA3's default with `qv`.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
want_10c = round((128 + 64) ** -0.5 * (0.1 * 1 * math.log(4) + 1) ** 2, 4)
exercises.check("10c", answer_10c, want_10c, solution=0.0936,
                hint="(Dn + Dr)^-0.5 times mscale squared, mscale = 0.1 * mscale_all_dim * ln(factor) + 1")

# %% [markdown]
# ## Checks

# %%
assert identity_err < 1e-4                                            # ML-008: both forms, one answer
assert forms == {"EXTEND, prefixes [0, 0]": "MHA_ONE_SHOT", "EXTEND, prefixes [0, 6]": "MLA",
                 "DECODE": "MLA", "TARGET_VERIFY": "MLA"}                     # ML-009
assert tuple(k9.shape) == (9, H, Dn + Dr) and tuple(rows9.shape) == (9, 1, 576)
assert c_kv_view.stride() == k_rope_view.stride() == (576 * P, 576, 576, 1)   # ML-003
assert not c_kv_view.is_contiguous() and c1.stride() == (576, 576, 576, 1)
assert c_kv_view[1, 3, 0, 0] == 0 and k_rope_view[1, 3, 0, 0] == 512          # slot 7 read in place
assert mla_pool.get_key_buffer(0)[0, 0].tolist() == [7.0] * 12                # ML-002: slot 0 kept
assert mha_pool.get_flat_kv(0)[0][0, 0].tolist() == [0.0] * 4                 # the MHA pool writes it
assert call["qv"] is built.q and call["q"] is built.q_rope                     # ML-005
assert call["k_cache"].shape[-1] == 64 and call["v_cache"].shape[-1] == 512
assert abs(call["softmax_scale"] - 0.1352) < 5e-5 and abs(ds_scale - 0.1352) < 5e-5   # ML-007
assert err_default > 1e-2 and err_no_qv > 1e-2                                 # each one matters
assert verdict.ok and graph_same.ok and slot0_kept                             # both wings, graphs
assert isinstance(refusal, InvariantError) and refusal.inv_id == "ML-013"      # ML-013
assert "HDIMDIFF64=TRUE" in str(refusal)
