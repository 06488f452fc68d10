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
MLA_PREFIX = "mla_"  #: an MLA mode (``mla_decode``, ...): the base mode through the MLA forward path


def rule_for(mode: str, phase: str, field: str | None, short_table: bool = False, out_of_pool: bool = False,
             stale: bool = False) -> str:
    """The rule ID governing ``field`` of ``mode`` at ``phase`` (``field`` None: an upstream error
    in that (mode, phase)).  ``short_table``: upstream's page table has fewer columns than the
    ceil(K_b / P) live pages: PA-003, or at capture / replay its graph-buffer form CG-008 (one
    defect, one level; the known upstream bug ``context-wall-page-table`` names the same ID), for
    ``page_table[live]`` and for the ``page_table[dead]`` width below the kernel bound alike (the
    same table, so the same rule on any code, whether or not a known bug names the row).
    ``out_of_pool``: a live page id upstream hands the kernel is not a page of the pool
    (``Diff.out_of_pool``): PA-011 (a kernel contract), before any rule of the values."""
    graph = phase in GRAPH_PHASES
    if mode.startswith(MLA_PREFIX):  # the MLA forward path: its own fields, the base mode's metadata rules
        from refspec.conformance.mla_forward import rule_for as mla_rule

        return mla_rule(mode, phase, field, base_rule=lambda m, p, f: rule_for(m, p, f, short_table, out_of_pool,
                                                                               stale), stale=stale)
    if (field or "").startswith("kernel:"):
        return kernel_rule(mode, phase, field[len("kernel:"):], short_table, out_of_pool, stale)
    if out_of_pool and base_field(field or "") == "page_table[live]":
        return "PA-011"
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


#: the rule of each compared kernel argument (``kernel:<arg>``) that no metadata field stands for
KERNEL_RULE = {"causal": "PA-004", "window_size": "PA-012", "softmax_scale": "PA-012", "softcap": "PA-012",
               "num_splits": "PA-012", "attention_chunk": "PA-012", "k_cache": "PA-011", "new_kv": "PA-009",
               "scheduler_metadata": "PA-013"}
#: the metadata field whose rule a kernel argument read from it takes
KERNEL_FIELD = {"cache_seqlens": "cache_seqlens_int32", "cu_seqlens_q": "cu_seqlens_q", "max_seqlen_q": "max_seq_len_q",
                "page_table[live]": "page_table[live]"}


def kernel_rule(mode: str, phase: str, arg: str, short_table: bool = False, out_of_pool: bool = False,
                stale: bool = False) -> str:
    """The rule of kernel argument ``arg`` (``kernel:<arg>``, :func:`refspec.conformance.compare.kernel_diffs`):
    an argument read from a metadata field takes that field's rule (:data:`KERNEL_FIELD`: the
    mode's K rule for ``cache_seqlens``, ...), the others :data:`KERNEL_RULE`; ``calls`` (a call
    missing, another kernel, or upstream raising in its forward) the mode's rule.  ``stale`` (a
    replay's kernel reads a captured buffer the replay hook did not rewrite, the metadata field
    itself being right: ``Diff.stale``): CG-001, the captured buffers rewritten in place."""
    if stale:
        return "CG-001"
    if arg in KERNEL_FIELD:
        return rule_for(mode, phase, KERNEL_FIELD[arg], short_table, out_of_pool)
    return KERNEL_RULE.get(arg) or rule_for(mode, phase, None)


#: an upstream exception at the page-table bound: indexing past a table's columns (dimension 1)
_BOUND = re.compile(r"^IndexError\b.*out of bounds for dimension 1\b")
_TABLES = re.compile(r"\b(req_to_token|page_table)\b")


