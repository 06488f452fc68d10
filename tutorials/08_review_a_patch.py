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
# # 08 · Review a real upstream patch with refspec
#
# The patch: SGLang #26512 (`e5f5d8478`) changed the FA3 backend's DRAFT_EXTEND_V2 metadata
# (`python/sglang/srt/layers/attention/flashattention_backend.py`, `init_forward_metadata`) so
# that the key length of each request became
#
# ```
# cache_seqlens_int32 = seq_lens + extend_seq_lens        # the patch
# cache_seqlens_int32 = seq_lens                           # before it (and after the revert)
# ```
#
# It was merged and reverted the next day by #26628 after `test_mimo_v2_flash.py` failed; #26651
# fixed that test's fixture instead. The review question is the one refspec answers: in
# DRAFT_EXTEND_V2, `seq_lens` is already post-write (`L + N`: it counts this forward's `N`
# tokens), so adding `extend_seq_lens` counts them twice. This notebook walks through the review:
#
# 1. reproduce the patch as a refspec scenario (the bug variant `de-v2-k-double-count` switches
#    the patched line on in refspec's production wing);
# 2. read the `InvariantError` it raises, and see that the outputs are really wrong (against the
#    oracle, which never looks at the switch);
# 3. look up the rule, its source and its tests;
# 4. write the review line, quoting the ID;
# 5. add a regression test that cites the ID, and see refspec's spec index pick it up;
# 6. run **upstream's own backend with the patch applied** (SGLang 0.5.23 plus the stored diff
#    `refspec/conformance/patches/pr26512-draft-extend-v2-double-count.diff`) against refspec's
#    metadata, read the rule-named failure, and finish the review line with upstream's values.
#
# CPU only. Section 6 starts SGLang in a worker process; the first time on a machine it installs
# SGLang 0.5.23 and its few real dependencies into `.conformance/` with the same cached installer
# `make conformance` uses.
# Run time as a script on a shared 2-core CPU machine: 75 s wall, 25 s of CPU (SGLang already
# installed; `benchmarks/results/cpu_learner_times.md`).

# %%
from refspec.harness.needs import needs

needs("tutorials")  # the set-up check: stops here, with the command to run, if something is missing


# %%
import ast
import textwrap
import tempfile
from pathlib import Path

import pytest

from refspec.mutants import variants
from refspec.core import tolerance
from refspec.core.invariants import INVARIANTS, InvariantError
from refspec.core.modes import ForwardMode as M
from refspec.cli.cite import load_spec_index
from refspec.harness import exercises

spec_index = load_spec_index()  # docs/spec_index.py: the ID -> tests index beside the spec pages
from refspec.harness.scenario import Scenario

# the docs' running example: committed lengths L, accepted a, N = Sd + 1 draft rows, page size P
L, A, N, P = [5, 8, 12], [2, 4, 1], 4, 4
scenario = Scenario(mode=M.DRAFT_EXTEND_V2, page_size=P, lens=L, num_accept_tokens=A, num_draft_tokens=N, seed=0)

# %% [markdown]
# ## 1. The scenario, without the patch
#
# `Scenario.build()` allocates the pages, fills the prefix KV and builds the `ForwardBatch`;
# `run_fa3()` runs the production wing (metadata, validation, store-then-attend, the kernel or
# its contract emulator), `run_oracle()` the oracle (keys gathered by slot).

# %%
built = scenario.build()
ref = built.run_oracle()
out = built.run_fa3()
md = built.extra["metadata"]
print("seq_lens      =", built.fb.seq_lens.tolist(), "(L + N: post-write)")
print("cache_seqlens =", md.cache_seqlens_int32.tolist())
print("fa3 vs oracle:", tolerance.t1(out, ref))

# %% [markdown]
# ## 2. With the patch: the `InvariantError`
#
# `variants.enabled("de-v2-k-double-count")` swaps in exactly the patched rule: the bug-zoo
# variant replaces the one-rule function `refspec.fa3.metadata.mode_delta` (from outside, for the
# `with` block; the production module holds only the correct rule). Validation runs before the
# kernel and stops the forward:

