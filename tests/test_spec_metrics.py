"""Acceptance (SD-001), accept length (SD-003), host syncs per round (v1 vs v2), and the
scripted-accept hook (record / replay)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative import generate, greedy_reference
from refspec.speculative.accept import ScriptedAccept, committed_candidates, num_correct_drafts

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

_rng = random.Random(3)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (4, 11, 7)]
SD, N = 3, 4
BUDGETS = [1 + 3 * N, 1 + 2 * N, 10]  # requests 0 and 1: whole rounds of N tokens after the prefill token


@functools.lru_cache(maxsize=None)
def target():
    return init_random_(LlamaModel(tiny_config()), seed=0)


@functools.lru_cache(maxsize=None)
def reference():
    return greedy_reference(target(), PROMPTS, [b + 8 for b in BUDGETS])  # + N: last-round drafts


#: production loops: name -> (version, overlap); "v2-overlap" reads round k after launching k+1
MODES = {"v1": ("v1", False), "v2": ("v2", False), "v2-overlap": ("v2", True)}


def run(**kw):
    if kw.get("version") in MODES:
        kw["version"], kw["overlap"] = MODES[kw["version"]]
    kw.setdefault("draft", "eagle")
    return generate(target(), PROMPTS, num_steps=SD, max_new_tokens=BUDGETS, reference=reference(), **kw)


@pytest.mark.spec("SD-001")
def test_greedy_accept_rule_by_hand():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    predict = torch.tensor([[5, 6, 9, 1], [5, 6, 7, 8], [4, 6, 7, 8], [5, 6, 7, 8]])
    n = num_correct_drafts(drafts, predict)
    assert n.tolist() == [2, 3, 0, 0]  # a mismatch stops the prefix even if later drafts match
    c = committed_candidates(drafts, predict, n)
    assert c.tolist() == [[5, 6, 9, 1], [5, 6, 7, 8], [4, 6, 7, 8], [5, 6, 7, 8]]
    forced = committed_candidates(drafts, predict, torch.tensor([0, 0, 2, 3]))  # scripted n
    assert forced.tolist() == [[5, 6, 9, 1], [5, 6, 7, 8], [5, 6, 7, 8], [1, 6, 7, 8]]  # d_1..d_n, then p


@pytest.mark.spec("SD-003")
@pytest.mark.parametrize("backend,version", [("oracle", "v1"), ("fa3", "v1"), ("fa3", "v2-overlap")])
def test_perfect_drafter_accepts_everything(backend, version):
    res = run(backend=backend, drafter="perfect", page_size=4, version=version)
    assert all(a == N for r in res.requests for a in r.accepts)
    # requests 0, 1: 1 + k*N tokens -> k full rounds of N (hand-computed), accept length exactly N
    assert [r.verify_rounds for r in res.requests[:2]] == [3, 2]
    assert [r.accept_length for r in res.requests[:2]] == [4.0, 4.0]
    # request 2: 10 tokens = 1 + 4 + 4 + 1: the last round is truncated at the budget
    assert res.requests[2].emitted == [4, 4, 1] and res.requests[2].accept_length == 3.0
    assert res.accept_length == (12 + 8 + 9) / (3 + 2 + 3)
    assert res.send_one_accept_length == (13 + 9 + 10) / (3 + 2 + 3)  # SGLang's counts the prefill token


@pytest.mark.spec("SD-003")
@pytest.mark.parametrize("backend,version", [("oracle", "v2"), ("fa3", "v2"), ("fa3", "v2-overlap")])
def test_adversarial_drafter_accepts_nothing(backend, version):
    res = run(backend=backend, drafter="adversarial", page_size=4, version=version)
    assert all(a == 1 for r in res.requests for a in r.accepts)
    assert [r.verify_rounds for r in res.requests] == [b - 1 for b in BUDGETS]
    assert res.accept_length == 1.0


@pytest.mark.spec("SD-003")
@pytest.mark.parametrize("version", list(MODES))
def test_random_drafter_accept_length_in_range(version):
    res = run(drafter="random", page_size=2, version=version)
    lens = [r.accept_length for r in res.requests]
    assert all(1.0 <= x <= N for x in lens) and len(set(lens)) > 1
    assert res.tokens == [reference()[i][len(p):len(p) + BUDGETS[i]] for i, p in enumerate(PROMPTS)]


@pytest.mark.spec("KV-005")
@pytest.mark.parametrize("graphs", [False, True])
def test_host_syncs_per_round_v1_one_v2_zero(graphs):
    for version, per_round in (("v1", 1), ("v2", 0), ("v2-overlap", 0)):
        res = run(drafter="random", page_size=4, version=version, graphs=graphs)
        assert [t.host_syncs for t in res.trace] == [per_round] * len(res.trace)
        assert res.host_syncs.get("in_round", 0) == per_round * len(res.trace)
        assert res.host_syncs.get("post_round", 0) == (len(res.trace) if version != "v1" else 0)
        assert res.host_syncs["prefill"] == 1  # one prefill of all three requests


@pytest.mark.spec("KV-005", "MD-006")
@pytest.mark.parametrize("version", list(MODES))
def test_v2_round_metadata_is_cpu_known_before_the_round(version):
    """Same batch, first-round a = 1 vs a = N (scripted): every forward's CPU-side metadata in
    that round is identical for v2 (it depends on L only), while v1's draft extend differs.
    Overlap: round 1 too is built before round 0's a is read, from the bound L + N, so the
    first TWO rounds' CPU metadata are identical."""
    seen = {}
    first_rounds = 2 if version == "v2-overlap" else 1

    def recorder(key):
        def obs(event, eng, **info):
            if event in ("draft_decode", "verify", "draft_extend") and eng.rounds_launched < first_rounds:
                fb = info["fb"]
                seen.setdefault(key, []).append((event, fb.seq_lens_cpu.tolist(), fb.q_lens_cpu()))
        return obs
    for key, a in (("low", 1), ("high", N)):
        run(version=version, page_size=4, accept={i: [a] for i in range(3)}, observer=recorder(key))
    assert len(seen["low"]) == 3 * first_rounds
    same = seen["low"] == seen["high"]
    assert same if version != "v1" else not same


