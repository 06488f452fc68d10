"""SGLang's top-k > 1 FA3 metadata (worker subprocess only): the helpers both adapters share for
the tree jobs of :mod:`refspec.conformance.tree_cases`.  :class:`TreeUpstream` runs them where
upstream builds its own tree (the graph-hooks adapter, :mod:`refspec.conformance.upstream_graph`);
the legacy-hooks adapter (:meth:`refspec.conformance.upstream_legacy.Upstream.run_tree`) takes
only :meth:`TreeUpstream.parts`.  This module imports no adapter.

Server args: ``speculative_eagle_topk = k``, ``speculative_num_draft_tokens = N``,
``speculative_num_steps = S`` (upstream's ``override_server_args``).  Per job:

* ``tree_verify``: upstream selects the drafts from the job's per-step draft lists
  (``eagle_utils.organize_draft_results``) and builds its *own* tree with
  ``eagle_utils.build_tree_kernel_efficient`` (FULL_MASK); its tree-building kernel is the
  Triton one, ``spec_tree.sgl_build_tree_kernel_triton`` (the dispatch
  ``build_tree_kernel_efficient_func`` picks it on XPU; the CUDA / CPU builds are compiled
  kernels absent here), run in Triton's interpreter.  The result becomes an ``EagleVerifyInput``
  (upstream's class) with ``topk``, ``custom_mask``, ``positions`` and the ``retrieve_*`` lists;
  ``FlashAttentionBackend`` then builds the metadata.  The tree itself is returned as the
  ``tree`` part of the eager result, with the greedy acceptance of the job's ``target_predict``
  on it: the buffers of ``eagle_utils``' verify (``predict`` zeros, ``accept_index`` -1, int32)
  filled by the Triton kernel ``spec_tree.verify_tree_greedy_triton`` (the CUDA one is compiled).
* ``tree_draft_decode``: ``FlashAttentionMultiStepBackend(topk=k)`` with an ``EagleDraftInput``;
  step s is ``attn_backends[s]``.  Before it, upstream's own
  ``eagle_worker_common.prepare_for_draft`` assigns the draft slots from the job's
  ``req_to_token`` (P = 1: the Triton kernel ``assign_draft_cache_locs_contiguous``; P > 1: the
  per-branch page-aligned gather) and requests the tail copies
  (``duplicate_prefix_tail_to_draft_branches``); its ``ForwardBatch.init_new`` is replaced for that
  call by one returning the batch's ``out_cache_loc``, and its pool records ``move_kv_cache``.
  Both go into the ``tree`` part of step 0's eager result (``out_cache_loc``; ``tail_copy``, the
  ``(target, source)`` slot pairs sorted by target).

Capture runs ``init_forward_metadata_out_graph(fb, in_capture=True)`` + ``..._in_graph`` on the
padded static batch (for top-k > 1 upstream only binds its ``*_topk_normal`` /
``*_topk_expand`` buffers there), replay the same two on refspec's padded static batch.  Verify
replay's ``spec_info`` carries upstream's live tree plus the padded requests' mask blocks of
refspec's runner (upstream's own runner passes the live ``spec_info``, whose padded rows read
mask element 0: a runner policy, not a metadata rule; the padded rows are compared as refspec
fills them).  ``draft_decode_set_expand_metadata`` is ``@torch.compile``: the worker runs it as
plain PyTorch (``TORCHDYNAMO_DISABLE=1``), the same operations without a compiler.

``seq_lens`` reaches upstream as int64, the dtype its scheduler and graph runners hold
(``schedule_batch.py:2786``, ``eagle_draft_cuda_graph_runner.py:193``).  This matters: the eager
P > 1 draft branch does ``metadata.cache_seqlens_int32 -= last_page_lens`` on
``seq_lens.to(torch.int32)``, which for an int32 ``seq_lens`` is the *same* tensor, so step 0
would shorten the batch's ``seq_lens`` in place and every later step would see lp = 0.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.conformance import upstream_common as uc

MODES = ("tree_verify", "tree_draft_decode")
TREE_FIELDS = ("custom_mask", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling",
               "draft_tokens")


class TreeUpstream:
    """The tree half of the graph-hooks adapter ``up`` (:class:`refspec.conformance.upstream_graph.Upstream`:
    same imports, same runner)."""

    def __init__(self, up):
        import sglang.kernels.ops.speculative.cache_locs as cl
        import sglang.kernels.ops.speculative.spec_tree as st
        import sglang.srt.speculative.eagle_utils as eu
        import sglang.srt.speculative.eagle_worker_common as ewc
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput

        self.up, self.eu, self.st, self.ewc, self.cl, self.modes = up, eu, st, ewc, cl, MODES
        self.Verify, self.Draft, self.hidden_mode = EagleVerifyInput, EagleDraftInput, CaptureHiddenMode.FULL

    def info(self) -> dict:
        kernels = {n: getattr(self.st, n) for n in ("sgl_build_tree_kernel_efficient_triton",
                                                    "verify_tree_greedy_kernel_triton")}
        kernels["assign_draft_cache_locs_contiguous"] = self.cl.assign_draft_cache_locs_contiguous
        return {"tree kernels in Triton's interpreter": {n: uc.interpreted(f) for n, f in kernels.items()}}

    def build_tree(self, tree: dict, seq_lens: torch.Tensor, k: int, S: int, N: int) -> dict:
        """Upstream's ``organize_draft_results`` on the job's draft lists, then its
        ``build_tree_kernel_efficient`` with the Triton tree kernel, then greedy acceptance (module doc)."""
        parent_list, top, draft_tokens = self.eu.organize_draft_results(tree["score_list"], tree["token_list"],
                                                                        tree["parents_list"], N)
        # the dispatch to the Triton tree kernel: a swappable ``build_tree_kernel_efficient_func``
        # (0.5.23), or (0.5.19 .. 0.5.22) the module's platform flags, whose ``_is_xpu`` branch calls
        # ``eagle_utils.sgl_build_tree_kernel_triton`` (CUDA / CPU / NPU: compiled kernels absent here)
        swap = {"build_tree_kernel_efficient_func": self.st.sgl_build_tree_kernel_triton} \
            if hasattr(self.eu, "build_tree_kernel_efficient_func") else {"_is_xpu": True, "_is_npu": False}
        saved = {n: getattr(self.eu, n) for n in swap}
        for n, v in swap.items():
            setattr(self.eu, n, v)
        mask_mode = getattr(self.st, "TreeMaskMode", None) or self.eu.TreeMaskMode
        try:
            out = self.eu.build_tree_kernel_efficient(
                tree["verified_id"], parent_list, top, draft_tokens, seq_lens, int(seq_lens.sum()), k, S, N,
                tree_mask_mode=mask_mode.FULL_MASK)
        finally:
            for n, v in saved.items():
                setattr(self.eu, n, v)
        built = dict(zip(TREE_FIELDS, (x.clone() for x in out)), parent_list=parent_list.clone(),
                     top_scores_index=top.clone())
        # greedy acceptance on upstream's own tree: eagle_utils' buffers, spec_tree's Triton kernel
        B = seq_lens.numel()
        predict = torch.zeros(B * N, dtype=torch.int32)
        accept_index = torch.full((B, S + 1), -1, dtype=torch.int32)
        accept_num = torch.empty((B,), dtype=torch.int32)
        verify = getattr(self.st, "verify_tree_greedy_triton", None) or self.eu.verify_tree_greedy_triton  # (<= 0.5.22)
        verify(predict, accept_index, accept_num, built["draft_tokens"].view(B, N),
                                          built["retrive_index"], built["retrive_next_token"],
                                          built["retrive_next_sibling"], tree["target_predict"].view(B, N))
        return dict(built, predicts=predict, accept_index=accept_index, accept_token_num=accept_num)

    def draft_slots(self, job: dict, k: int, S: int, P: int) -> dict:
        """Upstream's draft ``out_cache_loc`` and tail copies for the job's live batch (module doc)."""
        d = job["eager"]
        B = int(d["req_pool_indices"].numel())
        moves = []
        pool = uc.NS(move_kv_cache=lambda tgt, src: moves.append(torch.stack([tgt.long(), src.long()], dim=1)))
        batch = uc.NS(forward_mode=self.up.FM["DECODE"], seq_lens=d["seq_lens"].long(),
                      req_pool_indices=d["req_pool_indices"], token_to_kv_pool_allocator=uc.NS(page_size=P),
                      device="cpu", multimodal_inputs=[None] * B, out_cache_loc=None)
        runner = uc.NS(model_config=uc.NS(model_is_mrope=False), token_to_kv_pool=pool,
                       spec_algorithm=uc.NS(is_standalone=lambda: False))
        saved = self.ewc.ForwardBatch
        self.ewc.ForwardBatch = uc.NS(init_new=lambda b, *a, **kw: uc.NS(out_cache_loc=b.out_cache_loc))
        try:
            fb = self.ewc.prepare_for_draft(self.spec_info("tree_draft_decode", None, d, k, S, 0),
                                            uc.NS(req_to_token=job["req_to_token"]), batch, None, runner, k,
                                            S)[0]  # (forward batch, can run graph[, plan]: 3 from 0.5.23)
        finally:
            self.ewc.ForwardBatch = saved
        pairs = torch.cat(moves) if moves else torch.zeros((0, 2), dtype=torch.long)
        return {"out_cache_loc": fb.out_cache_loc.clone(), "tail_copy": pairs[torch.argsort(pairs[:, 0])]}

    def spec_info(self, mode: str, tree: dict | None, d: dict, k: int, S: int, N: int):
        if mode == "tree_draft_decode":
            B = int(d["req_pool_indices"].numel())
            return self.Draft(topk_p=torch.zeros(B, k), topk_index=torch.zeros(B, k, dtype=torch.long),
                              num_tokens_per_req=k)
        return self.Verify(draft_token=tree["draft_tokens"], custom_mask=d["custom_mask"], positions=d["positions"],
                           retrieve_index=tree["retrive_index"], retrieve_next_token=tree["retrive_next_token"],
                           retrieve_next_sibling=tree["retrive_next_sibling"], retrieve_cum_len=None, spec_steps=S,
                           topk=k, draft_token_num=N, capture_hidden_mode=self.hidden_mode,
                           seq_lens_sum=int(d["seq_lens_cpu"].sum()), seq_lens_cpu=d["seq_lens_cpu"])

    def forward_batch(self, mode: str, tree, d: dict, k: int, S: int, N: int, own_mask: bool = True):
        """A ``ForwardBatch`` namespace; ``seq_lens`` int64, as upstream's scheduler and graph runners
        hold it (module doc).  ``own_mask``: upstream's tree mask and positions for the live
        requests, then the padded requests' part of ``d``'s (refspec's runner's)."""
        fm = "TARGET_VERIFY" if mode == "tree_verify" else "DECODE"
        d = dict(d, seq_lens=d["seq_lens"].long())
        if mode == "tree_verify" and own_mask:
            for f in ("custom_mask", "positions"):
                d[f] = torch.cat([tree[f], d[f][tree[f].numel():]])
        fb = uc.NS(forward_mode=self.up.FM[fm], batch_size=int(d["req_pool_indices"].numel()),
                   req_pool_indices=d["req_pool_indices"], seq_lens=d["seq_lens"], seq_lens_cpu=d["seq_lens_cpu"],
                   seq_lens_sum=int(d["seq_lens_cpu"].sum()), extend_seq_lens=None, extend_seq_lens_cpu=None,
                   extend_prefix_lens_cpu=None, encoder_lens=None, out_cache_loc=d["out_cache_loc"],
                   positions=d["positions"], kv_loc_plan=None, kv_loc_cols=None)
        fb.spec_info = self.spec_info(mode, tree, d, k, S, N)
        return fb

    def run(self, job: dict, sa) -> dict:
        """``{(phase, step): {"prefix": fields, "expand": fields[, "tree": fields]}}`` for one tree job
        (``sa``: the job's ServerArgs, installed by the adapter)."""
        P, N, S, k, mode = job["page_size"], job["num_draft_tokens"], job["num_steps"], job["topk"], job["mode"]
        return self._run(job, mode, P, N, S, k, sa)

    def _run(self, job, mode, P, N, S, k, sa) -> dict:
        fa = self.up.fa
        mr = self.up.runner(job["req_to_token"], P, job["context_len"], mode == "tree_draft_decode", sa)
        if mode == "tree_draft_decode":
            be = fa.FlashAttentionMultiStepBackend(mr, topk=k, speculative_num_steps=S)
            steps = uc.draft_steps(be, S)
        else:
            be = fa.FlashAttentionBackend(mr)
            steps = [(None, be)]
        tree = None
        if mode == "tree_verify":
            tree = self.build_tree(job["tree"], job["eager"]["seq_lens"].long(), k, S, N)
        out = {}
        be.init_forward_metadata(self.forward_batch(mode, tree, job["eager"], k, S, N))
        out.update({("eager", s): self.parts(b) for s, b in steps})
        if tree is not None:
            out[("eager", None)]["tree"] = tree
        else:
            out[("eager", 0)]["tree"] = self.draft_slots(job, k, S, P)
        bs = job["bs"]
        be.init_cuda_graph_state(bs, bs * (N if mode == "tree_verify" else k * S))
        for phase in ("capture", "replay"):
            fb = self.forward_batch(mode, tree, job[phase], k, S, N, own_mask=phase == "replay")
            be.init_forward_metadata_out_graph(fb, in_capture=phase == "capture")
            be.init_forward_metadata_in_graph(fb)
            out.update({(phase, s): self.parts(b) for s, b in steps})
        return out

    @staticmethod
    def parts(b) -> dict:
        return {"prefix": uc.fields(b.forward_metadata), "expand": uc.fields(b.forward_metadata_spec_decode_expand)}

