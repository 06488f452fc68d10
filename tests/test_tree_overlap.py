"""The v2 tree round under the overlap schedule, and the host reads of the tree rounds.

fp32 on CPU, the FA3 emulator (and emulated CUDA graphs), shuffled physical pages.  Plain greedy
is the reference (SD-002); the oracle v2 tree loop gives the accept counts.  With overlap the
host launches round k+1 before it reads round k, so the round's lengths come from the device
(the future map) and the host holds bounds (TR-020's 2x reserve).
"""

from __future__ import annotations

import pytest
import torch

from refspec.audits.kv import audit_kv
from refspec.audits.sync import host_reads
from refspec.model.drafts import make_draft
from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.loop import greedy
from refspec.oracle.tree_loop import speculative_tree_greedy
from refspec.speculative.tree import kv as tree_kv
from refspec.speculative.tree.engine import TreeEngine
from refspec.speculative.tree.v2 import reserve_len
from test_tree_fa3_v2 import HiddenScaledDraft  # the target as a draft that reads its hidden

torch.set_num_threads(1)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 3, 3], [9, 4, 4, 2, 6, 1, 8]]
BUDGETS = [16, 11, 13, 9]
_REF: dict = {}


@pytest.fixture(scope="module")
def model():
    return init_random_(LlamaModel(tiny_config()), seed=0).eval()


def _reference(model, draft, k, N, S=3):
    key = (type(draft).__name__, k, N, S)
    if key not in _REF:
        _REF[key] = [(greedy(model, p, m).tokens,
                      speculative_tree_greedy(model, draft, p, num_steps=S, topk=k, num_draft_tokens=N,
                                              max_new_tokens=m, version="v2"))
                     for p, m in zip(PROMPTS, BUDGETS)]
    return _REF[key]


def _engine(model, draft, P, k, N, S=3, arrivals=(0, 0, 0, 0), **kw):
    kw = dict(dict(topk=k, num_draft_tokens=N, num_steps=S, page_size=P, max_context=64, max_batch=3,
                   provider="emulator", shuffle_pages=P, version="v2", capture_bs=(1, 2, 4)), **kw)
    eng = TreeEngine(model, draft, **kw)
    for i, (p, m, t) in enumerate(zip(PROMPTS, BUDGETS, arrivals)):
        eng.add_request(i, p, m, arrival=t)
    return eng


@pytest.mark.spec("TR-019", "TR-020", "TR-021", "SD-002", "SD-008", "KV-006")
@pytest.mark.parametrize("graphs", (False, True), ids=("eager", "graphs"))
@pytest.mark.parametrize("P", (1, 4, 16, 64))
@pytest.mark.parametrize("k,N,S", ((2, 5, 3), (4, 8, 3), (2, 3, 5), (3, 10, 2)))
def test_v2_tree_loop_with_overlap_is_lossless(model, P, k, N, S, graphs):
    """Overlapped, with arrivals (joins) and a full batch (a later request waits): every request
    equals plain greedy and its accept counts the oracle v2 tree loop's; every page comes back.
    (2, 3, 5): fewer nodes than steps (N < S + 1)."""
    draft = make_draft(model, model)
    eng = _engine(model, draft, P, k, N, S, arrivals=(0, 1, 1, 2), overlap=True, graphs=graphs)
    eng.run()
    done = sorted(eng.done, key=lambda r: r.rid)
    for r, (g, o) in zip(done, _reference(model, draft, k, N, S)):
        assert r.output == g and r.accepts == o.accepts
    assert max(a for r in done for a in r.accepts) >= (3 if N >= 5 else 2)  # drafts accepted: compaction runs
    assert min(a for r in done for a in r.accepts) == 1
    assert any(t.joined for t in eng.trace[1:])
    if graphs:
        assert {ph for (ph, how), n in eng.runners.counts.items() if how == "graph" and n} == \
            {"tree_verify", "tree_draft", "draft_extend"}
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start


