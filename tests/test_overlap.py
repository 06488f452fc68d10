"""The overlap loop (refspec.speculative.overlap): round k+1 launched before round k is read,
lengths from the device with host upper bounds, the 2N reserve, one result read per round
after the next launch, and a hot path that reads only host data.

Lossless / equivalence / KV audits with overlap on are parametrized into test_spec_lossless,
test_spec_cases, test_spec_kv, test_spec_metrics and test_trace ("v2-overlap")."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from refspec.core.future_batch import verify_batch_future
from refspec.core.invariants import InvariantError
from refspec.core.kv_cache import KVCache
from refspec.fa3.metadata import init_forward_metadata
from refspec.fa3.validate import validate_batch
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.speculative import generate, greedy_reference
from refspec.audits.kv import audit_kv
from refspec.speculative.drafters import Drafter
from refspec.speculative.engine import Engine
from refspec.speculative.overlap import reserve_len
from refspec.audits.sync import host_reads

torch.set_num_threads(1)  # tiny ops: threads only contend (2 shared cores)

_rng = random.Random(5)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (4, 11, 7, 9)]
BUDGETS = [13, 9, 16, 6]


@functools.lru_cache(maxsize=None)
def target() -> LlamaModel:
    return init_random_(LlamaModel(tiny_config()), seed=0)


@functools.lru_cache(maxsize=None)
def reference():
    return greedy_reference(target(), PROMPTS, [b + 8 for b in BUDGETS])


def engine(**kw) -> Engine:
    kw = {"version": "v2", "page_size": 4, "max_context": 40, "max_batch": 3, "overlap": True, **kw}
    eng = Engine(target(), make_draft("eagle", target()), **kw)
    for i, (p, m) in enumerate(zip(PROMPTS, BUDGETS)):
        eng.add_request(i, p, m, arrival=i)
    return eng


def test_overlap_is_on_by_default_only_for_v2_on_cuda():
    cpu = Engine(target(), make_draft("eagle", target()), version="v2")
    assert cpu.overlap is False and engine().overlap is True
    with pytest.raises(ValueError, match="v2"):
        engine(version="v1")

    class TokenDrafter(Drafter):  # reads the tokens: the overlap host has them one round late
        name = "tokens"

        def propose(self, rid, tokens, num_steps):
            return tokens[-num_steps:]
    with pytest.raises(ValueError, match="position_only"):
        engine(drafter=TokenDrafter())


@pytest.mark.spec("KV-005")
def test_worked_example_of_the_reserve():
    """The module doc's numbers: L = 5, N = 4, P = 4 -> 16 slots; P = 1 -> 13; P = 16 -> 16."""
    assert [reserve_len(5, 4, P) for P in (4, 1, 16)] == [16, 13, 16]
    assert reserve_len(9, 4, 4) == 20  # round k+1 may start at 9 + 4 = 13, writes up to 16


@pytest.mark.spec("MD-006", "MD-011")
def test_worked_example_of_a_bounded_verify_batch():
    """future_batch's doc: device L = [5, 9], bound [8, 12], N = 4, P = 4: positions [5..8, 9..12],
    K = [9, 13], max_seqlen_k = 16, page table ceil(16 / 4) = 4 columns; a bound below the
    device value is an MD-006 violation."""
    kv = KVCache(max_reqs=3, max_context=24, num_pages=12, page_size=4)
    rows = [kv.alloc_req(), kv.alloc_req()]
    kv.alloc_extend(rows, [0, 0], [16, 16])
    L = torch.tensor([5, 9])
    fb = verify_batch_future(kv, rows, torch.tensor(rows), L, [8, 12], 4)
    assert fb.positions.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert fb.out_cache_loc.tolist() == kv.req_to_token[rows[0], 5:9].tolist() + kv.req_to_token[rows[1], 9:13].tolist()
    md = init_forward_metadata(fb, kv.req_to_token, 4)
    assert md.cache_seqlens_int32.tolist() == [9, 13] and md.max_seq_len_k == 16 and md.page_table.shape == (2, 4)
    validate_batch(fb, kv.req_to_token)
    with pytest.raises(InvariantError, match="MD-006"):
        validate_batch(verify_batch_future(kv, rows, torch.tensor(rows), L, [8, 8], 4), kv.req_to_token)


