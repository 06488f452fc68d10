"""The graph runner: one graph per captured batch size, padded replay (SGLang ``CudaGraphRunner``).

CG-007: ``capture_bs`` is sorted ascending and captured largest first; a live batch of B
requests replays the graph of ``Bg = min{c in capture_bs : c >= B}`` (CG-007) and a batch
larger than every captured size runs eagerly (the caller asks :meth:`GraphRunner.can_run`).

Padding fills, rewritten on *every* replay so no padded row keeps an earlier batch's values
(CG-005):

===================  ====================================================================
field                padded rows / tokens
===================  ====================================================================
req_pool_indices     0 (the reserved row; ``req_to_token[0]`` is all zeros -> page 0)
seq_lens             1 for DECODE / draft decode / TARGET_VERIFY (SGLang since #7233);
                     W = tokens per request for DRAFT_EXTEND(_V2), so that K >= q holds on
                     padded rows too (CG-010; upstream fills 1 there and relies on FA3
                     returning 0 for the empty causal span)
out_cache_loc        0 (padded tokens write the dummy page 0)
positions            0
num_accept_tokens,   W (#15207 ``160a06cab`` fills ``num_tokens_per_bs``)
extend_seq_lens
inputs (ids, ...)    0
===================  ====================================================================

**One copy per dtype.**  A replay writes its static buffers with ONE ``torch._foreach_copy_``
per dtype (int64: ``req_pool_indices``, ``out_cache_loc``, ``positions``, the token inputs;
int32: ``seq_lens``, ``num_accept_tokens``, ``extend_seq_lens``; the model dtype: ``hidden``):
the real rows from the live batch's device tensors, the padded rows from constant fill
tensors (:func:`pad_rows`), in one list, so the padding is part of the same launch (on CUDA one
multi-tensor kernel per dtype, ``multi_tensor_apply``) instead of a ``copy_`` and a ``fill_``
per field.  Every field the graph reads is device-derived in the overlap loop (the future
map's lengths, the window's slots), so a device-to-device copy is the one that covers them
all.  SGLang writes the same fields with one ``copy_`` / ``fill_`` each
(``CudaGraphRunner.replay_prepare``, python/sglang/srt/model_executor/cuda_graph_runner.py,
`v0.5.5 <https://github.com/sgl-project/sglang/blob/v0.5.5/python/sglang/srt/model_executor/cuda_graph_runner.py#L758>`_;
``DecodeInputBuffers.populate_from_forward_batch`` at
`v0.5.12.post1 <https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/model_executor/cuda_graph_runner.py#L296>`_)
and fuses the metadata writes that follow into one Triton kernel per backend
(``normal_decode_set_metadata`` before the replay / ``draft_extend_set_metadata`` recorded in the graph,
`python/sglang/kernels/ops/attention/metadata.py@v0.5.23 <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/kernels/ops/attention/metadata.py#L505>`_).
The CPU mirrors of the static batch (``seq_lens_cpu``, the per-request lists) are built with
no per-request Python loop.

Graphs run each backend's ``init_forward_metadata_in_graph`` and then ``forward_fn(fb, inputs)``
on the runner's *static* batch and input buffers, so the captured launches read the same memory
at every replay, and the length part of the metadata rewrite (``cache_seqlens``, ``cu_seqlens_k``)
is recorded with them (no host launch per replay for it; the page table and the draft extend's
``cu_seqlens_q`` are still written before each replay by ``init_forward_metadata_replay_cuda_graph``,
:mod:`refspec.fa3.graph_metadata`).  Outputs come back sliced to the real
rows (tokens, or requests for ``rows="requests"``) and cloned.
"""

from __future__ import annotations

import bisect

import torch

from refspec.core.args import count, int_list
from refspec.core.batch import ForwardBatch, check_batch_shapes
from refspec.graphs.capture import make_graph
from refspec.core.invariants import require
from refspec.core.modes import ForwardMode


PER_TOKEN = ("out_cache_loc", "positions")  #: fields with one entry per token (T), not per request (B)


