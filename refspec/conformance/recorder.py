"""A stand-in for an attention kernel that records every call: what upstream's backend (and
refspec's) really hands the kernel.

:class:`Recorder` replaces a kernel function that a module looks up as a global at call time
(``flash_attn_with_kvcache``, ``flash_attn_varlen_func``, ``merge_state_v2``,
``get_scheduler_metadata`` of SGLang's ``flashattention_backend`` module -- each release imports
them from a different place, so the global the backend module looks up is the one replaced,
:func:`installed`), or an attribute an object calls (a backend's ``self.flash_attn_with_kvcache``,
refspec's ``refspec.fa3.kernel.attention``).  Each call is bound to the kernel's signature
(defaults applied: an omitted ``causal`` is recorded as the default the kernel would use) and
recorded as a :class:`Call`: every argument by name, tensors cloned with shape, stride, dtype and
device, scalars and tuples by value, the caller's ``file:line``, and a reference to each tensor
passed (:meth:`Call.reread`: what a CUDA graph replay hands the kernel, the captured tensors read
again after the replay hooks rewrote them in place).  The recorder then returns what the caller
needs: ``forward(**arguments)`` where given (:func:`emulated`: refspec's FA3 emulator, so outputs
can be compared too), else zeros of the output's shape (:func:`zeros_like_output`).

Worker and parent alike: nothing here imports refspec's production code at module level (the
emulator is imported by :func:`emulated` only when used).  Reused for MLA's forward path
(``use_mla=True``: the same globals, ``qv`` and the latent caches among the arguments).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import sys
from dataclasses import dataclass, field

import torch


def _fa3_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                 cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                 cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                 q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                 window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                 scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                 return_softmax_lse=False, **extra):
    """FA3's ``flash_attn_interface.flash_attn_with_kvcache`` signature (hopper/flash_attn_interface.py,
    the build ``sgl_kernel.flash_attn`` wraps), with its defaults: the binding used where the
    replaced global is not a Python function whose signature can be read (a stub)."""


def _merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None):
    """``sgl_kernel.merge_state_v2`` (the cascade merge of two attention states)."""


def _get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v=None,
                            qkv_dtype=torch.bfloat16, cache_seqlens=None, cu_seqlens_q=None, cu_seqlens_k=None,
                            cu_seqlens_k_new=None, seqused_q=None, cache_leftpad=None, page_size=None,
                            max_seqlen_k_new=0, causal=False, window_size=(-1, -1), attention_chunk=0,
                            has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0, **extra):
    """FA3's ``get_scheduler_metadata`` signature (hopper/flash_attn_interface.py), with its defaults."""


#: the FA3 signatures a recorder binds to where the replaced global is a stub
SIGNATURES = {"flash_attn_with_kvcache": _fa3_flash_attn_with_kvcache, "merge_state_v2": _merge_state_v2,
              "get_scheduler_metadata": _get_scheduler_metadata}


