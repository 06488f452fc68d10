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
