"""One speculative round, v1 and v2, over the running batch (docs/spec/spec-decode.md, docs/spec/kv.md).

Both return, per request, the round's result row (:mod:`refspec.speculative.round_row`:
a, the committed candidates, the drafts, the draft KV length): v1 as host
:class:`~refspec.speculative.round_row.RoundRow` s (it had to read a inside the round), v2 as one
device tensor ``[B, 3 + N + Sd]`` (those rows, then the device's L) that the engine reads after
the round.
Both leave each request's next ``seq_len``, ``root``, ``d1`` and draft hidden on the device,
in the engine's future map (:mod:`refspec.speculative.future`), and read them from it at the
start.  The overlap loop (:mod:`refspec.speculative.overlap`) runs :func:`round_v2` as it is,
with its batches built from the device lengths and host bounds (``batches=``).

Shapes: B requests, N = Sd + 1; token tensors int64; hidden ``[., E]`` in the model dtype.

Upstream (SGLang's two workers; each one's ``forward_batch_generation`` is one round):

* :func:`round_v1` is ``EAGLEWorker`` at v0.5.12.post1 (the last release with v1), its
  ``forward_batch_generation`` (line 445) calling ``draft`` (758), ``verify`` (935) and
  ``forward_draft_extend_after_decode`` (1154):
  https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/speculative/eagle_worker.py#L445
* :func:`round_v2` is ``EAGLEWorkerV2`` at v0.5.23, its ``forward_batch_generation`` (line 1416)
  calling ``EagleDraftWorker.draft`` (660), ``verify`` (1979) and
  ``EagleDraftWorker._draft_extend_for_decode`` (1110):
  https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_worker_v2.py#L1416

**What the round uses of the engine** (``eng``, :class:`~refspec.speculative.engine.Engine`, the
next module; ``reqs`` are its :class:`~refspec.speculative.request.Request` s):

* ``eng.Sd``, ``eng.N``: draft steps and verified tokens per request (N = Sd + 1);
* ``eng.kv``: the shared :class:`~refspec.core.kv_cache.KVCache` (``req_to_token``, allocator);
  ``eng.device``: where the tensors live;
* ``eng.runners``: the :class:`~refspec.speculative.runners.SpecRunners`, one call per phase
  (``draft_decode``, ``verify``, ``draft_extend``), each eager or a graph replay;
* ``eng.future``: the :class:`~refspec.speculative.future.FutureMap`, per ``req_to_token`` row
  the next round's L, root, d_1 and draft hidden (``gather`` at the start, ``stash`` at the end);
* ``eng.draft.uses_hidden``: whether the draft model takes the target hidden (an EAGLE head);
* ``eng.accept_counts(reqs, drafts, predict)``: n ``[B]`` on the device (greedy SD-001, or a
  scripted acceptance); ``eng.forced_drafts(reqs, rows_dev, L_dev)``: a test drafter's tokens
  ``[B, Sd]`` or None;
* ``eng.host(kind, t)``: the one counted device -> host read; ``eng.observe(event, **info)``:
  the observer hook after each forward.

Of each request it reads ``row`` (its ``req_to_token`` row) and ``seq_len`` (L); v1 writes
``alloc_len`` / ``seq_len`` / ``target_kv_len`` (tokens) inside the round, :func:`prepare_v2`
writes ``alloc_len`` before a v2 round.
"""

from __future__ import annotations

import torch

from refspec.core.constants import const_arange
from refspec.core.batch import draft_decode_steps_batch, draft_extend_batch, draft_extend_v2_batch, verify_batch
from refspec.core.transfer import h2d, h2d_many
from refspec.speculative.accept import committed_candidates
from refspec.speculative.round_row import RoundRow, pack


