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
# # 09 · Check metadata dumped from an SGLang run
#
# When a serving run produces wrong tokens, the first question is whether the attention
# metadata of the bad forward was right. SGLang's FA3 backend builds it in
# `FlashAttentionBackend.init_forward_metadata` (or `init_forward_metadata_replay_cuda_graph`
# under a CUDA graph): a `FlashAttentionMetadata` (`cache_seqlens_int32`, `cu_seqlens_q`,
# `cu_seqlens_k`, `max_seq_len_q`, `max_seq_len_k`, `page_table`) from the `ForwardBatch`
# (`req_pool_indices`, `seq_lens`, `seq_lens_cpu`, `out_cache_loc`, `positions`,
# `extend_seq_lens`) and the `req_to_token` rows of the batch's requests.
#
# Dump those fields as JSON from the run, and refspec checks them against every rule of the
# FA3 contract (`refspec.harness.dump.check`, which runs the validators of
# `refspec/fa3/validate.py`). This notebook:
#
# 1. reads a small committed dump, `tutorials/data/fa3_dump_draft_extend_v2.json` (a
#    DRAFT_EXTEND_V2 forward of 3 requests, P = 4; see its `note`: it was written by
#    `refspec.harness.dump.from_built` from the docs' running example, in the shape of the
#    SGLang fields, not captured from an SGLang process), and shows that it passes;
# 2. corrupts it the way two real upstream bugs did, and reads the `InvariantError`s;
# 3. shows the lines to paste into SGLang to dump a forward of your own.
#
# CPU only.
# Run time as a script on a shared 2-core CPU machine: 17 s wall, 6 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).

# %%
from refspec.harness.needs import needs

needs()  # the set-up check: stops here, with the command to run, if something is missing


# %%
import copy
import json
from pathlib import Path

import torch

from refspec.core.invariants import INVARIANTS, InvariantError
from refspec.harness import dump, exercises
from refspec.oracle.attention import attention_by_slot

HERE = Path("data") if Path("data").is_dir() else Path("tutorials/data")  # run from tutorials/ or the repo root
DUMP = HERE / "fa3_dump_draft_extend_v2.json"
raw = json.loads(DUMP.read_text())
print(raw["note"])
for part in ("forward_batch", "metadata"):
    print(f"\n{part}:")
    for k, v in raw[part].items():
        print(f"  {k:20s} {v}")
print("\nreq_to_token rows:", {r: len(s) for r, s in raw["req_to_token"].items()}, "(entries per row)")

# %% [markdown]
# ## 1. The clean dump passes
#
# `dump.load` turns the JSON into refspec's `ForwardBatch`, `FlashAttentionMetadata` and a
# `req_to_token` tensor (rows not in the dump are zero); `dump.check` raises the violated rule's
# `InvariantError`, or returns `None`.

# %%
d = dump.load(DUMP)
dump.check(d)
print("clean dump: every rule holds")
print("K = cache_seqlens =", d.md.cache_seqlens_int32.tolist(), " seq_lens =", d.fb.seq_lens.tolist())

# %% [markdown]
# ## 2. Corrupted the way SGLang #26512 did: `cache_seqlens = seq_lens + extend_seq_lens`
#
# In DRAFT_EXTEND_V2, `seq_lens` already counts this forward's `N` tokens (post-write), so
# `K_b = seq_lens` (MD-008). SGLang #26512 (`e5f5d8478`, reverted by #26628) added
# `extend_seq_lens` on top. Applied consistently (`cu_seqlens_k`, `max_seq_len_k` and the page
# table follow `K`, as they do upstream), the dump still *looks* fine; the check names the rule.

