"""The production loop's model-level runners: attention backends + CUDA-graph runners per phase.

One :class:`SpecRunners` per engine holds, over the shared ``req_to_token`` / allocator:

==================  ===============  ======================================  ==================
phase               model, mode      backend(s)                              graph (``graphs``)
==================  ===============  ======================================  ==================
prefill             target, EXTEND   ``target_be``                           eager (as SGLang)
draft prefill       draft, EXTEND    ``draft_be``                            eager
draft decode        draft, DECODE    ``step_bes[s]``, s = 0..Sd-2            ONE graph, all steps
                                     (``FlashAttentionMultiStepBackend``)
verify              target,          ``target_be``                           TARGET_VERIFY
                    TARGET_VERIFY
draft extend        draft,           ``draft_be``                            DRAFT_EXTEND (v1) /
                    DRAFT_EXTEND(_V2)                                        DRAFT_EXTEND_V2 (v2)
==================  ===============  ======================================  ==================

A batch larger than the largest captured size runs eagerly (CG-007).  The eager and the graphed
path run the *same* forward function; only where the metadata comes from differs (eager
``init_forward_metadata`` vs the runner's in-place replay), so graph vs eager is a T0 check.

The draft-decode graph (SGLang ``EAGLEDraftCudaGraphRunner``, CG-005) takes per-token inputs
laid out request-major ``[B * (Sd-1)]`` like its ``out_cache_loc`` (sglang #7239, SD-009): ``ids`` (column 0 =
d_1; the other columns are never read), with a drafter that overrides drafts (a test or replay
drafter, :mod:`refspec.speculative.drafters`) ``forced`` (column s = its d_(s+2), or -1 for the
draft's own argmax) and, for an EAGLE draft, ``hidden`` (column 0 = the kept draft-extend
row's hidden; the others never read).  Step s reads its
``draft_step_view`` and the backend of step s; the chosen tokens ``[B, Sd-1]`` come out.

**The greedy head inside the graph** (``head = "argmax"``, the chain's default).  Verify and
draft extend return each row's ``argmax`` token ``[T]`` instead of its logits ``[T, V]``: the
chain reads nothing else of them (greedy acceptance SD-001 compares the verify argmax with the
drafts; the next d_1 is the kept draft-extend row's argmax), so the argmax runs inside the
captured graph and the ``[T, V]`` logits (V = 49152 for SmolLM2) are neither cloned out of the
graph nor reduced by a separate launch.  ``torch.argmax`` of the same logits, so the tokens are
the same bits as an argmax outside.  Top-k trees need the draft logits (``head = "logits"``,
:class:`~refspec.speculative.tree.runners.TreeRunners`).
"""

from __future__ import annotations

from collections import Counter

import torch

from refspec.core.batch import draft_step_view
from refspec.model.drafts import aux_layers, target_hidden_size
from refspec.fa3.backend import FlashAttentionBackend, FlashAttentionMultiStepBackend
from refspec.graphs.runner import GraphRunner
from refspec.core.modes import ForwardMode
from refspec.oracle.backend import OracleBackend


