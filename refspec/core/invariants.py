"""The invariant catalogue: every rule refspec checks has a permanent ID.

IDs are grouped by family (conventions.md, "Spec in docs/"):

* ``PA-`` paging and attention semantics (the FA3 kernel contract),
* ``KV-`` KV-cache accounting (allocator, req_to_token),
* ``MD-`` attention metadata per forward mode,
* ``CG-`` CUDA-graph capture and replay,
* ``SD-`` the speculative-decoding loop,
* ``TR-`` top-k > 1 trees (construction, mask, acceptance, the FA3 tree path),
* ``TOL-`` tolerance tiers.

``docs/spec/*.md`` states each rule in full (MUST/SHOULD, why, a worked example, the upstream
source, the tests).  This module holds the one-line titles so that code can raise errors that
name the rule, and a meta-test checks that docs, code and tests agree on the set of IDs.
"""

from __future__ import annotations

INVARIANTS: dict[str, str] = {
    # --- paging / attention (spec §1, §2) ---
    "PA-001": "req_to_token rows are page-contiguous (INV-PAGE)",
    "PA-002": "page_table[b, p // P] * P + p % P == req_to_token[r_b, p] for every p < K_b",
    "PA-003": "page_table has at least ceil(K_b / P) columns for every request",
    "PA-004": "bottom-right causal: query row i of request b sees key p iff p <= i + K_b - q_b",
    "PA-005": "a query row with no visible key outputs exactly 0",
    "PA-006": "GQA: query head h reads KV head h // (H / Hkv)",
    "PA-007": "the kernel reads no page-table column >= ceil(K_b / P) and no key >= K_b",
    "PA-008": "page 0 and req_to_token row 0 are reserved dummies, never given to a request",
    "PA-009": "store-then-attend: new K/V are written at out_cache_loc before the kernel runs",
    "PA-010": "every request's query length fits max_seqlen_q",
    "PA-011": "kernel arguments are well formed (dtypes, shapes, page ids in the pool)",
    # --- KV accounting (spec §2.2, §5) ---
    "KV-001": "alloc_extend continues the request's last partial page (INV-PAGE is kept)",
    "KV-002": "free is page-granular and the free-page count is exact",
    "KV-003": "exhaustion, double free and freeing reserved pages raise",
    "KV-004": "v1 rejected slots: keep the page holding the last committed token, free whole pages after it",
    "KV-005": "v2 over-allocation: allocate_len = seq_len + N before a round, nothing freed inside it",
    "KV-006": "when every request has finished, the free-page count returns to its start",
    # --- metadata per mode (spec §3.3, §7 items 1-6) ---
    "MD-001": "all metadata tensors are int32 and contiguous",
    "MD-002": "cu_seqlens_q starts at 0, is non-decreasing and gives the mode's q_b",
    "MD-003": "cache_seqlens K_b equals the mode's formula (spec §3.3)",
    "MD-004": "K_b >= q_b for every real request",
    "MD-005": "INV-TAIL: out_cache_loc[cu_q[b] + i] == req_to_token[r_b, K_b - q_b + i]",
    "MD-006": "cu_seqlens_k = [0, cumsum K]; max_seqlen_k comes from the CPU mirror",
    "MD-007": "page_table = req_to_token[r, ::P] // P over ceil(max K / P) columns",
    "MD-008": "DRAFT_EXTEND_V2: K_b = seq_lens (= L + N); extend_seq_lens is never added again",
    "MD-009": "DRAFT_EXTEND (v1): q_b = num_accept_tokens = n + 1, packed",
    "MD-010": "draft decode step s: q_b = 1, K_b = L_b + s + 1",
    "MD-011": "TARGET_VERIFY: q_b = N, K_b = L_b + N",
    "MD-012": "the real requests of a batch have distinct req_to_token rows and write distinct slots",
    # --- CUDA graphs (spec §1.5, §4, §7 items 7-11) ---
    "CG-001": "replay writes captured buffers in place and never rebinds them (address stability)",
    "CG-002": "replay equals eager on real rows",
    "CG-003": "DRAFT_EXTEND (v1) replay: cu_seqlens_q = [0, cumsum(num_accept_tokens)]",
    "CG-004": "DRAFT_EXTEND_V2 replay: cu_seqlens_q = [0, W, 2W, ..., Bg*W] from extend_seq_lens",
    "CG-005": "padded rows get the fills (seq_lens 1, out_cache_loc 0, req_pool_indices 0), rewritten every replay",
    "CG-006": "captured max_seqlen_q is the mode's bound (1, N, Sd+1) and covers every live query",
    "CG-007": "replay picks the smallest captured batch size >= the live batch; larger batches run eagerly",
    "CG-008": "page-table buffers are sized from req_to_token.shape[1]; replay checks the pages fit",
    "CG-009": "real-row outputs do not depend on the padded batch size",
    "CG-010": "capture-time dummy metadata has K >= q (no empty causal span)",
    # --- spec decode (spec §5) ---
    "SD-001": "greedy acceptance: n = longest prefix with d_i == p_(i-1); num_accept_tokens a = n + 1",
    "SD-002": "lossless: speculative output tokens equal plain greedy decoding of the target",
    "SD-003": "accept length = emitted tokens / verify rounds, in [1, Sd + 1]",
    "SD-004": "v1 draft extend runs the a accepted tokens packed and keeps each request's last row",
    "SD-005": "v2 draft extend runs all N rows per request and keeps row b * N + a_b - 1",
    "SD-006": "v1 and v2 draft extend agree on the kept row; rows >= a_b cannot affect rows < a_b",
    "SD-007": "the draft position rule: the draft token at KV index p runs at RoPE position p",
    "SD-008": "after every round target-KV length == draft-KV length == prompt + sum(a)",
    "SD-009": "per-request results do not depend on batch composition or order",
    "SD-010": "top-k = 1: N = Sd + 1 draft tokens are verified per request",
    # --- top-k trees, the oracle side (docs/spec/tree.md, "Tree structure and the oracle") ---
    "TR-001": "tree expansion: k root children, then each frontier row's top-k, cumulative product scores, top-k of k^2",
    "TR-002": "selection: the N-1 drafts are the top-(N-1) of k + (Sd-1)k^2 scores, sorted by candidate id",
    "TR-003": "tree links: node 0 is the root; a node's parent is the node of its parent candidate; children ascending",
    "TR-004": "ancestor mask: verify row i sees the prefix, itself and its ancestors, nothing else of the tree",
    "TR-005": "tree positions: node i runs at RoPE position L + depth(i)",
    "TR-006": "greedy tree acceptance: from the root take the child equal to the target argmax; a = n + 1",
    "TR-007": "accepted-path commit: the path's target KV moves to L..L+a-1; the draft extend runs the path first",
    "TR-008": "tree draft decode: row t at step s sees the prefix and the KV its own row wrote at steps 0..s",
    "TR-009": "lossless tree: the top-k tree loop equals plain greedy (and the chain loop at top-k = 1)",
    # --- tolerances ---
    "TOL-001": "T0: bitwise equality (metadata, bookkeeping, graph vs eager, fp32 token streams)",
    "TOL-002": "T1: low-precision error <= 2x the oracle's own low-precision error + a floor",
    "TOL-003": "T2: tokens equal except where the baseline's top-2 logit margin is below delta",
}


class InvariantError(ValueError):
    """A violated refspec invariant.

    ``str(err)`` starts with ``[ID]`` and the rule's title, then says what was seen, so that a
    failure message can be quoted in a review as is.  ``err.inv_id`` holds the ID.
    """

    def __init__(self, inv_id: str, detail: str):
        if inv_id not in INVARIANTS:
            raise KeyError(f"unknown invariant id {inv_id!r}")
        self.inv_id = inv_id
        self.detail = detail
        super().__init__(f"[{inv_id}] {INVARIANTS[inv_id]}: {detail}")


def require(cond: bool, inv_id: str, detail) -> None:
    """Raise :class:`InvariantError` ``inv_id`` unless ``cond``; ``detail`` may be a callable."""
    if not cond:
        raise InvariantError(inv_id, detail() if callable(detail) else detail)
