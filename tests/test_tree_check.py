"""``python -m refspec check --sections tree --quick``: every tree row passes, and a wrong variant fails it."""

from __future__ import annotations

import pytest

from refspec.cli.check import main
from refspec.mutants.tree_variants import apply_variant


@pytest.mark.spec("TR-018", "TR-019", "TR-020", "TR-021")
def test_tree_check_quick_passes_with_every_row(capsys):
    rc = main(["--quick", "--sections", "tree"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith("tree ")]
    modes = {(r[1], r[2]) for r in rows}
    assert {("TREE_VERIFY", "k=2"), ("TREE_VERIFY", "k=4"), ("TREE_DRAFT", "k=2"), ("TREE_DRAFT", "k=4"),
            ("TREE_LOOP", "k=2"), ("TREE_LOOP", "k=4")} <= modes
    assert all("pass" in r for r in rows) and len(rows) == 2 * 2 * (3 + 3 + 4)
    loops = [line for line in out.splitlines() if line.startswith("tree ") and "TREE_LOOP" in line]
    assert sum("lossless v2" in line for line in loops) == sum("lossless v1" in line for line in loops) == 2 * 2 * 2


@pytest.mark.spec("TR-012")
def test_tree_check_fails_on_the_unscaled_merge(capsys):
    with apply_variant("lse-merge-no-rescale"):
        rc = main(["--quick", "--sections", "tree", "--page-sizes", "4"])
    out = capsys.readouterr().out
    assert rc == 1 and " FAIL " in out


@pytest.mark.spec("TR-018")
def test_ungraphable_provider_rows_capture_no_graph(monkeypatch):
    """On CUDA the emulator syncs with the host, so its rows must stay eager: the H200 run of
    ``check --device cuda --sections tree`` failed 24 emulator rows when they captured a graph."""
    import torch

    from refspec.cli import _check_tree as ct

    def no_graph(*a, **k):
        raise AssertionError("an eager-only row captured a CUDA graph")

    monkeypatch.setattr(ct, "make_graph", no_graph)
    for fn in (ct._verify_checks, ct._draft_checks):
        eager, same, vs = fn(4, 2, torch.float32, "cpu", "emulator", False)
        eager = eager if isinstance(eager, tuple) else (eager,)
        assert all(v.ok for v in eager)
        assert same in (None, (None,) * len(eager)) and vs in (None, (None,) * len(eager))
