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
``runtime_context.get_context().override_server_args(...)`` where the release has it (0.5.14 on).
Top-k > 1 jobs: upstream builds its own tree (:class:`refspec.conformance.upstream_tree.TreeUpstream`).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace as NS

from refspec.conformance import upstream_common as uc
from refspec.conformance.upstream_tree import TreeUpstream


def installed(ctx, override):
    """Install ``override`` (``RuntimeContext.override_server_args``) and return the ServerArgs now
    in force: ``install()``'s return value, or the context's ``server_args`` where it returns none."""
    sa = override.install()
    return sa if sa is not None else ctx.server_args


class Upstream(uc.Adapter):
    hooks = "graph"

    def _imports(self) -> None:
        try:  # 0.5.14 on; 0.5.13 has the graph hooks but publishes server args only through server_args.py
            import sglang.srt.runtime_context as runtime_context
        except ModuleNotFoundError:
            runtime_context = None
        try:  # 0.5.20 on; older graph-hook releases read model_runner.server_args and build no translator
            from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        except ImportError:
            KVIndexTranslator = None
        # imports upstream's tree code before the stubs are armed
        self.tree = TreeUpstream(self) if self.shape.own_tree else None
        kmeta = importlib.import_module(uc.module_name(self.shape.kernels)) if self.shape.kernels else None
        self.translator = KVIndexTranslator
        ctx = runtime_context.get_context() if runtime_context else None
        self.context = runtime_context.get_context if hasattr(ctx, "override_server_args") else None
        self.kernels = {n: uc.interpreted(getattr(kmeta, n)) for n in
                        ("_fused_decode_metadata_kernel", "_draft_extend_metadata_kernel") if hasattr(kmeta, n)}

    def info(self) -> dict:
        return {"replay kernels in Triton's interpreter": self.kernels, **(self.tree.info() if self.tree else {})}

    @contextlib.contextmanager
    def server_args(self, job: dict):
        """Through ``override_server_args`` where the release has it (installed, restored after the
        job); else the base's (published, and carried on the model runner)."""
        if self.context is None:
            with super().server_args(job) as sa:
                yield sa
            return
        override = self.context().override_server_args(**self.overrides(job))
        try:
            yield installed(self.context(), override)
        finally:
            override.restore()

    def runner(self, R, P: int, ctx: int, draft: bool, sa):
        """The model-runner namespace; ``sa``: the ServerArgs in force (the one published, or the
        one ``override_server_args`` installed), carried as ``model_runner.server_args`` too, since
        releases with the runtime-context override still read that field (0.5.16 .. 0.5.18
        ``FlashAttentionBackend.__init__``: ``model_runner.server_args.kv_cache_dtype``)."""
        pool = uc.KVPoolStub(int(R.max()) + 1, P)
        rows = uc.Given("req_to_token_pool", req_to_token=R, size=R.shape[0] - 1)
        mr = uc.Given("model_runner", sliding_window_size=None, model_config=uc.model_config(ctx, self.arch.MHA),
                      device="cpu", req_to_token_pool=rows, token_to_kv_pool=pool, kv_cache_dtype=None,
                      kv_cache_dtype_str="auto", page_size=P, is_draft_worker=draft, attention_chunk_size=None,
                      attn_cp_size=1, tp_size=1, is_hybrid=False,
                      ps=NS(attn_cp_size=1, tp_size=1),  # (0.5.16 on: model_runner.ps.attn_cp_size)
                      server_args=sa,
                      # 0.5.17 / 0.5.18 probe it for a unified MLA pool (unified_mla_hooks: no full_v2p_page_table
                      # means the static pool, which is what these cases model)
                      token_to_kv_pool_allocator=NS())
        if self.translator is not None:
            mr.kv_index_translator = uc.call(self.translator, req_to_token=R, token_to_kv_pool_allocator=None,
                                             token_to_kv_pool=pool, page_size=P, device="cpu", is_draft_worker=draft)
        return mr

    def run_tree(self, job: dict, sa) -> dict:
        return self.tree.run(job, sa)

    def run_flat(self, job: dict, sa) -> dict:
        """``{(phase, step): fields}`` for one top-k = 1 job, each with its forward's kernel calls
        (:data:`~refspec.conformance.upstream_common.KERNEL`; the modes of ``KERNEL_MODES``): eager
        and capture run the forward after the hooks; replay hands the kernel the capture's scalars
        and the tensors the re-run in-graph hook rewrote (:func:`~refspec.conformance.upstream_common.frozen`)."""
        P, N, Sd, mode = job["page_size"], job["num_draft_tokens"], job["num_steps"], job["mode"]
        mr = self.runner(job["req_to_token"], P, job["context_len"], mode in uc.DRAFT_MODES, sa)
        multi = mode == "draft_decode"
        be = self.fa.FlashAttentionMultiStepBackend(mr, topk=1, speculative_num_steps=Sd) if multi else \
            self.fa.FlashAttentionBackend(mr)
        steps = uc.draft_steps(be, Sd) if multi else [(None, be)]
        forward = mode in uc.KERNEL_MODES
        out = {}
        fb = self.fb(mode, job["eager"], N, token_to_kv_pool=mr.token_to_kv_pool)
        be.init_forward_metadata(fb)
        for s, b in steps:
            out[("eager", s)] = uc.fields(b.forward_metadata)
            if forward:
                uc.attach(out[("eager", s)], self.kernel(b, fb, uc.query_rows(mode, job["eager"])))
        if "bs" not in job:
            return out
        be.init_cuda_graph_state(job["bs"], job["capture"]["num_tokens"])
        captured = {}
        for phase in ("capture", "replay"):
            fb = self.fb(mode, job[phase], N, token_to_kv_pool=mr.token_to_kv_pool)
            be.init_forward_metadata_out_graph(fb, in_capture=phase == "capture")
            be.init_forward_metadata_in_graph(fb)
            for s, b in steps:
                out[(phase, s)] = uc.fields(b.forward_metadata)
                if not forward:
                    continue
                calls = self.kernel(b, fb, uc.query_rows(mode, job[phase]))
                if phase == "capture":
                    captured[s] = calls
                else:
                    calls = uc.frozen(captured[s], calls)
                uc.attach(out[(phase, s)], calls)
        if mode == "draft_extend_v2" and getattr(be, "supports_draft_extend_metadata_staging", False):
            out[("replay-staged", None)] = self._staged(mr, job, mode, N)
        return out

    def _staged(self, mr, job, mode, N) -> dict:
        """DRAFT_EXTEND_V2 replay with the out-of-graph step skipped (``stage_draft_extend_metadata``:
        the in-graph Triton kernel ``draft_extend_set_metadata`` alone writes the metadata), on a
        second backend that only went through capture; its kernel calls as :meth:`run_flat`'s replay."""
        be = self.fa.FlashAttentionBackend(mr)
        be.init_cuda_graph_state(job["bs"], job["capture"]["num_tokens"])
        cap = self.fb(mode, job["capture"], N, token_to_kv_pool=mr.token_to_kv_pool)
        be.init_forward_metadata_out_graph(cap, in_capture=True)
        be.init_forward_metadata_in_graph(cap)
        rows = uc.query_rows(mode, job["capture"])
        captured = self.kernel(be, cap, rows)
        rep = self.fb(mode, job["replay"], N, token_to_kv_pool=mr.token_to_kv_pool)
        be.stage_draft_extend_metadata(rep)
        return uc.attach(uc.fields(be.forward_metadata), uc.frozen(captured, self.kernel(be, rep, rows)))
