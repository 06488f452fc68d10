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
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from refspec.fa3.emulator import emulate_flash_attn_with_kvcache
from refspec.graphs.capture import recordable


@functools.lru_cache(maxsize=None)
def _real_kernel(name: str):
    """The real kernel function for provider ``name``, or the reason it is unavailable (str).

    Raises: ValueError for a name that is no provider at all."""
    modules = {"fa3": "flash_attn_interface", "sgl_kernel": "sgl_kernel.flash_attn"}
    if name not in modules:
        raise ValueError(f"unknown FA3 provider {name!r}: one of 'emulator', {', '.join(map(repr, modules))}")
    module = modules[name]
    try:
        return importlib.import_module(module).flash_attn_with_kvcache
    except Exception as e:  # ImportError, or a broken binary (OSError, RuntimeError)
        return f"`import {module}` failed: {type(e).__name__}: {e}"


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
                            return_softmax_lse=False, provider: str | None = None):
    """Paged-KV attention, FA3 semantics (docs/fa3-contract.md; PA-004..PA-006).

    Shapes: q ``[T, H, D]`` (fp16/bf16 for the real kernel; the emulator also takes fp32);
    k_cache, v_cache ``[NP, P, Hkv, D]``; cache_seqlens int32 ``[B]`` (K_b, tokens, the kernel's
    ``seqused_k``); page_table int32 ``[B, M]`` (page ids); cu_seqlens_q int32 ``[B+1]``;
    max_seqlen_q a Python int.  Returns ``[T, H, D]`` (and the LSE ``[H, T]`` if asked).

    Semantics: request b's rows ``cu_q[b]..cu_q[b+1]-1`` attend keys ``p < K_b`` with the
    bottom-right causal rule (PA-004); key p is at slot ``page_table[b, p // P] * P + p % P``.
    ``provider`` overrides :func:`select_provider` (tests use it to run both on one GPU).
    """
    provider = provider or select_provider(q.device)
    if provider == "emulator":
        return emulate_flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, return_softmax_lse=return_softmax_lse)
    fn = _real_kernel(provider)
    if isinstance(fn, str):
        raise RuntimeError(fn)
    kwargs = dict(cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                  max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
                  window_size=tuple(window_size), return_softmax_lse=return_softmax_lse)
    if softcap:
        kwargs["softcap"] = softcap  # unsupported by the tokenspeed build: it raises, tests skip
    return fn(q, k_cache, v_cache, **kwargs)


# ---- a forward's two kernel entry points, as a CUDA graph records them (wrapped here, once) ----
def _store_kv(*, pool, loc, layer_id: int, k, v) -> None:
    pool.set_kv_buffer(layer_id, loc, k, v)


#: ``store_kv(pool=, loc=, layer_id=, k=, v=)``: this forward's K/V into the pool at ``loc`` (PA-009)
store_kv = recordable(_store_kv, static=("pool", "loc"))
#: ``attention(q=, k_cache=, ...)``: :func:`flash_attn_with_kvcache`, its KV and metadata buffers static
attention = recordable(flash_attn_with_kvcache,
                       static=("k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q"))
