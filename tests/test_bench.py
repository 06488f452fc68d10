"""The benchmark script keeps working: its smallest configuration runs on CPU (benchmarks are
not tests; speed targets live in ``python -m refspec bench``, not here)."""

from __future__ import annotations

import json

from refspec.cli import bench


def test_bench_quick_runs_and_writes_tables(tmp_path, capsys):
    assert bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for section in bench.SECTIONS:
        assert f"### {section}" in text
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    kernel = [r for r in rows if r["section"] == "kernel" and "pct_bw" in r]
    assert kernel and all(r["us"] > 0 and r["pct_bw"] > 0 for r in kernel)
    assert (tmp_path / "bench.md").read_text().startswith("device: cpu")
    # on CPU: a caveat that the timings say nothing about the GPU claims, and no empty plot
    assert text.splitlines()[0].startswith("note: CPU run") and "noise for the GPU claims" in text
    assert "noise for the GPU claims" in (tmp_path / "bench.md").read_text()
    assert not (tmp_path / "bench.png").exists() and "no plot:" in text


def test_plot_of_rows_without_a_real_kernel_is_refused_in_one_line(tmp_path, capsys):
    rows = [dict(section="kernel", P=1, B=1, ctx=64, Q=1, us=5.0, pct_bw=1.0, provider="emulator")]
    (tmp_path / "bench.json").write_text(json.dumps({"env": "cpu", "rows": rows}))
    assert bench.main(["--plot", str(tmp_path / "bench.json")]) == 2
    err = capsys.readouterr().err
    assert "no plot" in err and "real-kernel rows" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "bench.png").exists()


def test_plot_of_real_kernel_rows_draws_both_panels(tmp_path):
    rows = [dict(section="kernel", P=P, B=8, ctx=4096, Q=Q, us=5.0, pct_bw=90.0, provider="fa3")
            for P in (1, 16) for Q in (1, 4)]
    assert bench.plot(rows, tmp_path / "bench.png") and (tmp_path / "bench.png").stat().st_size > 1000


def test_host_timers_time_the_result_wait_and_restore_the_methods():
    """HostTimers (the host section's profiler-free host timing) wraps ResultCopy.wait and
    CUDAGraph.replay for its duration only, and adds the seconds spent inside them."""
    import time

    import torch

    from refspec.cli._bench_profile import HostTimers
    from refspec.core.transfer import ResultCopy

    before = (ResultCopy.wait, torch.cuda.CUDAGraph.replay)
    orig_wait = ResultCopy.wait

    def slow_wait(self):
        time.sleep(0.02)
        return orig_wait(self)

    ResultCopy.wait = slow_wait
    try:
        with HostTimers() as t:
            assert ResultCopy(torch.arange(3)).wait() == [0, 1, 2]
            assert ResultCopy.wait is not slow_wait
        assert ResultCopy.wait is slow_wait
    finally:
        ResultCopy.wait = orig_wait
    assert t.wait >= 0.02 and t.replay == 0.0
    assert (ResultCopy.wait, torch.cuda.CUDAGraph.replay) == before


def test_host_section_on_cpu_is_a_skip_row_naming_the_gpu():
    from refspec.cli._bench_host import bench_host

    rows = bench_host(torch_device("cpu"), quick=False)
    assert len(rows) == 1 and rows[0]["section"] == "host" and "needs a CUDA GPU" in rows[0]["what"]


def torch_device(name):
    import torch
    return torch.device(name)


def test_peer_section_on_cpu_matches_graph_greedy_tokens():
    """The peer row (bench --sections peer): on CPU the uncompiled peer and refspec's greedy
    decode the same tokens (fp32, large margins: T2 passes as plain equality)."""
    from refspec.cli._bench_peer import bench_peer

    host, *rows = bench_peer(torch_device("cpu"), quick=True)
    assert host["section"] == "peer host" and host["launch_us"] > 0 and host["python_loop_ns"] > 0
    assert [r["B"] for r in rows] == [1, 4]
    for r in rows:
        assert r["t2_vs_peer"] == f"{r['B']}/{r['B']} pass" and r["t2_notes"] == "equal"
        assert r["peer_tok_per_s"] > 0 and r["graph_greedy_tok_per_s"] > 0


def test_peer_equals_the_dense_oracle_greedy():
    """PeerGreedy (static cache, SDPA, index_put writes) is an independent greedy: its tokens
    equal the dense oracle's, request by request, at B = 3 with prompts of different lengths."""
    import torch

    from refspec.cli._bench_peer import PeerGreedy
    from refspec.model.llama import LlamaModel, init_random_, tiny_config
    from refspec.oracle.loop import greedy

    m = init_random_(LlamaModel(tiny_config()), seed=3).eval()
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7], [11]]
    with torch.no_grad():
        run = PeerGreedy(m, 3, 64, compile=False).generate(prompts, 9)
    assert run.tokens == [greedy(m, p, 9).tokens for p in prompts]
    assert all(len(x) == 9 and min(x) >= 0 for x in run.margins)
