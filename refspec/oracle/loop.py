"""The oracle speculative-decoding loop: one request at a time, dense KV, fp32, written to be read.

This is the truth the production loop (:mod:`refspec.speculative.engine`) is compared with, token for
token and accept count for accept count.  It shares the model and the draft with production and
nothing else: no pages, no ``req_to_token``, no batching, no graphs, and the acceptance rule is
a plain loop here (vectorised there).

Positions (SD-007): KV index = RoPE position in every forward.  The target's KV index j holds
token t_j.  The draft uses the EAGLE shift: draft KV index j consumes token t_(j+1) and the
target hidden h_j (see :mod:`refspec.speculative.engine` for the full rule and SGLang's +1 quirk).

One round at committed length L (t_0..t_(L-1) have target KV; the root t_L is known):

1. draft: d_1 comes from the last draft extend; step s (s = 0..Sd-2) runs the draft at KV index
   L+s on d_(s+1) and yields d_(s+2);
2. verify: the target runs ``[t_L, d_1..d_Sd]`` at KV L..L+N-1, p_i = argmax of row i;
3. accept (SD-001): n = longest prefix with d_i == p_(i-1), a = n + 1; commit d_1..d_n, p_n;
4. draft extend: v1 runs the a committed tokens at draft KV L..L+a-1 with the target hidden of
   verify rows 0..a-1 and keeps its last row (SD-004); v2 runs all N rows at L..L+N-1 on
   ``d_1..d_n, p_n..p_(N-1)`` with every verify row's hidden and keeps row a-1 (SD-005).
   The kept row's argmax is the next round's d_1.

Upstream, the same four steps are SGLang's ``EAGLEWorker.forward_batch_generation`` (v1:
``draft``, ``verify``, ``forward_draft_extend_after_decode``) and ``EAGLEWorkerV2``'s (v2), batched
and paged; their refspec twin is :mod:`refspec.speculative.rounds`:
https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/speculative/eagle_worker.py#L445
https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_worker_v2.py#L1416
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV, draft_kv_dims, target_kv_dims


@dataclass
class GreedyResult:
    """Plain greedy decoding: ``tokens`` generated (ints), ``margins[i]`` = top-2 logit gap at step i."""

    tokens: list[int]
    margins: list[float]


@dataclass
class OracleSpecResult:
    """One request's speculative run: generated ``tokens``; per verify round ``accepts`` (a),
    ``drafts`` (d_1..d_Sd) and ``emitted`` (tokens appended to the output)."""

    tokens: list[int]
    accepts: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)


def _backend(dims, max_len, like: torch.Tensor) -> DenseBackend:
    """A dense cache of ``dims = (layers, Hkv, D, Dv)`` (:func:`~refspec.oracle.dense.target_kv_dims`)."""
    layers, num_kv_heads, head_dim, v_head_dim = dims
    return DenseBackend(DenseKV(layers, max_len, num_kv_heads, head_dim, dtype=like.dtype, device=like.device,
                                v_head_dim=v_head_dim))


def _target_backend(model, max_len):
    return _backend(target_kv_dims(model), max_len, next(model.parameters()))


def _ids(tokens, device) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long, device=device)


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> GreedyResult:
    """Plain greedy decoding of ``model`` (the lossless baseline, SD-002): prefill, then one
    token per forward.  Stops after ``max_new_tokens`` or right after emitting ``eos``.
    Raises: ValueError for an empty prompt or ``max_new_tokens < 1``."""
    _check_request(prompt, max_new_tokens)
    dev = next(model.parameters()).device
    be = _target_backend(model, len(prompt) + max_new_tokens)
    logits, _ = model(_ids(prompt, dev), DenseBatch.span(0, len(prompt), dev), be)
    last, L = logits[-1], len(prompt)
    out, margins = [], []
    while True:
        top2 = last.float().topk(2).values
        out.append(int(last.argmax()))
        margins.append(float(top2[0] - top2[1]))
        if len(out) >= max_new_tokens or out[-1] == eos:
            return GreedyResult(out, margins)
        logits, _ = model(_ids(out[-1:], dev), DenseBatch.span(L, 1, dev), be)
        last, L = logits[-1], L + 1


def _check_request(prompt, max_new_tokens) -> None:
    if not prompt or max_new_tokens < 1:
        raise ValueError(f"a request needs a non-empty prompt and max_new_tokens >= 1, got "
                         f"{len(prompt)} prompt tokens and max_new_tokens={max_new_tokens}")


def _emit(out: list[int], new: list[int], max_new_tokens: int, eos) -> tuple[int, bool]:
    """Append ``new`` to ``out`` until the budget or EOS; returns (tokens appended, finished)."""
    for i, t in enumerate(new):
        out.append(t)
        if len(out) >= max_new_tokens or t == eos:
            return i + 1, True
    return len(new), False


@torch.no_grad()
def speculative_greedy(target, draft, prompt: list[int], *, num_steps: int, max_new_tokens: int,
                       version: str = "v1", eos: int | None = None, drafter=None, accept=None,
                       rid: int = 0) -> OracleSpecResult:
    """EAGLE top-k = 1 speculative decoding of one request (module doc for the round).

    Args:
        target: a :class:`~refspec.model.llama.LlamaModel` or :class:`~refspec.model.deepseek.DeepseekModel`
            (its dense cache: :func:`~refspec.oracle.dense.target_kv_dims`); draft: a draft
            (:mod:`refspec.model.drafts`).
        num_steps: Sd draft tokens per round (N = Sd + 1 verified).  version: "v1" or "v2".
        drafter: optional :class:`~refspec.speculative.drafters.Drafter` overriding d_1..d_Sd.
        accept: optional ``(rid, k) -> a | None`` forcing the k-th round's a (scripted hook).
        rid: the request id drafter / accept are asked about.
    Returns: :class:`OracleSpecResult` (tokens are ints; fp32 on the model's device).
    """
    if version not in ("v1", "v2"):
        raise ValueError(f"version must be 'v1' or 'v2', got {version!r}")
    if num_steps < 1:
        raise ValueError(f"num_steps (Sd) must be >= 1, got {num_steps}")
    _check_request(prompt, max_new_tokens)
    Sd, N = num_steps, num_steps + 1
    dev = next(target.parameters()).device
    max_len = len(prompt) + max_new_tokens + N
    tkv = _target_backend(target, max_len)
    dkv = _backend(draft_kv_dims(draft), max_len, next(target.parameters()))
    use_h = draft.uses_hidden
    # the target hidden states the draft reads: None = the last (EAGLE), else EAGLE-3's layers
    # (the oracle reads the attribute itself: it imports nothing above the core)
    aux = getattr(draft, "aux_layers", None) if draft.uses_hidden else None

    # prefill: target KV 0..p-1 on t_0..t_(p-1); its last row gives t_p (emitted)
    p = L = len(prompt)
    logits, h = target(_ids(prompt, dev), DenseBatch.span(0, p, dev), tkv, aux=aux)
    tokens = list(prompt) + [int(logits[-1].argmax())]  # t_0..t_L, t_L = the root
    res = OracleSpecResult(tokens=[])
    _, done = _emit(res.tokens, tokens[-1:], max_new_tokens, eos)
    # draft prefill (EAGLE shift): draft KV j consumes t_(j+1) and h_j, j = 0..p-1
    dl, dh = draft.forward(_ids(tokens[1:], dev), h if use_h else None, DenseBatch.span(0, p, dev), dkv)
    d1, dhid = int(dl[-1].argmax()), dh[-1]

    while not done:
        # 1. draft
        forced = drafter.propose(rid, tokens, Sd) if drafter is not None else None
        drafts = [forced[0] if forced else d1]
        hid = dhid
        for s in range(Sd - 1):
            dl, hid = draft.forward(_ids(drafts[-1:], dev), hid[None] if use_h else None,
                                    DenseBatch.span(L + s, 1, dev), dkv)
            hid = hid[0]
            drafts.append(forced[s + 1] if forced else int(dl[0].argmax()))
        # 2. verify
        vl, vh = target(_ids([tokens[L]] + drafts, dev), DenseBatch.span(L, N, dev), tkv, aux=aux)
        pred = vl.argmax(-1).tolist()
        # 3. accept
        n = 0
        while n < Sd and drafts[n] == pred[n]:
            n += 1
        forced_a = accept(rid, len(res.accepts)) if accept is not None else None
        if forced_a is not None:
            n = min(max(int(forced_a), 1), N) - 1
        a = n + 1
        new = drafts[:n] + [pred[n]]  # t_(L+1)..t_(L+a); the last one is the bonus
        # 4. draft extend
        if version == "v1":
            dl, dh = draft.forward(_ids(new, dev), vh[:a] if use_h else None, DenseBatch.span(L, a, dev), dkv)
            keep = a - 1  # the last of the a rows
        else:
            cand = new + pred[a:]
            dl, dh = draft.forward(_ids(cand, dev), vh if use_h else None, DenseBatch.span(L, N, dev), dkv)
            keep = a - 1  # row b*N + a_b - 1 with b = 0
        d1, dhid = int(dl[keep].argmax()), dh[keep]
        tokens += new
        L += a
        k, done = _emit(res.tokens, new, max_new_tokens, eos)
        res.accepts.append(a)
        res.drafts.append(drafts)
        res.emitted.append(k)
    return res
