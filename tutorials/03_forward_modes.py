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
# # 03 · One batch through every forward mode
#
# One speculative round with top-k = 1 runs several kinds of forward, and each needs different
# attention metadata for the *same* requests. Symbols: `q_b` / `K_b` request `b`'s query rows /
# the keys the kernel reads for it, `L` a request's committed length before the forward (as in
# every tutorial and the shape legend: DECODE's new token is not in it), `s` the
# draft step (0, 1, ...), `Sd` the draft steps per round, `N` the tokens verified per request
# (`N = Sd + 1`), `n` the drafts accepted, `a = n + 1` the tokens committed (the bonus token
# included); v1 / v2 are SGLang's two EAGLE rounds (tutorial 01). IDs such as `MD-008` are
# refspec's rules: `python -m refspec cite MD-008` prints one.
#
# | mode | who | query rows `q_b` | keys `K_b` |
# |---|---|---|---|
# | DECODE | target, no speculation | 1 | `L + 1` (the new token, at position `L`, included) |
# | draft decode, step `s` | draft | 1 | `L + s + 1` |
# | TARGET_VERIFY | target | `N` | `L + N` |
# | DRAFT_EXTEND (v1) | draft | `a = n + 1`, packed | `L + a` |
# | DRAFT_EXTEND_V2 | draft | `N`, uniform | `L + N` |
#
# We push one batch through all of them with `refspec.harness.scenario.Scenario`, print the metadata the
# FA3 path builds, draw it, check it against hand-computed numbers, and check that the FA3 path
# (the emulator on CPU) matches the oracle in every mode.
#
# The batch: page size `P = 4`, `Sd = 3` draft steps, `N = 4`, three requests with committed
# lengths `L = [5, 8, 12]`; the v1 round accepts `n = [1, 3, 0]` drafts, i.e. `a = [2, 4, 1]`.
#
# Run time as a script on a shared 2-core CPU machine: 27 s wall, 10 s of CPU
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
from refspec.core.modes import ForwardMode as M
from refspec.oracle.attention import attention_by_slot
from refspec.harness.scenario import Scenario


P, N, L, A = 4, 4, [5, 8, 12], [2, 4, 1]
modes = {
    "decode": dict(mode=M.DECODE, lens=[x + 1 for x in L]),  # DECODE's lens are seq_lens = L + 1 (the new token)
    "draft decode s=0": dict(mode=M.DECODE, lens=L, draft_step=0),
    "draft decode s=1": dict(mode=M.DECODE, lens=L, draft_step=1),
    "target verify": dict(mode=M.TARGET_VERIFY, lens=L),
    "draft extend v1": dict(mode=M.DRAFT_EXTEND, lens=L, num_accept_tokens=A),
    "draft extend v2": dict(mode=M.DRAFT_EXTEND_V2, lens=L, num_accept_tokens=A),
}
results = {}
for name, kw in modes.items():
    built = Scenario(page_size=P, num_draft_tokens=N, seed=0, **kw).build()
    ref = built.run_oracle()
    out = built.run_fa3()
    results[name] = (built, built.extra["metadata"], ref, out)
    md = built.extra["metadata"]
    print(f"{name:17s} cache_seqlens {str(md.cache_seqlens_int32.tolist()):13s} "
          f"cu_seqlens_q {str(md.cu_seqlens_q.tolist()):15s} max_seqlen_q {md.max_seq_len_q}  "
          f"page_table width {md.page_table.shape[1]}")

# %% [markdown]
# ## The numbers, by hand
#
# Every line below is the formula of its mode evaluated by hand for `L = [5, 8, 12]`, `N = 4`,
# `a = [2, 4, 1]` (invariants MD-003, MD-010, MD-011, MD-009, MD-008):

