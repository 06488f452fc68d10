"""Ready-made attention scenarios: one batch of one mode, both wings, eager and graphed.

Used by the tests, ``python -m refspec check`` and the tutorials, so that "build a paged cache,
fill a prefix, run mode X through the oracle and the FA3 path" is one obvious call::

    sc = Scenario(ForwardMode.TARGET_VERIFY, page_size=4, lens=[5, 9], num_draft_tokens=4)
    built = sc.build()
    ref = built.run_oracle()          # fp32 truth, keys by slot
    out = built.run_fa3()             # eager FA3 path (emulator on CPU, real kernel on Hopper)
    out_g = built.run_fa3_graph()     # the same through a captured (emulated) CUDA graph

``lens`` means per mode (tokens): DECODE, ``seq_lens`` = L + 1 (the new token included); draft
decode, committed L (``draft_step`` s writes L + s); EXTEND, the prefix (``extend_lens`` new tokens); TARGET_VERIFY,
committed L; DRAFT_EXTEND, committed L before accept (``num_accept_tokens`` a); DRAFT_EXTEND_V2,
committed L before the round; IDLE, ``lens=[]`` (the empty batch: eager only, outputs
``[0, H, D]``).  Every request gets slots for all its K_b keys; the keys before
this forward's tokens hold random K/V, this forward's q/k/v are random too.

Poisoning (``poison=True``): page 0 and every page outside all tables hold NaN; slots in a
used page past K_b hold the sentinel 1e4.  A correct kernel's real rows never see either.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from refspec.core import batch as B
from refspec.core.args import count, int_list, is_int
from refspec.fa3.backend import FlashAttentionBackend
from refspec.harness.devices import device_problem
from refspec.graphs.runner import GraphRunner
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode
from refspec.oracle.backend import OracleBackend

SENTINEL = 1e4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  #: the dtypes of the tolerance policy (T1_FLOOR)
_USED_BY = {"extend_lens": "EXTEND", "draft_step": "DECODE (draft decode step s)",
            "num_accept_tokens": "DRAFT_EXTEND and DRAFT_EXTEND_V2"}


@dataclass
class Scenario:
    mode: ForwardMode
    page_size: int
    lens: list[int]
    num_draft_tokens: int = 4
    num_accept_tokens: list[int] | None = None
    extend_lens: list[int] | None = None
    draft_step: int | None = None
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    seed: int = 0
    shuffle_pages: bool = True
    poison: bool = True
    window_left: int = -1
    softcap: float = 0.0
    device: str = "cpu"
    extra_pages: int = 3

    def __post_init__(self):
        """Argument checks: ValueError naming the missing or inconsistent field (or the rule)."""
        if not isinstance(self.mode, ForwardMode):
            raise ValueError(f"mode must be a ForwardMode, got {self.mode!r}")
        for name in ("page_size", "num_draft_tokens", "num_heads", "num_kv_heads", "head_dim"):
            n = getattr(self, name)  # bools are ints to Python, not sizes
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads = {self.num_heads} must be a multiple of num_kv_heads = {self.num_kv_heads} "
                             f"(GQA: each KV head serves num_heads / num_kv_heads query heads)")
        self._check_other_fields()
        self._check_per_mode()

    def _check_other_fields(self):
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        problem = device_problem(self.device) if isinstance(self.device, str) else "choose cpu or cuda"
        if problem:
            raise ValueError(f"device {problem}" if problem.startswith("'") else f"device={self.device!r}: {problem}")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in DTYPES:
            hint = f" (a string: pass torch.{self.dtype})" if isinstance(self.dtype, str) else ""
            raise ValueError(f"dtype must be one of {', '.join(map(str, DTYPES))}, got {self.dtype!r}{hint}")
        count("extra_pages", self.extra_pages)
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        count("window_left (-1: no window)", self.window_left, -1)
        if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) \
                or not 0 <= self.softcap < math.inf:
            raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {self.softcap!r}")
        for name in ("shuffle_pages", "poison"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_per_mode(self):
        m, N = self.mode, self.num_draft_tokens
        self.lens = int_list("lens", self.lens, least=0)
        if m.is_idle() and self.lens:
            raise ValueError(f"mode IDLE is the empty batch: lens must be [], got {self.lens}")
        if not m.is_idle() and not self.lens:
            raise ValueError(f"lens must list at least one request for mode {m.name}, got [] "
                             f"(an empty batch is mode=ForwardMode.IDLE)")
        if m.is_decode() and self.draft_step is None and min(self.lens) < 1:
            raise ValueError(f"DECODE lens include the new token, so every entry must be >= 1, got {self.lens}")
        uses = {"extend_lens": m == ForwardMode.EXTEND, "draft_step": m.is_decode(),
                "num_accept_tokens": m.is_draft_extend(include_v2=True)}
        for name, used in uses.items():
            if getattr(self, name) is not None and not used:
                raise ValueError(f"{name} is not used by mode {m.name} (only by "
                                 f"{_USED_BY[name]}), got {getattr(self, name)!r}; leave it None")
        for name in ("extend_lens", "num_accept_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, int_list(name, getattr(self, name)))
        if self.draft_step is not None:
            count("draft_step", self.draft_step)
        per_req = {ForwardMode.EXTEND: "extend_lens", ForwardMode.DRAFT_EXTEND: "num_accept_tokens"}
        name = per_req.get(m)
        if name and (getattr(self, name) is None or len(getattr(self, name)) != len(self.lens)):
            raise ValueError(f"{m.name} needs {name} with one entry per request of lens {self.lens}, "
                             f"got {getattr(self, name)}")
        if m.is_target_verify() or m.is_draft_extend(include_v2=True):
            if N < 2:
                raise ValueError(f"num_draft_tokens N = {N}: {m.name} needs N = Sd + 1 >= 2 (the root and at "
                                 f"least one draft token per request, SD-010)")
        a = self.num_accept_tokens
        if m.is_draft_extend_v2() and a is not None:
            if len(a) != len(self.lens):
                raise ValueError(f"num_accept_tokens has {len(a)} entries, lens {len(self.lens)}")
            if not all(1 <= x <= N for x in a):
                raise ValueError(f"num_accept_tokens {a}: each a = n + 1 must lie in [1, N = {N}] "
                                 f"(num_draft_tokens)")

    def kv_and_q_lens(self) -> tuple[list[int], list[int]]:
        """(K_b, q_b) per request, from the mode's meaning of ``lens``."""
        m, N, L = self.mode, self.num_draft_tokens, self.lens
        if m.is_decode() and self.draft_step is not None:
            return [x + self.draft_step + 1 for x in L], [1] * len(L)
        if m.is_decode():
            return list(L), [1] * len(L)
        if m == ForwardMode.EXTEND:
            return [x + e for x, e in zip(L, self.extend_lens)], list(self.extend_lens)
        if m.is_target_verify() or m.is_draft_extend_v2():
            return [x + N for x in L], [N] * len(L)
        if m.is_draft_extend():
            return [x + a for x, a in zip(L, self.num_accept_tokens)], list(self.num_accept_tokens)
        return [], []

    def build(self) -> "Built":
        P, dev = self.page_size, torch.device(self.device)
        g = torch.Generator(device=dev).manual_seed(self.seed)  # values made where they are used
        K, q = self.kv_and_q_lens()
        pages_needed = sum(-(-k // P) for k in K)
        num_pages = pages_needed + self.extra_pages + 1
        ctx = max(K + [1]) + self.num_draft_tokens
        kv = KVCache(len(K) + 2, ctx, num_pages, P, extra=4 + self.num_draft_tokens, device=dev,
                     seed=self.seed if self.shuffle_pages else None)
        pool = KVPool(1, num_pages, P, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=dev,
                      fill=float("nan") if self.poison else 0.0)
        rows = [kv.alloc_req() for _ in K]
        kv.alloc_extend(rows, [0] * len(K), K)
        kf, vf = pool.get_flat_kv(0)
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev).to(self.dtype)
        for r, k_b, q_b in zip(rows, K, q):
            used = kv.req_to_token[r, :k_b].long()
            if self.poison:  # whole used pages get the sentinel first, then the real prefix
                pages = torch.unique(used // P)
                span = (pages[:, None] * P + torch.arange(P, device=dev)).flatten()
                kf[span], vf[span] = SENTINEL, SENTINEL
            prefix = used[: k_b - q_b]
            kf[prefix] = rnd(len(prefix), self.num_kv_heads, self.head_dim)
            vf[prefix] = rnd(len(prefix), self.num_kv_heads, self.head_dim)
        fb = self._batch(kv, rows)
        T = fb.num_tokens
        layer = AttentionLayer(0, self.num_heads, self.num_kv_heads, self.head_dim,
                               logit_cap=self.softcap, sliding_window_size=self.window_left)
        return Built(self, kv, pool, fb, layer, rnd(T, self.num_heads, self.head_dim),
                     rnd(T, self.num_kv_heads, self.head_dim), rnd(T, self.num_kv_heads, self.head_dim), K, q)

    def _batch(self, kv, rows):
        m, N, L = self.mode, self.num_draft_tokens, self.lens
        if m.is_decode() and self.draft_step is not None:
            return B.draft_decode_batch(kv, rows, L, self.draft_step)
        if m.is_decode():
            return B.decode_batch(kv, rows, L)
        if m == ForwardMode.EXTEND:
            return B.extend_batch(kv, rows, L, self.extend_lens)
        if m.is_target_verify():
            return B.verify_batch(kv, rows, L, N)
        if m.is_draft_extend():
            a = self.num_accept_tokens
            return B.draft_extend_batch(kv, rows, [x + y for x, y in zip(L, a)], a, num_draft_tokens=N)
        if m.is_draft_extend_v2():
            return B.draft_extend_v2_batch(kv, rows, [x + N for x in L], N, self.num_accept_tokens)
        return B.idle_batch(kv)


@dataclass
class Built:
    """A built scenario: cache, pool, live batch ``fb``, inputs ``q [T,H,D]``, ``k, v [T,Hkv,D]``."""

    sc: Scenario
    kv: KVCache
    pool: KVPool
    fb: B.ForwardBatch
    layer: AttentionLayer
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    K: list[int]
    q_lens: list[int]
    extra: dict = field(default_factory=dict)

    def run_oracle(self, upcast: bool = True) -> torch.Tensor:
        """The oracle on this batch: ``[T, H, D]``; fp32 (unrounded) by default, in the
        scenario's dtype with ``upcast=False`` (the T1 budget run)."""
        be = OracleBackend(self.pool, self.kv, upcast=upcast, out_dtype=torch.float32 if upcast else None)
        be.init_forward_metadata(self.fb)
        return be.forward(self.q, self.k, self.v, self.layer, self.fb)

    def fa3_backend(self, provider=None, validate=True) -> FlashAttentionBackend:
        step = self.sc.draft_step if self.fb.is_draft_decode else None
        return FlashAttentionBackend(self.pool, self.kv, speculative_step_id=step, provider=provider, validate=validate)

    def run_fa3(self, provider=None, validate=True) -> torch.Tensor:
        """The eager FA3 path: ``[T, H, D]``."""
        be = self.fa3_backend(provider, validate)
        self.extra["metadata"] = be.init_forward_metadata(self.fb)
        return be.forward(self.q, self.k, self.v, self.layer, self.fb)

    def graph_runner(self, capture_bs=(1, 2, 4, 8), provider=None, validate=True) -> GraphRunner:
        """A runner capturing this scenario's mode (draft decode: the one step ``draft_step``)."""
        if self.fb.forward_mode.is_idle():
            raise ValueError("mode IDLE (the empty batch) is not captured in a graph; run_oracle / run_fa3 "
                             "run it eagerly ([0, H, D])")
        be = self.fa3_backend(provider, validate)
        sc = self.sc
        W = 1 if self.fb.forward_mode.is_decode() else sc.num_draft_tokens
        shapes = dict(q=((sc.num_heads, sc.head_dim), sc.dtype), k=((sc.num_kv_heads, sc.head_dim), sc.dtype),
                      v=((sc.num_kv_heads, sc.head_dim), sc.dtype))
        layer = self.layer
        runner = GraphRunner(self.fb.forward_mode, [be], lambda fb, x: be.forward(x["q"], x["k"], x["v"], layer, fb),
                             kv=self.kv, capture_bs=capture_bs, tokens_per_req=W, inputs=shapes,
                             num_draft_tokens=sc.num_draft_tokens, draft_step=self.fb.draft_step)
        runner.backend = be
        return runner

    def run_fa3_graph(self, runner: GraphRunner | None = None, **kw) -> torch.Tensor:
        """Replay through a (given or new) graph runner: ``[T, H, D]`` real rows."""
        runner = runner or self.graph_runner(**kw)
        return runner.replay(self.fb, dict(q=self.q, k=self.k, v=self.v))
