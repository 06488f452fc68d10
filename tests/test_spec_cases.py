"""Public cases B01, B13, B20 (docs/cases.md) through the whole speculative loop."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from refspec.mutants import variants
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative import generate, greedy_reference

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

#: production loops: name -> (version, overlap); "v2-overlap" reads round k after launching k+1
MODES = {"v1": ("v1", False), "v2": ("v2", False), "v2-overlap": ("v2", True)}


@functools.lru_cache(maxsize=None)
def target():
    return init_random_(LlamaModel(tiny_config()), seed=0)


def prompts_of(lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in lens]


def poison_unowned(eng):
    """NaN into every free page and the dummy page 0, in both pools."""
    P = eng.P
    pages = [p for p in range(eng.kv.allocator.num_pages) if p == 0 or not eng.kv.allocator.is_in_use(p)]
    loc = torch.cat([torch.arange(p * P, p * P + P) for p in pages])
    for pool in (eng.target_pool, eng.draft_pool):
        for k, v in zip(pool.k_buffer, pool.v_buffer):
            k.flatten(0, 1)[loc] = float("nan")
            v.flatten(0, 1)[loc] = float("nan")


@pytest.mark.spec("MD-010", "MD-011", "SD-002", "KV-005")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-bs4"])
@pytest.mark.parametrize("mode", list(MODES))
def test_case_B01_draft_tokens_never_spill_into_unreserved_pages(mode, graphs):
    """B01: P = 16, Sd = 3, N = 4, committed [14, 16, 31] (drafts cross into a new page for
    requests 0 and 2, start a fresh page for request 1).  Before draft step 0 each request owns
    ceil((L + N) / P) = [2, 2, 3] pages (v1 transiently: ceil((L + Sd) / P), the same here);
    step k sees L + k + 1 keys, verify L + N; everything unowned is NaN; graph bs 3 in Bg = 4."""
    version, overlap = MODES[mode]
    prompts = prompts_of([14, 16, 31])
    budgets = [9, 9, 9]
    ref = greedy_reference(target(), prompts, budgets)
    checked = []

    def obs(event, eng, **info):
        reqs = info.get("reqs")
        if event == "round_end":
            poison_unowned(eng)
        if event == "prefill":
            poison_unowned(eng)
        if eng.rounds_launched == 0 and event == "draft_decode":  # the first round: L = [14, 16, 31]
            L = [r.seq_len for r in reqs]
            assert L == [14, 16, 31]
            owned = [sum(eng.kv.allocator.is_in_use(p) for p in set(eng.kv.row_pages(r.row, r.seq_len + 4)))
                     for r in reqs]
            assert owned == [2, 2, 3]
            for s, be in enumerate(eng.runners.step_bes):
                assert be.forward_metadata.cache_seqlens_int32[:3].tolist() == [x + s + 1 for x in L]
            checked.append("draft")
        if eng.rounds_launched == 0 and event == "verify":
            md = eng.runners.target_be.forward_metadata
            assert md.cache_seqlens_int32[:3].tolist() == [18, 20, 35]
            assert md.cu_seqlens_q[:4].tolist() == [0, 4, 8, 12] and md.max_seq_len_q == 4
            checked.append("verify")

    res = generate(target(), prompts, version=version, graphs=graphs, capture_bs=(4,), page_size=16,
                   num_steps=3, draft="early-exit", max_new_tokens=budgets, observer=obs,
                   pool_fill=float("nan"), reference=ref, overlap=overlap)
    assert checked == ["draft", "verify"]
    if graphs:
        assert {"draft_decode", "verify"} <= set(res.trace[0].graph)
    assert res.tokens == [ref[i][len(p):] for i, p in enumerate(prompts)]
    ora = generate(target(), prompts, backend="oracle", version=version, num_steps=3, draft="early-exit",
                   max_new_tokens=budgets)
    assert res.drafts == ora.drafts


@pytest.mark.spec("SD-008", "SD-001", "SD-009")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_case_B13_rewind_arithmetic_and_filtering_a_finished_request(mode, graphs):
    """B13: Sd = 3, N = 4, P = 8, prompts [5, 12, 20].  Round 1 acc [3, 0, 1], round 2 acc
    [3, 3, 0]; request 1 then finishes (1 + 1 + 4 = 6 tokens) and is filtered out; round 3 acc
    [2, 1].  Target-KV = draft-KV = prompt + sum(acc + 1) after every round (hand-computed).
    Under overlap request 1 also runs round 3, whose row is dropped (its finish is read late)."""
    version, overlap = MODES[mode]
    prompts = prompts_of([5, 12, 20], seed=13)
    acc = {0: [3, 3, 2], 1: [0, 3], 2: [1, 0, 1]}
    script = {rid: [n + 1 for n in ns] for rid, ns in acc.items()}
    budgets = [30, 6, 30]
    expected = [{0: 9, 1: 13, 2: 22}, {0: 13, 1: 17, 2: 23}, {0: 16, 2: 25}]
    seen, first = [], {}

    def obs(event, eng, **info):
        if event == "draft_decode" or (event == "verify" and eng.Sd == 1):  # checked when L is known
            fb, reqs = info["fb"], info["reqs"]
            first[eng.rounds_launched] = dict(zip([r.rid for r in reqs],
                                                  fb.positions.view(len(reqs), -1)[:, 0].tolist()))
        if event == "round_end":
            tr = info["trace"]
            got = [first[tr.index][rid] for rid in tr.rids]
            assert got == tr.seq_lens, "next draft input must sit at the committed length"
        if event == "round_end" and len(seen) < 3:
            live = {r.rid: (r.target_kv_len, r.draft_kv_len) for r in eng.running}
            done = {r.rid: (r.target_kv_len, r.draft_kv_len) for r in eng.done if r.rid in info["trace"].finished}
            seen.append({rid: kv for rid, kv in {**live, **done}.items() if rid in info["trace"].rids})

    res = generate(target(), prompts, version=version, graphs=graphs, page_size=8, num_steps=3, draft="eagle",
                   accept=script, max_new_tokens=budgets, observer=obs, overlap=overlap)
    assert [{rid: t for rid, (t, d) in s.items()} for s in seen] == expected
    assert all(t == d for s in seen for t, d in s.values())
    assert res.trace[1].finished == [1] and res.trace[2].rids == [0, 2]
    assert res.trace[2].discarded == ([1] if overlap else [])
    assert res.requests[1].tokens and len(res.requests[1].tokens) == 6
    assert [r.accepts[:3] for r in res.requests] == [script[0], script[1], script[2]]
    ora = generate(target(), prompts, backend="oracle", version=version, num_steps=3, draft="eagle",
                   accept=script, max_new_tokens=budgets)
    assert res.tokens == ora.tokens and res.drafts == ora.drafts


def _b20_run(order, mode, graphs, validate=True):
    """Requests of committed lengths 9 and 14 (P = 4, Sd = 3) in the given order -> per rid."""
    version, overlap = MODES[mode]
    prompts = prompts_of([9, 14], seed=20)
    sub = [prompts[i] for i in order]
    locs, pending = [], {}

    def obs(event, eng, **info):
        if event == "draft_decode":  # checked at round_end, when the round's L is known on the host
            fb, reqs = info["fb"], info["reqs"]  # (v1's draft slots are transient: keep the row as it is now)
            loc = fb.out_cache_loc.view(len(reqs), -1)
            pending[eng.rounds_launched] = {r.rid: (eng.kv.req_to_token[r.row].clone(), loc[b].clone())
                                            for b, r in enumerate(reqs)}
            for b, r in enumerate(reqs):
                assert set((loc[b] // eng.P).tolist()) <= set(eng.kv.row_pages(r.row, r.alloc_len + 3))
            locs.append(len(reqs))
        if event == "round_end":
            tr = info["trace"]
            for rid, L in zip(tr.rids, tr.seq_lens):  # step k of request b writes the slot of position L_b + k
                row, loc = pending[tr.index][rid]
                assert torch.equal(loc, row[L:L + loc.shape[0]].long())

    res = generate(target(), sub, version=version, graphs=graphs, page_size=4, num_steps=3, draft="early-exit",
                   max_new_tokens=16, observer=obs, validate=validate, overlap=overlap)
    assert locs
    return {order[i]: (r.tokens, r.accepts, r.drafts) for i, r in enumerate(res.requests)}


@pytest.mark.spec("SD-009")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("version", list(MODES))
def test_case_B20_batch_invariance_alone_batched_reversed(version, graphs):
    """B20: per-request tokens, accepts and every draft token are identical alone (bs = 1),
    batched (bs = 2) and in reversed order; draft step k of request i writes the slot of
    position L_i + k inside its own pages."""
    alone = {**_b20_run([0], version, graphs), **_b20_run([1], version, graphs)}
    together, reversed_ = _b20_run([0, 1], version, graphs), _b20_run([1, 0], version, graphs)
    assert together == alone and reversed_ == alone
    assert max(a for _, acc, _ in alone.values() for a in acc) > 1


@pytest.mark.spec("SD-009")
def test_case_B20_metamorphic_check_catches_step_major_draft_locations():
    """With the step-major bug variant and validation off, only the batch-invariance comparison
    is left to notice: bs = 2 drafts differ from bs = 1 drafts (acceptance at bs = 2 drops)."""
    alone = {**_b20_run([0], "v1", False, validate=False), **_b20_run([1], "v1", False, validate=False)}
    with variants.enabled("draft-loc-step-major"):  # bs = 1 is immune: one request, one layout
        assert {**_b20_run([0], "v1", False, validate=False), **_b20_run([1], "v1", False, validate=False)} == alone
        together = _b20_run([0, 1], "v1", False, validate=False)
    assert together != alone
    assert [together[i][2] for i in (0, 1)] != [alone[i][2] for i in (0, 1)]  # the drafts differ
