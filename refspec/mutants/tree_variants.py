"""Named wrong variants of the FA3 top-k > 1 path, as *replacement functions* for its seams.

Production code has no switch for them: a variant names the seam (``module:function``), gives
the replacement, and :func:`apply_variant` rebinds every ``refspec`` module global bound to the
seam (a module that did ``from x import f`` holds its own reference), then restores them.  Each
entry says where the wrong rule comes from, what it does, and which invariants catch it
(``tests/test_tree_variants.py`` proves that they do).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refspec.fa3 import tree_metadata as tm


@dataclass(frozen=True)
class TreeVariant:
    name: str
    target: str  #: "module:function", the seam replaced
    replacement: Callable
    source: str
    symptom: str
    caught_by: tuple[str, ...]


# ---- the replacements ----
def _mask_rows_with_siblings(custom_mask, seq_lens, num_draft_tokens):
    """Each node also sees its siblings (nodes with the same ancestors): a broken ancestor mask."""
    m = tm.verify_mask_rows.__wrapped_original__(custom_mask, seq_lens, num_draft_tokens)
    N = num_draft_tokens
    out = m.clone()
    for blk in range(m.shape[0] // N):
        rows = m[blk * N:(blk + 1) * N]
        for i in range(N):
            for j in range(N):
                a_i, a_j = rows[i].clone(), rows[j].clone()
                a_i[i], a_j[j] = False, False
                if i != j and torch.equal(a_i, a_j):
                    out[blk * N + i, j] = True
    return out


def _expand_with_prefix(custom_mask, seq_lens, req_pool_indices, req_to_token, num_draft_tokens):
    """The expand part lists the committed prefix as well: the prefix is attended twice."""
    md = tm.verify_expand_metadata.__wrapped_original__(custom_mask, seq_lens, req_pool_indices, req_to_token,
                                                        num_draft_tokens)
    N, rows = num_draft_tokens, []
    Ls = seq_lens.tolist()
    width = max(Ls) + N
    table = torch.zeros((md.page_table.shape[0], width), dtype=torch.int32, device=md.page_table.device)
    for t in range(md.page_table.shape[0]):
        b, K = t // N, int(md.cache_seqlens_int32[t])
        prefix = req_to_token[req_pool_indices[b], :Ls[b]]
        row = torch.cat([prefix, md.page_table[t, :K]])
        table[t, :row.numel()] = row
        rows.append(row.numel())
    md.page_table = table
    md.cache_seqlens_int32 = torch.tensor(rows, dtype=torch.int32, device=table.device)
    md.cu_seqlens_k = tm.cumsum0(md.cache_seqlens_int32)
    return md


def _merge_without_rescale(o1, lse1, o2, lse2):
    """Average the two partial outputs, ignoring their log-sum-exps."""
    return ((o1.float() + o2.float()) / 2).to(o1.dtype), torch.maximum(lse1, lse2)


def _no_tail_copy(kv, rows, seq_lens, topk, num_steps):
    """No duplication of the partial tail page into branches t >= 1 (the P > 1 divergence)."""
    z = torch.zeros(0, dtype=torch.long, device=kv.device)
    return z, z


def _replay_expand_unsliced(page_table, cache_seqlens, draft_cache_loc, seq_lens, step, topk, num_steps, page_size):
    """Replay feeds the whole ``cache_loc`` row (all S steps) to the scatter (#25077)."""
    cache_loc = tm.draft_cache_loc_rows(draft_cache_loc, num_steps)
    if page_size == 1:
        page_table[:, :step + 1].copy_(cache_loc[:, :step + 1])
        cache_seqlens.fill_(step + 1)
        return
    tm.draft_decode_set_expand_metadata(cache_seqlens, page_table, tm.last_page_lens(seq_lens, page_size),
                                        step + 1, cache_loc, topk, page_size)


TREE_VARIANTS: dict[str, TreeVariant] = {v.name: v for v in [
    TreeVariant("tree-mask-sibling-visible", "refspec.fa3.tree_metadata:verify_mask_rows", _mask_rows_with_siblings,
                "the rule the ancestor mask exists for (SGLang build_tree_efficient, FULL_MASK)",
                "a verify node attends its siblings' KV: its logits differ from the chain it stands for",
                ("TR-011", "TR-004", "TR-019")),
    TreeVariant("expand-reads-prefix-twice", "refspec.fa3.tree_metadata:verify_expand_metadata",
                _expand_with_prefix, "cascade split of SGLang FA3 forward_extend (prefix and expand are disjoint)",
                "every committed key is counted twice in the merged softmax", ("TR-011", "TR-012")),
    TreeVariant("lse-merge-no-rescale", "refspec.fa3.tree_attention:merge_state", _merge_without_rescale,
                "sgl_kernel merge_state_v2 (o = sum e^(lse - m) o / sum e^(lse - m))",
                "prefix and expand weighted 1:1 whatever their key counts and scores", ("TR-012",)),
    TreeVariant("branch-no-tail-copy", "refspec.speculative.tree_kv:tail_copy_slots", _no_tail_copy,
                "sgl-project/sglang#4908 (P > 1 for top-k = 1 only), #7725 (copy the real tail KV into every branch)",
                "P > 1: branches t >= 1 read an unwritten tail (stale or NaN KV), their drafts diverge",
                ("TR-015", "TR-019")),
    TreeVariant("draft-expand-unsliced-cache-loc", "refspec.speculative.tree_graphs:replay_draft_expand_table",
                _replay_expand_unsliced, "sgl-project/sglang#25077, #27360 (replay scatter_ not sliced to s + 1)",
                "the scatter writes past the s + 2 wide buffer (out of bounds on a GPU, an error on CPU)",
                ("TR-018",)),
]}


def _resolve(target: str):
    mod, fn = target.split(":")
    return importlib.import_module(mod), fn


@contextlib.contextmanager
def apply_variant(name: str):
    """Rebind every ``refspec.*`` module global that is the seam function to the replacement."""
    v = TREE_VARIANTS[name]
    mod, fn = _resolve(v.target)
    original = getattr(mod, fn)
    v.replacement.__wrapped_original__ = original  # a replacement may call the rule it bends
    patched = []
    for m in list(sys.modules.values()):
        if m is None or not getattr(m, "__name__", "").startswith("refspec"):
            continue
        for attr, val in list(vars(m).items()):
            if val is original:
                setattr(m, attr, v.replacement)
                patched.append((m, attr))
    try:
        yield v
    finally:
        for m, attr in patched:
            setattr(m, attr, original)
