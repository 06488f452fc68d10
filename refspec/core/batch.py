"""``ForwardBatch``: what one forward of one model runs on, and the per-mode builders.

Field meanings follow SGLang's ``ForwardBatch`` (MD-003 and docs/modes/ for ``seq_lens`` per mode).
L is the legend's L: the request's committed length before the forward (at the round's start
in the speculative modes; in plain DECODE the tokens cached before the one being decoded).
K_b is the keys the forward attends, FA3's ``cache_seqlens`` (:mod:`refspec.fa3.metadata`):

========================  ========================================  ==============  ==========================
mode                      ``seq_lens`` (tokens)                     K_b (tokens)    query rows per request q_b
========================  ========================================  ==============  ==========================
DECODE                    L + 1, *including* the token decoded      L + 1           1
EXTEND                    prefix + e                                prefix + e      e (``extend_seq_lens``)
TARGET_VERIFY             L, committed length before verify         L + N           N (``num_draft_tokens``)
DECODE, draft step s      L, committed length                       L + s + 1       1
DRAFT_EXTEND (v1)         L + a (post-accept)                       L + a           a (``num_accept_tokens``)
DRAFT_EXTEND_V2           L + N (post-write)                        L + N           N (``extend_seq_lens``)
========================  ========================================  ==============  ==========================

In every mode the q_b query tokens are the *last* q_b keys of the request, written by this
forward at positions ``K_b - q_b .. K_b - 1`` (MD-005; read it off the table: verify writes
L .. L + N - 1, draft step s writes L + s, v1 draft extend L .. L + a - 1), so the builders set
``out_cache_loc = req_to_token[r, K_b - q_b + i]`` (INV-TAIL, MD-005) and ``positions`` to those
KV indices (refspec's position rule, SD-007).

Shapes: B requests, T = sum(q_b) query tokens.  Dtypes: ``req_pool_indices`` int64 [B],
``seq_lens`` int32 [B] (device) with ``seq_lens_cpu`` int64 [B] (CPU mirror, no device sync),
``out_cache_loc`` int64 [T] (slots), ``positions`` int64 [T] (tokens).  In the overlap loop
(:mod:`refspec.speculative.overlap`) ``seq_lens`` is computed on the device and ``seq_lens_cpu``
holds per-request *upper bounds* (``seq_lens_cpu_is_bound``), built by
:mod:`refspec.core.future_batch`.

Host -> device: the builders here compute rows, lengths and positions on the host and send them
in ONE pinned, non-blocking copy (:func:`refspec.core.transfer.h2d_many`), then gather
``out_cache_loc`` from ``req_to_token`` in one indexing op (no per-request device ops).

**First reading:** the table, :class:`ForwardBatch`'s fields, ``_build`` and the builders from
``decode_batch`` to ``draft_extend_v2_batch``; skip ``check_batch_shapes`` (argument checks), the
overlap loop's ``seq_lens_cpu_is_bound``, the host -> device paragraph, and the last three functions
(all draft-decode steps of a round in one batch: read them with module 20, the round).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from refspec.core.args import count, int_list, tensor
from refspec.core.invariants import require
from refspec.core.kv_cache import KVCache
from refspec.core.modes import ForwardMode
from refspec.core.transfer import h2d, h2d_many


@dataclass
class ForwardBatch:
    """One forward's batch, SGLang's ``ForwardBatch`` fields (B requests, T query tokens).

    ``req_pool_indices`` int64 [B]: each request's ``req_to_token`` row.  ``seq_lens`` int32 [B]
    (device) and ``seq_lens_cpu`` int64 [B] (its host mirror): tokens per request as the mode
    defines them (the module table), which is not always K_b: it counts this forward's tokens in
    DECODE (L + 1), EXTEND (prefix + e) and the two draft extends (L + a, L + N), but not in
    TARGET_VERIFY and draft decode, where it stays the committed L (K_b = L + N, L + s + 1).
    ``out_cache_loc`` int64 [T]: the KV slot each query token writes.  ``positions`` int64 [T]:
    each token's KV index, which is also its RoPE position (SD-007).  Token order is
    request-major.  The optional fields say how many query rows a request has where the mode
    does not fix it (:meth:`q_lens_cpu`, MD-002).  Builders: one function per mode below.
    """

    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None  #: int32 [B]: EXTEND, DRAFT_EXTEND(_V2)
    extend_seq_lens_cpu: list[int] | None = None
    num_accept_tokens: torch.Tensor | None = None  #: int32 [B], a = n + 1 (DRAFT_EXTEND)
    num_accept_tokens_cpu: list[int] | None = None
    num_draft_tokens: int | None = None  #: N (TARGET_VERIFY, DRAFT_EXTEND_V2)
    draft_step: int | None = None  #: s for a draft decode step, else None
    #: overlap loop: ``seq_lens_cpu`` holds upper bounds of ``seq_lens`` (MD-006), not a mirror
    seq_lens_cpu_is_bound: bool = False
    #: MLA EXTEND only (ML-009 / ML-010): None = the absorbed paged path (every MLA forward but
    #: one); False = the non-absorbed MHA pass over the ragged k / v the model passes (all K_b keys
    #: of each request, SGLang's MHA_ONE_SHOT).  SGLang sets it with ``set_attn_attend_prefix_cache``;
    #: its True (the prefix-chunk pass of MHA_CHUNKED_KV) is not modelled
    attn_attend_prefix_cache: bool | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    @property
    def is_draft_decode(self) -> bool:
        return self.forward_mode.is_decode() and self.draft_step is not None

    def q_lens_cpu(self) -> list[int]:
        """Query rows per request (tokens) as the mode defines them (MD-002), from CPU fields."""
        m, B = self.forward_mode, self.batch_size
        if m.is_idle():
            return []
        if m.is_decode():
            return [1] * B
        if m.is_target_verify():
            return [self.num_draft_tokens] * B
        if m.is_draft_extend():
            return list(self.num_accept_tokens_cpu)
        return list(self.extend_seq_lens_cpu)  # EXTEND, DRAFT_EXTEND_V2

    def replace(self, **kw) -> "ForwardBatch":
        return replace(self, **kw)


def check_batch_shapes(fb: "ForwardBatch") -> None:
    """Shape agreement of ``fb``'s per-request and per-token fields (shapes only: no host sync).

    Run by the consumers (FA3 validation, the oracle twin, graph replay), not on construction,
    so that a half-built batch can still be passed around.
    Raises: ValueError naming the field whose length disagrees with ``req_pool_indices``
    (B) or ``out_cache_loc`` (T), or an index field that is not an integer tensor.
    """
    for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions"):
        tensor(f"ForwardBatch.{name}", getattr(fb, name))
    for name in ("extend_seq_lens", "num_accept_tokens"):
        if getattr(fb, name) is not None:
            tensor(f"ForwardBatch.{name}", getattr(fb, name), dim=1)
    for name in ("extend_seq_lens_cpu", "num_accept_tokens_cpu"):
        if getattr(fb, name) is not None:
            int_list(f"ForwardBatch.{name}", getattr(fb, name))
    if fb.num_draft_tokens is not None:
        count("ForwardBatch.num_draft_tokens", fb.num_draft_tokens, 1)
    m = fb.forward_mode
    need = (["num_draft_tokens"] if m.is_target_verify() or m.is_draft_extend_v2() else []) + \
        (["num_accept_tokens_cpu"] if m.is_draft_extend() else []) + \
        (["extend_seq_lens_cpu"] if m == ForwardMode.EXTEND or m.is_draft_extend_v2() else [])
    for name in need if fb.req_pool_indices.numel() else []:  # an empty batch has no query rows to set
        if getattr(fb, name) is None:
            raise ValueError(f"ForwardBatch.{name} is required in {m.name} (it sets the query rows per request)")
    if fb.seq_lens.dim() != 1 or fb.seq_lens_cpu.dim() != 1:
        raise ValueError(f"ForwardBatch.seq_lens {tuple(fb.seq_lens.shape)} and seq_lens_cpu "
                         f"{tuple(fb.seq_lens_cpu.shape)} must be [B]")
    B = fb.req_pool_indices.shape[0] if fb.req_pool_indices.dim() == 1 else None
    if B is None:
        raise ValueError(f"req_pool_indices must be 1-D [B], got shape {tuple(fb.req_pool_indices.shape)}")
    per_req = dict(seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, extend_seq_lens=fb.extend_seq_lens,
                   extend_seq_lens_cpu=fb.extend_seq_lens_cpu, num_accept_tokens=fb.num_accept_tokens,
                   num_accept_tokens_cpu=fb.num_accept_tokens_cpu)
    for name, x in per_req.items():
        if x is not None and len(x) != B:
            raise ValueError(f"ForwardBatch.{name} has {len(x)} entries, req_pool_indices has B = {B}")
    for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions"):
        t = getattr(fb, name)
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"ForwardBatch.{name} must be an integer tensor, got {t.dtype}")
    if fb.positions.shape != fb.out_cache_loc.shape or fb.out_cache_loc.dim() != 1:
        raise ValueError(f"ForwardBatch.out_cache_loc {tuple(fb.out_cache_loc.shape)} and positions "
                         f"{tuple(fb.positions.shape)} must both be [T]")


def _i32(x, device):
    return h2d(list(x), device, torch.int32)


def _check_rows(kv: KVCache, req_pool_indices, seq_lens) -> None:
    """Rows are real (not the dummy row 0, PA-008), in range and distinct (MD-012); B agrees."""
    if len(req_pool_indices) != len(seq_lens):
        raise ValueError(f"req_pool_indices has {len(req_pool_indices)} entries, seq_lens {len(seq_lens)}")
    R = kv.req_to_token.shape[0]
    for r in req_pool_indices:
        require(r != 0, "PA-008", "req_pool_indices holds the reserved dummy row 0")
        if not 0 < r < R:
            raise ValueError(f"req_pool_index {r} outside req_to_token rows [1, {R})")
    require(len(set(req_pool_indices)) == len(req_pool_indices), "MD-012",
            f"req_pool_indices {list(req_pool_indices)} repeat a row")


def _build(mode, kv: KVCache, req_pool_indices, seq_lens, q_lens, written_prefix, check_q=True, **fields):
    """Common part: out_cache_loc / positions = the last q_b KV indices of each request.

    Raises: InvariantError PA-008 (row 0), MD-012 (a repeated row), MD-004 (a query token
    before position 0, i.e. K_b < q_b); ValueError (a row out of range, q_b < 1, a position
    past the ``req_to_token`` width, per-request lists of different lengths, or holding
    something else than ints: every public builder checks its arguments' kinds the same way).
    """
    req_pool_indices, seq_lens = int_list("req_pool_indices", req_pool_indices), int_list("seq_lens", seq_lens)
    _check_rows(kv, req_pool_indices, seq_lens)
    W = kv.req_to_token.shape[1]
    for b, (q, p0) in enumerate(zip(q_lens, written_prefix)):
        if check_q and q < 1:
            raise ValueError(f"{mode.name} request {b}: {q} query tokens, need >= 1")
        require(p0 >= 0, "MD-004", f"{mode.name} request {b} (seq_len {seq_lens[b]}): its {q} query tokens "
                f"would start at position {p0} < 0")
        if p0 + q > W:
            raise ValueError(f"{mode.name} request {b} (seq_len {seq_lens[b]}): positions up to {p0 + q - 1} "
                             f"past the req_to_token width {W}")
    rows = [r for r, q in zip(req_pool_indices, q_lens) for _ in range(q)]
    pos = [t for q, p0 in zip(q_lens, written_prefix) for t in tail_positions(p0, q)]  # on the host
    rpi, seq, rows_t, pos_t = h2d_many([req_pool_indices, seq_lens, rows, pos], kv.device)
    return ForwardBatch(
        forward_mode=mode,
        req_pool_indices=rpi,
        seq_lens=seq.to(torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.long),
        out_cache_loc=kv.req_to_token[rows_t, pos_t].long(),
        positions=pos_t,
        **fields,
    )


def tail_positions(first: int, q: int) -> range:
    """KV indices (= positions, SD-007) of a request's q query tokens: ``first .. first + q - 1``
    (a host ``range`` of q ints), where ``first = K_b - q_b`` is the count of keys already written
    (INV-TAIL, MD-005: the query tokens are the request's last q keys)."""
    return range(first, first + q)


def decode_batch(kv, req_pool_indices, seq_lens):
    """DECODE: ``seq_lens`` = L + 1 counts the new token, which is written at position L."""
    seq_lens = int_list("seq_lens", seq_lens)
    return _build(ForwardMode.DECODE, kv, req_pool_indices, seq_lens, [1] * len(seq_lens),
                  [L - 1 for L in seq_lens])


def draft_decode_batch(kv, req_pool_indices, seq_lens, step):
    """Draft decode step ``s``: ``seq_lens`` L is committed; the draft token goes to L + s."""
    count("step", step, 0)
    seq_lens = int_list("seq_lens", seq_lens)
    return _build(ForwardMode.DECODE, kv, req_pool_indices, seq_lens, [1] * len(seq_lens),
                  [L + step for L in seq_lens], draft_step=step)


def extend_batch(kv, req_pool_indices, prefix_lens, extend_lens):
    """EXTEND: ``seq_lens`` = prefix + e; positions prefix .. prefix + e - 1."""
    prefix_lens = int_list("prefix_lens", prefix_lens, least=0)
    extend_lens = int_list("extend_lens", extend_lens, least=1)
    W, req_pool_indices = kv.req_to_token.shape[1], int_list("req_pool_indices", req_pool_indices)
    if not len(req_pool_indices) == len(prefix_lens) == len(extend_lens) or \
            any(p + e > W for p, e in zip(prefix_lens, extend_lens)):
        raise ValueError(f"req_pool_indices {req_pool_indices}, prefix_lens {prefix_lens}, extend_lens "
                         f"{extend_lens}: one entry each per request, prefix + extend inside the width {W}")
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    dev = kv.device
    return _build(ForwardMode.EXTEND, kv, req_pool_indices, seq, extend_lens, prefix_lens,
                  extend_seq_lens=_i32(extend_lens, dev), extend_seq_lens_cpu=list(extend_lens))


def verify_batch(kv, req_pool_indices, seq_lens, num_draft_tokens):
    """TARGET_VERIFY: ``seq_lens`` L is committed; N tokens at L .. L + N - 1."""
    N = num_draft_tokens
    count("num_draft_tokens", N, 1)
    seq_lens = int_list("seq_lens", seq_lens)
    return _build(ForwardMode.TARGET_VERIFY, kv, req_pool_indices, seq_lens, [N] * len(seq_lens),
                  list(seq_lens), num_draft_tokens=N)


def draft_extend_batch(kv, req_pool_indices, seq_lens, num_accept_tokens, num_draft_tokens=None):
    """DRAFT_EXTEND (v1): ``seq_lens`` = L + a (post-accept); a packed tokens at L .. L + a - 1.

    ``num_draft_tokens`` (N, optional) is informational: v1 metadata never reads it, but when
    given each a_b must lie in ``[1, N]``.
    Raises: InvariantError MD-009 (an a_b outside ``[1, N]``), and those of ``_build``.
    """
    a, seq_lens = int_list("num_accept_tokens", num_accept_tokens), int_list("seq_lens", seq_lens)
    if num_draft_tokens is not None:
        count("num_draft_tokens", num_draft_tokens, 1)
    if len(a) != len(seq_lens):
        raise ValueError(f"num_accept_tokens has {len(a)} entries, seq_lens {len(seq_lens)}")
    top = num_draft_tokens if num_draft_tokens is not None else float("inf")
    require(all(1 <= x <= top for x in a), "MD-009",
            f"num_accept_tokens {a}: each a = n + 1 must lie in [1, N = {num_draft_tokens}]")
    dev = kv.device
    return _build(ForwardMode.DRAFT_EXTEND, kv, req_pool_indices, seq_lens, a,
                  [Lp - ai for Lp, ai in zip(seq_lens, a)],
                  num_accept_tokens=_i32(a, dev), num_accept_tokens_cpu=a,
                  extend_seq_lens=_i32(a, dev), extend_seq_lens_cpu=a, num_draft_tokens=num_draft_tokens)


def draft_extend_v2_batch(kv, req_pool_indices, seq_lens, num_draft_tokens, num_accept_tokens=None):
    """DRAFT_EXTEND_V2: ``seq_lens`` = L + N (post-write); N tokens at L .. L + N - 1.

    ``num_accept_tokens`` (optional) is carried only to select row ``b * N + a_b - 1``
    afterwards (SD-005); the attention metadata never reads it.
    """
    count("num_draft_tokens", num_draft_tokens, 1)
    seq_lens = int_list("seq_lens", seq_lens)
    N, B, dev = num_draft_tokens, len(seq_lens), kv.device
    a = None if num_accept_tokens is None else int_list("num_accept_tokens", num_accept_tokens)
    if a is not None and len(a) != B:
        raise ValueError(f"num_accept_tokens has {len(a)} entries, seq_lens {B}")
    return _build(ForwardMode.DRAFT_EXTEND_V2, kv, req_pool_indices, seq_lens, [N] * B,
                  [L - N for L in seq_lens], num_draft_tokens=N,
                  extend_seq_lens=_i32([N] * B, dev), extend_seq_lens_cpu=[N] * B,
                  num_accept_tokens=None if a is None else _i32(a, dev), num_accept_tokens_cpu=a)


def idle_batch(kv):
    """IDLE: an empty batch."""
    return _build(ForwardMode.IDLE, kv, [], [], [], [])


def draft_decode_steps_batch(kv, req_pool_indices, seq_lens, num_steps):
    """All Sd - 1 draft-decode steps of one round in one batch (the draft-decode graph's input).

    ``out_cache_loc`` / ``positions`` are int64 ``[B * (Sd - 1)]``, request-major: entry
    ``b * (Sd - 1) + s`` is step s of request b, KV index ``L_b + s`` (sglang #7239, FA3's draft
    cache locations: the layout is request-major; a step-major reshape mixes requests, SD-009).
    :func:`draft_step_view` cuts step s.
    """
    count("num_steps", num_steps, 1)
    req_pool_indices, seq_lens = int_list("req_pool_indices", req_pool_indices), int_list("seq_lens", seq_lens)
    _check_rows(kv, req_pool_indices, seq_lens)
    S1, W = num_steps - 1, kv.req_to_token.shape[1]
    for b, L in enumerate(seq_lens):
        if L < 0 or L + S1 > W:
            raise ValueError(f"draft decode request {b}: seq_len {L} with {S1} steps needs positions "
                             f"{L}..{L + S1 - 1} inside the req_to_token width {W}")
    return _build(ForwardMode.DECODE, kv, req_pool_indices, seq_lens, [S1] * len(seq_lens), seq_lens,
                  check_q=False)


def draft_step_view(fb: ForwardBatch, step: int, num_steps: int) -> ForwardBatch:
    """Step ``s`` of a :func:`draft_decode_steps_batch` batch: views, no copies (graph-safe).

    Raises: ValueError unless ``0 <= step < num_steps - 1`` (Python ints only: no host sync).
    """
    S1 = num_steps - 1
    if not 0 <= step < S1:
        raise ValueError(f"draft step {step} outside [0, {S1}) for num_steps = {num_steps}")
    B = fb.batch_size
    return fb.replace(out_cache_loc=draft_step_cut(fb.out_cache_loc, B, S1, step),
                      positions=fb.positions.view(B, S1)[:, step], draft_step=step)


def draft_step_cut(x: torch.Tensor, B: int, S1: int, step: int) -> torch.Tensor:
    """Step ``s`` of a request-major ``[B * (Sd - 1)]`` per-token tensor: a ``[B]`` view.

    symbolic   x = [b0s0, b0s1, ..., b1s0, b1s1, ...]   (entry b * (Sd - 1) + s)
               step s -> x.view(B, Sd - 1)[:, s] = [b0s, b1s, ...]
    example    B = 2, Sd - 1 = 2, x = [10, 11, 20, 21]:  step 0 -> [10, 20], step 1 -> [11, 21]
    Used for ``out_cache_loc`` (sglang #7239: the draft cache locations are request-major; SD-009).
    """
    return x.view(B, S1)[:, step]
