"""The verdicts of a chain-trace replay (``refspec.traces.replay``), on runs written by hand: what
:func:`~refspec.traces.replay._check_run` must refuse once the production and oracle runs are
done (a schedule that is not the trace's, a token the oracle loop did not give, a KV pool that
does not return to its start), and how it counts.  No model runs: the production and oracle
results are stand-ins holding only the fields the verdict reads (test_trace.py replays recorded
traces end to end).  The mutation run (``make mutation``) mutates these functions against this file.

The trace: request 0 (a = [2, 3], output [3, 4, 5, 31]: rounds emit [4, 5] and [31]) and
request 1 (a = [1, 2, 1], output [0, 8, 9, 10, 11]: rounds emit [8], [9, 10], [11]) in rounds
0 (both), 1 (both), 2 (request 1).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from refspec.speculative.metrics import RoundTrace
from refspec.traces.replay import ReplayReport, RunCheck, _check_run, _round_tokens

ROUNDS = [dict(rids=[0, 1], seq_lens=[3, 2], num_accept_tokens=[2, 1], joined=[0, 1], finished=[]),
          dict(rids=[0, 1], seq_lens=[5, 3], num_accept_tokens=[3, 2], joined=[], finished=[0]),
          dict(rids=[1], seq_lens=[5], num_accept_tokens=[1], joined=[], finished=[1])]
TRACE = dict(requests=[dict(rid=0, num_accept_tokens=[2, 3]), dict(rid=1, num_accept_tokens=[1, 2, 1])],
             rounds=ROUNDS)
OUT = [[3, 4, 5, 31], [0, 8, 9, 10, 11]]
EMITTED = [[2, 1], [1, 2, 1]]
GRAPHS = [["verify", "draft"], ["verify"], []]


def run(tokens=OUT, emitted=EMITTED, rounds=ROUNDS, accepts=((2, 3), (1, 2, 1)), free=(40, 40), extra_rounds=()):
    """A finished generate() as _check_run reads it."""
    trace = [RoundTrace(k, list(r["rids"]), list(r["seq_lens"]), list(r["num_accept_tokens"]), [], list(r["joined"]),
                        list(r["finished"]), graph=list(g)) for k, (r, g) in enumerate(zip(rounds, GRAPHS))]
    reqs = [SimpleNamespace(rid=i, tokens=list(t), emitted=list(e)) for i, (t, e) in enumerate(zip(tokens, emitted))]
    return SimpleNamespace(trace=trace + list(extra_rounds), accepts=[list(a) for a in accepts], requests=reqs,
                           tokens=[list(t) for t in tokens], free_pages=free,
                           forwards={("verify", "graph"): 3, ("draft", "graph"): 4, ("verify", "eager"): 1,
                                     ("prefill", "eager"): 2, ("draft prefill", "eager"): 8, ("extend", "eager"): 5})


def greedy(tokens=OUT, margins=((1.0,) * 4, (1.0,) * 5)):
    return [SimpleNamespace(tokens=list(t), margins=list(m)) for t, m in zip(tokens, margins)]


def check(prod=None, ora=None, base=None, dtype=torch.float32, delta=0.01, drafter="perfect") -> RunCheck:
    return _check_run(TRACE, "v1", 4, prod or run(), ora or run(), base or greedy(), dtype, delta, drafter, 1.5)


def matches(rc: RunCheck) -> list[bool]:
    return [x["match"] for x in rc.per_round]


def test_round_tokens_cuts_the_output_per_round_after_the_prefill_token():
    assert _round_tokens([3, 4, 5, 31], [2, 1]) == [[4, 5], [31]]
    assert _round_tokens([0, 8, 9, 10, 11], [1, 2, 1]) == [[8], [9, 10], [11]]
    assert _round_tokens([7], []) == []
    assert _round_tokens([7, 1], [3]) == [[1]]


def test_a_replay_equal_to_the_trace_passes():
    rc = check()
    assert (rc.version, rc.page_size, rc.rounds, rc.schedule, rc.seconds) == ("v1", 4, 3, [], 1.5)
    assert rc.oracle_accepts_ok and rc.tokens_ok and rc.kv_ok and rc.ok
    assert rc.tokens == "T0 production == oracle loop: yes, == greedy: yes"
    assert (rc.graph_replays, rc.eager_forwards) == (7, 6)  # eager: verify 1 + extend 5, no prefill
    assert rc.per_round == [
        dict(rids=[0, 1], seq_lens=[3, 2], num_accept_tokens=[2, 1], joined=[0, 1], finished=[],
             graph=["verify", "draft"], match=True),
        dict(rids=[0, 1], seq_lens=[5, 3], num_accept_tokens=[3, 2], joined=[], finished=[0], graph=["verify"],
             match=True),
        dict(rids=[1], seq_lens=[5], num_accept_tokens=[1], joined=[], finished=[1], graph=[], match=True)]
    assert ReplayReport("t.json", "cpu", "float32", "emulator", "m", "perfect", [rc, rc]).ok


def test_a_schedule_field_that_differs_fails_its_round():
    rounds = copy.deepcopy(ROUNDS)
    rounds[1]["seq_lens"] = [5, 4]
    rc = check(prod=run(rounds=rounds))
    assert rc.schedule == ["round 1: seq_lens [5, 4] != trace [5, 3]"]
    assert matches(rc) == [True, False, True]
    assert rc.tokens_ok and not rc.ok


def test_a_missing_round_is_named_and_every_round_replayed_is_reported():
    rc = check(prod=run(rounds=ROUNDS[:2]))
    assert rc.schedule == ["2 rounds replayed, the trace has 3"]
    assert rc.rounds == 2 and matches(rc) == [True, True] and not rc.ok


def test_overlap_rounds_that_dropped_every_request_are_not_rounds():
    dropped = RoundTrace(3, [], [], [], [], discarded=[1])
    rc = check(prod=run(extra_rounds=[dropped]))
    assert rc.rounds == 3 and rc.schedule == [] and rc.ok
    rc = check(prod=run(extra_rounds=[RoundTrace(3, [], [], [], [])]))  # an empty round that dropped nothing
    assert rc.schedule[0] == "4 rounds replayed, the trace has 3" and not rc.ok


def test_per_request_accepts_that_differ_fail_without_naming_a_round():
    rc = check(prod=run(accepts=((2, 3), (1, 3))))
    assert rc.schedule == ["per-request a [[2, 3], [1, 3]] != trace [[2, 3], [1, 2, 1]]"]
    assert matches(rc) == [True, True, True] and not rc.ok


def test_oracle_accepts_that_differ_fail():
    rc = check(ora=run(accepts=((2, 3), (2, 2))))
    assert rc.schedule == [] and not rc.oracle_accepts_ok and not rc.ok


@pytest.mark.parametrize("tokens,bad", [
    ([[3, 4, 5, 31], [0, 8, 9, 7, 11]], [True, False, True]),  # request 1's second round: round 1
    ([[3, 4, 5, 31], [0, 8, 9, 10, 7]], [True, True, False]),  # request 1's third round: round 2
    ([[3, 4, 6, 31], [0, 8, 9, 10, 11]], [False, True, True]),  # request 0's first round
    ([[3, 4, 5, 30], [0, 8, 9, 10, 11]], [True, False, True]),  # request 0's second round
])
def test_a_token_the_oracle_loop_did_not_give_fails_its_round(tokens, bad):
    rc = check(prod=run(tokens=tokens))
    assert matches(rc) == bad
    assert not rc.tokens_ok and not rc.ok and rc.schedule == []
    assert rc.tokens == "T0 production == oracle loop: no, == greedy: no"


def test_production_equal_to_the_oracle_loop_but_not_greedy():
    """The perfect drafter keeps the output greedy: equal to the oracle loop is not enough."""
    other = [[3, 4, 5, 31], [0, 8, 9, 10, 12]]
    rc = check(prod=run(tokens=other), ora=run(tokens=other))
    assert not rc.tokens_ok and rc.tokens == "T0 production == oracle loop: yes, == greedy: no"
    rc = check(prod=run(tokens=other), ora=run(tokens=other), drafter="model")  # the draft model's argmax: not greedy
    assert rc.tokens_ok and rc.ok and rc.tokens == "T0 production == oracle loop: yes"
    rc = check(prod=run(tokens=other), drafter="model")
    assert not rc.tokens_ok and rc.tokens == "T0 production == oracle loop: no"


def test_a_kv_pool_that_does_not_return_to_its_start_fails():
    rc = check(prod=run(free=(40, 39)))
    assert not rc.kv_ok and not rc.ok and rc.tokens_ok


def test_low_precision_is_t2_against_the_fp32_greedy_baseline():
    rc = check(dtype=torch.bfloat16)
    assert rc.tokens_ok and rc.ok and rc.tokens == "T2 vs fp32 greedy (delta 0.01): 2 equal, 0 forgiven near-tie"
    near = greedy(margins=((1.0,) * 4, (1.0, 1.0, 0.001, 1.0, 1.0)))
    diverged = run(tokens=[[3, 4, 5, 31], [0, 8, 7, 10, 11]])
    rc = check(prod=diverged, base=near, dtype=torch.float16)
    assert rc.tokens_ok and rc.tokens == "T2 vs fp32 greedy (delta 0.01): 1 equal, 1 forgiven near-tie"
    assert matches(rc) == [True, True, True]  # T2 judges whole requests, not rounds
    rc = check(prod=diverged, dtype=torch.bfloat16, delta=0.25)
    assert not rc.tokens_ok and not rc.ok
    assert rc.tokens == "T2 vs fp32 greedy (delta 0.25): request 1: token 2: 7 != 9 with margin 1 >= 0.25"
    rc = check(prod=run(tokens=[[3, 4, 6, 31], [0, 8, 7, 10, 11]]), dtype=torch.bfloat16, delta=0.25)
    assert rc.tokens == ("T2 vs fp32 greedy (delta 0.25): request 0: token 2: 6 != 5 with margin 1 >= 0.25; "
                         "request 1: token 2: 7 != 9 with margin 1 >= 0.25")
    rc = check(prod=run(tokens=[[3, 4, 5], [0, 8, 7, 10, 11]]), base=near, dtype=torch.bfloat16)
    assert rc.tokens == "T2 vs fp32 greedy (delta 0.01): request 0: lengths 3 != 4"


def test_run_check_ok_needs_every_verdict():
    base = dict(version="v1", page_size=1, rounds=1, schedule=[], oracle_accepts_ok=True, tokens_ok=True, tokens="",
                kv_ok=True, graph_replays=0, eager_forwards=0, seconds=0.0)
    assert RunCheck(**base).ok
    for k, v in [("schedule", ["x"]), ("oracle_accepts_ok", False), ("tokens_ok", False), ("kv_ok", False)]:
        assert not RunCheck(**dict(base, **{k: v})).ok, k
    good, bad = RunCheck(**base), RunCheck(**dict(base, kv_ok=False))
    assert not ReplayReport("t", "cpu", "float32", "emulator", "m", "perfect", [good, bad]).ok
    assert ReplayReport("t", "cpu", "float32", "emulator", "m", "perfect", []).ok


# A tree-trace replay compares each phase's FA3 output with the slot oracle under T1 (TOL-002):
# refspec.traces.replay_tree._compare records the worst error per phase and a failure line.

class Pool:
    """A one-layer KV pool's flat slot view (layer 0 only: another layer is a KeyError)."""

    def __init__(self, k, v):
        self.kv = {0: (k, v)}

    def get_flat_kv(self, layer):
        return self.kv[layer]