# %%
expected = {
    "decode":           ([6, 9, 13],   [0, 1, 2, 3]),     # K = L + 1 (the new token included)
    "draft decode s=0": ([6, 9, 13],   [0, 1, 2, 3]),     # K = L + 0 + 1
    "draft decode s=1": ([7, 10, 14],  [0, 1, 2, 3]),     # K = L + 1 + 1
    "target verify":    ([9, 12, 16],  [0, 4, 8, 12]),    # K = L + N, q = N
    "draft extend v1":  ([7, 12, 13],  [0, 2, 6, 7]),     # K = L + a, q = a, packed
    "draft extend v2":  ([9, 12, 16],  [0, 4, 8, 12]),    # K = seq_lens = L + N, q = N
}
for name, (K, cu) in expected.items():
    md = results[name][1]
    assert md.cache_seqlens_int32.tolist() == K, name
    assert md.cu_seqlens_q.tolist() == cu, name
print("metadata matches the hand-computed formulas in every mode")

# %% [markdown]
# ## Pictures
#
# Top strip: the packed query rows, coloured by request according to `cu_seqlens_q`. Below: for
# each request, its query rows (`i`) against its key positions, grouped in pages labelled with the
# page id from the page table. Blue = keys that existed before this forward, orange = keys this
# forward wrote, grey = hidden by the causal rule, hatched = in the last page but past `K_b`
# (never read).

# %%
for name in ["decode", "target verify", "draft decode s=1", "draft extend v1", "draft extend v2"]:
    built, md, _, _ = results[name]
    show(viz.mode_figure(md.cu_seqlens_q, md.cache_seqlens_int32, md.page_table, P, name))

# %% [markdown]
# The page tables themselves: one row per request, one page id per page, only the first
# `ceil(K_b / P)` columns of each row are ever read (PA-007). Decode, draft decode and v1 draft
# extend were built with fewer keys than verify / v2, so their requests got other pages.

