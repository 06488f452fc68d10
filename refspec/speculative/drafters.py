"""Test drafters: scripted choices of the draft tokens d_1..d_Sd of a round.

A drafter overrides only the *token choice*: the draft model's forwards still run on the
proposed tokens (draft decode step s consumes d_(s+1)), so every draft attention mode stays
exercised.  It is a pure function of (request id, committed tokens, Sd), so the oracle loop and
the production loop see the same proposals whatever the batch composition.

All of them read a *reference*: the target's plain greedy continuation of each prompt (the
lossless baseline, :func:`refspec.oracle.loop.greedy`), ``reference[rid] = prompt + output``.
At a round whose committed tokens are ``t_0..t_L`` (t_L the root), d_i targets t_(L+i); past the
reference's end the proposal is token 0.

* :class:`PerfectDrafter`: d_i = reference t_(L+i): every round accepts all Sd drafts, a = N.
* :class:`AdversarialDrafter`: d_i = reference t_(L+i) + 1 (mod V) != the target's greedy token:
  a = 1 every round.
* :class:`RandomDrafter`: d_i = the reference token with probability ``p_correct``, else a uniform
  token; seeded per (seed, rid, L, i), so a geometric-ish mix of accept lengths.
"""

from __future__ import annotations

import random


class Drafter:
    """Base class: ``propose(rid, tokens, num_steps) -> list of Sd ints`` (or None: no override).

    ``position_only`` drafters also give ``propose_at(rid, L, num_steps)``, the same proposal
    from the committed length L alone: the overlap loop needs that, because it launches a round
    before the host has the previous round's tokens (it tabulates ``propose_at`` per L on the
    device, :mod:`refspec.speculative.overlap`).
    """

    name = "model"
    position_only = False

    def propose(self, rid: int, tokens: list[int], num_steps: int) -> list[int] | None:
        return None

    def propose_at(self, rid: int, L: int, num_steps: int) -> list[int]:
        raise NotImplementedError(f"drafter {self.name!r} proposes from the tokens, not from L alone")


class _ReferenceDrafter(Drafter):
    position_only = True

    def __init__(self, reference: dict[int, list[int]], vocab_size: int):
        self.reference, self.vocab_size = reference, vocab_size

    def propose(self, rid, tokens, num_steps):
        return self.propose_at(rid, len(tokens) - 1, num_steps)

    def ref(self, rid: int, index: int) -> int:
        seq = self.reference[rid]
        return seq[index] if index < len(seq) else 0


class PerfectDrafter(_ReferenceDrafter):
    name = "perfect"

    def propose_at(self, rid, L, num_steps):
        return [self.ref(rid, L + i) for i in range(1, num_steps + 1)]


class AdversarialDrafter(_ReferenceDrafter):
    name = "adversarial"

    def propose_at(self, rid, L, num_steps):
        return [(self.ref(rid, L + i) + 1) % self.vocab_size for i in range(1, num_steps + 1)]


class RandomDrafter(_ReferenceDrafter):
    name = "random"

    def __init__(self, reference, vocab_size, p_correct: float = 0.6, seed: int = 0):
        super().__init__(reference, vocab_size)
        self.p_correct, self.seed = p_correct, seed

    def propose_at(self, rid, L, num_steps):
        out = []
        for i in range(1, num_steps + 1):
            rng = random.Random(f"{self.seed}/{rid}/{L}/{i}")
            out.append(self.ref(rid, L + i) if rng.random() < self.p_correct else rng.randrange(self.vocab_size))
        return out


DRAFTERS = {"perfect": PerfectDrafter, "adversarial": AdversarialDrafter, "random": RandomDrafter}


def make_drafter(spec, reference: dict[int, list[int]] | None, vocab_size: int) -> Drafter:
    """``None`` (the draft model's own argmax), a name in :data:`DRAFTERS`, or a :class:`Drafter`."""
    if spec is None:
        return Drafter()
    if isinstance(spec, str):
        if spec not in DRAFTERS:
            raise ValueError(f"unknown drafter {spec!r}; known: {sorted(DRAFTERS)}")
        if reference is None:
            raise ValueError(f"drafter {spec!r} needs the greedy reference")
        return DRAFTERS[spec](reference, vocab_size)
    return spec
