"""The shared base of the adapters (worker subprocess only): what every SGLang release needs to
import and run on a CPU, and :class:`Adapter`, the base class of the one adapter per API shape
(:mod:`refspec.conformance.upstream_graph`: the out-of-graph / in-graph hooks;
:mod:`refspec.conformance.upstream_legacy`: the legacy capture / replay hooks).  An adapter
module imports only this module (and :mod:`refspec.conformance.upstream_tree`, the top-k > 1
helpers both shapes share), never another adapter.

Nothing here imports refspec's production code: the worker sees refspec only through the plain
tensors of :mod:`refspec.conformance.cases` jobs.  Upstream's own objects are used wherever the
metadata path reads them (``ForwardMode``, ``AttentionArch``, ``ServerArgs``, the backends and
their Triton replay kernels, run by Triton's interpreter: ``TRITON_INTERPRET=1``); the
``ForwardBatch``, ``spec_info`` and model runner are namespaces carrying exactly the fields the
metadata path reads, as upstream's own ``build_inner_fb_view`` does.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import traceback
from types import SimpleNamespace as NS

import torch

from refspec.conformance import lines, reach, stubs
from refspec.conformance.recorder import Recorder, installed

#: top-level packages imported somewhere on the import chain but never called on this path
ABSENT = ("orjson", "psutil", "pybase64", "requests", "PIL", "starlette", "zmq", "tqdm", "IPython", "aiohttp",
          "transformers", "torchvision", "tvm_ffi", "huggingface_hub", "sentencepiece", "safetensors",
          "compressed_tensors", "regex", "gguf", "openai", "partial_json_parser", "einops", "sgl_kernel",
          "flash_attn_interface",  # 0.4.4.x: the FA3 kernels, imported by the backend, never called here
          # the server stack older releases import at module level (0.4.6 .. 0.5.x ``srt/utils.py``: fastapi, ...)
          "fastapi", "uvicorn", "uvloop", "setproctitle", "interegular", "outlines", "xgrammar", "llguidance", "decord",
          "jinja2", "jsonschema", "httpx", "urllib3", "grpc", "grpc_health", "grpc_reflection", "polars", "google",
          "openai_harmony", "filelock")  # not vllm as a whole: see VLLM_IMPORTS
#: the single ``vllm`` import statements stubbed (:func:`stubs.for_importers`), by importing module:
#: the unguarded non-CUDA fallbacks of 0.4.x .. 0.5.3 (``layers/layernorm.py`` /
#: ``layers/activation.py``: vllm's RMSNorm / SiluAndMul; 0.4.x ``layers/rotary_embedding.py``,
#: ``layers/quantization/{fp8,utils}.py``, ``compressed_tensors_moe.py``, ``moe/fused_moe_triton/fused_moe.py``,
#: ``moe/ep_moe/layer.py``: ``from vllm import _custom_ops`` / ``from vllm._custom_ops import ...``), never
#: called on the metadata path.
#: Every other ``vllm`` import still finds no vllm, so a probe keeps its ImportError path (e.g.
#: ``layers/quantization/__init__.py``'s ``try: from vllm... except ImportError``, 0.4.x
#: ``fp8_utils.py``'s ``try: import vllm``, 0.5.x ``marlin_utils.py``)
_L = "sglang.srt.layers."
_OPS = {"vllm._custom_ops", "vllm._custom_ops.*"}  # (also ``from vllm._custom_ops import scaled_fp8_quant``)
VLLM_IMPORTS = {
    _L + "layernorm": {"vllm.model_executor.layers.layernorm.RMSNorm",
                       "vllm.model_executor.layers.layernorm.GemmaRMSNorm"},
    _L + "activation": {"vllm.model_executor.layers.activation.SiluAndMul",
                        "vllm.model_executor.layers.activation.GeluAndMul"},
    **{_L + m: _OPS for m in ("rotary_embedding", "quantization.fp8", "quantization.utils",
                              "quantization.compressed_tensors.compressed_tensors_moe",
                              "moe.fused_moe_triton.fused_moe", "moe.ep_moe.layer")},
}
#: sglang modules whose class bodies need the real pydantic / openai types; never imported by
#: the metadata path itself, only pulled in through ``sglang.srt.server_args``'s imports
REPLACED = ("sglang.srt.entrypoints.openai.protocol", "sglang.srt.parser.reasoning_parser")
#: names ``FlashAttentionBackend.__init__`` imports from ``sgl_kernel.flash_attn`` (stored,
#: never called while building metadata).  ``get_scheduler_metadata = None`` switches off FA3's
#: scheduler-metadata precompute, which would call the kernel library.
KERNEL_NAMES = ("flash_attn_varlen_func", "flash_attn_with_kvcache")


class SchedulerMetadata(Recorder):
    """``sgl_kernel.flash_attn.get_scheduler_metadata`` (FA3's scheduler-metadata precompute,
    sglang#21104): records each call's arguments and returns a *marker* vector instead of calling
    the kernel library: int32, ``1 + round_up(batch_size, 4) * 4`` entries (the size of FA3's
    metadata for a causal decode, as upstream sizes its graph buffer), every entry
    ``MARK + the call's index``.  Whatever upstream then hands the kernel as
    ``scheduler_metadata`` (the returned tensor, or the graph buffer it copied it into) names the
    call that produced it (:func:`refspec.conformance.compare.compare_kernel` checks that call's
    arguments against the kernel call's).  :meth:`reset` per job."""

    MARK = 1_000_000

    def __init__(self):
        super().__init__("get_scheduler_metadata", forward=self._marker)

    def _marker(self, **a):
        n = 1 + -(-int(a["batch_size"]) // 4) * 4
        return torch.full((n,), self.MARK + len(self.calls) - 1, dtype=torch.int32)

    def reset(self) -> None:
        self.calls = []


#: the one scheduler-metadata recorder of this worker (bound as ``get_scheduler_metadata``)
SCHEDULER = SchedulerMetadata()
RUNTIME_SETTINGS = {"sgl_kernel.flash_attn.get_scheduler_metadata": SCHEDULER}
DRAFT_MODES = ("draft_decode", "draft_extend", "draft_extend_v2")


def prepare(site: str) -> None:
    """Stubs in, ``sglang/__init__`` skipped (it patches Hugging Face and imports the frontend
    language; its submodules still load from ``site``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (replay kernels run "
                           "in Triton's interpreter on CPU)")
    stubs.install(ABSENT)
    stubs.for_importers(VLLM_IMPORTS)
    _old_release_shims()
    stubs.bare_package("sglang", os.path.join(site, "sglang"))
    for name in REPLACED:
        stubs.replace_module(name)


def module_name(rel: str) -> str:
    """``sglang/kernels/ops/attention/metadata.py`` -> ``sglang.kernels.ops.attention.metadata``."""
    return rel[:-len(".py")].replace("/", ".")


def revert_fix() -> str | None:
    """Revert the upstream fix named by ``REFSPEC_REVERT_FIX`` (a PR number) the way upstream does it:
    ``sglang.srt.debug_utils.pr_fix_toggle._revert_pr_fix`` rewrites each patched function's source
    from its registered YAML edits and swaps its ``__code__`` (what ``SGLANG_DEBUG_REVERT_PR`` does in
    the scheduler).  Returns the name, or None when none is asked for."""
    name = os.environ.get("REFSPEC_REVERT_FIX")
    if not name:
        return None
    from sglang.srt.debug_utils.pr_fix_toggle import _revert_pr_fix

    _revert_pr_fix(int(name))
    return name


def _old_release_shims() -> None:
    """Names older releases read at import time from an older torch / triton than the worker's
    (never on the metadata path): ``triton.runtime.cache.default_cache_dir`` / ``default_dump_dir``
    / ``default_override_dir`` (<= 0.4.x ``srt/utils.py``, cache paths) and
    ``torch._C._cpu._is_amx_tile_supported`` (0.4.9 .. 0.5.x ``cpu_has_amx_support()``, the Intel
    AMX probe: False here)."""
    import triton.runtime.cache as cache

    for name in ("cache", "dump", "override"):
        if not hasattr(cache, f"default_{name}_dir"):
            setattr(cache, f"default_{name}_dir", lambda n=name: os.path.join(os.path.expanduser("~"), ".triton", n))
    if not hasattr(torch._C._cpu, "_is_amx_tile_supported"):
        torch._C._cpu._is_amx_tile_supported = lambda: False


def finish_imports() -> None:
    """Revert the asked-for upstream fix (:func:`revert_fix`), bind the run-time names, then arm the
    stubs (any later use raises ``StubUsed``)."""
    revert_fix()
    for name in KERNEL_NAMES:
        stubs.provide("sgl_kernel.flash_attn", name)
    for dotted, value in RUNTIME_SETTINGS.items():
        module, _, name = dotted.rpartition(".")
        __import__(module)
        import sys
        sys.modules[module].__dict__[name] = value
    stubs.arm()


def interpreted(fn) -> bool:
    """Whether a ``@triton.jit`` kernel runs in Triton's interpreter (not replaced, not compiled)."""
    return type(fn).__name__ == "InterpretedFunction"


def model_config(context_len: int, attention_arch):
    return NS(is_encoder_decoder=False, context_len=context_len, attention_arch=attention_arch,
              is_local_attention_model=False, head_dim=8, hf_text_config=NS(num_attention_heads=1),
              get_num_kv_heads=lambda tp: 1)


class AdapterGap(AttributeError):
    """Upstream read something refspec's adapter does not lay out (an attribute of one of its
    stand-in objects): no rule broken; refspec cannot drive this code yet.  An AttributeError, so
    that upstream's own probes (``getattr(x, name, None)``, ``hasattr``) keep their meaning."""


def _gap(self, name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    raise AdapterGap(f"upstream reads {object.__getattribute__(self, '_what')}.{name}, which refspec's adapter "
                     f"does not lay out")


class Given(NS):
    """A namespace standing in for one of upstream's objects (``ForwardBatch``, ``spec_info``, the
    model runner, the KV pool, the layer), carrying the fields upstream reads; reading any other
    raises :class:`AdapterGap` naming the object (``what``) and the attribute."""

    def __init__(self, what: str, **fields):
        super().__init__(**fields)
        object.__setattr__(self, "_what", what)

    __getattr__ = _gap


@functools.lru_cache(maxsize=None)
def given_class(cls, what: str):
    """A subclass of upstream's class ``cls`` (``EagleDraftInput``, ...) whose instances raise
    :class:`AdapterGap` for an attribute neither they nor the class carry (isinstance checks hold)."""
    return type(cls.__name__, (cls,), {"__getattr__": _gap, "_what": what})


class KVPoolStub(Given):
    """``token_to_kv_pool``: a plain object (not an SWA / interleaved pool).  The forward path
    (:func:`kernel_calls`) reads its buffers: ``get_kv_buffer`` / ``get_key_buffer`` /
    ``get_value_buffer`` return zeros ``[slots, Hkv = 1, D = 8]`` (float32; the slots of
    ``req_to_token``, rounded up to whole pages), and ``set_kv_buffer`` is recorded, never stored."""

    def __init__(self, slots: int = 0, page_size: int = 1):
        n = max(page_size, -(-int(slots) // page_size) * page_size)
        super().__init__("token_to_kv_pool", stored=[], k=torch.zeros(n, HKV, HEAD_DIM),
                         v=torch.zeros(n, HKV, HEAD_DIM))

    def get_kv_buffer(self, layer_id):
        return self.k, self.v

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v

    def set_kv_buffer(self, *args, **kwargs):
        self.stored.append((args, kwargs))


#: the attention layer both sides run (upstream's ``RadixAttention`` constants; refspec's
#: ``AttentionLayer(layer_id=0, num_heads=1, num_kv_heads=1, head_dim=8)``): the model config's
#: one head of dimension 8 (:func:`model_config`), the default softmax scale, no softcap, no window
HEADS, HKV, HEAD_DIM = 1, 1, 8
SCALE = HEAD_DIM ** -0.5


def layer(fa):
    """The ``RadixAttention`` stand-in upstream's forward reads (:data:`HEADS` ...); ``attn_type``
    upstream's ``AttentionType.DECODER`` where the backend module names the enum."""
    kind = getattr(fa, "AttentionType", None)
    extra = {"attn_type": kind.DECODER} if kind is not None and hasattr(kind, "DECODER") else {}
    return Given("layer", layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=HKV, tp_v_head_num=HKV, head_dim=HEAD_DIM,
                 qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, scaling=SCALE, logit_cap=0.0, sliding_window_size=-1,
                 is_cross_attention=False, k_scale=None, v_scale=None, k_scale_float=None, v_scale_float=None,
                 **extra)


#: the kernel globals of upstream's backend module a forward may call (the recorder stands in for each)
FORWARD_KERNELS = ("flash_attn_with_kvcache", "flash_attn_varlen_func", "merge_state_v2")


def kernel_calls(fa, be, fb, rows: int) -> list:
    """Run upstream's forward (``be.forward``: the base backend's dispatch to ``forward_decode`` /
    ``forward_extend`` by ``fb.forward_mode``) on ``rows`` query tokens of zeros, no new K/V, with a
    :class:`~refspec.conformance.recorder.Recorder` in place of each kernel global of ``fa`` (every
    global named after a kernel of :data:`FORWARD_KERNELS`, aliases included, and the backend's
    ``self.flash_attn_*`` attributes); returns the recorded
    :class:`~refspec.conformance.recorder.Call` s in call order (their live tensor references kept:
    :meth:`~refspec.conformance.recorder.Call.reread`).  Line tracing is paused meanwhile (a
    forward's lines are not the metadata's).  Raises whatever upstream raises."""
    recs = {}  # every global naming a kernel (0.5.9: flash_attn_with_kvcache_fa3 / _base aliases), and the kernels
    for name, value in list(fa.__dict__.items()):
        kernel = next((k for k in FORWARD_KERNELS if name == k or name.startswith(k + "_")), None)
        if kernel is not None:
            recs[name] = Recorder(kernel, original=value)
    for k in FORWARD_KERNELS:
        recs.setdefault(k, Recorder(k))
    q = torch.zeros(rows, HEADS, HEAD_DIM)
    with lines.paused(), installed(fa, recs, objects=(be,)):
        be.forward(q, None, None, layer(fa), fb)
    return sorted((c for r in recs.values() for c in r.calls), key=lambda c: c.order)


def spec_info(mode: str, d: dict, num_draft_tokens: int, accept: dict | None = None):
    """The ``spec_info`` namespace of ``mode`` (None for the non-speculative modes).

    DRAFT_EXTEND_V2 carries ``extend_seq_lens_tensor`` / ``extend_seq_lens_cpu`` as upstream's
    draft-extend graph runner sets them (``eagle_draft_extend_cuda_graph_runner.py`` replay).
    DRAFT_EXTEND (v1) carries the accepted counts a = n + 1 under the names and in the layout of
    the release's own worker (``accept``: :func:`refspec.conformance.install.accept_layout`; the
    device field a, the host list a, or n where that worker keeps n there); without a layout, none
    (a backend that reads one is then an adapter gap, never a guess).
    """
    if mode in ("decode", "extend", "extend_prefix", "idle"):
        return None
    draft = mode in DRAFT_MODES
    ns = Given("spec_info", is_draft_input=lambda: draft, positions=d["positions"], custom_mask=None,
               ragged_verify_layout=None,
               num_tokens_per_req={"draft_decode": 1, "verify": num_draft_tokens}.get(mode, num_draft_tokens))
    if mode == "verify":
        ns.draft_token_num = num_draft_tokens  # (EagleVerifyInput's field; 0.4.5 reads it on the verify path)
    if mode == "draft_extend" and accept:
        a = d["num_accept_tokens"]
        setattr(ns, accept["device"], a)
        setattr(ns, accept["host"], [int(x) - int(accept["host_is_n"]) for x in d["num_accept_tokens_cpu"]])
    if mode == "draft_extend_v2":
        ns.extend_seq_lens_tensor, ns.extend_seq_lens_cpu = d["extend_seq_lens"], d["extend_seq_lens_cpu"]
    return ns


def forward_batch(FM, mode: str, d: dict, num_draft_tokens: int, accept: dict | None = None, **extra):
    """A ``ForwardBatch`` namespace from a job's batch dict ``d`` (``cases.snapshot_batch``);
    ``accept``: the release's accept-length layout (:func:`spec_info`)."""
    seq_cpu = d["seq_lens_cpu"]  # None: no CPU mirror (cases.without_mirrors); seq_lens_sum None with it
    ext_cpu = d["extend_seq_lens_cpu"]
    prefix_cpu = None
    if mode in ("extend", "extend_prefix", "draft_extend", "draft_extend_v2") and ext_cpu is not None:
        prefix_cpu = [int(s) - int(e) for s, e in zip(seq_cpu.tolist(), ext_cpu)]
    return Given("forward_batch", forward_mode=FM[d["forward_mode"]], batch_size=int(d["req_pool_indices"].numel()),
                 req_pool_indices=d["req_pool_indices"], seq_lens=d["seq_lens"], seq_lens_cpu=seq_cpu,
                 seq_lens_sum=None if seq_cpu is None else int(seq_cpu.sum()), extend_seq_lens=d["extend_seq_lens"],
                 extend_seq_lens_cpu=ext_cpu,
                 extend_prefix_lens_cpu=prefix_cpu, encoder_lens=None,
                 # (0.4.4.x reads the device tensor; ForwardBatch.init_new: int32, like extend_seq_lens)
                 extend_prefix_lens=None if prefix_cpu is None else torch.tensor(prefix_cpu, dtype=torch.int32),
                 out_cache_loc=d["out_cache_loc"],
                 positions=d["positions"], kv_loc_plan=None, kv_loc_cols=None, attn_cp_metadata=None,
                 spec_info=spec_info(mode, d, num_draft_tokens, accept), **extra)


def into_static(static: dict, live: dict) -> dict:
    """The replay batch as a CUDA-graph runner hands it over: the capture batch's own tensors (its
    static buffers, which the capture hook may have bound into the metadata, and the captured
    kernel call reads) with the replay's values copied into them in place; any other field (a
    scalar, a list, a tensor of another shape or dtype) the replay's own.  ``static`` is changed."""
    out = {}
    for k, v in live.items():
        s = static.get(k)
        if isinstance(v, torch.Tensor) and isinstance(s, torch.Tensor) and s.shape == v.shape and s.dtype == v.dtype:
            s.copy_(v)
            out[k] = s
        else:
            out[k] = v
    return out


def draft_steps(multi, num_steps: int) -> list:
    """``[(s, backend)]`` of the draft steps a ``FlashAttentionMultiStepBackend`` builds metadata
    for: its hooks loop over ``range(speculative_num_steps - 1)``; older releases (0.4.5 .. 0.5.3 read) also make
    an ``attn_backends[S - 1]`` that no hook ever initialises (its ``forward_metadata`` stays None)."""
    return list(enumerate(multi.attn_backends[:num_steps - 1]))


def fields(md) -> dict:
    """Copies of the metadata fields the comparison reads (upstream ``FlashAttentionMetadata``);
    marks the end of the phase's executed lines (:func:`refspec.conformance.lines.mark`)."""
    from refspec.conformance.lines import mark

    out = {}
    for f in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "max_seq_len_q", "max_seq_len_k", "page_table"):
        x = getattr(md, f)
        out[f] = x.clone() if isinstance(x, torch.Tensor) else (None if x is None else int(x))
    return mark(out)


def legacy_hook(be, phase: str, fb, bs: int, num_tokens: int, multi: bool) -> None:
    """Run the legacy graph hook of ``phase`` (``init_forward_metadata_capture_cuda_graph`` or
    ``init_forward_metadata_replay_cuda_graph``) on ``fb`` as SGLang's ``cuda_graph_runner`` calls it:
    the multi-step draft backend takes ``(fb, bs)`` / ``(fb)``, the backend the keyword arguments its
    signature names (:func:`call`; older releases take fewer)."""
    if phase == "capture":
        if multi:
            be.init_forward_metadata_capture_cuda_graph(fb)
        else:
            call(be.init_forward_metadata_capture_cuda_graph, bs=bs, num_tokens=num_tokens,
                 req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens, encoder_lens=None,
                 forward_mode=fb.forward_mode, spec_info=fb.spec_info)
    elif multi:
        be.init_forward_metadata_replay_cuda_graph(fb, bs)
    else:
        call(be.init_forward_metadata_replay_cuda_graph, bs=bs, req_pool_indices=fb.req_pool_indices,
             seq_lens=fb.seq_lens, seq_lens_sum=fb.seq_lens_sum, encoder_lens=None,
             forward_mode=fb.forward_mode, spec_info=fb.spec_info, seq_lens_cpu=fb.seq_lens_cpu,
             out_cache_loc=fb.out_cache_loc)


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


def server_args_from_defaults(ServerArgs, **over):
    """A ``ServerArgs`` dataclass with its field defaults and ``over`` set (no ``__post_init__``:
    that validates a model path and probes the GPU; the release's own guards on the speculative
    fields are evaluated by :mod:`refspec.conformance.reach`).  AttributeError for a field the
    release does not have."""
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


FA = "sglang/srt/layers/attention/flashattention_backend.py"
#: the backend methods that build a phase's metadata: an exception's row also cites the innermost of them
HOOKS = ("init_forward_metadata", "_apply_cuda_graph_metadata", "_init_full_cg_decode_metadata",
         "_set_decode_page_metadata", "stage_draft_extend_metadata")


#: the checkout holding refspec: its own files are named relative to it in a result's text (never a local path)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rel(name: str) -> str:
    """An upstream file relative to the folder holding ``sglang/``; one of refspec's relative to the
    checkout (``refspec/conformance/upstream_mla.py``); any other as it is."""
    i = name.rfind("/sglang/")
    if i >= 0:
        return name[i + 1:]
    if os.path.abspath(name).startswith(os.path.join(REPO, "refspec") + os.sep):
        return os.path.relpath(os.path.abspath(name), REPO)
    return name


def _ours(name: str) -> bool:
    return _rel(name).startswith("refspec" + os.sep)


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost upstream frame, and ``(run from flashattention_backend.py:N)``
    when that frame is not itself the innermost backend hook (:data:`HOOKS`, or any
    ``init_forward_metadata*``) that ran it: the hook's line.  With no upstream frame, the innermost
    frame of refspec's own code (named relative to the checkout)."""
    tb = list(traceback.walk_tb(exc.__traceback__))
    frames = [(f, n) for f, n in tb if "/sglang/" in f.f_code.co_filename] or \
        [(f, n) for f, n in tb if _ours(f.f_code.co_filename)] or tb
    f, n = frames[-1]
    at = f"{_rel(f.f_code.co_filename)}:{n}"
    hook = next(((g, m) for g, m in reversed(frames) if _rel(g.f_code.co_filename) == FA and
                 g.f_code.co_name.startswith(HOOKS)), None)
    if hook is not None and hook[0] is not f:
        at += f" (run from {FA.rsplit('/', 1)[-1]}:{hook[1]})"
    return at


def describe(exc: BaseException) -> str:
    """``Type at file:line: message`` of an upstream exception (the text a result row carries);
    ``Type at file:line (run from flashattention_backend.py:N): message`` when it was raised in a
    helper or kernel the backend's metadata hook called (:func:`_where`).  An exception no upstream
    frame raised or ran into (refspec's adapter itself failing, e.g. an ``AttributeError`` on a
    module of a release it does not lay out) is an adapter gap, worded so:
    ``AdapterGap at refspec/conformance/x.py:N: refspec's adapter raised AttributeError: ...``
    (``report.is_gap``; the path relative to the checkout)."""
    where = _where(exc)
    if where.startswith("refspec" + os.sep) and not isinstance(exc, AdapterGap) and \
            type(exc).__name__ != "StubUsed":
        return f"AdapterGap at {where}: refspec's adapter raised {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__} at {where}: {exc}"


class Adapter:
    """The shared base of the adapters, one per API shape (module doc).

    The worker builds one per target (``Upstream(site, shape)``) and calls :meth:`run` per job.
    Here: the imports every shape needs (the backend module ``fa``, ``ForwardMode``,
    ``AttentionArch``, ``server_args``), the stubs armed after the subclass's own imports
    (:meth:`_imports`), the server args of a job (:meth:`server_args`), and :meth:`run`, which
    hands a job to the subclass's :meth:`run_flat` (top-k = 1) or :meth:`run_tree` (top-k > 1).
    """

    def __init__(self, site: str, shape):
        prepare(site)
        self.site, self.shape, self.modes = site, shape, shape.modes
        # the model config first, as the server imports it before any attention backend: it imports
        # layers/quantization, whose 0.4.5 __init__ imports vocab_parallel_embedding back (a circular
        # import when the backend's chain reaches vocab_parallel_embedding first)
        from sglang.srt.configs.model_config import AttentionArch
        import sglang.srt.layers.attention.flashattention_backend as fa
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        import sglang.srt.server_args as server_args

        self.fa, self.FM, self.arch, self.server_args_module = fa, ForwardMode, AttentionArch, server_args
        self.ServerArgs = server_args.ServerArgs
        # older releases read the server args from the model runner only (no global to publish)
        self.publish = getattr(server_args, "set_global_server_args_for_scheduler", lambda sa: None)
        try:  # newer releases guard the speculative fields in hooks (reach.HOOKS): their module globals
            import sglang.srt.arg_groups.speculative_hook as hooks
        except Exception:  # noqa: BLE001 -- absent (older releases) or not importable here: guards then undetermined
            hooks = None
        self.hooks_module = hooks
        self.undetermined: set[str] = set()
        self._imports()
        from refspec.conformance.upstream_mla import MLAUpstream  # (it imports this module)

        self.mla = MLAUpstream(self)  # the MLA forward path's imports, before the stubs are armed
        finish_imports()

    def guard_globals(self) -> dict:
        """The module globals the release's guards read (:func:`refspec.conformance.reach.verdict`)."""
        out = {reach.SERVER_ARGS: vars(self.server_args_module)}
        if self.hooks_module is not None:
            out[reach.HOOKS] = vars(self.hooks_module)
        return out

    def _imports(self) -> None:
        """The subclass's own imports, done before the stubs are armed."""

    def fb(self, mode: str, d: dict, N: int, **extra):
        """A ``ForwardBatch`` namespace of batch ``d`` (:func:`forward_batch`), its ``spec_info`` laid
        out as this release's worker lays it out (the shape's accept-length layout)."""
        return forward_batch(self.FM, mode, d, N, self.shape.accept, **extra)

    def info(self) -> dict:
        return {}

    @staticmethod
    def overrides(job: dict) -> dict:
        """The ``ServerArgs`` fields a job sets (EAGLE, FA3, on the CPU)."""
        return dict(page_size=job["page_size"], speculative_algorithm="EAGLE",
                    speculative_eagle_topk=job.get("topk", 1), speculative_num_steps=job["num_steps"],
                    speculative_num_draft_tokens=job["num_draft_tokens"], device="cpu", attention_backend="fa3")

    @contextlib.contextmanager
    def server_args(self, job: dict):
        """The job's ``ServerArgs`` (:func:`server_args_from_defaults`), published where the release
        publishes one; a subclass may install it its release's own way."""
        sa = server_args_from_defaults(self.ServerArgs, **self.overrides(job))
        self.publish(sa)
        yield sa

    def run(self, job: dict) -> dict:
        """``{(phase, step): fields}`` for one job (``cases.Job.inputs``)."""
        mode = job["mode"]
        base = mode.removeprefix(MLA_PREFIX)  # an MLA mode: its base mode's batch through the MLA forward path
        if base not in self.modes:
            raise ValueError(f"this code is not compared on {mode!r}")
        if base in self.shape.gaps:  # refspec cannot lay out this mode's inputs the way this release does
            raise AdapterGap(self.shape.gaps[base])
        SCHEDULER.reset()
        with self.server_args(job) as sa:
            why, undetermined = reach.verdict(self.site, sa, self.guard_globals())
            self.undetermined.update(undetermined)
            if why:  # the release's own guards refuse or rewrite this configuration: nothing to compare
                return {UNREACHABLE: why}
            out = self.mla.run(job, sa) if base != mode else self.run_tree(job, sa) if mode.startswith("tree_") else \
                self.run_flat(job, sa)
        if SCHEDULER.calls:  # the job's get_scheduler_metadata calls (their markers name them)
            out[SCHED_KEY] = [c.plain() for c in SCHEDULER.calls]
        return out

    def run_flat(self, job: dict, sa) -> dict:
        raise NotImplementedError

    def kernel(self, be, fb, rows: int):
        """Upstream's kernel calls for a forward of ``be`` on ``fb`` (:func:`kernel_calls`), or the
        text of what it raised (:func:`describe`: an :class:`AdapterGap` says so)."""
        try:
            return kernel_calls(self.fa, be, fb, rows)
        except Exception as e:  # noqa: BLE001 -- this forward's own result; the metadata stands
            return describe(e)

    def run_tree(self, job: dict, sa) -> dict:
        raise NotImplementedError


#: the prefix of an MLA mode (``mla_decode``, ...): the base mode's batch through the MLA forward path
MLA_PREFIX = "mla_"
#: the key of a job's result when the release's own guards refuse or rewrite its configuration (``run.UNREACHABLE``)
UNREACHABLE = "unreachable"
#: the key of a job's result holding its ``get_scheduler_metadata`` calls (``compare.SCHED_KEY``)
SCHED_KEY = ("scheduler_metadata", None)
#: the key of a result's fields dict that carries the kernel calls of its forward (a list of
#: :meth:`~refspec.conformance.recorder.Call.plain` dicts), or the text of what the forward raised
KERNEL = "kernel_calls"
#: the modes whose forward is run for its kernel arguments (top-k = 1; IDLE runs no kernel)
KERNEL_MODES = ("decode", "extend", "extend_prefix", "verify", "draft_decode", "draft_extend", "draft_extend_v2")


def query_rows(mode: str, d: dict) -> int:
    """The query tokens of a forward on batch ``d``: one per request for a draft-decode step, else
    every position of the batch (its ``positions``: decode B, verify / draft extend v2 B * N,
    extend and v1 draft extend the packed lengths; a graph's static batch bs * W)."""
    return int(d["req_pool_indices"].numel()) if mode == "draft_decode" else int(d["positions"].numel())


def attach(res: dict, calls) -> dict:
    """``res`` (a phase's fields) with its kernel calls under :data:`KERNEL` (plain dicts), or the
    forward's error text."""
    res[KERNEL] = calls if isinstance(calls, str) else [c.plain() for c in calls]
    return res


def frozen(captured, fresh):
    """The kernel calls a graph-hooks replay hands the kernel: the *fresh* calls' tensors (the
    in-graph hook re-runs at replay as the graph's own operations, into the buffers it captured)
    with the *captured* calls' scalars (a graph freezes every non-tensor argument at capture);
    an error text of either side as it is."""
    if isinstance(captured, str) or isinstance(fresh, str) or len(captured) != len(fresh):
        return fresh if isinstance(captured, list) or isinstance(fresh, str) else captured
    out = []
    for c, f in zip(captured, fresh):
        args = {k: (v if isinstance(v, dict) and "tensor" in v else c.args.get(k, v)) for k, v in f.args.items()}
        out.append(type(f)(f.name, args, f.where, {}, f.order))
    return out
