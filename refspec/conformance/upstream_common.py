"""What both pinned SGLang releases need to import and run on a CPU (worker subprocess only).

Nothing here imports refspec's production code: the worker sees refspec only through the plain
tensors of :mod:`refspec.conformance.cases` jobs.  Upstream's own objects are used wherever the
metadata path reads them (``ForwardMode``, ``AttentionArch``, ``ServerArgs``, the backends and
their Triton replay kernels, run by Triton's interpreter: ``TRITON_INTERPRET=1``); the
``ForwardBatch``, ``spec_info`` and model runner are namespaces carrying exactly the fields the
metadata path reads, as upstream's own ``build_inner_fb_view`` does.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import os
from types import SimpleNamespace as NS

import torch

from refspec.conformance import stubs

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
RUNTIME_SETTINGS = {"sgl_kernel.flash_attn.get_scheduler_metadata": None}
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


class KVPoolStub:
    """``token_to_kv_pool``: a plain object (not an SWA / interleaved pool); never read for data."""


def spec_info(mode: str, d: dict, num_draft_tokens: int):
    """The ``spec_info`` namespace of ``mode`` (None for the non-speculative modes).

    DRAFT_EXTEND_V2 carries ``extend_seq_lens_tensor`` / ``extend_seq_lens_cpu`` as upstream's
    draft-extend graph runner sets them (``eagle_draft_extend_cuda_graph_runner.py`` replay).
    """
    if mode in ("decode", "extend", "extend_prefix", "idle"):
        return None
    draft = mode in DRAFT_MODES
    ns = NS(is_draft_input=lambda: draft, positions=d["positions"], custom_mask=None, ragged_verify_layout=None,
            num_tokens_per_req={"draft_decode": 1, "verify": num_draft_tokens}.get(mode, num_draft_tokens))
    if mode == "verify":
        ns.draft_token_num = num_draft_tokens  # (EagleVerifyInput's field; 0.4.5 reads it on the verify path)
    if mode == "draft_extend":
        ns.num_accept_tokens, ns.num_accept_tokens_cpu = d["num_accept_tokens"], d["num_accept_tokens_cpu"]
    if mode == "draft_extend_v2":
        ns.extend_seq_lens_tensor, ns.extend_seq_lens_cpu = d["extend_seq_lens"], d["extend_seq_lens_cpu"]
    return ns


def forward_batch(FM, mode: str, d: dict, num_draft_tokens: int, **extra):
    """A ``ForwardBatch`` namespace from a job's batch dict ``d`` (``cases.snapshot_batch``)."""
    seq_cpu = d["seq_lens_cpu"]  # None: no CPU mirror (cases.without_mirrors); seq_lens_sum None with it
    ext_cpu = d["extend_seq_lens_cpu"]
    prefix_cpu = None
    if mode in ("extend", "extend_prefix", "draft_extend", "draft_extend_v2") and ext_cpu is not None:
        prefix_cpu = [int(s) - int(e) for s, e in zip(seq_cpu.tolist(), ext_cpu)]
    return NS(forward_mode=FM[d["forward_mode"]], batch_size=int(d["req_pool_indices"].numel()),
              req_pool_indices=d["req_pool_indices"], seq_lens=d["seq_lens"], seq_lens_cpu=seq_cpu,
              seq_lens_sum=None if seq_cpu is None else int(seq_cpu.sum()), extend_seq_lens=d["extend_seq_lens"],
              extend_seq_lens_cpu=ext_cpu,
              extend_prefix_lens_cpu=prefix_cpu, encoder_lens=None,
              # (0.4.4.x reads the device tensor; ForwardBatch.init_new: int32, like extend_seq_lens)
              extend_prefix_lens=None if prefix_cpu is None else torch.tensor(prefix_cpu, dtype=torch.int32),
              out_cache_loc=d["out_cache_loc"],
              positions=d["positions"], kv_loc_plan=None, kv_loc_cols=None,
              spec_info=spec_info(mode, d, num_draft_tokens), **extra)


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
