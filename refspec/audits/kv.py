"""KV accounting audit of a running engine (what SGLang's strict memory-leak check asserts, and more).

:func:`audit_kv` checks the allocator and ``req_to_token`` against the engine's per-request
lengths; tests call it from the observer after every round.  Each failure raises
:class:`~refspec.core.invariants.InvariantError` naming the rule:

* PA-001: every live row is page-contiguous over its allocated positions (INV-PAGE);
* KV-004 / KV-005: no page holding a committed token is free;
* KV-002: live rows own disjoint pages, and the pages in use are exactly
  ``sum(ceil(alloc_len / P))`` over live requests (no leak, no early free);
* SD-008: target-KV length == draft-KV length == committed length;
* KV-007: the allocator's host mirror of ``req_to_token`` equals the device copy (this reads
  the device: an audit, not the hot path).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from refspec.core.invariants import require


def audit_kv(eng) -> None:
    """Check the invariants above on ``eng.running`` (an :class:`~refspec.speculative.engine.Engine`)."""
    kv, P, alloc = eng.kv, eng.P, eng.kv.allocator
    kv.check_mirror()
    owner: dict[int, int] = {}
    expected_pages = 0
    for r in eng.running:
        kv.check_page_contiguous(r.row, r.alloc_len)
        committed = set(kv.row_pages(r.row, r.seq_len))
        free = sorted(p for p in committed if not alloc.is_in_use(p))
        require(not free, "KV-004" if eng.version == "v1" else "KV-005",
                f"request {r.rid}: pages {free} hold committed tokens (L={r.seq_len}) but are free")
        pages = kv.row_pages(r.row, r.alloc_len)
        for p in pages:
            require(p not in owner, "KV-002", f"page {p} owned by requests {owner.get(p)} and {r.rid}")
            owner[p] = r.rid
        expected_pages += -(-r.alloc_len // P)
        require(r.target_kv_len == r.draft_kv_len == r.seq_len, "SD-008",
                f"request {r.rid}: target KV {r.target_kv_len}, draft KV {r.draft_kv_len}, L {r.seq_len}")
    in_use = alloc.num_pages - 1 - alloc.num_free_pages
    require(in_use == expected_pages, "KV-002",
            f"{in_use} pages in use, live requests account for {expected_pages}")
