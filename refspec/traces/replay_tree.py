"""``python -m refspec replay TREE_TRACE.json``: re-run every recorded top-k > 1 round's FA3 tree
attention at its recorded KV layout, against the oracle (:mod:`refspec.traces.tree`).

Per round, on one attention layer of the trace's model shapes (H, Hkv, D of ``model_config``),
with random K/V written at every slot the round reads (NaN everywhere else) and random queries:

1. **the recording** satisfies the tree rules it claims (TR-003 / TR-004 / TR-005 / TR-006,
   PA-002 for its page table, TR-015 for its branch slots), one line per violation
   (:func:`~refspec.traces.tree.tree_round_failures`); every page id it names lies in
   the recorded pool of ``num_pages`` pages, outside page 0 (PA-011 / PA-008; a round that breaks
   this is not run), and its accepted path is the greedy walk over its recorded ``draft_tokens``
   / ``target_predict``, emitting the request's output tokens (TR-003 / TR-006,
   :mod:`refspec.traces.tree_checks`);
2. **draft decode** (S > 1): the committed tail copied into branches t >= 1 (TR-015), then for
   every step s the FA3 tree backend (prefix + expand cascade, LSE merge) on the recorded
   ``draft_cache_loc`` vs the slot oracle: row t sees the prefix and its own steps 0..s (TR-008);
3. **TARGET_VERIFY**: the FA3 tree backend on the recorded ``custom_mask`` / ``positions``; its
   prefix page table must equal the recorded one (T0, TR-010), its output the slot oracle's
   over the prefix + each node's ancestors and itself *from the recorded parents* (TR-004,
   TR-012: a mask that lets a node see a sibling fails here and in step 1);
4. **compaction + draft extend**: v1: the production compaction (TR-017) moves the accepted
   path's KV to the first a verify slots (checked against the pre-compaction KV, T0), then the
   v1 DRAFT_EXTEND over the a accepted tokens, FA3 vs the oracle backend (SD-004).  v2: the v2
   move into the recorded ``moved_to`` slots (TR-020), then DRAFT_EXTEND_V2 over all N window
   rows and the recorded ``kept_row`` (TR-021), :mod:`refspec.traces.replay_tree_v2`; step 1 also
   checks the v2 recording (reserve, branch slots inside it: TR-020).

5. **graphs**: the same verify and draft decode replayed through the production tree graph
   runner, captured once for the trace's ``capture_bs`` and rewritten in place every round
   (TR-018, :mod:`refspec.traces.replay_tree_graphs`).

Outputs are compared under T1 (TOL-002: the fp32 oracle, and its own low-precision run for the
budget); metadata and moved KV bitwise.  Exit status 1 on any failure.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from refspec.traces.replay_tree_v2 import extend_vs_oracle, move_and_extend_v2
from refspec.core.batch import draft_extend_batch
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.layer import AttentionLayer
from refspec.core.modes import ForwardMode
from refspec.core.tolerance import t1
from refspec.fa3.kernel import select_provider
from refspec.fa3.tree_backend import FlashAttentionTreeBackend, TreeDraftBatch, TreeVerifyBatch, draft_step_batch
from refspec.oracle.slots import attention_over_slots
from refspec.speculative.tree import kv as tree_kv
from refspec.traces.tree import ancestors_and_self, from_runs, tree_round_failures, tree_v2_round_failures
from refspec.traces.tree_checks import acceptance_failures, page_id_failures, pool_size_problem, round_tokens


@dataclass
class TreeRoundCheck:
    """One replayed round: the worst T1 error as % of budget per phase, and every failure line."""

    index: int
    rids: list[int]
    seq_lens: list[int]
    num_accept_tokens: list[int]
    worst: dict = field(default_factory=dict)  #: phase -> worst % of the T1 budget
    failures: list[str] = field(default_factory=list)
    graphs: list[str] = field(default_factory=list)  #: phases also replayed through a captured graph


@dataclass
class TreeReplayReport:
    trace_path: str
    device: str
    dtype: str
    provider: str
    shapes: str
    rounds: list[TreeRoundCheck]
    seconds: float = 0.0
    graphs: bool = False  #: verify and draft decode also replayed through the production tree graphs

    @property
    def ok(self) -> bool:
        return all(not r.failures for r in self.rounds)

    def to_markdown(self) -> str:
        yes = lambda b: "yes" if b else "**NO**"
        cell = lambda r, ph: "-" if ph not in r.worst else f"{r.worst[ph]:.1f} %"
        lines = [f"# Replay of the tree trace `{self.trace_path}`", "",
                 f"device `{self.device}`, dtype `{self.dtype}`, FA3 provider `{self.provider}`, "
                 f"{'eager and CUDA graphs' if self.graphs else 'eager'}; one attention "
                 f"layer {self.shapes}, random K/V at the recorded slots; worst error per phase as % of the T1 "
                 f"budget (TOL-002)", "",
                 "| round | batch (rids) | seq_lens | a | draft decode | verify | draft extend | graphs | ok |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in self.rounds:
            lines.append(f"| {r.index} | {r.rids} | {r.seq_lens} | {r.num_accept_tokens} | {cell(r, 'draft')} | "
                         f"{cell(r, 'verify')} | {cell(r, 'extend')} | {','.join(r.graphs) or '-'} | "
                         f"{yes(not r.failures)} |")
        bad = [f"- round {r.index}: {f}" for r in self.rounds for f in r.failures]
        lines += ([""] + bad[:40] + ([f"- ... {len(bad) - 40} more"] if len(bad) > 40 else [])) if bad else []
        lines += ["", f"**{'PASS' if self.ok else 'FAIL'}** ({len(self.rounds)} rounds)", ""]
        return "\n".join(lines)


def _compare(check: TreeRoundCheck, phase: str, out, q, pool, slots, what: str) -> None:
    """T1 of ``out`` against the slot oracle over ``slots`` (fp32, and q's dtype for the budget)."""
    k, v = pool.get_flat_kv(0)
    ref = attention_over_slots(q, k, v, slots, out_dtype=torch.float32)
    low = None if q.dtype == torch.float32 else attention_over_slots(q, k, v, slots, upcast=False)
    verdict = t1(out, ref, low)
    check.worst[phase] = max(check.worst.get(phase, 0.0), verdict.pct)
    if not verdict.ok:
        inv = {"draft": "TR-008", "verify": "TR-012", "extend": "SD-004"}[phase]
        check.failures.append(f"[{inv}] {what}: FA3 vs oracle {verdict}")


class _Round:
    """The KV cache and pools of a replay, loaded with one round at a time: its rows as recorded,
    random K/V at the slots it reads, NaN everywhere else.  One cache for every round, so that
    graphs captured once (:mod:`refspec.traces.replay_tree_graphs`) see each round's rows."""

    def __init__(self, cfg, num_rows, width, num_pages, device, dtype):
        mc, P = cfg["model_config"], cfg["page_size"]
        self.layer = AttentionLayer(0, mc["num_attention_heads"], mc["num_key_value_heads"], mc["head_dim"])
        self.P, self.k, self.S, self.N = P, cfg["topk"], cfg["num_steps"], cfg["num_draft_tokens"]
        self.device, self.dtype = device, dtype
        self.kv = KVCache(num_rows, width, num_pages, P, device=device)
        hkv, D = self.layer.num_kv_heads, self.layer.head_dim
        self.target, self.draft = (KVPool(1, num_pages, P, hkv, D, dtype=dtype, device=device, fill=float("nan"))
                                   for _ in range(2))

    def load(self, entries, seq_lens, gen) -> None:
        """Round ``entries`` (its ``tree`` list) at committed lengths ``seq_lens``."""
        self.gen = gen
        self.rows = [e["req_pool_index"] for e in entries]
        self.Ls, self.slots = list(seq_lens), [from_runs(e["req_to_token"]) for e in entries]
        self.kv.req_to_token.zero_()
        self.kv.req_to_token_cpu.zero_()
        for r, s in zip(self.rows, self.slots):
            self.kv.req_to_token[r, :len(s)] = torch.tensor(s, dtype=self.kv.req_to_token.dtype)
            self.kv.req_to_token_cpu[r, :len(s)] = torch.tensor(s, dtype=self.kv.req_to_token_cpu.dtype)
        for buf in self.target.k_buffer + self.target.v_buffer + self.draft.k_buffer + self.draft.v_buffer:
            buf.fill_(float("nan"))
        for s, L in zip(self.slots, self.Ls):
            self.write(self.target, s)  # the committed prefix and the N verify slots
            self.write(self.draft, s[:L])  # the draft model's committed prefix

    def randn(self, *shape):
        return torch.randn(shape, generator=self.gen).to(device=self.device, dtype=self.dtype)

    def write(self, pool, slots: list[int]) -> None:
        loc = torch.tensor(slots, dtype=torch.long, device=self.device)
        pool.set_kv_buffer(0, loc, self.randn(len(slots), self.layer.num_kv_heads, self.layer.head_dim),
                           self.randn(len(slots), self.layer.num_kv_heads, self.layer.head_dim))

    def batch_fields(self):
        dev = self.device
        return dict(req_pool_indices=torch.tensor(self.rows, dtype=torch.long, device=dev),
                    seq_lens=torch.tensor(self.Ls, dtype=torch.int32, device=dev), seq_lens_cpu=torch.tensor(self.Ls))


def _draft_decode(rd: _Round, entries, check, provider):
    """Step 2 of the module doc: tail copies (TR-015), then each draft step vs the oracle (TR-008).
    Returns ``(fb, [q per step], [(eager output, key slots per row) per step])``."""
    k, S, P = rd.k, rd.S, rd.P
    loc = [x for e in entries for branch in e["draft_cache_loc"] for x in branch]
    src, tgt = [], []
    for e, s, L in zip(entries, rd.slots, rd.Ls):
        lp = L % P if P > 1 else 0
        for branch in e["draft_cache_loc"][1:]:
            src += s[L - lp:L]
            tgt += list(range(branch[0] - lp, branch[0]))
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=rd.device)  # noqa: E731
    tree_kv.move_kv_cache(rd.draft, as_t(tgt), as_t(src))
    rd.write(rd.draft, loc)  # every step's K/V (row t at step s may read its steps 0..s only)
    pos = [L + j for L in rd.Ls for _ in range(k) for j in range(S)]
    fb = TreeDraftBatch(forward_mode=ForwardMode.DECODE, out_cache_loc=as_t(loc), positions=as_t(pos), topk=k,
                        num_steps=S, draft_cache_loc=as_t(loc), **rd.batch_fields())
    qs, outs = [], []
    for step in range(S - 1):
        be = FlashAttentionTreeBackend(rd.draft, rd.kv, topk=k, num_steps=S, speculative_step_id=step,
                                       provider=provider)
        be.init_forward_metadata(fb)
        q = rd.randn(len(rd.rows) * k, rd.layer.num_heads, rd.layer.head_dim)
        out = be.forward(q, None, None, rd.layer, draft_step_batch(fb, step))
        slots = [s[:L] + e["draft_cache_loc"][t][:step + 1]
                 for e, s, L in zip(entries, rd.slots, rd.Ls) for t in range(k)]
        _compare(check, "draft", out, q, rd.draft, slots, f"draft decode step {step}")
        qs.append(q)
        outs.append((out, slots))
    return fb, qs, outs


