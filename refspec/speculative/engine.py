"""The production speculative-decoding loop: EAGLE top-k = 1, v1 and v2, over the paged pool.

Upstream: SGLang's scheduler runs one speculative worker's ``forward_batch_generation`` per
step of its loop, over the running batch (admission and prefill are the scheduler's):
v1 = ``EAGLEWorker`` under ``Scheduler.event_loop_normal``
(https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/speculative/eagle_worker.py#L91,
https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/managers/scheduler.py#L1537),
v2 = ``EAGLEWorkerV2`` under ``Scheduler.event_loop_overlap``
(https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_worker_v2.py#L1297,
https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/managers/scheduler.py#L2061).
:class:`Engine` is a small scheduler of that kind; one round is :mod:`refspec.speculative.rounds`.

**Positions (SD-007), one rule everywhere.**  ``ForwardBatch.positions`` are KV indices in
every forward, and RoPE uses exactly those.  The target's KV index j holds token t_j.  The draft
uses the EAGLE shift: draft KV index p consumes token t_(p+1) (and, for an EAGLE head, the
target hidden h_p), so target and draft KV have the same length and share one
``req_to_token`` row and one allocator.  For a request with prompt t_0..t_(p-1):

* draft prefill: rows 0..p-1 on t_1..t_p (t_p = the target's first generated token) with
  h_0..h_(p-1); its last row's argmax is d_1;
* round at committed length L (root t_L known, its KV not yet written), N = Sd + 1:
  draft decode step s (s = 0..Sd-2) at KV index L+s on d_(s+1) -> d_(s+2); verify runs the
  target on [t_L, d_1..d_Sd] at L..L+N-1; greedy accept n, a = n + 1, emitted p_0..p_n
  (SD-001); v1 draft extend runs the a packed rows at L..L+a-1 on t_(L+1)..t_(L+a) (the last is
  the bonus) with the target hidden of the accepted verify rows and keeps each request's last
  row (SD-004); v2 draft extend runs all N rows at L..L+N-1 on the committed candidates
  (d_1..d_n, then p_n..p_(N-1): :func:`~refspec.speculative.accept.committed_candidates`; under
  greedy acceptance these are p_0..p_(N-1)) with every verify row's hidden and keeps row b*N + a_b - 1 (SD-005).

SGLang ran draft decode step s at RoPE position L+1+s while writing KV index L+s up to
v0.5.10 (SD-007, docs/versions.md: ``positions`` is ``seq_lens`` bumped by one before each
step, in v1 and v2, not explained upstream; by v0.5.12.post1 the bump follows the step).
Its draft prefill / extend keys sit at position = KV
index, so a decode-step query is one position further from them than its KV index says: a
one-position skew between the two kinds of draft keys.  RoPE scores depend only on position
*differences*, so what an exact reference needs is one rule used consistently: refspec uses
KV index = position in every draft forward (prefill, decode, extend), in the oracle loop, v1
and v2 alike.  A draft checkpoint trained under SGLang's convention would see that skew
removed here; that can change acceptance, never the output (SD-002).

**KV accounting.**  v1 (KV-004): draft slots L..L+Sd-1 are transient (``backup_state``,
``alloc_extend``, restore), verify allocates L..L+N-1, and after accepting a the rejected slots
are freed page-aligned (``free_tail(keep_len=L+a, alloc_len=L+N)``, KV-004).  v2 (KV-005):
before each round the row is topped up to ``allocate_len = seq_len + N`` (KV-005), nothing is
freed inside the round, and a finished request frees its whole row (KV-006).

**Host syncs.**  Every device -> host read of a model result goes through :meth:`Engine.host`,
which counts it by kind in ``Engine.syncs``.  v1 needs the accept counts inside the round (the
packed draft-extend layout and the frees depend on them): 1 ``"in_round"`` read per round.
v2's in-round metadata is CPU-known (L and L + N) and the kept row ``b*N + a_b - 1`` is
gathered on the device: 0 reads inside the round, and 1 ``"post_round"`` read after it.  With
``overlap`` (:mod:`refspec.speculative.overlap`) that read happens after the *next* round was
launched.  Each prefill reads its first tokens (``"prefill"``; with overlap, also after the
next launch).  With ``validate=True`` each
validated metadata build reads the batch on the host: counted apart, as ``"validation"``.
The allocator reads nothing from the device (its host mirror of ``req_to_token``,
:mod:`refspec.core.kv_cache`) and every host -> device copy is pinned and non-blocking
(:mod:`refspec.core.transfer`); :mod:`refspec.audits.sync` counts what a CUDA run
still synchronizes on.

**Hooks.**  ``drafter`` (:mod:`refspec.speculative.drafters`) overrides draft tokens; ``accept``
(:class:`~refspec.speculative.accept.ScriptedAccept`) forces a per request-round (record/replay);
``observer(event, engine, **info)`` sees ``prefill``, ``draft_decode``, ``verify``,
``draft_extend`` (after each forward, with its ``fb``) and ``round_end`` (with the trace).
"""

