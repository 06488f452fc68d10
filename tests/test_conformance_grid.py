"""The conformance grid follows what upstream's own worker and runner do at the code under test.

* CPU mirrors: where both FA3 backend classes declare ``needs_cpu_seq_lens = False`` (0.5.16 on:
  upstream's spec-v2 worker then publishes no ``seq_lens_cpu``), each eager DRAFT_EXTEND_V2 job
  also runs with ``seq_lens_cpu`` / ``extend_seq_lens_cpu`` None (``/no-cpu-mirrors``), compared
  with refspec's eager result for the same batch.  A planted off-by-one in the backend's
  ``extend_seq_lens_cpu is None`` fallback (``speculative_num_draft_tokens - 1``) is caught there
  and invisible to the mirrored job.
* Idle: where the runner builds eager metadata only for ``batch_size > 0``, the empty IDLE batch is
  not run upstream; it is counted and named ("not reachable upstream") and never fails the run.
  So are DRAFT_EXTEND_V2's capture and replay where every spec-v2 worker builds the draft-extend
  graph only on an NPU (0.5.6.post2); their eager part is still compared.
* ``--baseline``: the modes the baseline does not run come after the changed groups, under one
  line saying why (for the tree modes: the missing upstream module).

Fake source trees (:func:`test_conformance_specs.fake_tree`) and a worker replaced by canned
results: nothing of upstream runs here.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from refspec.conformance import cases, install, report
from refspec.conformance import run as conformance
from refspec.conformance import upstream_common as uc
from refspec.conformance.cases import Job
from refspec.conformance.compare import compare
from test_conformance_baseline import BASE_FA, OURS, VERIFY, review, trees  # noqa: F401 (trees: a fixture)
from test_conformance_specs import GRAPH_FA, fake_tree

FLAG = "    needs_cpu_seq_lens: bool = False\n"
NO_MIRROR_FA = GRAPH_FA.replace("class FlashAttentionBackend(AttentionBackend):\n",
                                "class FlashAttentionBackend(AttentionBackend):\n" + FLAG) \
    .replace("class FlashAttentionMultiStepBackend:\n", "class FlashAttentionMultiStepBackend:\n" + FLAG)
RUNNER = "python/sglang/srt/model_executor/runner/eager_runner.py"
GUARDED = """
class EagerRunner:
    def _execute_idle(self, forward_batch, pp_proxy_tensors=None):
        model_runner = self.model_runner
        if forward_batch.batch_size > 0:
            model_runner.attn_backend.init_forward_metadata(forward_batch)
        else:
            model_runner.attn_backend.forward_metadata = None
"""
UNGUARDED = """
class EagerRunner:
    def _execute_idle(self, forward_batch, pp_proxy_tensors=None):
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)
"""


WORKER_V2 = "python/sglang/srt/speculative/eagle_worker_v2.py"
MULTI_V2 = "python/sglang/srt/speculative/multi_layer_eagle_worker_v2.py"
#: 0.5.6.post2's one-layer spec-v2 worker: the draft-extend graph is built only on an NPU
NPU_ONLY = """
class EAGLEWorkerV2:
    def init_cuda_graphs(self):
        self.cuda_graph_runner_for_draft_extend = None
        # FIXME cuda not support draft_extend capture
        if self.draft_extend_attn_backend and _is_npu:
            self.cuda_graph_runner_for_draft_extend = Device2ExtendCudaGraphRunner[self.device](self)
"""
#: 0.5.12.post1's: an allowlist of backends that may hold on CUDA
ALLOWLIST = NPU_ONLY.replace("self.draft_extend_attn_backend and _is_npu",
                             "self.draft_extend_attn_backend and (_is_npu or supports_cuda_draft_extend_graph)")
#: 0.5.7's multi-layer spec-v2 worker: builds one whenever CUDA graphs are on
MULTI = """
class MultiLayerEagleDraftWorker:
    def init_cuda_graphs(self):
        self.cuda_graph_runner_for_draft_extend = None
        if self.server_args.disable_cuda_graph:
            return
        self.cuda_graph_runner_for_draft_extend = (MultiLayerEagleMultiStepDraftExtendCudaGraphRunner(self))
