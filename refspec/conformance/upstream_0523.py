"""The graph-hooks adapter (worker subprocess only; written against SGLang 0.5.23, chosen for any
code whose shape has these hooks, :func:`refspec.conformance.install.detect`): capture =
``init_forward_metadata_out_graph(fb, in_capture=True)``
then ``init_forward_metadata_in_graph(fb)`` (the part a graph records);
replay = ``init_forward_metadata_out_graph(fb)`` then the in-graph part again (a graph replay
re-runs it).  ``DRAFT_EXTEND`` (v1) no longer exists in this release.

DRAFT_EXTEND_V2 is replayed a second time the way a runner that stages draft-extend metadata
does it (phase ``replay-staged``: out-of-graph step skipped, the Triton kernel alone).
Draft decode runs through ``FlashAttentionMultiStepBackend`` (each step's inner DECODE view,
``build_inner_fb_view``); step s is ``multi.attn_backends[s].forward_metadata``.
Server args are upstream's real ``ServerArgs`` through its own test helper
``runtime_context.get_context().override_server_args(...)``.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

from refspec.conformance import upstream_common as uc
from refspec.conformance.upstream_0512 import _server_args, call


def installed(ctx, override):
    """Install ``override`` (``RuntimeContext.override_server_args``) and return the ServerArgs now
    in force: ``install()``'s return value, or the context's ``server_args`` where it returns none."""
    sa = override.install()
    return sa if sa is not None else ctx.server_args


class Upstream:
    def __init__(self, site: str, shape):
        import importlib

        uc.prepare(site)
        import sglang.srt.layers.attention.flashattention_backend as fa
        import sglang.srt.server_args as server_args
        try:  # 0.5.14 on; 0.5.13 has the graph hooks but publishes server args only through server_args.py
            import sglang.srt.runtime_context as runtime_context
        except ModuleNotFoundError:
            runtime_context = None
        from sglang.srt.configs.model_config import AttentionArch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        try:  # 0.5.20 on; older graph-hook releases read model_runner.server_args and build no translator
            from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        except ImportError:
            KVIndexTranslator = None

        from refspec.conformance.upstream_tree import TreeUpstream

        self.fa, self.FM = fa, ForwardMode
        # imports upstream's tree code before the stubs are armed
        self.tree = TreeUpstream(self) if shape.own_tree else None
        kmeta = importlib.import_module(uc.module_name(shape.kernels)) if shape.kernels else None
        uc.finish_imports()
        self.fa, self.FM, self.arch = fa, ForwardMode, AttentionArch
        self.translator = KVIndexTranslator
        ctx = runtime_context.get_context() if runtime_context else None
        self.context = runtime_context.get_context if hasattr(ctx, "override_server_args") else None
        self.ServerArgs = server_args.ServerArgs
        self.publish = getattr(server_args, "set_global_server_args_for_scheduler", lambda sa: None)
        self.kernels = {n: uc.interpreted(getattr(kmeta, n)) for n in
                        ("_fused_decode_metadata_kernel", "_draft_extend_metadata_kernel") if hasattr(kmeta, n)}

    def info(self) -> dict:
        return {"replay kernels in Triton's interpreter": self.kernels, **(self.tree.info() if self.tree else {})}

    def _runner(self, R, P: int, ctx: int, draft: bool, sa):
        """The model-runner namespace; ``sa``: the ServerArgs in force (the one published, or the
        one ``override_server_args`` installed), carried as ``model_runner.server_args`` too, since
        releases with the runtime-context override still read that field (0.5.16 .. 0.5.18
        ``FlashAttentionBackend.__init__``: ``model_runner.server_args.kv_cache_dtype``)."""
        pool = uc.KVPoolStub()
        rows = NS(req_to_token=R, size=R.shape[0] - 1)
        mr = NS(sliding_window_size=None, model_config=uc.model_config(ctx, self.arch.MHA), device="cpu",
                req_to_token_pool=rows, token_to_kv_pool=pool, kv_cache_dtype=None, kv_cache_dtype_str="auto",
                page_size=P, is_draft_worker=draft, attention_chunk_size=None, attn_cp_size=1, tp_size=1,
                is_hybrid=False, ps=NS(attn_cp_size=1, tp_size=1),  # (0.5.16 on: model_runner.ps.attn_cp_size)
                server_args=sa,
                # 0.5.17 / 0.5.18 probe it for a unified MLA pool (unified_mla_hooks: no full_v2p_page_table
                # means the static pool, which is what these cases model)
                token_to_kv_pool_allocator=NS())
        if self.translator is not None:
            mr.kv_index_translator = call(self.translator, req_to_token=R, token_to_kv_pool_allocator=None,
                                          token_to_kv_pool=pool, page_size=P, device="cpu", is_draft_worker=draft)
        return mr

    def run(self, job: dict) -> dict:
        """``{(phase, step): fields}`` for one job (``cases.Job.inputs``); tree jobs: :mod:`upstream_tree`."""
        P, N, Sd, mode = job["page_size"], job["num_draft_tokens"], job["num_steps"], job["mode"]
        if self.tree is not None and mode in self.tree.modes:
            return self.tree.run(job)
        over = dict(page_size=P, speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=Sd,
                    speculative_num_draft_tokens=N, device="cpu", attention_backend="fa3")
        if self.context is None:  # an older graph-hook release: server args on the model runner, published
            self.sa = _server_args(self.ServerArgs, **over)
            self.publish(self.sa)
            return self._run(job, mode, P, N, Sd)
        override = self.context().override_server_args(**over)
        self.sa = installed(self.context(), override)
        try:
            return self._run(job, mode, P, N, Sd)
        finally:
            override.restore()

    def _run(self, job, mode, P, N, Sd) -> dict:
        mr = self._runner(job["req_to_token"], P, job["context_len"], mode in uc.DRAFT_MODES, self.sa)
        multi = mode == "draft_decode"
        be = self.fa.FlashAttentionMultiStepBackend(mr, topk=1, speculative_num_steps=Sd) if multi else \
            self.fa.FlashAttentionBackend(mr)
        steps = uc.draft_steps(be, Sd) if multi else [(None, be)]
        out = {}
        be.init_forward_metadata(uc.forward_batch(self.FM, mode, job["eager"], N))
        out.update({("eager", s): uc.fields(b.forward_metadata) for s, b in steps})
        if "bs" not in job:
            return out
        be.init_cuda_graph_state(job["bs"], job["capture"]["num_tokens"])
        for phase in ("capture", "replay"):
            fb = uc.forward_batch(self.FM, mode, job[phase], N)
            be.init_forward_metadata_out_graph(fb, in_capture=phase == "capture")
            be.init_forward_metadata_in_graph(fb)
            out.update({(phase, s): uc.fields(b.forward_metadata) for s, b in steps})
        if mode == "draft_extend_v2" and getattr(be, "supports_draft_extend_metadata_staging", False):
            out[("replay-staged", None)] = self._staged(mr, job, mode, N)
        return out

    def _staged(self, mr, job, mode, N) -> dict:
        """DRAFT_EXTEND_V2 replay with the out-of-graph step skipped (``stage_draft_extend_metadata``:
        the in-graph Triton kernel ``draft_extend_set_metadata`` alone writes the metadata), on a
        second backend that only went through capture."""
        be = self.fa.FlashAttentionBackend(mr)
        be.init_cuda_graph_state(job["bs"], job["capture"]["num_tokens"])
        cap = uc.forward_batch(self.FM, mode, job["capture"], N)
        be.init_forward_metadata_out_graph(cap, in_capture=True)
        be.init_forward_metadata_in_graph(cap)
        be.stage_draft_extend_metadata(uc.forward_batch(self.FM, mode, job["replay"], N))
        return uc.fields(be.forward_metadata)
