"""KV accounting of the production loop, checked after every round (docs/spec/kv.md, SD-008):
INV-PAGE, no committed page freed, exact page counts, target-KV == draft-KV == prompt + sum(a),
no leak at the end; poisoned rejected slots / free pages leave the output unchanged."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative import generate, greedy_reference
from refspec.audits.kv import audit_kv

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

#: production loops: name -> (version, overlap); "v2-overlap" reads round k after launching k+1
MODES = {"v1": ("v1", False), "v2": ("v2", False), "v2-overlap": ("v2", True)}


@functools.lru_cache(maxsize=None)
def micro() -> LlamaModel:
    """1 layer, hidden 32, vocab 64: accounting does not need a bigger model."""
    cfg = tiny_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=64)
    return init_random_(LlamaModel(cfg), seed=3)


@functools.lru_cache(maxsize=None)
def tiny() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0)


def ceil_div(a, b):
    return -(-a // b)


def assert_writes_reserved(eng, fb, reqs, per_req=None):
    """Case B01's allocator rule: every slot a forward writes lies in a page that is allocated
    and belongs to the writing request's own row (reservation before write)."""
    q = fb.q_lens_cpu() if per_req is None else [per_req] * len(reqs)
    loc = fb.out_cache_loc.tolist()
    for b, r in enumerate(reqs):
        pages = {s // eng.P for s in loc[sum(q[:b]):sum(q[:b + 1])]}
        own = set(eng.kv.row_pages(r.row, max(r.alloc_len, r.seq_len + eng.N)))
        assert all(eng.kv.allocator.is_in_use(p) for p in pages), f"request {r.rid} writes into a free page"
        assert pages <= own, f"request {r.rid} writes pages {sorted(pages - own)} outside its row"


def overlap_reserve(L, N, P):
    """The overlap loop's allocate_len for a round launched at host-known L (hand rule, KV-005):
    the round may start at up to L + N and writes N positions from there."""
    return ceil_div(L + 2 * N, P) * P


class Ledger:
    """The test's own accounting, from the trace only: committed length = prompt + sum(a).

    Overlap: at a round's ``round_end`` the next round is already launched, for every live
    request, at the host-known L = this round's start (it was launched before this round was
    read; newcomers: their prompt), so each holds ``overlap_reserve(L)`` slots."""

    def __init__(self, prompts, version, num_steps, page_size, overlap=False):
        self.length = {i: len(p) for i, p in enumerate(prompts)}
        self.version, self.N, self.P, self.overlap = version, num_steps + 1, page_size, overlap
        self.rounds = 0
        self.free_in_round: dict[str, int] = {}
        self.newcomers: set[int] = set()  #: prefilled since the last round_end (in the next round)

    def before_round(self, L):
        """v2: slots a request holds while a round launched at host-known L runs."""
        return overlap_reserve(L, self.N, self.P) if self.overlap else L + self.N

    def at_round_end(self, L_new, a):
        """Slots a live request holds at round_end, its length now L_new after accepting a."""
        if self.overlap:
            return overlap_reserve(L_new - a, self.N, self.P)  # the next round, launched at this one's L
        return L_new if self.version == "v1" else L_new - a + self.N  # v2: L + N from before the round

    def __call__(self, event, eng, **info):
        if event in ("prefill", "draft_decode", "verify", "draft_extend"):
            steps = eng.Sd - 1 if event == "draft_decode" else None
            assert_writes_reserved(eng, info["fb"], info["reqs"], per_req=steps)
        if event == "prefill":
            self.newcomers |= {r.rid for r in info["reqs"]}
        if event in ("draft_decode", "verify", "draft_extend") and self.version == "v2":
            # KV-005: everything allocated before the round, nothing allocated or freed inside it
            if self.free_in_round.get("round") != eng.rounds_launched:  # (overlap: a round_end lies
                self.free_in_round = {"round": eng.rounds_launched}    # between two launches, or not)
            self.free_in_round[event] = eng.kv.allocator.num_free_pages
            for r in info["reqs"]:
                assert r.alloc_len == self.before_round(r.seq_len), (r.rid, r.alloc_len, r.seq_len)
                eng.kv.check_page_contiguous(r.row, r.alloc_len)
            assert len({v for k, v in self.free_in_round.items() if k != "round"}) == 1, self.free_in_round
        if event != "round_end":
            return
        tr = info["trace"]
        self.rounds += 1
        for rid, L, a in zip(tr.rids, tr.seq_lens, tr.num_accept_tokens):
            assert L == self.length[rid], f"request {rid}: round started at L={L}, ledger says {self.length[rid]}"
            self.length[rid] = L + a
        live = {r.rid: r for r in eng.running}
        joined_next = self.newcomers - set(tr.rids) if self.overlap else set()
        self.newcomers = set()
        assert set(live) - joined_next == set(tr.rids) - set(tr.finished)
        expected_pages = 0
        for rid, r in live.items():  # SD-008 / case B13: both KV lengths = prompt + sum(a)
            assert r.target_kv_len == r.draft_kv_len == self.length[rid]
            a = tr.num_accept_tokens[tr.rids.index(rid)] if rid in tr.rids else 0  # 0: a newcomer
            expected_pages += ceil_div(self.at_round_end(self.length[rid], a), self.P)
        alloc = eng.kv.allocator
        assert alloc.num_pages - 1 - alloc.num_free_pages == expected_pages, "pages in use != the ledger"
        audit_kv(eng)


def run_audited(target, prompts, *, version, num_steps, page_size, **kw):
    version, overlap = MODES[version]
    ledger = Ledger(prompts, version, num_steps, page_size, overlap)
    res = generate(target, prompts, backend="fa3", version=version, num_steps=num_steps, page_size=page_size,
                   observer=ledger, overlap=overlap, **kw)
    assert res.free_pages[0] == res.free_pages[1], f"KV-006: pages leaked {res.free_pages}"
    return res, ledger


@pytest.mark.spec("PA-001", "KV-002", "KV-004", "KV-005", "KV-006", "SD-008")
@pytest.mark.parametrize("page_size", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("version", list(MODES))
def test_accounting_after_every_round(version, page_size):
    rng = random.Random(page_size)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (3, 15, 16, 17, 1)]
    res, ledger = run_audited(micro(), prompts, version=version, num_steps=3, page_size=page_size,
                              draft="early-exit", drafter="random", max_new_tokens=[20, 7, 13, 25, 1],
                              max_batch=3, arrivals=[0, 0, 1, 4, 4])
    assert ledger.rounds == len(res.trace) > 5
    assert res.requests[4].tokens and not res.requests[4].accepts  # max_new_tokens 1: finishes at prefill


@pytest.mark.spec("KV-004")
def test_v1_frees_whole_pages_after_the_last_committed_one():
    """P = 4, prompt 5, Sd = 3, scripted a = [1, 4, 2]: verify allocates L..L+3 each round.

    round 1: L 5 -> 6, verify used positions 5..8 (pages of 4..7 and 8..11): keep 2 pages;
    round 2: L 6 -> 10, verify 6..9: keep the page of 8..11: 3 pages;
    round 3: L 10 -> 12, verify 10..13 took the page of 12..15: freed again: 3 pages.
    """
    held = []

    def obs(event, eng, **info):
        if event == "round_end" and eng.running:
            r = eng.running[0]
            held.append(sum(eng.kv.allocator.is_in_use(p) for p in set(eng.kv.row_pages(r.row, 16))))
            assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start - held[-1]
    generate(micro(), [[1, 2, 3, 4, 5]], version="v1", page_size=4, num_steps=3, draft="early-exit",
             accept={0: [1, 4, 2]}, max_new_tokens=1 + 1 + 4 + 2 + 1, observer=obs, shuffle_pages=None)
    assert held[:3] == [2, 3, 3]


@pytest.mark.spec("KV-005", "KV-006")
def test_v2_over_allocates_seq_len_plus_n_and_frees_the_row_at_finish():
    """P = 4, prompt 5, N = 4, a = [1, 4, 2]: rounds run with L + N = 9, 10, 14 allocated: 3, 3, 4 pages."""
    during = []

    def obs(event, eng, **info):
        if event == "verify":
            during.append(eng.free_pages_at_start - eng.kv.allocator.num_free_pages)
    res = generate(micro(), [[1, 2, 3, 4, 5]], version="v2", page_size=4, num_steps=3, draft="early-exit",
                   accept={0: [1, 4, 2]}, max_new_tokens=1 + 1 + 4 + 2, observer=obs)
    assert during == [3, 3, 4]
    assert res.free_pages[0] == res.free_pages[1]


@pytest.mark.spec("KV-005", "KV-006")
def test_overlap_reserves_two_windows_page_aligned_and_frees_the_row_at_finish():
    """P = 4, prompt 5, N = 4, a = [1, 4, 2], budget 8 (finishes in round 2).  Each round is
    launched at the host-known L (the round before it is still in flight) with
    ceil((L + 2N) / P) * P slots:  round 0 at L = 5 (nothing in flight): 16 slots, 4 pages;
    round 1 at L = 5 again (round 0 unread): 4 pages;  round 2 at L = 6: ceil(14 / 4) = 4 pages;
    round 3 at L = 10: ceil(18 / 4) = 5 pages, launched before round 2's finish was read, its
    row dropped; every page is back at the end."""
    during = []

    def obs(event, eng, **info):
        if event == "verify":
            during.append(eng.free_pages_at_start - eng.kv.allocator.num_free_pages)
    res = generate(micro(), [[1, 2, 3, 4, 5]], version="v2", page_size=4, num_steps=3, draft="early-exit",
                   accept={0: [1, 4, 2]}, max_new_tokens=1 + 1 + 4 + 2, observer=obs, overlap=True)
    assert during == [4, 4, 4, 5]
    assert res.requests[0].accepts == [1, 4, 2] and [t.discarded for t in res.trace] == [[], [], [], [0]]
    assert res.free_pages[0] == res.free_pages[1]


ROUNDS = {"total": 0}


@pytest.mark.spec("KV-002", "KV-004", "KV-005", "KV-006", "SD-008", "PA-001")
@settings(deadline=None)
@given(version=st.sampled_from(list(MODES)), page_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
       num_steps=st.integers(1, 4), graphs=st.booleans(), data=st.data())
def test_random_schedules_never_leak(version, page_size, num_steps, graphs, data):
    """Random prompts, budgets, arrivals, batch caps and scripted accept patterns (forced a per
    request-round, teacher forcing); audited after every round; the oracle loop under the same
    script gives the same tokens.  The ci profile's 60 examples run ~1 900 engine rounds
    (``ROUNDS["total"]``); the "thorough" profile runs 10 000 examples."""
    N = num_steps + 1
    n_req = data.draw(st.integers(1, 5), label="requests")
    prompts = [data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=20), label="prompt") for _ in range(n_req)]
    budgets = [data.draw(st.integers(1, 48), label="max_new_tokens") for _ in range(n_req)]
    script = {i: data.draw(st.lists(st.integers(1, N), min_size=60, max_size=60), label="accepts")
              for i in range(n_req)}
    arrivals = [data.draw(st.integers(0, 4), label="arrival") for _ in range(n_req)]
    max_batch = data.draw(st.integers(1, 3), label="max_batch")
    res, ledger = run_audited(micro(), prompts, version=version, num_steps=num_steps, page_size=page_size,
                              draft="early-exit", accept=script, max_new_tokens=budgets, arrivals=arrivals,
                              max_batch=max_batch, graphs=graphs, capture_bs=(2,))
    ROUNDS["total"] += ledger.rounds
    for i, r in enumerate(res.requests):
        assert r.accepts == [min(a, N) for a in script[i][:len(r.accepts)]]
    ora = generate(micro(), prompts, backend="oracle", version=MODES[version][0], num_steps=num_steps,
                   draft="early-exit", accept=script, max_new_tokens=budgets)
    assert res.tokens == ora.tokens