from __future__ import annotations

from collections import Counter

import torch

from refspec.core.args import count, int_list
from refspec.core.batch import extend_batch
from refspec.core.kv_cache import KVCache, KVPool, MLAKVPool
from refspec.core.transfer import ResultCopy, h2d, h2d_many
from refspec.speculative import overlap as overlap_loop
from refspec.speculative import rounds
from refspec.speculative.accept import num_correct_drafts
from refspec.speculative.drafters import Drafter
from refspec.speculative.future import FutureMap
from refspec.speculative.metrics import RoundTrace
from refspec.speculative.request import Request
from refspec.speculative.round_row import RoundRow, unpack
from refspec.speculative.runners import SpecRunners

__all__ = ["Engine", "Request"]


def kv_pool(num_layers: int, mla_dims, mha_heads, num_pages: int, page_size: int, **kw):
    """One model's paged KV pool, by its attention arch: an :class:`~refspec.core.kv_cache.MLAKVPool`
    of ``mla_dims``' latent row (ML-001) for an MLA model (a DeepSeek target's ``config.mla_dims``, an
    MTP draft's ``mla_dims``), else a :class:`~refspec.core.kv_cache.KVPool` of ``mha_heads() =
    (Hkv, D)``.  ``kw``: dtype, device, fill.  SGLang's model runner picks ``MLATokenToKVPool`` the
    same way (``use_mla_backend = model_config.attention_arch == AttentionArch.MLA``,
    `model_runner.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/model_executor/model_runner.py#L406>`_;
    the pool, `kv_cache_configurator.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/kv_cache_configurator.py#L1872>`_)."""
    if mla_dims is not None:
        return MLAKVPool(num_layers, num_pages, page_size, mla_dims.kv_lora_rank, mla_dims.qk_rope_head_dim, **kw)
    return KVPool(num_layers, num_pages, page_size, *mha_heads(), **kw)


