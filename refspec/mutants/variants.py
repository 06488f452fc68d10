"""The bug zoo: named wrong variants of production seams, applied from outside.

Each variant is a real bug (or a real near miss) from SGLang / vLLM / FA3 history, or a hole an
audit of refspec found, written as a *replacement function* for one named production function
(a seam: one rule per function, e.g. :func:`refspec.fa3.metadata.mode_delta`).  The production
modules contain no trace of the variants; :func:`enabled` rebinds the seam at every call site
for the duration of a ``with`` block (:mod:`refspec.mutants.replace`)::

    from refspec.mutants import variants
    with variants.enabled("de-v2-packed-cu-q"):
        out = built.run_fa3_graph(runner)      # runs the buggy rule

A replacement that keeps the correct behaviour for the other modes calls the original through
names bound at import (:data:`refspec.mutants.replacements._orig`): :mod:`refspec.mutants` is never rebound.
``python -m refspec mutants`` proves each variant is caught by the IDs in ``Variant.caught_by``,
in a run that called its replacement (:mod:`refspec.mutants.reach`: ``enabled`` counts every call).

:data:`CHAIN_VARIANTS` are the seams of the chain (top-k = 1) path, defined here;
:data:`VARIANTS`, the whole zoo, adds the FA3 top-k > 1 ones of :mod:`refspec.mutants.tree_variants`
and the MLA ones of :mod:`refspec.mutants.mla_variants`.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from refspec.core import batch as core_batch
from refspec.core import kv_cache
from refspec.fa3 import backend as fa3_backend
from refspec.fa3 import emulator, validate
from refspec.fa3 import graph_metadata as gm
from refspec.fa3 import metadata as md
from refspec.graphs import runner as graph_runner
from refspec.mutants import replacements as R
from refspec.mutants.mla_variants import MLA_VARIANTS
from refspec.mutants.reach import Reach, counted
from refspec.mutants.replace import replaced
from refspec.mutants.tree_variants import TREE_VARIANTS
from refspec.mutants.variant import Variant

SG = "https://github.com/sgl-project/sglang/pull/"  #: SGLang pull requests (issues redirect)


CHAIN_VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("seed-page-table", gm.replay_page_table, R.slots_as_pages,
            "draft-decode and target-verify replay copy token slots into the page table (no ::P, no // P)",
            f"{SG}5090 (93470a141), fixed by {SG}5318 (188f0955f); {SG}5168",
            "P > 1 only (with P = 1 slots are page ids, so CI passed): FA3 reads slot ids as page ids, "
            "i.e. other requests' or free pages -> finite garbage (incoherent text; accept counts lose "
            "their meaning); slot ids >= NP read out of range, and max K > table width fails the copy",
            ("PA-002", "CG-002")),
    Variant("de-v1-uniform-cu-q", gm.write_draft_extend_cu_q, R.uniform_cu_q,
            "v1 draft-extend replay uses v2's uniform cu_seqlens_q [0, W, 2W, ...]",
            f"{SG}19807 (376dfb03f, the Triton backend: v2 logic applied to v1); docs/modes/draft-extend-v1.md",
            "whenever some a_b < W each request reads W rows (its tail, the next request's head, padding) "
            "aligned at L' - W + i: wrong kept rows, lower acceptance, no crash; right only at full accept",
            ("CG-003", "CG-002")),
    Variant("de-v2-packed-cu-q", gm.draft_extend_rows, R.packed_rows_in_v2,
            "v2 draft-extend replay uses v1's packed cumsum(num_accept_tokens) for cu_seqlens_q",
            f"{SG}21987, {SG}25002, {SG}27545 (v1 logic applied to v2; case B05, docs/cases.md)",
            "request b reads other requests' rows and its kept row sees the rejected drafts' KV; rows "
            "past sum(a) are never written (garbage / NaN); wrong even for B = 1",
            ("CG-004", "CG-002")),
    Variant("de-v1-accept-off-by-one", gm.draft_extend_rows, R.accept_rows_minus_one,
            "v1 draft-extend replay cu_seqlens_q from num_correct_drafts n instead of num_accept_tokens n + 1",
            "docs/spec/graphs.md#cg-003 (accept_length_cpu is n, the GPU tensor is n + 1)",
            "each request loses its bonus row and later requests shift by one row per request; a request "
            "with a = 1 gets no row at all, so its kept row is never written (garbage / NaN)",
            ("CG-003", "CG-002")),
    Variant("de-v2-k-double-count", md.mode_delta, R.delta_counts_n_twice,
            "DRAFT_EXTEND_V2 cache_seqlens = seq_lens + extend_seq_lens (L + 2N), eager and replay",
            f"{SG}26512 (e5f5d8478), reverted by {SG}26628",
            "every row sees N positions past what was written this round (stale KV, or dummy page 0 "
            "where req_to_token is unassigned): wrong outputs",
            ("MD-005", "MD-008", "TOL-002")),
    Variant("replay-rebind-page-table", gm.replay_page_table, R.rebind_page_table,
            "replay assigns a new page-table tensor instead of copying into the captured one",
            f"{SG}4855 (6ffb6bd47); case B11, {SG}26019",
            "the graph keeps reading the capture-time table (all dummy page 0): every request attends "
            "to page 0, every replay is wrong",
            ("CG-001", "CG-002")),
    Variant("replay-rebind-cache-seqlens", gm.write_cache_seqlens, R.rebind_cache_seqlens,
            "the lengths' write (the graph's own first work, and a validating replay's) assigns a new "
            "cache_seqlens tensor instead of copying into the captured one",
            f"{SG}4855 (6ffb6bd47); case B11, {SG}26019",
            "the graph keeps reading the capture-time lengths (the padding fill + delta): each row "
            "attends to a few keys instead of K_b",
            ("CG-001", "CG-002")),
    Variant("stale-padded-rows", graph_runner.pad_rows, R.pad_nothing,
            "replay copies only the real rows; padded rows keep the previous replay's values",
            "case B04, https://github.com/vllm-project/vllm-ascend/pull/7290",
            "padded rows keep an earlier batch's req_pool_indices / seq_lens / out_cache_loc: real rows "
            "are unchanged, but padded tokens write KV into the stale slots of a request outside the "
            "batch, corrupting it",
            ("CG-005",)),
    Variant("pad-seq-lens-zero", graph_runner.seq_lens_fill, R.seq_lens_fill_zero,
            "padded rows get seq_lens fill 0 (SGLang before #7233)",
            f"{SG}7233 (c64290dcb); cases B03, B10 (docs/cases.md)",
            "padded draft-extend rows have K = 0 < q = W, an empty causal span (B10: huge activations "
            "and non-finite dummy KV across layers); real rows unchanged at the attention level",
            ("CG-010", "CG-005")),
    Variant("capture-max-seqlen-q-small", gm.capture_query_rows, R.capture_q_of_dummy_batch,
            "draft-extend graph captured with max_seqlen_q = the dummy batch's q (1), not Sd + 1",
            "case B08, https://github.com/huggingface/transformers/pull/45323; docs/spec/graphs.md#cg-006",
            "live requests with more query rows than the frozen max_seqlen_q: undefined kernel result "
            "(B08: accuracy halved); the emulator refuses it, a real kernel may hide it while the rows "
            "fit one M-block",
            ("PA-010", "CG-006")),
    Variant("page-table-width-from-context", gm.graph_table_width, R.width_from_context,
            "graph page-table buffers sized ceil(max_context / P) instead of from req_to_token.shape[1]",
            f"case B07, {SG}35985, {SG}29665",
            "near the context wall verify / draft extend need ceil((L + N) / P) pages, more than the "
            "table has: refspec's replay guard raises; without it FA3 indexes past the table (illegal "
            "memory access, 'used 256001 > capacity 256000')",
            ("CG-008",)),
    Variant("free-last-committed-page", kv_cache.first_freeable_position, R.free_from_committed_page,
            "v1 rejected-slot free also frees the page holding the last committed token",
            "docs/spec/kv.md#kv-004 (sglang speculative/spec_utils.py align_evict_mask_to_page_size)",
            "a committed token's page goes back to the free list: the next request to allocate gets it "
            "and overwrites committed KV; finishing both requests frees that page twice",
            ("KV-004", "KV-003")),
    Variant("de-v1-attend-rejected", md.eager_cache_seqlens, R.v1_k_includes_rejected,
            "eager v1 draft extend uses K = L + N (all verify slots) instead of L' = L + a",
            "docs/spec/metadata.md#md-003; docs/modes/draft-extend-v1.md",
            "whenever a_b < N the a_b rows are aligned to L + N: the kept row attends to the rejected "
            "drafts' KV (wrong next d_1); eager runs only (batches past the captured sizes)",
            ("MD-005", "MD-003", "TOL-002")),
    Variant("verify-as-decode", md.eager_query_layout, R.verify_as_decode,
            "TARGET_VERIFY takes the eager DECODE branch: cu_seqlens_q = arange(B + 1), max_seqlen_q = 1",
            "case B14, https://github.com/vllm-project/vllm/pull/32084 "
            "(https://github.com/vllm-project/vllm/issues/31625: verify batches sent down a q_len-1 path)",
            "one query row per request: row 0 sees all L + N keys, the other N - 1 rows are never "
            "computed (garbage); acceptance collapses (GSM8K ~0%)",
            ("MD-002", "PA-004", "TOL-002")),
    Variant("draft-loc-step-major", core_batch.draft_step_cut, R.step_major_cut,
            "draft_step_view cuts step s of the request-major draft cache locations as if step-major",
            f"case B20, {SG}7239 (draft KV cache layout for fa3)",
            "B >= 2 only: draft tokens write their KV into another request's (or step's) slot and read "
            "an unwritten one; acceptance at bs=2 far below bs=1",
            ("MD-005", "TOL-002")),
    Variant("pad-rows-live-page", graph_runner.pad_rows, R.pad_with_live_row,
            "padded graph rows get req_pool_indices of a live request instead of the reserved row 0",
            "case B18, https://github.com/ROCm/rocm-libraries/pull/6932 (padded page tables with a valid "
            "page hid an over-read); docs/spec/graphs.md#cg-005",
            "padded rows read a live request's pages instead of the poisoned dummy page 0: real rows "
            "are unchanged, but every padded-row over-read becomes invisible",
            ("CG-005",)),
    Variant("fa3-window-minus-one", fa3_backend.kernel_window_size, R.window_minus_one,
            "the FA3 wing passes window_size = (w - 1, 0) for a left window of w tokens",
            "docs/spec/paging-attention.md#pa-004; sglang flashattention_backend.py passes "
            "(layer.sliding_window_size, 0)",
            "each row at position t >= w loses its oldest key t - w: wrong outputs for sliding-window "
            "layers once the context passes w, no error",
            ("PA-004",)),
    Variant("emulator-window-edge", emulator.visible_keys, R.window_edge_exclusive,
            "the emulator's left window edge is exclusive: key p visible iff p > t - w (w keys, not w + 1)",
            "docs/spec/paging-attention.md#pa-004; https://github.com/Dao-AILab/flash-attention/blob/"
            "fa4-v4.0.0.beta27/hopper/flash_attn_interface.py#L1012 (window_size: both edges inclusive)",
            "on CPU the emulated FA3 drops the window's oldest key, so a wing with the real rule would "
            "look wrong next to it; no error",
            ("PA-004",)),
    Variant("replay-skips-validate-batch", validate.validate_batch, R.skip_replay_validate_batch,
            "graph replay builds metadata without validate_batch (the live batch is never checked)",
            "docs/spec/metadata.md#md-006 (seq_lens_cpu mirrors seq_lens: replay reads max K from it)",
            "a malformed live batch (CPU mirror out of step, repeated rows) reaches the captured graph "
            "unchecked; validation on no longer stops it",
            ("MD-006",), within="refspec.fa3.graph_metadata", only_with_validation=True),
    Variant("positions-one-early", core_batch.tail_positions, R.tail_one_early,
            "the batch builders put this forward's tokens at positions K - q - 1 .. K - 2 (one early)",
            "docs/spec/metadata.md#md-005 (INV-TAIL); docs/spec/spec-decode.md#sd-007",
            "each forward overwrites the previous token's KV and leaves its last key unwritten; "
            "out_cache_loc and positions agree with req_to_token, so only the meaning is wrong",
            ("MD-005", "TOL-002")),
]}

#: the whole zoo: the chain variants, then the FA3 top-k > 1 ones (:mod:`refspec.mutants.tree_variants`),
#: then the MLA ones (:mod:`refspec.mutants.mla_variants`)
VARIANTS: dict[str, Variant] = {**CHAIN_VARIANTS, **TREE_VARIANTS, **MLA_VARIANTS}

@dataclass
class _On:
    """An applied variant: the rebound call sites, the counted replacement installed there, its reach."""

    sites: list
    installed: Callable
    reach: Reach


_active: dict[str, _On] = {}  #: name -> what enabled installed, while enabled


@contextmanager
def enabled(*names: str):
    """Apply the named variants inside the ``with`` block, each replacement counted
    (:mod:`refspec.mutants.reach`); yields ``{name: Reach}``, whose ``calls`` say how often each
    replacement ran so far (KeyError for an unknown name;
    :class:`~refspec.mutants.replace.NoCallSite` if two of them replace the same seam)."""
    for n in names:
        if n not in VARIANTS:
            raise KeyError(f"unknown variant {n!r}; known: {sorted(VARIANTS)}")
    reach: dict[str, Reach] = {}
    with ExitStack() as stack:
        for n in dict.fromkeys(names):
            if n in _active:  # already on (an enclosing block): its counter goes on counting
                reach[n] = _active[n].reach
                continue
            v = VARIANTS[n]
            reach[n] = Reach(v.seam)
            installed = counted(v.replacement, reach[n])
            _active[n] = _On(stack.enter_context(replaced(v.target, installed, v.within)), installed, reach[n])
            stack.callback(_active.pop, n)
        yield reach


@contextmanager
def disabled():
    """Every active variant off inside the block (the references the oracle computes)."""
    saved = dict(_active)
    for n, on in saved.items():
        for mod, key in on.sites:
            setattr(mod, key, VARIANTS[n].target)
    _active.clear()
    try:
        yield
    finally:
        for on in saved.values():
            for mod, key in on.sites:
                setattr(mod, key, on.installed)
        _active.update(saved)


def active() -> set[str]:
    """Names of the variants applied now."""
    return set(_active)
