"""CUDA graphs of the production top-k > 1 loop: capture per batch size, padded in-place replay (TR-018).

Buffers (SGLang ``init_cuda_graph_state``, the ``topk > 1`` entries), int32, per backend:

===========================  =====================================  ==================================
graph                        prefix (``*_topk_normal``)             expand (``*_topk_expand``)
===========================  =====================================  ==================================
tree verify                  K [max_bs]; cu_q = arange(0, bs*N+1,   K [max_bs*N]; cu_q = arange;
                             N) static; table [max_bs, W] pages     table [max_bs*N, N] token slots
draft decode step s          K [max_bs]; cu_q = arange(0, bs*k+1,   K [max_bs*k]; cu_q = arange;
                             k) static; table [max_bs, W] pages     table [max_bs*k, s+2] pages
===========================  =====================================  ==================================

W = ``ceil(req_to_token.shape[1] / P)`` (CG-008).  Replay copies the live batch into the static
batch buffers (padded requests: row 0, L = 1, slots 0 -- the reserved page, CG-005), builds the
rule's metadata for the padded batch with the eager functions of
:mod:`refspec.fa3.tree_metadata` and *writes it into* the captured buffers (CG-001), except
the draft expand table, which replay fills the way upstream's ``_apply_cuda_graph_metadata``
does: ``draft_decode_set_expand_metadata`` on ``cache_loc[:, :s+1]`` into the ``s + 2``-wide
buffer (unsliced, as at 0.5.12.post1 before sgl-project/sglang#27360's slice, its ``scatter_``
writes past the buffer: the #25077 family).  The draft
extend is the chain's graph: v1 DRAFT_EXTEND at ``Sd + 1`` rows per request, v2 DRAFT_EXTEND_V2
at N rows (:func:`capture_tree_graphs`).

What the captured functions return (:class:`~refspec.speculative.tree.runners.TreeRunners`):
the draft graph ends with ``organize_draft_results`` and the tree's length-free structure
(parents, child lists, ancestors, depth: :func:`~refspec.speculative.tree.device.tree_structure`),
the verify graph with the target argmax and greedy tree acceptance
(:func:`~refspec.speculative.tree.device.verify_tree_greedy_device`; its inputs are the node
tokens and the child lists), so neither the ``[B*N, V]`` logits nor a host loop sit between
them.  Replay keeps B*N rows of a per-node output and B of a per-request one.
"""

from __future__ import annotations

import bisect

import torch

from refspec.core.invariants import require
from refspec.core.modes import ForwardMode
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.metadata import FlashAttentionMetadata
from refspec.fa3.tree_backend import TreeDraftBatch, TreeVerifyBatch
from refspec.graphs.capture import make_graph
from refspec.graphs.runner import GraphRunner


def replay_draft_expand_table(page_table: torch.Tensor, cache_seqlens: torch.Tensor, draft_cache_loc, seq_lens,
                              step: int, topk: int, num_steps: int, page_size: int) -> None:
    """TR-018: the draft expand metadata at replay, in place (``_apply_cuda_graph_metadata``)."""
    cache_loc = tm.draft_cache_loc_rows(draft_cache_loc, num_steps)[:, :step + 1]
    if page_size == 1:
        page_table[:, :step + 1].copy_(cache_loc)
        cache_seqlens.fill_(step + 1)
        return
    tm.draft_decode_set_expand_metadata(cache_seqlens, page_table, tm.last_page_lens(seq_lens, page_size),
                                        step + 1, cache_loc, topk, page_size)


def _copy(dst: FlashAttentionMetadata, src: FlashAttentionMetadata) -> None:
    """Write ``src``'s values into ``dst``'s captured tensors (same rows), never rebinding (CG-001)."""
    require(src.page_table.shape[1] <= dst.page_table.shape[1], "CG-008",
            f"replay needs {src.page_table.shape[1]} page-table columns, the buffer has {dst.page_table.shape[1]}")
    dst.cache_seqlens_int32.copy_(src.cache_seqlens_int32)
    dst.cu_seqlens_k.copy_(src.cu_seqlens_k)
    dst.page_table[:, :src.page_table.shape[1]].copy_(src.page_table)