def one_slot_rows():
    """Two rows (H = 2, Hkv = 1, D = 4), each attending one key, so the fp32 oracle's output is
    exactly that slot's value: row 0 reads slot 3, row 1 slot 5; v[s, 0, j] = 0.5 + s / 16 + j / 64."""
    s, j = torch.arange(8.0).view(8, 1, 1), torch.arange(4.0).view(1, 1, 4)
    v = 0.5 + s / 16 + j / 64
    k = torch.ones(8, 1, 4)
    q = torch.ones(2, 2, 4)
    want = torch.stack([v[3, 0], v[3, 0]]), torch.stack([v[5, 0], v[5, 0]])
    return q, Pool(k, v), [[3], [5]], torch.stack(want)


@pytest.mark.parametrize("phase,inv", [("draft", "TR-008"), ("verify", "TR-012"), ("extend", "SD-004")])
def test_compare_names_the_phase_rule_when_the_output_is_off(phase, inv):
    from refspec.traces.replay_tree import TreeRoundCheck, _compare

    q, pool, slots, want = one_slot_rows()
    check = TreeRoundCheck(0, [0], [5], [2])
    _compare(check, phase, want.clone(), q, pool, slots, "what")
    assert check.failures == [] and check.worst == {phase: 0.0}
    near = want.clone()
    near[1, 0, 2] += 2 ** -17  # err 2^-17 of the fp32 budget 2e-5: 38.1 %
    _compare(check, phase, near, q, pool, slots, "what")
    assert check.failures == [] and check.worst[phase] == pytest.approx(100 * 2 ** -17 / 2e-5, rel=1e-9)
    _compare(check, phase, want.clone(), q, pool, slots, "what")  # the worst so far stays
    assert check.worst[phase] == pytest.approx(100 * 2 ** -17 / 2e-5, rel=1e-9)
    off = want.clone()
    off[0, 1, 0] -= 2 ** -10
    _compare(check, phase, off, q, pool, slots, "what")
    assert check.failures == [f"[{inv}] what: FA3 vs oracle err 0.000977 = 4882.8% of budget 2e-05"]
    assert check.worst[phase] == pytest.approx(100 * 2 ** -10 / 2e-5, rel=1e-9)
    assert list(check.worst) == [phase]