def _verify(rd: _Round, entries, check, provider):
    """Step 3: TARGET_VERIFY on the recorded mask and positions; returns ``(fb, q, (eager output, key
    slots per row))``."""
    N, dev = rd.N, rd.device
    mask = []
    for e, L in zip(entries, rd.Ls):
        for row in e["mask"]:
            mask += [True] * L + [c == "1" for c in row]
    node_slots = torch.tensor([x for s, L in zip(rd.slots, rd.Ls) for x in s[L:L + N]], dtype=torch.long,
                              device=dev)
    fb = TreeVerifyBatch(forward_mode=ForwardMode.TARGET_VERIFY, out_cache_loc=node_slots,
                         positions=torch.tensor([p for e in entries for p in e["positions"]], device=dev),
                         num_draft_tokens=N, topk=rd.k, custom_mask=torch.tensor(mask, device=dev),
                         **rd.batch_fields())
    be = FlashAttentionTreeBackend(rd.target, rd.kv, topk=rd.k, num_draft_tokens=N, provider=provider)
    be.init_forward_metadata(fb)
    for b, (e, L) in enumerate(zip(entries, rd.Ls)):
        got = be.forward_metadata.page_table[b, :-(-L // rd.P)].tolist()
        if got != e["page_table"]:
            check.failures.append(f"[TR-010] request {b}: the replayed prefix page table {got} != the recorded "
                                  f"{e['page_table']}")
    q = rd.randn(len(rd.rows) * N, rd.layer.num_heads, rd.layer.head_dim)
    out = be.forward(q, None, None, rd.layer, fb)
    slots = [s[:L] + [s[L + j] for j in ancestors_and_self(e["parents"], i)]
             for e, s, L in zip(entries, rd.slots, rd.Ls) for i in range(N)]
    _compare(check, "verify", out, q, rd.target, slots, "tree verify (nodes: prefix + ancestors + self)")
    return fb, q, (out, slots)


def _compact_and_extend(rd: _Round, entries, accepts, node_slots, check, provider) -> None:
    """Step 4: TR-017 compaction of the target KV, then the v1 draft extend (FA3 vs oracle)."""
    N, S, dev = rd.N, rd.S, rd.device
    flat_k = rd.target.get_flat_kv(0)[0]
    before = flat_k.clone()
    accept_index = torch.full((len(rd.rows), S + 1), -1, dtype=torch.long, device=dev)
    for b, e in enumerate(entries):
        accept_index[b, :len(e["accept_path"])] = torch.tensor([b * N + i for i in e["accept_path"]])
    n = torch.tensor([a - 1 for a in accepts], device=dev)
    Lt = torch.tensor(rd.Ls, device=dev)
    src, _, to_free = tree_kv.get_src_tgt_cache_loc(Lt, node_slots, accept_index, n, N, rd.P)
    tgt, _ = tree_kv.get_target_cache_loc(node_slots, n, to_free, N)
    tree_kv.move_kv_cache(rd.target, tgt, src)
    for b, (e, s, L) in enumerate(zip(entries, rd.slots, rd.Ls)):
        want = before[[s[L + i] for i in e["accept_path"]]]
        got = flat_k[s[L:L + len(e["accept_path"])]]
        if not torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)):
            check.failures.append(f"[TR-017] request {b}: positions L..L+a-1 do not hold the accepted path "
                                  f"{e['accept_path']}'s KV after compaction")
    fb = draft_extend_batch(rd.kv, rd.rows, [L + a for L, a in zip(rd.Ls, accepts)], accepts, num_draft_tokens=S + 1)
    extend_vs_oracle(rd, fb, sum(accepts), check, provider, "[SD-004] draft extend over the a accepted tokens")