class TreeGraphRunner:
    """Graphs of one tree phase ("verify" or "draft") over captured batch sizes.

    Args: runners (a TreeRunners), phase, capture_bs, dtype (of the hidden input).
    """

    def __init__(self, runners, phase: str, capture_bs, dtype):
        self.r, self.phase = runners, phase
        capture_bs = list(capture_bs)
        if not capture_bs or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in capture_bs):
            raise ValueError(f"capture_bs must be a non-empty list of batch sizes >= 1, got {capture_bs}")
        self.capture_bs = sorted(set(capture_bs))
        kv, dev = runners.kv, runners.kv.device
        self.k, self.S, self.N, self.P = runners.topk, runners.Sd, runners.num_draft_tokens, kv.page_size
        max_bs = self.capture_bs[-1]
        W = -(-kv.req_to_token.shape[1] // self.P)
        self.per_req = self.N if phase == "verify" else self.k * self.S  # token rows per request
        z = lambda *shape, dt=torch.int32: torch.zeros(shape, dtype=dt, device=dev)
        self.buf = dict(req_pool_indices=z(max_bs, dt=torch.long), seq_lens=z(max_bs),
                        out_cache_loc=z(max_bs * self.per_req, dt=torch.long),
                        positions=z(max_bs * self.per_req, dt=torch.long))
        if phase == "verify":
            self.backends = [runners.tree_verify_be]
            self.inputs = {n: z(max_bs * self.N, dt=torch.long)  # node tokens, the tree's child lists (local ids)
                           for n in ("ids", "retrive_next_token", "retrive_next_sibling")}
            rows, xw = [max_bs * self.N], [self.N]
            self.fn = runners._tree_verify_fn
        else:
            self.backends = runners.tree_step_bes
            E = runners.target.config.hidden_size
            self.inputs = {"topk_p": z(max_bs, self.k, dt=torch.float32),
                           "topk_index": z(max_bs, self.k, dt=torch.long)}
            if runners.draft.uses_hidden:
                self.inputs["hidden"] = z(max_bs, E, dt=dtype)
            rows, xw = [max_bs * self.k] * len(self.backends), [s + 2 for s in range(len(self.backends))]
            self.fn = runners._tree_draft_fn
        self.state = [dict(prefix=(z(max_bs), z(max_bs + 1), z(max_bs, W)),
                           expand=(z(n), z(n + 1), z(n, w))) for n, w in zip(rows, xw)]
        self.graphs, self.static, self.bound = {}, {}, {}
        pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        for bs in reversed(self.capture_bs):
            self._capture(bs, pool)

    def can_run(self, fb) -> bool:
        return 0 < fb.batch_size <= self.capture_bs[-1]

    def _static_batch(self, bs):
        b, T = self.buf, bs * self.per_req
        common = dict(req_pool_indices=b["req_pool_indices"][:bs], seq_lens=b["seq_lens"][:bs],
                      seq_lens_cpu=torch.ones(bs, dtype=torch.long), out_cache_loc=b["out_cache_loc"][:T],
                      positions=b["positions"][:T], topk=self.k)
        if self.phase == "verify":
            return TreeVerifyBatch(forward_mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=self.N, **common)
        return TreeDraftBatch(forward_mode=ForwardMode.DECODE, num_steps=self.S,
                              draft_cache_loc=b["out_cache_loc"][:T], **common)

    def _bind(self, bs):
        """Metadata objects over the buffers' first rows, one (prefix, expand) pair per backend."""
        out = []
        q = self.N if self.phase == "verify" else self.k
        for st in self.state:
            (pk, pck, pt), (ek, eck, et) = st["prefix"], st["expand"]
            cu_p = torch.arange(0, bs * q + 1, q, dtype=torch.int32, device=pk.device)
            cu_e = torch.arange(0, bs * q + 1, dtype=torch.int32, device=pk.device)
            out.append((FlashAttentionMetadata(pk[:bs], cu_p, pck[:bs + 1], q, 0, pt[:bs]),
                        FlashAttentionMetadata(ek[:bs * q], cu_e, eck[:bs * q + 1], 1, 0, et[:bs * q])))
        return out

    def _pad_mask(self, live_mask, B, bs):
        """Padded requests (L = 1): every node sees the prefix slot, the root and itself (built on
        the device: no host copy at replay).  Under the overlap schedule the live mask is sized
        from host bounds (``build_tree_device``'s ``mask_numel``) and its unused tail is True, so
        the padded blocks, placed by the exact device L, may land in that tail: a padded node then
        sees all N slots of the dummy row 0 (slot 0, CG-005), never a live request's."""
        N, dev = self.N, self.r.kv.device
        eye = torch.eye(N, dtype=torch.bool, device=dev)
        eye[:, 0] = True
        pad = torch.cat([torch.ones((N, 1), dtype=torch.bool, device=dev), eye], dim=1).flatten().repeat(bs - B)
        return pad if live_mask is None else torch.cat([live_mask, pad])

    def _fill(self, fb, live, bs):
        B = 0 if live is None else live.batch_size
        T = B * self.per_req
        for name, buf in self.buf.items():
            per_token = name in ("out_cache_loc", "positions")
            n, end = (T, bs * self.per_req) if per_token else (B, bs)
            if n:
                phase_src = "draft_cache_loc" if (name == "out_cache_loc" and self.phase == "draft") else name
                buf[:n].copy_(getattr(live, phase_src))
            buf[n:end].fill_(1 if name == "seq_lens" else 0)  # padded: row 0, L = 1, slot 0 (CG-005)
        fb.seq_lens_cpu = torch.tensor(([] if live is None else live.seq_lens_cpu.tolist()) + [1] * (bs - B))
        if self.phase == "verify":
            fb.custom_mask = self._pad_mask(None if live is None else live.custom_mask, B, bs)

    def _write_metadata(self, fb, bs):
        R = self.r.kv.req_to_token
        for s, (be, (pre, exp)) in enumerate(zip(self.backends, self.bound[bs])):
            if self.phase == "verify":
                _copy(pre, tm.verify_prefix_metadata(fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices, R,
                                                     self.N, self.P))
                _copy(exp, tm.verify_expand_metadata(fb.custom_mask, fb.seq_lens, fb.req_pool_indices, R, self.N))
            else:
                _copy(pre, tm.draft_prefix_metadata(fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices, R,
                                                    self.k, self.P))
                replay_draft_expand_table(exp.page_table, exp.cache_seqlens_int32, fb.draft_cache_loc, fb.seq_lens,
                                          s, self.k, self.S, self.P)
                exp.cu_seqlens_k.copy_(tm.cumsum0(exp.cache_seqlens_int32))
            be.forward_metadata, be.forward_metadata_spec_decode_expand = pre, exp

    def _capture(self, bs, pool):
        fb = self._static_batch(bs)
        self._fill(fb, None, bs)
        self.bound[bs] = self._bind(bs)
        self._write_metadata(fb, bs)
        rows = bs * (self.N if self.phase == "verify" else 1)
        inputs = {n: t[:rows] for n, t in self.inputs.items()}
        graph = make_graph(fb.seq_lens.device, pool)
        fn = self.fn
        graph.capture(lambda: fn(fb, inputs))
        self.graphs[bs], self.static[bs] = graph, (fb, inputs)

    def replay(self, live, inputs: dict):
        """Pad ``live`` to the smallest captured size, rewrite metadata in place, replay, slice."""
        require(self.can_run(live), "CG-007", f"batch of {live.batch_size}; captured {self.capture_bs}")
        B = live.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, B)]
        fb, x = self.static[bs]
        self._fill(fb, live, bs)
        rows = B * (self.N if self.phase == "verify" else 1)
        for name, buf in x.items():
            if name in inputs:
                buf[:rows].copy_(inputs[name])
                buf[rows:].zero_()
            else:  # an input this caller does not use (a metadata-only capture): zeros
                buf.zero_()
        self._write_metadata(fb, bs)
        out = self.graphs[bs].replay()
        # verify: per-node outputs ([bs*N, ...]) keep B*N rows, per-request ones ([bs, ...]: the
        # accepted path and its length) keep B; draft: every output is per request (B rows)
        keep = [B if o.shape[0] == bs else rows for o in out]
        return tuple(o[:n].clone() for o, n in zip(out, keep))


