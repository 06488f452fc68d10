"""The bug zoo: named wrong variants that can be switched on inside the production wing.

Each variant is a real bug (or a real near-miss) from SGLang / vLLM / FA3 history, kept as a
switch so that the suite can prove it would catch it.  Code never has to be edited to turn one
on: ``with bugs.enabled("de-v2-k-double-count"): ...`` or ``REFSPEC_BUGS=name1,name2``.

The production wing asks :func:`is_on` at exactly the line the bug lived on (``Bug.hook``); with
no variant on, every such ``if`` is dead.  The oracle wing never looks here.
``python -m refspec mutants`` proves each variant is caught by the IDs in ``Bug.caught_by``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    changes: str  #: what the variant changes
    source: str  #: where it was seen (spec section, upstream PR, case id)
    symptom: str  #: what it does when it runs
    caught_by: tuple[str, ...]  #: invariant IDs whose checks catch it (``python -m refspec mutants``)
    hook: str = ""  #: where the switch sits in the production wing (file, function)


BUGS: dict[str, Bug] = {b.name: b for b in [
    Bug("seed-page-table",
        "draft-decode and target-verify replay copy token slots into the page table (no ::P, no // P)",
        "spec §2.3; SGLang A0 93470a141 (#5090), fixed by #5318 188f0955f; #5168",
        "P > 1 only (with P = 1 slots are page ids, so CI passed): FA3 reads slot ids as page ids, "
        "i.e. other requests' or free pages -> finite garbage (incoherent text; accept counts lose "
        "their meaning, low or even high on degenerate repetition); slot "
        "ids >= NP read out of range, and max K > table width fails the copy",
        ("PA-002", "CG-002"), "fa3/graph_metadata.py GraphMetadataMixin._update_lengths"),
    Bug("de-v1-uniform-cu-q",
        "v1 draft-extend replay uses v2's uniform cu_seqlens_q [0, W, 2W, ...]",
        "spec §4.6 'v2 logic applied to v1'; Triton #19807 376dfb03f",
        "whenever some a_b < W each request reads W rows (its tail, the next request's head, padding) "
        "aligned at L' - W + i: wrong kept rows, lower acceptance, no crash; right only at full accept",
        ("CG-003", "CG-002"), "fa3/graph_metadata.py GraphMetadataMixin._update_lengths"),
    Bug("de-v2-packed-cu-q",
        "v2 draft-extend replay uses v1's packed cumsum(num_accept_tokens) for cu_seqlens_q",
        "spec §4.6 'v1 logic applied to v2'; sglang #21987, #25002, #27545 (case B05)",
        "request b reads other requests' rows and its kept row sees the rejected drafts' KV; rows "
        "past sum(a) are never written (garbage / NaN); wrong even for B = 1",
        ("CG-004", "CG-002"), "fa3/graph_metadata.py GraphMetadataMixin._update_lengths"),
    Bug("de-v1-accept-off-by-one",
        "v1 draft-extend replay cu_seqlens_q from num_correct_drafts n instead of num_accept_tokens n + 1",
        "spec §0.2 (accept_length_cpu is n, the GPU tensor is n + 1), §4.4 item 4",
        "each request loses its bonus row and later requests shift by one row per request; a request "
        "with a = 1 gets no row at all, so its kept row is never written (garbage / NaN)",
        ("CG-003", "CG-002"), "fa3/graph_metadata.py GraphMetadataMixin._update_lengths"),
    Bug("de-v2-k-double-count",
        "DRAFT_EXTEND_V2 cache_seqlens = seq_lens + extend_seq_lens (L + 2N), eager and replay",
        "spec §3.8; sglang #26512 e5f5d8478, reverted by #26628",
        "every row sees N positions past what was written this round (stale KV, or dummy page 0 "
        "where req_to_token is unassigned): wrong outputs",
        ("MD-005", "MD-008", "TOL-002"), "fa3/metadata.py mode_delta"),
    Bug("replay-rebind-page-table",
        "replay assigns a new page-table tensor instead of copying into the captured one",
        "spec §2.3 (#4855 6ffb6bd47); case B11 (#26019)",
        "the graph keeps reading the capture-time table (all dummy page 0): every request attends "
        "to page 0, every replay is wrong",
        ("CG-001", "CG-002"), "fa3/graph_metadata.py GraphMetadataMixin._update_lengths"),
    Bug("replay-rebind-cache-seqlens",
        "replay assigns a new cache_seqlens tensor instead of copying into the captured one",
        "spec §2.3 (#4855); case B11",
        "the graph keeps reading the capture-time lengths (the padding fill + delta): each row "
        "attends to a few keys instead of K_b",
        ("CG-001", "CG-002"), "fa3/graph_metadata.py GraphMetadataMixin._update_lengths"),
    Bug("stale-padded-rows",
        "replay copies only the real rows; padded rows keep the previous replay's values",
        "case B04 (vllm-ascend #7290)",
        "padded rows keep an earlier batch's req_pool_indices / seq_lens / out_cache_loc: real rows "
        "are unchanged, but padded tokens write KV into the stale slots of a request outside the "
        "batch, corrupting it",
        ("CG-005",), "graph_runner.py GraphRunner._fill"),
    Bug("pad-seq-lens-zero",
        "padded rows get seq_lens fill 0 (SGLang before #7233 c64290dcb)",
        "spec §4.1; cases B03, B10",
        "padded draft-extend rows have K = 0 < q = W, an empty causal span (B10: huge activations "
        "and non-finite dummy KV across layers); real rows unchanged at the attention level",
        ("CG-010", "CG-005"), "graph_runner.py GraphRunner.seq_lens_fill"),
    Bug("capture-max-seqlen-q-small",
        "draft-extend graph captured with max_seqlen_q = the dummy batch's q (1), not Sd + 1",
        "case B08 (transformers #45323); spec §1.5",
        "live requests with more query rows than the frozen max_seqlen_q: undefined kernel result "
        "(B08: accuracy halved); the emulator refuses it at capture, a real kernel may hide it "
        "while the rows fit one M-block",
        ("PA-010", "CG-006"), "fa3/graph_metadata.py init_forward_metadata_capture_cuda_graph"),
    Bug("page-table-width-from-context",
        "graph page-table buffers sized ceil(max_context / P) instead of from req_to_token.shape[1]",
        "spec §2.4; case B07 (sglang #35985, #29665)",
        "near the context wall verify / draft extend need ceil((L + N) / P) pages, more than the "
        "table has: refspec's replay guard raises; without it FA3 indexes past the table (illegal "
        "memory access, 'used 256001 > capacity 256000')",
        ("CG-008",), "fa3/graph_metadata.py GraphMetadataMixin.init_cuda_graph_state"),
    Bug("free-last-committed-page",
        "v1 rejected-slot free also frees the page holding the last committed token",
        "spec §5.1 step 3 (align_evict_mask_to_page_size)",
        "a committed token's page goes back to the free list: the next request to allocate gets it "
        "and overwrites committed KV; finishing both requests frees that page twice",
        ("KV-004", "KV-003"), "kv_cache.py KVCache.free_tail"),
    Bug("de-v1-attend-rejected",
        "eager v1 draft extend uses K = L + N (all verify slots) instead of L' = L + a",
        "spec §5.4 (v1 K is L + a), §7 item 17",
        "whenever a_b < N the a_b rows are aligned to L + N: the kept row attends to the rejected "
        "drafts' KV (wrong next d_1); eager runs only (batches past the captured sizes)",
        ("MD-005", "MD-003", "TOL-002"), "fa3/metadata.py init_forward_metadata"),
    Bug("verify-as-decode",
        "TARGET_VERIFY takes the eager DECODE branch: cu_seqlens_q = arange(B + 1), max_seqlen_q = 1",
        "case B14 (vllm #32084, issue #31625: verify batches sent down a q_len-1 decode path)",
        "one query row per request: row 0 sees all L + N keys, the other N - 1 rows are never "
        "computed (garbage); acceptance collapses (GSM8K ~0%)",
        ("MD-002", "PA-004", "TOL-002"), "fa3/metadata.py init_forward_metadata"),
    Bug("draft-loc-step-major",
        "draft_step_view cuts step s of the request-major draft cache locations as if step-major",
        "case B20 (sglang #7239: draft KV cache layout for fa3)",
        "B >= 2 only: draft tokens write their KV into another request's (or step's) slot and read "
        "an unwritten one; acceptance at bs=2 far below bs=1",
        ("MD-005", "TOL-002"),
        "batch.py draft_step_view (the production draft-decode runner's per-step cut; the oracle "
        "loop never calls it)"),
    Bug("pad-rows-live-page",
        "padded graph rows get req_pool_indices of a live request instead of the reserved row 0",
        "case B18 (ROCm/rocm-libraries #6932: harnesses padded page tables with a valid page and "
        "hid an over-read); spec §4.1 (SGLang target/draft-decode runners leave it stale)",
        "padded rows read a live request's pages instead of the poisoned dummy page 0: real rows "
        "are unchanged, but every padded-row over-read becomes invisible",
        ("CG-005",), "graph_runner.py GraphRunner._fill"),
]}

_active: set[str] = set(filter(None, os.environ.get("REFSPEC_BUGS", "").split(",")))
for _name in _active:
    if _name not in BUGS:
        raise KeyError(f"REFSPEC_BUGS names unknown variant {_name!r}; known: {sorted(BUGS)}")


def is_on(name: str) -> bool:
    """Whether the named variant is switched on (KeyError for an unknown name)."""
    if name not in BUGS:
        raise KeyError(f"unknown bug variant {name!r}")
    return name in _active


@contextmanager
def enabled(*names: str):
    """Switch the named variants on inside the ``with`` block."""
    for n in names:
        is_on(n)
    added = set(names) - _active
    _active.update(added)
    try:
        yield
    finally:
        _active.difference_update(added)


@contextmanager
def disabled():
    """Switch every variant off inside the ``with`` block (references the oracle computes)."""
    saved = set(_active)
    _active.clear()
    try:
        yield
    finally:
        _active.update(saved)


def active() -> set[str]:
    return set(_active)
