"""Which rule a conformance difference breaks, and where the code under test produced the field.

:func:`rule_for` maps a compared field of a (mode, phase) to the invariant that governs it
(``docs/spec/metadata.md``, ``graphs.md``, ``paging-attention.md``, ``tree.md``); its level is the
catalogue's (:data:`refspec.core.invariants.RULES`, read at run time).  :func:`locate` reads the
installed upstream file: :func:`ran` picks, among the upstream lines that ran while the result
was built (recorded in the worker, :mod:`refspec.conformance.lines`), the last that writes the
field; :func:`locate`, the fallback when none does, reads the line of the function that builds
that (mode, phase) where the field is written; so a failing row points at the code under test,
not at a table.
"""

from __future__ import annotations

import ast
import os
import re
from functools import lru_cache

from refspec.conformance.compare import base_field
from refspec.core.invariants import RULES

#: K_b (cache_seqlens) per mode: MD-003's formula, or the mode's own rule
K_RULE = {"decode": "MD-003", "extend": "MD-003", "extend_prefix": "MD-003", "idle": "MD-003", "verify": "MD-011",
          "draft_decode": "MD-010", "draft_extend": "MD-003", "draft_extend_v2": "MD-008"}
#: cu_seqlens_q (q_b) per mode at eager
Q_RULE = {"verify": "MD-011", "draft_decode": "MD-010", "draft_extend": "MD-009"}
#: cu_seqlens_q at capture / replay
Q_GRAPH_RULE = {"draft_extend": "CG-003", "draft_extend_v2": "CG-004"}
TREE_PART = {"custom_mask": "TR-004", "positions": "TR-005", "retrive_index": "TR-003", "retrive_next_token": "TR-003",
             "retrive_next_sibling": "TR-003", "draft_tokens": "TR-002", "parent_list": "TR-002",
             "top_scores_index": "TR-002", "out_cache_loc": "TR-015", "tail_copy": "TR-015"}
GRAPH_PHASES = ("capture", "replay", "replay-staged")


def rule_for(mode: str, phase: str, field: str | None, short_table: bool = False) -> str:
    """The rule ID governing ``field`` of ``mode`` at ``phase`` (``field`` None: an upstream error
    in that (mode, phase)).  ``short_table``: upstream's page table has fewer columns than the
    ceil(K_b / P) live pages: PA-003, or at capture / replay its graph-buffer form CG-008 (one
    defect, one level; the known upstream bug ``context-wall-page-table`` names the same ID), for
    ``page_table[live]`` and for the ``page_table[dead]`` width below the kernel bound alike (the
    same table, so the same rule on any code, whether or not a known bug names the row)."""
    graph = phase in GRAPH_PHASES
    if mode.startswith("tree_"):
        part, _, f = (field or "").rpartition(":")
        if part == "tree":
            return TREE_PART.get(f, "TR-016")
        if short_table:
            return "CG-008" if graph else "PA-003"
        if graph or field is None:
            return "TR-018" if graph else {"tree_verify": "TR-010", "tree_draft_decode": "TR-013"}[mode]
        verify = mode == "tree_verify"
        return ("TR-011" if verify else "TR-014") if part == "expand" else ("TR-010" if verify else "TR-013")
    if field is None:
        return Q_GRAPH_RULE.get(mode, "CG-002") if graph else K_RULE.get(mode, "MD-003")
    f = base_field(field)
    if f == "page_table[live]":
        return ("CG-008" if graph else "PA-003") if short_table else "PA-002"
    if f == "page_table[dead]":  # below the kernel bound the width is the live-page defect, not MD-007's columns
        return ("CG-008" if graph else "PA-003") if short_table else "MD-007"
    if f == "cache_seqlens_int32":
        return K_RULE.get(mode, "MD-003")
    if f == "cu_seqlens_q":
        return Q_GRAPH_RULE.get(mode, "CG-002") if graph else Q_RULE.get(mode, "MD-002")
    if f == "max_seq_len_q":
        return "CG-006" if graph else "PA-010"
    if f in ("cu_seqlens_k", "max_seq_len_k"):
        return "MD-006"
    return "CG-002" if graph else "MD-003"