"""


def quiet(*_):
    pass


def tree(root, fa=GRAPH_FA, runner: str | None = None):
    t = fake_tree(root, fa)
    if runner is not None:
        (t / RUNNER).parent.mkdir(parents=True, exist_ok=True)
        (t / RUNNER).write_text(textwrap.dedent(runner))
    return t


def shape(root, fa=GRAPH_FA, runner: str | None = None) -> install.Shape:
    return install.detect(str(tree(root, fa, runner) / "python"))


def test_cpu_mirrors_are_off_only_where_both_fa3_classes_declare_needs_cpu_seq_lens_false(tmp_path):
    assert shape(tmp_path / "a", NO_MIRROR_FA).cpu_mirrors is False
    assert shape(tmp_path / "b").cpu_mirrors is True  # no attribute: the base class's True
    one = GRAPH_FA.replace("class FlashAttentionMultiStepBackend:\n", "class FlashAttentionMultiStepBackend:\n" + FLAG)
    assert shape(tmp_path / "c", one).cpu_mirrors is True  # the draft-extend backend still needs them
    back_on = NO_MIRROR_FA.replace("    def init_cuda_graph_state(self, max_bs, max_num_tokens):\n",
                                   "    def __init__(self, model_runner):\n        self.needs_cpu_seq_lens = True\n"
                                   "    def init_cuda_graph_state(self, max_bs, max_num_tokens):\n")
    assert shape(tmp_path / "d", back_on).cpu_mirrors is True  # __init__ sets it back


def test_the_idle_case_is_unreachable_where_the_runner_guards_an_empty_batch(tmp_path):
    s = shape(tmp_path / "a", runner=GUARDED)
    line = next(i for i, x in enumerate(GUARDED.splitlines(), 1) if "batch_size > 0" in x)
    assert s.idle_unreachable.startswith(f"sglang/srt/model_executor/runner/eager_runner.py:{line} _execute_idle "
                                         f"builds attention metadata only if forward_batch.batch_size > 0")
    assert shape(tmp_path / "b", runner=UNGUARDED).idle_unreachable is None
    assert shape(tmp_path / "c").idle_unreachable is None  # no runner found: the case runs


def _worker_tree(root, **files):
    """A fake tree with ``files`` (repo path -> source) written into it."""
    t = fake_tree(root, GRAPH_FA)
    for rel, text in files.items():
        (t / rel).parent.mkdir(parents=True, exist_ok=True)
        (t / rel).write_text(textwrap.dedent(text))
    return t


def _workers(root, **files):
    return install.detect(str(_worker_tree(root, **files) / "python")).draft_extend_graph_unreachable


def canned_worker(monkeypatch) -> list[str]:
    """Replace upstream's worker by one returning refspec's own results; the list of job ids it ran."""
    ran = []

    def worker(target, jobs):
        ran.extend(j.id for j in jobs)
        return {j.id: dict(j.refspec) for j in jobs}, {"import_s": 0.0}

    monkeypatch.setattr(conformance, "run_worker", worker)
    return ran


def test_the_draft_extend_v2_graph_is_unreachable_only_where_every_v2_worker_builds_it_on_an_npu_only(tmp_path):
    why = _workers(tmp_path / "a", **{WORKER_V2: NPU_ONLY})
    line = next(i for i, x in enumerate(NPU_ONLY.splitlines(), 1) if "and _is_npu:" in x)
    assert why == (f"sglang/srt/speculative/eagle_worker_v2.py:{line} builds the draft-extend CUDA graph only on an "
                   f"NPU (`if self.draft_extend_attn_backend and _is_npu:`), and no other spec-v2 worker builds one: "
                   f"on CUDA, DRAFT_EXTEND_V2 runs eager")
    assert _workers(tmp_path / "b", **{WORKER_V2: NPU_ONLY, MULTI_V2: MULTI}) is None  # 0.5.7: the multi-layer one
    assert _workers(tmp_path / "c", **{WORKER_V2: ALLOWLIST}) is None  # `_is_npu or ...` may hold on CUDA
    assert _workers(tmp_path / "d") is None  # no worker found: the graphs are compared


DE_RUNNER = "python/sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py"
#: 0.5.3.post2's spec-v2 worker: no draft-extend graph of its own; it inherits the v1 worker's runner
INHERITS = """
class EAGLEWorkerV2(EAGLEWorker):
    def forward_draft_extend_after_decode(self, batch):
        forward_batch = draft_input.prepare_for_extend_to_fill_draft_kvcache(batch)
        return self.draft_model_runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
