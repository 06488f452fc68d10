"""The documented differences: where refspec's metadata differs from upstream's, and why it is
harmless.  The one committed table; ``docs/conformance.md`` reprints it.

Only fields the FA3 MHA kernel does not read may appear here (``max_seq_len_k``, dead
page-table columns).  Upstream's FA3 call passes ``page_table``, ``cache_seqlens``,
``cu_seqlens_q``, ``cu_seqlens_k_new`` and ``max_seqlen_q``, and ``max_seqlen_k`` only on the FA4
static-grid path (``_decode_uses_static_max_seqlen_k``): 0.5.23
``flashattention_backend.py:1789`` (extend) and ``:2285`` (decode).  The kernel reads page
``j`` of row ``b`` only for ``j < ceil(cache_seqlens[b] / P)``.

Line numbers are those of the files in the PyPI wheels (``sglang==0.5.23``,
``sglang==0.5.12.post1``); neither release records a commit id, so links go to the release tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from refspec.conformance.compare import KERNEL_FIELDS

FA = "python/sglang/srt/layers/attention/flashattention_backend.py"
KM = "python/sglang/kernels/ops/attention/metadata.py"
NEW, OLD = ("0.5.23",), ("0.5.12.post1",)
BOTH = NEW + OLD


@dataclass(frozen=True)
class Known:
    """One documented difference: ``field`` in ``modes`` x ``phases`` at ``pins``."""

    key: str
    field: str
    modes: tuple[str, ...]
    phases: tuple[str, ...]
    pins: tuple[str, ...]
    upstream: tuple[tuple[str, str, int], ...]  #: (pin, file, line) where upstream sets it
    refspec: str  #: what refspec does instead
    why: str  #: why the kernel result cannot change

    def __post_init__(self):
        if self.field in KERNEL_FIELDS:
            raise ValueError(f"{self.key}: {self.field} is read by the kernel; a difference there is a bug, "
                             f"never a documented difference")


KNOWN: tuple[Known, ...] = (
    Known("replay-max-k-context", "max_seq_len_k", ("decode", "draft_extend_v2"), ("replay",), NEW,
          (("0.5.23", FA, 741), ("0.5.23", FA, 3137), ("0.5.23", FA, 3289)),
          "0 (graph metadata keeps no max K; the page-table bound comes from the CPU mirror)",
          "with no CPU mirror (sync-free replay) upstream sets max_context_len; FA3 never reads "
          "max_seqlen_k (only FA4's static grid does)"),
    Known("capture-max-k-dummy", "max_seq_len_k", ("decode", "draft_extend_v2", "draft_extend"), ("capture",),
          BOTH, (("0.5.23", FA, 648), ("0.5.12.post1", FA, 1851)),
          "0 (not set at capture)",
          "upstream takes max(seq_lens) of the capture-time dummy batch; capture-time values are "
          "overwritten at every replay, and FA3 does not read max_seqlen_k"),
    Known("replay-max-k-mirror", "max_seq_len_k", ("decode", "draft_decode", "verify", "draft_extend",
                                                   "draft_extend_v2"), ("replay", "capture"), OLD,
          (("0.5.12.post1", FA, 1918), ("0.5.12.post1", FA, 2160)),
          "0 (graph metadata keeps no max K)",
          "0.5.12.post1 keeps max(seq_lens_cpu) + delta for the host-side page bound; FA3 does not "
          "read max_seqlen_k"),
    Known("idle-context-width", "max_seq_len_k", ("idle",), ("eager",), NEW, (("0.5.23", FA, 905),),
          "0 (no requests)",
          "an empty batch has no CPU max, so upstream falls back to max_context_len; nothing is read"),
    Known("idle-table-width", "page_table[dead]", ("idle",), ("eager",), BOTH, (("0.5.23", FA, 1189),),
          "a [0, 1] table", "zero rows: no page is ever read, whatever the width"),
    Known("replay-dead-columns", "page_table[dead]", ("decode", "draft_decode", "verify", "draft_extend",
                                                      "draft_extend_v2"), ("replay",), BOTH,
          (("0.5.23", KM, 265), ("0.5.12.post1", FA, 1918)),
          "copies columns [0, ceil(max K / P)) of every row (graph_metadata._update_lengths), so a "
          "short row also holds its req_to_token entries past its own last page",
          "upstream's replay kernel stores only each row's live pages (store mask cols < "
          "ceil(K_b / P)); columns at or past ceil(K_b / P) are never read (PA-007)"),
)


def match(pin: str, mode: str, phase: str, field: str) -> Known | None:
    """The entry documenting ``field`` differing for (pin, mode, phase), or None."""
    for k in KNOWN:
        if k.field == field and pin in k.pins and mode in k.modes and phase in k.phases:
            return k
    return None


def link(pin: str, file: str, line: int) -> str:
    """A one-click GitHub link to ``file:line`` at the release tag of ``pin``."""
    return f"https://github.com/sgl-project/sglang/blob/v{pin}/{file}#L{line}"