@pytest.mark.spec("SD-002", "KV-004", "KV-005")
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("version", list(MODES))
def test_poisoned_rejected_slots_and_free_pages_change_nothing(version, graphs, page_size):
    """NaN in every slot that holds no committed KV (rejected drafts' slots in kept pages, the
    over-allocated tail, free pages, the dummy page 0), both pools, after every round: the
    tokens, accepts and drafts equal the clean run (nothing stale is ever read, SD-008).
    Overlap: the round in flight has written L .. L + N - 1 and committed an unread part of it,
    so a live request's window up to L + N is spared."""
    version, overlap = MODES[version]
    rng = random.Random(11)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (6, 13, 3)]
    budgets = [12, 9, 14]
    ref = greedy_reference(tiny(), prompts, budgets)

    def poison(event, eng, **info):
        if event != "round_end":
            return
        kv, P, nan = eng.kv, eng.P, float("nan")
        slots = [torch.arange(p * P, p * P + P) for p in range(kv.allocator.num_pages)
                 if p == 0 or not kv.allocator.is_in_use(p)]
        flying = {id(r) for r in eng.in_flight.reqs} if overlap and eng.in_flight else set()
        for r in eng.running:
            maybe = r.seq_len + (eng.N if id(r) in flying else 0)
            committed = set(kv.req_to_token[r.row, :maybe].tolist())
            for p in set(kv.row_pages(r.row, r.alloc_len)):
                slots.append(torch.tensor([s for s in range(p * P, p * P + P) if s not in committed], dtype=torch.long))
        loc = torch.cat(slots)
        for pool in (eng.target_pool, eng.draft_pool):
            for k, v in zip(pool.k_buffer, pool.v_buffer):
                k.flatten(0, 1)[loc] = nan
                v.flatten(0, 1)[loc] = nan

    kw = dict(version=version, graphs=graphs, page_size=page_size, draft="early-exit", max_new_tokens=budgets,
              reference=ref, num_steps=3, overlap=overlap)
    clean = generate(tiny(), prompts, **kw)
    dirty = generate(tiny(), prompts, observer=poison, pool_fill=float("nan"), **kw)
    assert dirty.tokens == clean.tokens == [ref[i][len(p):] for i, p in enumerate(prompts)]
    assert dirty.accepts == clean.accepts and dirty.drafts == clean.drafts
    assert max(a for r in clean.accepts for a in r) > 1, "the schedule never accepted a draft"
