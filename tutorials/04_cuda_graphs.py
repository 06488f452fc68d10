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
# # 04 · CUDA graphs: capture, replay, padding, and the accept-length rule
#
# A CUDA graph records kernel launches once (**capture**) and re-issues them cheaply
# (**replay**). Replay re-reads *device memory* only: every buffer address and every host scalar
# (`max_seqlen_q`, the page-table width) is frozen at capture. That single fact explains every
# rule in this notebook:
#
# 1. replay must write metadata **into** the captured buffers, never rebind them (CG-001);
# 2. host scalars are frozen, so `max_seqlen_q` must be captured at the mode's bound (CG-006);
# 3. a live batch is **padded** to a captured size, and padded rows need safe values (CG-005);
# 4. draft extend replays `cu_seqlens_q` from the *right* per-request counts: packed
#    `num_accept_tokens` in one draft-extend mode, the same row count for every request in the
#    other (v1 and v2 in the table below; CG-003, CG-004) — and both wrong variants are silent.
#
# On CPU refspec uses `EmulatedGraph`, which freezes exactly what a CUDA graph freezes.
#
# **Symbols and names used below** (SGLang's field names; units in brackets):
#
# | symbol | meaning |
# |---|---|
# | `P` | page size [tokens per page] |
# | `L`, `L_b` | committed length of request `b` before the round [tokens] |
# | `q`, `q_b`; `K`, `K_b` | request `b`'s query rows and the keys the kernel reads for it [tokens] |
# | `Sd` | `speculative_num_steps`: draft steps per round |
# | `N` | `num_draft_tokens`: tokens verified per request (`N = Sd + 1` at top-k = 1) |
# | `n_b`, `a_b` | request `b`'s accepted drafts, and its committed tokens `a_b = n_b + 1` (the bonus token included) |
# | `B`, `Bg` | live batch size, and the captured graph size it is padded to (`Bg >= B`) |
# | `W` | query rows per request a draft-extend graph is captured with (`W = Sd + 1`) |
# | v1 / v2 | the two EAGLE draft-extend modes: `ForwardMode.DRAFT_EXTEND` (v1, packs `a_b` rows per request) and `DRAFT_EXTEND_V2` (v2, `W` rows per request) |
# | T0 | refspec's bitwise-equality tier (TOL-001); T1 is its low-precision tier (TOL-002) |
# | B04, B08, B11 | *public cases*: bugs reported upstream, each reduced to a test (`docs/cases.md`) |
#
# Rule IDs (`CG-001`, ...) are the rules of `docs/spec/`: `python -m refspec cite CG-006` prints one
# with its level, upstream source and test. When a scenario breaks several rules, refspec's error
# names the most specific one (the cause), and that is the ID to quote.
#
# Run time as a script on a shared 2-core CPU machine: 26 s wall, 10 s of CPU
# (`benchmarks/results/cpu_learner_times.md`).

# %%
from refspec.harness.needs import needs

needs("tutorials")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import matplotlib.pyplot as plt
import torch

from refspec.mutants import variants

from refspec.core import tolerance

from refspec.harness import viz
from refspec.harness.viz import show
from refspec.graphs.capture import EmulatedGraph, launch
from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode as M
from refspec.harness.scenario import Scenario


# %% [markdown]
# ## What a graph freezes
#
# A toy "kernel" `x * scale` launched with a static buffer `x` and a host scalar `scale`. After
# capture we (a) copy new values into `x`, (b) rebind the name `x` to a new tensor, and
# (c) change `scale`. Only (a) reaches the replay.

# %%
def scale_kernel(x, scale):
    return x * scale


x = torch.zeros(3)
scale = 2.0
g = EmulatedGraph()
g.capture(lambda: launch(scale_kernel, static=dict(x=x), scalars=dict(scale=scale)))

x.copy_(torch.tensor([1.0, 2.0, 3.0]))          # (a) in place: seen
in_place = g.replay()
x_captured, x = x, torch.tensor([10.0, 20.0, 30.0])  # (b) rebinding: not seen
scale = 100.0                                    # (c) host scalar: frozen at 2
rebound = g.replay()
print("after copy_:   ", in_place.tolist())
print("after rebind + new scale:", rebound.tolist())
assert in_place.tolist() == [2.0, 4.0, 6.0] and rebound.tolist() == [2.0, 4.0, 6.0]

# %% [markdown]
# That is SGLang #4855 (`6ffb6bd47`) and public case B11: a replay that *assigns*
# `metadata.page_table = new_table` leaves the graph reading the capture-time table.
#
# ## Capture sizes and padding
#
# A graph runner captures one graph per batch size in `capture_bs` (largest first) and replays a
# live batch of `B` requests in the smallest captured size `>= B` (CG-007). Larger batches run
# eagerly.

# %%
P, N, L, A = 4, 4, [5, 8, 12], [2, 4, 1]
verify = Scenario(M.TARGET_VERIFY, page_size=P, lens=L, num_draft_tokens=N, seed=0).build()
runner = verify.graph_runner(capture_bs=(1, 2, 4, 8))
print("B -> Bg:", {B: runner.graph_bs(B) for B in range(1, 9)}, " B = 9 can run:",
      runner.can_run(verify.fb.replace(req_pool_indices=torch.zeros(9, dtype=torch.long))))

