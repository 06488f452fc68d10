"""Checks run before every FA3 kernel call (on by default; ``validate=False`` for benchmarks).

Each failure raises :class:`~refspec.core.invariants.InvariantError` naming the rule:

* MD-001: every metadata tensor is int32 and contiguous;
* MD-002: ``cu_seqlens_q`` starts at 0, does not decrease, and gives the mode's q_b;
* MD-004: K_b >= q_b for real rows;
* MD-005: INV-TAIL, ``out_cache_loc[cu_q[b] + i] == req_to_token[r_b, K_b - q_b + i]``: the
  query tokens are the last q_b keys, so a wrong K (off by one, double counted) or a wrong
  ``cu_seqlens_q`` shows here;
* MD-006: ``cu_seqlens_k = [0, cumsum K]``;
* PA-008 (checked before PA-001 / PA-002): no real request uses row 0 or has a key in the
  reserved page 0 (an unreserved position, as vLLM #16370's draft tokens written past the pages
  reserved for the request: its ``req_to_token`` entry is still 0;
  the checks below would only see its symptom, e.g. a broken page-contiguity, PA-001);
* PA-001 / PA-002: the page table reproduces ``req_to_token`` for every visible position
  (which also catches a non-page-contiguous row, and a table in the wrong unit);
* PA-003: the table is wide enough; PA-010: ``max_seq_len_q`` covers every request;
* MD-012: the real requests write distinct slots (checked after the per-request rules above,
  so that each of them keeps naming its own violations; distinct rows: :func:`validate_batch`).

:func:`validate_batch` runs *before* the metadata is built: ``req_pool_indices`` inside
``req_to_token`` and fields of one batch size (ValueError), the CPU mirror ``seq_lens_cpu == seq_lens`` (MD-006; the
metadata's ``max_seqlen_k`` and page-table width come from it) and distinct rows (MD-012).  In the
overlap loop ``seq_lens_cpu`` is an upper bound (``fb.seq_lens_cpu_is_bound``) and MD-006 asks
``seq_lens <= seq_lens_cpu`` instead; every other check reads the exact device values.

Every check reads device tensors on the host: on a GPU the first read of a call waits for the
stream.  The engine counts one ``"validation"`` sync per validated metadata build
(``Engine.syncs``), apart from the model-result reads.

Only the first ``num_real`` rows are checked (padded graph rows are ignored, CG-005 checks
them).  Cost: O(sum K) integer work on the host per call.
"""

from __future__ import annotations

import torch

from refspec.core.batch import ForwardBatch, check_batch_shapes
from refspec.fa3.metadata import FlashAttentionMetadata
from refspec.core.invariants import InvariantError, require


def validate_batch(fb: ForwardBatch, req_to_token: torch.Tensor, num_real: int | None = None) -> None:
    """Check the first ``num_real`` (default all) requests of ``fb`` before metadata is built.

    Raises: ValueError (a row outside ``req_to_token``), InvariantError MD-006 (``seq_lens_cpu``
    disagrees with ``seq_lens``), MD-012 (a repeated row); ValueError from
    :func:`refspec.core.batch.check_batch_shapes` (fields of different batch sizes).
    """
    check_batch_shapes(fb)
    B = fb.batch_size if num_real is None else num_real
    if B == 0:
        return
    rows = fb.req_pool_indices[:B].tolist()
    R = req_to_token.shape[0]
    bad = [r for r in rows if not 0 <= r < R]
    if bad:
        raise ValueError(f"req_pool_indices {bad} outside req_to_token rows [0, {R})")
    dev, cpu = fb.seq_lens[:B].tolist(), fb.seq_lens_cpu[:B].tolist()
    if fb.seq_lens_cpu_is_bound:  # overlap: a host upper bound, not a mirror
        require(all(d <= c for d, c in zip(dev, cpu)), "MD-006",
                f"seq_lens_cpu {cpu} is no upper bound of seq_lens {dev}")
    else:
        require(dev == cpu, "MD-006", f"seq_lens_cpu {cpu} is not a mirror of seq_lens {dev}")
    require(len(set(rows)) == B, "MD-012", f"req_pool_indices {rows} repeat a row")


