"""``refspec.harness.dump``: metadata dumped in the shape of SGLang's fields is checked by the FA3
validators; a corrupted dump raises the ID of the rule it breaks.

The committed dump ``tutorials/data/fa3_dump_draft_extend_v2.json`` is the docs' running example
(DRAFT_EXTEND_V2, L = [5, 8, 12], N = 4, P = 4); its numbers are also quoted on
docs/modes/draft-extend-v2.md. Expected values here are the rules' formulas, written out.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode as M
from refspec.harness import dump
from refspec.harness.scenario import Scenario

DUMP = Path(__file__).resolve().parents[1] / "tutorials" / "data" / "fa3_dump_draft_extend_v2.json"
L, N, P = [5, 8, 12], 4, 4


@pytest.fixture
def raw() -> dict:
    return json.loads(DUMP.read_text())


def _raises(d) -> str | None:
    try:
        dump.check(d)
    except InvariantError as e:
        return e.inv_id
    return None


@pytest.mark.spec("MD-008", "MD-002")
def test_committed_dump_is_the_running_example_and_passes(raw):
    d = dump.load(raw)
    assert d.md.cache_seqlens_int32.tolist() == [x + N for x in L]  # MD-008: K = seq_lens = L + N
    assert d.md.cu_seqlens_q.tolist() == [0, N, 2 * N, 3 * N]  # uniform N rows
    assert d.fb.forward_mode == M.DRAFT_EXTEND_V2 and d.page_size == P
    assert _raises(d) is None


@pytest.mark.spec("MD-005", "MD-008")
def test_double_counted_k_is_md005(raw):
    """SGLang #26512: K = seq_lens + extend_seq_lens, with cu_seqlens_k / max / table following K."""
    bad = copy.deepcopy(raw)
    md = bad["metadata"]
    K = [k + N for k in md["cache_seqlens_int32"]]
    md.update(cache_seqlens_int32=K, cu_seqlens_k=[0, K[0], K[0] + K[1], sum(K)], max_seq_len_k=max(K))
    width = -(-max(K) // P)
    md["page_table"] = [[s // P for s in (bad["req_to_token"][str(r)][::P] + [0] * width)[:width]]
                        for r in bad["forward_batch"]["req_pool_indices"]]
    assert _raises(bad) == "MD-005"


@pytest.mark.spec("PA-002")
def test_slots_in_the_page_table_is_pa002(raw):
    """SGLang #5090 (seed bug): token slots copied into the page table instead of page ids."""
    bad = copy.deepcopy(raw)
    width = len(bad["metadata"]["page_table"][0])
    bad["metadata"]["page_table"] = [(bad["req_to_token"][str(r)][::P] + [0] * width)[:width]
                                     for r in bad["forward_batch"]["req_pool_indices"]]
    assert _raises(bad) == "PA-002"


@pytest.mark.spec("MD-002", "CG-004")
def test_packed_cu_seqlens_q_in_v2_is_md002(raw):
    bad = copy.deepcopy(raw)
    bad["metadata"]["cu_seqlens_q"] = [0, 2, 6, 7]  # v1's cumsum(num_accept_tokens), a = [2, 4, 1]
    assert _raises(bad) == "MD-002"


@pytest.mark.spec("MD-006")
def test_stale_cpu_mirror_is_md006(raw):
    bad = copy.deepcopy(raw)
    bad["forward_batch"]["seq_lens_cpu"] = [9, 12, 15]
    assert _raises(bad) == "MD-006"


@pytest.mark.parametrize("mode,kw", [
    (M.DECODE, dict(lens=[6, 9, 13])),
    (M.TARGET_VERIFY, dict(lens=L)),
    (M.DRAFT_EXTEND, dict(lens=L, num_accept_tokens=[2, 4, 1])),
    (M.EXTEND, dict(lens=[0, 8, 3], extend_lens=[5, 4, 2])),
    (M.DECODE, dict(lens=L, draft_step=1)),
])
@pytest.mark.spec("MD-003")
def test_round_trip_of_every_mode(mode, kw):
    built = Scenario(mode=mode, page_size=P, seed=0, **kw).build()
    built.run_fa3()
    d = dump.load(json.loads(json.dumps(dump.from_built(built))))
    assert d.md.cache_seqlens_int32.tolist() == built.K
    assert d.fb.q_lens_cpu() == built.q_lens
    assert _raises(d) is None


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.pop("metadata"), "no field 'metadata'"),
    (lambda r: r.update(forward_mode="PREFILL"), "is not one of"),
    (lambda r: r.update(page_size=0), "page_size must be an int >= 1"),
    (lambda r: r["forward_batch"].update(seq_lens=[9.0, 12, 16]), "forward_batch.seq_lens must be a list of ints"),
    (lambda r: r["forward_batch"].pop("extend_seq_lens"), "no field 'extend_seq_lens'"),
    (lambda r: r["metadata"].update(page_table=[[1, 2], [3]]), "equal-length lists"),
    (lambda r: r["req_to_token"].update(x=[1]), "not a row index"),
])
def test_malformed_dump_is_a_named_value_error(raw, edit, message):
    edit(raw)
    with pytest.raises(ValueError, match=message):
        dump.load(raw)
