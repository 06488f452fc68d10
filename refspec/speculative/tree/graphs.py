"""CUDA graphs of the production top-k > 1 loop: capture per batch size, padded in-place replay (TR-018).

Buffers (SGLang ``init_cuda_graph_state``, the ``topk > 1`` entries), int32; the prefix set is
shared by a graph's backends (its values do not depend on the draft step, TR-013), the expand
sets are per backend:

===========================  =====================================  ==================================
graph                        prefix (``*_topk_normal``)             expand (``*_topk_expand``)
===========================  =====================================  ==================================
tree verify                  K [max_bs]; cu_q = arange(0, bs*N+1,   K [max_bs*N]; cu_q = arange;
                             N) static; table [max_bs, M] pages     table [max_bs*N, N] token slots
draft decode step s          K [max_bs]; cu_q = arange(0, bs*k+1,   K [max_bs*k]; cu_q = arange;
                             k) static; table [max_bs, M] pages     table [max_bs*k, s+2] pages
===========================  =====================================  ==================================

M = ``ceil(req_to_token.shape[1] / P)`` columns (CG-008).  Replay copies the live batch into the static
batch buffers (padded requests: row 0, L = 1, slots 0 -- the reserved page, CG-005) with ONE
``torch._foreach_copy_`` per dtype (the batch fields, the inputs, the verify tree mask rows; the
padded rows from constant fill tensors, as :class:`~refspec.graphs.runner.GraphRunner` does),
then writes the one part of the metadata that needs a host value *into* the captured buffers
(CG-001): the prefix's strided page table over the host bound
(:func:`~refspec.fa3.graph_metadata.replay_page_table`, MD-007).  The rest reads only static
buffers, so it is the captured graph's own first work, in place and with the eager rule
functions: the prefix lengths (:func:`write_prefix_lengths`: ``K`` = L, or L - lp for the draft,
and ``cu_seqlens_k``; with the page table the values of
:func:`~refspec.fa3.tree_metadata.verify_prefix_metadata` / ``draft_prefix_metadata``) and the
expand metadata (:func:`write_verify_expand`: the tree mask rows,
which the live batch brings from the tree builder, ``TreeVerifyBatch.tree_mask``;
:func:`write_draft_expand`: upstream's ``_apply_cuda_graph_metadata`` way,
``draft_decode_set_expand_metadata`` on ``cache_loc[:, :s+1]`` into the ``s + 2``-wide buffer
(unsliced, as at 0.5.12.post1 before sgl-project/sglang#27360's slice, its ``scatter_`` writes
past the buffer: the #25077 family)).  Upstream writes both parts before the replay, one op per
field; here a replay dispatches one gather and one ``// P`` for all of it (tests/test_launch_audit.py).
The draft extend is the chain's graph: v1 DRAFT_EXTEND at ``Sd + 1`` rows per request, v2
DRAFT_EXTEND_V2 at N rows (:func:`capture_tree_graphs`).

What the captured functions compute (:class:`~refspec.speculative.tree.runners.TreeRunners`):
the draft graph starts with the tail copies into branches t >= 1 (TR-015, from the static rows
and L, in the draft pool) and ends with ``organize_draft_results`` and the tree's length-free
structure (parents, child lists, ancestors, depth:
:func:`~refspec.speculative.tree.device.tree_structure`), the verify graph ends with the target
argmax and greedy tree acceptance
(:func:`~refspec.speculative.tree.device.verify_tree_greedy_device`; its inputs are the node
tokens and the child lists) and, under v2, the accepted path's KV move and the compaction of
``predict`` / ``hidden`` to the front (TR-020 / TR-021), so neither the ``[B*N, V]`` logits nor
a host loop sit between them.  Replay keeps B*N rows of a per-node output and B of a
per-request one, as views of the graph's buffers (no copy-out, upstream's
``CudaGraphRunner.replay`` way): valid until the graph's next replay, and the round launches
every reader of them before that (:meth:`TreeGraphRunner.replay`).
"""

from __future__ import annotations

import bisect

import torch