#: an upstream exception at the page-table bound: indexing past a table's columns (dimension 1)
_BOUND = re.compile(r"^IndexError\b.*out of bounds for dimension 1\b")
_TABLES = re.compile(r"\b(req_to_token|page_table)\b")


def error_rule(mode: str, phase: str, error: str, statement: str = "") -> tuple[str, str]:
    """``(rule ID, note)`` for an upstream exception of ``mode`` at ``phase``; ``statement`` is
    the upstream source statement it was raised in (:func:`statement`).

    An ``IndexError`` out of bounds for dimension 1 in a statement that indexes ``req_to_token``
    or ``page_table`` reads a table past its width: the page-table bound, CG-008 in every phase
    (upstream's static bound ``max_context_len`` sizes the tables and strided indices of eager and
    graph paths alike; PA-003 is the same defect).  Any other exception keeps the mode's rule
    (:func:`rule_for` with no field) and the note says it is an upstream exception, not a
    compared field."""
    if _BOUND.search(error) and _TABLES.search(statement):
        return "CG-008", "upstream exception past a table's width (req_to_token / page_table: the page-table bound)"
    return rule_for(mode, phase, None), "upstream exception (the mode's rule: no field was compared)"


def statement(path: str, line: int) -> str:
    """The source of the innermost simple statement of ``path`` holding ``line`` ('' if none)."""
    try:
        tree, text = _tree(path)
    except (OSError, SyntaxError):
        return ""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not hasattr(node, "body") and node.lineno <= line <= node.end_lineno:
            if best is None or node.lineno >= best.lineno:
                best = node
    return "" if best is None else ast.get_source_segment(text, best) or ""


