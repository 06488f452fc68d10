"""GPU: the committed MT-Bench trace (SmolLM2-135M-Instruct's real schedule, recorded on CPU)
replayed on a Hopper GPU through the real FA3 kernel and ``torch.cuda.CUDAGraph``.

The target is a random-init model of SmolLM2's config (the real weights never reach the GPU
machine), bf16; acceptance is forced from the trace, so batch membership, seq_lens, a, joins and
finishes must equal the trace round for round (T0), and the tokens must equal the fp32 greedy
baseline under T2 (TOL-003), for v1 and v2 at page sizes 1, 4 and 16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refspec.cli.replay import main as replay_main
from refspec.traces.replay import replay_trace
from refspec.traces.chain import load_trace

pytestmark = pytest.mark.gpu

COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "mtbench_smollm2.json"


@pytest.mark.spec("SD-008", "TOL-003", "CG-002", "KV-006")
def test_gpu_replays_committed_trace_with_real_fa3_and_cuda_graphs():
    trace = load_trace(COMMITTED)
    rep = replay_trace(trace, device="cuda", dtype=torch.bfloat16, versions=["v1", "v2"], page_sizes=[1, 4, 16],
                       trace_path=str(COMMITTED))
    assert rep.provider != "emulator", "on Hopper the real FA3 kernel must be selected"
    assert len(rep.runs) == 6
    for run in rep.runs:
        assert not run.schedule, (run.version, run.page_size, run.schedule[:5])
        assert run.oracle_accepts_ok and run.kv_ok
        assert run.tokens_ok, (run.version, run.page_size, run.tokens)
        assert run.rounds == len(trace["rounds"]) and run.graph_replays > 0 and run.eager_forwards == 0


def test_gpu_replay_cli_writes_markdown(tmp_path):
    out = tmp_path / "replay_gpu.md"
    rc = replay_main([str(COMMITTED), "--device", "cuda", "--out", str(out)])
    md = out.read_text()
    assert rc == 0, md
    assert "dtype `bfloat16`" in md and "provider `emulator`" not in md and "**PASS**" in md
