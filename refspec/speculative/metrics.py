"""What a speculative run reports: per-round trace, per-request stats, accept lengths (SD-003).

**Accept length** (SD-003) = tokens emitted by verify rounds / verify rounds: per request, and
overall as the sum over requests of emitted tokens / the sum of their verify rounds.  It lies in
[1, Sd + 1]: every verify round of a live request emits at least the bonus token and at most N.
The prefill token is not a verify-round token; SGLang's ``send_one.py`` "Acc Length" counts it
(``completion_tokens / spec_verify_ct``) and is reported as ``send_one_accept_length``.

**Per round**: each production round's :class:`RoundTrace` holds ``num_accept_tokens`` (a per
request) for chain and top-k tree rounds alike; ``RoundTrace.accept_length`` is its mean and
``GenerateResult.round_accept_lengths`` the list over rounds (what ``demo --topk`` prints).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundTrace:
    """One production round over the running batch.

    ``rids`` / ``seq_lens`` (committed L at the round's start, tokens) / ``num_accept_tokens`` (a)
    are aligned; ``joined`` were prefilled just before it, ``finished`` left after it;
    ``host_syncs`` counts device -> host reads inside the round (v2: 0); ``graph`` names the
    phases that replayed a graph; ``discarded`` (overlap only) the requests that were still in
    this round although an earlier round had finished them (known one round late): their rows
    of this round were dropped, and they are not in ``rids``.
    """

    index: int
    rids: list[int]
    seq_lens: list[int]
    num_accept_tokens: list[int]
    drafts: list[list[int]]
    joined: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    host_syncs: int = 0
    graph: list[str] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> float | None:
        """This round's mean a over its requests (tokens per request, bonus included; the same for a
        chain round and a top-k tree round, whose a is its accepted path length).  Before the
        budget / EOS truncation that :attr:`RequestResult.emitted` applies; None for an empty round."""
        a = self.num_accept_tokens
        return sum(a) / len(a) if a else None


@dataclass
class RequestResult:
    """One request: generated ``tokens``; per verify round ``accepts`` (a), ``emitted`` (tokens
    appended to the output, after truncation at the budget / EOS) and ``drafts`` (d_1..d_Sd);
    ``finish_reason`` ("length" / "eos")."""

    rid: int
    tokens: list[int]
    accepts: list[int]
    emitted: list[int]
    drafts: list[list[int]] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def verify_rounds(self) -> int:
        return len(self.accepts)

    @property
    def accept_length(self) -> float | None:
        """Emitted tokens / verify rounds (SD-003); None if the request never verified."""
        return sum(self.emitted) / len(self.emitted) if self.emitted else None


@dataclass
class GenerateResult:
    """The result of :func:`refspec.speculative.generate`, requests in prompt order."""

    requests: list[RequestResult]
    backend: str
    version: str
    trace: list[RoundTrace] | None = None
    host_syncs: dict = field(default_factory=dict)  #: "prefill" / "in_round" / "post_round" / "validation" -> reads
    free_pages: tuple[int, int] | None = None  #: (before, after) the run
    forwards: dict = field(default_factory=dict)  #: (phase, "graph" | "eager") -> count

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.requests]

    @property
    def accepts(self) -> list[list[int]]:
        return [r.accepts for r in self.requests]

    @property
    def drafts(self) -> list[list[list[int]]]:
        return [r.drafts for r in self.requests]

    @property
    def accept_length(self) -> float | None:
        """Overall accept length: all verify-emitted tokens / all request-rounds (SD-003)."""
        rounds = sum(r.verify_rounds for r in self.requests)
        return sum(sum(r.emitted) for r in self.requests) / rounds if rounds else None

    @property
    def send_one_accept_length(self) -> float | None:
        """SGLang ``send_one.py``: completion tokens (prefill token included) / verify rounds."""
        rounds = sum(r.verify_rounds for r in self.requests)
        return sum(len(r.tokens) for r in self.requests) / rounds if rounds else None

    @property
    def round_accept_lengths(self) -> list[float] | None:
        """Per production round (chain or tree), :attr:`RoundTrace.accept_length`; None without a
        per-round trace (the oracle loops run one request at a time)."""
        if self.trace is None:
            return None
        return [t.accept_length for t in self.trace if t.num_accept_tokens]

    def accept_table(self) -> dict[int, list[int]]:
        """``rid -> [a per round]``: feed to :class:`~refspec.speculative.accept.ScriptedAccept` to replay."""
        return {r.rid: list(r.accepts) for r in self.requests}