@lru_cache(maxsize=16)
def _tree(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return ast.parse(text, path), text


def level(rule: str) -> str:
    """The rule's conformance level, as the catalogue states it now (e.g. ``upstream behaviour``)."""
    return str(RULES[rule].level)


FA = "sglang/srt/layers/attention/flashattention_backend.py"
#: the functions that build each phase's metadata, in the order they run (graph / legacy hooks)
PHASE_FUNCS = {
    ("graph", "eager"): ("FlashAttentionBackend.init_forward_metadata",),
    ("graph", "capture"): ("FlashAttentionBackend.init_forward_metadata_out_graph",
                           "FlashAttentionBackend._init_full_cg_decode_metadata",
                           "FlashAttentionBackend._bind_metadata_buffers",
                           "FlashAttentionBackend.init_cuda_graph_state"),
    ("graph", "replay"): ("FlashAttentionBackend._apply_cuda_graph_metadata",
                          "FlashAttentionBackend._set_decode_page_metadata",
                          "FlashAttentionBackend.init_forward_metadata_in_graph",
                          "FlashAttentionBackend.init_forward_metadata_out_graph",
                          "normal_decode_set_metadata", "draft_extend_set_metadata", "_fused_decode_metadata_kernel",
                          "_draft_extend_metadata_kernel"),
    ("graph", "replay-staged"): ("FlashAttentionBackend.stage_draft_extend_metadata",
                                 "FlashAttentionBackend.init_forward_metadata_in_graph", "draft_extend_set_metadata",
                                 "_draft_extend_metadata_kernel"),
    ("legacy", "eager"): ("FlashAttentionBackend.init_forward_metadata",),
    ("legacy", "capture"): ("FlashAttentionBackend.init_forward_metadata_capture_cuda_graph",
                            "FlashAttentionBackend.init_cuda_graph_state"),
    ("legacy", "replay"): ("FlashAttentionBackend.init_forward_metadata_replay_cuda_graph",
                           "normal_decode_set_metadata", "_fused_metadata_kernel_general",
                           "_fused_metadata_kernel_ps1_no_swa"),
}
#: the branch of a function that handles each mode (the first matching line after the def)
MODE_BRANCH = {"decode": r"is_decode_or_idle\(", "draft_decode": r"is_decode_or_idle\(", "idle": r"is_decode_or_idle\(",
               "verify": r"is_target_verify\(", "tree_verify": r"is_target_verify\(",
               "tree_draft_decode": r"is_decode_or_idle\(",
               "draft_extend": r"is_draft_extend\(|is_extend_or_draft_extend",
               "draft_extend_v2": r"is_draft_extend_v2\(|include_draft_extend_v2=True|is_draft_extend\(",
               "extend": r"is_extend",
               "extend_prefix": r"is_extend"}
#: the name a field is written under (metadata attribute, kernel pointer)
FIELD_NAMES = {"cache_seqlens_int32": "cache_seqlens", "page_table[live]": "page_table",
               "page_table[dead]": "page_table", "max_seq_len_q": "max_seq_len_q", "max_seq_len_k": "max_seq_len_k",
               "cu_seqlens_q": "cu_seqlens_q", "cu_seqlens_k": "cu_seqlens_k"}


@lru_cache(maxsize=64)
def _functions(path: str) -> dict[str, tuple[int, int]]:
    """``{qualified name: (first line, last line)}`` of a module's top-level functions and methods."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = (node.lineno, node.end_lineno)
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{m.name}"] = (m.lineno, m.end_lineno)
    return out


@lru_cache(maxsize=64)
def _lines(path: str) -> tuple[str, ...]:
    with open(path, encoding="utf-8") as f:
        return tuple(f.read().splitlines())


def _writes(name: str, expand: bool) -> re.Pattern:
    """A line that writes ``name`` (``name`` and a suffix such as ``_int32`` / ``_ptr``, not a
    ``..._stride_0`` local): an assignment, ``.copy_(`` / ``.fill_(``, ``+=`` / ``-=``, or a
    Triton ``tl.store(name ...``; ``expand``: only ``metadata_expand.name``, else never it."""
    obj = r"metadata_expand\." if expand else r"(?<!metadata_expand\.)"
    return re.compile(rf"{obj}\b{name}(?!\w*stride)\w*\b(\[[^\]]*\])?\s*(=(?!=)|\.copy_\(|\.fill_\(|\+=|-=)"
                      rf"|tl\.store\(\s*{name}(?!\w*stride)")


def _field_pattern(field: str | None) -> re.Pattern | None:
    part, _, f = (field or "").rpartition(":")
    name = FIELD_NAMES.get(f)
    return _writes(name, part == "expand") if name else None


def _is_write(path: str, line: int, text: str, pat: re.Pattern) -> bool:
    """Whether ``text`` (line ``line`` of ``path``) writes the field ``pat`` names: an in-place
    write (``.copy_(``, ``.fill_(``, ``tl.store(``), or an ``=`` / ``+=`` / ``-=`` of an
    assignment statement; a keyword argument (``page_table=metadata.page_table`` in a call) is not
    a write of it."""
    m = pat.search(text)
    if m is None:
        return False
    if "(" in m.group(0) and "=" not in m.group(0).replace("==", ""):
        return True
    code = statement(path, line)
    try:
        node = ast.parse(code).body[0] if code else None
    except SyntaxError:
        return True  # (a line the parser cannot place: the textual test alone)
    return isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))


def _binding(path: str, line: int) -> bool:
    """Whether the statement at ``line`` only binds a view (``x = self.buf["k"][:bs]``: a name,
    attribute or subscript chain, no call, no arithmetic) rather than writing values."""
    text = statement(path, line)
    try:
        node = ast.parse(text).body[0] if text else None
    except SyntaxError:
        return False
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return False
    v = node.value
    while isinstance(v, (ast.Subscript, ast.Attribute)):
        v = v.value
    return isinstance(v, ast.Name)


def ran(site: str, executed, field: str | None) -> tuple[str, int, int | None] | None:
    """``(file relative to site, line, via)``: among the ``executed`` lines (``((file, line, via),
    ...)`` in the order they last ran, :mod:`refspec.conformance.lines`; ``via``: the backend
    file's line that was running, for a line of a helper or kernel file) the last that writes
    ``field`` (the textual test of :func:`locate`), a line writing values preferred over one that
    only binds a buffer view (:func:`_binding`); None when no executed line writes it."""
    pat = _field_pattern(field)
    if pat is None or not executed:
        return None
    hits = []
    for rel, n, via in executed:
        path = os.path.join(site, rel)
        lines = _lines(path)
        if 0 < n <= len(lines) and _is_write(path, n, lines[n - 1], pat):
            hits.append((rel, n, via))
    values = [h for h in hits if not _binding(os.path.join(site, h[0]), h[1])]
    return (values or hits or [None])[-1]


def locate(site: str, files: tuple[str, ...], hooks: str, mode: str, phase: str, field: str | None
           ) -> tuple[str, int] | None:
    """``(file relative to site, line)``: where the code under ``site`` writes ``field`` for
    ``mode`` at ``phase`` (the first write after the mode's branch in the phase's functions, in the
    order they run), or the def line of the phase's first function; None if none is found.  Read
    statically: the fallback when no executed line writes the field (:func:`ran`)."""
    pat = _field_pattern(field)
    branch = re.compile(MODE_BRANCH.get(mode, r"$^"))
    fallback = None
    for func in PHASE_FUNCS.get((hooks, phase), ()):
        for rel in files:
            path = os.path.join(site, rel)
            if not os.path.exists(path):
                continue
            span = _functions(path).get(func)
            if span is None:
                continue
            fallback = fallback or (rel, span[0])
            if pat is None:
                return rel, span[0]
            lines = _lines(path)
            lo, hi = span[0] - 1, span[1]
            start = next((i for i in range(lo, hi) if branch.search(lines[i])), lo)
            for i in (*range(start, hi), *range(lo, start)):
                if _is_write(path, i + 1, lines[i], pat):
                    return rel, i + 1
    return fallback


def link(target, rel: str, line: int) -> str:
    """A permalink at the release tag for a release, else ``<absolute file>:<line>``."""
    if target is not None and getattr(target, "tag", None):
        return f"https://github.com/sgl-project/sglang/blob/{target.tag}/python/{rel}#L{line}"
    site = target.site if target is not None else ""
    return f"{os.path.join(site, rel)}:{line}"


#: the order a report lists the rules one result breaks: the field the others are derived from
#: first (docs/citing.md, "Which ID to quote": the rule that names the cause, then its
#: consequences).  K_b (``cache_seqlens``: the mode's formula), then q_b (``cu_seqlens_q``), then
#: what is computed from them (``cu_seqlens_k`` / ``max_seqlen_k`` from K_b, ``max_seqlen_q`` from
#: q_b, the live pages from K_b, the dead columns), then the rules this map names for no single
#: field (the tree rules, CG-002), by ID; last the kernel's page-table bound (PA-003 / CG-008: a
#: table too narrow for the K_b it is read with)
CAUSE_ORDER = (("MD-003", "MD-008", "MD-010", "MD-011"), ("MD-002", "MD-009", "CG-003", "CG-004"), ("MD-006",),
               ("CG-006", "PA-010"), ("PA-002",), ("MD-007",), None, ("PA-003", "CG-008"))


def cause_rank(rule: str) -> tuple[int, str]:
    """``rule``'s place in :data:`CAUSE_ORDER` (a rule of no group: the ``None`` slot), then its ID."""
    group = next((i for i, g in enumerate(CAUSE_ORDER) if g and rule in g), CAUSE_ORDER.index(None))
    return group, rule


def by_cause(rules_: set[str] | list[str]) -> list[str]:
    """Rule IDs, cause first (:data:`CAUSE_ORDER`)."""
    return sorted(set(rules_), key=cause_rank)
