"""One speculative round, v1 and v2, over the running batch (docs/spec/spec-decode.md, docs/spec/kv.md).

Both return, per request, the row ``[a, c_0..c_(N-1), d_1..d_Sd, draft_len]`` (``c`` the
committed candidates of :func:`~refspec.speculative.accept.committed_candidates`, ``c[:a]`` the emitted
tokens; ``draft_len`` the draft KV length the draft extend committed: the kept row's KV index
+ 1): v1 as a host list (it had to read it inside the round), v2 as a device tensor
``[B, 2 + N + Sd]`` that the engine reads after the round.  Both leave each request's next ``root``, ``d1`` and
``dhid`` on the device.

Shapes: B requests, N = Sd + 1; token tensors int64; hidden ``[., E]`` in the model dtype.
"""

from __future__ import annotations

import torch

from refspec.core.batch import draft_decode_steps_batch, draft_extend_batch, draft_extend_v2_batch, verify_batch
from refspec.speculative.accept import committed_candidates


def _start(eng, reqs):
    """d_1 (a drafter may override it), the roots, the draft hidden, and the forced drafts."""
    forced = eng.forced_drafts(reqs)
    d1 = torch.where(forced[:, 0] >= 0, forced[:, 0], torch.stack([r.d1 for r in reqs]))
    roots = torch.stack([r.root for r in reqs])
    dhid = torch.stack([r.dhid for r in reqs]) if eng.draft.uses_hidden else None
    return forced, d1, roots, dhid


def _draft(eng, reqs, rows, L, forced, d1, dhid):
    """Sd - 1 draft-decode steps at KV L..L+Sd-2 (slots must exist in R): drafts ``[B, Sd]``."""
    if eng.Sd == 1:
        return d1[:, None]
    fb = draft_decode_steps_batch(eng.kv, rows, L, eng.Sd)
    rest = eng.runners.draft_decode(fb, d1, forced[:, 1:], dhid)
    eng.observe("draft_decode", reqs=reqs, fb=fb)
    return torch.cat([d1[:, None], rest], dim=1)


def _verify(eng, reqs, rows, L, roots, drafts):
    """TARGET_VERIFY on [t_L, d_1..d_Sd] at L..L+N-1: predictions ``[B, N]``, hidden ``[B*N, E]``, n, c."""
    B, N = len(reqs), eng.N
    fb = verify_batch(eng.kv, rows, L, N)
    logits, hidden = eng.runners.verify(torch.cat([roots[:, None], drafts], dim=1).flatten(), fb)
    eng.observe("verify", reqs=reqs, fb=fb)
    predict = logits.argmax(-1).view(B, N)
    n = eng.accept_counts(reqs, drafts, predict)
    return hidden, n, committed_candidates(drafts, predict, n)


def _next_state(eng, reqs, cand, dl, dh, keep, a):
    """Kept draft rows -> next d_1 / hidden; the bonus c[b, a_b - 1] -> next root."""
    d1 = dl[keep].argmax(-1)
    roots = cand.gather(1, (a - 1)[:, None])[:, 0]
    dh_keep = dh[keep] if eng.draft.uses_hidden else None
    for b, r in enumerate(reqs):
        r.root, r.d1 = roots[b], d1[b]
        r.dhid = None if dh_keep is None else dh_keep[b]


def round_v1(eng, reqs) -> list[list[int]]:
    """v1 (non-overlap): transient draft slots, verify, page-aligned free, packed draft extend."""
    kv, N, Sd = eng.kv, eng.N, eng.Sd
    rows, L = [r.row for r in reqs], [r.seq_len for r in reqs]
    forced, d1, roots, dhid = _start(eng, reqs)
    # 1. draft: slots L..L+Sd-1 allocated, written into R, then the allocator is restored
    if Sd > 1:
        state = kv.allocator.backup_state()
        kv.alloc_extend(rows, L, [l + Sd for l in L])
        drafts = _draft(eng, reqs, rows, L, forced, d1, dhid)
        kv.allocator.restore_state(state)
    else:
        drafts = d1[:, None]
    # 2. verify: allocate L..L+N-1
    kv.alloc_extend(rows, L, [l + N for l in L])
    for r, l in zip(reqs, L):
        r.alloc_len = l + N
    hidden, n, cand = _verify(eng, reqs, rows, L, roots, drafts)
    a_dev = n + 1
    host = eng.host("in_round", torch.cat([a_dev[:, None], cand, drafts], dim=1))  # v1 needs a on the host
    a = [row[0] for row in host]
    # 3. commit; free rejected slots page-aligned: keep the page of position L+a-1 (KV-004)
    for r, l, ab in zip(reqs, L, a):
        kv.free_tail(r.row, keep_len=l + ab, alloc_len=l + N)
        r.alloc_len = r.seq_len = r.target_kv_len = l + ab
    # 4. draft extend on the a committed tokens, packed (SD-004)
    fb = draft_extend_batch(kv, rows, [l + ab for l, ab in zip(L, a)], a, num_draft_tokens=N)
    sel = eng.ids([b * N + i for b, ab in enumerate(a) for i in range(ab)])
    dl, dh = eng.runners.draft_extend(fb, cand.flatten()[sel], hidden[sel])
    eng.observe("draft_extend", reqs=reqs, fb=fb)
    keep = eng.ids([sum(a[:b + 1]) - 1 for b in range(len(a))])  # the last row of each request
    _next_state(eng, reqs, cand, dl, dh, keep, a_dev)
    for r, row, K in zip(reqs, host, fb.seq_lens_cpu.tolist()):  # the extent the draft extend wrote
        r.draft_kv_len = K
        row.append(K)
    return host


def prepare_v2(eng, reqs) -> None:
    """Before a v2 round: top each row up to ``allocate_len = seq_len + N`` (KV-005)."""
    need = [r for r in reqs if r.alloc_len < r.seq_len + eng.N]
    if need:
        eng.kv.alloc_extend([r.row for r in need], [r.alloc_len for r in need], [r.seq_len + eng.N for r in need])
    for r in need:
        r.alloc_len = r.seq_len + eng.N


def round_v2(eng, reqs) -> torch.Tensor:
    """v2 (overlap style): no allocation, no free and no host read inside the round."""
    kv, N = eng.kv, eng.N
    rows, L = [r.row for r in reqs], [r.seq_len for r in reqs]
    forced, d1, roots, dhid = _start(eng, reqs)
    drafts = _draft(eng, reqs, rows, L, forced, d1, dhid)  # slots exist (over-allocated)
    hidden, n, cand = _verify(eng, reqs, rows, L, roots, drafts)
    a_dev = n + 1
    # draft extend over all N rows at L..L+N-1 (metadata CPU-known: seq_lens = L + N), SD-005
    fb = draft_extend_v2_batch(kv, rows, [l + N for l in L], N)
    fb.num_accept_tokens = a_dev.to(torch.int32)  # device only; used to select the kept row
    dl, dh = eng.runners.draft_extend(fb, cand.flatten(), hidden)
    eng.observe("draft_extend", reqs=reqs, fb=fb)
    keep = torch.arange(len(reqs), device=a_dev.device) * N + a_dev - 1  # row b*N + a_b - 1
    _next_state(eng, reqs, cand, dl, dh, keep, a_dev)
    draft_len = fb.positions[keep] + 1  # the kept row's KV index + 1
    return torch.cat([a_dev[:, None], cand, drafts, draft_len[:, None]], dim=1)