# %%
def double_count_k(raw: dict) -> dict:
    bad = copy.deepcopy(raw)
    P, md, fb = bad["page_size"], bad["metadata"], bad["forward_batch"]
    K = [k + e for k, e in zip(md["cache_seqlens_int32"], fb["extend_seq_lens"])]
    md["cache_seqlens_int32"] = K
    md["cu_seqlens_k"] = [0] + torch.tensor(K).cumsum(0).tolist()
    md["max_seq_len_k"] = max(K)
    width = -(-max(K) // P)
    md["page_table"] = [(bad["req_to_token"][str(r)][::P] + [0] * width)[:width] for r in fb["req_pool_indices"]]
    md["page_table"] = [[s // P for s in row] for row in md["page_table"]]
    return bad


bad_k = double_count_k(raw)
print("corrupted K =", bad_k["metadata"]["cache_seqlens_int32"])
try:
    dump.check(bad_k)
    err_k = None
except InvariantError as e:
    err_k = e
print(err_k)

# %% [markdown]
# MD-005 is INV-TAIL: the `q_b` query tokens of request `b` are the *last* `q_b` keys, so
# `out_cache_loc[cu_seqlens_q[b] + i] == req_to_token[r_b, K_b - q_b + i]`. With `K` four too
# big, the kernel would treat positions `L + N .. L + 2N - 1` (never written: stale KV, or the
# dummy page 0) as this forward's tokens. What it would compute instead of the right answer, on
# the oracle (keys gathered by slot through `req_to_token`, refspec/oracle/attention.py):

# %%
def oracle_out(d: dump.Dump, K: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, T = 4, 2, 16, d.fb.num_tokens
    slots = int(d.req_to_token.max()) + 1
    k_flat, v_flat = torch.randn(slots, Hkv, D, generator=g), torch.randn(slots, Hkv, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    r2t = torch.nn.functional.pad(d.req_to_token, (0, 8))  # unassigned entries read 0, as upstream
    return attention_by_slot(q, k_flat, v_flat, r2t, d.fb.req_pool_indices.tolist(), K.tolist(),
                             d.md.cu_seqlens_q.tolist())


right = oracle_out(d, d.md.cache_seqlens_int32)
wrong = oracle_out(d, torch.tensor(bad_k["metadata"]["cache_seqlens_int32"], dtype=torch.int32))
print("max |wrong - right| over the 12 query rows:", float((wrong - right).abs().max()))

# %% [markdown]
# ## 3. Corrupted the way the seed bug did: slots in the page table (SGLang #5090)
#
# SGLang's first speculative FA3 path (`93470a141`, #5090, fixed by #5318 `188f0955f`) copied
# `req_to_token[r_b, :max_k]` (slots) into the page table in two graph replays, instead of
# `req_to_token[r_b, 0:max_k:P] // P` (pages). Tutorial 06 shows it on the real model.

# %%
def slots_in_page_table(raw: dict) -> dict:
    bad = copy.deepcopy(raw)
    P, md = bad["page_size"], bad["metadata"]
    width = len(md["page_table"][0])
    md["page_table"] = [(bad["req_to_token"][str(r)][::P] + [0] * width)[:width]
                        for r in bad["forward_batch"]["req_pool_indices"]]
    return bad


bad_pt = slots_in_page_table(raw)
print("corrupted page_table =", bad_pt["metadata"]["page_table"])
try:
    dump.check(bad_pt)
    err_pt = None
except InvariantError as e:
    err_pt = e
print(err_pt)

# %% [markdown]
# ## 4. Dump a forward of your own from SGLang
#
# Paste this at the end of `FlashAttentionBackend.init_forward_metadata` in
# `python/sglang/srt/layers/attention/flashattention_backend.py` (for a graph replay, at the
# end of `init_forward_metadata_replay_cuda_graph`, with the replay's batch fields), run the
# failing request, then `refspec.harness.dump.check("/tmp/fa3_dump_0.json")`:
#
# ```python
# import json, os
# md, fb = self.forward_metadata, forward_batch
# rows = fb.req_pool_indices.tolist()
# K = md.cache_seqlens_int32.tolist()
# r2t = fb.req_to_token_pool.req_to_token
# tl = lambda t: None if t is None else t.tolist()
# dump = {
#     "forward_mode": fb.forward_mode.name, "page_size": self.page_size,
#     "num_draft_tokens": getattr(fb.spec_info, "draft_token_num", None),
#     "draft_step": self.speculative_step_id if fb.forward_mode.is_decode() and fb.spec_info else None,
#     "forward_batch": {"req_pool_indices": rows, "seq_lens": tl(fb.seq_lens),
#                       "seq_lens_cpu": tl(fb.seq_lens_cpu), "out_cache_loc": tl(fb.out_cache_loc),
#                       "positions": tl(fb.positions), "extend_seq_lens": tl(fb.extend_seq_lens)},
#     "req_to_token": {str(r): r2t[r, :k].tolist() for r, k in zip(rows, K)},
#     "metadata": {"cache_seqlens_int32": K, "cu_seqlens_q": tl(md.cu_seqlens_q),
#                  "cu_seqlens_k": tl(md.cu_seqlens_k), "max_seq_len_q": md.max_seq_len_q,
#                  "max_seq_len_k": md.max_seq_len_k, "page_table": tl(md.page_table)},
# }
# n = getattr(self, "_dump_n", 0); self._dump_n = n + 1
# with open(f"/tmp/fa3_dump_{n}.json", "w") as f:
#     json.dump(dump, f)
# ```
#
# (`.tolist()` syncs the device: for debugging only. Under a CUDA graph the `page_table` buffer is
# wider than the batch needs; refspec checks only the columns a request reads, PA-007.)

# %% [markdown]
# ## Exercises
#
# **9a.** Corrupt the clean dump so that `dump.check` raises **MD-002** (`cu_seqlens_q` must give
# the mode's query rows per request). Put the corrupted `cu_seqlens_q` list in `answer_9a`.

# %%
answer_9a = ...  # e.g. [0, 4, 8, 12] with one entry changed

# %% [markdown]
# <details><summary>Solution 9a</summary>
#
# DRAFT_EXTEND_V2 runs `N = 4` rows per request, so any `cu_seqlens_q` whose steps are not all 4
# breaks MD-002, for example v1's packed layout `[0, 2, 6, 7]` (`cumsum(num_accept_tokens)`,
# the bug class of SGLang #27545). The check cell puts your list into a copy of the dump and
# expects `InvariantError` MD-002.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
def raised_id(raw: dict):
    try:
        dump.check(raw)
    except InvariantError as e:
        return e.inv_id
    return None


def with_cu_q(cu):
    bad = copy.deepcopy(raw)
    bad["metadata"]["cu_seqlens_q"] = list(cu)
    return bad


if answer_9a is ...:
    exercises.check("9a", ..., "MD-002", solution=raised_id(with_cu_q([0, 2, 6, 7])))
else:
    exercises.check("9a", raised_id(with_cu_q(answer_9a)), "MD-002", solution=None,
                    hint="keep 4 entries starting at 0; change a step away from N = 4")

# %% [markdown]
# **9b.** A dump from a DECODE forward has `seq_lens = [9, 12, 16]` for rows `[1, 2, 3]`
# (DECODE: `seq_lens` includes the token being decoded). What must `cache_seqlens_int32` and
# `cu_seqlens_q` be? Answer as `answer_9b = (cache_seqlens, cu_seqlens_q)`.

# %%
answer_9b = ...  # (list, list)

# %% [markdown]
# <details><summary>Solution 9b</summary>
#
# One query row per request, and `K_b = seq_lens` (the decoded token is already counted):
# `([9, 12, 16], [0, 1, 2, 3])` (MD-002, MD-003).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
# the rule, from the spec (docs/modes/decode.md): q_b = 1, K_b = seq_lens
seq_lens = [9, 12, 16]
expected_9b = (seq_lens, [0] + torch.ones(3, dtype=torch.long).cumsum(0).tolist())
exercises.check("9b", answer_9b, expected_9b, solution=([9, 12, 16], [0, 1, 2, 3]),
                hint="DECODE: one query row each; seq_lens already counts the new token")

# %% [markdown]
# ## Checks

# %%
assert err_k is not None and err_k.inv_id == "MD-005", err_k
assert err_pt is not None and err_pt.inv_id == "PA-002", err_pt
assert not torch.allclose(wrong, right)  # the double count changes what attention computes
assert str(err_k).startswith("[MD-005] " + INVARIANTS["MD-005"])  # quotable as is
print("all checks passed")
