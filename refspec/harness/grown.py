"""Scenarios whose ``req_to_token`` rows grew over several speculative rounds, as a server's do.

:class:`~refspec.harness.scenario.Scenario` allocates every row in one go.  A row of a running
server instead grew round by round: a prompt, then per round N verify slots, a few accepted and
the rest rejected, ``free_tail`` (v1) or over-allocation (v2), requests finishing and their pages
going to the next one, all out of a shuffled free list.  :class:`GrownScenario` replays such a
history with a seeded schedule, then builds one forward of ``mode`` on the result::

    built = GrownScenario(ForwardMode.TARGET_VERIFY, page_size=4, version="v1").build()
    built.run_oracle(); built.run_fa3(); built.run_fa3_graph()   # as for Scenario

History (tokens; L = committed length, N = num_draft_tokens, a = accepted + bonus in [1, N]):

* round r, v1: ``alloc_extend`` to L + N, write the verify K/V, accept a, ``free_tail(L + a,
  L + N)`` (KV-004: the page of the last committed token stays), L += a;
* round r, v2: allocate to L + N unless already there (KV-005), write, accept a, L += a;
* after round 0 one *transient* request finishes (``free_req``), so later rounds reuse its pages.

Every written slot holds seeded random K/V (rejected drafts' slots too: stale values that a
wrong key count would read); never-written slots keep the pool's NaN.  The final forward's own
positions are allocated as its mode requires; its q/k/v are random.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from refspec.core import batch as B
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode
from refspec.harness.scenario import Built

SD = 3  #: draft steps of the final draft-decode forward (its input is the request-major Sd - 1 steps)


@dataclass
class GrownScenario:
    """Args: ``mode`` of the final forward, ``page_size`` P, ``version`` ("v1" / "v2": the
    history's KV accounting), ``prompt_lens`` (tokens), ``rounds`` of history, N, ``seed``
    (schedule, page shuffle, values), ``draft_step`` (draft decode), ``extend_len`` (EXTEND).
    Head shapes, dtype, window and softcap as in :class:`~refspec.harness.scenario.Scenario`."""

    mode: ForwardMode
    page_size: int
    version: str = "v1"
    prompt_lens: tuple[int, ...] = (7, 13, 4)
    rounds: int = 4
    num_draft_tokens: int = 4
    seed: int = 0
    draft_step: int | None = None
    extend_len: int = 3
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    window_left: int = -1
    softcap: float = 0.0
    device: str = "cpu"

    def __post_init__(self):
        if self.version not in ("v1", "v2"):
            raise ValueError(f"version must be 'v1' or 'v2', got {self.version!r}")
        if self.mode.is_decode() and self.draft_step is not None and not 0 <= self.draft_step < SD - 1:
            raise ValueError(f"draft_step {self.draft_step} outside [0, {SD - 1})")

    def build(self) -> Built:
        """Replay the history (module doc), then build the final forward as a ``Built``.

        The pool is sized by a dry run to exactly the peak number of pages in use (plus page 0):
        at the peak nothing is free, so every allocation after a free hands out a freed page
        again (the transient request's, v1's rejected tails).
        Raises: whatever the allocator and the builders raise (KV-003 on exhaustion, ...).
        """
        P, N, dev = self.page_size, self.num_draft_tokens, torch.device(self.device)
        longest = max(self.prompt_lens) + (self.rounds + 2) * N + self.extend_len + 2 * P
        roomy = (len(self.prompt_lens) + 1) * (-(-longest // P) + 1) + 2
        dry = KVCache(len(self.prompt_lens) + 3, longest, roomy, P, extra=4 + N, device=dev, seed=self.seed)
        low = [roomy]
        self._grow(dry, lambda r, a, b: None, low)
        pages = roomy - low[0]  # (roomy - 1 - low) in use at the peak, + the reserved page 0: no spare
        kv = KVCache(len(self.prompt_lens) + 3, longest, pages, P, extra=4 + N, device=dev, seed=self.seed)
        pool = KVPool(1, pages, P, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=dev,
                      fill=float("nan"))
        kf, vf = pool.get_flat_kv(0)
        g = torch.Generator(device=dev).manual_seed(self.seed)
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev).to(self.dtype)

        def write(r, start, stop):
            slots = kv.req_to_token[r, start:stop].long()
            kf[slots] = rnd(len(slots), self.num_kv_heads, self.head_dim)
            vf[slots] = rnd(len(slots), self.num_kv_heads, self.head_dim)

        fb, K, q = self._grow(kv, write, [pages])
        if not self.reused:  # the point of the history; a sizing change must not lose it silently
            raise RuntimeError(f"{self}: no freed page was handed out again")
        T = fb.num_tokens
        layer = AttentionLayer(0, self.num_heads, self.num_kv_heads, self.head_dim, logit_cap=self.softcap,
                               sliding_window_size=self.window_left)
        return Built(self, kv, pool, fb, layer, rnd(T, self.num_heads, self.head_dim),
                     rnd(T, self.num_kv_heads, self.head_dim), rnd(T, self.num_kv_heads, self.head_dim), K, q)

    def _grow(self, kv: KVCache, write, low: list[int]):
        """The history on ``kv`` (``write(r, start, stop)`` fills K/V; ``low[0]`` tracks the
        fewest free pages seen), then the final forward: ``(fb, K, q_lens)``."""
        N, P = self.num_draft_tokens, self.page_size
        rng = random.Random(self.seed)
        L, alloc = {}, {}
        self.freed, self.reused = set(), set()  # pages given back, and those handed out again

        def grow(r, end):  # positions alloc[r] .. end - 1 get slots
            if alloc[r] < end:
                new = kv.alloc_extend([r], [alloc[r]], [end])
                alloc[r] = end
                low[0] = min(low[0], kv.allocator.num_free_pages)
                self.reused |= self.freed & set((new // P).tolist())

        def give_back(r, keep):  # v1 free_tail, or the whole row (keep None)
            start = 0 if keep is None else keep
            self.freed |= set(kv.row_pages(r, alloc[r], start=start))
            if keep is None:
                kv.free_req(r, alloc[r])
            else:
                kv.free_tail(r, keep, alloc[r])
                alloc[r] = keep

        transient = kv.alloc_req()  # finishes after round 0: its pages go back into use
        rows = [kv.alloc_req() for _ in self.prompt_lens]
        for r, n in [(transient, 2 * P + 1), *zip(rows, self.prompt_lens)]:
            L[r], alloc[r] = n, 0
            grow(r, n)
            write(r, 0, n)
        for i in range(self.rounds):
            for r in ([transient] if i == 0 else []) + rows:
                a = rng.randint(1, N)
                grow(r, L[r] + N)
                write(r, L[r], L[r] + N)  # verify writes all N; only a are committed
                if self.version == "v1":
                    give_back(r, L[r] + a)
                L[r] += a
            if i == 0:
                give_back(transient, None)
        return self._final(kv, rows, [L[r] for r in rows], rng, write, grow)

    def _final(self, kv, rows, L, rng, write, grow):
        """The last forward: ``(fb, K, q_lens)`` with K_b / q_b in the FA3 meaning (tokens)."""
        m, N, B_ = self.mode, self.num_draft_tokens, len(rows)

        def reserve(ends):  # positions up to ends[b] - 1 hold slots (the mode's own tokens)
            for r, e in zip(rows, ends):
                grow(r, e)

        if m.is_decode() and self.draft_step is not None:
            s = self.draft_step
            reserve([x + SD - 1 for x in L])
            steps = B.draft_decode_steps_batch(kv, rows, L, SD)  # the production draft-decode input
            return B.draft_step_view(steps, s, SD), [x + s + 1 for x in L], [1] * B_
        if m.is_decode():
            reserve([x + 1 for x in L])
            return B.decode_batch(kv, rows, [x + 1 for x in L]), [x + 1 for x in L], [1] * B_
        if m == ForwardMode.EXTEND:
            e = self.extend_len
            reserve([x + e for x in L])
            return B.extend_batch(kv, rows, L, [e] * B_), [x + e for x in L], [e] * B_
        if m.is_target_verify():
            reserve([x + N for x in L])
            return B.verify_batch(kv, rows, L, N), [x + N for x in L], [N] * B_
        a = [rng.randint(1, N) for _ in rows]
        reserve([x + N for x in L])
        for r, x in zip(rows, L):
            write(r, x, x + N)  # this round's verify K/V: the rejected drafts' slots hold real values
        if m.is_draft_extend():
            return (B.draft_extend_batch(kv, rows, [x + y for x, y in zip(L, a)], a, num_draft_tokens=N),
                    [x + y for x, y in zip(L, a)], a)
        if m.is_draft_extend_v2():
            return B.draft_extend_v2_batch(kv, rows, [x + N for x in L], N, a), [x + N for x in L], [N] * B_
        raise ValueError(f"{m.name}: no grown scenario for this mode")


#: every mode the spec loop runs, as (mode, draft_step) pairs
MODES = [(ForwardMode.DECODE, None), (ForwardMode.DECODE, 1), (ForwardMode.EXTEND, None),
         (ForwardMode.TARGET_VERIFY, None), (ForwardMode.DRAFT_EXTEND, None), (ForwardMode.DRAFT_EXTEND_V2, None)]