@pytest.mark.spec("SD-002", "SD-003")
@pytest.mark.parametrize("version", list(MODES))
def test_record_and_replay_a_schedule(version):
    """Record a run's accept counts, replay them with a scripted accept + the perfect drafter:
    the same schedule (batches, lengths, a per round) and still the greedy tokens."""
    rec = run(drafter="random", page_size=4, version=version, max_batch=2, arrivals=[0, 1, 1])
    rep = run(drafter="perfect", page_size=4, version=version, max_batch=2, arrivals=[0, 1, 1],
              accept=rec.accept_table())
    assert rep.accepts == rec.accepts and rep.tokens == rec.tokens
    assert [(t.rids, t.seq_lens, t.num_accept_tokens) for t in rep.trace] == \
           [(t.rids, t.seq_lens, t.num_accept_tokens) for t in rec.trace]
    ora = run(backend="oracle", drafter="perfect", version=MODES[version][0], accept=rec.accept_table())
    assert ora.accepts == rec.accepts and ora.tokens == rec.tokens
    assert ScriptedAccept.from_trace(rec.trace).table == rec.accept_table()


@pytest.mark.spec("SD-001")
@pytest.mark.parametrize("version", list(MODES))
def test_forced_accept_teacher_forces_the_drafts(version):
    """Forcing a = N with wrong drafts commits the drafts (the KV verify computed): the text
    leaves greedy, but the oracle loop and the production loop still agree token for token."""
    script = {i: [N] * 20 for i in range(3)}
    prod = run(drafter="adversarial", page_size=4, version=version, accept=script, graphs=True)
    ora = run(backend="oracle", drafter="adversarial", version=MODES[version][0], accept=script)
    assert prod.tokens == ora.tokens and prod.drafts == ora.drafts
    assert prod.tokens != [reference()[i][len(p):len(p) + BUDGETS[i]] for i, p in enumerate(PROMPTS)]
    assert all(a == N for r in prod.requests for a in r.accepts)


