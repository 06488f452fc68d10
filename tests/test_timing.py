"""One timing rule for "x graph greedy" (issue 41, part 3; refspec.cli._timing): the demo (CPU
and GPU tables) and the bench compute the ratio with the same function over the same decode
window, and graph capture, the warm-up run and the prefill are outside the window (a fake clock
and a log of what ran when)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from refspec.cli import _timing
from refspec.graphs.capture import EmulatedGraph
from refspec.model.llama import LlamaModel, init_random_, tiny_config

torch.set_num_threads(1)

PROMPTS = [[3, 5, 7, 9, 11, 13, 15, 17, 19, 21], [60, 2, 33, 4, 4, 90, 91, 92], [100, 101, 7, 7, 40, 41, 42] * 2]
BUDGETS = [10, 7, 4]  # staggered, as the demo's


@functools.lru_cache(maxsize=None)
def target() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0).eval().requires_grad_(False)


class Log:
    """What ran when: graph captures, target forwards (their token count), clock reads."""

    def __init__(self, monkeypatch, model):
        self.events: list[tuple] = []
        self.now = 0.0
        real = EmulatedGraph.capture

        def capture(graph, fn):
            self.events.append(("capture",))
            return real(graph, fn)

        monkeypatch.setattr(EmulatedGraph, "capture", capture)
        forward = model.forward  # the loops call target.forward(...), so the instance attribute is what they run

        def logged(input_ids, *a, **k):
            self.events.append(("forward", input_ids.numel()))
            return forward(input_ids, *a, **k)

        monkeypatch.setattr(model, "forward", logged)

    def clock(self) -> float:
        self.now += 1.0
        self.events.append(("clock", self.now))
        return self.now

    def window(self) -> tuple[int, int]:
        """Indices of the window's opening and closing clock reads: the first and the last (a
        warm-up run reads no clock; an instrument's paused reads fall between)."""
        reads = [i for i, e in enumerate(self.events) if e[0] == "clock"]
        return reads[0], reads[-1]


def _check_window(log, prefill_tokens: int, runs: int, most: int):
    """Capture and every run's prefill before the window; inside it only forwards of at most
    ``most`` tokens (the largest padded decode / verify batch, below the prefill's)."""
    t0, t1 = log.window()
    before, inside = log.events[:t0], log.events[t0 + 1:t1]
    assert ("capture",) in before and ("capture",) not in inside, "graph capture inside the timed part"
    prefills = [i for i, e in enumerate(log.events) if e == ("forward", prefill_tokens)]
    assert len(prefills) == runs and all(i < t0 for i in prefills), "a prefill inside the timed part"
    decode = [e for e in inside if e[0] == "forward"]
    assert most < prefill_tokens and decode and all(e[1] <= most for e in decode)


@pytest.mark.parametrize("warmup", [0, 1])
def test_graph_greedy_window_leaves_capture_warmup_and_prefill_outside(monkeypatch, warmup):
    m = target()
    log = Log(monkeypatch, m)
    g, t = _timing.time_greedy(m, PROMPTS, BUDGETS, page_size=4, capture_bs=(1, 2, 4), warmup=warmup,
                               clock=log.clock)
    _check_window(log, sum(map(len, PROMPTS)), runs=1 + warmup, most=4)  # B = 3 padded to the graph of 4
    assert t.tokens == sum(BUDGETS) - len(PROMPTS)  # every token but each request's first (the prefill's)
    t0, t1 = log.window()
    assert t.seconds == log.events[t1][1] - log.events[t0][1]


def test_spec_window_leaves_capture_warmup_prefill_and_instruments_outside(monkeypatch):
    m = target()
    log = Log(monkeypatch, m)
    seen = []

    def slow_instrument(event, eng, **info):  # host work of a check: 1000 s on the fake clock each call
        seen.append(event)
        log.now += 1000.0

    res, t = _timing.time_spec(m, PROMPTS, BUDGETS, warmup=1, instrument=slow_instrument, clock=log.clock,
                               draft="eagle", version="v2", page_size=4, graphs=True, capture_bs=(1, 2, 4))
    _check_window(log, sum(map(len, PROMPTS)), runs=2, most=4 * 4)  # verify: 4 padded requests x N = 4
    assert t.tokens == sum(map(len, res.tokens)) - len(PROMPTS)
    assert "round_end" in seen and t.seconds < 1000, "the instrument's time was counted"