def _start(eng, reqs):
    """Rows ``[B]`` (device), the forced drafts (None without a drafter that overrides them), d_1
    (a drafter may override it), the roots and the draft hidden (gathered from the future map),
    and the device L ``[B]``."""
    rows_dev = h2d([r.row for r in reqs], eng.device)
    L_dev, roots, d1, dhid = eng.future.gather(rows_dev)
    forced = eng.forced_drafts(reqs, rows_dev, L_dev)
    if forced is not None:
        d1 = torch.where(forced[:, 0] >= 0, forced[:, 0], d1)
    return rows_dev, forced, d1, roots, dhid, L_dev


def _draft(eng, reqs, fb, forced, d1, dhid):
    """Sd - 1 draft-decode steps on ``fb`` (KV L..L+Sd-2, or None when Sd = 1): drafts ``[B, Sd]``."""
    if eng.Sd == 1:
        return d1[:, None]
    rest = eng.runners.draft_decode(fb, d1, None if forced is None else forced[:, 1:], dhid)
    eng.observe("draft_decode", reqs=reqs, fb=fb)
    return torch.cat([d1[:, None], rest], dim=1)


def _verify(eng, reqs, fb, roots, drafts):
    """TARGET_VERIFY on [t_L, d_1..d_Sd] at L..L+N-1: hidden ``[B*N, E]``, n ``[B]``, c ``[B, N]``
    (the verify rows' argmax comes out of the forward, :class:`~refspec.speculative.runners.SpecRunners`)."""
    B, N = len(reqs), eng.N
    predict, hidden = eng.runners.verify(torch.cat([roots[:, None], drafts], dim=1).flatten(), fb)
    eng.observe("verify", reqs=reqs, fb=fb)
    predict = predict.view(B, N)
    n = eng.accept_counts(reqs, drafts, predict)
    return hidden, n, committed_candidates(drafts, predict, n)


def _next_state(eng, rows_dev, new_seq_lens, cand, d_next, dh, keep, a):
    """Into the future map: the next L, the bonus c[b, a_b - 1] (next root), the kept draft
    rows' argmax (next d_1; ``d_next [T]`` is every draft-extend row's) and hidden."""
    roots = cand.gather(1, (a - 1)[:, None])[:, 0]
    dh_keep = dh[keep] if eng.draft.uses_hidden else None
    eng.future.stash(rows_dev, seq_lens=new_seq_lens, root=roots, d1=d_next[keep], hidden=dh_keep)


def round_v1(eng, reqs) -> list[RoundRow]:
    """v1 (non-overlap): transient draft slots, verify, page-aligned free, packed draft extend."""
    kv, N, Sd = eng.kv, eng.N, eng.Sd
    rows, L = [r.row for r in reqs], [r.seq_len for r in reqs]
    rows_dev, forced, d1, roots, dhid, _ = _start(eng, reqs)
    # 1. draft: slots L..L+Sd-1 allocated, written into req_to_token, then the allocator is restored
    if Sd > 1:
        state = kv.allocator.backup_state()
        kv.alloc_extend(rows, L, [l + Sd for l in L])
        drafts = _draft(eng, reqs, draft_decode_steps_batch(kv, rows, L, Sd), forced, d1, dhid)
        kv.allocator.restore_state(state)
    else:
        drafts = d1[:, None]
    # 2. verify: allocate L..L+N-1
    kv.alloc_extend(rows, L, [l + N for l in L])
    for r, l in zip(reqs, L):
        r.alloc_len = l + N
    hidden, n, cand = _verify(eng, reqs, verify_batch(kv, rows, L, N), roots, drafts)
    a_dev = n + 1
    host = eng.host("in_round", torch.cat([a_dev[:, None], cand, drafts], dim=1))  # v1 needs a on the host
    a = [h[0] for h in host]
    # 3. commit; free rejected slots page-aligned: keep the page of position L+a-1 (KV-004)
    for r, l, ab in zip(reqs, L, a):
        kv.free_tail(r.row, keep_len=l + ab, alloc_len=l + N)
        r.alloc_len = r.seq_len = r.target_kv_len = l + ab
    # 4. draft extend on the a committed tokens, packed (SD-004)
    fb = draft_extend_batch(kv, rows, [l + ab for l, ab in zip(L, a)], a, num_draft_tokens=N)
    sel, keep = h2d_many([[b * N + i for b, ab in enumerate(a) for i in range(ab)],
                          [sum(a[:b + 1]) - 1 for b in range(len(a))]], eng.device)  # keep: each one's last row
    d_next, dh = eng.runners.draft_extend(fb, cand.flatten()[sel], None if hidden is None else hidden[sel])
    eng.observe("draft_extend", reqs=reqs, fb=fb)
    _next_state(eng, rows_dev, fb.seq_lens, cand, d_next, dh, keep, a_dev)
    K = fb.seq_lens_cpu.tolist()  # the extent the draft extend wrote
    return [RoundRow(h[0], h[1:1 + N], h[1 + N:], k) for h, k in zip(host, K)]