@pytest.mark.spec("SD-002", "KV-006")
@pytest.mark.parametrize("validate", [False, True], ids=["no-validation", "validation"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_one_result_read_per_round_after_the_next_launch(graphs, validate):
    """Per round: no model-result read while it is built and launched; exactly one after it,
    and only once the next round was launched (round k is read after round k+1's verify ran).
    Validation reads are counted apart ("validation"), never as result reads."""
    log = []

    def obs(event, eng, **info):
        if event in ("draft_decode", "verify", "draft_extend"):
            log.append((eng.rounds_launched, event, eng.syncs["post_round"], eng.syncs["in_round"],
                        eng.syncs["prefill"]))
    eng = engine(graphs=graphs, validate=validate, observer=obs)
    eng.run()
    K = eng.rounds_launched
    assert K > 8 and eng.syncs["post_round"] == K and eng.syncs["in_round"] == 0
    assert len(eng.trace) == K and all(t.host_syncs == 0 for t in eng.trace)
    for k in range(K):
        mine = [x for x in log if x[0] == k]
        assert {x[1] for x in mine} == {"draft_decode", "verify", "draft_extend"}
        assert len({x[2:] for x in mine}) == 1, f"round {k} read a result while it was launched: {mine}"
        reads_before_launch = mine[0][2]
        assert reads_before_launch == max(k - 1, 0), f"round {k} launched after {reads_before_launch} reads"
    assert (eng.syncs["validation"] > 0) == validate
    assert eng.free_pages_at_start == eng.kv.allocator.num_free_pages
    tokens = {r.rid: r.output for r in eng.done}
    assert [tokens[i] for i in range(len(PROMPTS))] == \
        [reference()[i][len(p):len(p) + b] for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]


#: call sites that read tensor values during a run with validation off, each a read of HOST data
#: (or of the kernel stand-in): (path under refspec/, function) -> what it reads
HOST_SITES = {
    ("core/transfer.py", "wait"): "the counted result and prefill reads: pinned buffers, after their events",
    ("core/kv_cache.py", "alloc_extend"): "req_to_token_cpu, the allocator's host mirror (KV-007)",
    ("core/kv_cache.py", "row_pages"): "req_to_token_cpu (KV-007)",
    ("core/kv_cache.py", "free_pages"): "the allocator's host in-use bitmap",
    ("fa3/metadata.py", "init_forward_metadata"): "seq_lens_cpu (mirror or bound, MD-006)",
    ("fa3/metadata.py", "eager_cache_seqlens"): "max(seq_lens_cpu) (MD-006)",
    ("fa3/metadata.py", "eager_query_layout"): "seq_lens_cpu vs extend_seq_lens_cpu (EXTEND's prefix test)",
    ("fa3/graph_metadata.py", "_write_page_table"): "max(seq_lens_cpu) (MD-006)",
}
KERNEL_STAND_IN = "fa3/emulator.py"  # the CPU contract emulator; the real FA3 kernel reads nothing back


@pytest.mark.spec("KV-007")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_hot_path_reads_only_host_data(graphs):
    """Every value read of a tensor during an overlap run (validation off) happens at a site
    that reads host data (HOST_SITES); the counted site reads exactly Engine.syncs times."""
    eng = engine(graphs=graphs, validate=False)
    with host_reads() as reads:
        eng.run()
    sites = {(path, fn) for path, fn, _ in reads if path != KERNEL_STAND_IN}
    assert sites <= set(HOST_SITES), f"reads outside the host sites: {sites - set(HOST_SITES)}"
    by_site = {k: sum(n for (p, f, _), n in reads.items() if (p, f) == k) for k in HOST_SITES}
    assert eng.syncs["post_round"] == eng.rounds_launched and eng.syncs["prefill"] == 4  # arrivals 0..3
    assert by_site[("core/transfer.py", "wait")] == eng.syncs["post_round"] + eng.syncs["prefill"]


@pytest.mark.spec("KV-007", "KV-005", "KV-006", "SD-008")
def test_mirror_and_kv_audit_after_every_round_with_joins_and_finishes():
    """Audited at every round_end (joins: arrivals 0..3 with max_batch 3; finishes by length and
    by EOS); the allocator's host mirror equals the device req_to_token each time."""
    eos = reference()[2][len(PROMPTS[2]) + 4]
    audited = []

    def obs(event, eng, **info):
        if event == "round_end":
            audit_kv(eng)
            audited.append(info["trace"].index)
    ref = greedy_reference(target(), PROMPTS, [b + 8 for b in BUDGETS], eos=eos)
    res = generate(target(), PROMPTS, version="v2", overlap=True, page_size=4, drafter="random", reference=ref,
                   max_new_tokens=BUDGETS, eos=eos, max_batch=3, arrivals=[0, 1, 2, 3], observer=obs, graphs=True)
    assert audited == list(range(len(res.trace)))
    assert {r.finish_reason for r in res.requests} == {"eos", "length"}
    assert any(t.joined for t in res.trace[1:]) and any(t.discarded for t in res.trace)
    assert res.tokens == [ref[i][len(p):len(p) + b] for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    assert res.free_pages[0] == res.free_pages[1]


@pytest.mark.spec("SD-002", "KV-006")
def test_prefill_tokens_are_read_after_the_next_launch():
    """A newcomer's first token is read after its first round was launched: max_new_tokens 1
    leaves it out of that round (no verify round at all); an EOS first token runs the round,
    whose row is dropped; both end with every page back."""
    launched_with = []

    def obs(event, eng, **info):
        if event == "verify":
            launched_with.append(sorted(r.rid for r in info["reqs"]))
    eos = reference()[1][len(PROMPTS[1])]  # request 1's first greedy token
    res = generate(target(), PROMPTS[:3], version="v2", overlap=True, page_size=4, max_new_tokens=[1, 5, 6],
                   eos=eos, observer=obs)
    assert res.requests[0].tokens == [reference()[0][len(PROMPTS[0])]] and not res.requests[0].accepts
    assert res.requests[1].tokens == [eos] and res.requests[1].finish_reason == "eos" and not res.requests[1].accepts
    assert launched_with[0] == [1, 2] and res.trace[0].discarded == [1] and res.trace[0].rids == [2]
    assert res.host_syncs["prefill"] == 1 and res.free_pages[0] == res.free_pages[1]


@pytest.mark.spec("SD-002", "KV-006")
@pytest.mark.parametrize("budget,rounds,dropped", [(6, 2, []), (7, 3, [0])])
def test_a_sure_length_finish_is_not_launched_again(budget, rounds, dropped):
    """Prompt 5, N = 4, a = 4 then 4 (scripted).  Budget 6: after round 0 (1 + 4 tokens) one
    token is left, so round 1 surely finishes it and no round 2 is launched.  Budget 7: two
    left, a is unknown when round 2 is launched: it runs and its row is dropped."""
    res = generate(target(), [[1, 2, 3, 4, 5]], version="v2", overlap=True, page_size=4, num_steps=3,
                   draft="early-exit", accept={0: [4, 4]}, max_new_tokens=budget)
    assert len(res.trace) == rounds and res.host_syncs["post_round"] == rounds
    assert [rid for t in res.trace for rid in t.discarded] == dropped
    assert res.requests[0].accepts == [4, 4] and len(res.tokens[0]) == budget
    assert res.free_pages[0] == res.free_pages[1]