# %%
patched = scenario.build()
try:
    with variants.enabled("de-v2-k-double-count"):
        patched.run_fa3()
    err = None
except InvariantError as e:
    err = e
print(err)
print("\nID:", err.inv_id, "| detail:", err.detail)

# %% [markdown]
# Read it the way the kernel would: request 0 has `K = 13` but only 9 positions exist
# (`L + N = 5 + 4`); the "last 4 keys" the kernel treats as this forward's tokens are positions
# 9..12, whose `req_to_token` entries are 0 (never allocated: the dummy page). That is rule
# **MD-005** (INV-TAIL), the general form of which MD-008 is the v2 instance: refspec's validator
# checks INV-TAIL first, so MD-005 is the ID it raises; section 6 shows which one to quote.
#
# A check can be pedantic; this one is not. With validation off, the patched forward computes
# something else than the oracle (NaN here: refspec fills unwritten pages with NaN so that a read
# of them cannot pass unnoticed):

# %%
unchecked = scenario.build()
with variants.enabled("de-v2-k-double-count"):
    out_bug = unchecked.run_fa3(validate=False)
verdict = tolerance.t1(out_bug, unchecked.run_oracle())
print("patched fa3 vs oracle:", verdict)

# %% [markdown]
# ## 3. The rule, its source and its tests
#
# Every ID has one entry in `docs/spec/` (rule, why, example, upstream source) and the tests
# that cite it through `@pytest.mark.spec`. The bug zoo lists which IDs catch the variant.

# %%
index = spec_index.build_index()
for inv_id in ("MD-005", "MD-008"):
    print(f"{inv_id}: {INVARIANTS[inv_id]}")
    print(f"  spec:  docs/spec/{spec_index.family_page(inv_id)}#{inv_id.lower()}")
    print(f"  tests: {len(index.tests.get(inv_id, []))}, e.g. {index.tests.get(inv_id, ['-'])[0]}")
print("variant caught by:", variants.VARIANTS["de-v2-k-double-count"].caught_by)

# %% [markdown]
# ## 4. The review line
#
# Quote the ID, the rule and what refspec saw; link the entry. One line is enough. Check the
# rule's conformance level first (`python -m refspec cite MD-008` prints it with the sources and
# tests): MD-008 is *upstream behaviour*, so the patch is a regression against SGLang itself; a
# *refspec hardening* rule (CG-005, CG-008, CG-010) would make the same line a suggestion.

# %%
review = (f"This violates MD-008 ({INVARIANTS['MD-008']}): in DRAFT_EXTEND_V2 `seq_lens` is already "
          f"L + N, so `+ extend_seq_lens` gives K = L + 2N; refspec's scenario raises {err.inv_id}: "
          f"{err.detail} (docs/spec/metadata.md#md-008).")
print(textwrap.fill(review, 100))

# %% [markdown]
# ## 5. A regression test that cites the ID
#
# The test goes next to the change (upstream: a unit test of the backend's metadata; here, a
# refspec test). `@pytest.mark.spec("MD-008")` is what puts it in the ID's "Tests" list and in
# `refspec cite`-style look-ups: `tests/test_spec_ids.py` requires every ID to have one. The
# expected value is the rule written out (`L + N`), not a number read from the code under test.

