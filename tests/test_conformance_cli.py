"""``python -m refspec conformance``'s argument handling, without upstream (fake trees, canned results).

Usage errors come before torch loads (the names checked against: :mod:`refspec.conformance.names`,
kept equal to the case builders' own here); each is one line naming the option, exit 2: an empty
``--modes``, a malformed or unknown ``--expect-bugs`` item (no quote or exception text leaking), an
unknown ``--variant`` (each name listed once), a ``--base-url`` that is no http(s) URL, a
``--report`` file that cannot be created (tried, not guessed).  With several targets each compares
its own subset of ``--modes`` and names the ones it skips; ``--modes mla`` is every ``mla_*`` mode
the code has.  The report echoes the command quoted as a shell reads it; with ``--variant`` the
headline names refspec's planted variant, not sglang.  A symlinked default install root refuses a
new install unless ``--root`` is given.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import torch

from refspec.cli.conformance import main
from refspec.conformance import cases, install, mla_forward, names, tree_cases
from refspec.conformance import run as conformance
from refspec.conformance.cases import Job
from refspec.mutants import variants
from test_conformance_specs import GRAPH_FA, LEGACY_FA, REPO, fake_tree

OURS = {"cache_seqlens_int32": torch.tensor([65, 24], dtype=torch.int32), "cu_seqlens_q": torch.tensor([0, 4, 8]),
        "cu_seqlens_k": torch.tensor([0, 65, 89]), "max_seq_len_q": 4, "max_seq_len_k": 0,
        "page_table": torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 0, 0, 0, 0]], dtype=torch.int32)}


def test_the_light_names_equal_the_case_builders_own():
    """The CLI checks arguments against :mod:`names` (no torch); a drift from the builders fails here."""
    assert set(names.FLAT_MODES) == set(cases.MODES) and names.TREE_MODES == tree_cases.MODES
    assert names.MLA_MODES == mla_forward.MODES and names.MLA_GRIDS == mla_forward.GRIDS
    assert names.PAGE_SIZES == tuple(sorted(set(cases.PAGE_SIZES) | set(tree_cases.PAGE_SIZES)))
    assert names.TOPKS == tree_cases.TOPKS
    assert names.expand(["decode", "mla", "mla_decode"]) == ["decode", *mla_forward.MODES]


def error(capsys, *args: str) -> str:
    """The one stderr line of a usage error (exit 2, nothing on stdout)."""
    rc = main(list(args))
    cap = capsys.readouterr()
    (line,) = cap.err.strip().splitlines()
    assert rc == 2 and cap.out == "", (rc, cap)
    return line


def test_a_usage_error_comes_before_torch_loads():
    code = ("import sys; from refspec.cli.conformance import main; rc = main(['--modes', '']); "
            "print(rc, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stdout.split() == ["2", "False"], p
    assert "'' is not a comma-separated list of modes (e.g. decode,draft_decode)" in p.stderr  # not the P example


@pytest.mark.parametrize("args, said", [
    (["--expect-bugs", "garbage"], "argument --expect-bugs: garbage: expected LABEL:KEY, a target and a known upstream "
                                   "bug (e.g. 0.5.23:context-wall-page-table)"),
    (["--expect-bugs", "0.4.7:no-such-bug"], "argument --expect-bugs: 0.4.7:no-such-bug: no-such-bug is no known "
                                             "upstream bug; the known ones: context-wall-page-table, "),
    (["--base-url", "not a url"], "--base-url 'not a url': not an http(s) URL"),
    (["--base-url", "ftp://example.org/x"], "--base-url 'ftp://example.org/x': not an http(s) URL"),
])
def test_each_argument_error_is_one_clean_line(capsys, tmp_path, args, said):
    line = error(capsys, *args, "--root", str(tmp_path / "root"))
    assert said in line
    if args[0] == "--expect-bugs":  # the item as given: no stray quote, no exception repr
        assert not {"'", '"'} & set(line)
    assert not (tmp_path / "root").exists()


def test_an_unknown_variant_lists_each_name_once(capsys):
    line = error(capsys, "--variant", "nope")
    listed = line.split("choose from ", 1)[1].removesuffix(" (see --help)").split(", ")
    assert listed == sorted(variants.VARIANTS) and len(listed) == len(set(listed))


def test_a_bad_docs_url_in_the_environment_is_named(capsys, monkeypatch):
    monkeypatch.setenv("REFSPEC_DOCS_URL", "docs here")
    assert "$REFSPEC_DOCS_URL 'docs here': not an http(s) URL" in error(capsys, "--modes", "decode")
    monkeypatch.setenv("REFSPEC_DOCS_URL", "https://example.org/refspec/blob/v1")  # a good one passes the check
    assert "REFSPEC_DOCS_URL" not in error(capsys, "--modes", "decode", "--variant", "nope")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_report_file_that_cannot_be_created_is_refused_before_any_run(capsys, tmp_path):
    """/proc is a writable-looking folder to root (``os.access``) where no file can be created."""
    line = error(capsys, "--sglang", "0.5.23", "--report", "/proc/version.md", "--root", str(tmp_path / "root"))
    assert line.endswith("error: --report /proc/version.md: cannot be written (No such file or directory)")
    assert not (tmp_path / "root").exists()


def test_the_report_check_leaves_no_file_and_keeps_an_old_one(capsys, tmp_path):
    new, old = tmp_path / "review.md", tmp_path / "r.md"  # a fresh report, and one a last review left
    old.write_text("the last review\n")
    for path in (new, old):  # a later argument error stops the run after the --report check
        assert "--variant" in error(capsys, "--report", str(path), "--variant", "nope")
    assert not new.exists() and old.read_text() == "the last review\n"


@pytest.fixture
def trees(tmp_path, monkeypatch):
    """A graph-hooks tree with DRAFT_EXTEND_V2 only and a legacy-hooks tree with DRAFT_EXTEND (v1) only;
    each mode's job is one verify-shaped replay result, upstream's canned equal to refspec's."""
    monkeypatch.setattr(install, "_deps", lambda root, log: str(tmp_path / "deps"))
    v2 = fake_tree(tmp_path / "v2 tree", GRAPH_FA)  # (a space in the path: the echoed command quotes it)
    v1 = fake_tree(tmp_path / "v1", LEGACY_FA, modes="DRAFT_EXTEND = auto()")
    ran = {}

    def jobs(target, page_sizes, modes, topks, variant=None, edges=None):
        return [Job(f"{m}/P16/B3/bs4", m, 16, "B3/bs4", True, {}, {("replay", None): OURS}) for m in modes]

    def worker(target, js):
        ran[target.label] = [j.mode for j in js]
        return {j.id: {("replay", None): ran.get("theirs", OURS)} for j in js}, {"import_s": 0.0}

    monkeypatch.setattr(conformance, "_jobs", jobs)
    monkeypatch.setattr(conformance, "_mla_jobs", lambda *a, **k: [])
    monkeypatch.setattr(conformance, "run_worker", worker)
    return v2, v1, ran


