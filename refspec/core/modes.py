"""Forward modes and their predicates, as SGLang's ``ForwardMode`` (v0.5.5;
v0.5.14 removed DRAFT_EXTEND: docs/versions.md).

Draft decode is not a mode of its own: it is ``DECODE`` run by the draft model with a draft step
index ``s`` (``ForwardBatch.draft_step``), exactly as SGLang tells them apart by
``forward_batch.spec_info is not None``.

**v1 and v2** (used from here on, in the code and the docs) name SGLang's two EAGLE loops, and
differ in what a round may read on the host and in their draft extend:

* **v1** = SGLang's ``EAGLEWorker`` (non-overlap scheduler; removed in v0.5.14): verify reads the
  accept counts on the host inside the round (``num_correct_drafts.cpu()`` in
  ``EagleVerifyInput.verify``), frees the rejected slots, then runs ``DRAFT_EXTEND`` over the
  a = n + 1 accepted tokens per request, packed (``forward_draft_extend_after_decode``);
  https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/speculative/eagle_worker.py#L91
* **v2** = SGLang's ``EAGLEWorkerV2`` (overlap scheduler, the default since 2026-04): no host
  read inside the round; ``DRAFT_EXTEND_V2`` runs over all N verify rows per request (uniform)
  and keeps row ``b * N + a_b - 1`` on the device (``_draft_extend_for_decode``);
  https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_worker_v2.py#L1297

docs/modes/draft-extend-v1.md and docs/modes/draft-extend-v2.md give both modes' metadata.

Mirrors ``model_executor/forward_batch_info.py`` (the ``include_v2`` helpers of #11398
``20a6c0a63``, simplified in #11874 ``0bfe1d145``).  Only the modes EAGLE uses (chains and trees)
are here, with the predicates refspec calls; MIXED / SPLIT_PREFILL are out of scope.

**First reading:** the six members and the v1 / v2 paragraph; the ``is_*`` predicates are
one-line comparisons to skim (only ``is_draft_extend``'s ``include_v2`` default carries a rule).
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