# %%
TEST = '''
import pytest
from refspec.mutants import variants
from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode as M
from refspec.harness.scenario import Scenario

L, A, N, P = [5, 8, 12], [2, 4, 1], 4, 4


def _scenario():
    return Scenario(mode=M.DRAFT_EXTEND_V2, page_size=P, lens=L, num_accept_tokens=A, num_draft_tokens=N)


@pytest.mark.spec("MD-008")
def test_draft_extend_v2_k_is_seq_lens():
    built = _scenario().build()
    built.run_fa3()
    assert built.extra["metadata"].cache_seqlens_int32.tolist() == [x + N for x in L]


@pytest.mark.spec("MD-008", "MD-005")
def test_double_counted_k_is_refused():
    with variants.enabled("de-v2-k-double-count"), pytest.raises(InvariantError) as e:
        _scenario().build().run_fa3()
    assert e.value.inv_id == "MD-005"
'''
tmp = Path(tempfile.mkdtemp())
(tmp / "test_review_26512.py").write_text(TEST)
code = pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                    str(tmp / "test_review_26512.py")])
cited, problems = spec_index.scan_file(tmp / "test_review_26512.py", "test_review_26512.py")
print("pytest exit code:", int(code))
print("the spec index sees:", dict(cited))

# %% [markdown]
# ## 6. Upstream's own backend with the patch applied
#
# Everything above ran refspec's code with the patched rule switched on. The review is about
# SGLang's code, so run that: `Code("0.5.23", (patch,)).target()` installs the release if it is
# missing, applies the stored diff (its header names the PR and says where its text came from) to
# a copy of the install, and resolves the copy as a source tree: the same thing
# `python -m refspec conformance --sglang PATH` does with any checkout. `run()` then feeds
# upstream's backend and refspec's production wing the same `req_to_token` and batches.

# %%
from refspec.conformance import controls, patches, run as conformance

PATCH = "pr26512-draft-extend-v2-double-count"
print(patches.load(PATCH).header["PR"])
target = controls.Code("0.5.23", (PATCH,)).target()
print("code under test:", target.label, "->", target.site)
upstream = conformance.run([target], page_sizes=(4,), modes=("draft_extend_v2",), log=print)
failing = [r for r in upstream.rows if not r.ok]
finding = next(f for r in failing if r.phase == "eager" for f in r.findings if f.field == "cache_seqlens_int32")
for r in failing:
    for f in r.findings:
        print(f"{r.job} {r.phase}: {f.rule} ({f.level}) {f.field}: refspec {f.ours} | upstream {f.theirs}")

# %% [markdown]
# Upstream's patched backend gives `cache_seqlens` `L + 2N` where refspec (and unpatched 0.5.23,
# `tests/test_conformance_controls.py`) gives `L + N`, and the row names **MD-008**, the
# DRAFT_EXTEND_V2 rule. Which ID to quote: **MD-008**. It is the rule the patch changes (`K_b =
# seq_lens`, never `+ extend_seq_lens`), the one the conformance row names and the one whose
# level (*upstream behaviour*) makes the line a regression report. MD-005 (INV-TAIL) is the same
# defect seen from the KV side: refspec's validator checks it first, so a refspec run raises
# MD-005; mention it as the symptom, not as the rule. The finished review line carries upstream's
# own values and the line of the patched file they came from:

# %%
line = f"{finding.where[0]}:{finding.where[1]}" if finding.where else "flashattention_backend.py"
review_upstream = (f"This violates MD-008 ({INVARIANTS['MD-008']}): with this change SGLang's FA3 backend gives "
                   f"DRAFT_EXTEND_V2 cache_seqlens {finding.theirs} where the rule gives {finding.ours} (seq_lens "
                   f"already counts the N draft tokens; refspec's validator reports the same defect as MD-005, "
                   f"INV-TAIL). Measured with python -m refspec conformance --sglang on 0.5.23 + this diff "
                   f"({line}); docs/spec/metadata.md#md-008.")
print(textwrap.fill(review_upstream, 100))

# %% [markdown]
# ## Exercises
#
# **8a.** Another real patch class: a v2 draft-extend *graph replay* that fills `cu_seqlens_q`
# with v1's packed `cumsum(num_accept_tokens)` (trtllm-mla #21987, trtllm-mha #25002, Triton
# #27545; bug variant `de-v2-packed-cu-q`). Which ID does refspec's replay raise for it on this
# scenario? Put it in `answer_8a` (a string like `"XX-000"`).

# %%
answer_8a = ...