def _cuda_like_outputs(monkeypatch):
    """Emulated graphs that return the SAME output tensors at every replay, rewritten in place
    (a CUDA graph's outputs live in its pool: ``CudaGraph.replay`` returns one tuple for good);
    the plain emulator returns fresh tensors, so a read after the next replay would pass there.
    Returns ``{graph: its fixed outputs}``."""
    from refspec.graphs import capture

    fixed, replay = {}, capture.EmulatedGraph.replay

    def flat(out):
        return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]

    def rewriting(self):
        out = replay(self)
        if self not in fixed:
            fixed[self] = out
        else:
            for dst, src in zip(flat(fixed[self]), flat(out)):
                dst.copy_(src)
        return fixed[self]
    monkeypatch.setattr(capture.EmulatedGraph, "replay", rewriting)
    return fixed


@pytest.mark.spec("TR-018", "TR-019", "SD-002")
@pytest.mark.parametrize("P", (1, 16))
def test_overlap_reads_each_tree_graph_output_before_the_graph_replays_again(model, P, monkeypatch):
    """The tree graphs hand out views of their output buffers, no clone (``TreeGraphRunner.replay``):
    with buffers every replay rewrites, as on a GPU, the overlapped loop (round k+1 launched
    before round k is read) still equals plain greedy.  Control: a verify output kept from one
    round does change under the next round's replay, so a late reader would see it."""
    fixed = _cuda_like_outputs(monkeypatch)
    draft = make_draft(model, model)
    eng = _engine(model, draft, P, 4, 8, overlap=True, graphs=True)
    runner, kept = eng.runners.graph["tree_verify"], []
    replay = runner.replay

    def keep_first(live, inputs):
        out = replay(live, inputs)
        if not kept:
            kept.extend((out[3], out[3].clone()))  # accept_index: a view, and its value then
        return out
    monkeypatch.setattr(runner, "replay", keep_first)
    eng.run()
    for r, (g, o) in zip(sorted(eng.done, key=lambda r: r.rid), _reference(model, draft, 4, 8)):
        assert r.output == g and r.accepts == o.accepts
    assert len(fixed) >= 3 and eng.runners.counts[("tree_verify", "graph")] > 1
    assert not torch.equal(kept[0], kept[1])  # the view was rewritten by later replays


