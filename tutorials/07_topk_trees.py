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
# # 07 · Top-k trees: EAGLE drafts with k branches, one tree verify
#
# With top-k = 1 (tutorial 05) the draft proposes a chain. With `k > 1` every draft step keeps
# the `k` best branches, and the target checks a **tree** of `N` nodes in one forward. The
# rules (docs/spec/tree.md, `TR-` IDs):
#
# 1. **expand** (TR-001): the `k` root children come from the draft extend's softmax top-k;
#    then each of the `k` frontier rows proposes its top-k children, a child scores
#    `parent score x its probability`, and the best `k` of the `k x k` become the new frontier;
# 2. **select** (TR-002): the `N - 1` best of all `k + (Sd-1) k^2` candidates, sorted by
#    candidate id, are the drafts; node 0 is the root (the last verified token);
# 3. **verify** (TR-004, TR-005): node `i` attends to the committed prefix, its ancestors and
#    itself, at RoPE position `L + depth(i)`;
# 4. **accept** (TR-006): from the root, take the child equal to the target's argmax, as deep
#    as it goes; `n` drafts + the bonus are emitted.
#
# Everything here runs on a CPU with a tiny random model (no real weights needed).
# Run time as a script on a shared 2-core CPU machine: 46 s wall, 14 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).

# %%
from refspec.harness.needs import needs

needs("tutorials")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import random

import matplotlib.pyplot as plt
import torch

from refspec.harness.viz import show
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.loop import greedy
from refspec.oracle.slots import attention_over_slots, merge_by_lse
from refspec.oracle.tree import build_tree, expand, greedy_accept, root_children, select, verify_key_slots
from refspec.oracle.tree_loop import speculative_tree_greedy
from refspec.speculative import generate

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Building a tree by hand
#
# `k = 2`, `Sd = 3`, `N = 7`, committed length `L = 5`. The draft extend's last row gives the
# root children 10 (p .6) and 11 (p .3). Step 1: 10 proposes 20 (.5), 21 (.4); 11 proposes
# 22 (.9), 23 (.05). The four children score .30, .24, .27, .015, so the new frontier is
# [20, 22]. Step 2: 20 proposes 30 (.7), 31 (.2); 22 proposes 32 (.6), 33 (.3).

# %%
t = torch.tensor
ROOT, L = 99, 5
cands, front = root_children(t([0.6, 0.3]), t([10, 11]))
front = expand(cands, front, 1, t([[0.5, 0.4], [0.9, 0.05]]), t([[20, 21], [22, 23]]))
print("step-1 frontier: tokens", front.tokens.tolist(), "candidate ids", front.cand, "parent rows", front.parent_row)
front = expand(cands, front, 2, t([[0.7, 0.2], [0.6, 0.3]]), t([[30, 31], [32, 33]]))
print("all candidate scores:", [round(x, 3) for x in cands.scores.tolist()])
selected = select(cands, 7)
tree = build_tree(ROOT, cands, selected, seq_len=L)
print("selected candidate ids (sorted):", selected)
print("tokens   ", tree.tokens)
print("parents  ", tree.parent)
print("positions", tree.positions)
print("retrieve_next_token  ", tree.retrieve_next_token)
print("retrieve_next_sibling", tree.retrieve_next_sibling)