def test_several_targets_each_compare_their_own_subset_of_the_modes(trees, tmp_path, capsys):
    v2, v1, ran = trees
    root = str(tmp_path / "root")
    rc = main(["--sglang", f"{v2},{v1}", "--modes", "draft_extend,draft_extend_v2", "--page-sizes", "16",
               "--root", root])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert ran == {f"@ {v2}": ["draft_extend_v2"], f"@ {v1}": ["draft_extend"]}
    assert f"== not compared on sglang @ {v2} (requested by --modes, which it lacks): draft_extend: ForwardMode " \
           f"has no DRAFT_EXTEND (v1)" in text
    assert f"== not compared on sglang @ {v1} (requested by --modes, which it lacks): draft_extend_v2: ForwardMode " \
           f"has no DRAFT_EXTEND_V2" in text
    # a target that gets none of them is still an error, naming it; one target is strict about a named mode
    line = error(capsys, "--sglang", f"{v2},{v1}", "--modes", "draft_extend", "--page-sizes", "16", "--root", root)
    assert f"sglang @ {v2} compares none of the requested modes draft_extend" in line
    line = error(capsys, "--sglang", str(v2), "--modes", "draft_extend,draft_extend_v2", "--page-sizes", "16",
                 "--root", root)
    assert f"sglang @ {v2} is not compared on draft_extend" in line


