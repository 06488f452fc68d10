"""Named wrong variants of the FA3 top-k > 1 path, as *replacement functions* for its seams.

The same shape as :mod:`refspec.mutants.variants` (its :class:`~refspec.mutants.variant.Variant`
and :func:`~refspec.mutants.replace.replaced`, which rebinds every production binding of the seam
by identity): production code has no switch for them.  Each entry says what it changes, where the
wrong rule comes from, what it does, and which invariants catch it; ``tests/test_tree_variants.py``
proves that they do.  The replacements call the rules they bend through the names bound here at
import (:mod:`refspec.mutants` is never rebound).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from refspec.fa3 import tree_attention as ta
from refspec.fa3 import tree_metadata as tm
from refspec.mutants.replace import replaced
from refspec.mutants.variant import Variant
from refspec.speculative.tree import graphs as tg
from refspec.speculative.tree import kv as tkv

SG = "https://github.com/sgl-project/sglang/pull/"
_verify_mask_rows = tm.verify_mask_rows  #: the originals, for the replacements that bend them
_verify_expand_metadata = tm.verify_expand_metadata
_verify_expand_page_table = tm.verify_expand_page_table
_write_verify_expand = tg.write_verify_expand


# ---- the replacements ----
def _siblings_visible(rows: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """Mask rows ``[B*N, N]`` where each node also sees its siblings (nodes with the same
    ancestors): a broken ancestor mask.  Tensor ops only (it also runs inside a captured graph)."""
    N = num_draft_tokens
    m = rows.view(-1, N, N)
    eye = torch.eye(N, dtype=torch.bool, device=rows.device)
    strict = m & ~eye  # the ancestors alone
    same = (strict[:, :, None, :] == strict[:, None, :, :]).all(-1)  # [blk, i, j]: the same ancestors
    return (m | same).reshape(rows.shape)


def _mask_rows_with_siblings(custom_mask, seq_lens, num_draft_tokens):
    """Each node also sees its siblings, in the mask rows the eager verify extracts."""
    return _siblings_visible(_verify_mask_rows(custom_mask, seq_lens, num_draft_tokens), num_draft_tokens)


def _graph_expand_with_siblings(exp, mask, fb, req_to_token, num_draft_tokens):
    """The verify graph builds its expand metadata from mask rows that also allow siblings."""
    _write_verify_expand(exp, _siblings_visible(mask, num_draft_tokens), fb, req_to_token, num_draft_tokens)


def _expand_seqlens_all_nodes(mask):
    """Every node row reads all N tree slots: the mask's count ignored."""
    return torch.full((mask.shape[0],), mask.shape[1], dtype=torch.int32, device=mask.device)


def _expand_table_from_row_start(mask, req_to_token, req_pool_indices, seq_lens, num_draft_tokens):
    """The tree columns gathered from the row's start (positions 0 .. N-1), not from L."""
    return _verify_expand_page_table(mask, req_to_token, req_pool_indices, torch.zeros_like(seq_lens),
                                     num_draft_tokens)


def _expand_with_prefix(custom_mask, seq_lens, req_pool_indices, req_to_token, num_draft_tokens):
    """The expand part lists the committed prefix as well: the prefix is attended twice."""
    md = _verify_expand_metadata(custom_mask, seq_lens, req_pool_indices, req_to_token, num_draft_tokens)
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


TREE_VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("tree-mask-sibling-visible", tm.verify_mask_rows, _mask_rows_with_siblings,
            "eager verify: the mask rows extracted from custom_mask also allow a node's siblings (same "
            "ancestors); the graphed verify never extracts them (graph-mask-sibling-visible is its twin)",
            "the ancestor-mask rule of build_tree_efficient (FULL_MASK); docs/spec/tree.md TR-004",
            "a verify node attends its siblings' KV: its logits differ from the chain it stands for",
            ("TR-011", "TR-004", "TR-019")),
    Variant("expand-reads-prefix-twice", tm.verify_expand_metadata, _expand_with_prefix,
            "eager verify: the expand table lists the committed prefix before the node's tree slots; "
            "the graphed verify builds its table in the graph (expand-table-from-row-start is its twin)",
            "the cascade split of FA3 forward_extend (prefix and expand are disjoint); docs/spec/tree.md TR-011",
            "every committed key is counted twice in the merged softmax", ("TR-011", "TR-012")),
    Variant("lse-merge-no-rescale", ta.merge_state, _merge_without_rescale,
            "the prefix and expand outputs are averaged, their LSEs ignored",
            "sgl_kernel merge_state_v2 (o = sum e^(lse - m) o / sum e^(lse - m)); docs/spec/tree.md TR-012",
            "prefix and expand weighted 1:1 whatever their key counts and scores", ("TR-012",)),
    Variant("branch-no-tail-copy", tkv.tail_copy_slots, _no_tail_copy,
            "the last partial page's lp tokens are not copied into branches t >= 1",
            f"{SG}4908 (P > 1 for top-k = 1 only), {SG}7725 (copy the real tail KV into every branch)",
            "P > 1: branches t >= 1 read an unwritten tail (stale or NaN KV), their drafts diverge",
            ("TR-015", "TR-019")),
    Variant("draft-expand-unsliced-cache-loc", tg.replay_draft_expand_table, _replay_expand_unsliced,
            "draft expand replay feeds all S steps of cache_loc to the unique-pages scatter",
            f"{SG}25077, {SG}27360 (replay scatter_ not sliced to s + 1)",
            "the scatter writes past the s + 2 wide buffer (out of bounds on a GPU, an error on CPU)",
            ("TR-018",)),
    # the graphed tree verify: its expand metadata is the verify graph's own first work
    # (speculative.tree.graphs.write_verify_expand), from the builder's mask rows
    Variant("graph-mask-sibling-visible", tg.write_verify_expand, _graph_expand_with_siblings,
            "graphed verify: the in-graph expand metadata is built from mask rows that also allow a node's "
            "siblings (the graphed twin of tree-mask-sibling-visible)",
            "the ancestor-mask rule of build_tree_efficient (FULL_MASK); docs/spec/tree.md TR-004, TR-011",
            "under CUDA-graph replay a verify node attends its siblings' KV: its logits differ from the "
            "chain it stands for, and the graphed loop's tokens leave greedy",
            ("TR-011", "TR-012", "TR-019")),
    Variant("expand-seqlens-all-nodes", tm.verify_expand_seqlens, _expand_seqlens_all_nodes,
            "verify expand cache_seqlens = N for every node row (the mask row's count, depth + 1, ignored); "
            "in the verify graph and eager",
            "docs/spec/tree.md TR-011 (K of a node row = its ancestors + itself)",
            "each node reads every tree slot of its request (siblings, other branches, descendants), not "
            "only its ancestors and itself",
            ("TR-011", "TR-012")),
    Variant("expand-table-from-row-start", tm.verify_expand_page_table, _expand_table_from_row_start,
            "verify expand page table gathers req_to_token[r, 0 .. N-1] instead of [r, L .. L+N-1] (the + L "
            "dropped); in the verify graph and eager (the graphed twin of expand-reads-prefix-twice)",
            "the cascade split of FA3 forward_extend (prefix and expand are disjoint); docs/spec/tree.md TR-011",
            "the expand part reads committed prefix keys (counted twice in the merged softmax) instead of "
            "the tree's own",
            ("TR-011", "TR-012")),
]}


@contextmanager
def apply_variant(name: str):
    """Inside the block the seam of tree variant ``name`` is its replacement (every call site)."""
    v = TREE_VARIANTS[name]
    with replaced(v.target, v.replacement, v.within):
        yield v