eager = verify.run_fa3()
replayed = verify.run_fa3_graph(runner)
static = runner.static[4]
md = runner.backend.forward_metadata
print("padded batch (Bg = 4):")
print("  req_pool_indices", static.req_pool_indices.tolist(), "  seq_lens", static.seq_lens.tolist())
print("  out_cache_loc   ", static.out_cache_loc.tolist())
print("  cache_seqlens   ", md.cache_seqlens_int32.tolist(), "  cu_seqlens_q", md.cu_seqlens_q.tolist(),
      "  frozen max_seqlen_q", md.max_seq_len_q)
print("replay vs eager on the 12 real rows:", tolerance.t0(replayed, eager))
assert tolerance.t0(replayed, eager).ok

# %% [markdown]
# The padded row 3 points at the reserved `req_to_token` row 0, writes its dummy token into slot
# 0 (the reserved page 0), and has `seq_lens = 1`, so `K = 1 + N = 5 >= q = 4` (CG-005, CG-010).
# These fills are rewritten on **every** replay: a padded row that kept the previous batch's
# values would read that batch's pages (public case B04).
#
# ## Frozen `max_seqlen_q`
#
# The kernel plans its query tiles from `max_seqlen_q`, a Python int baked into the graph. The
# runner captures each mode at its bound: 1 for decode and draft decode, `N` for verify, `Sd + 1`
# for draft extend — never the (smaller) query length of the dummy capture batch (CG-006, public
# case B08). The bug variant `capture-max-seqlen-q-small` captures draft extend with 1. The live
# requests then have more query rows than the frozen scalar, which breaks two rules: CG-006 (the
# graph froze the wrong bound, the cause) and PA-010 (the kernel contract, every request's query
# fits `max_seqlen_q`). The replay check names the more specific one, CG-006; with the replay
# checks off, the emulated kernel refuses the call with PA-010.

# %%
de1 = Scenario(M.DRAFT_EXTEND, page_size=P, lens=L, num_draft_tokens=N, num_accept_tokens=A, seed=0).build()
with variants.enabled("capture-max-seqlen-q-small"):
    small = de1.graph_runner(capture_bs=(4,))
try:
    de1.run_fa3_graph(small)
    frozen_error = None
except InvariantError as e:
    frozen_error = e
print(frozen_error)
assert frozen_error is not None and frozen_error.inv_id == "CG-006"

# %% [markdown]
# ## Draft extend: the accept-length rule for `cu_seqlens_q`
#
# Draft-extend graphs are captured with `W = Sd + 1 = 4` rows per request, shared by v1 and v2.
# At replay the two differ:
#
# * **v1** packs the `a_b = n_b + 1` accepted tokens back to back:
#   `cu_seqlens_q = [0, cumsum(num_accept_tokens)]` (CG-003);
# * **v2** lays out `W` rows for every request:
#   `cu_seqlens_q = [0, W, 2W, ...]` from `extend_seq_lens` (CG-004).
#
# Three wrong variants have shipped somewhere: v2's rule on v1 (Triton #19807), v1's rule on v2
# (trtllm-mla #21987, trtllm-mha #25002, Triton #27545) and v1 built from `n` instead of `n + 1`.
# The whole story in one place (why the two loops differ, the upstream bugs):
# `docs/accept-length.md`, or `python -m refspec cite accept-length`.
# Each strip below is one replay of the same live batch: colour = the request `cu_seqlens_q`
# assigns a row to, text = the token that is really there.

# %%
de2 = Scenario(M.DRAFT_EXTEND_V2, page_size=P, lens=L, num_draft_tokens=N, num_accept_tokens=A, seed=0).build()
ref = {"v1": de1.run_oracle(), "v2": de2.run_oracle()}
# the row the loop keeps per request: the last of its a_b rows (v1: packed, v2: W = N rows each)
kept = {"v1": [sum(A[: b + 1]) - 1 for b in range(len(A))], "v2": [b * N + a - 1 for b, a in enumerate(A)]}
print("kept rows:", kept)
cases = [("v1", None), ("v1", "de-v1-uniform-cu-q"), ("v1", "de-v1-accept-off-by-one"),
         ("v2", None), ("v2", "de-v2-packed-cu-q")]


def replay(which, variant, validate=False):
    built = de1 if which == "v1" else de2
    r = built.graph_runner(capture_bs=(4,), validate=validate)
    with variants.enabled(*([variant] if variant else [])):
        out = built.run_fa3_graph(r)
    return out, r.backend.forward_metadata.cu_seqlens_q[:5].tolist()


