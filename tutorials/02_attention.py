# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Attention over a paged cache: the oracle and the FA3 contract
#
# refspec has two implementations of the same attention:
#
# * the **oracle** (`refspec.oracle.attention.attention_by_slot`): gathers each request's keys
#   *by slot* through `req_to_token` and applies the causal rule explicitly — it never sees a page
#   table;
# * the **FA3 contract** (`refspec.fa3.kernel.flash_attn_with_kvcache`): the real
#   FlashAttention-3 kernel on a Hopper GPU, or on CPU an emulator that reads keys *through the
#   page table*, in tiles, with an online softmax.
#
# This notebook writes the rule down in a few lines, checks it against the oracle, looks at the
# **bottom-right causal** mask with a KV cache, **GQA**, rows that see nothing, and runs the same
# call through the FA3 contract (and on a GPU, if there is one).
#
# Names: `b` a request, `q_b` its query rows, `K_b` its keys (tokens), `P` the page size, `H` /
# `Hkv` query / KV heads. IDs such as `PA-004` are refspec's rules (`docs/spec/`):
# `python -m refspec cite PA-004` prints one with its level, its upstream source and a test.
#
# Run time as a script on a shared 2-core CPU machine: 18 s wall, 8 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).

# %%
from refspec.harness.needs import needs

needs("tutorials")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import matplotlib.pyplot as plt
import torch

from refspec.core import tolerance

from refspec.harness import viz
from refspec.harness.viz import show
from refspec.fa3 import kernel
from refspec.fa3.kernel import hopper_reason, provider_status
from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode
from refspec.oracle.attention import attention_by_slot
from refspec.harness.scenario import Scenario


# %% [markdown]
# ## A batch to attend over
#
# A target-verify batch (the target model checks `N` tokens per request in one forward:
# the last committed token, called the *root*, and `N - 1` drafts): two requests with committed
# lengths `L = [5, 10]`, each verifying `N = 4` tokens, page size 4. `H = 8` query heads share `Hkv = 2` KV heads, head dim 16, fp32.
# `Scenario` fills the prefix KV with random values, **poisons** everything that must never be read
# (page 0 and unused pages hold NaN, unused slots of used pages hold `1e4`), and stores this
# forward's K/V before attention runs (store-then-attend, PA-009).

# %%
sc = Scenario(ForwardMode.TARGET_VERIFY, page_size=4, lens=[5, 10], num_draft_tokens=4,
              num_heads=8, num_kv_heads=2, head_dim=16)
built = sc.build()
fb = built.fb
print("keys per request K_b:", built.K, " query rows q_b:", built.q_lens)
ref = built.run_oracle()  # also stores this forward's K/V into the pool
print("output", tuple(ref.shape), "finite:", bool(torch.isfinite(ref).all()))

# %% [markdown]
# ## The rule in a few lines
#
# For request `b` with `q_b` query rows and `K_b` keys, row `i` sees key `p` iff
# `p <= i + K_b - q_b` (**bottom-right** alignment, PA-004), and query head `h` reads KV head
# `h // (H / Hkv)` (PA-006). Written as plainly as possible, one request, one head, one row at a
# time:

# %%
def naive(q, k_flat, v_flat, req_to_token, rows, K, q_lens):
    H, Hkv, D = q.shape[1], k_flat.shape[1], q.shape[2]
    out, start = torch.zeros_like(q), 0
    for r, Kb, qb in zip(rows, K, q_lens):
        slots = req_to_token[r, :Kb].long()
        for i in range(qb):
            last = i + Kb - qb                      # the last visible key of row i
            for h in range(H):
                kh = h // (H // Hkv)
                keys, vals = k_flat[slots[: last + 1], kh], v_flat[slots[: last + 1], kh]
                w = torch.softmax(keys @ q[start + i, h] / D ** 0.5, dim=0)
                out[start + i, h] = w @ vals
        start += qb
    return out


k_flat, v_flat = built.pool.get_flat_kv(0)
mine = naive(built.q, k_flat, v_flat, built.kv.req_to_token, fb.req_pool_indices.tolist(), built.K, built.q_lens)
print("naive vs oracle:", tolerance.t1(mine, ref))
assert tolerance.t1(mine, ref).ok

# %% [markdown]
# Note that `naive` gathers *exactly* the visible keys. A masked matmul over all slots would
# still multiply the poisoned values by zero, and `0 * NaN = NaN`.
#
# ## Bottom-right causal with a KV cache
#
# In every forward mode the `q_b` query tokens are the *last* `q_b` keys of their request (they
# were written by this forward). Aligning the causal mask to the bottom-right corner gives each row
# its own position and everything before it. Request 0 below: `K = 9`, `q = 4`; row 0 is the root
# token at position 5 and sees keys 0..5; row 3 sees all 9. A top-left alignment would let row 0
# see only key 0.

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 2.2), width_ratios=[3, 1])
viz.draw_visibility(axes[0], 9, 4, 4, None, "bottom-right: row i sees p <= i + K - q")
viz.draw_visibility(axes[1], 2, 4, 4, None, "K = 2 < q = 4")
fig.tight_layout()
show(fig)