from refspec.core.invariants import require
from refspec.core.modes import ForwardMode
from refspec.fa3 import kernel
from refspec.fa3 import tree_metadata as tm
from refspec.fa3.metadata import FlashAttentionMetadata
from refspec.fa3.tree_backend import TreeDraftBatch, TreeVerifyBatch
from refspec.graphs.capture import make_graph
from refspec.fa3.graph_metadata import check_table_width, replay_page_table
from refspec.graphs.runner import GraphRunner, copy_rows, fill_source, padded_cpu
from refspec.model.drafts import target_hidden_size


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


def write_draft_expand(expand: list, fb, topk: int, num_steps: int, page_size: int) -> None:
    """TR-014 / TR-018, inside the draft graph: every step's expand metadata, in place, from the
    static batch alone (``draft_cache_loc`` and ``seq_lens``, the buffers replay fills):
    :func:`replay_draft_expand_table` (``cache_loc[:, :s+1]``) and ``cu_seqlens_k[1:] <- cumsum K``.
    ``expand`` holds step s's bound expand metadata at index s.  Static shapes, no host value:
    captured once, it runs at every replay with no host op.  In-graph twin of the eager
    :func:`~refspec.fa3.tree_metadata.draft_expand_metadata` (same values on the columns a row reads)."""
    for s, exp in enumerate(expand):
        replay_draft_expand_table(exp.page_table, exp.cache_seqlens_int32, fb.draft_cache_loc, fb.seq_lens,
                                  s, topk, num_steps, page_size)
        torch.cumsum(exp.cache_seqlens_int32, 0, dtype=torch.int32, out=exp.cu_seqlens_k[1:])


def write_verify_expand(exp: FlashAttentionMetadata, mask: torch.Tensor, fb, req_to_token: torch.Tensor,
                        num_draft_tokens: int) -> None:
    """TR-011 / TR-018, inside the verify graph: the expand metadata, in place, from static
    buffers alone (the tree mask rows ``mask`` bool ``[bs*N, N]``, ``req_pool_indices``,
    ``seq_lens``, ``req_to_token``): ``cache_seqlens <-`` :func:`~refspec.fa3.tree_metadata.verify_expand_seqlens`,
    ``page_table <-`` :func:`~refspec.fa3.tree_metadata.verify_expand_page_table` (the eager rule
    functions), ``cu_seqlens_k[1:] <- cumsum K``.  Static shapes, no host value.  In-graph twin
    of the eager :func:`~refspec.fa3.tree_metadata.verify_expand_metadata` (same values on every
    real row; the mask rows are the builder's, not :func:`~refspec.fa3.tree_metadata.verify_mask_rows`)."""
    exp.cache_seqlens_int32.copy_(tm.verify_expand_seqlens(mask))
    exp.page_table.copy_(tm.verify_expand_page_table(mask, req_to_token, fb.req_pool_indices, fb.seq_lens,
                                                     num_draft_tokens))
    torch.cumsum(exp.cache_seqlens_int32, 0, dtype=torch.int32, out=exp.cu_seqlens_k[1:])