class GraphRunner:
    """Capture ``forward_fn`` per batch size and replay it on padded live batches.

    Args:
        mode: the ForwardMode of every batch this runner takes (DECODE for draft decode).
        backends: FA3 backends whose metadata the graph reads (one, or the Sd - 1 draft steps).
        forward_fn: ``(fb, inputs) -> Tensor | tuple`` reading only ``fb`` / ``inputs`` tensors.
        kv: the :class:`~refspec.core.kv_cache.KVCache` whose ``req_to_token`` the batches index
            (its device is where the static buffers live).
        split: ``fb -> [fb for backend i]`` (default: the same batch for every backend).
        capture_bs: batch sizes to capture.  tokens_per_req: W, token rows per request.
        inputs: ``name -> (trailing shape, dtype)`` of per-token input buffers.
        num_draft_tokens: N (TARGET_VERIFY, DRAFT_EXTEND_V2).
        rows: slice outputs by ``"tokens"`` (T real tokens) or ``"requests"`` (B).
        draft_step: ``ForwardBatch.draft_step`` of the static batch: not None marks a draft-decode
            graph (DECODE run by the draft, :mod:`refspec.core.batch`); the draft-decode runner
            passes 0 and its ``split`` hands each step's backend step s's view.  None otherwise.
    """

    def __init__(self, mode: ForwardMode, backends, forward_fn, *, kv, capture_bs, tokens_per_req,
                 inputs=None, num_draft_tokens=None, split=None, rows="tokens", draft_step=None):
        self.mode, self.backends, self.forward_fn, self.kv = mode, list(backends), forward_fn, kv
        capture_bs = int_list("capture_bs (batch sizes)", list(capture_bs), least=1)
        if not capture_bs:
            raise ValueError("capture_bs must be a non-empty list of batch sizes >= 1, got []")
        count("tokens_per_req", tokens_per_req, 1)
        self.capture_bs = sorted(set(capture_bs))
        self.W, self.N, self.rows = tokens_per_req, num_draft_tokens, rows
        self._split = split  # a plain attribute, not a bound method or a lambda over self: no cycle
        self.draft_step = draft_step
        dev = kv.device
        max_bs = self.capture_bs[-1]
        max_tokens = max_bs * tokens_per_req
        self.buf = dict(
            req_pool_indices=torch.zeros(max_bs, dtype=torch.long, device=dev),
            seq_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            num_accept_tokens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            extend_seq_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            out_cache_loc=torch.zeros(max_tokens, dtype=torch.long, device=dev),
            positions=torch.zeros(max_tokens, dtype=torch.long, device=dev),
        )
        self.inputs = {n: torch.zeros((max_tokens, *shape), dtype=dt, device=dev)
                       for n, (shape, dt) in (inputs or {}).items()}
        for b in self.backends:
            b.init_cuda_graph_state(max_bs, max_tokens)
        self.graphs, self.static = {}, {}
        self.num_replays = 0
        pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        for bs in reversed(self.capture_bs):  # largest first (#4195)
            self._capture(bs, pool)

    def split(self, fb: ForwardBatch) -> list[ForwardBatch]:
        """The batch each backend builds its metadata from (default: ``fb`` for every one)."""
        return self._split(fb) if self._split is not None else [fb] * len(self.backends)

    # ---- padding ----
    def seq_lens_fill(self) -> int:
        """This runner's ``seq_lens`` fill for padded rows (:func:`seq_lens_fill`)."""
        return seq_lens_fill(self.mode, self.W)

    def _static_batch(self, bs: int) -> ForwardBatch:
        b, T = self.buf, bs * self.W
        return ForwardBatch(
            forward_mode=self.mode, req_pool_indices=b["req_pool_indices"][:bs], seq_lens=b["seq_lens"][:bs],
            seq_lens_cpu=torch.zeros(bs, dtype=torch.long), out_cache_loc=b["out_cache_loc"][:T],
            positions=b["positions"][:T], extend_seq_lens=b["extend_seq_lens"][:bs],
            extend_seq_lens_cpu=[self.W] * bs, num_accept_tokens=b["num_accept_tokens"][:bs],
            num_accept_tokens_cpu=[self.W] * bs, num_draft_tokens=self.N, draft_step=self.draft_step)

    def _fill(self, fb: ForwardBatch, live: ForwardBatch | None, bs: int, inputs: dict | None) -> None:
        """Copy the live batch into the static buffers and pad (CG-005) in one copy per dtype
        (module doc); set the CPU mirrors."""
        B = 0 if live is None else live.batch_size
        T = 0 if live is None else live.num_tokens
        fill, W = self.seq_lens_fill(), self.W
        dst, src = [], []
        for name, buf in self.buf.items():
            n, stop = (T, bs * W) if name in PER_TOKEN else (B, bs)
            x = None if live is None else getattr(live, name)
            if x is not None and n:
                dst.append(buf[:n])
                src.append(x)
            if stop > n:  # padded rows (or tokens) exist
                rows, fills = pad_rows(buf, name, n, stop, self.mode, W)
                dst.append(rows)
                src.append(fills)
        for name, buf in self.inputs.items():
            if live is not None and T:
                dst.append(buf[:T])
                src.append(inputs[name])
            if bs * W > T:
                dst.append(buf[T:bs * W])
                src.append(fill_source(buf, 0)[T:bs * W])
        copy_rows(dst, src)
        fb.seq_lens_cpu = padded_cpu(None if live is None else live.seq_lens_cpu, bs, fill)
        fb.seq_lens_cpu_is_bound = live is not None and live.seq_lens_cpu_is_bound
        fb.num_accept_tokens_cpu = _cpu_list(live, "num_accept_tokens_cpu", B, bs, W)
        fb.extend_seq_lens_cpu = _cpu_list(live, "extend_seq_lens_cpu", B, bs, W)

    def _checking(self, B: int, bs: int) -> bool:
        return bs > B and all(getattr(b, "validate", True) for b in self.backends)

    def _check_fills(self, fb: ForwardBatch, B: int, bs: int) -> None:
        """CG-005 on the padded rows of the static batch, before any metadata is built from it:
        every padded row was rewritten this replay (row 0, the runner's fill).  Whether the fill
        value itself is safe is CG-010's check (K >= q on padded rows, after the hooks)."""
        if not self._checking(B, bs):
            return
        require(bool((fb.req_pool_indices[B:] == 0).all()) and bool((fb.seq_lens[B:] == self.seq_lens_fill()).all()),
                "CG-005", lambda: f"padded rows {B}..{bs - 1}: req_pool_indices {fb.req_pool_indices[B:].tolist()}, "
                f"seq_lens {fb.seq_lens[B:].tolist()}")

    def _check_padding(self, fb: ForwardBatch, B: int, bs: int) -> None:
        """CG-010 on the padded rows' metadata (after the capture / replay hooks)."""
        if not self._checking(B, bs):
            return
        for backend in self.backends:
            md = backend.forward_metadata
            q = (md.cu_seqlens_q[1:bs + 1] - md.cu_seqlens_q[:bs])[B:]
            require(bool((md.cache_seqlens_int32[B:bs] >= q).all()), "CG-010",
                    lambda: f"padded rows: K {md.cache_seqlens_int32[B:bs].tolist()} < q {q.tolist()}")

    # ---- capture / replay ----
    def _capture(self, bs: int, pool) -> None:
        fb = self._static_batch(bs)
        self._fill(fb, None, bs, None)
        self._check_fills(fb, 0, bs)
        subs = self.split(fb)
        for sub, backend in zip(subs, self.backends):
            backend.init_forward_metadata_capture_cuda_graph(bs, bs * self.W, sub)
        self._check_padding(fb, 0, bs)
        graph = make_graph(fb.seq_lens.device, pool)
        inputs = {n: t[: bs * self.W] for n, t in self.inputs.items()}
        fwd, pairs = self.forward_fn, list(zip(self.backends, subs))  # the closure must not hold the runner

        def run():  # the metadata rewrite is the graph's own first work (CG-001: into the captured buffers)
            for backend, sub in pairs:
                backend.init_forward_metadata_in_graph(bs, sub)
            return fwd(fb, inputs)
        graph.capture(run)
        self.graphs[bs], self.static[bs] = graph, fb

    def can_run(self, fb: ForwardBatch) -> bool:
        """CG-007: a captured size >= the live batch exists."""
        return fb.forward_mode == self.mode and 0 < fb.batch_size <= self.capture_bs[-1]

    def graph_bs(self, B: int) -> int:
        """The smallest captured batch size >= B (CG-007)."""
        return self.capture_bs[bisect.bisect_left(self.capture_bs, B)]

    def _check_live(self, live: ForwardBatch, inputs: dict | None) -> None:
        """What the captured graph can take: its mode's layout, W rows per request, the inputs."""
        check_batch_shapes(live)
        require(self.can_run(live), "CG-007", f"batch of {live.batch_size} ({live.forward_mode.name}); "
                f"captured {self.capture_bs} for {self.mode.name}")
        m = live.forward_mode
        if (m.is_target_verify() or m.is_draft_extend_v2()) and live.num_draft_tokens != self.N:
            raise ValueError(f"{m.name} batch with num_draft_tokens={live.num_draft_tokens}, "
                             f"the graph was captured for N={self.N}")
        q = [] if m.is_decode() else live.q_lens_cpu()
        require(all(x <= self.W for x in q) and live.num_tokens <= live.batch_size * self.W, "CG-006",
                lambda: f"{m.name}: query lens {q}, {live.num_tokens} tokens; the graph froze "
                f"max_seqlen_q / rows per request W = {self.W}")
        if inputs is not None and not isinstance(inputs, dict):
            raise ValueError(f"replay inputs must be a dict name -> tensor, got {type(inputs).__name__}")
        want = sorted(self.inputs)
        got = sorted(inputs or {})
        if got != want:
            raise ValueError(f"replay inputs {got}, the graph was captured with {want}")
        for name, buf in self.inputs.items():
            x = inputs[name]
            if not isinstance(x, torch.Tensor) or x.dtype != buf.dtype or x.device != buf.device:
                raise ValueError(f"replay input {name!r} must be a {buf.dtype} tensor on {buf.device} like the "
                                 f"captured buffer, got {getattr(x, 'dtype', type(x).__name__)}")
            if tuple(x.shape) != (live.num_tokens, *buf.shape[1:]):
                raise ValueError(f"replay input {name!r} has shape {tuple(x.shape)}, expected "
                                 f"{(live.num_tokens, *buf.shape[1:])} (live tokens, captured trailing shape)")

    def replay(self, live: ForwardBatch, inputs: dict | None = None):
        """Pad ``live`` to its graph's size, rewrite metadata in place, replay, slice real rows.

        Raises: CG-007 (wrong mode, empty or too large a batch), CG-006 (a request with more
        query rows than the captured W), ValueError (another N, or ``inputs`` whose names /
        shapes do not match the capture), and the backends' replay checks.
        """
        self._check_live(live, inputs)
        B = live.batch_size
        bs = self.graph_bs(B)
        fb = self.static[bs]
        self._fill(fb, live, bs, inputs)
        self._check_fills(fb, B, bs)
        for sub, backend in zip(self.split(fb), self.backends):
            backend.init_forward_metadata_replay_cuda_graph(bs, sub, num_real=B)
        self._check_padding(fb, B, bs)
        out = self.graphs[bs].replay()
        self.num_replays += 1
        n = B if self.rows == "requests" else live.num_tokens
        if isinstance(out, tuple):  # None: an output the caller does not read (nothing to copy out)
            return tuple(None if o is None else o[:n].clone() for o in out)
        return out[:n].clone()