def test_the_mla_group_takes_the_mla_modes_the_code_has(trees, tmp_path, monkeypatch):
    v2, v1, _ = trees
    monkeypatch.setattr(mla_forward, "has_mla_path", lambda site: True)
    t = install.resolve(str(v2), root=str(tmp_path / "root"), log=lambda *_: None)
    take, skip = conformance.wanted(t, ["mla"])
    assert take == [f"mla_{m}" for m in ("decode", "extend", "extend_prefix", "verify", "draft_decode",
                                         "draft_extend_v2")]
    assert skip["mla_draft_extend"] == "ForwardMode has no DRAFT_EXTEND (v1)"
    assert set(skip) == {"mla_draft_extend", "mla_tree_verify", "mla_tree_draft_decode"}  # (no tree builder here)
    with pytest.raises(conformance.NoCases, match="is not compared on mla_draft_extend"):  # named outright: strict
        conformance.wanted(t, ["mla_draft_extend"])
    monkeypatch.setattr(mla_forward, "has_mla_path", lambda site: False)
    with pytest.raises(conformance.NoCases, match="compares none of the requested modes mla"):
        conformance.wanted(t, ["mla"])


def test_the_report_echoes_the_command_quoted_and_a_variant_is_named_as_refspecs(trees, tmp_path, capsys):
    v2, _, ran = trees
    out = tmp_path / "my review.md"
    args = ["--sglang", str(v2), "--modes", "verify", "--page-sizes", "16", "--report", str(out),
            "--root", str(tmp_path / "root")]
    ran["theirs"] = dict(OURS, cache_seqlens_int32=torch.tensor([66, 24], dtype=torch.int32))
    rc = main(args)
    text, md = capsys.readouterr().out, out.read_text()
    assert rc == 1 and f"== FINDING 1 of 1: MD-011 (upstream behaviour) broken by sglang @ {v2} in 1 result" in text
    echoed = md.split("`")[1]
    assert shlex.split(echoed) == ["python", "-m", "refspec", "conformance", *args]
    assert "variant" not in md
    rc = main([*args, "--variant", "replay-rebind-cache-seqlens"])  # (the canned upstream: refspec's side differs)
    text, md = capsys.readouterr().out, out.read_text()
    assert rc == 1 and ("== FINDING 1 of 1: MD-011 (upstream behaviour) broken by refspec's planted variant "
                        f"replay-rebind-cache-seqlens (a negative control; sglang @ {v2} is the upstream side)") in text
    assert "refspec's bug variant replay-rebind-cache-seqlens is on (a negative control)" in text
    assert "refspec's bug variant `replay-rebind-cache-seqlens` was switched on" in md


def test_a_symlinked_default_root_refuses_a_new_install_unless_root_is_given(tmp_path, monkeypatch, capsys):
    other, link = tmp_path / "other checkout's .conformance", tmp_path / "link"
    other.mkdir()
    link.symlink_to(other)
    monkeypatch.setattr(install, "default_root", lambda: str(link))
    pip = []
    monkeypatch.setattr(install.subprocess, "run", lambda cmd, **k: pip.append(cmd) or
                        subprocess.CompletedProcess(cmd, 1, "", "ERROR: planted"))
    with pytest.raises(install.LinkedRoot, match=f"{link} is a symlink to {other} .*pass --root {other}"):
        install.resolve("0.5.14", log=lambda *_: None)
    assert pip == [] and os.listdir(other) == []
    line = error(capsys, "--sglang", "0.5.14", "--modes", "decode")
    assert "not installing sglang==0.5.14" in line and "--root" in line and pip == []
    # given explicitly, the same folder is installed into (pip runs; here it fails as planted)
    with pytest.raises(install.PipError, match="planted"):
        install.resolve("0.5.14", root=str(link), log=lambda *_: None)
    assert pip and "sglang==0.5.14" in pip[0]
    # a release already installed there is reused without --root
    site = fake_tree(tmp_path / "pkg", GRAPH_FA) / "python"
    os.rename(site, other / "sglang-0.5.14")
    for d, text in ((other / "sglang-0.5.14", "sglang==0.5.14\n"), (other / "deps", "\n".join(install.DEPS) + "\n")):
        d.mkdir(exist_ok=True)
        (d / install.STAMP).write_text(text)
    pip.clear()
    assert install.resolve("0.5.14", log=lambda *_: None).site == str(link / "sglang-0.5.14") and pip == []
