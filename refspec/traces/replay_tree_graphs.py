"""Tree-trace replay under graphs: each recorded round's tree verify and draft decode replayed
through the production :class:`~refspec.speculative.tree.graphs.TreeGraphRunner` (TR-018).

The runner is the one the production top-k loop uses: captured once per batch size of the
trace's ``capture_bs``, then, per round, the live batch copied into its static buffers (padded
requests: row 0, L = 1, slot 0), the metadata rebuilt and *written into* the captured buffers
(the draft expand table sliced to s + 1 columns) and the graph replayed.  Only its forward
functions differ from the engine's: instead of the model they run the round's attention layer on
queries staged in a static buffer (:class:`AttentionRunners`), so the replayed output compares
with the eager run of the same round bitwise with the emulator (T0, TOL-001); with the real
kernel, which may split differently inside a graph, it compares with the fp32 slot oracle under
T1 (TOL-002), as ``python -m refspec check --sections tree`` does.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from refspec.core.tolerance import t0, t1
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, draft_step_batch
from refspec.oracle.slots import attention_over_slots
from refspec.speculative.tree.graphs import TreeGraphRunner


class AttentionRunners:
    """The part of :class:`~refspec.speculative.tree.runners.TreeRunners` a TreeGraphRunner reads,
    with attention-only forward functions over the static query buffers ``q_verify`` [max_bs*N, H, D]
    and ``q_draft`` [S-1, max_bs*k, H, D]."""

    def __init__(self, rnd, provider: str, max_bs: int):
        self.kv, self.layer, self.topk, self.Sd, self.num_draft_tokens = rnd.kv, rnd.layer, rnd.k, rnd.S, rnd.N
        H, D = rnd.layer.num_heads, rnd.layer.head_dim
        bkw = dict(topk=rnd.k, provider=provider)
        self.tree_verify_be = FlashAttentionTreeBackend(rnd.target, rnd.kv, num_draft_tokens=rnd.N, **bkw)
        self.tree_step_bes = [FlashAttentionTreeBackend(rnd.draft, rnd.kv, num_steps=rnd.S, speculative_step_id=s,
                                                        **bkw) for s in range(rnd.S - 1)]
        self.target = SimpleNamespace(config=SimpleNamespace(hidden_size=1))  # the draft inputs' hidden width
        self.draft = SimpleNamespace(uses_hidden=False)
        z = lambda *shape: torch.zeros(shape, dtype=rnd.dtype, device=rnd.device)  # noqa: E731
        self.q_verify, self.q_draft = z(max_bs * rnd.N, H, D), z(max(rnd.S - 1, 1), max_bs * rnd.k, H, D)

    def _tree_verify_fn(self, fb, x):
        q = self.q_verify[:fb.batch_size * self.num_draft_tokens]
        return (self.tree_verify_be.forward(q, None, None, self.layer, fb),)

    def _tree_draft_fn(self, fb, x):
        """Every step's output, per request ``[bs, k, H, D]`` (the runner keeps a request's rows)."""
        k, out = self.topk, []
        for s, be in enumerate(self.tree_step_bes):
            o = be.forward(self.q_draft[s, :fb.batch_size * k], None, None, self.layer, draft_step_batch(fb, s))
            out.append(o.view(fb.batch_size, k, *o.shape[1:]))
        return tuple(out)


class TreeGraphs:
    """The verify and draft-decode graph runners of one replay (module doc)."""

    def __init__(self, rnd, provider: str, capture_bs):
        self.rnd, self.capture_bs = rnd, sorted(set(capture_bs))
        self.r = AttentionRunners(rnd, provider, self.capture_bs[-1])
        self.verify = TreeGraphRunner(self.r, "verify", self.capture_bs, rnd.dtype)
        self.draft = TreeGraphRunner(self.r, "draft", self.capture_bs, rnd.dtype) if rnd.S > 1 else None

    def _same(self, check, replay, q, pool, eager, what) -> None:
        """``eager = (output, key slots per row)``: T0 vs the eager output on CPU, T1 vs the oracle on CUDA."""
        out, slots = eager
        if replay.is_cuda:
            k, v = pool.get_flat_kv(0)
            verdict = t1(replay, attention_over_slots(q, k, v, slots, out_dtype=torch.float32),
                         attention_over_slots(q, k, v, slots, upcast=False))
        else:
            verdict = t0(replay, out)
        if not verdict.ok:
            vs = "the oracle" if replay.is_cuda else "eager"
            check.failures.append(f"[TR-018] {what}: graph replay vs {vs}: {verdict}")

    def check_round(self, check, verify, draft) -> None:
        """Replay this round's ``verify = (fb, q, eager)`` and ``draft = (fb, [q], [eager])`` (eager: see
        :meth:`_same`); appends "verify" / "draft" to ``check.graphs``."""
        fb, q, eager = verify
        B, N, k = fb.batch_size, self.rnd.N, self.rnd.k
        if not self.verify.can_run(fb):
            return  # a batch past the captured sizes runs eagerly, as in the engine (CG-007)
        self.r.q_verify.zero_()
        self.r.q_verify[:B * N].copy_(q)
        (out,) = self.verify.replay(fb, {"ids": torch.zeros(B * N, dtype=torch.long, device=q.device)})
        self._same(check, out, q, self.rnd.target, eager, "tree verify")
        check.graphs.append("verify")
        if draft is None:
            return
        dfb, qs, eagers = draft
        self.r.q_draft.zero_()
        for s, qs_s in enumerate(qs):
            self.r.q_draft[s, :B * k].copy_(qs_s)
        dev = q.device
        outs = self.draft.replay(dfb, {"topk_p": torch.zeros((B, k), device=dev),
                                       "topk_index": torch.zeros((B, k), dtype=torch.long, device=dev)})
        for s, (o, q_s, e) in enumerate(zip(outs, qs, eagers)):
            self._same(check, o.reshape(e[0].shape), q_s, self.rnd.draft, e, f"draft decode step {s}")
        check.graphs.append("draft")