def write_prefix_lengths(pre: FlashAttentionMetadata, K: torch.Tensor) -> None:
    """TR-010 / TR-013, inside both tree graphs: the prefix lengths, in place, from the static
    ``seq_lens`` alone: ``cache_seqlens <- K`` (verify L, draft L - lp:
    :func:`~refspec.fa3.tree_metadata.draft_prefix_seqlens`), ``cu_seqlens_k[1:] <- cumsum K``.
    The prefix page table needs the host bound, so replay writes it (:meth:`TreeGraphRunner._write_metadata`)."""
    pre.cache_seqlens_int32.copy_(K)
    torch.cumsum(K, 0, dtype=torch.int32, out=pre.cu_seqlens_k[1:])


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
            # the tree mask rows (TR-011) the expand metadata is built from inside the graph;
            # padded rows: a node sees the root and itself (row 0, L = 1: only slot 0 behind them)
            self.mask_rows = torch.zeros((max_bs * self.N, self.N), dtype=torch.bool, device=dev)
            pad = torch.eye(self.N, dtype=torch.bool, device=dev)
            pad[:, 0] = True
            self.mask_pad = pad.repeat(max_bs, 1)  # the padded rows' source (never written)
        else:
            self.backends = runners.tree_step_bes
            E = runners.target.config.hidden_size
            self.inputs = {"topk_p": z(max_bs, self.k, dt=torch.float32),
                           "topk_index": z(max_bs, self.k, dt=torch.long)}
            if runners.draft.uses_hidden:
                self.inputs["hidden"] = z(max_bs, E, dt=dtype)
            rows, xw = [max_bs * self.k] * len(self.backends), [s + 2 for s in range(len(self.backends))]
            self.fn = runners._tree_draft_fn
        for be in self.backends:  # a graph capture cannot run the emulator's host-side checks
            kernel.check_graphable(dev, be.provider)
        # one prefix set for all backends: the prefix part does not depend on the draft step
        # (TR-013), so the S - 1 steps read the same buffers, written once per replay
        prefix = (z(max_bs), z(max_bs + 1), z(max_bs, W))
        self.state = [dict(prefix=prefix, expand=(z(n), z(n + 1), z(n, w))) for n, w in zip(rows, xw)]
        # the page table's first slot of each page, token columns 0, P, 2P, ... (MD-007)
        self.strided = torch.arange(0, W * self.P, self.P, device=dev).clamp(max=kv.req_to_token.shape[1] - 1)
        self.width = W
        self.graphs, self.static, self.bound = {}, {}, {}
        self._plans, self._pads = {}, {}  # _fill's cached copy plans, padded mask blocks
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
        """Metadata objects over the buffers' first rows, one (prefix, expand) pair per backend
        (the prefix object shared, as its buffers are)."""
        out = []
        q = self.N if self.phase == "verify" else self.k
        (pk, pck, pt) = self.state[0]["prefix"]
        cu_p = torch.arange(0, bs * q + 1, q, dtype=torch.int32, device=pk.device)
        pre = FlashAttentionMetadata(pk[:bs], cu_p, pck[:bs + 1], q, 0, pt[:bs])
        for st in self.state:
            ek, eck, et = st["expand"]
            cu_e = torch.arange(0, bs * q + 1, dtype=torch.int32, device=pk.device)
            out.append((pre, FlashAttentionMetadata(ek[:bs * q], cu_e, eck[:bs * q + 1], 1, 0, et[:bs * q])))
        return out

    def _pad_mask(self, live_mask, B, bs):
        """The padded batch's flat FULL_MASK (the static batch's ``custom_mask``, what the padded
        verify batch holds; the graph itself reads the tree mask rows): padded requests (L = 1)
        see the prefix slot, the root and themselves, a block made once per padded count (never
        written).  No padded request: the live mask itself (no op)."""
        if bs == B and live_mask is not None:
            return live_mask
        pad = self._pads.get(("mask", bs - B))
        if pad is None:
            N, dev = self.N, self.r.kv.device
            eye = torch.eye(N, dtype=torch.bool, device=dev)
            eye[:, 0] = True
            pad = torch.cat([torch.ones((N, 1), dtype=torch.bool, device=dev), eye], dim=1).flatten().repeat(bs - B)
            self._pads[("mask", bs - B)] = pad
        return pad if live_mask is None else torch.cat([live_mask, pad])

    def _live_mask_rows(self, live):
        """The live batch's tree mask rows (TR-011), bool ``[B*N, N]``: the builder's
        (``TreeVerifyBatch.tree_mask``), or extracted from its FULL_MASK
        (:func:`~refspec.fa3.tree_metadata.verify_mask_rows`, e.g. a recorded trace's batch)."""
        if live.tree_mask is not None:
            return live.tree_mask
        return tm.verify_mask_rows(live.custom_mask, live.seq_lens, self.N)

    def _fill_plan(self, bs: int, B: int, present: tuple) -> tuple[list, list]:
        """The copies of :meth:`_fill` for a (bs, B) replay with the ``present`` inputs, built once
        and cached: the destination slices and their sources (a constant fill tensor,
        ``refspec.graphs.runner.fill_source``, or the name of a live field / ``("input", name)``
        resolved at replay), real rows before padding; :func:`~refspec.graphs.runner.copy_rows`
        groups them by dtype."""
        key = (bs, B, present)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        dst, src = [], []
        for name, buf in self.buf.items():
            per_token = name in ("out_cache_loc", "positions")
            n, end = (B * self.per_req, bs * self.per_req) if per_token else (B, bs)
            if n:
                dst.append(buf[:n])
                src.append("draft_cache_loc" if (name == "out_cache_loc" and self.phase == "draft") else name)
            dst.append(buf[n:end])  # padded: row 0, L = 1, slot 0 (CG-005)
            src.append(fill_source(buf, 1 if name == "seq_lens" else 0)[n:end])
        rows = B * (self.N if self.phase == "verify" else 1)
        for name, buf in self.inputs.items():
            n = rows if name in present else 0  # an input this caller does not use (a metadata-only capture): zeros
            if n:
                dst.append(buf[:n])
                src.append(("input", name))
            dst.append(buf[n:bs * (self.N if self.phase == "verify" else 1)])
            src.append(fill_source(buf, 0)[n:bs * (self.N if self.phase == "verify" else 1)])
        if self.phase == "verify":
            if B:
                dst.append(self.mask_rows[:B * self.N])
                src.append(("mask", None))
            dst.append(self.mask_rows[B * self.N:bs * self.N])
            src.append(self.mask_pad[B * self.N:bs * self.N])
        plan = self._plans[key] = (dst, src)
        return plan

    def _fill(self, fb, live, bs, inputs=None) -> int:
        """Copy the live batch and inputs into the static buffers and pad (CG-005), ONE
        ``_foreach_copy_`` per dtype (as :class:`refspec.graphs.runner.GraphRunner` does); set the
        CPU mirror.  Returns the largest ``seq_lens_cpu`` of the padded batch (host, MD-006)."""
        B = 0 if live is None else live.batch_size

        def source(x):
            if isinstance(x, str):
                return getattr(live, x)
            if isinstance(x, tuple):
                return self._live_mask_rows(live) if x[0] == "mask" else inputs[x[1]]
            return x
        dst, src = self._fill_plan(bs, B, tuple(sorted(inputs or ())))
        copy_rows(dst, [source(x) for x in src])  # one _foreach_copy_ per dtype
        lens = [] if live is None else live.seq_lens_cpu.tolist()
        fb.seq_lens_cpu = padded_cpu(None if live is None else live.seq_lens_cpu, bs, 1)  # padded rows: L = 1
        if self.phase == "verify":
            fb.custom_mask = self._pad_mask(None if live is None else live.custom_mask, B, bs)
        return max(lens + [1] * (bs - B))

    def _write_metadata(self, fb, bs, max_len: int):
        """The prefix page table (shared by every backend, TR-010 / TR-013), written once per
        replay over the host bound ``max_len`` (:func:`refspec.fa3.graph_metadata.replay_page_table`,
        MD-007), and the bound metadata handed to the backends; the prefix lengths and the expand
        parts are the graph's own first work (:func:`write_prefix_lengths`,
        :func:`write_verify_expand`, :func:`write_draft_expand`).  Together the values of
        :func:`~refspec.fa3.tree_metadata.verify_prefix_metadata` / ``draft_prefix_metadata``.
        Raises: CG-008 when the pages do not fit the captured table."""
        check_table_width(max_len, self.P, self.width)
        replay_page_table(self.bound[bs][0][0], fb, self.r.kv.req_to_token, self.strided, max_len, self.P)
        for be, (pre, exp) in zip(self.backends, self.bound[bs]):
            be.forward_metadata, be.forward_metadata_spec_decode_expand = pre, exp

    def _capture(self, bs, pool):
        fb = self._static_batch(bs)
        max_len = self._fill(fb, None, bs)
        self.bound[bs] = self._bind(bs)
        self._write_metadata(fb, bs, max_len)
        rows = bs * (self.N if self.phase == "verify" else 1)
        inputs = {n: t[:rows] for n, t in self.inputs.items()}
        graph = make_graph(fb.seq_lens.device, pool)
        fn, pre = self.fn, self.bound[bs][0][0]  # the closures must not hold the runner (a GC-only cycle)
        if self.phase == "draft":  # the prefix lengths and expand metadata are the graph's first work (module doc)
            expand, k, S, P = [exp for _, exp in self.bound[bs]], self.k, self.S, self.P

            def run():
                write_prefix_lengths(pre, tm.draft_prefix_seqlens(fb.seq_lens, P))  # K = L - lp
                write_draft_expand(expand, fb, k, S, P)
                return fn(fb, inputs)
        else:  # likewise for verify, the expand part from the mask rows replay copies in
            exp, mask, R, N = self.bound[bs][0][1], self.mask_rows[:bs * self.N], self.r.kv.req_to_token, self.N

            def run():
                write_prefix_lengths(pre, fb.seq_lens)  # K = L
                write_verify_expand(exp, mask, fb, R, N)
                return fn(fb, inputs)
        graph.capture(run)
        self.graphs[bs], self.static[bs] = graph, (fb, inputs)

    def replay(self, live, inputs: dict):
        """Pad ``live`` to the smallest captured size, rewrite metadata in place, replay, slice.

        The outputs are views of the real rows of the graph's output tensors (upstream's
        ``CudaGraphRunner.replay`` returns its ``output_buffers`` sliced), valid until this
        graph's next replay.  No copy-out: every reader of them is launched in the same round
        (the next tree, the verify inputs, the compaction, the draft extend, the future-map
        scatters and the result rows all make new tensors or write the future map), before the
        next round's launch replays the graph again (``tests/test_tree_overlap.py`` runs the
        overlap schedule on output buffers that every replay rewrites, as a CUDA graph does)."""
        require(self.can_run(live), "CG-007", f"batch of {live.batch_size}; captured {self.capture_bs}")
        B = live.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, B)]
        fb, x = self.static[bs]
        max_len = self._fill(fb, live, bs, inputs)
        self._write_metadata(fb, bs, max_len)
        out = self.graphs[bs].replay()
        # verify: per-node outputs ([bs*N, ...]) keep B*N rows, per-request ones ([bs, ...]: the
        # accepted path and its length) keep B; draft: every output is per request (B rows)
        rows = B * (self.N if self.phase == "verify" else 1)
        keep = [B if o.shape[0] == bs else rows for o in out]
        return tuple(o[:n] for o, n in zip(out, keep))


