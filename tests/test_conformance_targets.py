"""``--sglang SPEC`` against real upstream code (marker ``conformance``: ``make conformance``).

Each SPEC form resolves to the same code and the same result (a release, its wheel file, its
files laid out as a source tree); the shape read from each pinned release picks its adapter;
``--revert-fix 27360`` (upstream's own toggle, ``pr_fix_toggle.py``) changes what 0.5.23 does;
a failing row carries a rule ID, its level, and an upstream line that exists in the installed
file; a selection with no case is exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from refspec.conformance import install, report, run, sweep
from refspec.core.invariants import RULES

pytestmark = pytest.mark.conformance
REPO = Path(__file__).resolve().parent.parent
#: upstream results shared by the tests (keyed by code and inputs: a refspec variant reuses them)
UPSTREAM: dict = {}
SMALL = {"page_sizes": (4,), "modes": ("decode", "draft_extend_v2"), "log": lambda *_: None, "cache": UPSTREAM}


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def new():
    return install.resolve("0.5.23", log=quiet)


def test_the_pinned_releases_shapes_pick_their_adapters_from_the_code():
    new, old = (install.resolve(p, log=quiet) for p in install.PINS)
    assert (new.shape.hooks, new.shape.adapter) == ("graph", "refspec.conformance.upstream_graph")
    assert (old.shape.hooks, old.shape.adapter) == ("legacy", "refspec.conformance.upstream_legacy")
    assert not new.shape.draft_extend_v1 and old.shape.draft_extend_v1
    assert new.shape.staged and new.shape.own_tree and not old.shape.staged and not old.shape.own_tree
    assert new.shape.kernels == "sglang/kernels/ops/attention/metadata.py"
    assert old.shape.kernels == install.FA  # the fused Triton kernels still inside the backend file
    assert "27360" in new.shape.toggles and not old.shape.toggles
    assert new.tag == "v0.5.23" and new.label == "0.5.23"


def test_a_source_tree_and_a_wheel_file_run_the_same_code_as_the_release(new, tmp_path):
    """The installed 0.5.23 laid out as a checkout (``python/sglang``, linked: nothing copied), and
    the release's wheel file: same shape; the tree gives the same rows as the release, the wheel
    installs byte-identical backend files."""
    (tmp_path / "co" / "python").mkdir(parents=True)
    os.symlink(os.path.join(new.site, "sglang"), tmp_path / "co" / "python" / "sglang")
    tree = install.resolve(str(tmp_path / "co"), log=quiet)
    assert tree.kind == "tree" and tree.site == str(tmp_path / "co" / "python") and tree.tag is None
    assert tree.shape == new.shape
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "sglang==0.5.23", "-d",
                    str(wheels)], check=True, capture_output=True)
    (whl,) = wheels.glob("*.whl")
    wheel = install.resolve(str(whl), log=quiet)  # into .conformance/wheel-<sha256[:16]>, kept for the next run
    assert wheel.kind == "wheel" and wheel.version == "0.5.23" and wheel.shape == new.shape
    assert os.path.basename(wheel.site) == "wheel-" + install._file_hash(str(whl))[:16]
    assert install.resolve(str(whl), log=quiet).site == wheel.site  # keyed by content: reused
    for rel in (install.FA, new.shape.kernels):
        assert Path(wheel.site, rel).read_bytes() == Path(new.site, rel).read_bytes()
    outs = [run.run(sglang=[t], **SMALL) for t in (new, tree)]
    assert all(o.ok for o in outs), [run.render(o) for o in outs if not o.ok]
    key = [[(r.job, r.phase, r.step, [d.field for d in r.diffs]) for r in o.rows] for o in outs]
    assert key[0] == key[1] and key[0]
    assert [r.pin for r in outs[1].rows][0] == f"@ {tmp_path / 'co'}"


@pytest.mark.spec("TR-018")
def test_revert_fix_27360_brings_back_the_unsliced_draft_expand_scatter(new):
    """``27360`` removes ``cache_loc = cache_loc[:, :decode_length]`` from
    ``_apply_cuda_graph_metadata`` (upstream's toggle); the backend's own buffer check then raises.
    The other five toggles of 0.5.23 patch code off this path (the EAGLE v2 worker, the draft graph
    runner, FlashInfer, req_to_token sizing): they are listed, and not compared here."""
    sel = {"page_sizes": (4,), "modes": ("tree_draft_decode",), "topks": (2,), "log": quiet}
    clean = run.run(sglang=["0.5.23"], **sel)
    assert clean.ok, run.render(clean)
    reverted = run.run(sglang=["0.5.23"], revert_fix="27360", **sel)
    assert not reverted.ok and {r.pin for r in reverted.rows} == {"0.5.23 -fix 27360"}
    found = [f for r in reverted.rows if r.phase == "replay" for f in r.findings]
    assert found and {f.rule for f in found} == {"TR-018"} and {f.level for f in found} == {str(RULES["TR-018"].level)}
    assert all("used 3 > capacity 2" in f.theirs and f.where is not None for f in found)
    targets = new.shape.toggles["27360"]
    assert targets == ["sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend."
                       "_apply_cuda_graph_metadata"]


@pytest.mark.spec("MD-008")
def test_a_failing_row_names_the_rule_its_level_and_a_real_upstream_line(new, tmp_path):
    out = run.run(sglang=[new], variant="de-v2-k-double-count", **SMALL)
    rows = [r for r in out.rows if not r.ok]
    assert rows and all(r.findings for r in rows)
    for r in rows:
        for f in r.findings:
            assert f.rule in RULES and f.level == str(RULES[f.rule].level)
            rel, line = f.where
            text = Path(new.site, rel).read_text().splitlines()[line - 1]
            name = "page_table" if "page_table" in f.field else f.field.split(":")[-1].replace("_int32", "")
            assert name in text or "def " in text, (f, text)
            assert f.url == f"https://github.com/sgl-project/sglang/blob/v0.5.23/python/{rel}#L{line}"
    ks = {f.rule for r in rows for f in r.findings if f.field == "cache_seqlens_int32"}
    assert ks == {"MD-008"}
    md = report.markdown(out, "python -m refspec conformance --sglang 0.5.23 --variant de-v2-k-double-count")
    # no --base-url: the spec links go to this repository's blob (pyproject's Repository URL), as the footer says
    assert "[MD-008](https://github.com/refspec/refspec/blob/main/docs/spec/metadata.md#md-008)" in md
    assert "upstream behaviour" in md and "package metadata" in md.splitlines()[-1]
    assert "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/" in md


def test_zero_selected_cases_exit_2_with_the_reason():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for args, words in ((["--modes", "draft_extend", "--sglang", "0.5.23"], "ForwardMode has no DRAFT_EXTEND (v1)"),
                        (["--modes", "idle", "--sglang", "0.5.12.post1"], "not compared on idle")):
        p = subprocess.run([sys.executable, "-m", "refspec", "conformance", *args], capture_output=True, text=True,
                           cwd=REPO, env=env, check=False)
        assert p.returncode == 2 and words in p.stderr and "== OK" not in p.stdout, p.stderr


def test_the_sweep_measures_a_release_and_writes_its_row(tmp_path):
    """One release through the sweep: its cells come from the run, and the doc part is replaced
    between the markers (the full sweep: ``make sweep``)."""
    e = sweep.measure("0.5.12.post1", install.default_root(), log=quiet)
    # the sweep grid holds the edges where the known bugs show: 0.5.12.post1's context wall (P = 16) and its
    # unsliced draft expand scatter, which raises at num_steps 6, P = 2 (at S = 3 it reaches only dead columns)
    # and, since the MLA forward path joined the grid, its three known bugs at this release (ML-011, #26982, #36003)
    assert ("failing (context-wall-page-table, draft-expand-unsliced-scatter, mla-pool-no-move-kv-cache, "
            "mla-store-writes-slot-0, mla-verify-expand-paged-view)") in e["status"]
    assert sweep.cell(e["rules"]["CG-003"]) == "holds"
    assert sweep.cell(e["rules"]["TR-018"]) == "differs on upstream error (P = 2)"
    assert sweep.cell(e["rules"]["CG-008"]).startswith("differs on page_table[live] (P = 16)")
    doc = tmp_path / "versions.md"
    doc.write_text(f"# x\n\n{sweep.BEGIN}\nstale table\n{sweep.END}\n\nafter\n")
    sweep.write_doc([e], "python -m refspec conformance --sweep", 60.0, str(doc))
    text = doc.read_text()
    assert "stale table" not in text and text.endswith("after\n") and "| 0.5.12.post1 | legacy hooks" in text


@pytest.mark.spec("CG-008")
def test_an_index_error_past_req_to_token_names_cg_008_and_says_it_is_upstreams_exception():
    """The trial's setup: 0.5.23 with #35985's change (max_context_len = 320 + N = 324) on rows only
    context_len = 320 wide (no headroom): its draft-extend metadata reads req_to_token columns up to
    324 and raises IndexError ("index 320 is out of bounds for dimension 1 with size 320") in every
    phase; each row names CG-008 (the page-table bound), not the mode's rule (MD-008 / CG-004)."""
    from refspec.conformance import cases, controls

    t = controls.Code("0.5.23", ("pr35985-page-table-width",)).target(log=quiet)
    jobs = cases.build_jobs(("draft_extend_v2",), (4,), ("B3/bs4",), staged=t.shape.staged, extra=0)
    assert jobs[0].inputs["req_to_token"].shape[1] == 320
    rows = run.rows_for(t, jobs, run.run_worker(t, jobs)[0])
    assert {r.phase for r in rows} == {"eager", "capture", "replay", "replay-staged"}
    for r in rows:
        assert r.error and r.error.startswith("IndexError") and "size 320" in r.error, r.error
        (f,) = r.findings
        assert f.rule == "CG-008" and f.level == str(RULES["CG-008"].level) and r.bug is None
        assert "past a table's width" in report.finding_line(r, f) and "upstream exception" in f.note


#: (release, modes, page size, what the selection exercises) -- one small selection per adapter gap
#: the sweep found (issue 21 item 5); each release is installed like any ``--sglang`` release
OLD_RELEASES = (
    ("0.4.4.post2", ("extend_prefix",), 1),  # vllm fallbacks, flash_attn_interface, extend_prefix_lens
    ("0.5.1", ("draft_decode", "draft_extend"), 1),  # S - 1 draft steps, typed spec_info, accept_length names
    ("0.5.6", ("decode", "draft_extend_v2"), 1),  # is_hybrid_swa; DRAFT_EXTEND_V2 graphs built only on an NPU
    ("0.5.13", ("decode",), 1),  # graph hooks without runtime_context.py
    ("0.5.16", ("decode",), 1),  # model_runner.server_args beside the runtime-context override
    ("0.5.17", ("decode",), 1),  # model_runner.token_to_kv_pool_allocator (the unified-pool probe)
    ("0.5.19", ("tree_verify",), 1),  # the tree dispatch by platform flags
)


#: the sample make conformance (CI) runs; the rest run under ``make sweep`` (marker ``releases``)
CI_SAMPLE = ("0.5.1", "0.5.16")


@pytest.mark.parametrize("version,modes,P", [pytest.param(*r, marks=() if r[0] in CI_SAMPLE else pytest.mark.releases)
                                             for r in OLD_RELEASES], ids=[r[0] for r in OLD_RELEASES])
def test_old_releases_are_driven_by_the_adapter_their_shape_picks(version, modes, P):
    t = install.resolve(version, log=quiet)
    out = run.run(sglang=[t], page_sizes=(P,), modes=modes, topks=(2,), log=quiet)
    rows = out.rows
    assert rows and {r.mode for r in rows} == set(modes)
    gaps = [(r.job, r.phase, f.theirs) for r in rows for f in r.findings if f.rule == report.ADAPTER]
    assert not gaps, gaps  # every row is upstream's own result, never refspec's adapter failing
    by_mode = {m: [r for r in rows if r.mode == m] for m in modes}
    if version == "0.4.4.post2":
        assert all(r.error is None for r in rows)  # eager extend with a prefix built by upstream
    if version == "0.5.1":
        # v1 draft extend under the old names: n + 1 on the device, n on the host (a wrong mapping
        # differs on cu_seqlens_q / max_seq_len_q); draft decode: steps 0 .. S - 2, all equal
        assert all(r.ok for r in by_mode["draft_extend"]), [r.findings for r in by_mode["draft_extend"] if not r.ok]
        assert all(r.ok for r in by_mode["draft_decode"])
        assert {0, 1} <= {r.step for r in by_mode["draft_decode"]}  # num_steps 3: steps 0, 1 (no unused S-th)
    if version == "0.5.6":
        assert all(r.ok for r in by_mode["decode"])
        # its spec-v2 worker builds the draft-extend graph only on an NPU: the capture / replay its backend has
        # no DRAFT_EXTEND_V2 branch for never run on CUDA (not reachable upstream, never a CG-004 failure)
        assert by_mode["draft_extend_v2"] and {r.phase for r in by_mode["draft_extend_v2"]} == {"eager"}
        graphs = [(job, why) for _label, job, why, *_ in out.unreachable if job.startswith("draft_extend_v2/")]
        assert graphs and all(job.endswith("/graphs") and "only on an NPU" in why for job, why in graphs), graphs
    if version in ("0.5.13", "0.5.16", "0.5.17"):
        assert all(r.error is None for r in rows)
    if version == "0.5.19":
        assert all(r.ok for r in rows), [r.findings for r in rows if not r.ok]


@pytest.mark.spec("CG-003", "MD-009")
def test_an_accept_length_field_the_adapter_does_not_know_is_an_adapter_gap_with_exit_3():
    """A planted rename of the v1 draft extend's accepted counts (``patches/mutants/``: 0.5.12.post1 reading
    ``spec_info.num_accepted_drafts_plus_one``, as a PR renaming them would): refspec cannot lay out what
    that code reads, so every draft-extend result is an adapter gap, said as such, never a rule failure
    (CG-003 is not accused), and the run exits 3."""
    from refspec.conformance import controls

    t = controls.Code("0.5.12.post1", ("draft-extend-unknown-accept-name",)).target(log=quiet)
    assert "spec_info.num_accepted_drafts_plus_one" in t.shape.gaps["draft_extend"]
    p = subprocess.run([sys.executable, "-m", "refspec", "conformance", "--sglang", t.site, "--modes", "draft_extend",
                        "--page-sizes", "4"], capture_output=True, text=True, cwd=REPO, check=False,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 3, p.stdout + p.stderr
    gaps = [x for x in p.stdout.splitlines() if x.startswith("  ADAPTER GAP ")]
    assert gaps and all("no rule broken; refspec cannot drive this code yet" in x for x in gaps)
    assert "CG-003" not in p.stdout and "== FAIL" not in p.stdout
    assert "== ADAPTER GAP: 6 results not compared (no rule broken; refspec cannot drive this code yet)" in p.stdout
