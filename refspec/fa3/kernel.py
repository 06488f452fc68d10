"""The FA3 kernel provider: the real ``flash_attn_with_kvcache`` on Hopper, else the emulator.

One function, :func:`flash_attn_with_kvcache`, with the signature and semantics of FA3's
``flash_attn_interface.flash_attn_with_kvcache`` as SGLang's FA3 backend calls it
(docs/fa3-contract.md):
no new k/v (store-then-attend), paged KV, ``causal=True``.

Providers, picked by :func:`select_provider` for a device (the FA3 backend picks once, at
construction, and passes ``provider=`` on every call):

* ``fa3``: ``flash_attn_interface`` (upstream FA3 hopper build; refspec's GPU runs use the
  stable-ABI ``tokenspeed-fa3`` wheel), for CUDA tensors on an sm_90 device;
* ``sgl_kernel``: ``sgl_kernel.flash_attn`` if that is what is installed;
* ``emulator``: :mod:`refspec.fa3.emulator` (any device), the contract in pure PyTorch.

``REFSPEC_FA3_PROVIDER=emulator|fa3|sgl_kernel`` forces one (an unavailable forced provider
raises ``RuntimeError``).  The emulator refuses contract violations that the real kernel
would silently turn into undefined results (PA-003, PA-010, PA-011).

**MLA** (docs/mla.md): :func:`flash_attn_with_kvcache` takes ``qv`` (ML-005) and
:func:`flash_attn_varlen_func` runs the non-absorbed prefill (ML-010).  Before a real kernel
runs an MLA call, two refusals by rule replace what would otherwise be a silent wrong result:
head dims FA3 has no kernel for (ML-006, :func:`~refspec.fa3.emulator.fa3_dims_problem`, which the
emulator checks too), and a build whose configuration
(``flash_attn_config.py``, written by FA3's ``hopper/setup.py``) lacks the hdim 64 / 512 kernel
or the 192 / 128 one (ML-013; :func:`mla_kernel_problem`).  The ``tokenspeed-fa3`` wheel refspec's
GPU runs use is built with ``FLASH_ATTENTION_DISABLE_HDIMDIFF64`` and ``...HDIMDIFF192``: MLA is
refused there.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from refspec.core.invariants import require
from refspec.fa3.emulator import emulate_flash_attn_varlen_func, emulate_flash_attn_with_kvcache, fa3_dims_problem
from refspec.graphs.capture import recordable


@functools.lru_cache(maxsize=None)
def _real_kernel(name: str, function: str = "flash_attn_with_kvcache"):
    """The real kernel ``function`` of provider ``name``, or the reason it is unavailable (str).

    Raises: ValueError for a name that is no provider at all."""
    modules = {"fa3": "flash_attn_interface", "sgl_kernel": "sgl_kernel.flash_attn"}
    if name not in modules:
        raise ValueError(f"unknown FA3 provider {name!r}: one of 'emulator', {', '.join(map(repr, modules))}")
    module = modules[name]
    try:
        return getattr(importlib.import_module(module), function)
    except Exception as e:  # ImportError, AttributeError, or a broken binary (OSError, RuntimeError)
        return f"`import {module}` failed: {type(e).__name__}: {e}"


# ---- MLA on a real kernel: which head dims and which builds have a kernel (ML-006, ML-013) ----

#: the FA3 build flags (``flash_attn_config.CONFIG["build_flags"]``) that remove a kernel MLA needs:
#: the absorbed paged ``qv`` call (hdim 64 / 512, paged KV) and the prefill (hdim 192 / 128, varlen)
MLA_BUILD_FLAGS = {
    "qv": ("FLASH_ATTENTION_DISABLE_HDIMDIFF64", "FLASHATTENTION_DISABLE_PAGEDKV", "FLASHATTENTION_DISABLE_HDIM64"),
    "prefill": ("FLASH_ATTENTION_DISABLE_HDIMDIFF192", "FLASHATTENTION_DISABLE_VARLEN"),
}


PROVIDERS = ("fa3", "sgl_kernel", "emulator")  #: every provider name (module doc)


def check_provider(provider) -> str:
    """``provider`` if it is one of :data:`PROVIDERS`; ValueError naming it otherwise (a typo must not
    read as "this build has no MLA kernel")."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown FA3 provider {provider!r}: one of {', '.join(map(repr, PROVIDERS))}")
    return provider


@functools.lru_cache(maxsize=None)
def build_flags(provider: str) -> dict | str:
    """The build configuration of ``provider``'s FA3 build (``CONFIG["build_flags"]`` of the
    ``flash_attn_config`` module its ``setup.py`` writes next to ``flash_attn_interface``), or why
    it cannot be read (str): the emulator has none, ``sgl_kernel`` ships none.  Raises ValueError
    for a name that is no provider at all."""
    check_provider(provider)
    if provider != "fa3":
        return f"provider {provider!r} exposes no FA3 build configuration (flash_attn_config.py) to check"
    problems = []
    for module in ("flash_attn_config", "flash_attn_3.flash_attn_config"):
        try:
            return dict(importlib.import_module(module).CONFIG["build_flags"])
        except Exception as e:  # ImportError, or a config without build_flags
            problems.append(f"{module}: {type(e).__name__}: {e}")
    return "no readable FA3 build configuration (" + "; ".join(problems) + ")"


