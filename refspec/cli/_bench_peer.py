"""``bench --sections peer``: refspec's graph greedy against the simplest fast loop a user would write.

The **peer** (:class:`PeerGreedy`) is the gpt-fast recipe (pytorch-labs/gpt-fast ``generate.py``
and ``model.py``): a static KV cache ``[B, Hkv, S, D]`` per layer held as module buffers, each
decode step writes its k / v with one indexed write per cache and attends with
``scaled_dot_product_attention`` under a position mask, the whole step (embedding to argmax)
compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (inductor kernels
replayed from a CUDA graph), the tokens kept on the device and read once at the end.  It uses
the same weights, RMSNorm and ``apply_rope`` as :class:`~refspec.model.llama.LlamaModel`.  What
differs from gpt-fast: positions are per request (MT-Bench prompts differ in length), so the
cache write is an ``index_put_`` at ``(b, :, pos_b)`` instead of ``index_copy_`` at one shared
position; prefill runs eagerly, one request at a time.

The section measures, in one process, at B = 1, 4 and 16 on the same prompts and budgets
(``PEER_NEW`` tokens per request, no EOS stop): the peer and refspec's graph greedy
(:func:`~refspec.speculative.greedy.production_greedy`, the fused model, FA3, P = 16), each
timed on its second run (compilation and capture in the first), decode only (prefill excluded
on both sides: ``PeerRun.decode_seconds``; graph greedy's decode window,
:func:`~refspec.cli._timing.time_greedy`), and checks refspec's
tokens against the peer's under T2 (TOL-003, the peer's own top-2 margins; in bf16 with the
demo's measured delta, 2 x the largest |bf16 - fp32| logit difference of a teacher-forced pass
over the prompts, :func:`~refspec.traces.replay.teacher_forced_err`).  Then (``peer spec``
rows, CUDA, B = 1 and 16) spec v2 against the same peer figure: the perfect drafter and the best
real draft (:func:`_spec_rows`), each the median of ``SPEC_REPEATS`` measurements in the
process, with ``x_graph_greedy``: :func:`~refspec.cli._timing.speedup` over graph greedy's window
at the same B (the demo's "x graph greedy"); the tree row's ``x_chain`` is its tok/s over the
chain row of the same draft (issue 24's tree target).  Every spec round at B = 1 is host-bound, so its time
depends on the host's speed: the ``peer host`` row (:func:`host_speed`) measures that host in
the same process (one eager kernel launch, one empty Python loop iteration), to compare runs
made on different machines.  CPU ``--quick``:
the tiny model in fp32, the peer not compiled (what ``make test`` runs to keep this working).

This is a benchmark, not part of the reference: a learner can skip it.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from refspec.model.llama import apply_rope, rope_cos_sin

PEER_NEW = 128  #: tokens per request (the first from the prefill, then PEER_NEW - 1 decode steps)


@dataclass
class PeerRun:
    """``tokens[b]``: request b's output; ``margins[b][i]``: top-2 logit margin of its token i;
    ``decode_seconds``: wall time of the decode steps (after the prefill, synchronized)."""

    tokens: list[list[int]]
    margins: list[list[float]]
    decode_seconds: float


class PeerGreedy(nn.Module):
    """The compiled static-cache greedy loop (module doc) for ``model`` and B requests.

    Args: ``model`` a :class:`~refspec.model.llama.LlamaModel`; ``batch_size`` B; ``max_len`` S,
    the cache length (tokens, >= prompt + budget); ``compile`` (default: on CUDA).
    """

    def __init__(self, model, batch_size: int, max_len: int, compile: bool | None = None):
        super().__init__()
        self.m, c = model, model.config
        p = next(model.parameters())
        shape = (batch_size, c.num_key_value_heads, max_len, c.head_dim)
        for i in range(c.num_hidden_layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=p.dtype, device=p.device))
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=p.dtype, device=p.device))
        self.register_buffer("slots", torch.arange(max_len, device=p.device))
        self.register_buffer("heads", torch.arange(c.num_key_value_heads, device=p.device))
        compile = p.device.type == "cuda" if compile is None else compile
        self.decode = (torch.compile(self.forward, mode="reduce-overhead", fullgraph=True) if compile
                       else self.forward)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor):
        """``ids, pos [R, T]`` int64 (tokens, positions) of cache rows ``rows [R]`` ->
        (argmax ``[R, T]``, top-2 margin ``[R, T]`` fp32)."""
        c, m = self.m.config, self.m.model
        R, T = ids.shape
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = m.embed_tokens(ids).view(R * T, -1)
        cos, sin = rope_cos_sin(pos.flatten(), D, c.rope_theta, h.dtype)
        G = H // Hkv
        mask = (self.slots[None, None, None, :] <= pos[:, None, :, None]).repeat(1, 1, G, 1)  # [R, 1, G*T, S]
        b_idx, h_idx, p_idx = rows[:, None, None], self.heads[None, :, None], pos[:, None, :]
        for i, lay in enumerate(m.layers):
            a = lay.self_attn
            x = lay.input_layernorm(h)
            q = apply_rope(a.q_proj(x).view(R * T, H, D), cos, sin).view(R, T, Hkv, G, D).permute(0, 2, 3, 1, 4)
            k = apply_rope(a.k_proj(x).view(R * T, Hkv, D), cos, sin).view(R, T, Hkv, D).transpose(1, 2)
            v = a.v_proj(x).view(R, T, Hkv, D).transpose(1, 2)
            kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            kc.index_put_((b_idx, h_idx, p_idx), k)
            vc.index_put_((b_idx, h_idx, p_idx), v)
            if R != kc.shape[0]:  # prefill of one request: its cache row
                kc, vc = kc[rows], vc[rows]
            # GQA without copying the cache: the G = H / Hkv query heads of a KV head as G * T rows
            o = F.scaled_dot_product_attention(q.reshape(R, Hkv, G * T, D), kc, vc, attn_mask=mask)
            h = h + a.o_proj(o.view(R, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(R * T, H * D))
            h = h + lay.mlp(lay.post_attention_layernorm(h))
        top2 = self.m.logits(h).float().topk(2, dim=-1)
        return top2.indices[:, 0].view(R, T), (top2.values[:, 0] - top2.values[:, 1]).view(R, T)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> PeerRun:
        """Greedy ``max_new_tokens`` tokens for each of the B prompts (module doc)."""
        dev = self.slots.device
        B = len(prompts)
        toks = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)
        margins = torch.zeros(B, max_new_tokens, device=dev)
        for b, p in enumerate(prompts):  # prefill, eager, one request at a time
            t, mg = self.forward(torch.tensor([p], device=dev), torch.arange(len(p), device=dev)[None],
                                 torch.tensor([b], device=dev))
            toks[b, 0], margins[b, 0] = t[0, -1], mg[0, -1]
        pos = torch.tensor([[len(p)] for p in prompts], device=dev)
        rows = torch.arange(B, device=dev)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for j in range(1, max_new_tokens):
            t, mg = self.decode(toks[:, j - 1:j].clone(), pos.clone(), rows)
            toks[:, j:j + 1].copy_(t)
            margins[:, j:j + 1].copy_(mg)
            pos += 1
        sync()
        dt = time.perf_counter() - t0
        return PeerRun(toks.tolist(), margins.tolist(), dt)


def host_speed(device, n: int = 2000) -> dict:
    """The host's speed in this process: ``launch_us``, microseconds per eager ``torch.add(x, 1,
    out=y)`` on a 4-element int32 tensor of ``device`` (on CUDA a kernel launch; the median of 3
    passes of ``n``, timed without a sync so only the host side counts), and ``python_loop_ns``,
    nanoseconds per iteration of an empty ``for`` loop."""
    x = torch.zeros(4, dtype=torch.int32, device=device)
    y = torch.empty_like(x)
    passes = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            torch.add(x, 1, out=y)
        passes.append(1e6 * (time.perf_counter() - t) / n)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(100 * n):
        pass
    loop_ns = 1e9 * (time.perf_counter() - t) / (100 * n)
    return {"launch_us": sorted(passes)[1], "python_loop_ns": loop_ns}


def bench_peer(device, quick):
    """The peer vs graph greedy at B = 1, 4, 16 (module doc)."""
    from refspec.cli._bench_profile import _workload, capture_sizes
    from refspec.core.tolerance import T2_DELTA, t2
    from refspec.traces.replay import teacher_forced_err
    from refspec.model.fused import FusedLlama
    from refspec.cli._timing import time_greedy

    if quick:
        from refspec.model.llama import LlamaModel, init_random_, tiny_config
        model = init_random_(LlamaModel(tiny_config()), seed=0).to(device).eval()
        prompts_all = [[(7 * i + j) % 128 for j in range(5 + 3 * i)] for i in range(4)]
        batches, M, label = (1, 4), 12, "tiny random model, fp32 (CPU smoke run)"
    else:
        model, prompts_all, label = _workload(16)
        batches, M = (1, 4, 16), PEER_NEW
    fast = FusedLlama(model)
    delta = T2_DELTA
    if next(model.parameters()).dtype != torch.float32:  # bf16: the demo's measured delta (TOL-003)
        m32 = copy.deepcopy(model).float()
        delta = 2 * max(teacher_forced_err(m32, model, list(p)) for p in prompts_all[:4])
        del m32
    rows = [{"section": "peer host", "workload": label, **host_speed(device)}]
    for B in batches:
        prompts = prompts_all[:B]
        S = -(-(max(map(len, prompts)) + M) // 64) * 64
        peer = PeerGreedy(model, B, S, compile=None if device.type == "cuda" else False)
        cap = capture_sizes(B)
        for _ in range(2):  # the second run is timed
            pr = peer.generate(prompts, M)
        g, g_time = time_greedy(fast if device.type == "cuda" else model, prompts, [M] * B, page_size=16,
                                capture_bs=cap, warmup=1)
        verdicts = [t2(g.tokens[b], pr.tokens[b], pr.margins[b], delta=delta) for b in range(B)]
        decode_tokens = B * (M - 1)
        peer_tps, ours = decode_tokens / pr.decode_seconds, g_time.tok_per_s
        rows.append({"section": "peer", "workload": label, "B": B, "tokens": M,
                     "peer_tok_per_s": peer_tps, "graph_greedy_tok_per_s": ours, "x_peer": ours / peer_tps,
                     "t2_vs_peer": f"{sum(ok for ok, _ in verdicts)}/{B} pass", "t2_delta": delta,
                     "t2_notes": "; ".join(sorted({why for _, why in verdicts}))[:160]})
        del peer
        if not quick and B in (1, 16):
            rows += _spec_rows(model, fast, prompts, g, peer_tps, label, g_time)
    return rows


#: each spec row is measured this many times in its process (a fresh engine each, capture included)
#: and reports the median: a B = 1 spec round is host-bound, and the host's speed drifts over
#: seconds (benchmarks/results/h200_peer4.md: one process ran Sd = 3 at 2.25x and Sd = 5 at 4.42x)
SPEC_REPEATS = 3


def _spec_rows(model, fast, prompts, g, peer_tps, label, g_time):
    """Spec v2 (overlap, FA3, graphs, P = 16) against the peer at this B: the perfect drafter
    (the ceiling: a 1-layer draft forward whose proposals are the target's own greedy tokens,
    ``g``, so a = Sd + 1) at Sd = 3, 5, 7 (B = 1; B = 16: Sd = 3), and the best real draft (the trained EAGLE head with
    the real weights, else early-exit:25), Sd = 3, and at B = 1 the head's tree (k = 4, N = 8, overlapped).
    ``host_ms`` / ``wait_ms`` per round (:class:`~refspec.cli._bench_profile.HostTimers`): a
    round whose ``wait_ms`` is ~0 is
    host-bound (the GPU waits for the host's launches)."""
    from refspec.cli._bench_eagle import _head
    from refspec.cli._bench_profile import profile_config
    from refspec.cli import _timing

    B = len(prompts)
    own = {i: list(p) + list(t) for i, (p, t) in enumerate(zip(prompts, g.tokens))}
    head, why = _head(model)
    configs = [(f"perfect drafter Sd={Sd}", "early-exit:1", "perfect", Sd) for Sd in ((3, 5, 7) if B == 1 else (3,))]
    configs.append(("trained EAGLE head Sd=3", head, None, 3) if head is not None else
                   (f"early-exit:25 Sd=3 (no head: {why})", "early-exit:25", None, 3))
    if B == 1 and head is not None:  # issue 24's tree target: tree v2 vs chain v2, the same draft
        configs.append(("trained EAGLE head tree k=4 N=8 Sd=3", head, None, 3))
    rows = []
    for name, draft, drafter, Sd in configs:
        kw = {"reference": own} if drafter else {}
        if "tree" in name:
            kw.update(topk=4, num_draft_tokens=8, overlap=True)  # trees overlap only when asked
        try:
            reps = [profile_config(fast, prompts, version="v2", draft=draft, drafter=drafter, num_steps=Sd,
                                   max_new=PEER_NEW - 1, **kw) for _ in range(SPEC_REPEATS)]
        except Exception as e:  # noqa: BLE001 - one failing configuration is a row, not the end of the run
            rows.append({"section": "peer spec", "B": B, "config": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        r = reps[0]
        mid = {k: statistics.median(x[k] for x in reps) for k in ("wall_ms", "host_ms", "wait_ms", "tok_per_s")
               if all(x.get(k) is not None for x in reps)}
        median_timed = sorted((x["timed"] for x in reps), key=lambda t: t.tok_per_s)[len(reps) // 2]
        same = sum(a[:len(b)] == b[:len(a)] for a, b in zip(r["text"], g.tokens))
        rows.append({"section": "peer spec", "workload": label, "B": B, "config": f"spec v2 {name}",
                     "accept_length": r["accept_length"], "wall_ms_per_round": mid["wall_ms"],
                     "host_ms": mid.get("host_ms"), "wait_ms": mid.get("wait_ms"), "tok_per_s": mid["tok_per_s"],
                     "x_peer": mid["tok_per_s"] / peer_tps, "x_graph_greedy": _timing.speedup(median_timed, g_time),
                     "same_text_as_graph_greedy": f"{same}/{B}",
                     "x_peer_repeats": ", ".join(f"{x['tok_per_s'] / peer_tps:.3g}" for x in reps),
                     "same_over_repeats": all(x["text"] == r["text"] for x in reps)})
    chain = [r for r in rows if r.get("config") == "spec v2 trained EAGLE head Sd=3" and "tok_per_s" in r]
    for r in rows:
        if "tree" in r.get("config", "") and chain and "tok_per_s" in r:
            r["x_chain"] = r["tok_per_s"] / chain[0]["tok_per_s"]
    return rows