def error_rule(mode: str, phase: str, error: str, statement: str = "", field: str | None = None) -> tuple[str, str]:
    """``(rule ID, note)`` for an upstream exception of ``mode`` at ``phase``; ``statement`` is
    the upstream source statement it was raised in (:func:`statement`), ``field`` the compared
    field that statement computes, where known (:func:`computed_field`).

    An ``IndexError`` out of bounds for dimension 1 in a statement that indexes ``req_to_token``
    or ``page_table`` reads a table past its width: the page-table bound, CG-008 in every phase
    (upstream's static bound ``max_context_len`` sizes the tables and strided indices of eager and
    graph paths alike; PA-003 is the same defect).  Any other exception takes the rule of
    ``field`` (e.g. PA-010 for a crash in the branch that computes ``max_seq_len_q``), else the
    mode's rule (:func:`rule_for` with no field); the note says it is an upstream exception and
    which of the two it is."""
    if _BOUND.search(error) and _TABLES.search(statement):
        return "CG-008", "upstream exception past a table's width (req_to_token / page_table: the page-table bound)"
    if mode.startswith(MLA_PREFIX) and field is None:
        from refspec.conformance.mla_forward import rule_for as mla_rule

        return mla_rule(mode, phase, None, error), "upstream exception on the MLA forward path (no field was compared)"
    if field is not None:
        return rule_for(mode, phase, field), f"upstream exception in the statement that computes {field}"
    return rule_for(mode, phase, None), "upstream exception (the mode's rule: no field was compared)"


#: a metadata attribute upstream writes -> the compared field (:func:`computed_field`)
ATTR_FIELD = {"cache_seqlens_int32": "cache_seqlens_int32", "page_table": "page_table[live]",
              "max_seq_len_q": "max_seq_len_q", "max_seq_len_k": "max_seq_len_k", "cu_seqlens_q": "cu_seqlens_q",
              "cu_seqlens_k": "cu_seqlens_k"}


def _written(nodes, tree_mode: bool) -> list[str]:
    """The compared fields that assignments among ``nodes`` (and below them) write, in source order."""
    out = []
    for n in nodes:
        for a in ast.walk(n):
            if isinstance(a, ast.Assign):
                targets = a.targets
            elif isinstance(a, (ast.AugAssign, ast.AnnAssign)):
                targets = [a.target]
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in ATTR_FIELD:
                    owner = ast.unparse(t.value)
                    part = ("expand:" if "expand" in owner else "prefix:") if tree_mode else ""
                    out.append(part + ATTR_FIELD[t.attr])
    return out


def computed_field(path: str, line: int, mode: str = "") -> str | None:
    """The compared metadata field the upstream statement at ``path:line`` computes, or None.

    The innermost statement holding ``line``: an assignment to a metadata attribute
    (``metadata.max_seq_len_q = max(...)``) computes that field; a line in the test of an ``if``
    (or loop) computes what its body assigns (``if any(forward_batch.extend_prefix_lens_cpu):``
    guarding ``metadata.max_seq_len_q = ...``: ``max_seq_len_q``), the first in source order.
    Tree modes (``mode`` ``tree_*``) get the table's part (``expand:`` / ``prefix:``).  None for
    any other statement, or where the file cannot be read."""
    try:
        tree, _ = _tree(path)
    except (OSError, SyntaxError):
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno <= line <= node.end_lineno and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if best is None or (node.lineno, -node.end_lineno) > (best.lineno, -best.end_lineno):
                best = node
    if best is None:
        return None
    tree_mode = mode.removeprefix(MLA_PREFIX).startswith("tree_")
    test = getattr(best, "test", None) if isinstance(best, (ast.If, ast.While)) else \
        getattr(best, "iter", None) if isinstance(best, ast.For) else None
    if test is not None and test.lineno <= line <= test.end_lineno:
        fields = _written(best.body, tree_mode)
    elif hasattr(best, "body"):
        return None
    else:
        fields = _written([best], tree_mode)
    return fields[0] if fields else None


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


#: the in-place tensor methods that write their receiver (``x[...].scatter_(...)`` writes x)
INPLACE = ("copy_", "fill_", "scatter_", "scatter_add_", "index_copy_", "index_fill_", "index_put_", "masked_fill_",
           "masked_scatter_", "zero_")
#: one index ``[...]``, brackets nested one deep (``[: cache_loc.shape[0]]``)
_IDX = r"(?:\[(?:[^\[\]]|\[[^\[\]]*\])*\])"