def snapshot(x):
    """A recorded argument: a tensor as ``{"tensor": clone, "shape", "stride", "dtype", "device"}``,
    a list / tuple item by item, anything else by value (a placeholder or object by its repr)."""
    if isinstance(x, torch.Tensor):
        return {"tensor": x.detach().clone(), "shape": tuple(x.shape), "stride": tuple(x.stride()),
                "dtype": str(x.dtype).replace("torch.", ""), "device": str(x.device)}
    if isinstance(x, (list, tuple)):
        return type(x)(snapshot(v) for v in x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


#: one counter for every recorder of the process: the calls of several recorders sort into call order
_ORDER = itertools.count()


@dataclass
class Call:
    """One recorded kernel call: ``args`` (name -> :func:`snapshot`), the caller's ``where``
    (``(file, line)``), the tensors passed (``refs``, kept for :meth:`reread`), and ``order`` (its
    place among every recorder's calls of this process)."""

    name: str
    args: dict
    where: tuple[str, int] | None = None
    refs: dict = field(default_factory=dict, repr=False)
    order: int = 0

    def reread(self) -> Call:
        """The same call with every tensor argument read again from the tensor passed: what a CUDA
        graph that captured this call hands the kernel at replay (the captured buffers, their
        contents rewritten in place by the replay hooks; the scalars frozen at capture)."""
        args = dict(self.args)
        for name, x in self.refs.items():
            args[name] = snapshot(x)
        return Call(self.name, args, self.where, self.refs, self.order)

    def plain(self) -> dict:
        """``{"name", "args", "where"}``: what the worker saves (no live tensors)."""
        return {"name": self.name, "args": self.args, "where": self.where}


def _caller(depth: int = 2) -> tuple[str, int] | None:
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    return f.f_code.co_filename, f.f_lineno


class Recorder:
    """A kernel stand-in that records every call (module doc).

    ``name``: the kernel's name (the global it replaces); ``original``: the function replaced (its
    signature binds the call when readable; else :data:`SIGNATURES` ``[name]``; else the keyword
    arguments as passed, positional ones as ``arg0``, ``arg1``, ...); ``forward``: called with the
    bound arguments to produce the result (None: :func:`zeros_like_output`)."""

    def __init__(self, name: str, original=None, forward=None):
        self.name, self.forward = name, forward
        self.calls: list[Call] = []
        self.signature = None
        for fn in (original, SIGNATURES.get(name)):
            if inspect.isfunction(fn):
                self.signature = inspect.signature(fn)
                break

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name, the kernel's defaults applied."""
        if self.signature is None:
            return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        out = {}
        for name, value in bound.arguments.items():
            p = self.signature.parameters[name]
            if p.kind is p.VAR_KEYWORD:
                out.update(value)
            elif p.kind is not p.VAR_POSITIONAL:
                out[name] = value
        return out

    def __call__(self, *args, **kwargs):
        bound = self.bind(args, kwargs)
        refs = {k: v for k, v in bound.items() if isinstance(v, torch.Tensor)}
        self.calls.append(Call(self.name, {k: snapshot(v) for k, v in bound.items()}, _caller(), refs,
                               next(_ORDER)))
        if self.forward is not None:
            return self.forward(**bound)
        return zeros_like_output(self.name, bound)


def zeros_like_output(name: str, a: dict):
    """What the kernel ``name`` returns for the bound arguments ``a``, as zeros (the recorder's
    default result: nothing downstream of the call is compared).  ``flash_attn_*``: the output
    ``[T, H, Dv]`` (written into ``out`` where given), with the LSE ``[H, T]`` when
    ``return_softmax_lse``; ``merge_state_v2``: ``(v, s)`` of ``v_a``'s and ``s_a``'s shapes;
    ``get_scheduler_metadata``: an int32 vector; anything else: None."""
    if name.startswith("flash_attn"):
        q, v_cache = a.get("q"), a.get("v_cache", a.get("v"))
        if not isinstance(q, torch.Tensor):
            return None
        dv = v_cache.shape[-1] if isinstance(v_cache, torch.Tensor) else q.shape[-1]
        o = q.new_zeros((*q.shape[:-1], dv))
        if isinstance(a.get("out"), torch.Tensor):
            a["out"].zero_()
            o = a["out"]
        if a.get("return_softmax_lse"):
            return o, q.new_zeros((q.shape[-2], q.shape[0]), dtype=torch.float32)
        return o
    if name == "merge_state_v2":
        return torch.zeros_like(a["v_a"]), torch.zeros_like(a["s_a"])
    if name == "get_scheduler_metadata":
        return torch.zeros(1, dtype=torch.int32)
    return None


def emulated(**a):
    """``flash_attn_with_kvcache`` through refspec's FA3 emulator (:mod:`refspec.fa3.emulator`) for a
    recorder's ``forward``: the paged call without new k / v (the contract SGLang's MHA paths use;
    a call with new k / v raises ValueError naming them)."""
    from refspec.fa3.emulator import emulate_flash_attn_with_kvcache

    new = [n for n in ("k", "v", "qv", "rotary_cos", "cache_batch_idx", "cache_leftpad") if a.get(n) is not None]
    if new:
        raise ValueError(f"the emulator takes the paged call without {', '.join(new)}")
    out = emulate_flash_attn_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], cache_seqlens=a["cache_seqlens"], page_table=a["page_table"],
        cu_seqlens_q=a["cu_seqlens_q"], max_seqlen_q=a["max_seqlen_q"], softmax_scale=a.get("softmax_scale"),
        causal=a.get("causal", False), window_size=tuple(a.get("window_size") or (-1, -1)),
        softcap=a.get("softcap") or 0.0, return_softmax_lse=bool(a.get("return_softmax_lse")))
    o = out[0] if isinstance(out, tuple) else out
    if isinstance(a.get("out"), torch.Tensor):
        a["out"].copy_(o)
    return out


@contextlib.contextmanager
def installed(module, recorders: dict, objects=()):
    """Recorders in place of ``module``'s globals (``{global name: Recorder}``) and of the
    same-named attributes of ``objects`` that have them (e.g. a backend's
    ``self.flash_attn_with_kvcache``); everything restored on exit.  A name the module does not
    define is set while installed and removed again."""
    missing = object()
    saved = [(module.__dict__, n, module.__dict__.get(n, missing)) for n in recorders]
    saved += [(o.__dict__, n, o.__dict__[n]) for o in objects for n in recorders if n in getattr(o, "__dict__", {})]
    try:
        for space, n, _ in saved:
            space[n] = recorders[n]
        yield recorders
    finally:
        for space, n, old in saved:
            if old is missing:
                space.pop(n, None)
            else:
                space[n] = old
