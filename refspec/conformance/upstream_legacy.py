"""The legacy-hooks adapter (worker subprocess only; written against SGLang 0.5.12.post1, chosen for
any code whose shape has these hooks, :func:`refspec.conformance.install.detect`), 0.5.12.post1
being the newest release with ``ForwardMode.DRAFT_EXTEND``
(v1) *and* the legacy graph hooks ``init_forward_metadata_capture_cuda_graph`` /
``init_forward_metadata_replay_cuda_graph`` (0.5.13 dropped the hooks, 0.5.14 the v1 mode).

Here v1 draft extend and its replay rule ``cu_seqlens_q[1:] = cumsum(spec_info.num_accept_tokens)``
(``flashattention_backend.py`` ``init_forward_metadata_replay_cuda_graph``) run as upstream
wrote them.  The model runner carries a real ``ServerArgs`` (dataclass defaults, no
``__post_init__``: that validates a model path and probes the GPU), also published through
upstream's ``set_global_server_args_for_scheduler``.
IDLE is not compared: with an empty batch this release never builds attention metadata
(``model_runner.py`` ``forward_idle``: ``if forward_batch.batch_size > 0``), and its eager
builder would take the max of an empty ``seq_lens_cpu``.

Top-k > 1 (:meth:`Upstream.run_tree`): these releases build trees only with the CUDA
``sgl_kernel.build_tree_kernel_efficient``, so the tree job's ``spec_info`` carries the tree of the
job's batch snapshot -- refspec's ``build_tree``, which the graph-hooks jobs check bitwise against
upstream's own tree kernel -- in a namespace with the fields the metadata path reads
(``custom_mask``, ``positions``, ``topk``; for draft decode ``is_draft_input``), typed as
upstream's class where the backend module names one (:meth:`Upstream.typed`).  An error in the
capture or replay hook is that phase's result (the error text, as the worker reports a failed
job; a failed capture is also replay's), so the same job's earlier phases are still compared.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

from refspec.conformance import upstream_common as uc
from refspec.conformance.upstream_tree import TreeUpstream


def _built(backend, phase: str):
    """The fields of ``backend.forward_metadata`` after a graph hook, or, where the hook left it
    None (0.5.6's replay hook starts from ``metadata = None`` and has no DRAFT_EXTEND_V2 branch:
    ``is_draft_extend()`` excludes v2), that upstream fact as the phase's error text."""
    if backend.forward_metadata is None:
        hook = "init_forward_metadata_capture_cuda_graph" if phase == "capture" else \
            "init_forward_metadata_replay_cuda_graph"
        return (f"NoMetadata: upstream's {hook} left forward_metadata None for this mode (none of its "
                f"branches handles it)")
    return uc.fields(backend.forward_metadata)