class _Writes:
    """Where a line writes ``name`` (``name`` and a suffix such as ``_int32`` / ``_ptr``, not a
    ``..._stride_0`` local): an assignment (``=``, ``+=``, ``-=``), an in-place method of it
    (:data:`INPLACE`, after any index: ``x[: a.shape[0]].copy_(``), or a Triton ``tl.store(name``.
    Each match carries its *owner*, the attribute or name right before ``.name`` (None for a bare
    name: a local, or a helper's parameter); an owner whose name holds ``expand``
    (``metadata_expand``, ``self.forward_metadata_spec_decode_expand``,
    ``self.draft_decode_metadata_topk_expand[bs]``) writes the top-k > 1 expand part, any other
    owner the prefix / flat metadata.  A bare name is resolved by :func:`_bare_expand`."""

    def __init__(self, name: str, expand: bool):
        self.name, self.expand = name, expand
        self.rx = re.compile(rf"(?:\b(?P<owner>\w+){_IDX}?\.|(?<![\w.])){name}(?!\w*stride)\w*\b{_IDX}*"
                             rf"\s*(?P<op>=(?!=)|\.(?:{'|'.join(INPLACE)})\(|\+=|-=)"
                             rf"|(?P<store>tl\.store\(\s*{name}(?!\w*stride))")

    def matches(self, text: str):
        """``(match, owner)`` of each candidate write in ``text`` (``owner`` '' for a bare name)."""
        for m in self.rx.finditer(text):
            if m.group("store"):
                yield m, None if self.expand else "kernel"
            else:
                yield m, m.group("owner") or ""

    # (the old single-pattern interface: the first candidate whose owner fits, bare names as prefix writes)
    def search(self, text: str):
        for m, owner in self.matches(text):
            if owner is None:
                continue
            if owner == "" or ("expand" in owner) == self.expand:
                if owner == "" and self.expand:
                    continue
                return m
        return None


def _writes(name: str, expand: bool) -> _Writes:
    """The writes of ``name`` (:class:`_Writes`); ``expand``: only those of the expand part."""
    return _Writes(name, expand)


def _field_pattern(field: str | None) -> _Writes | None:
    part, _, f = (field or "").rpartition(":")
    if part == "kernel":  # a kernel argument read from a metadata field (``kernel:[part.]arg``): where that is written
        part, _, arg = f.rpartition(".")
        f = KERNEL_FIELD.get(arg, arg)
    name = FIELD_NAMES.get(f)
    return _writes(name, part == "expand") if name else None


def _is_write(path: str, line: int, text: str, pat: _Writes, site: str | None = None,
              via: int | None = None) -> bool:
    """Whether ``text`` (line ``line`` of ``path``) writes the field ``pat`` names: an in-place
    write (:data:`INPLACE`, ``tl.store(``), or an ``=`` / ``+=`` / ``-=`` of an assignment
    statement; a keyword argument (``page_table=metadata.page_table`` in a call) is not a write of
    it.  The owner must be of the field's part (``expand`` or not); a bare name that is a
    parameter of a module-level helper is the argument its call passes (``site`` / ``via``: the
    backend file's calling line, :func:`_bare_expand`), a bare name that is not one writes the
    prefix / flat field (a local the backend copies from)."""
    for m, owner in pat.matches(text):
        if owner is None:
            continue
        if owner == "":
            side = _bare_expand(path, line, pat.name, site, via)
            if side is None:
                side = False  # a local: counted as the prefix / flat field's, never the expand part's
            if side != pat.expand:
                continue
        elif owner != "kernel" and ("expand" in owner) != pat.expand:
            continue
        if m.group("store") or "(" in m.group("op"):
            return True
        code = statement(path, line)
        try:
            node = ast.parse(code).body[0] if code else None
        except SyntaxError:
            return True  # (a line the parser cannot place: the textual test alone)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(re.search(rf"(?<![\w]){pat.name}", ast.get_source_segment(code, t) or "") for t in targets):
                return True  # (``o = f(page_table=...)`` is an assignment of o, not of page_table)
    return False