def test_a_run_without_a_prefill_event_is_refused():
    w = _timing.DecodeWindow("cpu")
    with pytest.raises(RuntimeError, match="no 'prefill' event"):
        w.stop([[1, 2]])


def test_speedup_is_the_ratio_of_the_windows_rates():
    assert _timing.speedup(_timing.Timed(30, 2.0), _timing.Timed(10, 1.0)) == pytest.approx(1.5)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = _timing.speedup

    def counting(spec, greedy):
        out = real(spec, greedy)
        calls.append((spec, greedy, out))
        return out

    monkeypatch.setattr(_timing, "speedup", counting)
    return calls


def test_the_cpu_demo_ratio_is_the_shared_function(spy):
    from refspec.cli.demo import run_matrix

    res = run_matrix(target(), PROMPTS, BUDGETS, page_sizes=(4,), versions=("v1", "v2"), draft="eagle",
                     num_steps=3)
    prod = [r for r in res.rows if r.path == "production"]
    graph = next(r for r in res.rows if r.path == "graph greedy")
    assert len(prod) == 2 and len(spy) == 3  # the two production rows and graph greedy itself
    assert [r.x_graph for r in (graph, *prod)] == [out for _, _, out in spy]
    assert all(g.tokens == graph.tokens for _, g, _ in spy)  # every ratio is over the graph-greedy window
    assert graph.spec_eq_greedy and all(r.spec_eq_greedy for r in prod)


def test_the_gpu_demo_ratio_is_the_shared_function(spy):
    """The GPU table's code, run on the CPU (bf16 there too)."""
    from refspec.cli._demo_gpu import run_gpu_matrix

    res = run_gpu_matrix(target(), PROMPTS, BUDGETS, page_sizes=[4], versions=["v2"], draft="eagle", num_steps=3,
                         eos=None, capture_bs=(1, 2, 4))
    rows = {r.path: r for r in res.rows}
    assert rows["production"].x_graph == spy[-1][2] and rows["greedy, production"].x_graph == spy[0][2] == 1.0
    assert rows["greedy, eager"].x_graph is None and rows["oracle loop"].x_graph is None  # whole-run rows: no ratio
    assert rows["production"].tokens == sum(BUDGETS) - len(PROMPTS)  # the window's tokens


def test_the_bench_ratio_is_the_shared_function(spy, monkeypatch):
    """``bench --sections peer``'s spec rows, run on the CPU with the tiny model: x_graph_greedy
    comes from the same function, over graph greedy's window of the same B."""
    from refspec.cli import _bench_eagle, _bench_peer
    from refspec.model.drafts import EagleDraft

    m = target()
    monkeypatch.setattr(_bench_peer, "SPEC_REPEATS", 1)
    monkeypatch.setattr(_bench_peer, "PEER_NEW", 8)
    monkeypatch.setattr(_bench_eagle, "_head", lambda model: (EagleDraft(model), "a random head"))
    prompts = PROMPTS[:1]
    g, g_time = _timing.time_greedy(m, prompts, [8], page_size=16, capture_bs=(1,))
    rows = _bench_peer._spec_rows(m, m, prompts, g, 1.0, "tiny", g_time)
    chain = [r for r in rows if "x_graph_greedy" in r]
    assert len(chain) >= 4 and [r["x_graph_greedy"] for r in chain] == [out for _, _, out in spy]
    assert all(gt is g_time for _, gt, _ in spy)


def test_no_ratio_to_graph_greedy_is_computed_by_hand():
    """Every x_graph / x_graph_greedy in the instruments goes through ``_timing.speedup``
    (negative control: the pattern finds a hand-made one)."""
    hand = re.compile(r"x_graph\w*\W.*tok_per_s\W*/")
    assert hand.search('"x_graph_greedy": r["tok_per_s"] / greedy_tps')
    root = Path(__file__).resolve().parents[1]
    files = [*(root / "refspec" / "cli").glob("*.py"), root / "benchmarks" / "compare_heads.py"]
    found = [f"{p.name}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if hand.search(line)]
    assert not found, found