# %% [markdown]
# ### The horizon probe
#
# A way to *measure* how many keys each row saw, with no reference at all: set every query to 0
# (so the softmax is uniform over the visible keys) and every value to its key's position. Row
# `i` then outputs the mean of the positions it saw: `(K - q + i) / 2`.

# %%
probe_v = torch.zeros_like(v_flat)
for r, Kb in zip(fb.req_pool_indices.tolist(), built.K):
    slots = built.kv.req_to_token[r, :Kb].long()
    probe_v[slots] = torch.arange(Kb, dtype=probe_v.dtype)[:, None, None]
cu = [0, 4, 8]
probe = attention_by_slot(torch.zeros_like(built.q), k_flat, probe_v, built.kv.req_to_token,
                          fb.req_pool_indices.tolist(), built.K, cu)
horizon = probe[:, 0, 0]
expected = torch.tensor([(K - 4 + i) / 2 for K in built.K for i in range(4)])
print("row outputs :", horizon.tolist())
print("(K - q + i)/2:", expected.tolist())
assert torch.allclose(horizon, expected)

# %% [markdown]
# ### A row that sees nothing outputs 0
#
# If `K < q`, the first `q - K` rows have no visible key. FA3 returns exactly 0 for them (measured
# on the H200); a naive softmax over an empty set gives NaN. The oracle pins the kernel's
# behaviour (PA-005), and refspec's checks refuse `K < q` on real rows anyway (MD-004).

# %%
empty = attention_by_slot(built.q[:4], k_flat, v_flat, built.kv.req_to_token, [fb.req_pool_indices[0].item()],
                          [2], [0, 4])
print("rows with any nonzero output:", [i for i in range(4) if bool(empty[i].abs().sum() > 0)])
assert torch.equal(empty[:2], torch.zeros_like(empty[:2]))

# %% [markdown]
# ## GQA: which KV head a query head reads
#
# With `H = 8` and `Hkv = 2`, heads 0–3 share KV head 0 and heads 4–7 share KV head 1. Put value
# 0 in KV head 0 and value 1 in KV head 1; with uniform attention each query head reports its KV
# head.

# %%
gqa_v = torch.zeros_like(v_flat)
gqa_v[:, 1] = 1.0
out = attention_by_slot(torch.zeros_like(built.q), k_flat, gqa_v, built.kv.req_to_token,
                        fb.req_pool_indices.tolist(), built.K, cu)
kv_head_seen = out[0, :, 0].tolist()
print("KV head read by query heads 0..7:", kv_head_seen)
assert kv_head_seen == [0.0] * 4 + [1.0] * 4

# %% [markdown]
# ## The FA3 contract and the emulator
#
# The production path gives the kernel four metadata tensors (see tutorial 03 for every mode):
# `cache_seqlens` (K per request), `cu_seqlens_q` (row offsets), `page_table` (page ids) and the
# Python int `max_seqlen_q`. The emulator dereferences keys **through the page table**, in tiles,
# with an online softmax — a computation that shares nothing with the oracle but the rule.

# %%
print("providers:", provider_status())
out_fa3 = built.run_fa3(provider="emulator")
md = built.extra["metadata"]
print("cache_seqlens", md.cache_seqlens_int32.tolist(), " cu_seqlens_q", md.cu_seqlens_q.tolist(),
      " max_seqlen_q", md.max_seq_len_q)
print("page_table", md.page_table.tolist())
print("emulator vs oracle:", tolerance.t1(out_fa3, ref))
assert tolerance.t1(out_fa3, ref).ok

# %% [markdown]
# ### What the kernel never reads
#
# Page-table columns at or past `ceil(K_b / P)` are never dereferenced (PA-007; on the H200
# filling them with `2e9` changed nothing and did not fault). The emulator behaves the same: put a
# page id far outside the pool there and nothing changes.

# %%
k_cache, v_cache = built.pool.get_kv_buffer(0)


def call(page_table=md.page_table, cu_q=md.cu_seqlens_q, max_q=md.max_seq_len_q):
    return kernel.flash_attn_with_kvcache(built.q, k_cache, v_cache, cache_seqlens=md.cache_seqlens_int32,
                                          page_table=page_table, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                                          provider="emulator")


