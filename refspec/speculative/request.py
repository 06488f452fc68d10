"""A request of the production engine: its host state (lengths in tokens, emitted tokens).

Its device state (the next round's committed length, root token, d_1 and draft hidden) lives in
the engine's future map, row ``row`` (:mod:`refspec.speculative.future`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    """A request's host state (lengths in tokens; v2 overlap: ``seq_len`` is the start of the round in flight)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    row: int = 0  #: req_to_token row
    seq_len: int = 0  #: L, committed target KV
    alloc_len: int = 0  #: positions of the row that hold slots (v1: L after a round; v2: L + N)
    target_kv_len: int = 0  #: updated where the target's KV is committed (verify)
    draft_kv_len: int = 0  #: what the draft extend committed (its extent; v2: kept row index + 1)
    output: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    finish_reason: str = ""
    launched: int = 0  #: verify rounds launched (= len(accepts) unless one is in flight)

    @property
    def tokens(self) -> list[int]:
        """t_0..t_L: the prompt and every emitted token (the root included)."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)