def validate_metadata(md: FlashAttentionMetadata, fb: ForwardBatch, req_to_token: torch.Tensor,
                      page_size: int, num_real: int | None = None, max_seqlen_q: int | None = None) -> None:
    """Check ``md`` against ``fb`` (see module doc).  ``max_seqlen_q``: the frozen value in force."""
    B = fb.batch_size if num_real is None else num_real
    for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"):
        t = getattr(md, name)
        ok = t.dtype == torch.int32 and t.is_contiguous() and (t.numel() == 0 or t.stride(-1) == 1)
        require(ok, "MD-001", f"{name}: {t.dtype}, contiguous={t.is_contiguous()}, strides {t.stride()}")
    if B == 0:
        return
    P = page_size
    K = md.cache_seqlens_int32[:B].tolist()
    cu = md.cu_seqlens_q.tolist()
    require(cu[0] == 0 and all(x <= y for x, y in zip(cu, cu[1:])), "MD-002", f"cu_seqlens_q = {cu}")
    q_expected = fb.q_lens_cpu()[:B]
    q = [cu[b + 1] - cu[b] for b in range(B)]
    require(q == q_expected, "MD-002", f"{fb.forward_mode.name}: q lens {q}, the mode requires {q_expected}")
    cuk = md.cu_seqlens_k.tolist()
    require(cuk[0] == 0 and all(cuk[b + 1] - cuk[b] == K[b] for b in range(B)), "MD-006",
            f"cu_seqlens_k {cuk[:B + 1]} vs K {K}")
    max_q = md.max_seq_len_q if max_seqlen_q is None else max_seqlen_q
    require(max(q) <= max_q, "PA-010", f"q lens {q}, max_seqlen_q {max_q}")
    loc = fb.out_cache_loc.tolist()
    pt = md.page_table
    for b in range(B):
        r, Kb, qb = int(fb.req_pool_indices[b]), K[b], q[b]
        require(Kb >= qb, "MD-004", f"request {b}: K={Kb} < q={qb}")
        require(-(-Kb // P) <= pt.shape[1], "PA-003",
                f"request {b}: K={Kb} needs {-(-Kb // P)} pages, width {pt.shape[1]}")
        row = req_to_token[r, :Kb].long()
        tail = row[Kb - qb:].tolist()
        mine = loc[cu[b]:cu[b + 1]]
        require(tail == mine, "MD-005", lambda: f"request {b} (K={Kb}, q={qb}): out_cache_loc {mine} "
                f"!= req_to_token[{r}, {Kb - qb}:{Kb}] {tail}")
        # an unreserved position still reads 0 in req_to_token: it would write / read the dummy page 0.
        # Checked before PA-001 / PA-002, which would only see its symptom (a broken page-contiguity).
        require(r != 0 and not bool((row < P).any()), "PA-008", lambda: f"request {b} (row {r}, K={Kb}): "
                f"position(s) {(row < P).nonzero().flatten().tolist()} map to the reserved page 0: no slot was "
                f"reserved for them (alloc_extend them first)")
        p = torch.arange(Kb, device=row.device)
        via_table = pt[b, p // P].long() * P + p % P
        if not torch.equal(via_table, row):
            bad = int((via_table != row).nonzero()[0])
            ids = "PA-001" if int(row[bad]) % P != bad % P else "PA-002"
            raise InvariantError(ids, f"request {b} position {bad}: page_table gives slot {int(via_table[bad])}, "
                                 f"req_to_token[{r}] holds {int(row[bad])} (P={P})")
    real = loc[:cu[B]]  # distinct rows: validate_batch, which runs first
    require(len(set(real)) == len(real), "MD-012", lambda: f"out_cache_loc {real} writes a slot twice")