class Upstream(uc.Adapter):
    hooks = "legacy"

    def _imports(self) -> None:
        self.kernels = {n: uc.interpreted(getattr(self.fa, n)) for n in
                        ("_fused_metadata_kernel_general", "_fused_metadata_kernel_ps1_no_swa")
                        if hasattr(self.fa, n)}

    def info(self) -> dict:
        return {"replay kernels in Triton's interpreter": self.kernels}

    def runner(self, job: dict, sa):
        """The model-runner namespace, carrying the job's ``ServerArgs``."""
        R, P = job["req_to_token"], job["page_size"]
        rows = uc.Given("req_to_token_pool", req_to_token=R, size=R.shape[0] - 1)
        return uc.Given("model_runner", server_args=sa, sliding_window_size=None,
                        model_config=uc.model_config(job["context_len"], self.arch.MHA),
                        device="cpu", req_to_token_pool=rows, token_to_kv_pool=uc.KVPoolStub(int(R.max()) + 1, P),
                        kv_cache_dtype=None, page_size=P, attn_cp_size=1, tp_size=1, attention_chunk_size=None,
                        is_hybrid=False, is_hybrid_swa=False)  # (<= 0.5.5: is_hybrid, 0.5.6: is_hybrid_swa)

    def run_flat(self, job: dict, sa) -> dict:
        """``{(phase, step): fields}`` for one top-k = 1 job (``cases.Job.inputs``), each with its
        forward's kernel calls (:data:`~refspec.conformance.upstream_common.KERNEL`; the modes of
        ``KERNEL_MODES``): eager and capture run the forward after the hooks; replay hands the
        kernel what the capture's calls passed, read again (the legacy replay hook runs outside the
        graph and must rewrite the captured buffers in place: :meth:`~refspec.conformance.recorder.Call.reread`)."""
        N, Sd, mode = job["num_draft_tokens"], job["num_steps"], job["mode"]
        mr = self.runner(job, sa)
        rows = mr.req_to_token_pool
        multi = mode == "draft_decode"
        be = self.fa.FlashAttentionMultiStepBackend(mr, topk=1, speculative_num_steps=Sd) if multi else \
            self.fa.FlashAttentionBackend(mr)
        steps = uc.draft_steps(be, Sd) if multi else [(None, be)]
        forward = mode in uc.KERNEL_MODES

        def fb(phase):
            b = self.fb(mode, job[phase], N, req_to_token_pool=rows, token_to_kv_pool=mr.token_to_kv_pool)
            b.spec_info = self.typed(b.spec_info, mode)
            return b

        eager = fb("eager")
        be.init_forward_metadata(eager)
        out = {}
        for s, b in steps:
            out[("eager", s)] = uc.fields(b.forward_metadata)
            if forward:
                uc.attach(out[("eager", s)], self.kernel(b, eager, uc.query_rows(mode, job["eager"])))
        if "bs" not in job:
            return out
        try:
            self._graph(be, multi, job, fb, steps, out, forward)
        except Exception as e:  # noqa: BLE001 -- that phase's own upstream error; the earlier phases' results stand
            out.update({(ph, s): uc.describe(e) for ph in ("capture", "replay") for s, _ in steps
                        if (ph, s) not in out})
        return out

    def typed(self, ns, mode: str):
        """``spec_info`` as an instance of upstream's own class (``EagleDraftInput`` /
        ``EagleVerifyInput``) where the backend module names one: the 0.4.x multi-step capture
        asserts ``isinstance(forward_batch.spec_info, EagleDraftInput)``.  Only the namespace's
        fields are set (no ``__init__``: its other fields keep their class defaults)."""
        cls = getattr(self.fa, "EagleDraftInput" if mode in uc.DRAFT_MODES else "EagleVerifyInput", None)
        if ns is None or not isinstance(cls, type):
            return ns
        given = uc.given_class(cls, "spec_info")
        obj = given.__new__(given)
        obj.__dict__.update(vars(ns))
        return obj

    def _graph(self, be, multi, job, fb, steps, out, forward: bool) -> None:
        """Capture then replay (legacy hooks), each phase's fields (and kernel calls) into ``out``."""
        bs = job["bs"]
        mode = job["mode"]
        uc.call(be.init_cuda_graph_state, max_bs=bs, max_num_tokens=job["capture"]["num_tokens"])  # (0.4.x: max_bs)
        cap = fb("capture")
        uc.legacy_hook(be, "capture", cap, bs, job["capture"]["num_tokens"], multi)
        captured = {}
        for s, b in steps:
            out[("capture", s)] = _built(b, "capture")
            if forward and isinstance(out[("capture", s)], dict):
                captured[s] = self.kernel(b, cap, uc.query_rows(mode, job["capture"]))
                uc.attach(out[("capture", s)], captured[s])
        job["replay"] = uc.into_static(job["capture"], job["replay"])  # the runner's static buffers, rewritten
        rep = fb("replay")
        uc.legacy_hook(be, "replay", rep, bs, job["capture"]["num_tokens"], multi)
        for s, b in steps:
            out[("replay", s)] = _built(b, "replay")
            if s in captured and isinstance(out[("replay", s)], dict):
                c = captured[s]
                uc.attach(out[("replay", s)], c if isinstance(c, str) else [x.reread() for x in c])

    def draft_order(self, loc, B: int, k: int, S: int):
        """The draft ``out_cache_loc`` (refspec's ``[B, k, S]``: branch-major) in the order this
        release's worker lays it out (``shape.draft_loc``, :func:`refspec.conformance.install.draft_loc_layout`):
        ``[B, S, k]`` (step-major) before sglang#7239.  The slots are the same; only their order in
        the flat tensor the backend reads differs."""
        order = (self.shape.draft_loc or {}).get("order")
        if order == "bs,topk,steps":
            return loc
        if order == "bs,steps,topk" and loc.numel() == B * k * S:
            return loc.view(B, k, S).transpose(1, 2).reshape(-1).contiguous()
        raise uc.AdapterGap(f"the draft out_cache_loc ({loc.numel()} slots, B = {B}, k = {k}, S = {S}) cannot be laid "
                            f"out in this release's order {order!r}")

    def run_tree(self, job: dict, sa) -> dict:
        """One tree job through the legacy hooks (module doc)."""
        N, S, k, mode = job["num_draft_tokens"], job["num_steps"], job["topk"], job["mode"]
        mr = self.runner(job, sa)
        rows = mr.req_to_token_pool
        draft = mode == "tree_draft_decode"
        FM = self.FM["DECODE" if draft else "TARGET_VERIFY"]

        def fb(phase):
            d = dict(job[phase])
            if draft:
                d["out_cache_loc"] = self.draft_order(d["out_cache_loc"], int(d["req_pool_indices"].numel()), k, S)
            spec = self.typed(NS(is_draft_input=lambda: draft, positions=d["positions"],
                                 custom_mask=d["custom_mask"], topk=k, num_tokens_per_req=k if draft else N),
                              "draft_decode" if draft else "verify")
            return uc.Given("forward_batch", forward_mode=FM, batch_size=int(d["req_pool_indices"].numel()),
                      req_pool_indices=d["req_pool_indices"], seq_lens=d["seq_lens"].long(),
                      seq_lens_cpu=d["seq_lens_cpu"], seq_lens_sum=int(d["seq_lens_cpu"].sum()),
                      extend_seq_lens=None, extend_seq_lens_cpu=None, extend_prefix_lens_cpu=None, encoder_lens=None,
                      out_cache_loc=d["out_cache_loc"], positions=d["positions"], req_to_token_pool=rows,
                      spec_info=spec, token_to_kv_pool=mr.token_to_kv_pool)

        if draft:
            be = self.fa.FlashAttentionMultiStepBackend(mr, topk=k, speculative_num_steps=S)
            steps = uc.draft_steps(be, S)
        else:
            be = self.fa.FlashAttentionBackend(mr)
            steps = [(None, be)]
        be.init_forward_metadata(fb("eager"))
        out = {("eager", s): TreeUpstream.parts(b) for s, b in steps}
        bs, T = job["bs"], job["bs"] * (k * S if draft else N)
        uc.call(be.init_cuda_graph_state, max_bs=bs, max_num_tokens=T)  # (<= 0.4.x: max_bs only)
        cap = fb("capture")
        try:
            if draft:
                be.init_forward_metadata_capture_cuda_graph(cap)
            else:
                be.init_forward_metadata_capture_cuda_graph(bs, T, cap.req_pool_indices, cap.seq_lens, None, FM,
                                                            cap.spec_info)
        except Exception as e:  # noqa: BLE001 -- the capture's own error (replay has nothing to run on); eager stands
            out.update({(ph, s): uc.describe(e) for ph in ("capture", "replay") for s, _ in steps})
            return out
        out.update({("capture", s): TreeUpstream.parts(b) for s, b in steps})
        job["replay"] = uc.into_static(job["capture"], job["replay"])  # the runner's static buffers, rewritten
        rep = fb("replay")
        try:
            if draft:
                be.init_forward_metadata_replay_cuda_graph(rep, bs)
            else:
                be.init_forward_metadata_replay_cuda_graph(bs, rep.req_pool_indices, rep.seq_lens,
                                                           rep.seq_lens_sum, None, FM, rep.spec_info,
                                                           rep.seq_lens_cpu, rep.out_cache_loc)
        except Exception as e:  # noqa: BLE001 -- the replay's own error; eager and capture results stand
            out.update({("replay", s): uc.describe(e) for s, _ in steps})
            return out
        out.update({("replay", s): TreeUpstream.parts(b) for s, b in steps})
        return out
