"""``--sglang SPEC`` without upstream: SPEC forms, API-shape detection on tiny fake trees, fix
toggles, the one-line exit-2 errors, the zero-case guard, the rule map and the line locator.

(The same against the real releases: ``tests/test_conformance_upstream.py``, marker ``conformance``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from refspec.conformance import install, rules
from refspec.conformance import run as conformance
from refspec.core.invariants import RULES

REPO = Path(__file__).resolve().parent.parent

GRAPH_FA = """
class FlashAttentionMetadata:
    pass

class FlashAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, forward_batch):
        if forward_batch.forward_mode.is_decode_or_idle():
            metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
        self.forward_metadata_spec_decode_expand = None
    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass
    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass
    def stage_draft_extend_metadata(self, forward_batch):
        pass

class FlashAttentionMultiStepBackend:
    def init_forward_metadata(self, forward_batch):
        pass
    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass
    def init_forward_metadata_in_graph(self, forward_batch):
        pass
"""
BASE = """
class AttentionBackend(ABC):
    def init_forward_metadata_in_graph(self, forward_batch):
        pass
"""
LEGACY_FA = """
class FlashAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, forward_batch):
        pass
    def init_cuda_graph_state(self, max_bs):
        pass
    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        pass
    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        pass
"""
NO_HOOKS_FA = """
class FlashAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, forward_batch):
        pass
"""
FBI = """
class ForwardMode(IntEnum):
    EXTEND = auto()
    DECODE = auto()
    TARGET_VERIFY = auto()
    {extra}
"""
TOGGLES = '''
_PR_REVERT_YAML_1 = """
patches:
  - target: sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend.init_forward_metadata
    edits:
      - match: x
        replacement: y