@pytest.mark.spec("TR-020", "KV-002", "KV-006", "SD-008")
@pytest.mark.parametrize("P", (1, 4))
def test_overlap_reserve_is_twice_alloc_and_the_kv_audits_at_every_round(model, P):
    """At each launch a row holds at least ``ceil_P(L + 2R)`` (L = the host's start of the round
    in flight); committed KV and page ownership are audited at every round_end; with an EOS some
    rows finish one round late (dropped) and the tokens still equal greedy's (cut at the EOS)."""
    k, N, S = 2, 5, 3
    R = tree_kv.alloc_len_per_decode(k, S, N, P)
    draft = make_draft(model, model)
    ref = greedy(model, PROMPTS[1], BUDGETS[1]).tokens
    eos = ref[4]
    seen = []

    def observer(event, eng, **info):
        if event == "draft_decode":
            for r in info["reqs"]:
                assert r.alloc_len >= reserve_len(r.seq_len, R, P, True) == -(-(r.seq_len + 2 * R) // P) * P
        if event == "round_end":
            audit_kv(eng)
            seen.append(info["trace"])
    eng = _engine(model, draft, P, k, N, arrivals=(0, 0, 1, 3), overlap=True, eos=eos, observer=observer)
    eng.run()
    for r in eng.done:
        g = greedy(model, r.prompt, r.max_new_tokens).tokens
        cut = g.index(eos) + 1 if eos in g else len(g)
        assert r.output == g[:cut]
    assert any(r.finish_reason == "eos" for r in eng.done) and any(t.discarded for t in seen)
    assert eng.kv.allocator.num_free_pages == eng.free_pages_at_start


def test_reserve_len_worked_example():
    """TR-020: R = 8, P = 4, host L = 5: 13 positions non-overlapped; ceil((5 + 16) / 4) * 4 = 24 overlapped."""
    assert reserve_len(5, 8, 4, False) == 13 and reserve_len(5, 8, 4, True) == 24
    assert reserve_len(5, 8, 1, True) == 21


#: sites that read tensor values during a tree run with validation off, each a read of HOST data
#: (or of the kernel stand-in); (path under refspec/, function) -> what it reads
TREE_HOST_SITES = {
    ("core/transfer.py", "wait"): "overlap: the counted result and prefill reads (pinned, after their events)",
    ("speculative/engine.py", "host"): "non-overlap: the counted reads (Engine.host)",
    ("core/kv_cache.py", "alloc_extend"): "req_to_token_cpu, the allocator's host mirror (KV-007)",
    ("core/kv_cache.py", "row_pages"): "req_to_token_cpu (KV-007)",
    ("core/kv_cache.py", "free_pages"): "the allocator's host in-use bitmap",
    ("core/kv_cache.py", "is_in_use"): "the allocator's host in-use bitmap (v1's TR-017 check)",
    ("fa3/metadata.py", "eager_cache_seqlens"): "max(seq_lens_cpu) (MD-006), the prefill / draft extend",
    ("fa3/metadata.py", "eager_query_layout"): "seq_lens_cpu vs extend_seq_lens_cpu",
    ("fa3/graph_metadata.py", "_write_page_table"): "max(seq_lens_cpu) (MD-006)",
    ("fa3/tree_metadata.py", "draft_prefix_metadata"): "max(seq_lens_cpu) (mirror or bound)",
    ("fa3/tree_metadata.py", "verify_prefix_metadata"): "max(seq_lens_cpu) (mirror or bound)",
    ("speculative/tree/graphs.py", "_fill"): "live.seq_lens_cpu (host) into the padded batch",
}
KERNEL_STAND_IN = "fa3/emulator.py"


@pytest.mark.spec("TR-016", "TR-020")
@pytest.mark.parametrize("overlap", (False, True), ids=("v2", "v2-overlap"))
@pytest.mark.parametrize("graphs", (False, True), ids=("eager", "graphs"))
def test_v2_tree_round_reads_nothing_from_the_device(model, overlap, graphs):
    """v2 (and v2 + overlap): 0 counted reads inside a round, 1 after it; every value read of the
    whole run is a read of host data (TREE_HOST_SITES): the tree is built and accepted on the
    device, its lengths come from the future map."""
    eng = _engine(model, make_draft(model, model), 4, 2, 5, overlap=overlap, graphs=graphs, validate=False)
    with host_reads() as reads:
        eng.run()
    sites = {(path, fn) for path, fn, _ in reads if path != KERNEL_STAND_IN}
    assert sites <= set(TREE_HOST_SITES), f"reads outside the host sites: {sites - set(TREE_HOST_SITES)}"
    assert all(t.host_syncs == 0 for t in eng.trace) and "in_round" not in eng.syncs
    assert eng.syncs["post_round"] == eng.rounds_launched == len(eng.trace)  # every launched round read once
    counted = ("core/transfer.py", "wait") if overlap else ("speculative/engine.py", "host")
    assert sum(n for (p, f, _), n in reads.items() if (p, f) == counted) == \
        eng.syncs["post_round"] + eng.syncs["prefill"]


@pytest.mark.spec("TR-016", "TR-017")
def test_v1_tree_round_reads_once(model):
    """v1: one counted read inside each round (a, the path and its tokens: the frees and the
    packed draft extend need them), none after; no other device read."""
    eng = _engine(model, make_draft(model, model), 4, 2, 5, version="v1", validate=False)
    with host_reads() as reads:
        eng.run()
    sites = {(path, fn) for path, fn, _ in reads if path != KERNEL_STAND_IN}
    assert sites <= set(TREE_HOST_SITES), f"reads outside the host sites: {sites - set(TREE_HOST_SITES)}"
    assert [t.host_syncs for t in eng.trace] == [1] * len(eng.trace)
    assert eng.syncs["in_round"] == len(eng.trace) and "post_round" not in eng.syncs
    done = sorted(eng.done, key=lambda r: r.rid)
    assert [r.output for r in done] == [greedy(model, p, m).tokens for p, m in zip(PROMPTS, BUDGETS)]


@pytest.mark.spec("TR-021", "TR-019")
@pytest.mark.parametrize("P", (1, 4))
def test_overlap_carries_the_draft_hidden_through_the_future_map(model, P):
    """A draft that reads its hidden input (its scores, so every later tree, depend on it):
    overlapped and graphed, still the oracle v2 tree loop's accepts and greedy's tokens."""
    draft = HiddenScaledDraft(model)
    eng = _engine(model, draft, P, 4, 8, overlap=True, graphs=True, arrivals=(0, 0, 1, 1))
    eng.run()
    for r, (g, o) in zip(sorted(eng.done, key=lambda r: r.rid), _reference(model, draft, 4, 8)):
        assert r.output == g and r.accepts == o.accepts