# %%
fig, axes = plt.subplots(1, 3, figsize=(9, 1.6))
for ax, name in zip(axes, ["decode", "target verify", "draft extend v1"]):
    md = results[name][1]
    K = md.cache_seqlens_int32.tolist()
    colors = [[viz.req_color(b) + ("66" if j < -(-K[b] // P) else "11") for j in range(md.page_table.shape[1])]
              for b in range(len(K))]
    viz.draw_int_table(ax, md.page_table.tolist(), ["r0", "r1", "r2"], f"{name}: page_table", colors)
fig.tight_layout()
show(fig)

# %% [markdown]
# Things to notice:
#
# * **decode** and **draft decode** have one row per request; draft step `s` sees one more key
#   than step `s - 1` (its own token at `L + s`).
# * **target verify** and **draft extend v2** have the same shape: `N` rows per request and
#   `K = L + N`. The difference is who runs them (target vs draft model) and what `seq_lens`
#   means: committed `L` for verify, post-write `L + N` for v2 draft extend — add `N` to it again
#   and every row reads 4 unwritten positions (the reverted SGLang #26512, MD-008).
# * **draft extend v1** packs only the accepted tokens: request 1 has 4 rows, request 2 one.
#
# ## INV-TAIL: the one check that ties it together
#
# In every mode the tokens of this forward are the *last* `q_b` keys of their request, so the
# slot each row wrote must be the slot of key position `K_b - q_b + i` (MD-005). Check it by hand:

# %%
for name, (built, md, _, _) in results.items():
    fb, cu = built.fb, md.cu_seqlens_q.tolist()
    for b, r in enumerate(fb.req_pool_indices.tolist()):
        K, q = int(md.cache_seqlens_int32[b]), cu[b + 1] - cu[b]
        assert fb.out_cache_loc[cu[b]:cu[b + 1]].tolist() == built.kv.req_to_token[r, K - q:K].tolist(), (name, b)
print("INV-TAIL holds in every mode")

# %% [markdown]
# ## The FA3 path equals the oracle in every mode

# %%
for name, (_, _, ref, out) in results.items():
    v = tolerance.t1(out, ref)
    print(f"{name:17s} FA3 (emulator) vs oracle: {v}")
    assert v.ok, name

# %% [markdown]
# ## v1 and v2 draft extend keep the same row
#
# v1 runs only the `a_b` accepted tokens and keeps each request's last row; v2 runs all `N` rows
# and keeps row `b * N + a_b - 1`. Causality makes them the same computation (SD-006): the kept
# v2 row sees exactly the keys the kept v1 row sees. Take the v2 batch, and run v1 on the *same*
# pool with the first `a_b` rows of each request: the kept rows agree.

# %%
built, md, ref_v2, _ = results["draft extend v2"]
rows = built.fb.req_pool_indices.tolist()
kf, vf = built.pool.get_flat_kv(0)
v1_rows = torch.cat([torch.arange(b * N, b * N + a) for b, a in enumerate(A)])
cu_v1 = [sum(A[:b]) for b in range(len(A) + 1)]  # v1 packs a_b rows per request (MD-009)
out_v1 = attention_by_slot(built.q[v1_rows], kf, vf, built.kv.req_to_token, rows, [x + a for x, a in zip(L, A)], cu_v1)
kept_v1 = out_v1[[c - 1 for c in cu_v1[1:]]]
kept_v2 = ref_v2[[b * N + a - 1 for b, a in enumerate(A)]]
print("kept rows v1:", [c - 1 for c in cu_v1[1:]], " v2:", [b * N + a - 1 for b, a in enumerate(A)])
print("v1 vs v2 kept rows:", tolerance.t1(kept_v1, kept_v2))
assert tolerance.t1(kept_v1, kept_v2).ok

# %% [markdown]
# ## Exercises
#
# The check cells build the batch with refspec and ask the **oracle** (`oracle_metadata`, which
# reads `K` off the positions the batch writes, not off the FA3 rules) for the answer.
#
# **3a.** TARGET_VERIFY, committed lengths `L = [3, 10]`, `N = 4`. What are `cache_seqlens` and
# `cu_seqlens_q`? `answer_3a = (cache_seqlens, cu_seqlens_q)`.

# %%
answer_3a = ...

# %% [markdown]
# <details><summary>Solution 3a</summary>
#
# `K = L + N = [7, 14]`, `N` rows each: `([7, 14], [0, 4, 8])` (MD-011).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
from refspec.harness import exercises
from refspec.oracle.backend import oracle_metadata


def ex_oracle(**kw):
    om = oracle_metadata(Scenario(page_size=4, seed=0, **kw).build().fb)
    return om.cache_seqlens, om.cu_seqlens_q


exercises.check("3a", answer_3a, ex_oracle(mode=M.TARGET_VERIFY, lens=[3, 10]), solution=([7, 14], [0, 4, 8]),
                hint="verify appends N chained tokens to the committed L")

# %% [markdown]
# **3b.** Draft decode step `s = 2` with committed `L = [5, 8]`: `cache_seqlens`?

# %%
answer_3b = ...

# %% [markdown]
# <details><summary>Solution 3b</summary>
#
# Step `s` sees the committed tokens, the root and `s` drafts: `K = L + s + 1 = [8, 11]` (MD-010).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
exercises.check("3b", answer_3b, ex_oracle(mode=M.DECODE, lens=[5, 8], draft_step=2)[0], solution=[8, 11],
                hint="K = L + s + 1")

# %% [markdown]
# **3c.** DRAFT_EXTEND (v1) with `L = [5, 8, 12]` and accepted `a = [3, 1, 2]`: `cu_seqlens_q`?

# %%
answer_3c = ...

# %% [markdown]
# <details><summary>Solution 3c</summary>
#
# v1 packs the `a_b` accepted tokens back to back: `[0, 3, 4, 6]` (MD-009).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
exercises.check("3c", answer_3c, ex_oracle(mode=M.DRAFT_EXTEND, lens=[5, 8, 12], num_accept_tokens=[3, 1, 2])[1],
                solution=[0, 3, 4, 6], hint="packed: [0, cumsum(a)]")

# %% [markdown]
# ## Checks

# %%
assert all(tolerance.t1(out, ref).ok for _, _, ref, out in results.values())
assert results["target verify"][1].max_seq_len_q == N
assert results["draft extend v1"][1].max_seq_len_q == max(A)
assert tolerance.t1(kept_v1, kept_v2).ok
print("all checks passed")