# ---- the padding rules (the module table), one function each ----

def seq_lens_fill(mode: ForwardMode, W: int) -> int:
    """``seq_lens`` of a padded row (tokens): 1 for DECODE / draft decode / TARGET_VERIFY (SGLang
    since #7233); W, the rows per request, for DRAFT_EXTEND(_V2), so that K >= q (CG-010)."""
    return W if mode.is_draft_extend(include_v2=True) else 1


def pad_rows(buf: torch.Tensor, name: str, start: int, stop: int, mode: ForwardMode, W: int):
    """The padded rows (or tokens) ``buf[start:stop]`` of field ``name`` and what the replay's
    copy writes there, rewritten on *every* replay (CG-005): ``(buf[start:stop], fills)``, the
    fills ``req_pool_indices`` / ``out_cache_loc`` / ``positions`` 0 (the reserved row and the
    dummy page 0), ``seq_lens`` :func:`seq_lens_fill`, ``num_accept_tokens`` /
    ``extend_seq_lens`` W (sglang #15207 ``160a06cab``: the draft-extend runner fills
    ``num_tokens_per_bs``)."""
    fill = {"seq_lens": seq_lens_fill(mode, W), "num_accept_tokens": W, "extend_seq_lens": W}.get(name, 0)
    return buf[start:stop], fill_source(buf, fill)[start:stop]


