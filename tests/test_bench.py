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