@pytest.mark.spec("SD-007", "SD-004", "SD-005")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("version", list(MODES))
def test_positions_are_kv_indices_in_every_forward(version, graphs):
    """SD-007: in every forward each token's RoPE position is the KV index its slot holds
    (``req_to_token[r, position] == out_cache_loc``), consecutive per request, starting at 0
    (prefill), L (draft decode: no SGLang +1), L (verify) and L (draft extend: a rows in v1,
    N rows in v2), where L is the round's committed length: checked at the round's
    ``round_end``, when L and a are known on the host (under overlap, one round after launch)."""
    spans, events = {}, []

    def obs(event, eng, **info):
        if event == "round_end":
            tr = info["trace"]
            for rid, L, a in zip(tr.rids, tr.seq_lens, tr.num_accept_tokens):
                want = {"draft_decode": (L, eng.Sd - 1), "verify": (L, eng.N),
                        "draft_extend": (L, a if version == "v1" else eng.N)}
                got = {ev: span for (k, ev, r), span in spans.items() if k == tr.index and r == rid}
                assert got == {ev: w for ev, w in want.items() if ev != "draft_decode" or eng.Sd > 1}, (rid, got)
            return
        fb, reqs = info["fb"], info["reqs"]
        per_req = fb.q_lens_cpu() if event != "draft_decode" else [eng.Sd - 1] * len(reqs)
        offs = [sum(per_req[:b]) for b in range(len(reqs))]
        for b, r in enumerate(reqs):
            p = fb.positions[offs[b]:offs[b] + per_req[b]]
            loc = fb.out_cache_loc[offs[b]:offs[b] + per_req[b]]
            assert torch.equal(eng.kv.req_to_token[r.row, p].long(), loc)
            assert p.tolist() == list(range(int(p[0]), int(p[0]) + len(p)))
            if event == "prefill":
                assert int(p[0]) == 0 and len(p) == len(r.prompt)
            else:
                spans[(eng.rounds_launched, event, r.rid)] = (int(p[0]), len(p))
        events.append(event)

    run(drafter="random", page_size=4, version=version, graphs=graphs, observer=obs)
    assert {"prefill", "draft_decode", "verify", "draft_extend"} <= set(events)


# ---- per-round accept lengths, chain and top-k tree rounds alike (RoundTrace.accept_length) ----

@pytest.mark.spec("SD-003")
def test_round_accept_lengths_by_hand():
    from refspec.cli.demo import tree_round_lines
    from refspec.speculative.metrics import GenerateResult, RequestResult, RoundTrace

    trace = [RoundTrace(0, [0, 1], [10, 20], [3, 1], [[5, 6], [-1, -1]]),
             RoundTrace(1, [0, 1], [13, 21], [2, 2], [[7, -1], [8, -1]]),
             RoundTrace(2, [1], [23], [4], [[1, 2]], finished=[1])]
    reqs = [RequestResult(0, [1] * 6, [3, 2], [3, 2]), RequestResult(1, [1] * 8, [1, 2, 4], [1, 2, 4])]
    res = GenerateResult(reqs, "fa3", "v1", trace=trace)
    assert [t.accept_length for t in trace] == [2.0, 2.0, 4.0]  # (3+1)/2, (2+2)/2, 4/1
    assert res.round_accept_lengths == [2.0, 2.0, 4.0]
    assert res.accept_length == 12 / 5  # per request-round, not the mean of the round means
    assert GenerateResult(reqs, "oracle", "v1").round_accept_lengths is None  # no per-round trace
    assert tree_round_lines({("v1", 4): res, ("v1 k=2 N=4", 4): res}) == [
        "production tree v1 k=2 N=4 P=4: accept length per round (mean a over the batch, 3 rounds): 2.00 2.00 4.00"]


@pytest.mark.spec("SD-003", "TR-019")
@pytest.mark.parametrize("graphs", [False, True])
def test_tree_rounds_report_num_accept_tokens_per_round(graphs):
    """A target whose layers write nothing to the residual stream (o_proj, down_proj = 0): each
    position's logits depend on its own token only, so the early-exit draft computes the target's
    own next-token function and proposes exactly its greedy continuation.  With N = 1 + k +
    (S-1) k^2 every candidate is verified, so the greedy path (depth S) is always in the tree:
    a = S + 1 = 3 in every round.  By hand, budgets 10 and 5 after the prefill token: request 0
    emits 3 + 3 + 3 (3 rounds), request 1 emits 3 + 1 (its 2nd round truncated at the budget)."""
    m = init_random_(LlamaModel(tiny_config()), seed=0).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    res = generate(m, PROMPTS[:2], backend="fa3", version="v1", page_size=4, graphs=graphs, draft="early-exit:1",
                   num_steps=2, max_new_tokens=[10, 5], topk=2, num_draft_tokens=7, capture_bs=(1, 2))
    assert [t.num_accept_tokens for t in res.trace] == [[3, 3], [3, 3], [3]]
    assert [t.rids for t in res.trace] == [[0, 1], [0, 1], [0]]
    assert res.round_accept_lengths == [3.0, 3.0, 3.0]
    assert res.accepts == [[3, 3, 3], [3, 3]] and [r.emitted for r in res.requests] == [[3, 3, 3], [3, 1]]
    assert res.accept_length == (9 + 4) / 5