slack = md.page_table.clone()
for b, Kb in enumerate(built.K):
    slack[b, -(-Kb // 4):] = 10**6
print("slack columns poisoned:", slack.tolist())
assert torch.equal(call(page_table=slack), call())

# %% [markdown]
# ### What the emulator refuses
#
# The real kernel checks almost nothing: a too-small `max_seqlen_q`, a narrow page table or an
# int64 offset tensor is undefined behaviour there. The emulator raises an `InvariantError` that
# names the rule instead.

# %%
refusals = {}
for what, kwargs in {"max_seqlen_q = 1": dict(max_q=1),
                     "page table with 1 column": dict(page_table=md.page_table[:, :1].contiguous()),
                     "int64 cu_seqlens_q": dict(cu_q=md.cu_seqlens_q.long())}.items():
    try:
        call(**kwargs)
    except InvariantError as e:
        refusals[what] = e.inv_id
        print(f"{what:26s} -> {e}")
assert refusals == {"max_seqlen_q = 1": "PA-010", "page table with 1 column": "PA-003",
                    "int64 cu_seqlens_q": "PA-011"}

# %% [markdown]
# ## The same call on a GPU
#
# With a Hopper GPU and FA3 installed (`pip install -e ".[fa3]"`), the cell below runs the same
# batch in bf16 through the real kernel and checks it against the fp32 oracle with tolerance tier
# T1 (TOL-002: at most twice the oracle's own bf16 error plus a floor). Anywhere else it says why
# it skipped.

# %%
gpu_reason = "no CUDA device" if not torch.cuda.is_available() else hopper_reason()
if gpu_reason is None and isinstance(kernel._real_kernel("fa3"), str):
    gpu_reason = kernel._real_kernel("fa3")
if gpu_reason:
    print("GPU cell skipped:", gpu_reason)
else:
    gsc = Scenario(ForwardMode.TARGET_VERIFY, page_size=4, lens=[5, 10], num_draft_tokens=4,
                   num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda")
    g = gsc.build()
    ref32, ref_low = g.run_oracle(), g.run_oracle(upcast=False)
    print("real FA3 vs fp32 oracle:", tolerance.assert_t1(g.run_fa3(provider="fa3"), ref32, ref_low, "verify"))

# %% [markdown]
# ## Exercises
#
# **2a.** A request has `K = 9` keys and `q = 4` query rows. Which key positions does row
# `i = 1` see (bottom-right causal, PA-004)? `answer_2a = [...]`.

# %%
answer_2a = ...  # a list of key positions

# %% [markdown]
# <details><summary>Solution 2a</summary>
#
# Row `i` sees `p <= i + K - q = 1 + 9 - 4 = 6`: `[0, 1, 2, 3, 4, 5, 6]`.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
import torch

from refspec.harness import exercises
from refspec.oracle.attention import attention_by_slot


def ex_visible_keys(K: int, q: int, row: int) -> list[int]:
    """Measured on the oracle: zero queries (uniform softmax), value of key p = one-hot(p)."""
    r2t = torch.zeros(2, 16, dtype=torch.int32)
    r2t[1, :K] = torch.arange(K, dtype=torch.int32)  # slot = position
    k = torch.randn(16, 1, 16)
    v = torch.eye(16)[:, None, :]  # [slots, Hkv = 1, D = 16]
    out = attention_by_slot(torch.zeros(q, 1, 16), k, v, r2t, [1], [K], [0, q])
    return [p for p in range(16) if out[row, 0, p] > 0]


exercises.check("2a", answer_2a, ex_visible_keys(9, 4, 1), solution=[0, 1, 2, 3, 4, 5, 6],
                hint="row i sees keys p <= i + K - q")

# %% [markdown]
# **2b.** GQA with `H = 8` query heads and `Hkv = 2` KV heads: which KV head does query head
# `h = 5` read (PA-006)?

# %%
answer_2b = ...  # an int

# %% [markdown]
# <details><summary>Solution 2b</summary>
#
# `h // (H / Hkv) = 5 // 4 = 1`: heads 0..3 share KV head 0, heads 4..7 KV head 1.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
def ex_kv_head_of(h: int, H: int = 8, Hkv: int = 2) -> int:
    """Measured on the oracle: the value of KV head j is the constant j."""
    r2t = torch.zeros(2, 4, dtype=torch.int32)
    r2t[1, :1] = 0
    v = torch.arange(Hkv, dtype=torch.float32)[None, :, None].expand(4, Hkv, 8).contiguous()
    out = attention_by_slot(torch.randn(1, H, 8), torch.randn(4, Hkv, 8), v, r2t, [1], [1], [0, 1])
    return int(out[0, h, 0].round())


exercises.check("2b", answer_2b, ex_kv_head_of(5), solution=1, hint="H / Hkv query heads share one KV head")

# %% [markdown]
# ## Checks

# %%
assert tolerance.t1(mine, ref).ok and tolerance.t1(out_fa3, ref).ok   # three implementations agree
assert torch.allclose(horizon, expected)                              # bottom-right horizon
assert torch.equal(empty[:2], torch.zeros_like(empty[:2]))            # empty rows are 0
assert kv_head_seen == [0.0] * 4 + [1.0] * 4                          # GQA grouping
assert set(refusals.values()) == {"PA-010", "PA-003", "PA-011"}
print("all checks passed")
