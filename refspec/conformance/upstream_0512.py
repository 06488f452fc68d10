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
The top-k > 1 tree jobs go to :func:`refspec.conformance.upstream_tree.run_legacy` (with
``speculative_eagle_topk = k``).
IDLE is not compared: with an empty batch this release never builds attention metadata
(``model_runner.py`` ``forward_idle``: ``if forward_batch.batch_size > 0``), and its eager
builder would take the max of an empty ``seq_lens_cpu``.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace as NS

from refspec.conformance import upstream_common as uc


def call(fn, **kw):
    """Call ``fn`` with the arguments its signature names (older releases take fewer, e.g. no
    ``out_cache_loc``, or no ``is_draft_worker`` for ``KVIndexTranslator``): every parameter it
    requires must be among ``kw``."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                  p.KEYWORD_ONLY)]
    missing = [p.name for p in params if p.name not in kw and p.default is p.empty]
    if missing:
        raise TypeError(f"{fn.__qualname__} needs {', '.join(missing)}, which this adapter does not have")
    return fn(**{p.name: kw[p.name] for p in params if p.name in kw})


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


def _server_args(ServerArgs, **over):
    sa = ServerArgs.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(sa, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(sa, f.name, f.default_factory())
    for k, v in over.items():
        if not hasattr(sa, k):
            raise AttributeError(f"ServerArgs has no field {k!r}")
        setattr(sa, k, v)
    return sa


class Upstream:
    def __init__(self, site: str, shape):
        uc.prepare(site)
        # the model config first, as the server imports it before any attention backend: it imports
        # layers/quantization, whose 0.4.5 __init__ imports vocab_parallel_embedding back (a circular
        # import when the backend's chain reaches vocab_parallel_embedding first)
        from sglang.srt.configs.model_config import AttentionArch
        import sglang.srt.layers.attention.flashattention_backend as fa
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        import sglang.srt.server_args as server_args

        uc.finish_imports()
        self.fa, self.FM, self.arch, self.modes = fa, ForwardMode, AttentionArch, shape.modes
        # older releases read the server args from the model runner only (no global to publish)
        self.ServerArgs = server_args.ServerArgs
        self.publish = getattr(server_args, "set_global_server_args_for_scheduler", lambda sa: None)
        #: the backend reads v1 draft extend's accepted counts under their old names (0.5.x before #23962)
        self.accept_length = "spec_info.accept_length" in inspect.getsource(fa)
        self.kernels = {n: uc.interpreted(getattr(fa, n)) for n in
                        ("_fused_metadata_kernel_general", "_fused_metadata_kernel_ps1_no_swa") if hasattr(fa, n)}

    def info(self) -> dict:
        return {"replay kernels in Triton's interpreter": self.kernels}

    def run(self, job: dict) -> dict:
        """``{(phase, step): fields}`` for one job (``cases.Job.inputs``)."""
        P, N, Sd, mode = job["page_size"], job["num_draft_tokens"], job["num_steps"], job["mode"]
        if mode not in self.modes:
            raise ValueError(f"this code is not compared on {mode!r}")
        sa = _server_args(self.ServerArgs, page_size=P, speculative_algorithm="EAGLE",
                          speculative_eagle_topk=job.get("topk", 1), speculative_num_steps=Sd,
                          speculative_num_draft_tokens=N, device="cpu", attention_backend="fa3")
        if mode.startswith("tree_"):
            from refspec.conformance.upstream_tree import run_legacy
            return run_legacy(self, job, sa)
        self.publish(sa)
        R = job["req_to_token"]
        rows = NS(req_to_token=R, size=R.shape[0] - 1)
        mr = NS(server_args=sa, sliding_window_size=None,
                model_config=uc.model_config(job["context_len"], self.arch.MHA),
                device="cpu", req_to_token_pool=rows, token_to_kv_pool=uc.KVPoolStub(), kv_cache_dtype=None,
                page_size=P, attn_cp_size=1, tp_size=1, attention_chunk_size=None,
                is_hybrid=False, is_hybrid_swa=False)  # (<= 0.5.5: is_hybrid, 0.5.6: is_hybrid_swa)
        multi = mode == "draft_decode"
        be = self.fa.FlashAttentionMultiStepBackend(mr, topk=1, speculative_num_steps=Sd) if multi else \
            self.fa.FlashAttentionBackend(mr)
        steps = uc.draft_steps(be, Sd) if multi else [(None, be)]

        def fb(phase):
            b = uc.forward_batch(self.FM, mode, job[phase], N, req_to_token_pool=rows)
            b.spec_info = self.typed(b.spec_info, mode)
            return b

        be.init_forward_metadata(fb("eager"))
        out = {("eager", s): uc.fields(b.forward_metadata) for s, b in steps}
        if "bs" not in job:
            return out
        try:
            self._graph(be, multi, job, fb, steps, out)
        except Exception as e:  # noqa: BLE001 -- that phase's own upstream error; the earlier phases' results stand
            from refspec.conformance.worker import describe

            out.update({(ph, s): describe(e) for ph in ("capture", "replay") for s, _ in steps
                        if (ph, s) not in out})
        return out

    def typed(self, ns, mode: str):
        """``spec_info`` as an instance of upstream's own class (``EagleDraftInput`` /
        ``EagleVerifyInput``) where the backend module names one: the 0.4.x multi-step capture
        asserts ``isinstance(forward_batch.spec_info, EagleDraftInput)``.  Only the namespace's
        fields are set (no ``__init__``: its other fields keep their class defaults)."""
        if ns is not None and mode == "draft_extend" and self.accept_length:
            # the names before the rename to num_accept_tokens (MD-009 lists it): at draft extend the device
            # ``accept_length`` already holds n + 1 (``self.accept_length.add_(1)``), the host list
            # ``accept_length_cpu`` still n (``extend_lens = [x + 1 for x in accept_length_cpu]``):
            # EagleDraftInput.prepare_extend_after_decode, v0.5.1 speculative/eagle_utils.py#L130-L138
            ns.accept_length = ns.num_accept_tokens
            ns.accept_length_cpu = [int(x) - 1 for x in ns.num_accept_tokens_cpu]
        cls = getattr(self.fa, "EagleDraftInput" if mode in uc.DRAFT_MODES else "EagleVerifyInput", None)
        if ns is None or not isinstance(cls, type):
            return ns
        obj = cls.__new__(cls)
        obj.__dict__.update(vars(ns))
        return obj

    def _graph(self, be, multi, job, fb, steps, out) -> None:
        """Capture then replay (legacy hooks), each phase's fields into ``out``."""
        bs = job["bs"]
        call(be.init_cuda_graph_state, max_bs=bs, max_num_tokens=job["capture"]["num_tokens"])  # (0.4.x: max_bs)
        cap, rep = fb("capture"), fb("replay")
        if multi:
            be.init_forward_metadata_capture_cuda_graph(cap)
        else:
            call(be.init_forward_metadata_capture_cuda_graph, bs=bs, num_tokens=job["capture"]["num_tokens"],
                 req_pool_indices=cap.req_pool_indices, seq_lens=cap.seq_lens, encoder_lens=None,
                 forward_mode=cap.forward_mode, spec_info=cap.spec_info)
        out.update({("capture", s): _built(b, "capture") for s, b in steps})
        if multi:
            be.init_forward_metadata_replay_cuda_graph(rep, bs)
        else:
            call(be.init_forward_metadata_replay_cuda_graph, bs=bs, req_pool_indices=rep.req_pool_indices,
                 seq_lens=rep.seq_lens, seq_lens_sum=rep.seq_lens_sum, encoder_lens=None,
                 forward_mode=rep.forward_mode, spec_info=rep.spec_info, seq_lens_cpu=rep.seq_lens_cpu,
                 out_cache_loc=rep.out_cache_loc)
        out.update({("replay", s): _built(b, "replay") for s, b in steps})