def test_compare_budgets_a_low_precision_output_by_the_oracles_own_error():
    """bf16: the budget is twice the bf16 oracle's distance from the fp32 one plus the bf16 floor
    (TOL-002).  Values near 100 (bf16 steps of 0.5 there) over 6 slots: the bf16 oracle itself is
    off by more than the floor 1.6e-2, and must pass; twice its distance past it must not."""
    from refspec.core.tolerance import T1_FLOOR, t1
    from refspec.oracle.slots import attention_over_slots
    from refspec.traces.replay_tree import TreeRoundCheck, _compare

    g = torch.Generator().manual_seed(0)
    k = torch.randn(8, 1, 4, generator=g).to(torch.bfloat16)
    v = (100 + 10 * torch.randn(8, 1, 4, generator=g)).to(torch.bfloat16)
    q = torch.randn(3, 2, 4, generator=g).to(torch.bfloat16)
    slots = [[1, 2, 3, 4, 5, 6], [0, 7], [2, 4, 6]]
    ref = attention_over_slots(q, k, v, slots, out_dtype=torch.float32)
    low = attention_over_slots(q, k, v, slots, upcast=False)
    gap = float((low.float() - ref).abs().max())
    assert gap > T1_FLOOR[torch.bfloat16]  # the case is one where the budget's base matters
    check = TreeRoundCheck(0, [0], [5], [2])
    _compare(check, "verify", low, q, Pool(k, v), slots, "what")
    assert check.failures == []
    assert check.worst["verify"] == pytest.approx(t1(low, ref, low).pct, rel=1e-9)
    assert check.worst["verify"] == pytest.approx(100 * gap / (2 * gap + T1_FLOOR[torch.bfloat16]), rel=1e-6)
    bad = (ref + 3 * (low.float() - ref) + torch.sign(low.float() - ref)).to(torch.bfloat16)
    _compare(check, "verify", bad, q, Pool(k, v), slots, "what")
    assert len(check.failures) == 1 and check.failures[0].startswith("[TR-012] what: FA3 vs oracle err ")


def test_a_tree_replay_passes_when_no_round_failed():
    from refspec.traces.replay_tree import TreeReplayReport, TreeRoundCheck

    good, bad = TreeRoundCheck(0, [0], [5], [2]), TreeRoundCheck(1, [0], [7], [2], failures=["[TR-004] x"])
    assert TreeReplayReport("t", "cpu", "float32", "emulator", "", [good, good]).ok
    assert TreeReplayReport("t", "cpu", "float32", "emulator", "", []).ok
    assert not TreeReplayReport("t", "cpu", "float32", "emulator", "", [good, bad]).ok
