"""The bug zoo: named wrong variants that can be switched on inside the production wing.

Each variant is a real bug (or a real near-miss) from SGLang / vLLM / FA3 history, kept as a
switch so that the suite can prove it would catch it.  Code never has to be edited to turn one
on: ``with bugs.enabled("de-v2-k-double-count"): ...`` or ``REFSPEC_BUGS=name1,name2``.

The production wing asks :func:`is_on` at exactly the line the bug lived on; with no variant on,
every such ``if`` is dead.  The oracle wing never looks here.
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
    caught_by: tuple[str, ...]  #: invariant IDs whose checks catch it


BUGS: dict[str, Bug] = {b.name: b for b in [
    Bug("seed-page-table",
        "draft-decode and target-verify replay copy token slots into the page table (no ::P, no // P)",
        "spec §2.3; SGLang A0 93470a141 (#5090), fixed by #5318 188f0955f; #5168",
        "P > 1: FA3 reads slot ids as page ids -> wrong pages (garbage text) or out-of-range pages",
        ("PA-002", "CG-002", "SD-002")),
    Bug("de-v1-uniform-cu-q",
        "v1 draft-extend replay uses v2's uniform cu_seqlens_q [0, W, 2W, ...]",
        "spec §4.6 'v2 logic applied to v1'; Triton #19807 376dfb03f",
        "rows misaligned whenever some a_b < W: wrong draft tokens, lower acceptance, no crash",
        ("CG-003", "MD-005")),
    Bug("de-v2-packed-cu-q",
        "v2 draft-extend replay uses v1's packed cumsum(num_accept_tokens) for cu_seqlens_q",
        "spec §4.6 'v1 logic applied to v2'; sglang #21987, #25002, #27545",
        "kept row reads rejected drafts' KV; rows past sum(a) never written (garbage / NaN)",
        ("CG-004", "MD-002")),
    Bug("de-v1-accept-off-by-one",
        "v1 draft-extend cu_seqlens_q from num_correct_drafts n instead of num_accept_tokens n + 1",
        "spec §0.2 (accept_length_cpu is n, the GPU tensor is n + 1), §4.4 item 4",
        "each request loses its bonus row; later requests shift by one row per request",
        ("CG-003", "MD-009")),
    Bug("de-v2-k-double-count",
        "DRAFT_EXTEND_V2 cache_seqlens = seq_lens + extend_seq_lens (L + 2N)",
        "spec §3.8; sglang #26512 e5f5d8478, reverted by #26628",
        "every row sees N positions past what was written (stale KV or dummy page 0)",
        ("MD-008", "MD-005")),
    Bug("replay-rebind-page-table",
        "replay assigns a new page-table tensor instead of copying into the captured one",
        "spec §2.3 (#4855 6ffb6bd47); case B11 (#26019)",
        "the graph keeps reading the capture-time table: stale pages, wrong output",
        ("CG-001",)),
    Bug("replay-rebind-cache-seqlens",
        "replay assigns a new cache_seqlens tensor instead of copying into the captured one",
        "spec §2.3 (#4855); case B11",
        "the graph keeps reading the capture-time lengths",
        ("CG-001",)),
    Bug("stale-padded-rows",
        "replay copies only the real rows; padded rows keep the previous replay's values",
        "case B04 (vllm-ascend #7290)",
        "padded rows read stale lengths / pages of an earlier batch",
        ("CG-005",)),
    Bug("pad-seq-lens-zero",
        "padded rows get seq_lens fill 0 (SGLang before #7233 c64290dcb)",
        "spec §4.1; cases B03, B10",
        "padded multi-token rows have K < q (empty causal span)",
        ("CG-005", "CG-010")),
    Bug("capture-max-seqlen-q-small",
        "draft-extend graph captured with max_seqlen_q = the dummy batch's q (1), not Sd + 1",
        "case B08 (transformers #45323); spec §1.5",
        "live requests with more query rows than the frozen max_seqlen_q: undefined kernel result",
        ("CG-006", "PA-010")),
    Bug("page-table-width-from-context",
        "graph page-table buffers sized ceil(max_context / P) instead of from req_to_token.shape[1]",
        "spec §2.4; case B07 (sglang #35985, #29665)",
        "near the context wall verify / draft extend need more pages than the table has",
        ("CG-008", "PA-003")),
    Bug("free-last-committed-page",
        "v1 rejected-slot free also frees the page holding the last committed token",
        "spec §5.1 step 3 (align_evict_mask_to_page_size)",
        "a committed token's page is reused by another request: its KV is overwritten",
        ("KV-004", "KV-003")),
    Bug("de-v1-attend-rejected",
        "v1 draft extend uses K = L + N (all verify slots) instead of L' = L + a",
        "spec §5.4 (v1 K is L + a), §7 item 17",
        "the kept row attends to rejected drafts' KV",
        ("MD-005", "MD-003")),
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


def active() -> set[str]:
    return set(_active)