def prepare_v2(eng, reqs) -> None:
    """Before a v2 round: top each row up to ``allocate_len = seq_len + N`` (KV-005)."""
    need = [r for r in reqs if r.alloc_len < r.seq_len + eng.N]
    if need:
        eng.kv.alloc_extend([r.row for r in need], [r.alloc_len for r in need], [r.seq_len + eng.N for r in need])
    for r in need:
        r.alloc_len = r.seq_len + eng.N


def host_batches(eng, reqs, rows_dev, L_dev):
    """v2's three batches from the host's exact L: draft decode steps (None if Sd = 1), verify
    at L, draft extend v2 at L + N (metadata CPU-known, SD-005)."""
    kv, N, rows, L = eng.kv, eng.N, [r.row for r in reqs], [r.seq_len for r in reqs]
    steps = draft_decode_steps_batch(kv, rows, L, eng.Sd) if eng.Sd > 1 else None
    return steps, verify_batch(kv, rows, L, N), draft_extend_v2_batch(kv, rows, [l + N for l in L], N)


def round_v2(eng, reqs, batches=host_batches) -> torch.Tensor:
    """v2: no allocation, no free and no host read inside the round.

    ``batches(eng, reqs, rows_dev, L_dev) -> (steps, verify, extend)`` builds the forwards'
    batches: :func:`host_batches`, or the overlap loop's from device lengths.  Returns
    ``[B, 3 + N + Sd]`` on the device: the result rows, then the device L (:func:`~refspec.speculative.round_row.pack`).
    """
    N = eng.N
    rows_dev, forced, d1, roots, dhid, L_dev = _start(eng, reqs)
    steps, verify, fb = batches(eng, reqs, rows_dev, L_dev)
    drafts = _draft(eng, reqs, steps, forced, d1, dhid)  # slots exist (over-allocated)
    hidden, n, cand = _verify(eng, reqs, verify, roots, drafts)
    a_dev = n + 1
    # draft extend over all N rows at L..L+N-1 (seq_lens = L + N), SD-005
    # a on the batch, as SGLang's v2 sets spec_info.num_accept_tokens = accept_lens for this forward
    # (eagle_worker_v2.py _draft_extend_for_decode); the graph runner copies it into its static
    # buffer as upstream's does.  No v2 rule reads it (rows and K come from N, MD-008 / CG-004) and
    # the kept row comes from n below; it is what v1's packed cu_seqlens_q rule, misapplied to v2,
    # would read (CG-004)
    fb.num_accept_tokens = a_dev.to(torch.int32)
    d_next, dh = eng.runners.draft_extend(fb, cand.flatten(), hidden)
    eng.observe("draft_extend", reqs=reqs, fb=fb)
    keep = const_arange(len(reqs), n.device, step=N) + n  # row b*N + a_b - 1 (= b*N + n_b)
    _next_state(eng, rows_dev, L_dev + a_dev, cand, d_next, dh, keep, a_dev)
    draft_len = fb.positions[keep] + 1  # the kept row's KV index + 1
    return pack(a_dev, cand, drafts, draft_len, L_dev)