fig, axes = plt.subplots(len(cases), 1, figsize=(8, 1.1 * len(cases)))
kept_err = {}
for ax, (which, variant) in zip(axes, cases):
    out, cu = replay(which, variant)
    q_live = de1.q_lens if which == "v1" else de2.q_lens
    owner = [b for b, q in enumerate(q_live) for _ in range(q)] + [-1] * (16 - sum(q_live))
    rows = kept[which]
    err = (out[rows] - ref[which][rows]).abs().max().item()
    kept_err[(which, variant)] = err
    viz.draw_query_rows(ax, cu, 16, f"{which} {variant or 'correct'}: cu_seqlens_q = {cu}; "
                        f"kept rows {rows}, max error {err:.3g}", owner=owner, num_real=3)
fig.tight_layout()
show(fig)
for k, e in kept_err.items():
    print(f"{k[0]} {k[1] or 'correct':26s} max |kept row - oracle| = {e:.3g}")

# %% [markdown]
# * **v2's rule on v1**: request 0 gets rows holding `r0, r0, r1, r1`; its window is aligned to
#   the wrong rows, so the kept row sees neither itself nor the token before it. Wrong draft, no
#   crash.
# * **`n` instead of `n + 1`**: every request loses its bonus row and the later ones shift.
# * **v1's rule on v2**: request 0's kept row sees the rejected drafts' KV; rows past `sum(a)`
#   are never written, and request 1's kept row (7) lands among them: garbage (NaN in the
#   emulator, which fills unwritten rows with NaN on purpose).
#
# None of these crash a real kernel. With refspec's replay checks on (the default), each one is
# refused with the rule it breaks:

# %%
caught = {}
for which, variant in [c for c in cases if c[1]]:
    try:
        replay(which, variant, validate=True)
    except InvariantError as e:
        caught[variant] = e.inv_id
        print(f"{variant:26s} -> {str(e)[:150]}")
print(caught)

# %% [markdown]
# ### Why tests need partial acceptance
#
# With full acceptance (every `a_b = W`) the packed and the uniform layouts coincide, so v2's
# rule on v1 is *invisible*. A test suite that only drafts with a perfect draft model never sees
# the bug:

# %%
full = Scenario(M.DRAFT_EXTEND, page_size=P, lens=L, num_draft_tokens=N, num_accept_tokens=[4, 4, 4],
                seed=0).build()
good = full.run_fa3_graph(full.graph_runner(capture_bs=(4,)))
with variants.enabled("de-v1-uniform-cu-q"):
    bad = full.run_fa3_graph(full.graph_runner(capture_bs=(4,), validate=False))
print("full acceptance, v2 rule on v1 vs correct:", tolerance.t0(bad, good))

# %% [markdown]
# ## Exercises
#
# **4a.** A DRAFT_EXTEND_V2 graph captured at `Bg = 4` replays 3 live requests with `W = N = 4`
# rows each. What `cu_seqlens_q` must the replay write (all `Bg + 1` entries)?

# %%
answer_4a = ...

# %% [markdown]
# <details><summary>Solution 4a</summary>
#
# Uniform, the padded row included: `[0, 4, 8, 12, 16]` (CG-004).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
from refspec.harness import exercises

ex_Bg, ex_W = 4, 4
# CG-004 written out: the runner lays out W rows per (padded) request
exercises.check("4a", answer_4a, [ex_W * i for i in range(ex_Bg + 1)], solution=[0, 4, 8, 12, 16],
                hint="v2 lays out W rows for every request, padded ones too")

# %% [markdown]
# **4b.** The same graph replays **v1** with accepted `a = [2, 4, 1]`; the padded row's fill is
# `W = 4`. What `cu_seqlens_q` must the replay write?

# %%
answer_4b = ...

# %% [markdown]
# <details><summary>Solution 4b</summary>
#
# v1 packs: `[0, cumsum(a + [4])] = [0, 2, 6, 7, 11]` (CG-003). The uniform rule would give
# `[0, 4, 8, 12, 16]` and misalign every request after the first (the `de-v1-uniform-cu-q` bug).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
ex_counts = [2, 4, 1, ex_W]  # live a_b, then the padded row's fill
exercises.check("4b", answer_4b, [sum(ex_counts[:i]) for i in range(len(ex_counts) + 1)],
                solution=[0, 2, 6, 7, 11], hint="[0, cumsum(num_accept_tokens)], padded row last")

# %% [markdown]
# ## Checks

# %%
assert tolerance.t0(replayed, eager).ok                                    # CG-002
assert frozen_error is not None and frozen_error.inv_id == "CG-006"          # the graph rule, named first
assert kept_err[("v1", None)] < 1e-5 and kept_err[("v2", None)] < 1e-5    # correct rules
for key in [("v1", "de-v1-uniform-cu-q"), ("v1", "de-v1-accept-off-by-one"), ("v2", "de-v2-packed-cu-q")]:
    assert not kept_err[key] < 1e-3, key             # wrong rules: a large error or NaN (NaN < x is False)
assert caught == {"de-v1-uniform-cu-q": "CG-003", "de-v1-accept-off-by-one": "CG-003",  # v1's rule
                  "de-v2-packed-cu-q": "CG-004"}                                          # v2's rule
assert tolerance.t0(bad, good).ok                                          # invisible at full acceptance
print("all checks passed")
