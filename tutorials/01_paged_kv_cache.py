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
# # 01 · The paged KV cache
#
# A serving engine keeps every request's keys and values in one big **pool**, cut into **pages**
# of `P` slots. This notebook builds one with refspec and looks at the three units that every
# attention bug in this area mixes up:
#
# * **tokens** (positions inside a request: 0, 1, 2, ...),
# * **slots** (flat indices into the pool),
# * **pages** (`slot // P`).
#
# `req_to_token[r, p]` maps position `p` of the request in row `r` to its slot. The FA3 kernel
# does not take `req_to_token`; it takes a **page table** with one page id per page. We will build
# that table, see why it is only correct because rows are *page-contiguous*, and why one row per
# request is enough only at top-k = 1 (one draft candidate per position; top-k > 1 drafts a tree
# and is lesson 07's subject). Runs on a CPU.
# Run time as a script on a shared 2-core CPU machine: 21 s wall, 8 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).
#
# **Names used below** (SGLang's field names; units in brackets):
#
# | name | meaning |
# |---|---|
# | `P` | page size [slots per page] |
# | `b`, `r` | a request's index in the batch, and its row of `req_to_token` (`r = req_pool_indices[b]`) |
# | `K_b` | request `b`'s KV length, the keys the kernel reads (`cache_seqlens[b]`) [tokens] |
# | draft, verify | one round of speculative decoding: a small model *drafts* tokens, the target model *verifies* them in one forward (lesson 05) |
# | top-k | draft candidates kept per step: 1 gives a chain, more give a tree (lesson 07) |
# | `n`, `L'` | drafts the verify accepted, and the committed length after the round [tokens] |
# | v1, v2 | SGLang's two EAGLE rounds: v1 frees the rejected drafts' slots right after verify (`free_tail` below); v2 reserves the round's slots up front (lesson 05) |
# | `alloc_len`, `keep_len` | slots reserved for a request, and positions it keeps [tokens] |
#
# IDs such as `PA-001` name refspec's rules (`docs/spec/`); `python -m refspec cite PA-001` prints
# one with its level, its upstream source and a test that shows it.

# %%
from refspec.harness.needs import needs

needs("tutorials")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import matplotlib.pyplot as plt
import torch

from refspec.harness import viz
from refspec.harness.viz import show
from refspec.fa3.metadata import strided_page_table
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache


# %% [markdown]
# ## A pool, three requests
#
# Page size `P = 4`, 14 pages. Page 0 is a reserved dummy (padded CUDA-graph rows write there,
# invariant PA-008), so 13 pages can be handed out. `seed=0` shuffles the free list, so requests
# get scattered physical pages, as in a server that has been running for a while.

# %%
P, NUM_PAGES = 4, 14
kv = KVCache(max_reqs=8, max_context=32, num_pages=NUM_PAGES, page_size=P, seed=0)
print("free pages at start:", kv.allocator.num_free_pages)

lens = [5, 8, 12]                       # committed tokens per request
rows = [kv.alloc_req() for _ in lens]   # req_to_token rows (never row 0)
out_cache_loc = kv.alloc_extend(rows, [0, 0, 0], lens)
print("req_to_token rows:", rows)
for b, (r, n) in enumerate(zip(rows, lens)):
    slots = kv.req_to_token[r, :n].tolist()
    print(f"request {b}: slots {slots}")
    print(f"           pages {[s // P for s in slots]}  offsets {[s % P for s in slots]}")
print("free pages now:", kv.allocator.num_free_pages)

# %% [markdown]
# Each request got `ceil(len / P)` pages: 2, 2 and 3. Inside a page the offsets run
# 0, 1, 2, 3 in position order; across pages the page ids jump around. That shape — *in order
# inside each page, anywhere across pages* — is **INV-PAGE** (invariant PA-001):
#
# `req_to_token[r, p] % P == p % P` and the slot minus its offset is the slot of the page's
# first position.

# %%
for r, n in zip(rows, lens):
    kv.check_page_contiguous(r, n)  # raises InvariantError [PA-001] if not
fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), width_ratios=[1, 2.2])
viz.draw_pool(axes[0], kv.req_to_token, rows, lens, NUM_PAGES, P, "pool: pages x slots (r<b>:<position>)")
vals = [kv.req_to_token[r, :n].tolist() for r, n in zip(rows, lens)]
viz.draw_int_table(axes[1], vals, [f"request {b}" for b in range(3)], "req_to_token: position -> slot",
                   [[viz.req_color(b) + "55"] * len(v) for b, v in enumerate(vals)])
