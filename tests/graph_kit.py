"""Set-up shared by the CUDA-graph tests (not a test module).

Used by ``test_graphs.py``, ``test_accept_length_rule.py``, ``test_cases_graphs.py`` and
``test_gpu_graphs.py``:

* :class:`Requests`: one built :class:`~refspec.harness.scenario.Scenario` used as a pool of requests, so
  one graph runner can replay several *different* live batches (other rows, other pages, other
  sizes) on the same KV cache; each request's fp32 oracle rows come from an identical fresh build;
* :class:`DraftSteps`: the draft-decode graph as SGLang's ``EAGLEDraftCudaGraphRunner`` captures it,
  all Sd - 1 steps of one round in one graph (``FlashAttentionMultiStepBackend``,
  ``draft_decode_steps_batch`` cut per step by ``draft_step_view``), each step's query depending
  on the previous step's output like a model's would;
* poisoning of the dummy page 0 and of padded graph rows, and the real-row metadata comparison
  of CG-002.

Shapes follow the legend: B requests, Bg padded graph batch, T query tokens, H / Hkv heads, D head
dim, P page size, N = Sd + 1 draft tokens.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from refspec.core import batch as fbatch
from refspec.fa3.backend import FlashAttentionMultiStepBackend
from refspec.graphs.runner import GraphRunner
from refspec.core.modes import ForwardMode
from refspec.oracle.backend import OracleBackend
from refspec.harness.scenario import SENTINEL, Built, Scenario

N = 4  #: num_draft_tokens (Sd = 3)
DIMS = dict(num_heads=8, num_kv_heads=2, head_dim=32)  #: small heads keep the CPU suite fast
#: committed lengths (tokens) of the pool's requests: page boundaries +-1 for P = 4, 16, 64
LENS = [5, 17, 33, 63, 1, 64, 12, 40, 7]
#: num_accept_tokens a = n + 1 per request (mixed, 1..N)
ACCEPT = [1, 3, 4, 2, 4, 1, 2, 3, 1]
PAGE_SIZES = [1, 4, 16, 64]

MODES = {  # name -> (mode, draft_step)
    "decode": (ForwardMode.DECODE, None),
    "draft_decode": (ForwardMode.DECODE, 1),
    "verify": (ForwardMode.TARGET_VERIFY, None),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, None),
    "draft_extend_v2": (ForwardMode.DRAFT_EXTEND_V2, None),
}
#: captured max_seqlen_q per mode, by hand from CG-006: 1, 1, N, Sd+1, Sd+1
FROZEN_MAX_Q = {"decode": 1, "draft_decode": 1, "verify": N, "draft_extend": N, "draft_extend_v2": N}
#: token rows per request in the runner's buffers (W): 1 for decode modes, N otherwise
TOKENS_PER_REQ = {"decode": 1, "draft_decode": 1, "verify": N, "draft_extend": N, "draft_extend_v2": N}
#: seq_lens fill of padded rows (graph_runner module doc) and K - seq_lens per mode (MD-003;
#: draft decode here is step s = 1: K = L + s + 1)
PAD_SEQ_LEN = {"decode": 1, "draft_decode": 1, "verify": 1, "draft_extend": N, "draft_extend_v2": N}
K_DELTA = {"decode": 0, "draft_decode": 2, "verify": N, "draft_extend": 0, "draft_extend_v2": 0}


def scenario(name: str, page_size: int, lens=LENS, accept=ACCEPT, **kw) -> Scenario:
    """The pool scenario of mode ``name`` (a key of :data:`MODES`)."""
    mode, step = MODES[name]
    a = list(accept[: len(lens)]) if mode.is_draft_extend(include_v2=True) else None
    return Scenario(mode, page_size=page_size, lens=list(lens), num_draft_tokens=N, num_accept_tokens=a,
                    draft_step=step, **{**DIMS, **kw})


def captured_key(name: str) -> str:
    """The mode key of ``GraphState.captured`` (capture is shared by v1 and v2 draft extend)."""
    mode = MODES[name][0]
    return "draft_extend" if mode.is_draft_extend(include_v2=True) else mode.name.lower()


def live_batch(sc: Scenario, kv, rows: list[int], idx: list[int]) -> fbatch.ForwardBatch:
    """The ``sc.mode`` batch of the pool requests ``idx`` (positions in ``sc.lens``)."""
    m, N_ = sc.mode, sc.num_draft_tokens
    L = [sc.lens[j] for j in idx]
    r = [rows[j] for j in idx]
    a = None if sc.num_accept_tokens is None else [sc.num_accept_tokens[j] for j in idx]
    if m.is_decode() and sc.draft_step is not None:
        return fbatch.draft_decode_batch(kv, r, L, sc.draft_step)
    if m.is_decode():
        return fbatch.decode_batch(kv, r, L)
    if m.is_target_verify():
        return fbatch.verify_batch(kv, r, L, N_)
    if m.is_draft_extend():
        return fbatch.draft_extend_batch(kv, r, [x + y for x, y in zip(L, a)], a, num_draft_tokens=N_)
    assert m.is_draft_extend_v2(), m
    return fbatch.draft_extend_v2_batch(kv, r, [x + N_ for x in L], N_, a)


class Requests:
    """A built scenario as a pool of requests (module doc).

    ``built`` holds the cache, pool and the all-requests batch; ``ref`` is the fp32 oracle
    ``[T_all, H, D]`` (float32 whatever the scenario dtype) of an identical fresh build, so no FA3
    code ever touched it; ``ref_low`` the same oracle computed in the scenario's low precision (the
    T1 budget unit, TOL-002), None for fp32 scenarios.
    """

    def __init__(self, sc: Scenario):
        self.sc = sc
        self.built = sc.build()
        self.ref = oracle(sc.build())
        self.ref_low = None if sc.dtype == torch.float32 else oracle(sc.build(), upcast=False)
        self.rows = self.built.fb.req_pool_indices.tolist()
        self.cu = [0, *accumulate(self.built.q_lens)]

    def tokens(self, idx) -> torch.Tensor:
        """Token indices (rows of ``built.q`` / ``ref``) of requests ``idx``, request-major."""
        return torch.cat([torch.arange(self.cu[j], self.cu[j + 1]) for j in idx])

    def live(self, idx):
        """``(fb, inputs, ref_rows)`` for requests ``idx``: inputs ``q [T,H,D]``, ``k, v [T,Hkv,D]``."""
        fb = live_batch(self.sc, self.built.kv, self.rows, list(idx))
        t = self.tokens(idx).to(self.built.q.device)
        return fb, dict(q=self.built.q[t], k=self.built.k[t], v=self.built.v[t]), self.ref[t]

    def ref_low_rows(self, idx) -> torch.Tensor | None:
        return None if self.ref_low is None else self.ref_low[self.tokens(idx).to(self.ref_low.device)]

    def runner(self, capture_bs=(1, 2, 4, 8), **kw) -> GraphRunner:
        return self.built.graph_runner(capture_bs=capture_bs, **kw)

    def runner_with(self, backend, capture_bs=(1, 2, 4, 8)) -> GraphRunner:
        """A runner like ``built.graph_runner`` but over a given backend (e.g. another context length)."""
        sc, b = self.sc, self.built
        shapes = dict(q=((sc.num_heads, sc.head_dim), sc.dtype), k=((sc.num_kv_heads, sc.head_dim), sc.dtype),
                      v=((sc.num_kv_heads, sc.head_dim), sc.dtype))
        W = 1 if b.fb.forward_mode.is_decode() else sc.num_draft_tokens
        runner = GraphRunner(b.fb.forward_mode, [backend],
                             lambda fb, x: backend.forward(x["q"], x["k"], x["v"], b.layer, fb),
                             kv=b.kv, capture_bs=capture_bs, tokens_per_req=W, inputs=shapes,
                             num_draft_tokens=sc.num_draft_tokens, draft_step=b.fb.draft_step)
        runner.backend = backend
        return runner

    def eager(self, fb, x, provider=None, validate=True):
        """The eager FA3 path on ``fb``: ``(out [T,H,D], metadata)``."""
        be = self.built.fa3_backend(provider, validate)
        md = be.init_forward_metadata(fb)
        return be.forward(x["q"], x["k"], x["v"], self.built.layer, fb), md


def oracle(built: Built, upcast: bool = True) -> torch.Tensor:
    """The oracle on ``built.fb``: fp32 output from the (low-precision) inputs when ``upcast``,
    else computed and returned in the scenario dtype.  Shapes: ``[T, H, D]``."""
    be = OracleBackend(built.pool, built.kv, upcast=upcast)
    be.init_forward_metadata(built.fb)
    cast = (lambda t: t.float()) if upcast else (lambda t: t)
    return be.forward(cast(built.q), cast(built.k), cast(built.v), built.layer, built.fb)


# ---- poisoning (public cases B03, B11, B18) ----
def poison_dummy_page(pool, value=float("nan")) -> None:
    """Fill page 0 (the reserved dummy that padded rows read and write) of every layer."""
    for buf in pool.k_buffer + pool.v_buffer:
        buf[0] = value


def poison_padding(runner: GraphRunner, value=float("nan")) -> None:
    """After every fill, the padded token rows of the runner's input buffers hold ``value``.

    Instrumentation only: it wraps ``GraphRunner._fill`` so padded q/k/v rows are garbage (and
    their k/v land in the dummy page), which real rows must never see.
    """
    fill = runner._fill

    def poisoned(fb, live, bs, inputs):
        fill(fb, live, bs, inputs)
        T = 0 if live is None else live.num_tokens
        for buf in runner.inputs.values():
            buf[T: bs * runner.W] = value

    runner._fill = poisoned


# ---- metadata (CG-002) ----
def assert_real_rows_metadata_equal(md_graph, md_eager, B: int, P: int) -> None:
    """T0 on real rows: K, cu_q[:B+1], cu_k[:B+1], page_table[b, :ceil(K_b / P)]."""
    K = md_eager.cache_seqlens_int32
    assert torch.equal(md_graph.cache_seqlens_int32[:B], K), (md_graph.cache_seqlens_int32[:B], K)
    assert torch.equal(md_graph.cu_seqlens_q[: B + 1], md_eager.cu_seqlens_q)
    assert torch.equal(md_graph.cu_seqlens_k[: B + 1], md_eager.cu_seqlens_k)
    for b, k in enumerate(K.tolist()):
        m = -(-k // P)
        assert torch.equal(md_graph.page_table[b, :m], md_eager.page_table[b, :m]), f"page_table row {b}"


def real_rows_differ(out: torch.Tensor, ref: torch.Tensor, atol: float = 1e-3) -> bool:
    """At least one real row is NaN/inf or off by more than ``atol`` (a detectable difference)."""
    bad = ~torch.isfinite(out.float()) | ((out.float() - ref.float()).abs() > atol)
    return bool(bad.any())


# ---- the draft-decode graph: all Sd - 1 steps in one graph ----
def draft_chain(backends, layer, fbs, x) -> torch.Tensor:
    """Run draft steps s = 0..Sd-2 in order: step s's query is ``x_q[:, s] + 0.5 * out_{s-1}``.

    Shapes: ``x`` q ``[B*(Sd-1), H, D]``, k / v ``[B*(Sd-1), Hkv, D]``, request-major (entry
    ``b*(Sd-1) + s``); ``fbs[s]`` the step-s batch; returns ``[B*(Sd-1), H, D]`` request-major.
    Graph-safe (no host syncs): used inside the captured graph and eagerly alike.
    """
    S1, B = len(fbs), fbs[0].batch_size
    q, k, v = (x[n].unflatten(0, (B, S1)) for n in ("q", "k", "v"))
    outs, prev = [], None
    for s, (be, fb) in enumerate(zip(backends, fbs)):
        qs = q[:, s] if prev is None else q[:, s] + 0.5 * prev
        prev = be.forward(qs.contiguous(), k[:, s].contiguous(), v[:, s].contiguous(), layer, fb)
        outs.append(prev)
    return torch.stack(outs, 1).flatten(0, 1)


class DraftSteps:
    """The Sd - 1 draft-decode steps of one round (module doc).  ``lens`` are committed L."""

    def __init__(self, page_size: int, Sd: int = 4, lens=LENS, seed: int = 0, **kw):
        self.Sd, self.S1, self.P = Sd, Sd - 1, page_size
        self.lens = list(lens)
        # the pool covers the last step's keys L + Sd - 1; its "prefix" includes the positions the
        # steps write, which fresh() resets to the sentinel so a step reading an unwritten slot shows
        self.sc = Scenario(ForwardMode.DECODE, page_size=page_size, lens=self.lens, draft_step=Sd - 2,
                           num_draft_tokens=Sd, seed=seed, **{**DIMS, **kw})
        g = torch.Generator().manual_seed(seed + 1)
        T, sc = len(self.lens) * self.S1, self.sc
        rnd = lambda *s: torch.randn(*s, generator=g).to(sc.dtype).to(sc.device)
        self.x = dict(q=rnd(T, sc.num_heads, sc.head_dim), k=rnd(T, sc.num_kv_heads, sc.head_dim),
                      v=rnd(T, sc.num_kv_heads, sc.head_dim))

    def fresh(self) -> Built:
        """A new cache + pool whose draft positions L .. L + Sd - 2 hold the sentinel."""
        built = self.sc.build()
        kf, vf = built.pool.get_flat_kv(0)
        for r, L in zip(built.fb.req_pool_indices.tolist(), self.lens):
            slots = built.kv.req_to_token[r, L: L + self.S1].long()
            kf[slots], vf[slots] = SENTINEL, SENTINEL
        return built

    def live(self, built: Built, idx):
        """``(fb, inputs)``: the all-steps batch of requests ``idx`` and their inputs."""
        rows = built.fb.req_pool_indices.tolist()
        fb = fbatch.draft_decode_steps_batch(built.kv, [rows[j] for j in idx], [self.lens[j] for j in idx], self.Sd)
        t = torch.cat([torch.arange(j * self.S1, (j + 1) * self.S1) for j in idx]).to(self.x["q"].device)
        return fb, {n: x[t] for n, x in self.x.items()}

    def split(self, fb):
        return [fbatch.draft_step_view(fb, s, self.Sd) for s in range(self.S1)]

    def runner(self, built: Built, capture_bs=(1, 2, 4, 8), validate=True, provider=None):
        """``(runner, multi)``: one graph per batch size holding all Sd - 1 steps."""
        multi = FlashAttentionMultiStepBackend(built.pool, built.kv, self.Sd, validate=validate, provider=provider)
        sc, layer = self.sc, built.layer
        shapes = dict(q=((sc.num_heads, sc.head_dim), sc.dtype), k=((sc.num_kv_heads, sc.head_dim), sc.dtype),
                      v=((sc.num_kv_heads, sc.head_dim), sc.dtype))
        runner = GraphRunner(ForwardMode.DECODE, multi.backends,
                             lambda fb, x: draft_chain(multi.backends, layer, self.split(fb), x),
                             kv=built.kv, capture_bs=capture_bs, tokens_per_req=self.S1, inputs=shapes,
                             split=self.split)
        return runner, multi

    def _step_batches(self, built: Built, idx):
        rows = built.fb.req_pool_indices.tolist()
        r, L = [rows[j] for j in idx], [self.lens[j] for j in idx]
        return [fbatch.draft_decode_batch(built.kv, r, L, s) for s in range(self.S1)]

    def eager(self, built: Built, idx, provider=None):
        """Eager FA3, one backend per step: ``(out [B*(Sd-1),H,D], [metadata of step s])``."""
        multi = FlashAttentionMultiStepBackend(built.pool, built.kv, self.Sd, provider=provider)
        fbs = self._step_batches(built, idx)
        mds = [be.init_forward_metadata(fb) for be, fb in zip(multi.backends, fbs)]
        return draft_chain(multi.backends, built.layer, fbs, self.live(built, idx)[1]), mds

    def oracle(self, built: Built, idx, upcast=True) -> torch.Tensor:
        """The oracle chain (keys by slot): fp32 from the inputs, or all in the scenario dtype
        with ``upcast=False``."""
        fbs = self._step_batches(built, idx)
        bes = [OracleBackend(built.pool, built.kv, upcast=upcast) for _ in fbs]
        for be, fb in zip(bes, fbs):
            be.init_forward_metadata(fb)
        x = self.live(built, idx)[1]
        return draft_chain(bes, built.layer, fbs, {n: t.float() for n, t in x.items()} if upcast else x)