def mla_kernel_problem(provider: str, call: str = "qv") -> str | None:
    """ML-013: None if ``provider`` has the kernel an MLA ``call`` needs ("qv": the absorbed paged
    call, hdim 64 / 512; "prefill": the non-absorbed varlen call, hdim 192 / 128), else why not.

    The emulator always has it.  A real provider has it only if its build configuration is
    readable and leaves the kernel in (:data:`MLA_BUILD_FLAGS` all off); FA3's own ``setup.py``
    writes ``flash_attn_config.py`` with each ``FLASH*_DISABLE_*`` flag (hopper/setup.py L102).
    Raises ValueError for another ``call`` or an unknown ``provider``."""
    if call not in MLA_BUILD_FLAGS:
        raise ValueError(f"call must be one of {sorted(MLA_BUILD_FLAGS)}, got {call!r}")
    if check_provider(provider) == "emulator":
        return None
    flags = build_flags(provider)
    if isinstance(flags, str):
        return flags
    off = [f for f in MLA_BUILD_FLAGS[call] if flags.get(f) in (True, "TRUE", "True", 1)]
    if off:
        flags = ", ".join(f"{f}=TRUE" for f in off)
        return f"the {provider!r} build sets {flags}: it has no kernel for the MLA {call} call"
    return None


def require_mla_kernel(provider: str, call: str = "qv") -> None:
    """:func:`mla_kernel_problem` as a refusal: raises InvariantError ML-013 naming the flag."""
    problem = mla_kernel_problem(provider, call)
    require(problem is None, "ML-013", lambda: f"{problem}; refspec refuses MLA on it instead of computing a wrong "
            "result (see docs/mla.md, the GPU build)")