"""
_PR_FIX_REVERT_YAML: Dict[int, str] = {
    111: _PR_REVERT_YAML_1,
}
'''


@pytest.fixture(autouse=True)
def no_deps_install(monkeypatch, tmp_path):
    """A fake tree is never run: resolving it needs no dependency install."""
    monkeypatch.setattr(install, "_deps", lambda root, log: str(tmp_path / "deps"))


def fake_tree(root: Path, fa: str, modes: str = "DRAFT_EXTEND_V2 = auto()", base: str = BASE,
              toggles: str | None = None, runner_files: bool = True) -> Path:
    """A minimal SGLang checkout under ``root`` (``python/sglang/...``); returns the checkout."""
    sg = root / "python" / "sglang"
    files = {"__init__.py": "", "srt/layers/attention/flashattention_backend.py": fa,
             "srt/layers/attention/base_attn_backend.py": base,
             "srt/model_executor/forward_batch_info.py": FBI.format(extra=modes)}
    if runner_files:
        files.update({"srt/mem_cache/kv_index_translator.py": "", "srt/runtime_context.py": ""})
    if toggles is not None:
        files["srt/debug_utils/pr_fix_toggle.py"] = toggles
    for rel, text in files.items():
        p = sg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refspec", "conformance", *args], capture_output=True, text=True,
                          cwd=cwd, check=False, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_a_graph_hook_tree_is_driven_by_the_graph_adapter_with_its_modes(tmp_path):
    tree = fake_tree(tmp_path / "co", GRAPH_FA, toggles=TOGGLES)
    for spec in (tree, tree / "python"):  # the checkout or its python/ folder
        t = install.resolve(str(spec), root=str(tmp_path / "root"), log=lambda *_: None)
        assert t.kind == "tree" and t.site == str(tree / "python") and t.label == f"@ {spec}"  # "sglang @ ..." once
        assert t.paths[0] == str(tree / "python")  # used in place: nothing copied
    s = t.shape
    assert s.hooks == "graph" and s.adapter == "refspec.conformance.upstream_graph"
    assert (s.draft_extend_v1, s.draft_extend_v2, s.topk, s.staged, s.own_tree) == (False, True, True, True, False)
    assert s.modes == ("decode", "extend", "extend_prefix", "verify", "draft_decode", "draft_extend_v2", "idle")
    assert s.toggles == {"111": ["sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend."
                                 "init_forward_metadata"]}
    assert not any((tree / "python").rglob("__pycache__"))


def test_a_legacy_hook_tree_with_v1_is_driven_by_the_legacy_adapter(tmp_path):
    tree = fake_tree(tmp_path, LEGACY_FA, modes="DRAFT_EXTEND = auto()")
    s = install.detect(str(tree / "python"))
    assert s.hooks == "legacy" and s.adapter == "refspec.conformance.upstream_legacy"
    # no FlashAttentionMultiStepBackend here: draft decode is not compared, and says why
    assert "draft_decode" not in s.modes and "FlashAttentionMultiStepBackend" in s.no_draft_decode
    assert s.modes == ("decode", "extend", "extend_prefix", "verify", "draft_extend")


def test_a_tree_without_the_hooks_is_a_one_line_exit_2_naming_what_is_missing(tmp_path):
    tree = fake_tree(tmp_path, NO_HOOKS_FA)
    with pytest.raises(install.UnsupportedSpec, match="neither the graph hooks init_forward_metadata_out_graph"):
        install.resolve(str(tree), root=str(tmp_path / "root"))
    p = cli("--sglang", str(tree), "--root", str(tmp_path / "root"))
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.strip().splitlines()
    assert "cannot drive this API shape" in line and "init_forward_metadata_capture_cuda_graph" in line


def test_a_legacy_hook_lacking_a_parameter_the_adapter_passes_is_named(tmp_path):
    fa = LEGACY_FA.replace("bs, req_pool_indices, seq_lens, seq_lens_sum", "bs, seq_lens, seq_lens_sum")
    s = install.detect(str(fake_tree(tmp_path, fa) / "python"))
    assert s.adapter is None and "init_forward_metadata_replay_cuda_graph takes no req_pool_indices" in s.missing


def test_graph_hooks_without_the_runtime_context_are_driven(tmp_path):
    # 0.5.13: the graph hooks, no srt/runtime_context.py (server args published through
    # server_args.py and read from the model runner): the graph adapter drives it without one
    s = install.detect(str(fake_tree(tmp_path, GRAPH_FA, runner_files=False) / "python"))
    assert s.adapter == "refspec.conformance.upstream_graph" and s.missing is None


def test_specs_that_name_nothing_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    for spec, words in (("not-a-version", "neither a release version"), (str(tmp_path / "empty"), "not an SGLang"),
                        (str(tmp_path / "x.whl"), "does not exist")):
        with pytest.raises(install.UnsupportedSpec, match=words):
            install.resolve(spec, root=str(tmp_path / "root"))
        p = cli("--sglang", spec, "--root", str(tmp_path / "root"))
        assert p.returncode == 2 and words in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_revert_fix_needs_a_registered_toggle(tmp_path):
    with_t = fake_tree(tmp_path / "a", GRAPH_FA, toggles=TOGGLES)
    without = fake_tree(tmp_path / "b", GRAPH_FA)
    t = install.resolve(str(with_t), root=str(tmp_path / "r"), revert_fix="#111")
    assert t.revert_fix == "111" and t.label.endswith(" -fix 111")
    with pytest.raises(install.UnsupportedSpec, match="registers no fix '999'; its fix toggles: 111"):
        install.resolve(str(with_t), root=str(tmp_path / "r"), revert_fix="999")
    with pytest.raises(install.UnsupportedSpec, match="has no fix toggles"):
        install.resolve(str(without), root=str(tmp_path / "r"), revert_fix="111")
    p = cli("--sglang", str(with_t), "--revert-fix", "999", "--root", str(tmp_path / "r"))
    assert p.returncode == 2 and "its fix toggles: 111" in p.stderr


def test_ensure_never_removes_a_directory_it_did_not_create(tmp_path):
    mine = tmp_path / "sglang-0.0.1"
    mine.mkdir()
    (mine / "edited.py").write_text("# a user's hand edit")
    with pytest.raises(RuntimeError, match="was not installed by refspec"):
        install._ensure(str(mine), ("sglang==0.0.1",), print)
    assert (mine / "edited.py").exists()


def test_a_selection_with_no_case_is_refused_with_the_reason(tmp_path):
    t = install.resolve(str(fake_tree(tmp_path, GRAPH_FA)), root=str(tmp_path / "r"))
    with pytest.raises(conformance.NoCases, match=r"not compared on draft_extend .*no DRAFT_EXTEND \(v1\)"):
        conformance.select(t, (4,), ("draft_extend",), (2,))
    t.shape.modes = (*t.shape.modes, "tree_verify")
    # 32: no tree case (tree page sizes 1, 2, 4, 8, 16, 64); top-k = 1 cases take any page size
    with pytest.raises(conformance.NoCases, match="no case compares modes tree_verify at page sizes 32"):
        conformance.select(t, (32,), ("tree_verify",), (2,))
    with pytest.raises(conformance.NoCases, match="mode tree_verify has no case at page sizes 32"):
        conformance.select(t, (32,), ("decode", "tree_verify"), (2,))


def test_every_compared_field_maps_to_a_catalogue_rule_with_a_level():
    from refspec.conformance.cases import MODES
    from refspec.conformance.compare import KERNEL_FIELDS, OTHER_FIELDS, PARTS
    from refspec.conformance.tree_cases import MODES as TREE

    for mode in [*MODES, *TREE]:
        for phase in ("eager", "capture", "replay", "replay-staged"):
            fields = [*KERNEL_FIELDS, *OTHER_FIELDS, None]
            if mode in TREE:
                fields = [f"{p}:{f}" for p in PARTS for f in fields if f] + ["tree:positions", "tree:x", None]
            for f in fields:
                rid = rules.rule_for(mode, phase, f)
                assert rid in RULES and rules.level(rid) == str(RULES[rid].level)
    assert rules.rule_for("draft_extend_v2", "replay", "cache_seqlens_int32") == "MD-008"
    assert rules.rule_for("draft_extend_v2", "replay", "cu_seqlens_q") == "CG-004"
    assert rules.rule_for("verify", "replay", "page_table[live]", short_table=True) == "CG-008"  # graph buffer
    assert rules.rule_for("verify", "eager", "page_table[live]", short_table=True) == "PA-003"
    # the dead width below the kernel bound is the same table's defect: the same rule as the live pages
    assert rules.rule_for("verify", "replay", "page_table[dead]", short_table=True) == "CG-008"
    assert rules.rule_for("verify", "eager", "page_table[dead]", short_table=True) == "PA-003"
    assert rules.rule_for("verify", "replay", "page_table[dead]") == "MD-007"
    assert rules.rule_for("tree_draft_decode", "replay", None) == "TR-018"


def test_the_locator_reads_the_line_from_the_code_under_test(tmp_path):
    site = fake_tree(tmp_path, GRAPH_FA) / "python"
    rel, line = rules.locate(str(site), (install.FA,), "graph", "decode", "eager", "cache_seqlens_int32")
    text = (site / rel).read_text().splitlines()[line - 1]
    assert rel == install.FA and "metadata.cache_seqlens_int32 =" in text
    # no write of the field in the phase's functions: the def line of the first one present
    rel, line = rules.locate(str(site), (install.FA,), "graph", "decode", "replay", "cu_seqlens_q")
    assert "def init_forward_metadata_out_graph" in (site / rel).read_text().splitlines()[line - 1]
    # none of the phase's functions present: None (never a made-up line)
    assert rules.locate(str(site), (install.FA,), "legacy", "decode", "replay", "cu_seqlens_q") is None


def test_an_error_raised_in_refspecs_adapter_is_not_reported_as_a_broken_rule():
    from refspec.conformance.report import ADAPTER, Row, find, finding_line

    up = Row("x", "tree_verify/k2/P4", "tree_verify", 4, "k2", "eager", None,
             error="IndexError at sglang/srt/layers/attention/flashattention_backend.py:1977: index 2 is out of bounds")
    ours = Row("x", "tree_verify/k2/P4", "tree_verify", 4, "k2", "eager", None,
               error="ValueError at /w/refspec/conformance/upstream_tree.py:115: not enough values to unpack")
    find(up)
    find(ours)
    assert up.findings[0].rule == "TR-010" and up.findings[0].where == (install.FA, 1977)
    (f,) = ours.findings
    assert f.rule == ADAPTER and f.where is None and "no rule broken" in finding_line(ours, f)


def test_a_syntax_error_in_the_code_under_test_names_the_file_and_line(tmp_path):
    tree = fake_tree(tmp_path / "co", GRAPH_FA.replace("def init_cuda_graph_state(self, max_bs, max_num_tokens):",
                                                       "def init_cuda_graph_state(self, max_bs, max_num_tokens)"))
    fa = tree / "python" / install.FA
    line = next(i for i, x in enumerate(fa.read_text().splitlines(), 1) if "def init_cuda_graph_state" in x)
    with pytest.raises(install.UnsupportedSpec, match=rf"^sglang @ {tree}: {fa}:{line}: SyntaxError: expected ':'$"):
        install.resolve(str(tree), root=str(tmp_path / "root"))
    p = cli("--sglang", str(tree), "--root", str(tmp_path / "root"))
    (err,) = p.stderr.strip().splitlines()
    assert p.returncode == 2 and f"{fa}:{line}: SyntaxError" in err and "<unknown>" not in err


PIP_MISSING = """WARNING: Location 'file:///opt/pypi/simple/sglang/' is ignored: it is neither a file nor a directory.
ERROR: Could not find a version that satisfies the requirement sglang==9.9.9 (from versions: 0.1.3, 0.5.23)
ERROR: No matching distribution found for sglang==9.9.9 (rerun with --debug for the traceback)
"""


def test_a_release_the_index_does_not_have_is_a_short_one_line_error(tmp_path, monkeypatch):
    assert install.pip_last_line(PIP_MISSING) == "ERROR: No matching distribution found for sglang==9.9.9"
    assert install.pip_last_line("WARNING: x\nsomething broke\nWARNING: y\n") == "something broke"
    calls = []

    def pip(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", PIP_MISSING)

    monkeypatch.setattr(install.subprocess, "run", pip)
    with pytest.raises(install.UnsupportedSpec) as e:
        install.resolve("9.9.9", root=str(tmp_path / "root"))
    assert str(e.value) == ("sglang==9.9.9 is not on the package index (pip download failed): "
                            "ERROR: No matching distribution found for sglang==9.9.9")
    assert calls and calls[0][-1] == "sglang==9.9.9" and not (tmp_path / "root" / "sglang-9.9.9").exists()
    # any other pip failure: one line too, pip's whole output kept on the exception
    monkeypatch.setattr(install.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "WARNING: w\nERROR: disk full\n"))
    with pytest.raises(install.PipError, match=r"failed \(sglang==9.9.8\): ERROR: disk full$") as e:
        install.resolve("9.9.8", root=str(tmp_path / "root"))
    assert "\n" not in str(e.value) and "WARNING: w" in e.value.stderr