class SpecRunners:
    """Backends and graph runners of one production engine.

    ``head``: what :meth:`verify` and :meth:`draft_extend` return per row (module doc):
    ``"argmax"`` (int64 ``[T]``) or ``"logits"`` (``[T, V]``).

    Args:
        target: :class:`~refspec.model.llama.LlamaModel`; draft: a draft (:mod:`refspec.model.drafts`).
        kv: the shared :class:`~refspec.core.kv_cache.KVCache`; target_pool, draft_pool: KV pools.
        num_steps: Sd.  version: "v1" (DRAFT_EXTEND) or "v2" (DRAFT_EXTEND_V2).
        attention: "fa3" (FlashAttentionBackend; emulator on CPU, real FA3 on Hopper) or
            "oracle" (the paged OracleBackend, eager only).
        graphs: capture graphs (fa3 only).  capture_bs: batch sizes (CG-007).
        provider, validate: FA3 backend options.  syncs: the engine's ``Counter`` (the FA3
            backends add their ``"validation"`` reads to it).
        forced_drafts: the draft-decode phase takes a drafter's tokens (``forced``, module doc);
            without it the graph captures no such input.
    """

    head = "argmax"

    def __init__(self, target, draft, kv, target_pool, draft_pool, *, num_steps, version, attention="fa3",
                 graphs=False, capture_bs=(1, 2, 4, 8), provider=None, validate=True, syncs=None,
                 forced_drafts=False):
        self.target, self.draft, self.kv = target, draft, kv
        self.aux = aux_layers(draft)  #: the target hidden states the draft reads (None: the last)
        self.forced_drafts = forced_drafts
        self.Sd, self.N, self.version = num_steps, num_steps + 1, version
        if attention == "fa3":
            kw = dict(provider=provider, validate=validate, syncs=syncs)
            self.target_be = FlashAttentionBackend(target_pool, kv, **kw)
            self.draft_be = FlashAttentionBackend(draft_pool, kv, **kw)
            self.step_bes = FlashAttentionMultiStepBackend(draft_pool, kv, num_steps, **kw).backends
        elif attention == "oracle":
            if graphs:
                raise ValueError("graphs need the fa3 backend (the oracle backend has no capture hooks)")
            self.target_be, self.draft_be = OracleBackend(target_pool, kv), OracleBackend(draft_pool, kv)
            self.step_bes = [OracleBackend(draft_pool, kv) for _ in range(num_steps - 1)]
        else:
            raise ValueError(f"attention must be 'fa3' or 'oracle', got {attention!r}")
        self.counts: Counter = Counter()  #: (phase, "graph" | "eager") -> forwards
        self.graph = {}
        if graphs:
            with torch.no_grad():
                self._capture(tuple(capture_bs), next(target.parameters()).dtype)

    def _capture(self, capture_bs, dtype):
        ids, E, N, Sd = ((), torch.long), self.target.config.hidden_size, self.N, self.Sd
        # draft decode reads the draft's own hidden [E]; draft extend the target's (EAGLE-3: [len(aux) * E])
        hidden = {"hidden": ((E,), dtype)} if self.draft.uses_hidden else {}
        features = {"hidden": ((target_hidden_size(self.draft, self.target),), dtype)} if self.draft.uses_hidden else {}
        forced = {"forced": ids} if self.forced_drafts else {}
        kv = self.kv
        self.graph["verify"] = GraphRunner(ForwardMode.TARGET_VERIFY, [self.target_be], self._verify_fn, kv=kv,
                                           capture_bs=capture_bs, tokens_per_req=N, inputs={"ids": ids},
                                           num_draft_tokens=N)
        if Sd > 1:
            self.graph["draft_decode"] = GraphRunner(
                ForwardMode.DECODE, self.step_bes, self._draft_decode_fn, kv=kv, capture_bs=capture_bs,
                tokens_per_req=Sd - 1, inputs={"ids": ids, **forced, **hidden}, rows="requests",
                split=lambda fb: [draft_step_view(fb, s, Sd) for s in range(Sd - 1)], draft_step=0)
        mode = ForwardMode.DRAFT_EXTEND if self.version == "v1" else ForwardMode.DRAFT_EXTEND_V2
        self.graph["draft_extend"] = GraphRunner(mode, [self.draft_be], self._draft_extend_fn, kv=kv,
                                                 capture_bs=capture_bs, tokens_per_req=N,
                                                 inputs={"ids": ids, **features}, num_draft_tokens=N)

    # ---- the forward functions (shared by eager and graphed runs) ----
    def _head(self, logits: torch.Tensor) -> torch.Tensor:
        """``[T, V]`` logits -> what the phase returns (``head``, module doc)."""
        return logits.argmax(-1) if self.head == "argmax" else logits

    def _verify_fn(self, fb, x):
        logits, hidden = self.target.forward(x["ids"], fb, self.target_be, aux=self.aux)
        return self._head(logits), (hidden if self.draft.uses_hidden else None)  # only an EAGLE draft reads it

    def _draft_extend_fn(self, fb, x):
        logits, hidden = self.draft.forward(x["ids"], x.get("hidden"), fb, self.draft_be)
        return self._head(logits), (hidden if self.draft.uses_hidden else None)

    def _draft_decode_fn(self, fb, x):
        S1, B = self.Sd - 1, fb.batch_size
        ids = x["ids"].view(B, S1)[:, 0]
        forced = x["forced"].view(B, S1) if "forced" in x else None
        hid = x["hidden"].view(B, S1, -1)[:, 0] if "hidden" in x else None
        toks = []
        for s in range(S1):  # step s: KV index L + s, input d_(s+1), output d_(s+2)
            logits, hid = self.draft.forward(ids, hid, draft_step_view(fb, s, self.Sd), self.step_bes[s])
            ids = logits.argmax(-1)
            if forced is not None:  # a drafter's token where it gives one
                ids = torch.where(forced[:, s] >= 0, forced[:, s], ids)
            toks.append(ids)
        return torch.stack(toks, dim=1)

    def _run(self, phase, fb, inputs, fn, eager_init):
        g = self.graph.get(phase)
        if g is not None and g.can_run(fb):
            self.counts[(phase, "graph")] += 1
            return g.replay(fb, inputs)
        self.counts[(phase, "eager")] += 1
        eager_init(fb)
        return fn(fb, inputs)

    # ---- public phases ----
    def target_extend(self, ids, fb):
        """Prefill (EXTEND), eager: ``ids [T]`` -> ``logits [T, V]``, ``hidden [T, E]``."""
        self.counts[("prefill", "eager")] += 1
        self.target_be.init_forward_metadata(fb)
        return self.target.forward(ids, fb, self.target_be, aux=self.aux)

    def draft_prefill(self, ids, hidden, fb):
        """Draft prefill (EXTEND on the draft pool), eager: -> ``logits [T, V]``, ``hidden [T, E]``."""
        self.counts[("draft_prefill", "eager")] += 1
        self.draft_be.init_forward_metadata(fb)
        return self.draft.forward(ids, hidden, fb, self.draft_be)

    def verify(self, ids, fb):
        """TARGET_VERIFY: ``ids [B*N]`` -> ``argmax [B*N]`` int64 (or ``logits [B*N, V]``, ``head``),
        ``hidden [B*N, E]`` (None unless the draft reads it)."""
        return self._run("verify", fb, {"ids": ids}, self._verify_fn, self.target_be.init_forward_metadata)

    def draft_extend(self, fb, ids, hidden):
        """DRAFT_EXTEND (v1, packed ``T = sum a``) or DRAFT_EXTEND_V2 (``T = B*N``) ->
        ``argmax [T]`` int64 (or ``logits [T, V]``, ``head``), ``hidden [T, E]`` (None unless the
        draft reads it)."""
        x = {"ids": ids} if hidden is None or not self.draft.uses_hidden else {"ids": ids, "hidden": hidden}
        return self._run("draft_extend", fb, x, self._draft_extend_fn, self.draft_be.init_forward_metadata)

    def draft_decode(self, fb, first_ids, forced, hidden):
        """All Sd - 1 draft-decode steps of a round.

        Shapes: ``fb`` from :func:`~refspec.core.batch.draft_decode_steps_batch`; ``first_ids [B]``
        (d_1); ``forced [B, Sd-1]`` (-1: the draft's argmax) or None (no drafter overrides
        drafts); ``hidden [B, E]`` or None ->
        tokens ``[B, Sd-1]`` (d_2..d_Sd).
        """
        B, S1 = fb.batch_size, self.Sd - 1
        # request-major [B * (Sd-1)] like out_cache_loc; the graph reads column 0 only, so every
        # column holds it (one copy, no zeros + scatter)
        x = {"ids": first_ids[:, None].expand(B, S1).flatten()}
        if forced is not None:
            x["forced"] = forced.flatten()
        if self.draft.uses_hidden:
            x["hidden"] = hidden[:, None].expand(B, S1, hidden.shape[-1]).flatten(0, 1)

        def eager_init(fb):
            for s, be in enumerate(self.step_bes):
                be.init_forward_metadata(draft_step_view(fb, s, self.Sd))
        return self._run("draft_decode", fb, x, self._draft_decode_fn, eager_init)