def _helper(path: str, line: int) -> ast.FunctionDef | None:
    """The module-level function (not a method) of ``path`` holding ``line``, or None."""
    try:
        tree, _ = _tree(path)
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= node.end_lineno:
            return node
    return None


def _owner_expand(expr: ast.AST) -> bool | None:
    """Whether ``expr`` (an argument: ``metadata_expand.page_table``, ``x.page_table[:n]``) is a
    field of an expand owner; None when it is not an attribute."""
    while isinstance(expr, ast.Subscript):
        expr = expr.value
    if not isinstance(expr, ast.Attribute):
        return None
    owner = expr.value
    while isinstance(owner, ast.Subscript):
        owner = owner.value
    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
    return "expand" in name


def _call(site: str, fn: ast.FunctionDef, via: int) -> ast.Call | None:
    """The call of helper ``fn`` in the backend file holding its line ``via`` (innermost), or None."""
    try:
        tree, _ = _tree(os.path.join(site, FA))
    except (OSError, SyntaxError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno <= via <= n.end_lineno and
             (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) == fn.name]
    return max(calls, key=lambda n: n.lineno) if calls else None


def _call_line(site: str, path: str, line: int, via: int | None) -> int | None:
    """``via`` (the backend's running line) moved to the first line of the helper's call statement
    it lies in (a multi-line call records the line of an argument); ``via`` itself otherwise."""
    fn = _helper(path, line) if via is not None else None
    call = _call(site, fn, via) if fn is not None else None
    return call.lineno if call is not None else via


def _bare_expand(path: str, line: int, name: str, site: str | None, via: int | None) -> bool | None:
    """For a bare ``name...`` written at ``line`` of ``path``: when it is a parameter of the
    module-level helper holding the line and ``via`` (the backend's line that was running the
    call) holds that helper's call in the backend file, whether the argument passed is an expand
    field (``page_table=metadata_expand.page_table``), or a local the calling function then
    stores in one (``page_table=expand_page_table`` ... ``self.forward_metadata_spec_decode_expand
    .page_table = expand_page_table``).  None when it cannot be resolved."""
    fn = _helper(path, line)
    if fn is None or via is None or site is None:
        return None
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    param = next((p for p in params + [a.arg for a in fn.args.kwonlyargs] if re.fullmatch(rf"{name}\w*", p)), None)
    if param is None:
        return None
    call = _call(site, fn, via)
    if call is None:
        return None
    tree, _ = _tree(os.path.join(site, FA))
    arg = next((k.value for k in call.keywords if k.arg == param), None)
    if arg is None and param in params and params.index(param) < len(call.args):
        arg = call.args[params.index(param)]
    if arg is None:
        return None
    side = _owner_expand(arg)
    if side is not None or not isinstance(arg, ast.Name):
        return side
    caller = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and
                   n.lineno <= call.lineno <= n.end_lineno and
                   not any(isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)) and c is not n and
                           c.lineno <= call.lineno <= c.end_lineno for c in ast.walk(n))), None)
    for n in ast.walk(caller) if caller is not None else ():
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == arg.id:
            for t in n.targets:
                if isinstance(t, ast.Attribute) and re.fullmatch(rf"{name}\w*", t.attr):
                    return _owner_expand(t)
    return None


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
        if 0 < n <= len(lines) and _is_write(path, n, lines[n - 1], pat, site, via):
            hits.append((rel, n, _call_line(site, path, n, via)))
    values = [h for h in hits if not _binding(os.path.join(site, h[0]), h[1])]
    return (values or hits or [None])[-1]


