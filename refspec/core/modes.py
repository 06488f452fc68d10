"""Forward modes and their predicates, as SGLang's ``ForwardMode`` (v0.5.5;
v0.5.14 removed DRAFT_EXTEND: docs/versions.md).

Draft decode is not a mode of its own: it is ``DECODE`` run by the draft model with a draft step
index ``s`` (``ForwardBatch.draft_step``), exactly as SGLang tells them apart by
``forward_batch.spec_info is not None``.

Mirrors ``model_executor/forward_batch_info.py`` (the ``include_v2`` helpers of #11398
``20a6c0a63``, simplified in #11874 ``0bfe1d145``).  Only the modes EAGLE uses (chains and trees)
are here, with the predicates refspec calls; MIXED / SPLIT_PREFILL are out of scope.
"""

from __future__ import annotations

from enum import IntEnum, auto


class ForwardMode(IntEnum):
    EXTEND = auto()  #: prefill (with or without a cached prefix)
    DECODE = auto()  #: one token per request (target decode, or draft decode step s)
    TARGET_VERIFY = auto()  #: N rows per request, target model: root + Sd drafts (N = Sd + 1), or N tree nodes
    DRAFT_EXTEND = auto()  #: v1: the a = n + 1 accepted tokens per request, packed, draft model
    DRAFT_EXTEND_V2 = auto()  #: v2: all N verify rows per request (uniform), draft model
    IDLE = auto()  #: empty batch (data-parallel filler)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self, include_v2: bool = False) -> bool:
        """DRAFT_EXTEND; DRAFT_EXTEND_V2 too only when ``include_v2`` (default False, as upstream).

        The default matters: the v1 replay branch ``elif is_draft_extend():`` must not match V2
        (SGLang's replay tests ``is_draft_extend()`` before ``is_draft_extend_v2()``, CG-003).
        """
        if include_v2:
            return self in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2)
        return self == ForwardMode.DRAFT_EXTEND

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2