def capture_tree_graphs(runners, capture_bs, dtype) -> None:
    """Capture the tree verify, the tree draft decode (S > 1) and the draft extend graphs.

    The draft extend is the chain's graph: v1 ``DRAFT_EXTEND`` at ``Sd + 1`` rows per request,
    v2 ``DRAFT_EXTEND_V2`` at N = ``num_draft_tokens`` rows (the whole verify window, TR-021;
    upstream captures it with ``num_tokens_per_req = speculative_num_draft_tokens``).
    """
    # the draft extend reads the target's hidden (EAGLE-3: its aux states, [len(aux) * E])
    ids = ((), torch.long)
    hidden = ({"hidden": ((target_hidden_size(runners.draft, runners.target),), dtype)}
              if runners.draft.uses_hidden else {})
    runners.graph["tree_verify"] = TreeGraphRunner(runners, "verify", capture_bs, dtype)
    if runners.Sd > 1:
        runners.graph["tree_draft"] = TreeGraphRunner(runners, "draft", capture_bs, dtype)
    mode, W = ((ForwardMode.DRAFT_EXTEND, runners.Sd + 1) if runners.version == "v1"
               else (ForwardMode.DRAFT_EXTEND_V2, runners.num_draft_tokens))
    runners.graph["draft_extend"] = GraphRunner(
        mode, [runners.draft_be], runners._draft_extend_fn, kv=runners.kv,
        capture_bs=capture_bs, tokens_per_req=W, inputs={"ids": ids, **hidden}, num_draft_tokens=W)