_FILLS: dict = {}


def fill_source(buf: torch.Tensor, value: int) -> torch.Tensor:
    """A constant tensor like ``buf`` (shape, dtype, device) holding ``value``, made once and
    shared (never written): the source of padded rows in the replay's copy."""
    key = (buf.device, buf.dtype, tuple(buf.shape), value)
    if key not in _FILLS:
        _FILLS[key] = torch.full_like(buf, value)
    return _FILLS[key]


def padded_cpu(live_cpu: torch.Tensor | None, bs: int, fill: int) -> torch.Tensor:
    """The static batch's ``seq_lens_cpu`` (int64 ``[bs]``, tokens): the live rows, then ``fill``
    per padded row from a constant CPU tensor made once per (count, fill) and shared (never
    written); the live tensor itself when no row is padded (no op)."""
    live_cpu = None if live_cpu is None else live_cpu.long()
    n = bs - (0 if live_cpu is None else len(live_cpu))
    if n == 0:
        return live_cpu
    key = ("cpu", n, fill)
    if key not in _FILLS:
        _FILLS[key] = torch.full((n,), fill, dtype=torch.long)
    return _FILLS[key] if live_cpu is None else torch.cat([live_cpu, _FILLS[key]])


def copy_rows(dst: list, src: list) -> None:
    """``dst[i].copy_(src[i])`` for all i, one ``torch._foreach_copy_`` per destination dtype
    (on CUDA one multi-tensor kernel each when every pair has the same shape and strides, else
    the copies in list order).  Pairs are applied in list order within a dtype."""
    groups: dict = {}
    for d, s in zip(dst, src):
        if d.numel():
            ds, ss = groups.setdefault(d.dtype, ([], []))
            ds.append(d)
            ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def _cpu_list(live, field: str, B: int, bs: int, W: int) -> list[int]:
    """A per-request CPU list of the static batch: the live one's (or W each), then W per padded row."""
    real = None if live is None else getattr(live, field)
    return ([W] * B if real is None else list(real)) + [W] * (bs - B)