"""
#: the v1 draft-extend graph runner of 0.5.3.post2: it captures the draft extend as DRAFT_EXTEND
V1_RUNNER = """
class EAGLEDraftExtendCudaGraphRunner:
    def capture_one_batch_size(self, bs, forward):
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND,
            batch_size=bs,
        )
"""


@pytest.mark.spec("CG-004")
def test_a_v2_worker_without_a_draft_extend_graph_of_its_own_leaves_the_v2_graph_unreachable(tmp_path):
    """0.5.3.post2 / .post3: the spec-v2 worker builds no draft-extend graph (its DRAFT_EXTEND_V2 forward
    runs eagerly) and the v1 runner it inherits captures DRAFT_EXTEND, so FA3's DRAFT_EXTEND_V2 capture /
    replay never run: not reachable upstream (they read as CG-004 upstream errors before).  A runner that
    names DRAFT_EXTEND_V2, or no spec-v2 worker at all, keeps the graphs compared."""
    why = _workers(tmp_path / "a", **{WORKER_V2: INHERITS, DE_RUNNER: V1_RUNNER})
    line = next(i for i, x in enumerate(textwrap.dedent(V1_RUNNER).splitlines(), 1) if "ForwardMode.DRAFT_EXTEND," in x)
    assert why == (f"sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py:{line} (the draft-extend CUDA "
                   f"graph runner the spec-v2 worker builds) captures and replays with "
                   f"forward_mode=ForwardMode.DRAFT_EXTEND and no runner names DRAFT_EXTEND_V2: the backend's "
                   f"DRAFT_EXTEND_V2 graph hooks never run (its DRAFT_EXTEND v1 graph rows are compared)")
    v2_runner = V1_RUNNER + "        mode = ForwardMode.DRAFT_EXTEND_V2\n"
    assert _workers(tmp_path / "b", **{WORKER_V2: INHERITS, DE_RUNNER: v2_runner}) is None
    assert _workers(tmp_path / "c", **{DE_RUNNER: V1_RUNNER}) is None  # no spec-v2 worker: compared
    assert _workers(tmp_path / "d", **{WORKER_V2: INHERITS}) is None  # no runner found: compared


def test_an_unreachable_draft_extend_v2_graph_keeps_the_eager_part_and_names_the_graphs():
    jobs = cases.build_jobs(("verify", "draft_extend_v2"), (4,), shapes=("B3/bs4",))
    assert cases.mark_graph_unreachable(jobs, None) == jobs
    out = cases.mark_graph_unreachable(jobs, "eagle_worker_v2.py:9 NPU only")
    assert [(j.id, j.graphed, j.unreachable) for j in out] == [
        ("verify/P4/B3/bs4", True, None), ("draft_extend_v2/P4/B3/bs4", False, None),
        ("draft_extend_v2/P4/B3/bs4/graphs", True, "its capture and replay: eagle_worker_v2.py:9 NPU only")]
    eager = out[1]
    assert list(eager.refspec) == [("eager", None)] and not {"bs", "capture", "replay"} & set(eager.inputs)
    assert eager.refspec[("eager", None)] is jobs[1].refspec[("eager", None)]
    assert out[0] is jobs[0]


def test_no_mirror_jobs_are_eager_copies_of_draft_extend_v2_with_the_mirrors_none():
    jobs = cases.build_jobs(("verify", "draft_extend_v2"), (4,))
    extra = cases.without_mirrors(jobs)
    de = [j for j in jobs if j.mode == "draft_extend_v2"]
    assert [j.id for j in extra] == [f"{j.id}/no-cpu-mirrors" for j in de] and len(extra) == 2
    for j, x in zip(de, extra):
        assert not x.graphed and not {"bs", "capture", "replay"} & set(x.inputs)
        assert x.inputs["eager"]["seq_lens_cpu"] is None and x.inputs["eager"]["extend_seq_lens_cpu"] is None
        assert j.inputs["eager"]["seq_lens_cpu"] is not None and j.inputs["eager"]["extend_seq_lens_cpu"]
        assert torch.equal(x.inputs["eager"]["seq_lens"], j.inputs["eager"]["seq_lens"])
        assert list(x.refspec) == [("eager", None)] and x.refspec[("eager", None)] is j.refspec[("eager", None)]


def test_the_run_adds_them_only_for_code_whose_backends_opt_out(tmp_path):
    ids = {}
    for name, fa in (("off", NO_MIRROR_FA), ("on", GRAPH_FA)):
        t = install.resolve(str(tree(tmp_path / name, fa)), root=str(tmp_path / "r"), log=quiet)
        ids[name] = [j.id for j in conformance._jobs(t, (4,), ("draft_extend_v2",), ())]
    assert [i for i in ids["off"] if i.endswith("/no-cpu-mirrors")] == \
        ["draft_extend_v2/P4/B3/bs4/no-cpu-mirrors", "draft_extend_v2/P4/B5/bs8/no-cpu-mirrors"]
    assert not [i for i in ids["on"] if "no-cpu-mirrors" in i]


def test_the_run_says_why_the_no_mirror_results_have_no_mirrors(tmp_path, monkeypatch):
    """The ``/no-cpu-mirrors`` results are explained on one line, with the two classes'
    ``needs_cpu_seq_lens = False`` lines; code that keeps the mirrors gets no such line."""
    canned_worker(monkeypatch)
    lines = [i for i, x in enumerate(NO_MIRROR_FA.splitlines(), 1) if x == FLAG.rstrip("\n")]
    for name, fa in (("off", NO_MIRROR_FA), ("on", GRAPH_FA)):
        t = install.resolve(str(tree(tmp_path / name, fa)), root=str(tmp_path / "r"), log=quiet)
        out = conformance.run(sglang=[t], page_sizes=(4,), modes=("draft_extend_v2",), log=quiet)
        said = [x for x in conformance.render(out).splitlines() if "no-cpu-mirrors` result" in x]
        if name == "on":
            assert said == []
            continue
        assert said == [f"== no CPU mirrors: sglang {t.label}: 2 `/no-cpu-mirrors` results ran DRAFT_EXTEND_V2 with "
                        f"seq_lens_cpu / extend_seq_lens_cpu None: FlashAttentionBackend "
                        f"(flashattention_backend.py:{lines[0]}) and FlashAttentionMultiStepBackend "
                        f"(flashattention_backend.py:{lines[1]}) declare "
                        f"needs_cpu_seq_lens = False, so upstream's spec-v2 worker hands them seq_lens_cpu = None "
                        f"(resolve_seq_lens_cpu)"]
        assert f"No CPU mirrors: sglang {t.label}: 2 `/no-cpu-mirrors` results ran DRAFT_EXTEND_V2" in \
            report.markdown(out)


def _fallback_q(fb, num_draft_tokens: int, minus: int) -> dict:
    """0.5.16's eager DRAFT_EXTEND_V2 q metadata (``flashattention_backend.py:956-963``), with
    ``minus`` planted in the ``extend_seq_lens_cpu is None`` fallback (1: the trial's bugC)."""
    return {"max_seq_len_q": max(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu is not None
            else num_draft_tokens - minus,
            "cu_seqlens_q": torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens, dim=0, dtype=torch.int32),
                                                    (1, 0))}