class Engine:
    """Continuous-batching EAGLE top-k = 1 engine over a paged KV cache (module doc).

    Args:
        target: :class:`~refspec.model.llama.LlamaModel` or :class:`~refspec.model.deepseek.DeepseekModel`;
            draft: a draft (:mod:`refspec.model.drafts`).  Each gets the pool of its attention arch
            (:func:`kv_pool`: an MLA model's is an ``MLAKVPool``).
        version: "v1" or "v2".  num_steps: Sd >= 1 (N = Sd + 1).  page_size: P.
        max_context: bound on prompt + max_new_tokens (tokens); ``req_to_token`` rows get
            4 + N extra columns (SGLang's ``extra_max_context_len``) for the verify window
            (overlap: :func:`~refspec.speculative.overlap.row_width` columns in all).
        max_batch: most running requests; later arrivals wait.
        attention, graphs, capture_bs, provider, validate: see :class:`SpecRunners`.
        drafter, accept, eos, observer: module doc.
        num_pages: pool size (default: enough for ``max_batch`` requests of ``max_context``).
        shuffle_pages: seed to scatter physical pages.  pool_fill: initial KV value (NaN poisons).
        overlap: launch round k+1 before reading round k's results (v2 only,
            :mod:`refspec.speculative.overlap`); None = on for v2 on CUDA, off elsewhere.
    Raises: InvariantError KV-003 when the pool is exhausted; ValueError for overlap with v1,
    or with a drafter that is not ``position_only``.
    """

    def __init__(self, target, draft, *, version="v1", num_steps=3, page_size=1, max_context=256, max_batch=8,
                 attention="fa3", graphs=False, capture_bs=(1, 2, 4, 8), provider=None, validate=True,
                 drafter: Drafter | None = None, accept=None, eos=None, observer=None, num_pages=None,
                 shuffle_pages=None, pool_fill=0.0, overlap=None):
        if version not in ("v1", "v2"):
            raise ValueError(f"version must be 'v1' or 'v2', got {version!r}")
        p = next(target.parameters())
        self.drafter = drafter or Drafter()
        self.forces_drafts = type(self.drafter) is not Drafter  #: a drafter may override draft tokens
        self.overlap = overlap = overlap_loop.resolve(overlap, version, p.device, self.drafter)
        for name, n in (("num_steps (Sd)", num_steps), ("page_size", page_size), ("max_context", max_context),
                        ("max_batch", max_batch)):
            count(name, n, 1)
        self.max_context = max_context
        self.target, self.draft, self.version = target, draft, version
        self.Sd, self.N, self.P = num_steps, self._verify_width(num_steps), page_size
        self.max_batch, self.eos, self.observer = max_batch, eos, observer
        self.accept = accept
        span = self._row_span()  # positions past the committed length a round may give slots
        width = overlap_loop.row_width(max_context, span, page_size) if overlap else max_context + 4 + span
        num_pages = num_pages or 1 + max_batch * (-(-width // page_size) + 1)
        self.kv = KVCache(max_batch + 1, max_context, num_pages, page_size, extra=width - max_context,
                          device=p.device, seed=shuffle_pages)
        self.syncs: Counter = Counter()
        c, pool_kw = target.config, dict(dtype=p.dtype, device=p.device, fill=pool_fill)
        self.target_pool = kv_pool(c.num_hidden_layers, getattr(c, "mla_dims", None),
                                   lambda: (c.num_key_value_heads, c.head_dim), num_pages, page_size, **pool_kw)
        self.draft_pool = kv_pool(draft.num_layers, getattr(draft, "mla_dims", None),
                                  lambda: (draft.num_kv_heads, draft.head_dim), num_pages, page_size, **pool_kw)
        self.runners = self._make_runners(num_steps=num_steps, version=version, attention=attention, graphs=graphs,
                                          capture_bs=capture_bs, provider=provider, validate=validate,
                                          syncs=self.syncs, forced_drafts=self.forces_drafts)
        self.device = p.device
        self.future = FutureMap(self.kv.req_to_token.shape[0], p.device)  #: next-round inputs per row
        self.rounds_launched = 0  #: rounds launched so far (the next one's index)
        self.in_flight = None  #: overlap: the launched round whose results are not read yet
        self.prefills = []  #: overlap: (requests, first-token copy) of prefills not read yet
        self.draft_table = None  #: overlap: a position_only drafter's propose_at per (row, L), [R, ctx, Sd]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.done: list[Request] = []
        self.trace: list[RoundTrace] = []
        self.free_pages_at_start = self.kv.allocator.num_free_pages

    # ---- what a sibling engine (refspec.speculative.tree.engine.TreeEngine) replaces ----
    def _verify_width(self, num_steps: int) -> int:
        """N, the verify rows per request: Sd + 1 for a chain (SD-010)."""
        return num_steps + 1

    def _row_span(self) -> int:
        """Positions past the committed length that one round gives slots: N for a chain."""
        return self.N

    def _make_runners(self, **kw) -> SpecRunners:
        return SpecRunners(self.target, self.draft, self.kv, self.target_pool, self.draft_pool, **kw)

    def _set_draft_state(self, reqs, fb, first, draft_logits, draft_hidden) -> None:
        """After the prefill: the root t_p = ``first``, ``d_1`` = the kept draft row's argmax and its
        hidden (EAGLE), stashed in the future map by ``req_to_token`` row."""
        self.future.stash(fb.req_pool_indices, seq_lens=fb.seq_lens, root=first, d1=draft_logits.argmax(-1),
                          hidden=draft_hidden if self.draft.uses_hidden else None)

    def _overlap_round(self, reqs, seq_lens_hi, batches):
        """One round launched by the overlap loop (:func:`refspec.speculative.overlap.launch`): the
        2x reserve (KV-005), then :func:`~refspec.speculative.rounds.round_v2` on ``batches``."""
        overlap_loop.prepare(self, reqs)
        return rounds.round_v2(self, reqs, batches)

    def _run_round(self, reqs):
        """One round's rows (module :mod:`refspec.speculative.rounds`), v1 or v2."""
        if self.version == "v1":
            return rounds.round_v1(self, reqs)
        rounds.prepare_v2(self, reqs)  # before the round: allocate_len = seq_len + N
        return rounds.round_v2(self, reqs)

    # ---- small helpers ----
    def observe(self, event: str, **info) -> None:
        if self.observer is not None:
            self.observer(event, self, **info)

    def host(self, kind: str, t) -> list:
        """The one device -> host read path (counted per ``kind``): a tensor, or a
        :class:`~refspec.core.transfer.ResultCopy` started earlier (waits on its event only)."""
        self.syncs[kind] += 1
        return t.wait() if isinstance(t, ResultCopy) else t.tolist()

    def ids(self, xs) -> torch.Tensor:
        """A host int list -> int64 on the device (pinned, non-blocking: no stream sync)."""
        return h2d(xs, self.device)

    def forced_drafts(self, reqs, rows_dev: torch.Tensor, L_dev: torch.Tensor) -> torch.Tensor | None:
        """The drafter's d_1..d_Sd per request, ``[B, Sd]`` int64, -1 = the draft's own argmax;
        None without a drafter that overrides drafts (``forces_drafts``).

        Overlap: the host does not know this round's L, so the proposal is looked up on the
        device in the table of ``propose_at`` per (row, L) filled at admission."""
        if not self.forces_drafts:
            return None
        if self.overlap:
            return self.draft_table[rows_dev, L_dev]
        rows = [self.drafter.propose(r.rid, r.tokens, self.Sd) or [-1] * self.Sd for r in reqs]
        return self.ids(rows)

    def accept_counts(self, reqs, drafts, predict) -> torch.Tensor:
        """n per request ``[B]`` (device): the greedy rule, or the scripted a - 1 (host-known:
        the k-th verify round of a request is the k-th one launched for it)."""
        n = num_correct_drafts(drafts, predict)
        if self.accept is None:
            return n
        forced = [self.accept(r.rid, r.launched) for r in reqs]
        f = self.ids([0 if x is None else min(max(int(x), 1), self.N) for x in forced])
        return torch.where(f > 0, f - 1, n)

    # ---- requests ----
    def add_request(self, rid: int, prompt: list[int], max_new_tokens: int, arrival: int = 0) -> Request:
        """Queue a request.  Raises ValueError naming the field: a prompt that is not a non-empty list
        of ints, ``max_new_tokens`` / ``arrival`` not an int (>= 1 / >= 0), prompt +
        budget past ``max_context``, a token id outside the vocabulary, a ``rid`` already used."""
        prompt = int_list(f"request {rid}: prompt", prompt)
        max_new_tokens = count(f"request {rid}: max_new_tokens", max_new_tokens, 1)
        arrival = count(f"request {rid}: arrival", arrival, 0)
        if not prompt:
            raise ValueError(f"request {rid}: the prompt is empty")
        if len(prompt) + max_new_tokens > self.max_context:
            raise ValueError(f"request {rid}: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                             f"> max_context {self.max_context}")
        V = self.target.config.vocab_size
        if not all(0 <= t < V for t in prompt):
            raise ValueError(f"request {rid}: token ids outside [0, vocab_size = {V})")
        if any(r.rid == rid for r in self.waiting + self.running + self.done):
            raise ValueError(f"request id {rid} is already in use")
        req = Request(rid, prompt, max_new_tokens, arrival)
        self.waiting.append(req)
        return req

    def _emit(self, r: Request, new: list[int]) -> int:
        """Append ``new`` to ``r.output`` until its budget or EOS; returns how many were appended."""
        for i, t in enumerate(new):
            r.output.append(t)
            if t == self.eos or len(r.output) >= r.max_new_tokens:
                r.finish_reason = "eos" if t == self.eos else "length"
                return i + 1
        return len(new)

    def _release(self, finished: list[Request]) -> None:
        """Free every page of each finished request's row (v1: L + a, v2: L + N positions)."""
        for r in finished:
            self.kv.free_req(r.row, r.alloc_len)
            self.running.remove(r)
            self.done.append(r)

    def _prefill(self, reqs: list[Request]) -> None:
        """Target EXTEND over the prompts, then the draft prefill (EAGLE shift) on the same slots."""
        kv, run = self.kv, self.runners
        for r in reqs:
            r.row = kv.alloc_req()
        rows, p = [r.row for r in reqs], [len(r.prompt) for r in reqs]
        kv.alloc_extend(rows, [0] * len(reqs), p)
        fb = extend_batch(kv, rows, [0] * len(reqs), p)
        ids, last = h2d_many([[t for r in reqs for t in r.prompt], [sum(p[:b + 1]) - 1 for b in range(len(p))]],
                             self.device)
        logits, hidden = run.target_extend(ids, fb)
        first = logits[last].argmax(-1)  # t_p per request
        dids = ids.roll(-1)  # draft row j of a request consumes t_(j+1) ...
        dids[last] = first  # ... and its last row the first generated token
        dl, dh = run.draft_prefill(dids, hidden if self.draft.uses_hidden else None, fb)
        for b, r in enumerate(reqs):
            r.seq_len = r.alloc_len = r.target_kv_len = r.draft_kv_len = p[b]
        self._set_draft_state(reqs, fb, first, dl[last], dh[last])
        if self.overlap:
            overlap_loop.tabulate_drafts(self, reqs)
        self.observe("prefill", reqs=reqs, fb=fb)
        self.running.extend(reqs)
        if self.overlap:  # read after the next round is launched (overlap.read_prefills)
            self.prefills.append((reqs, ResultCopy(first)))
        else:
            self.emit_first(reqs, self.host("prefill", first))

    def emit_first(self, reqs, first: list[int]) -> None:
        """Emit each request's first token (the prefill's); free those it finishes."""
        for r, t in zip(reqs, first):
            self._emit(r, [t])
        self._release([r for r in reqs if r.finished])

    def _admit(self, step: int) -> list[Request]:
        joined = []
        for r in sorted(self.waiting, key=lambda r: (r.arrival, r.rid)):
            if r.arrival <= step and len(self.running) + len(joined) < self.max_batch:
                joined.append(r)
        for r in joined:
            self.waiting.remove(r)
        return joined

    # ---- the loop ----
    def run(self) -> list[Request]:
        """Run until every request finished; returns them in completion order."""
        if self.overlap:
            return overlap_loop.run(self)
        step = 0
        with torch.no_grad():
            while self.waiting or self.running:
                if not self.running and self.waiting:
                    step = max(step, min(r.arrival for r in self.waiting))
                joined = self._admit(step)
                if joined:
                    self._prefill(joined)
                if self.running:
                    self._round(list(self.running), [r.rid for r in joined])
                step += 1
        return self.done

    def _round(self, reqs: list[Request], joined: list[int]) -> None:
        """One round over ``reqs``, then emission, finishes, frees and the trace entry."""
        before = self.syncs["in_round"]
        counts_before = Counter(self.runners.counts)
        L = [r.seq_len for r in reqs]
        out = self._run_round(reqs)
        for r in reqs:
            r.launched += 1
        self.rounds_launched += 1
        in_round = self.syncs["in_round"] - before
        if self.version == "v2":  # the results, read once after the round
            out = [unpack(row, self.N, self.Sd) for row in self.host("post_round", out)]
        self.commit(reqs, L, out, joined, in_round, self.graphs_used(counts_before))

    def graphs_used(self, counts_before: Counter) -> list[str]:
        """The phases that replayed a graph since ``counts_before`` (a copy of ``runners.counts``)."""
        return sorted(ph for (ph, how), v in self.runners.counts.items()
                      if how == "graph" and v > counts_before[(ph, how)])

    def commit(self, reqs, L, out: list[RoundRow], joined, in_round, used, discarded=()) -> None:
        """Apply one round's result rows ``out`` (one :class:`~refspec.speculative.round_row.RoundRow`
        per request of ``reqs``, committed lengths ``L``): lengths, emission, finishes, frees,
        the trace entry and the ``round_end`` event.  ``discarded``: rids whose row was dropped."""
        for r, l, row in zip(reqs, L, out):
            r.seq_len = r.target_kv_len = l + row.a
            r.draft_kv_len = row.draft_len
            r.accepts.append(row.a)
            r.drafts.append(row.drafts)
            r.emitted.append(self._emit(r, row.committed[:row.a]))
        finished = [r for r in reqs if r.finished]
        self._release(finished)
        tr = RoundTrace(len(self.trace), [r.rid for r in reqs], list(L), [row.a for row in out],
                        [row.drafts for row in out], joined=joined, finished=[r.rid for r in finished],
                        host_syncs=in_round, graph=used, discarded=list(discarded))
        self.trace.append(tr)
        self.observe("round_end", reqs=reqs, trace=tr)