def hopper_reason(device=None) -> str | None:
    """None if ``device`` (default: current CUDA device) is a Hopper GPU, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    return None if major == 9 else f"GPU is sm_{major}{minor}, FA3 needs Hopper (sm_90)"


def check_graphable(device, provider: str) -> None:
    """CUDA graphs on a CUDA device need a real kernel provider.  The emulator checks its
    metadata on the host (``tolist``), which a stream capture forbids, so capture would fail deep
    inside torch; this says why first.  Raises ValueError naming the provider and why no real
    one was chosen (no Hopper GPU, FA3 not importable, or ``REFSPEC_FA3_PROVIDER``)."""
    if torch.device(device).type != "cuda" or provider != "emulator":
        return
    why = hopper_reason(device) or "; ".join(r for r in (_real_kernel(n) for n in ("fa3", "sgl_kernel"))
                                              if isinstance(r, str))
    if os.environ.get("REFSPEC_FA3_PROVIDER") == "emulator":
        why = "REFSPEC_FA3_PROVIDER=emulator"
    raise ValueError(f"CUDA graphs on {device} need a real FA3 kernel, but the provider is the emulator ({why}): "
                     "install FA3 (`flash_attn_interface`, docs/fa3-contract.md) or run without graphs")


def provider_status() -> dict[str, str]:
    """Each provider -> 'available' or the reason it is not (for ``python -m refspec info``)."""
    status = {}
    for name in ("fa3", "sgl_kernel"):
        k = _real_kernel(name)
        reason = k if isinstance(k, str) else hopper_reason()
        status[name] = "available" if reason is None else reason
    status["emulator"] = "available"
    return status


def select_provider(device: torch.device) -> str:
    """The provider a call on ``device`` uses: forced by env, else the first real one that works."""
    forced = os.environ.get("REFSPEC_FA3_PROVIDER")
    if forced:
        if forced != "emulator":
            k = _real_kernel(forced)
            if isinstance(k, str):
                raise RuntimeError(f"REFSPEC_FA3_PROVIDER={forced} but {k}")
        return forced
    if device.type == "cuda" and hopper_reason(device) is None:
        for name in ("fa3", "sgl_kernel"):
            if not isinstance(_real_kernel(name), str):
                return name
    return "emulator"


def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
                            softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                            return_softmax_lse=False, qv=None, provider: str | None = None):
    """Paged-KV attention, FA3 semantics (docs/fa3-contract.md; PA-004..PA-006).

    Shapes: q ``[T, H, D]`` (fp16/bf16 for the real kernel; the emulator also takes fp32);
    k_cache ``[NP, P, Hkv, D]``, v_cache ``[NP, P, Hkv, Dv]``; cache_seqlens int32 ``[B]`` (K_b,
    tokens, the kernel's ``seqused_k``); page_table int32 ``[B, M]`` (page ids); cu_seqlens_q int32
    ``[B+1]``; max_seqlen_q a Python int; qv ``[T, H, Dv]`` or None (MLA's absorbed ``q_nope``,
    ML-005).  Returns ``[T, H, Dv]`` (and the LSE ``[H, T]`` if asked).

    Semantics: request b's rows ``cu_q[b]..cu_q[b+1]-1`` attend keys ``p < K_b`` with the
    bottom-right causal rule (PA-004); key p is at slot ``page_table[b, p // P] * P + p % P``.
    ``provider`` overrides :func:`select_provider` (tests use it to run both on one GPU).
    Raises (a real provider, before the call): InvariantError ML-006 (head dims with no FA3
    kernel, D != Dv or qv), ML-013 (a qv call on a build without the hdim 64 / 512 kernel);
    InvariantError PA-011 for a ``q`` that is not a tensor; ValueError for an unknown ``provider``.
    """
    require(isinstance(q, torch.Tensor), "PA-011", lambda: f"q must be a torch.Tensor, got {type(q).__name__}")
    provider = check_provider(provider or select_provider(q.device))
    if provider == "emulator":
        return emulate_flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, return_softmax_lse=return_softmax_lse, qv=qv)
    if qv is not None or v_cache.shape[-1] != q.shape[-1]:  # MLA: no silent wrong result (module doc)
        dims = fa3_dims_problem(q.shape[-1], v_cache.shape[-1], qv is not None)
        require(dims is None, "ML-006", lambda: f"{dims} (provider {provider!r})")
        require_mla_kernel(provider, "qv")
    fn = _real_kernel(provider)
    if isinstance(fn, str):
        raise RuntimeError(fn)
    kwargs = dict(cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                  max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
                  window_size=tuple(window_size), return_softmax_lse=return_softmax_lse)
    if softcap:
        kwargs["softcap"] = softcap  # unsupported by the tokenspeed build: it raises, tests skip
    if qv is not None:
        kwargs["qv"] = qv
    return fn(q, k_cache, v_cache, **kwargs)


def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, return_softmax_lse=False, provider: str | None = None):
    """Ragged, non-paged attention, FA3's ``flash_attn_varlen_func`` (the MLA prefill, ML-010).

    Shapes: q ``[Tq, H, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]``; cu_seqlens_q / cu_seqlens_k
    int32 ``[B+1]``; max_seqlen_q / max_seqlen_k Python ints.  ``causal``: bottom-right per
    request (PA-004).  Returns ``[Tq, H, Dv]``, and the LSE ``[H, Tq]`` if ``return_softmax_lse``
    (:func:`~refspec.fa3.emulator.emulate_flash_attn_varlen_func` states the contract).
    Raises (a real provider, before the call): InvariantError ML-006 (head dims), ML-013 (D != Dv
    on a build without the hdim 192 / 128 kernel); InvariantError PA-011 for ``q`` / ``k`` / ``v``
    that are not tensors; ValueError for an unknown ``provider``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        require(isinstance(t, torch.Tensor), "PA-011", lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    provider = check_provider(provider or select_provider(q.device))
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal)
    if provider == "emulator":
        return emulate_flash_attn_varlen_func(q, k, v, return_softmax_lse=return_softmax_lse, **kw)
    if v.shape[-1] != q.shape[-1]:
        dims = fa3_dims_problem(q.shape[-1], v.shape[-1], False)
        require(dims is None, "ML-006", lambda: f"{dims} (provider {provider!r})")
        require_mla_kernel(provider, "prefill")
    fn = _real_kernel(provider, "flash_attn_varlen_func")
    if isinstance(fn, str):
        raise RuntimeError(fn)
    if provider == "fa3":  # the hopper interface names the LSE flag return_attn_probs
        return fn(q, k, v, return_attn_probs=return_softmax_lse, **kw)
    return fn(q, k, v, return_softmax_lse=return_softmax_lse, **kw)


# ---- a forward's two kernel entry points, as a CUDA graph records them (wrapped here, once) ----
def _store_kv(*, pool, loc, layer_id: int, k, v) -> None:
    pool.set_kv_buffer(layer_id, loc, k, v)


#: ``store_kv(pool=, loc=, layer_id=, k=, v=)``: this forward's K/V into the pool at ``loc`` (PA-009)
store_kv = recordable(_store_kv, static=("pool", "loc"))


def _store_mla_kv(*, pool, loc, layer_id: int, k_nope, k_rope) -> None:
    pool.set_mla_kv_buffer(layer_id, loc, k_nope, k_rope)


#: ``store_mla_kv(pool=, loc=, layer_id=, k_nope=, k_rope=)``: this forward's latent rows into the MLA
#: pool at ``loc``, slot 0 never written (PA-009, ML-002)
store_mla_kv = recordable(_store_mla_kv, static=("pool", "loc"))
#: ``attention(q=, k_cache=, ...)``: :func:`flash_attn_with_kvcache`, its KV and metadata buffers static
attention = recordable(flash_attn_with_kvcache,
                       static=("k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q"))
#: ``attention_varlen(q=, k=, v=, ...)``: :func:`flash_attn_varlen_func` (the MLA prefill, never graphed)
attention_varlen = recordable(flash_attn_varlen_func, static=("cu_seqlens_q", "cu_seqlens_k"))