def capture_tree_graphs(runners, capture_bs, dtype) -> None:
    """Capture the tree verify, the tree draft decode (S > 1) and the draft extend graphs.

    The draft extend is the chain's graph: v1 ``DRAFT_EXTEND`` at ``Sd + 1`` rows per request,
    v2 ``DRAFT_EXTEND_V2`` at N = ``num_draft_tokens`` rows (the whole verify window, TR-021;
    upstream captures it with ``num_tokens_per_req = speculative_num_draft_tokens``).
    """
    ids, E = ((), torch.long), runners.target.config.hidden_size
    hidden = {"hidden": ((E,), dtype)} if runners.draft.uses_hidden else {}
    runners.graph["tree_verify"] = TreeGraphRunner(runners, "verify", capture_bs, dtype)
    if runners.Sd > 1:
        runners.graph["tree_draft"] = TreeGraphRunner(runners, "draft", capture_bs, dtype)
    mode, W = ((ForwardMode.DRAFT_EXTEND, runners.Sd + 1) if runners.version == "v1"
               else (ForwardMode.DRAFT_EXTEND_V2, runners.num_draft_tokens))
    runners.graph["draft_extend"] = GraphRunner(
        mode, [runners.draft_be], runners._draft_extend_fn, kv=runners.kv,
        capture_bs=capture_bs, tokens_per_req=W, inputs={"ids": ids, **hidden}, num_draft_tokens=W)