# %% [markdown]
# <details><summary>Solution 8a</summary>
#
# `"CG-004"`: the v2 replay rule, `cu_seqlens_q = [0, W, 2W, ..., Bg*W]`. The check cell runs
# the replay with the variant on and reads the error's ID; the packed layout `[0, 2, 6, 7, 11]`
# does not match the token layout `[0, 4, 8, 12, 16]`.
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
b8 = scenario.build()
runner = b8.graph_runner(capture_bs=(4,))
with variants.enabled("de-v2-packed-cu-q"), pytest.raises(InvariantError) as raised_8a:
    b8.run_fa3_graph(runner)
exercises.check("8a", answer_8a, raised_8a.value.inv_id, solution="CG-004",
                hint="the rule of the v2 draft-extend replay is in docs/spec/graphs.md")

# %% [markdown]
# **8b.** For request 0 (`L = 5`, `N = 4`): what `cache_seqlens` does the patched code give,
# and what does the rule require? `answer_8b = (patched, rule)`.

# %%
answer_8b = ...

# %% [markdown]
# <details><summary>Solution 8b</summary>
#
# `seq_lens = L + N = 9` already counts the 4 tokens; the patch adds `extend_seq_lens = 4` again:
# `(13, 9)` (MD-008).
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
seq_len0 = L[0] + N  # DRAFT_EXTEND_V2 seq_lens is post-write (docs/modes/draft-extend-v2.md)
exercises.check("8b", answer_8b, (seq_len0 + N, seq_len0), solution=(13, 9),
                hint="seq_lens already includes this forward's N tokens")

# %% [markdown]
# **8c.** Write your own review line for the 8a patch: it must quote the ID and the rule's
# title (`INVARIANTS[...]`). Put the string in `answer_8c`.

# %%
answer_8c = ...

# %% [markdown]
# <details><summary>Solution 8c</summary>
#
# ```python
# f"This violates CG-004 ({INVARIANTS['CG-004']}): the v2 replay packs cu_seqlens_q as "
# "[0, 2, 6, 7, 11], but the runner laid out N = 4 rows per request (docs/spec/graphs.md#cg-004)."
# ```
#
# </details>

# %% tags=["check"] jupyter={"source_hidden": true}
def quotes_the_rule(line: str, inv_id: str) -> bool:
    return inv_id in line and INVARIANTS[inv_id] in line


solution_8c = (f"This violates CG-004 ({INVARIANTS['CG-004']}): the v2 replay packs cu_seqlens_q as "
               "[0, 2, 6, 7, 11], but the runner laid out N = 4 rows per request (docs/spec/graphs.md#cg-004).")
exercises.check("8c", ... if answer_8c is ... else quotes_the_rule(answer_8c, raised_8a.value.inv_id), True,
                solution=quotes_the_rule(solution_8c, raised_8a.value.inv_id),
                hint="include the ID and INVARIANTS[ID] verbatim")

# %% [markdown]
# ## Checks

# %%
assert tolerance.t1(out, ref).ok                                      # unpatched: production == oracle
assert err is not None and err.inv_id in variants.VARIANTS["de-v2-k-double-count"].caught_by
assert err.inv_id == "MD-005" and "K=13" in err.detail                 # K = L + 2N for request 0
assert not verdict.ok                                                  # unchecked, the patch is wrong
assert "MD-008" in review and INVARIANTS["MD-008"] in review
assert int(code) == 0 and not problems
assert {i for ids in cited.values() for i in ids} == {"MD-008", "MD-005"}  # the new tests cite the IDs
# upstream's own patched backend: it fails, on cache_seqlens, named MD-008, by + N per request
assert not upstream.ok and failing and {f.rule for r in failing for f in r.findings} == {"MD-008"}
ours_k, theirs_k = ast.literal_eval(finding.ours), ast.literal_eval(finding.theirs)
assert [t - o for o, t in zip(ours_k, theirs_k)] == [N] * len(ours_k)
assert "MD-008" in review_upstream and INVARIANTS["MD-008"] in review_upstream
print("all checks passed")