# %%
def draw_tree(ax, tree, path=(), title=""):
    """Nodes by depth (x) and order (y); the accepted path in green."""
    rows = {}
    ypos = []
    for i, d in enumerate(tree.depth):
        ypos.append(-rows.get(d, 0))
        rows[d] = rows.get(d, 0) + 1
    for i, p in enumerate(tree.parent):
        if p >= 0:
            on = i in path and p in path
            ax.plot([tree.depth[p], tree.depth[i]], [ypos[p], ypos[i]], color="tab:green" if on else "0.6",
                    lw=2.5 if on else 1, zorder=1)
    for i, tok in enumerate(tree.tokens):
        color = "tab:green" if i in path else ("0.85" if i else "gold")
        ax.scatter([tree.depth[i]], [ypos[i]], s=900, color=color, edgecolor="k", zorder=2)
        ax.text(tree.depth[i], ypos[i], f"{'root' if i == 0 else tok}\n#{i}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(max(tree.depth) + 1), [f"depth {d}\npos {L + d}" for d in range(max(tree.depth) + 1)])
    ax.set_yticks([])
    ax.set_xlim(-0.5, max(tree.depth) + 0.5)
    ax.set_ylim(min(ypos) - 0.7, 0.7)
    ax.set_title(title)


fig, ax = plt.subplots(figsize=(6, 3))
draw_tree(ax, tree, title="the verify tree (node #i, its token)")
fig.tight_layout()
show(fig)

# %% [markdown]
# ## 2. The ancestor mask
#
# Row `i` of the verify sees the `L` committed keys and, of the tree, only itself and its
# ancestors (TR-004). Siblings (20 and 21) never see each other, which is what makes each
# row's logits the target's prediction after exactly its own path.

# %%
full = torch.cat([torch.ones(7, L, dtype=torch.bool), tree.mask], dim=1)  # [N, L + N]
fig, ax = plt.subplots(figsize=(6, 3))
ax.imshow(full.int() + torch.cat([torch.zeros(7, L), torch.ones(7, 7)], 1) * full.int(), cmap="Blues", vmin=0, vmax=2.5)
ax.axvline(L - 0.5, color="k", lw=1)
ax.set_xticks(range(L + 7), [f"p{j}" for j in range(L)] + [f"#{j}" for j in range(7)], fontsize=7)
ax.set_yticks(range(7), [f"#{i} {'root' if i == 0 else tree.tokens[i]}" for i in range(7)])
ax.set_title("verify mask: prefix (light) | tree part: self + ancestors (dark)")
fig.tight_layout()
show(fig)
print("\n".join("".join(str(int(x)) for x in row) for row in tree.mask.tolist()))

# %% [markdown]
# ## 3. Two-part attention and the LSE merge
#
# FA3 does not apply this mask in one kernel call. It runs **prefix** attention (every row over
# the same `L` committed keys, `causal=False`) and **expand** attention (row `i` over its own
# few tree keys), each returning its output `o` and log-sum-exp `lse`, and merges them:
#
# `o = (e^lse_p o_p + e^lse_e o_e) / (e^lse_p + e^lse_e)`
#
# which is exactly attention over the union of the two key sets. Below: the prefix at slots
# 0..4, the tree nodes at slots 5..11, random q/k/v, both parts with `attention_over_slots`.

# %%
g = torch.Generator().manual_seed(0)
H, Hkv, D = 4, 2, 16
k_pool, v_pool = torch.randn(L + 7, Hkv, D, generator=g), torch.randn(L + 7, Hkv, D, generator=g)
q = torch.randn(7, H, D, generator=g)
prefix_slots, node_slots = list(range(L)), [L + i for i in range(7)]
expand_slots = [[node_slots[j] for j in range(7) if tree.mask[i, j]] for i in range(7)]
o_p, lse_p = attention_over_slots(q, k_pool, v_pool, [prefix_slots] * 7, return_lse=True)
o_e, lse_e = attention_over_slots(q, k_pool, v_pool, expand_slots, return_lse=True)
# the merge written out (per row and head), then the library's version
w_p, w_e = lse_p.T[..., None].exp(), lse_e.T[..., None].exp()
o_merged = (w_p * o_p + w_e * o_e) / (w_p + w_e)
o_lib, lse_lib = merge_by_lse(o_p, lse_p, o_e, lse_e)
o_union, lse_union = attention_over_slots(q, k_pool, v_pool, verify_key_slots(tree, prefix_slots, node_slots),
                                          return_lse=True)
err = float((o_merged - o_union).abs().max())
print(f"max |merge - union| = {err:.2e}; lse: {float((lse_lib - lse_union).abs().max()):.2e}")

fig, axes = plt.subplots(1, 2, figsize=(10, 3))
parts = torch.zeros(7, L + 7)
parts[:, :L] = 1
for i in range(7):
    for s in expand_slots[i]:
        parts[i, s] = 2
axes[0].imshow(parts, cmap="viridis", vmin=0, vmax=2)
axes[0].set_title("keys per row: prefix (teal) + expand (yellow)")
axes[0].set_xlabel("slot")
axes[0].set_ylabel("tree row")
share = (w_e / (w_p + w_e))[..., 0]  # [N, H]: the expand part's weight in the merge
axes[1].bar(range(7), share.mean(1).tolist(), color="goldenrod")
axes[1].set_ylim(0, 1)
axes[1].set_title("expand part's weight in the merge")
axes[1].set_xlabel("tree row")
fig.tight_layout()
show(fig)

# %% [markdown]
# ## 4. Greedy tree acceptance
#
# Suppose the target's argmax is 10 at the root, 21 after `root 10`, and 99 after
# `root 10 21`. The walk takes child 10 (node 1), then among 10's children (20, 21) the one
# equal to 21 (node 4), which has no children: `n = 2` drafts accepted, bonus 99.

# %%
predict = [10, 21, 0, 0, 99, 0, 0]  # target argmax per node (only the walked ones matter)
acc = greedy_accept(tree, predict)
print("path", acc.path, "n =", acc.n, "a =", acc.a, "emitted", acc.emitted)
fig, ax = plt.subplots(figsize=(6, 3))
draw_tree(ax, tree, path=acc.path, title=f"accepted path {acc.path}, bonus {acc.bonus}")
fig.tight_layout()
show(fig)

# %% [markdown]
# The accepted nodes sat at verify slots `L + node` = 5, 6, 9. After acceptance their KV moves to
# `L .. L+a-1` = 5, 6, 7 (TR-007); their depths are 0, 1, 2, so their RoPE positions are already
# right. The draft extend then runs the emitted tokens with the target hidden states of the
# path nodes, and its softmax top-k gives the next round's root children.
#
# **Draft decode and the row history (TR-008).** While drafting, frontier row `t` at step `s`
# attends to the prefix plus the KV *its row* wrote at steps `0..s`. The frontier is re-ranked
# every step (only the hidden state follows the parent), so this is not necessarily the row's
# tree ancestors: below, both step-1 rows descend from row 0 (token 10), but row 1's history
# holds row 1's step-0 token, 11.

# %%
c2, f2 = root_children(t([0.9, 0.1]), t([10, 11]))
f2 = expand(c2, f2, 1, t([[0.6, 0.3], [0.5, 0.5]]), t([[20, 21], [22, 23]]))
for row in range(2):
    print(f"step-1 row {row}: token {int(f2.tokens[row])}, parent row {f2.parent_row[row]} "
          f"(token {[10, 11][f2.parent_row[row]]}); its KV history: step-0 row {row} = token {[10, 11][row]}")

# %% [markdown]
# ## 5. The loop: lossless, and longer accepts with k = 4
#
# `speculative_tree_greedy` runs the whole round per request on a tiny random Llama (2 layers),
# with an early-exit draft (the target's first layer). Every attention row's keys are listed
# explicitly and attended with `attention_over_slots`. The output must equal plain greedy
# decoding bit for bit (TR-009); only the number of target forwards changes.

# %%
target = init_random_(LlamaModel(tiny_config()), seed=0)
draft = make_draft("early-exit:1", target)
rng = random.Random(3)
prompts = [[rng.randrange(128) for _ in range(n)] for n in (5, 8, 11, 6)]
lossless = {}
for k, N in [(2, 6), (4, 8)]:
    for i, p in enumerate(prompts):
        res = speculative_tree_greedy(target, draft, p, num_steps=3, topk=k, num_draft_tokens=N, max_new_tokens=24)
        lossless[(k, i)] = res.tokens == greedy(target, p, 24).tokens
print(lossless)

# %%
runs = {k: generate(target, prompts, backend="oracle", draft="early-exit:1", num_steps=3, topk=k,
                    num_draft_tokens=N, max_new_tokens=24) for k, N in [(1, 4), (2, 6), (4, 8)]}
for k, r in runs.items():
    print(f"topk={k}: accept length {r.accept_length:.3f} over {sum(len(a) for a in r.accepts)} rounds")
fig, axes = plt.subplots(1, 2, figsize=(10, 2.8))
axes[0].bar([f"k={k}\nN={N}" for k, N in [(1, 4), (2, 6), (4, 8)]], [r.accept_length for r in runs.values()],
            color=["0.6", "tab:blue", "tab:green"])
axes[0].set_ylabel("tokens per verify round")
axes[0].set_title("accept length (Sd = 3, early-exit draft)")
for k, r in runs.items():
    all_a = [a for req in r.accepts for a in req]
    axes[1].hist(all_a, bins=[0.5, 1.5, 2.5, 3.5, 4.5], alpha=0.5, label=f"k={k}")
axes[1].set_xlabel("a (tokens committed in a round)")
axes[1].legend()
fig.tight_layout()
show(fig)

# %% [markdown]
# ## 6. The production loop under spec v2
#
# The production wing (`backend="fa3"`: paged KV, the FA3 cascade, CUDA graphs) runs the tree
# round as SGLang's v1 worker did and as its v2 worker (`EAGLEWorkerV2`, the only one from
# v0.5.14 on) does. Drafting, the tree, verify and acceptance are the same; v2 changes the KV
# bookkeeping and the draft extend (docs/spec/tree.md, "The v2 tree round"):
#
# * **TR-020**: before the round each row is topped up to `L + R` positions, `R =
#   max(npp*P*k, N)` (the `k` page-aligned branch regions, or the `N` verify slots); nothing is
#   allocated or freed inside the round, so the rejected branches' slots stay in the row until
#   the request finishes. The accepted path's KV is still moved to the first `a` verify slots.
# * **TR-021**: the draft extend runs `DRAFT_EXTEND_V2` over all `N` verify rows (not the `a`
#   accepted ones), with the target's predictions and hidden states *compacted to the front*
#   (path node `j` in row `j`), and keeps row `a - 1`.
#
# Watch one request's committed length `L` and the positions its row holds after each round:

# %%
held = {}
for v in ("v1", "v2"):
    held[v] = []

    def watch(event, eng, **info):
        if event == "round_end" and eng.running:
            r = min(eng.running, key=lambda r: r.rid)
            held[eng.version].append((r.seq_len, r.alloc_len))

    res = generate(target, prompts[:2], backend="fa3", version=v, page_size=4, topk=4, num_draft_tokens=8,
                   num_steps=3, draft="early-exit:1", max_new_tokens=24, observer=watch, graphs=True,
                   capture_bs=(1, 2))
    lossless[("fa3", v)] = res.tokens == [greedy(target, p, 24).tokens for p in prompts[:2]]
    print(f"{v}: == greedy {lossless[('fa3', v)]}, pages all freed {res.free_pages[0] == res.free_pages[1]}; "
          f"(L, positions held) per round {held[v][:5]} ...")

# %% [markdown]
# v1 frees whole pages past `ceil_4(L + a)` in every round (TR-017), so the row holds its `L` positions;
# v2 holds `L_start + R = L_start + 32` (`npp = ceil((3 + 3) / 4) = 2` pages per branch, 4
# branches, `P = 4`) and returns it all when the request finishes. Tree + the overlap schedule is
# not implemented in refspec (upstream v0.5.23 runs it); `generate(..., overlap=True)` with
# `topk > 1` raises.

# %% [markdown]
# ## Exercises
#
# **7a.** In the tree part of the verify mask, which nodes does row 5 (token 22) see (TR-004)?
# `answer_7a = [...]` (node indices, ascending).

# %%
answer_7a = ...

# %% [markdown]
# <details><summary>Solution 7a</summary>
#
# Itself and its ancestors: node 5's parent is node 2 (token 11), whose parent is the root:
# `[0, 2, 5]`. Not its siblings 3 and 4, nor node 1.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
from refspec.harness import exercises


def ex_ancestors_and_self(parent: list[int], i: int) -> list[int]:
    """The rule from the parent pointers alone (not from tree.mask)."""
    out = [i]
    while parent[out[-1]] >= 0:
        out.append(parent[out[-1]])
    return sorted(out)


exercises.check("7a", answer_7a, ex_ancestors_and_self(tree.parent, 5), solution=[0, 2, 5],
                hint="follow tree.parent from node 5 up to the root")

# %% [markdown]
# **7b.** This time the target's argmax is 11 at the root, 22 after `root 11`, and 7 after
# `root 11 22` (`predict = [11, 0, 22, 0, 0, 7, 0]` per node). Which path is accepted and which
# tokens are emitted? `answer_7b = (path, emitted)`.

# %%
answer_7b = ...

# %% [markdown]
# <details><summary>Solution 7b</summary>
#
# Root's child 11 is node 2; node 2's child 22 is node 5; node 5 has no children, so the bonus is
# the target's 7: `([0, 2, 5], [11, 22, 7])` (TR-006).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
def ex_greedy_walk(tokens: list[int], parent: list[int], predict: list[int]):
    """Greedy tree acceptance written out: follow the child whose token is the target's argmax."""
    path = [0]
    while True:
        kids = [j for j, p in enumerate(parent) if p == path[-1] and tokens[j] == predict[path[-1]]]
        if not kids:
            return path, [tokens[j] for j in path[1:]] + [predict[path[-1]]]
        path.append(kids[0])


exercises.check("7b", answer_7b, ex_greedy_walk(tree.tokens, tree.parent, [11, 0, 22, 0, 0, 7, 0]),
                solution=([0, 2, 5], [11, 22, 7]), hint="walk from the root; the bonus is the last argmax")

# %% [markdown]
# ## Checks

# %%
assert tree.tokens == [ROOT, 10, 11, 20, 21, 22, 30] and tree.parent == [-1, 0, 0, 1, 1, 2, 3]   # TR-003
assert tree.positions == [5, 6, 6, 7, 7, 7, 8]                                                  # TR-005
assert tree.mask.sum(1).tolist() == [1, 2, 2, 3, 3, 3, 4] and not tree.mask[3, 4]              # TR-004
assert err < 1e-5                                                   # prefix + expand merged = the union
assert acc.path == [0, 1, 4] and acc.emitted == [10, 21, 99]                                    # TR-006
assert f2.parent_row == [0, 0]                                                                  # TR-001
assert all(lossless.values())                                                                   # TR-009
assert runs[4].tokens == runs[1].tokens                             # same text whatever k is
assert runs[4].accept_length > runs[1].accept_length                # the tree accepts more per round
assert all(a - L < 4 for L, a in held["v1"])                        # v1 frees rejected pages (TR-017)
assert all(a > L for L, a in held["v2"])                            # v2 keeps its reserve (TR-020)