def replay_tree_trace(trace: dict, *, device="cpu", dtype=torch.float32, seed=0, trace_path="",
                      progress=None, graphed: bool = True) -> TreeReplayReport:
    """Replay every round of a tree trace (module doc); returns the report.

    Shapes: one layer of ``model_config``'s heads, a KV pool of the recorded ``num_pages`` pages
    (P = ``page_size`` tokens each; ValueError past the recording engine's pool), the recorded
    rows; ``dtype`` is the production wing's (the oracle is fp32, plus its own ``dtype`` run for
    the T1 budget).  ``progress(label)`` is called per round.
    ``graphed``: also replay each round's verify and draft decode through the production tree
    graphs (:mod:`refspec.traces.replay_tree_graphs`; not with the emulator on CUDA, which syncs).
    """
    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    cfg = trace["config"]
    v2 = cfg["version"] == "v2"
    provider = select_provider(torch.device(device))
    rounds = trace["rounds"]
    if (why := pool_size_problem(trace)) is not None:  # load_trace refuses it too
        raise ValueError(why)
    page_rules = [[page_id_failures(e, cfg) for e in rd["tree"]] for rd in rounds]  # PA-008 / PA-011
    ok = [e for rd, bad in zip(rounds, page_rules) for e, b in zip(rd["tree"], bad) if not b]
    width = max((sum(c for _, c in e["req_to_token"]) for e in ok), default=1)
    num_rows = max((e["req_pool_index"] for e in ok), default=1) + 1  # rows 1 .. max_batch (PA-011)
    rnd = _Round(cfg, num_rows, width, cfg["num_pages"], device, dtype)  # the recording's pool
    graphs = None
    if graphed and not (torch.device(device).type == "cuda" and provider == "emulator"):  # the emulator syncs
        from refspec.traces.replay_tree_graphs import TreeGraphs

        graphs = TreeGraphs(rnd, provider, cfg["capture_bs"])
    checks = []
    for i, (rd, toks) in enumerate(zip(rounds, round_tokens(trace))):
        if progress:
            progress(f"round {i}")
        check = TreeRoundCheck(i, rd["rids"], rd["seq_lens"], rd["num_accept_tokens"])
        entries = rd["tree"]
        for rid, pages in zip(rd["rids"], page_rules[i]):
            check.failures += [f"request {rid}: {f}" for f in pages]
        if any(page_rules[i]):
            checks.append(check)  # slots outside the pool: nothing of this round can be loaded
            continue
        for b, (e, L, a) in enumerate(zip(entries, rd["seq_lens"], rd["num_accept_tokens"])):
            rules = tree_round_failures(e, L, a, cfg) + (tree_v2_round_failures(e, L, a, cfg) if v2 else [])
            rules += acceptance_failures(e, *toks[b])
            check.failures += [f"request {rd['rids'][b]}: {f}" for f in rules]
        rnd.load(entries, rd["seq_lens"], torch.Generator().manual_seed(seed * 100003 + i))
        try:
            draft = _draft_decode(rnd, entries, check, provider) if cfg["num_steps"] > 1 else None
            verify = _verify(rnd, entries, check, provider)
            if graphs is not None:
                graphs.check_round(check, verify, draft)
            step4 = move_and_extend_v2 if v2 else _compact_and_extend
            step4(rnd, entries, rd["num_accept_tokens"], verify[0].out_cache_loc, check, provider)
        except Exception as e:  # noqa: BLE001 - an InvariantError (validation) or a crash is a failure of this round
            check.failures.append(f"the FA3 wing raised {type(e).__name__}: {e}")
        checks.append(check)
    mc = cfg["model_config"]
    shapes = f"H={mc['num_attention_heads']}, Hkv={mc['num_key_value_heads']}, D={mc['head_dim']}"
    return TreeReplayReport(trace_path, str(device), str(dtype).replace("torch.", ""), provider, shapes, checks,
                            time.perf_counter() - t0, graphs is not None)