def test_a_planted_off_by_one_in_the_no_mirror_fallback_is_caught_only_by_the_no_mirror_job():
    (job,) = cases.build_jobs(("draft_extend_v2",), (4,), shapes=("B3/bs4",))
    (bare,) = cases.without_mirrors([job])
    FM, N = {"DRAFT_EXTEND_V2": "DRAFT_EXTEND_V2"}, job.inputs["num_draft_tokens"]
    seen = {}
    for j in (job, bare):
        fb = uc.forward_batch(FM, j.mode, j.inputs["eager"], N)
        if j is bare:  # what the worker hands upstream: no mirror anywhere
            assert fb.seq_lens_cpu is None and fb.seq_lens_sum is None and fb.extend_seq_lens_cpu is None
            assert fb.extend_prefix_lens_cpu is None and fb.spec_info.extend_seq_lens_cpu is None
        ours = j.refspec[("eager", None)]
        for minus in (0, 1):
            got = dict(ours, **_fallback_q(fb, N, minus))
            seen[(j is bare, minus)] = [d.field for d in compare(ours, got, j.page_size)]
    assert seen == {(False, 0): [], (False, 1): [], (True, 0): [], (True, 1): ["max_seq_len_q"]}


def test_an_unreachable_idle_case_is_not_run_is_named_and_does_not_fail(tmp_path, monkeypatch):
    ran = canned_worker(monkeypatch)
    for name, runner in (("guarded", GUARDED), ("unguarded", UNGUARDED)):
        ran.clear()
        t = install.resolve(str(tree(tmp_path / name, runner=runner)), root=str(tmp_path / "r"), log=quiet)
        out = conformance.run(sglang=[t], page_sizes=(4,), modes=("decode", "idle"), log=quiet)
        text = conformance.render(out)
        if name == "unguarded":  # its runner may build it: compared as before
            assert "idle/P4/B3/bs4" in ran and not out.unreachable
            assert "not reachable upstream" not in text
            continue
        assert "idle/P4/B3/bs4" not in ran and ran and out.ok
        assert [(j, why.split(":")[0]) for _, j, why, _ in out.unreachable] == [("idle/P4/B3/bs4", "an empty batch")]
        assert "idle" not in {r.mode for r in out.rows}
        line = next(x for x in text.splitlines() if "not reachable upstream" in x)
        assert line.startswith(f"== not reachable upstream: sglang {t.label}: 1 job not run (idle/P4/B3/bs4): an "
                               f"empty batch: sglang/srt/model_executor/runner/eager_runner.py:")
        assert "== OK" in text
        assert "Not reachable upstream: sglang" in report.markdown(out)


