"""The documented differences: where refspec's metadata differs from upstream's, and why it is
harmless.  The one committed table; ``docs/conformance.md`` reprints it.

Only fields the FA3 MHA kernel does not read may appear here (``max_seq_len_k``, dead
page-table columns), plus the *capture-time* contents of buffers every replay rewrites, plus
``cu_seqlens_k`` where an entry's ``unread`` cites why that kernel call cannot read it (top-k > 1
draft decode: not passed at all, or passed as ``cu_seqlens_k_new``, which FA3 reads only with new
K/V: ``docs/kernel-facts.md#cu-seqlens-k-new``).  Top-k > 1 fields carry their part
(``prefix:`` / ``expand:``, :func:`refspec.conformance.compare.compare_parts`); the ``tree:``
part is never documentable.
Upstream's FA3 call passes ``page_table``, ``cache_seqlens``,
``cu_seqlens_q``, ``cu_seqlens_k_new`` and ``max_seqlen_q``, and ``max_seqlen_k`` only on the FA4
static-grid path (``_decode_uses_static_max_seqlen_k``): 0.5.23
``flashattention_backend.py:1789`` (extend) and ``:2285`` (decode).  The kernel reads page
``j`` of row ``b`` only for ``j < ceil(cache_seqlens[b] / P)``, so a table is wide enough when
it has the kernel bound ``ceil(max_b K_b / P)`` columns (CG-008, PA-003): a ``page_table[dead]``
difference whose upstream table is narrower than that bound (``Diff.short_table``) is never
documented (it drops a live page: the known bug ``context-wall-page-table``), and an entry
with ``at_bound`` documents only a width difference (``Diff.width_only``) at or above it.

Line numbers are those of the files in the PyPI wheels (``sglang==0.5.23``,
``sglang==0.5.12.post1``); neither release records a commit id, so links go to the release tag.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from refspec.conformance.compare import KERNEL_FIELDS, base_field

FA = "python/sglang/srt/layers/attention/flashattention_backend.py"
KM = "python/sglang/kernels/ops/attention/metadata.py"
NEW, OLD = ("0.5.23",), ("0.5.12.post1",)
BOTH = NEW + OLD
#: kernel-listed fields an entry may document when it cites why the call does not read them
UNREAD_IF_CITED = ("cu_seqlens_k",)


#: kernel-read fields every replay rewrites before the graph runs: their *capture-time* contents
#: only feed the discarded capture run (a graph records addresses, not contents)
REWRITTEN_AT_REPLAY = ("cache_seqlens_int32", "cu_seqlens_k", "page_table[live]")


@dataclass(frozen=True)
class Known:
    """One documented difference: any of ``fields`` in ``modes`` x ``phases`` at ``pins``."""

    key: str
    fields: tuple[str, ...]
    modes: tuple[str, ...]
    phases: tuple[str, ...]
    pins: tuple[str, ...]
    upstream: tuple[tuple[str, str, int], ...]  #: (pin, file, line) where upstream sets it
    refspec: str  #: what refspec does instead
    why: str  #: why the kernel result cannot change
    unread: str = ""  #: for a kernel-listed field: why this kernel call does not read it (a citation)
    at_bound: bool = False  #: documents a table *width* difference only, upstream at or above the kernel bound

    def __post_init__(self):
        for f in self.fields:
            b = base_field(f)
            if self.at_bound and b != "page_table[dead]":
                raise ValueError(f"{self.key}: at_bound documents a page-table width; {f} has no width")
            if f.startswith("tree:"):
                raise ValueError(f"{self.key}: {f} is the verify tree itself; a difference there is a bug")
            if b in KERNEL_FIELDS and not (self.phases == ("capture",) and b in REWRITTEN_AT_REPLAY) and \
                    not (b in UNREAD_IF_CITED and self.unread):
                raise ValueError(f"{self.key}: {f} is read by the kernel; a difference there is a bug, never a "
                                 f"documented difference (only its capture-time contents may differ)")


_DECODE_MODES = ("decode", "draft_decode", "verify", "draft_extend", "draft_extend_v2")
_TREE = ("tree_verify", "tree_draft_decode")
KNOWN: tuple[Known, ...] = (
    Known("replay-max-k-context", ("max_seq_len_k",), ("decode", "draft_extend_v2"), ("replay", "replay-staged"), NEW,
          (("0.5.23", FA, 741), ("0.5.23", FA, 3137), ("0.5.23", FA, 3289), ("0.5.23", FA, 541)),
          "0: graph metadata keeps no max K (replay bounds the page copy by the CPU mirror)",
          "replay passes no CPU mirror (sync-free), so upstream sets max_context_len; FA3 never reads "
          "max_seqlen_k (only FA4's static grid does)"),
    Known("capture-max-k-dummy", ("max_seq_len_k",), ("decode", "draft_extend_v2"), ("capture",), NEW,
          (("0.5.23", FA, 648),),
          "0: not set at capture",
          "upstream takes max(seq_lens) of the capture-time dummy batch; FA3 does not read max_seqlen_k"),
    Known("capture-max-k-dummy-legacy", ("max_seq_len_k",), _DECODE_MODES, ("capture",), OLD,
          (("0.5.12.post1", FA, 1651), ("0.5.12.post1", FA, 1721), ("0.5.12.post1", FA, 1762),
           ("0.5.12.post1", FA, 1854)),
          "0: not set at capture",
          "the legacy capture hook takes max(seq_lens) of the dummy batch (+ delta); FA3 does not read "
          "max_seqlen_k"),
    Known("replay-max-k-mirror", ("max_seq_len_k",), _DECODE_MODES, ("replay",), OLD,
          (("0.5.12.post1", FA, 1920), ("0.5.12.post1", FA, 1997), ("0.5.12.post1", FA, 2042),
           ("0.5.12.post1", FA, 2161), ("0.5.12.post1", FA, 2195)),
          "0: graph metadata keeps no max K",
          "the legacy replay hook keeps max(seq_lens_cpu) + delta as its host-side page bound; FA3 does "
          "not read max_seqlen_k"),
    Known("capture-contents-legacy", ("cache_seqlens_int32", "cu_seqlens_k"),
          ("draft_decode", "verify", "draft_extend", "draft_extend_v2"), ("capture",), OLD,
          (("0.5.12.post1", FA, 1648), ("0.5.12.post1", FA, 1657), ("0.5.12.post1", FA, 1774),
           ("0.5.12.post1", FA, 1864)),
          "fills the capture-time buffers from the dummy batch (K = fill + delta, their cumsum)",
          "the legacy capture hook binds the buffers without filling them (zeros); a CUDA graph keeps "
          "addresses, not contents, the capture run's output is discarded, and every replay rewrites "
          "both before the graph runs (the replay rows compare the rewritten values)"),
    Known("idle-context-width", ("max_seq_len_k",), ("idle",), ("eager",), NEW, (("0.5.23", FA, 905),),
          "0: no requests",
          "an empty batch has no CPU max, so upstream falls back to max_context_len; nothing is read"),
    Known("idle-table-width", ("page_table[dead]",), ("idle",), ("eager",), NEW, (("0.5.23", FA, 1004),),
          "a [0, 1] table",
          "upstream slices req_to_token[[], :max_context_len]: zero rows either way, no page is ever read"),
    Known("graph-table-headroom", ("page_table[dead]",), _DECODE_MODES, ("capture", "replay", "replay-staged"), BOTH,
          (("0.5.23", FA, 2432), ("0.5.23", FA, 196), ("0.5.12.post1", FA, 1338)),
          "a graph table of ceil(req_to_token.shape[1] / P) columns (CG-008): req_to_token rows carry SGLang's "
          "speculative headroom (allocation_sizing.py:96 at 0.5.23), so refspec's table is the wider one",
          "upstream's table has ceil(max_context_len / P) columns; while that is at least the kernel bound "
          "ceil(max_b K_b / P) every live page is in both tables and the columns past it are never read (PA-007); "
          "below the bound it is the known bug context-wall-page-table, never this entry",
          at_bound=True),
    Known("replay-dead-columns", ("page_table[dead]",), ("decode", "draft_decode", "verify", "draft_extend_v2"),
          ("replay", "replay-staged"), NEW, (("0.5.23", KM, 256), ("0.5.23", KM, 265), ("0.5.23", KM, 383)),
          "copies columns [0, ceil(max K / P)) of every row (graph_metadata._write_page_table), so a short "
          "row also holds its req_to_token entries past its own last page (as 0.5.12.post1 does)",
          "upstream's replay kernel stores only each row's live pages (store mask cols < "
          "ceil(K_b / P)); columns at or past ceil(K_b / P) are never read (PA-007)"),
    # ---- eager without CPU mirrors (cases.without_mirrors: needs_cpu_seq_lens False) ----
    Known("eager-max-k-context", ("max_seq_len_k",), ("draft_extend_v2",), ("eager",), NEW,
          (("0.5.23", FA, 902), ("0.5.23", FA, 1185)),
          "max_b K_b",
          "with no seq_lens_cpu (the spec-v2 worker when no backend needs CPU mirrors) upstream's eager bound "
          "is max_context_len; FA3 does not read max_seqlen_k (only FA4's static grid does)"),
    Known("eager-table-context-width", ("page_table[dead]",), ("draft_extend_v2",), ("eager",), NEW,
          (("0.5.23", FA, 1190),),
          "a table of ceil(max_b K_b / P) columns",
          "with no seq_lens_cpu upstream slices req_to_token[:, :max_context_len]; while that is at least the "
          "kernel bound every live page is in both tables and the columns past it are never read (PA-007); "
          "below the bound it is the known bug context-wall-page-table, never this entry",
          at_bound=True),
    # ---- top-k > 1 (refspec.conformance.tree_cases) ----
    Known("tree-expand-max-k", ("expand:max_seq_len_k",), _TREE, ("eager",), BOTH,
          (("0.5.23", FA, 87), ("0.5.23", FA, 964), ("0.5.23", FA, 1105), ("0.5.12.post1", FA, 49),
           ("0.5.12.post1", FA, 321), ("0.5.12.post1", FA, 423)),
          "N (verify: at most N tree keys) / s + 1 + (P - 1) (draft: steps plus the tail copy)",
          "upstream's eager expand metadata never sets max_seq_len_k (the dataclass default 0); FA3 does not "
          "read max_seqlen_k (only FA4's static grid does, :2316)"),
    Known("tree-replay-prefix-max-k", ("prefix:max_seq_len_k",), _TREE, ("replay",), BOTH,
          (("0.5.23", FA, 3057), ("0.5.23", FA, 3203), ("0.5.12.post1", FA, 1957), ("0.5.12.post1", FA, 2075)),
          "0: graph metadata keeps no max K",
          "upstream keeps its host-side page-copy bound there: max_context_len at 0.5.23 (no CPU mirror), "
          "max(seq_lens_cpu) at 0.5.12.post1; FA3 does not read max_seqlen_k"),
    Known("tree-capture-max-k-legacy", ("prefix:max_seq_len_k",), ("tree_draft_decode",), ("capture",), OLD,
          (("0.5.12.post1", FA, 1678),),
          "0: not set at capture",
          "the legacy capture hook takes max(seq_lens) of the dummy batch; FA3 does not read max_seqlen_k"),
    Known("tree-prefix-table-width", ("prefix:page_table[dead]",), _TREE, ("capture", "replay"), BOTH,
          (("0.5.23", FA, 2501), ("0.5.23", FA, 2639), ("0.5.23", FA, 3066), ("0.5.23", FA, 3208),
           ("0.5.12.post1", FA, 1422), ("0.5.12.post1", FA, 1549)),
          "a [bs, ceil(context_len / P)] prefix table (CG-008); replay writes ceil(max K / P) columns",
          "upstream's *_topk_normal page_table buffers are max_context_len columns wide (a page count "
          "only for P = 1) and replay copies the pages of max_context_len; columns at or past "
          "ceil(K_b / P) are never read (PA-007)"),
    Known("tree-expand-table-width", ("expand:page_table[dead]",), ("tree_draft_decode",),
          ("eager", "capture", "replay"), BOTH,
          (("0.5.23", FA, 1350), ("0.5.23", FA, 2531), ("0.5.12.post1", FA, 592), ("0.5.12.post1", FA, 1452)),
          "a draft expand table of S columns eager (TR-014) and s + 2 in the graph buffer (TR-018), the unique pages "
          "of the row's lp + s + 1 keys in its first columns",
          "upstream's expand table has its own width (S columns eager, decode_length + 1 in the graph buffer at "
          "these releases; ceil(decode_length / P) eager and decode_length in the buffer before sglang#15469); the "
          "kernel reads ceil(K_b / P) pages of a row, so while upstream's table has at least the kernel bound "
          "ceil(max_b K_b / P) columns every live page is in both and the rest are never read (PA-007); below the "
          "bound it is PA-003 / CG-008, never this entry",
          at_bound=True),
    Known("tree-capture-contents", ("prefix:cache_seqlens_int32", "prefix:cu_seqlens_k", "expand:cache_seqlens_int32",
                                    "expand:cu_seqlens_k"), _TREE, ("capture",), BOTH,
          (("0.5.23", FA, 669), ("0.5.23", FA, 678), ("0.5.23", FA, 2761), ("0.5.23", FA, 2845),
           ("0.5.12.post1", FA, 1672), ("0.5.12.post1", FA, 1787)),
          "fills the capture-time buffers from the padded dummy batch (L = 1, row 0)",
          "for top-k > 1 upstream's capture only binds its *_topk_normal / *_topk_expand buffers (their "
          "init_cuda_graph_state values) and returns; a graph keeps addresses, not contents, and every "
          "kernel-read one is rewritten at replay (the replay rows compare the rewritten values)"),
    Known("tree-draft-prefix-cu-k", ("prefix:cu_seqlens_k",), ("tree_draft_decode",), ("eager", "replay"), BOTH,
          (("0.5.23", FA, 955), ("0.5.23", FA, 1341), ("0.5.23", FA, 3053), ("0.5.23", FA, 2285),
           ("0.5.12.post1", FA, 312), ("0.5.12.post1", FA, 583), ("0.5.12.post1", FA, 1955),
           ("0.5.12.post1", FA, 1196)),
          "cumsum(cache_seqlens) = cumsum(L - lp) (consistent with the K it passes)",
          "upstream computes it before `cache_seqlens_int32 -= last_page_lens` (eager, P > 1: cumsum(L)) and "
          "never writes it at replay ('cu_seqlens_k is not needed': zeros); its draft-decode prefix call "
          "passes no cu_seqlens_k_new at all",
          unread="the draft-decode prefix flash_attn_with_kvcache call (0.5.23 :2285, 0.5.12.post1 :1196) "
                 "passes page_table, cache_seqlens, cu_seqlens_q and max_seqlen_q only"),
    Known("tree-draft-expand-cu-k", ("expand:cu_seqlens_k",), ("tree_draft_decode",), ("eager", "replay"), BOTH,
          (("0.5.23", FA, 979), ("0.5.23", FA, 1345), ("0.5.23", FA, 2522), ("0.5.23", FA, 2328),
           ("0.5.12.post1", FA, 336), ("0.5.12.post1", FA, 587), ("0.5.12.post1", FA, 1443),
           ("0.5.12.post1", FA, 1227)),
          "cumsum(cache_seqlens) = cumsum(s + 1 + lp) (consistent with the K it passes)",
          "P > 1: upstream's arange(0, .., s + 1) is built before `cache_seqlens += lp` (eager) and is a static "
          "buffer replay never rewrites, so it omits the tail lp; it reaches the kernel only as cu_seqlens_k_new",
          unread="FA3 reads cu_seqlens_k_new only when new K/V are passed (flash_api.cpp:929), which SGLang "
                 "never does (docs/kernel-facts.md#cu-seqlens-k-new, measured on the H200 for the top-k = 1 "
                 "calls; tests/test_gpu_tree_cu_seqlens_k.py makes this expand call with the stale value)"),
)


@dataclass(frozen=True)
class Bug:
    """A known upstream bug: code that breaks rule ``rule``, as the comparison sees it.

    A failing row in ``modes`` x ``phases`` is this bug when every field that differs undocumented
    is one of ``fields`` (and at least one does), or when upstream raised an error containing
    ``error``.  Where it is recognised:

    * a bug with a **signature** (``short_table``: a page table below the kernel bound whose live
      pages agree with refspec's up to upstream's width, so the table only lacks live pages) is
      recognised on **any** code under test -- a release, a wheel, a source tree such as a PR
      branch -- because that condition is the defect itself, whoever has it;
    * any other bug only on the code ``pins`` it was reproduced on (a release, or a release plus
      stored patches: :func:`refspec.conformance.patches.patched_copy`): its fields alone could be
      a different defect on other code.

    ``pins`` is in both cases the code whose negative control (:mod:`refspec.conformance.controls`)
    shows it.  Such a row still fails (it is upstream's bug, reported with the rule); the run's
    verdict separates it from an unexplained failure.
    """

    key: str
    rule: str  #: the rule ID a review quotes (``python -m refspec cite ID``)
    also: tuple[str, ...]  #: rules the same defect breaks too (cross-references)
    pins: tuple[str, ...]  #: the code it was reproduced on (the only code it is recognised on without a signature)
    modes: tuple[str, ...]
    phases: tuple[str, ...]
    fields: tuple[str, ...]
    error: str
    upstream: tuple[tuple[str, str, int], ...]  #: (pin, file, line) of the defect
    status: str  #: fixed by / open PR / reverted
    what: str

    short_table: bool = False  #: shown only when upstream's table is below the kernel bound (a live page dropped)
    issue: int | None = None  #: the sglang PR a report links (``sglang#N``): the fix, the open fix, or the bug's own PR
    #: (mode, phase) pairs recognised besides ``modes`` x ``phases`` (the wall's eager draft extend v2
    #: without CPU mirrors: :func:`refspec.conformance.cases.without_mirrors`)
    also_at: tuple[tuple[str, str], ...] = ()
    introduced: int | None = None  #: the sglang PR that introduced it, where known (sglang/pull/N)
    fixed_by: int | None = None  #: the sglang PR that fixed it, where merged

    @property
    def signature(self) -> bool:
        """True: recognised on any code by its fields and condition, not only at ``pins``."""
        return self.short_table

    @property
    def ref(self) -> str:
        """``sglang#35985`` ('' without an issue)."""
        return f"sglang#{self.issue}" if self.issue else ""

    @property
    def url(self) -> str:
        """The PR's GitHub link ('' without one)."""
        return f"https://github.com/sgl-project/sglang/pull/{self.issue}" if self.issue else ""

    @property
    def marker(self) -> str:
        """``known upstream bug context-wall-page-table (sglang#35985)``: what a report prints on its rows."""
        return f"known upstream bug {self.key}" + (f" ({self.ref})" if self.issue else "")

    @property
    def history(self) -> str:
        """``introduced by sglang#15469, fixed by sglang#27360`` ('' when neither is known)."""
        return ", ".join(f"{w} by sglang#{n}" for w, n in (("introduced", self.introduced), ("fixed", self.fixed_by))
                         if n)

    @property
    def hint(self) -> str:
        """What a failing row that only *looks like* this bug says (code other than ``pins``, no signature):
        ``matches known upstream bug X (introduced by sglang#15469, fixed by sglang#27360)``."""
        return f"matches known upstream bug {self.key}" + (f" ({self.history})" if self.history else "")

    def matches(self, code: str, mode: str, phase: str, undocumented: list[str], error: str | None,
                short: bool = False) -> bool:
        """``undocumented``: the failing row's undocumented field names; ``short``: one of them is a
        page table narrower than ceil(K_b / P) whose live pages agree up to its width and none is a
        live table that differs otherwise (``Diff.short_table``, ``Diff.truncated``); ``code``: the
        code's label, compared with ``pins`` only for a bug without a signature."""
        if (code not in self.pins and not self.signature) or \
                ((mode not in self.modes or phase not in self.phases) and (mode, phase) not in self.also_at):
            return False
        if error is not None:
            return bool(self.error) and self.error in error
        if self.short_table and not short:
            return False
        return bool(undocumented) and set(undocumented) <= set(self.fields)


#: the patched code a stored diff makes (``refspec/conformance/patches/``): base pin + patch name
def patched(pin: str, *names: str) -> str:
    return "+".join((pin, *names))


DE_V2_DOUBLE_COUNT = patched("0.5.23", "pr26512-draft-extend-v2-double-count")
WALL_FIXED = patched("0.5.23", "pr35985-page-table-width")
PFT = "python/sglang/srt/debug_utils/pr_fix_toggle.py"
BUGS: tuple[Bug, ...] = (
    Bug("context-wall-page-table", "CG-008", ("PA-003",), BOTH + (DE_V2_DOUBLE_COUNT,),
        ("decode", "verify", "draft_decode", "draft_extend", "draft_extend_v2"),
        ("capture", "replay", "replay-staged"),
        ("page_table[live]", "page_table[dead]"), "",
        (("0.5.23", FA, 196), ("0.5.23", FA, 2432), ("0.5.12.post1", FA, 1338), ("0.5.23", FA, 1190)),
        "open: sglang#35985 (https://github.com/sgl-project/sglang/pull/35985); #29665 proposed the same and was "
        "closed",
        "the graph page tables have ceil(context_len / P) columns while req_to_token rows are wider (speculative "
        "headroom): a request near the context limit (L = 61, P = 16, context 64) verifies K = L + N = 65 keys = 5 "
        "pages, and replay writes 4: the kernel is handed a table without the request's last live page (below "
        "the kernel bound ceil(max_b K_b / P); a table only narrower than refspec's is graph-table-headroom). "
        "The eager builder has the same wall where no CPU mirror is published (seq_lens_cpu None): its table is "
        "req_to_token[:, :max_context_len] (#35985 widens max_context_len by N, which covers both)",
        short_table=True, issue=35985, also_at=(("draft_extend_v2", "eager"),)),
    Bug("draft-expand-unsliced-scatter", "TR-018", (), OLD, ("tree_draft_decode",), ("replay",),
        ("expand:page_table[dead]",), "out of bounds",
        (("0.5.12.post1", FA, 1977), ("0.5.12.post1", FA, 3017), ("0.5.23", PFT, 76), ("0.5.23", FA, 3084)),
        "fixed by sglang#27360 (https://github.com/sgl-project/sglang/pull/27360; 0.5.23's pr_fix_toggle.py "
        "registers the slice cache_loc[:, :decode_length] in _apply_cuda_graph_metadata as #27360's fix)",
        "the top-k > 1 draft-decode replay feeds the whole num_steps-wide cache_loc row to the unique-pages "
        "scatter into the decode_length + 1 wide expand table: with few distinct pages (S = 3) the extra pages "
        "land in dead columns; once a branch spans more pages than that (num_steps = 6, P = 2) the scatter "
        "raises 'index 2 is out of bounds' (the #25077 family); #15469 (v0.5.7) introduced it: its new helper "
        "draft_decode_set_expand_metadata takes the whole cache_loc row where the code before it sliced "
        "cache_loc[:, :decode_length]", issue=27360, introduced=15469, fixed_by=27360),
    Bug("draft-extend-v2-double-count", "MD-008", ("MD-003",), (DE_V2_DOUBLE_COUNT,), ("draft_extend_v2",),
        ("eager", "replay"), ("cache_seqlens_int32", "cu_seqlens_k", "max_seq_len_k", "page_table[dead]"), "",
        (),
        "merged as sglang#26512 (https://github.com/sgl-project/sglang/pull/26512), reverted by #26628; "
        "#26651 fixed the test fixture instead",
        "DRAFT_EXTEND_V2's seq_lens already counts the N draft tokens (eagle_info_v2 adds them before the "
        "backend runs); #26512 adds extend_seq_lens again, so K_b = L + 2N", issue=26512),
    # --- the MLA forward path (refspec.conformance.mla_forward: upstream's own MLA forward, pool and worker) ---
    Bug("mla-verify-expand-paged-view", "ML-011", ("PA-011",), BOTH, ("mla_tree_verify",),
        ("eager", "capture", "replay"),
        # (mla:out the live rows, mla:out[padded] a replay's padded rows: they read through the same views)
        ("kernel:expand.k_cache", "kernel:expand.v_cache", "mla:out", "mla:out[padded]"), "",
        (("0.5.23", FA, 2036), ("0.5.23", FA, 1949), ("0.5.23", FA, 1844), ("0.5.12.post1", FA, 1001),
         ("0.5.12.post1", FA, 958), ("0.5.12.post1", FA, 857)),
        "open: no upstream issue or PR known (found by this comparison, 2026-12-07); reachable at 0.5.23 (its "
        "ServerArgs allow fa3 with top-k > 1 and page size > 1: arg_groups/speculative_hook.py L1271-1283, "
        "_PAGE_TREE_SPEC_BACKENDS; no MLA guard); at 0.5.12.post1 the verify forward runs too (server_args.py "
        "L3837-3844 allows fa3), but every such round then ends in mla-pool-no-move-kv-cache "
        "(eagle_info.py:543 after the verify, eagle_worker.py:729 before the draft when a tail page is partial)",
        "MLA + top-k > 1 + P > 1, TARGET_VERIFY: the MLA branch of forward_extend hands the cascade's expand "
        "call the P-paged views (k_rope_cache, c_kv_cache: [slots / P, P, 1, D]) with "
        "forward_metadata_spec_decode_expand.page_table, whose entries are token slots; the MHA branch reads "
        "paged_view(cache, 1) there (sglang#7725). The kernel reads page `slot` at element slot * P * row: "
        "outside the pool for most slots (refspec's emulator refuses page id >= slots / P, PA-011), another "
        "request's rows for the rest; every verify row's output is wrong (smallest case: bs = 3, P = 4, k = 2, "
        "eager)"),
    Bug("mla-pool-no-move-kv-cache", "ML-012", (), OLD, ("mla_tree_draft_decode",), ("eager",), (),
        "move_kv_cache",
        (("0.5.12.post1", "python/sglang/srt/speculative/eagle_worker.py", 729),
         ("0.5.12.post1", "python/sglang/srt/speculative/eagle_info.py", 543),
         ("0.5.12.post1", "python/sglang/srt/mem_cache/memory_pool.py", 1618),
         ("0.5.23", "python/sglang/srt/mem_cache/memory_pool.py", 5079)),
        "fixed by sglang#26982 (https://github.com/sgl-project/sglang/pull/26982: MLATokenToKVPool.move_kv_cache); "
        "#14817 / #9742 note MLA models did not support top-k > 1 with page size > 1",
        "MLA + EAGLE top-k > 1 + P > 1: the v1 worker's draft preprocess copies each request's partial prefix "
        "tail page into the branches with self.draft_model_runner.token_to_kv_pool.move_kv_cache, which "
        "0.5.12.post1's MLATokenToKVPool does not have: AttributeError before the first draft forward (when "
        "some L mod P != 0; verify's own tail moves, eagle_info.py:543, fail the same way)",
        issue=26982, fixed_by=26982),
    Bug("mla-store-writes-slot-0", "ML-002", (), OLD,
        ("mla_decode", "mla_verify", "mla_draft_decode", "mla_draft_extend", "mla_draft_extend_v2",
         "mla_tree_verify", "mla_tree_draft_decode"), ("capture", "replay"), ("mla:slot0", "mla:out[padded]"), "",
        (("0.5.12.post1", "python/sglang/srt/mem_cache/utils.py", 101),
         ("0.5.12.post1", "python/sglang/srt/mem_cache/memory_pool.py", 1750),
         ("0.5.23", "python/sglang/kernels/ops/kvcache/mla_buffer.py", 42)),
        "fixed by sglang#36003 (https://github.com/sgl-project/sglang/pull/36003: reserved_skip_index=0 in the "
        "MLA writers; #36207)",
        "the MLA KV writer (set_mla_kv_buffer_triton) stores every row, a CUDA graph's padded rows "
        "(out_cache_loc 0) into the reserved padding slot 0 too; the padded rows then read that row "
        "(mla:out[padded]: the output differs on padded rows only), and a later read of slot 0 sees whatever "
        "padding wrote",
        issue=36003, fixed_by=36003),
)


def bug(code: str, mode: str, phase: str, undocumented: list[str], error: str | None,
        short: bool = False) -> Bug | None:
    """The known upstream bug a failing row of ``code`` shows, or None (an unexplained failure);
    ``short``: a differing page table is below the kernel bound, lacking only live pages
    (:meth:`Bug.matches`, :func:`below_bound`)."""
    return next((b for b in BUGS if b.matches(code, mode, phase, undocumented, error, short)), None)


def cover(code: str, mode: str, phase: str, undocumented) -> list[tuple[str, Bug]]:
    """``[(field, bug)]`` when every undocumented :class:`~refspec.conformance.compare.Diff` of a
    failing row of ``code`` is a field of some known bug at (``mode``, ``phase``), each field's bug
    (the first of :data:`BUGS` that matches it alone), else ``[]``: a row that shows two known bugs
    at once (an MLA graph replay at 0.5.12.post1: the padded rows' slot-0 write of
    ``mla-store-writes-slot-0`` beside the verify expand call of ``mla-verify-expand-paged-view``).
    :func:`bug` names a row that one bug explains."""
    out = []
    for d in undocumented:
        b = bug(code, mode, phase, [d.field], None, below_bound([d]))
        if b is None:
            return []
        out.append((d.field, b))
    return out


def resembles(code: str, mode: str, phase: str, undocumented: list[str], error: str | None,
              short: bool = False) -> Bug | None:
    """A known upstream bug without a signature that a failing row of ``code`` (not one of the bug's
    ``pins``) shows the fields or error of: a hint for the reviewer (:attr:`Bug.hint`), which never
    suppresses the failure; None when :func:`bug` already names one, or none matches."""
    if bug(code, mode, phase, undocumented, error, short) is not None:
        return None
    return next((b for b in BUGS if not b.signature and code not in b.pins and
                 b.matches(b.pins[0], mode, phase, undocumented, error, short)), None)


def below_bound(diffs) -> bool:
    """The ``short`` of :func:`bug` for a row's undocumented :class:`~refspec.conformance.compare.Diff` s:
    a page table is below the kernel bound (``short_table``) and every ``page_table[live]`` diff
    only lacks the live pages past upstream's width (``truncated``), never a wrong page id."""
    live = [d for d in diffs if base_field(d.field) == "page_table[live]"]
    return any(d.short_table for d in diffs) and all(d.truncated for d in live)


def by_key(key: str) -> Bug:
    """The :data:`BUGS` entry ``key`` (KeyError naming it if none)."""
    for b in BUGS:
        if b.key == key:
            return b
    raise KeyError(f"no known upstream bug {key!r}")


def match(pin: str, mode: str, phase: str, field: str, diff=None) -> Known | None:
    """The entry documenting ``field`` differing for (pin, mode, phase), or None.

    ``diff`` (the :class:`~refspec.conformance.compare.Diff`): a page table below the kernel bound
    (``short_table``) is never documented; an ``at_bound`` entry needs ``diff`` and a width-only
    difference (``width_only``)."""
    if diff is not None and diff.short_table:
        return None
    for k in KNOWN:
        if field in k.fields and pin in k.pins and mode in k.modes and phase in k.phases:
            if k.at_bound and (diff is None or not diff.width_only):
                continue
            return k
    return None


def link(pin: str, file: str, line: int) -> str:
    """A one-click GitHub link to ``file:line`` at the release tag of ``pin``."""
    return f"https://github.com/sgl-project/sglang/blob/v{pin}/{file}#L{line}"


#: where upstream builds each (mode, phase)'s metadata: the file:line a "differs" row points at
SOURCES = {
    "0.5.23": {
        ("decode", "eager"): (FA, 995), ("draft_decode", "eager"): (FA, 909), ("verify", "eager"): (FA, 1036),
        ("extend", "eager"): (FA, 1181), ("extend_prefix", "eager"): (FA, 1208),
        ("draft_extend_v2", "eager"): (FA, 1194), ("idle", "eager"): (FA, 908),
        ("decode", "capture"): (FA, 2798), ("draft_decode", "capture"): (FA, 2739), ("verify", "capture"): (FA, 2823),
        ("draft_extend_v2", "capture"): (FA, 2905),
        ("decode", "replay"): (FA, 3106), ("draft_decode", "replay"): (FA, 3027), ("verify", "replay"): (FA, 3170),
        ("draft_extend_v2", "replay"): (FA, 3281), ("draft_extend_v2", "replay-staged"): (FA, 539),
        ("tree_verify", "eager"): (FA, 1084), ("tree_draft_decode", "eager"): (FA, 944),
        ("tree_verify", "capture"): (FA, 2845), ("tree_draft_decode", "capture"): (FA, 2761),
        ("tree_verify", "replay"): (FA, 3195), ("tree_draft_decode", "replay"): (FA, 3043),
    },
    "0.5.12.post1": {
        ("decode", "eager"): (FA, 352), ("draft_decode", "eager"): (FA, 280), ("verify", "eager"): (FA, 374),
        ("extend", "eager"): (FA, 501), ("extend_prefix", "eager"): (FA, 513), ("draft_extend", "eager"): (FA, 513),
        ("draft_extend_v2", "eager"): (FA, 513),
        ("decode", "capture"): (FA, 1712), ("draft_decode", "capture"): (FA, 1645), ("verify", "capture"): (FA, 1752),
        ("draft_extend", "capture"): (FA, 1846), ("draft_extend_v2", "capture"): (FA, 1846),
        ("decode", "replay"): (FA, 1993), ("draft_decode", "replay"): (FA, 1915), ("verify", "replay"): (FA, 2035),
        ("draft_extend", "replay"): (FA, 2157), ("draft_extend_v2", "replay"): (FA, 2191),
        ("tree_verify", "eager"): (FA, 403), ("tree_draft_decode", "eager"): (FA, 302),
        ("tree_verify", "capture"): (FA, 1787), ("tree_draft_decode", "capture"): (FA, 1672),
        ("tree_verify", "replay"): (FA, 2070), ("tree_draft_decode", "replay"): (FA, 1945),
    },
}


EU = "python/sglang/srt/speculative/eagle_utils.py"
EWC = "python/sglang/srt/speculative/eagle_worker_common.py"
#: the ``tree:`` fields come from upstream's speculative code, not the attention backend (0.5.23)
TREE_SOURCES = {f"tree:{f}": (EU, 138) for f in ("custom_mask", "positions", "retrive_index", "retrive_next_token",
                                                 "retrive_next_sibling", "draft_tokens")}
TREE_SOURCES.update({"tree:parent_list": (EU, 100), "tree:top_scores_index": (EU, 100)})
TREE_SOURCES.update({"tree:out_cache_loc": (EWC, 241), "tree:tail_copy": (EWC, 65), "tree:predicts": (EU, 632),
                     "tree:accept_index": (EU, 632), "tree:accept_token_num": (EU, 632)})


def source(pin: str, mode: str, phase: str, field: str = "") -> str:
    """``file:line`` (and link) of upstream's builder for (mode, phase) at ``pin`` (of ``field``
    where it has its own: the ``tree:`` part)."""
    f, line = TREE_SOURCES[field] if field in TREE_SOURCES else SOURCES[pin][(mode, phase)]
    return f"{f.split('/')[-1]}:{line} {link(pin, f, line)}"