def _outside(path: str, span: tuple[int, int], mode: str) -> set[int]:
    """The lines of the function ``span`` of ``path`` inside another mode's branch: the body of an
    ``if`` whose test is another mode's (:data:`MODE_BRANCH`) and the ``else`` of ``mode``'s own
    ``if`` (the other modes' chain), but never a line of ``mode``'s own branch; for a tree mode
    also the ``if self.topk <= 1`` body (the chain draft path), for a flat mode its ``else``."""
    try:
        tree, text = _tree(path)
    except (OSError, SyntaxError):
        return set()
    ours = re.compile(MODE_BRANCH.get(mode, r"$^"))
    others = re.compile("|".join(f"(?:{v})" for v in set(MODE_BRANCH.values())))
    chain = re.compile(r"\btopk\s*<=\s*1\b")

    def lines_of(stmts):
        return {n for st in stmts for n in range(st.lineno, st.end_lineno + 1)}

    mine, other, path_other = set(), set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not span[0] <= node.lineno <= span[1]:
            continue
        test = ast.get_source_segment(text, node.test) or ""
        if ours.search(test):
            mine |= lines_of(node.body)
            other |= lines_of(node.orelse)
        elif others.search(test):
            other |= lines_of(node.body)
        elif chain.search(test):
            path_other |= lines_of(node.body if mode.startswith("tree_") else node.orelse)
    return (other - mine) | path_other


def _blocks(path: str, line: int) -> list[tuple[int, int]]:
    """The statement blocks (an ``if`` / ``else`` body, a loop or ``with`` body) holding ``line``,
    innermost first, as (first line, last line)."""
    try:
        tree, _ = _tree(path)
    except (OSError, SyntaxError):
        return []
    out = []
    for node in ast.walk(tree):
        for attr in ("body", "orelse", "finalbody"):
            block = getattr(node, attr, None)
            if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)) and isinstance(block, list) and \
                    block and block[0].lineno <= line <= block[-1].end_lineno:
                out.append((block[0].lineno, block[-1].end_lineno))
    return sorted(out, key=lambda b: b[1] - b[0])


def taken(path: str, rel: str, line: int, executed) -> bool:
    """Whether the branch holding ``line`` of ``path`` is proven taken by the trace ``executed``
    (``((file, line, via), ...)``): some executed line of the same file lies in the innermost
    block that holds ``line``; a line in no block, in a function the trace entered at all."""
    ran = {n for f, n, _ in executed if f == rel}
    blocks = _blocks(path, line)
    if blocks:
        lo, hi = blocks[0]
        return any(lo <= n <= hi for n in ran)
    return bool(ran)


def locate(site: str, files: tuple[str, ...], hooks: str, mode: str, phase: str, field: str | None,
           executed=None) -> tuple[str, int] | None:
    """``(file relative to site, line)``: where the code under ``site`` writes ``field`` for
    ``mode`` at ``phase`` (the first write after the mode's branch in the phase's functions, in the
    order they run, never a line in another mode's branch: :func:`_outside`), or the def line of
    the phase's first function when they write it nowhere; None if none of the functions is found,
    or when the only writes are in other modes' branches (no line rather than a wrong one).  Read
    statically: the fallback when no executed line writes the field (:func:`ran`).  With a trace
    (``executed``: the lines that ran while the result was built), a write is cited only where its
    branch is proven taken (:func:`taken`): a branch that did not run for the mode is never cited."""
    mode = mode.removeprefix(MLA_PREFIX)  # an MLA mode's metadata is its base mode's (ML-004)
    pat = _field_pattern(field)
    branch = re.compile(MODE_BRANCH.get(mode, r"$^"))
    fallback, elsewhere = None, False
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
            skip = _outside(path, span, mode)
            for i in (*range(start, hi), *range(lo, start)):
                if _is_write(path, i + 1, lines[i], pat):
                    if i + 1 in skip or (executed and not taken(path, rel, i + 1, executed)):
                        elsewhere = True
                        continue
                    return rel, i + 1
    return None if elsewhere else fallback


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
               ("CG-006", "PA-010"), ("PA-011", "PA-002"), ("MD-007",), None, ("PA-003", "CG-008"))


def cause_rank(rule: str) -> tuple[int, str]:
    """``rule``'s place in :data:`CAUSE_ORDER` (a rule of no group: the ``None`` slot), then its ID."""
    group = next((i for i, g in enumerate(CAUSE_ORDER) if g and rule in g), CAUSE_ORDER.index(None))
    return group, rule


def by_cause(rules_: set[str] | list[str]) -> list[str]:
    """Rule IDs, cause first (:data:`CAUSE_ORDER`)."""
    return sorted(set(rules_), key=cause_rank)