def test_an_unreachable_draft_extend_v2_graph_is_not_run_is_named_and_does_not_fail(tmp_path, monkeypatch):
    ran = canned_worker(monkeypatch)
    t = install.resolve(str(_worker_tree(tmp_path / "npu", **{WORKER_V2: NPU_ONLY})), root=str(tmp_path / "r"),
                        log=quiet)
    out = conformance.run(sglang=[t], page_sizes=(4,), modes=("draft_extend_v2",), log=quiet)
    assert out.ok and "draft_extend_v2/P4/B3/bs4" in ran and not [j for j in ran if j.endswith("/graphs")]
    assert {r.phase for r in out.rows} == {"eager"}
    assert "draft_extend_v2/P4/B3/bs4/graphs" in [j for _, j, _, _ in out.unreachable]
    line = next(x for x in conformance.render(out).splitlines() if "not reachable upstream" in x)
    assert "its capture and replay: sglang/srt/speculative/eagle_worker_v2.py:" in line


def test_modes_the_baseline_does_not_run_come_after_the_changed_groups_under_one_line(trees, tmp_path, capsys):  # noqa: F811
    base, _, planted = trees
    fake_tree(base, BASE_FA, modes="")  # the baseline's ForwardMode has no DRAFT_EXTEND_V2
    why = "draft_extend_v2 not run on the baseline: ForwardMode has no DRAFT_EXTEND_V2"
    planted[("base", VERIFY, "replay")] = dict(OURS, cache_seqlens_int32=torch.tensor([66, 24], dtype=torch.int32))
    rc, text, md = review(trees, tmp_path, capsys)
    assert rc == 0, text
    lines = text.splitlines()
    fixed = next(i for i, x in enumerate(lines) if x.startswith("fixed"))
    said = lines.index(why)
    new = [i for i, x in enumerate(lines) if x.startswith("new, same")]
    assert fixed < said < min(new) and len(new) == 2, text
    assert why + "." in md and md.index(why) < md.index("| new, same |")
    del planted[("base", VERIFY, "replay")]
    rc, text, _ = review(trees, tmp_path, capsys, "-v")  # verbose: after the unchanged groups too
    lines = text.splitlines()
    unchanged = [i for i, x in enumerate(lines) if x.startswith("unchanged ")]
    new = [i for i, x in enumerate(lines) if x.startswith("new, same")]
    assert unchanged and new and max(unchanged) < lines.index(why) < min(new), text


def test_the_tree_modes_reason_names_the_missing_upstream_module(tmp_path):
    base = install.resolve(str(tree(tmp_path / "b")), root=str(tmp_path / "r"), log=quiet)
    assert base.shape.tree_missing == install.OWN_TREE_FILES[0] and not base.shape.own_tree
    base.shape.topk = True
    jobs = [Job("tree_verify/P1/k2", "tree_verify", 1, "k2", True, {}, {}), Job(VERIFY, "verify", 16, "B3/bs4",
                                                                                True, {}, {})]
    assert conformance.not_on_baseline(base, jobs) == {
        "tree_verify": f"upstream's own tree builder is missing ({install.OWN_TREE_FILES[0]})"}