fig.tight_layout()
show(fig)

# %% [markdown]
# ## The strided page table
#
# Because each page is filled in order, a page is fully described by its first slot. The page
# table keeps every `P`-th column of the row and divides by `P` (SGLang's "strided format",
# invariant MD-007):
#
# `page_table[b, j] = req_to_token[r_b, j * P] // P`
#
# and the kernel recovers the slot of position `p` as `page_table[b, p // P] * P + p % P`
# (invariant PA-002). Let us build it by hand and with refspec's function, and check the
# identity for every position.

# %%
max_len = max(lens)
by_hand = torch.stack([kv.req_to_token[r, 0:max_len:P] // P for r in rows])
page_table = strided_page_table(kv.req_to_token, torch.tensor(rows), max_len, P)
print(page_table)
assert torch.equal(by_hand, page_table)

for b, (r, n) in enumerate(zip(rows, lens)):
    p = torch.arange(n)
    via_table = page_table[b, p // P] * P + p % P
    assert torch.equal(via_table, kv.req_to_token[r, :n]), b
print("page_table[b, p // P] * P + p % P == req_to_token[r_b, p] for every position: OK")

# %% [markdown]
# Entries past a request's last page are zeros here (request 0 has 2 pages, the table has 3
# columns). The kernel never reads a column `>= ceil(K_b / P)` (PA-007), so whatever sits there
# is harmless — CUDA-graph replay even leaves stale values there on purpose.
#
# A classic bug (SGLang's draft-decode and verify replay before `188f0955f`, PR #5318) copied
# the *token-level* row into the page table. With `P = 1` the two tables are identical, so tests at
# page size 1 pass; with `P = 4` the kernel reads slot ids as page ids:

# %%
seed_bug_table = kv.req_to_token[rows[0], :lens[0]]  # slots where page ids belong
p = 4
wrong_slot = int(seed_bug_table[p // P]) * P + p % P
right_slot = int(kv.req_to_token[rows[0], p])
print(f"position {p} of request 0: the right slot is {right_slot}, the seed bug reads slot {wrong_slot}")
owned = {int(s) // P for s in kv.req_to_token[rows[0], :lens[0]]}
print(f"slot {wrong_slot} lies in page {wrong_slot // P}; request 0 owns pages {sorted(owned)}")

# %% [markdown]
# ## Growing a request keeps it page-contiguous
#
# Verify writes `N = 4` more tokens for request 0 (positions 5..8). The allocator continues the
# last partial page — positions 5..7 go into the free slots of request 0's second page — and
# takes a new page only when position 8 crosses a page boundary (invariant KV-001).

# %%
free_before = kv.allocator.num_free_pages
new_slots = kv.alloc_extend([rows[0]], [5], [9])
print("new slots:", new_slots.tolist(), "pages:", (new_slots // P).tolist())
print("pages taken:", free_before - kv.allocator.num_free_pages)
kv.check_page_contiguous(rows[0], 9)
last_page_before = int(kv.req_to_token[rows[0], 4]) // P
assert [int(s) // P for s in new_slots[:3]] == [last_page_before] * 3
assert free_before - kv.allocator.num_free_pages == 1

# %% [markdown]
# ## Why one row per request needs top-k = 1
#
# With top-k = 1 every position has exactly one slot, so one `req_to_token` row describes the
# request. With top-k = 2 the draft tree has two candidates for position 5, two for position 6,
# ...: each branch needs its *own* slots for the *same* positions. Put branch B's slots into the
# row and it is no longer page-contiguous — and the strided page table, which only remembers the
# first slot of each page, silently points at the wrong slots.
#
# Here branch B gets a page of its own starting at offset 0, while position 5 sits at offset 1.

# %%
branch_b_page = kv.allocator.alloc_pages(1)[0]
mixed = kv.req_to_token[rows[0]].clone()
mixed[5:8] = torch.arange(branch_b_page * P, branch_b_page * P + 3, dtype=torch.int32)
kv.req_to_token[7] = mixed  # a scratch row
try:
    kv.check_page_contiguous(7, 9)
    raised = None
except InvariantError as e:
    raised = e
print(raised)
pt = strided_page_table(kv.req_to_token, torch.tensor([7]), 9, P)[0]
p = 6
print(f"position {p}: row says slot {int(mixed[p])}, the page table reads slot {int(pt[p // P]) * P + p % P}")
kv.req_to_token[7] = 0
kv.allocator.free_pages([branch_b_page])

# %% [markdown]
# So a tree cannot share one row. SGLang's FA3 backend runs top-k > 1 with `P > 1` by giving
# every branch page-aligned slots of its own and copying the shared partial tail page into them
# ([#7725](https://github.com/sgl-project/sglang/pull/7725)); at v0.5.23 `_handle_eagle_family`
# allows top-k > 1 with `P > 1` only on `flashinfer`, `fa3` and `triton`
# ([`speculative_hook.py:1271`](https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/arg_groups/speculative_hook.py#L1271)). Each branch's
# table is then page-contiguous again: refspec checks that layout as TR-015 and runs trees in
# lesson 07 (`tutorials/07_topk_trees.py`).
#
# ## Freeing: whole pages only
#
# Freeing is page-granular (KV-002): you cannot give back one slot of a page. After a v1 verify
# that accepted `n = 1` of 3 drafts, request 0 commits `L' = 5 + 2 = 7` positions; positions 7 and
# 8 were rejected. Position 7 shares a page with committed position 6, so that page stays;
# only the page of position 8 is freed (KV-004, SGLang's `align_evict_mask_to_page_size`).

# %%
free_before = kv.allocator.num_free_pages
kv.free_tail(rows[0], keep_len=7, alloc_len=9)
print("pages freed:", kv.allocator.num_free_pages - free_before)
assert kv.allocator.num_free_pages - free_before == 1

for r, n in zip(rows, [7, 8, 12]):
    kv.free_req(r, n)
print("free pages after every request finished:", kv.allocator.num_free_pages)

# %% [markdown]
# ## Exercises
#
# **1a.** A request's `req_to_token` row is `[8, 9, 10, 11, 44, 45, 46, 47, 40]` (`P = 4`,
# `K = 9` positions). What is its page-table row (the strided rule, `ceil(K / P)` entries)?

# %%
answer_1a = ...  # a list of page ids

# %% [markdown]
# <details><summary>Solution 1a</summary>
#
# One entry per page: the slot of the page's first position, divided by `P` (MD-007):
# `[8 // 4, 44 // 4, 40 // 4] = [2, 11, 10]`.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
from refspec.harness import exercises

ex_row, ex_P = [8, 9, 10, 11, 44, 45, 46, 47, 40], 4
# the rule read off the row: the page holding each page-start position
expected_1a = [ex_row[j] // ex_P for j in range(0, len(ex_row), ex_P)]
exercises.check("1a", answer_1a, expected_1a, solution=[2, 11, 10],
                hint="take every P-th slot of the row, then // P")

# %% [markdown]
# **1b.** Through that page table, which slot does the kernel read for position `p = 6`
# (`page_table[p // P] * P + p % P`)? Check it against the row.

# %%
answer_1b = ...  # a slot id

# %% [markdown]
# <details><summary>Solution 1b</summary>
#
# `page_table[1] * 4 + 2 = 11 * 4 + 2 = 46`, which is `req_to_token[r, 6]`: the page table is
# right because the row is page-contiguous (PA-001, PA-002).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
# the oracle reads keys by slot: position p of the request lives in req_to_token[r, p]
exercises.check("1b", answer_1b, ex_row[6], solution=46, hint="page 1 of the table holds positions 4..7")

# %% [markdown]
# **1c.** A v1 round leaves a request with `alloc_len = 12` slots reserved and `keep_len = 7`
# committed (`P = 4`). How many pages does `free_tail` give back (KV-002, KV-004)?

# %%
answer_1c = ...  # an int

# %% [markdown]
# <details><summary>Solution 1c</summary>
#
# Positions 0..6 use pages of positions 0..3 and 4..7; positions 8..11 fill a third page that
# no committed position needs, so **1** page is freed; position 7 stays (its page holds
# position 6).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
# pages are freed whole: count the pages used by positions < alloc_len but by none < keep_len
ex_pages = lambda n: {p // 4 for p in range(n)}  # page index (within the request) of each position
exercises.check("1c", answer_1c, len(ex_pages(12) - ex_pages(7)), solution=1,
                hint="a page is freed only when no committed position is on it")

# %% [markdown]
# ## Checks

# %%
assert kv.allocator.num_free_pages == NUM_PAGES - 1          # KV-006: back to the start
assert not kv.allocator.is_in_use(0)                          # page 0 never handed out (PA-008)
assert 0 not in rows                                          # row 0 never handed out (PA-008)
assert raised is not None and raised.inv_id == "PA-001"       # a mixed-branch row is caught
assert wrong_slot // P not in owned                           # the seed bug reads a page request 0 does not own
print("all checks passed")
