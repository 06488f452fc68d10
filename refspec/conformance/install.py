"""Resolve what ``--sglang SPEC`` names, install it next to the repository (never into the main
venv) and read its API shape from the code.

A SPEC is one of

* a release on the package index (``0.5.14``): ``pip install --no-deps --target
  <root>/sglang-<V>`` (reused while its stamp lists the same requirement);
* a wheel file (``sglang-*.whl``): installed into ``<root>/wheel-<sha256[:16]>`` (keyed by the
  file's content, so the same file is installed once);
* a source tree: an SGLang checkout or its ``python/`` folder (e.g. a PR branch).  It is used
  *in place*: its ``python/`` folder goes on the worker's path, nothing is copied, nothing is
  written into it (the worker runs with ``PYTHONDONTWRITEBYTECODE=1``).

``<root>/deps`` holds the few real packages upstream's metadata path imports (shared by every
target).  All installs are ``--no-deps``: SGLang's declared dependencies (CUDA kernels, a server
stack, a newer torch) are *not* installed; what the metadata path imports but never calls is
stubbed in the worker (:mod:`refspec.conformance.stubs`).  torch and numpy come from the
running interpreter.  :func:`_ensure` only ever replaces a directory under ``root`` that carries
its own stamp file (one it created); a directory a user pointed at is never removed.

:func:`detect` reads the backend's API shape from the source files (no import): which graph hooks
``FlashAttentionBackend`` has, whether ``ForwardMode.DRAFT_EXTEND`` (v1) exists, top-k > 1
support, where the replay kernels live, the staged draft-extend replay, whether upstream builds
its own verify tree, and the fix toggles of ``sglang/srt/debug_utils/pr_fix_toggle.py``.  The
adapter and the compared modes follow from the shape, never from a version string.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

#: the default targets: the newest release; the newest with DRAFT_EXTEND v1 + legacy hooks
PINS = ("0.5.23", "0.5.12.post1")
#: real dependencies of the metadata path (``pip download --no-deps`` served these here)
DEPS = ("triton==3.9.0", "msgspec==0.23.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
        "typing-inspection==0.4.5", "typing-extensions==4.16.0", "dill==0.4.1", "packaging==26.4")
STAMP = ".installed"
FA = "sglang/srt/layers/attention/flashattention_backend.py"
FBI = "sglang/srt/model_executor/forward_batch_info.py"
BASE = "sglang/srt/layers/attention/base_attn_backend.py"
TOGGLES = "sglang/srt/debug_utils/pr_fix_toggle.py"
#: where releases keep the Triton replay-metadata kernels (newest first)
KERNEL_FILES = ("sglang/kernels/ops/attention/metadata.py", "sglang/srt/layers/attention/triton_ops/metadata.py", FA)
#: what :mod:`refspec.conformance.upstream_tree` imports to let upstream build its own tree
OWN_TREE_FILES = ("sglang/kernels/ops/speculative/spec_tree.py", "sglang/kernels/ops/speculative/cache_locs.py",
                  "sglang/srt/speculative/eagle_utils.py", "sglang/srt/speculative/eagle_worker_common.py",
                  "sglang/srt/speculative/eagle_info.py")
#: the first release whose wheel has ``layers/attention/flashattention_backend.py`` (0.4.4 and
#: 0.4.4.post1 have none): an older release is refused before anything is downloaded
FIRST_FA3 = "0.4.4.post2"
RELEASE = re.compile(r"^\d+\.\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")

BASE_MODES = ("decode", "extend", "extend_prefix", "verify", "draft_decode")
TREE_MODES = ("tree_verify", "tree_draft_decode")
#: what each adapter calls on the backend; a missing one makes the code undrivable (name it)
ADAPTERS = {
    "graph": ("refspec.conformance.upstream_graph", {
        "FlashAttentionBackend": ("init_forward_metadata", "init_cuda_graph_state", "init_forward_metadata_out_graph",
                                  "init_forward_metadata_in_graph"),
        "FlashAttentionMultiStepBackend": ("init_forward_metadata", "init_forward_metadata_out_graph",
                                           "init_forward_metadata_in_graph")},
        ()),
    "legacy": ("refspec.conformance.upstream_legacy", {
        "FlashAttentionBackend": ("init_forward_metadata", "init_cuda_graph_state",
                                  "init_forward_metadata_capture_cuda_graph:bs,req_pool_indices,seq_lens,forward_mode,"
                                  "spec_info",
                                  "init_forward_metadata_replay_cuda_graph:bs,req_pool_indices,seq_lens,forward_mode,"
                                  "spec_info"),
        "FlashAttentionMultiStepBackend": ("init_forward_metadata", "init_forward_metadata_capture_cuda_graph",
                                           "init_forward_metadata_replay_cuda_graph")},
        ()),
}


class UnsupportedSpec(ValueError):
    """A SPEC that names nothing installable, or code whose API shape no adapter drives (one line)."""


class LinkedRoot(UnsupportedSpec):
    """An install refused: the default root (``<repo>/.conformance``) is a symlink to another folder
    (another checkout's), and the root was not given explicitly (one line: where it points, what to pass)."""


class PipError(RuntimeError):
    """pip failed: the message is one line (what failed and pip's last meaningful line); ``stderr``
    keeps pip's whole output."""

    def __init__(self, message: str, stderr: str):
        super().__init__(message)
        self.stderr = stderr


def pip_last_line(stderr: str) -> str:
    """pip's last meaningful line: its last ``ERROR:`` line, else its last line that is not a
    ``WARNING:`` ('' when pip printed nothing else).  A hint in parentheses is dropped."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    last = next((x for x in reversed(lines) if x.startswith("ERROR:")), None) or \
        next((x for x in reversed(lines) if not x.startswith("WARNING:")), "")
    return re.sub(r"\s*\(rerun with --debug[^)]*\)$", "", last)


@dataclass
class Shape:
    """The API shape of one SGLang tree's FA3 backend, read from its files (:func:`detect`)."""

    hooks: str | None  #: "graph" (init_forward_metadata_out_graph / _in_graph), "legacy" (capture / replay), None
    draft_extend_v1: bool  #: ForwardMode.DRAFT_EXTEND exists
    draft_extend_v2: bool  #: ForwardMode.DRAFT_EXTEND_V2 exists
    topk: bool  #: the backend has the top-k > 1 (cascade prefix + expand) path
    kernels: str | None  #: file holding the replay-metadata kernel ``normal_decode_set_metadata`` (None: PyTorch)
    staged: bool  #: FlashAttentionBackend.stage_draft_extend_metadata (staged draft-extend replay)
    own_tree: bool  #: upstream's tree builder and draft-slot kernels are all present (OWN_TREE_FILES)
    toggles: dict = field(default_factory=dict)  #: fix toggle name -> the functions it patches
    adapter: str | None = None  #: the adapter module that drives it, None if none can
    missing: str | None = None  #: why no adapter drives it (what is missing), None if one does
    modes: tuple = ()  #: the modes compared on this code
    no_draft_decode: str | None = None  #: why draft decode is not compared (no multi-step backend), or None
    #: False where every FA3 backend a spec-v2 EAGLE step touches declares ``needs_cpu_seq_lens = False``
    #: (:func:`cpu_mirrors`): upstream's worker then hands the backend no ``seq_lens_cpu``
    cpu_mirrors: bool = True
    idle_unreachable: str | None = None  #: why upstream never builds eager metadata for an empty batch, or None
    #: why upstream's spec-v2 workers never capture / replay DRAFT_EXTEND_V2 in a CUDA graph on CUDA, or None
    #: (:func:`draft_extend_graph_unreachable`)
    draft_extend_graph_unreachable: str | None = None
    tree_missing: str | None = None  #: the first of OWN_TREE_FILES this code lacks, or None
    #: the v1 draft extend's accept-length fields as this release's worker lays them out (:func:`accept_layout`):
    #: ``{"device", "host", "host_is_n", "at"}``, or None where the backend reads none or the layout is unknown
    accept: dict | None = None
    #: the draft ``out_cache_loc`` order of this release's top-k > 1 worker (:func:`draft_loc_layout`):
    #: ``"bs,topk,steps"`` / ``"bs,steps,topk"``, with the worker line; None where unknown
    draft_loc: dict | None = None
    #: what refspec's adapter does not know how to lay out for this code (``{mode: why}``): adapter gaps
    gaps: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Shape:
        d = json.loads(text)
        d["modes"] = tuple(d["modes"])
        return cls(**d)


@dataclass
class Target:
    """One code under test: what ``--sglang SPEC`` resolved to."""

    spec: str
    kind: str  #: "release", "wheel", "tree"
    label: str  #: shown after "sglang" in rows and messages: "0.5.23", "@ /path", "0.5.23 -fix 27360"
    site: str  #: the folder holding ``sglang/``
    paths: list[str]  #: the worker's sys.path entries (site, deps)
    shape: Shape
    version: str | None = None  #: release version (a release or a wheel's metadata); None for a tree
    revert_fix: str | None = None  #: the upstream fix toggle reverted in the worker

    @property
    def tag(self) -> str | None:
        """The release tag links go to (``v0.5.23``), None for a local tree."""
        return f"v{self.version}" if self.kind == "release" and self.version else None


def default_root() -> str:
    """``<repo>/.conformance`` (gitignored)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".conformance")


def linked_root(root: str | None) -> str | None:
    """Where the default root points when ``root`` was not given (``--root``) and
    ``<repo>/.conformance`` is a symlink (to another checkout's folder, say); else None.  An install
    there would land in that other folder unseen: :func:`_ensure` refuses it (:class:`LinkedRoot`);
    what is installed there already is reused."""
    if root is not None:
        return None
    d = default_root()
    return os.path.realpath(d) if os.path.islink(d) else None


def _installed(target: str, reqs: tuple[str, ...], key: str | None = None) -> bool:
    """Whether ``target``'s stamp lists ``reqs`` (or ``key``): :func:`_ensure` has nothing to install."""
    stamp = os.path.join(target, STAMP)
    if not os.path.exists(stamp):
        return False
    with open(stamp) as f:
        return f.read() == (key if key is not None else "\n".join(reqs)) + "\n"


def _ensure(target: str, reqs: tuple[str, ...], log, key: str | None = None, linked: str | None = None) -> bool:
    """Install ``reqs`` into ``target`` unless its stamp already lists them (or ``key``, e.g. a
    wheel's content hash, when given); True if installed.  ``linked`` (:func:`linked_root`): the
    folder a symlinked default root points to, where nothing new is installed.

    Raises: PipError if pip fails (one line: pip's last meaningful line; ``.stderr`` all of it),
    RuntimeError if ``target`` exists without a stamp (not a directory this function created: it
    is never removed), LinkedRoot if an install is needed and ``linked`` is set.
    """
    stamp = os.path.join(target, STAMP)
    want = (key if key is not None else "\n".join(reqs)) + "\n"
    if _installed(target, reqs, key):
        return False
    if linked is not None:
        raise LinkedRoot(f"not installing {' '.join(reqs)} into {target}: {default_root()} is a symlink to "
                         f"{linked} (another folder, e.g. another checkout's); pass --root {linked} to install "
                         f"there on purpose, or --root DIR for a folder of this checkout's own")
    if not os.path.exists(stamp) and os.path.exists(target) and os.listdir(target):
        raise RuntimeError(f"{target} exists and was not installed by refspec (no {STAMP}); not touching it: "
                           f"move it away or pass another --root")
    if os.path.exists(target):
        shutil.rmtree(target)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", target, *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        raise PipError(f"pip install into {target} failed ({' '.join(reqs)}): {pip_last_line(proc.stderr)}",
                       proc.stderr)
    with open(stamp, "w") as f:
        f.write(want)
    log(f"installed {' '.join(reqs)} into {target} in {time.perf_counter() - t0:.0f} s")
    return True


def _read(site: str, rel: str) -> str | None:
    p = os.path.join(site, rel)
    if not os.path.exists(p):
        return None
    with open(p, encoding="utf-8") as f:
        return f.read()


def methods(text: str, filename: str = "<unknown>") -> dict[str, dict[str, list[str]]]:
    """``{class: {method: [parameter names]}}`` of a module's source (top-level classes).

    Raises: SyntaxError naming ``filename`` (the file the text was read from) and the line."""
    out: dict[str, dict[str, list[str]]] = {}
    for node in ast.parse(text, filename).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {f.name: [a.arg for a in (*f.args.args, *f.args.kwonlyargs)]
                              for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def _enum_members(text: str, cls: str, filename: str = "<unknown>") -> set[str]:
    for node in ast.parse(text, filename).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return set()


def toggles(site: str) -> dict[str, list[str]]:
    """The fix toggles of ``pr_fix_toggle.py``: ``{PR number: [patched function, ...]}`` (empty: none).

    Read from the module's ``_PR_FIX_REVERT_YAML`` dict literal and the ``target:`` lines of the
    YAML strings it maps to; upstream applies one with ``_revert_pr_fix(pr_num)``
    (``SGLANG_DEBUG_REVERT_PR``), which rewrites the targets' source and swaps their ``__code__``.
    """
    text = _read(site, TOGGLES)
    if text is None:
        return {}
    tree = ast.parse(text, os.path.join(site, TOGGLES))
    strings = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
               and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}
    out = {}
    for n in tree.body:
        target = n.target if isinstance(n, ast.AnnAssign) else (n.targets[0] if isinstance(n, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "_PR_FIX_REVERT_YAML" and isinstance(n.value, ast.Dict):
            for k, v in zip(n.value.keys, n.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Name):
                    out[str(k.value)] = re.findall(r"^\s*-?\s*target:\s*(\S+)", strings.get(v.id, ""), re.M)
    return out


#: upstream's eager runners, newest layout first (the function that runs an IDLE batch)
RUNNERS = (("sglang/srt/model_executor/runner/eager_runner.py", "_execute_idle"),
           ("sglang/srt/model_executor/model_runner.py", "forward_idle"))


def _flag(cls: ast.ClassDef) -> tuple[bool | None, int | None]:
    """The constant ``needs_cpu_seq_lens`` a class sets (class body, or ``self.`` in ``__init__``;
    the last one wins) and the line that sets it; ``(None, None)`` if it sets none."""
    value, line = None, None
    for n in cls.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            names = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == "needs_cpu_seq_lens" for t in names) and \
                    isinstance(n.value, ast.Constant):
                value, line = bool(n.value.value), n.lineno
    init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    for n in ast.walk(init) if init else ():
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and any(
                isinstance(t, ast.Attribute) and t.attr == "needs_cpu_seq_lens" for t in n.targets):
            value, line = bool(n.value.value), n.lineno
    return value, line


def _needs_flag(cls: ast.ClassDef) -> bool | None:
    """The constant ``needs_cpu_seq_lens`` a class sets (:func:`_flag`), None if it sets none."""
    return _flag(cls)[0]


def mirror_reason(site: str) -> str | None:
    """Why the ``/no-cpu-mirrors`` jobs hand upstream no CPU mirrors (:func:`cpu_mirrors` False):
    the two classes' ``needs_cpu_seq_lens = False`` lines, or None where upstream keeps them."""
    fa = _read(site, FA)
    if fa is None or cpu_mirrors(fa):
        return None
    classes = {n.name: n for n in ast.parse(fa).body if isinstance(n, ast.ClassDef)}
    at = [f"{c} ({FA.rsplit('/', 1)[-1]}:{_flag(classes[c])[1]})"
          for c in ("FlashAttentionBackend", "FlashAttentionMultiStepBackend")]
    return (f"{' and '.join(at)} declare needs_cpu_seq_lens = False, so upstream's spec-v2 worker hands them "
            f"seq_lens_cpu = None (resolve_seq_lens_cpu)")


def cpu_mirrors(fa: str, filename: str = "<unknown>") -> bool:
    """Whether upstream's spec-v2 EAGLE worker hands the FA3 backends CPU mirrors.

    SGLang's scheduler ORs ``needs_cpu_seq_lens`` over the backends a spec-v2 step touches (target,
    draft, draft extend: ``FlashAttentionBackend`` and ``FlashAttentionMultiStepBackend``), a
    backend without the attribute counting as True (``decide_needs_cpu_seq_lens``,
    ``managers/overlap_utils.py:22`` at v0.5.16); when it is False ``resolve_seq_lens_cpu`` sets
    ``seq_lens_cpu = None`` (``:436``).  False only when both classes set it False."""
    classes = {n.name: n for n in ast.parse(fa, filename).body if isinstance(n, ast.ClassDef)}
    return not all(c in classes and _needs_flag(classes[c]) is False
                   for c in ("FlashAttentionBackend", "FlashAttentionMultiStepBackend"))


def _guard(test: ast.expr) -> bool:
    """``<...>.batch_size > 0`` (the empty-batch guard)."""
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute) and \
        test.left.attr == "batch_size" and len(test.ops) == 1 and isinstance(test.ops[0], ast.Gt) and \
        isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 0


def idle_unreachable(site: str) -> str | None:
    """Why upstream's runner never builds eager metadata for an empty IDLE batch (its idle path calls
    ``init_forward_metadata`` only under ``if forward_batch.batch_size > 0``), or None where it
    may (a call outside such a guard, or no runner found)."""
    for rel, func in RUNNERS:
        text = _read(site, rel)
        if text is None:
            continue
        fn = next((n for n in ast.walk(ast.parse(text, os.path.join(site, rel)))
                   if isinstance(n, ast.FunctionDef) and n.name == func), None)
        if fn is None:
            continue
        guarded = {id(c) for g in ast.walk(fn) if isinstance(g, ast.If) and _guard(g.test)
                   for b in g.body for c in ast.walk(b)}
        calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                 and c.func.attr == "init_forward_metadata"]
        if calls and all(id(c) in guarded for c in calls):
            guard = next(g for g in ast.walk(fn) if isinstance(g, ast.If) and _guard(g.test))
            return (f"{rel}:{guard.lineno} {func} builds attention metadata only if forward_batch.batch_size > 0 "
                    f"(an empty batch never reaches the backend)")
        return None
    return None


#: upstream's spec-v2 EAGLE workers (one-layer and multi-layer drafts), the files that capture the
#: draft-extend CUDA graph (``self.cuda_graph_runner_for_draft_extend = <a runner>``)
V2_WORKERS = ("sglang/srt/speculative/eagle_worker_v2.py", "sglang/srt/speculative/multi_layer_eagle_worker_v2.py")


def _npu_only(test: ast.expr) -> bool:
    """A guard that holds only on an NPU: ``_is_npu``, or ``... and _is_npu and ...``."""
    if isinstance(test, ast.Name):
        return test.id == "_is_npu"
    return isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(_npu_only(v) for v in test.values)


def draft_extend_graph_unreachable(site: str) -> str | None:
    """Why upstream's spec-v2 workers never run DRAFT_EXTEND_V2 from a CUDA graph on CUDA, or None.

    A worker captures the draft-extend graph where it builds a runner into
    ``self.cuda_graph_runner_for_draft_extend`` (a call, not None or a copy).  Where every such
    build in :data:`V2_WORKERS` sits in the body of an ``if`` that holds only on an NPU (0.5.6.post2:
    ``if self.draft_extend_attn_backend and _is_npu:``, under ``# FIXME cuda not support
    draft_extend capture``, and no multi-layer worker yet), FA3's DRAFT_EXTEND_V2 capture / replay
    hooks never run on CUDA: their rows are not reachable upstream.  Where a build may run on CUDA
    (0.5.7 on: the multi-layer worker builds one unconditionally; a backend allowlist, as at
    0.5.12.post1, counts as reachable), the runner it builds may still capture the draft extend in
    the v1 mode (:func:`v1_mode_runners`, 0.5.4.post2).  Where a spec-v2 worker exists but builds
    none of its own (0.5.3.post2 / .post3: ``EAGLEWorkerV2(EAGLEWorker)`` inherits the v1 worker's
    runner, which captures ``DRAFT_EXTEND``, and runs its DRAFT_EXTEND_V2 forward eagerly), the
    runners' capture mode decides the same way.  None where no spec-v2 worker is found (the
    comparison then runs) or a CUDA runner captures DRAFT_EXTEND_V2."""
    builds, guards = 0, []
    for rel in V2_WORKERS:
        text = _read(site, rel)
        if text is None:
            continue
        tree = ast.parse(text, os.path.join(site, rel))
        npu_bodies = {id(c): g for g in ast.walk(tree) if isinstance(g, ast.If) and _npu_only(g.test)
                      for b in g.body for c in ast.walk(b)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and any(
                    isinstance(t, ast.Attribute) and t.attr == "cuda_graph_runner_for_draft_extend" for t in n.targets):
                builds += 1
                if id(n) in npu_bodies:
                    guards.append((rel, npu_bodies[id(n)]))
    if not builds:  # no spec-v2 worker builds its own: the runners it inherits decide (0.5.3.post2)
        return v1_mode_runners(site) if any(_read(site, rel) is not None for rel in V2_WORKERS) else None
    if not guards or len(guards) < builds:  # a build may run on CUDA: with which mode does its runner capture?
        return v1_mode_runners(site)
    rel, g = guards[0]
    return (f"{rel}:{g.lineno} builds the draft-extend CUDA graph only on an NPU (`if {ast.unparse(g.test)}:`), "
            f"and no other spec-v2 worker builds one: on CUDA, DRAFT_EXTEND_V2 runs eager")


#: upstream's CUDA draft-extend graph runners (one-layer, multi-layer): the files that capture and replay it
DRAFT_EXTEND_RUNNERS = ("sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py",
                        "sglang/srt/speculative/multi_layer_eagle_draft_extend_cuda_graph_runner.py")


def v1_mode_runners(site: str) -> str | None:
    """Why a spec-v2 worker's draft-extend CUDA graph never runs FA3 in DRAFT_EXTEND_V2 mode, or None:
    where no CUDA draft-extend graph runner of the code names ``ForwardMode.DRAFT_EXTEND_V2`` and
    they capture with ``forward_mode=ForwardMode.DRAFT_EXTEND`` (0.5.4.post2: the spec-v2 worker
    reuses the v1 runner, which captures and replays the draft extend as ``DRAFT_EXTEND``), the
    backend's DRAFT_EXTEND_V2 capture and replay hooks never run (the v1 mode's are compared)."""
    at = None
    for rel in DRAFT_EXTEND_RUNNERS:
        text = _read(site, rel)
        if text is None:
            continue
        if "DRAFT_EXTEND_V2" in text:
            return None
        n = next((i for i, x in enumerate(text.splitlines(), 1) if "forward_mode=ForwardMode.DRAFT_EXTEND," in x), None)
        at = at or (f"{rel}:{n}" if n else None)
    if at is None:
        return None
    return (f"{at} (the draft-extend CUDA graph runner the spec-v2 worker builds) captures and replays with "
            f"forward_mode=ForwardMode.DRAFT_EXTEND and no runner names DRAFT_EXTEND_V2: the backend's "
            f"DRAFT_EXTEND_V2 graph hooks never run (its DRAFT_EXTEND v1 graph rows are compared)")


SPEC_DIR = "sglang/srt/speculative"
#: the v1 draft extend's accept-length layouts refspec's adapters know: (device field, host field,
#: host holds n rather than a = n + 1, the worker statement that shows it).  The device field always
#: holds a = n + 1 when the backend reads it (MD-009): 0.4.x .. 0.5.10 add 1 in place before the
#: draft extend (``self.accept_length.add_(1)``, their host list keeping n); 0.5.11 renamed them
#: ``num_accepted_tokens`` (sglang#23962) and 0.5.12 ``num_accept_tokens``, a on both sides
ACCEPT_LAYOUTS = (
    ("num_accept_tokens", "num_accept_tokens_cpu", False, r"num_accept_tokens_cpu = \w+ \+ 1\b"),
    ("num_accepted_tokens", "num_accepted_tokens_cpu", False, r"num_accepted_tokens_cpu = \w+ \+ 1\b"),
    ("accept_length", "accept_length_cpu", True, r"self\.accept_length\.add_\(1\)"),
)


def _grep(site: str, folder: str, pattern: str) -> str | None:
    """``file:line`` (relative to ``site``) of the first line of a ``folder`` module matching ``pattern``."""
    rx = re.compile(pattern)
    for path in sorted(glob.glob(os.path.join(site, folder, "*.py"))):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if rx.search(line):
                    return f"{os.path.relpath(path, site)}:{n}"
    return None


def accept_layout(site: str, fa: str) -> tuple[dict | None, str | None]:
    """``(layout, gap)``: the accept-length fields the backend reads from ``spec_info`` at v1 draft
    extend, laid out as this release's worker does (:data:`ACCEPT_LAYOUTS`, the worker statement
    found in ``sglang/srt/speculative/``); ``gap`` says why the adapter cannot lay them out (a
    name it does not know, or no worker statement shows the values); both None where the backend
    reads none."""
    read = list(dict.fromkeys(re.findall(r"spec_info\.(\w*accept\w*)", fa)))
    if not read:
        return None, None
    for device, host, host_is_n, shows in ACCEPT_LAYOUTS:
        if device in read:
            unknown = [n for n in read if n not in (device, host)]
            if unknown:
                return None, (f"the backend reads spec_info.{', spec_info.'.join(unknown)} besides {device}: "
                              f"accept-length fields refspec's adapter does not know")
            at = _grep(site, SPEC_DIR, shows)
            if at is None:
                return None, (f"the backend reads spec_info.{device}, but no worker statement in {SPEC_DIR} shows its "
                              f"values (refspec's adapter knows {shows!r})")
            return {"device": device, "host": host, "host_is_n": host_is_n, "at": at}, None
    return None, (f"the backend reads spec_info.{', spec_info.'.join(read)}: accept-length fields refspec's adapter "
                  f"does not know (it knows {', '.join(d for d, *_ in ACCEPT_LAYOUTS)})")


#: the draft out_cache_loc orders of the top-k > 1 worker: a line of its ``draft_forward`` that reads it so
DRAFT_LOC_LAYOUTS = (
    ("bs,topk,steps", r"forward_batch\.batch_size, self\.topk, self\.speculative_num_steps\b"),
    ("bs,steps,topk", r":, self\.topk \* i : self\.topk \* \(i \+ 1\)"),
)
EAGLE_WORKER = "sglang/srt/speculative/eagle_worker.py"


def draft_loc_layout(site: str) -> dict | None:
    """The order in which this release's EAGLE worker lays out the top-k > 1 draft ``out_cache_loc``
    (``draft_forward``): ``[bs, topk, steps]`` (0.4.7.post1 on, sglang#7239: branch-major) or
    ``[bs, steps, topk]`` (0.4.5 .. 0.4.7: step-major); ``{"order", "at"}`` (``at``: the worker's
    line), None where the worker file is absent or neither line is found."""
    text = _read(site, EAGLE_WORKER)
    for order, pattern in DRAFT_LOC_LAYOUTS:
        for n, line in enumerate((text or "").splitlines(), 1):
            if re.search(pattern, line):
                return {"order": order, "at": f"{EAGLE_WORKER}:{n}"}
    return None


def detect(site: str) -> Shape:
    """The API shape of the SGLang code under ``site`` (the folder holding ``sglang/``), from its
    source text; ``shape.adapter`` None with ``shape.missing`` saying what is missing."""
    fa = _read(site, FA)
    fbi = _read(site, FBI)
    if fa is None:
        return Shape(None, False, False, False, None, False, False, missing=f"no FA3 backend ({FA})")
    m = methods(fa, os.path.join(site, FA))
    own = m.get("FlashAttentionBackend", {})
    base = methods(_read(site, BASE) or "", os.path.join(site, BASE)).get("AttentionBackend", {})
    for cls in ("FlashAttentionBackend",):  # inherited defaults (e.g. a no-op init_forward_metadata_in_graph)
        m[cls] = {**base, **m.get(cls, {})}
    be = m["FlashAttentionBackend"]
    legacy = {"init_forward_metadata_capture_cuda_graph", "init_forward_metadata_replay_cuda_graph"}
    hooks = "graph" if "init_forward_metadata_out_graph" in own and "init_forward_metadata_in_graph" in be else \
        "legacy" if legacy <= set(own) else None
    members = _enum_members(fbi, "ForwardMode", os.path.join(site, FBI)) if fbi else set()
    kernels = next((f for f in KERNEL_FILES if re.search(r"^def normal_decode_set_metadata\b", _read(site, f) or "",
                                                         re.M)), None)
    tree_missing = next((f for f in OWN_TREE_FILES if not os.path.exists(os.path.join(site, f))), None)
    shape = Shape(hooks=hooks, draft_extend_v1="DRAFT_EXTEND" in members, draft_extend_v2="DRAFT_EXTEND_V2" in members,
                  topk="forward_metadata_spec_decode_expand" in fa, kernels=kernels,
                  staged="stage_draft_extend_metadata" in be, own_tree=tree_missing is None, toggles=toggles(site),
                  cpu_mirrors=cpu_mirrors(fa, os.path.join(site, FA)), idle_unreachable=idle_unreachable(site),
                  draft_extend_graph_unreachable=draft_extend_graph_unreachable(site), tree_missing=tree_missing)
    if hooks is None:
        shape.missing = (f"FlashAttentionBackend has neither the graph hooks init_forward_metadata_out_graph / "
                         f"_in_graph nor the legacy init_forward_metadata_capture_cuda_graph / _replay_cuda_graph "
                         f"({FA})")
        return shape
    if fbi is None or "DECODE" not in members:
        shape.missing = f"no ForwardMode enum in {FBI}"
        return shape
    module, needs, files = ADAPTERS[hooks]
    multi_lacks = None
    for cls, names in needs.items():
        for need in names:
            name, _, params = need.partition(":")
            lack = [p for p in params.split(",") if p and p not in m.get(cls, {}).get(name, ())]
            why = None
            if name not in m.get(cls, {}):
                why = f"{cls}.{name} is missing ({FA}; the {hooks}-hooks adapter calls it)"
            elif lack:
                why = f"{cls}.{name} takes no {', '.join(lack)} ({FA}; the {hooks}-hooks adapter passes them)"
            if why and cls == "FlashAttentionMultiStepBackend":  # only the draft-decode modes need it
                multi_lacks = multi_lacks or why
            elif why:
                shape.missing = why
                return shape
    for f in files:
        if not os.path.exists(os.path.join(site, f)):
            shape.missing = f"{f} is missing (the {hooks}-hooks adapter builds its model runner with it)"
            return shape
    shape.adapter = module
    shape.no_draft_decode = multi_lacks
    modes = [m_ for m_ in BASE_MODES if not (multi_lacks and m_ == "draft_decode")]
    if shape.draft_extend_v1:
        modes.append("draft_extend")
    if shape.draft_extend_v2:
        modes.append("draft_extend_v2")
    if hooks == "graph":
        modes.append("idle")  # the legacy-hooks releases never build metadata for an empty batch (upstream_legacy)
    if shape.topk and (hooks == "legacy" or shape.own_tree):
        modes += [m_ for m_ in TREE_MODES if not (multi_lacks and m_ == "tree_draft_decode")]
    shape.modes = tuple(modes)
    shape.accept, gap = accept_layout(site, fa)
    if gap and shape.draft_extend_v1:
        shape.gaps["draft_extend"] = gap
    if "tree_draft_decode" in modes and not shape.own_tree:  # refspec lays out the draft slots: in the worker's order
        shape.draft_loc = draft_loc_layout(site)
        if shape.draft_loc is None:
            shape.gaps["tree_draft_decode"] = (f"the draft out_cache_loc order of this release's worker is not one "
                                               f"refspec's adapter knows ({EAGLE_WORKER} draft_forward)")
    return shape


def _version_of(site: str) -> str | None:
    """The version in an installed ``sglang-*.dist-info`` next to ``sglang/``, else None."""
    for d in sorted(glob.glob(os.path.join(site, "sglang-*.dist-info"))):
        return os.path.basename(d)[len("sglang-"):-len(".dist-info")]
    return None


def _deps(root: str, log) -> str:
    deps = os.path.join(root, "deps")
    _ensure(deps, DEPS, log)
    return deps


def _file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_site(path: str) -> str | None:
    """The folder holding ``sglang/`` for a checkout (``python/sglang``) or its ``python/`` folder."""
    for cand in (os.path.join(path, "python"), path):
        if os.path.isfile(os.path.join(cand, "sglang", "__init__.py")):
            return cand
    return None


def install_release(version: str, root: str, log=print, linked: str | None = None) -> str:
    """``<root>/sglang-<version>`` with that release installed (``--no-deps``); its path
    (``linked``: :func:`_ensure`).

    Raises: UnsupportedSpec (one line) when the index has no such release, LinkedRoot (one line)
    when it is not installed yet and ``linked`` is set; PipError for any other pip failure."""
    d = os.path.join(root, f"sglang-{version}")
    try:
        _ensure(d, (f"sglang=={version}",), log, linked=linked)
    except PipError as e:
        if re.search(r"No matching distribution found|Could not find a version that satisfies", e.stderr):
            raise UnsupportedSpec(f"sglang=={version} is not on the package index (pip download failed): "
                                  f"{pip_last_line(e.stderr)}") from None
        raise
    return d


def resolve(spec: str, root: str | None = None, log=print, revert_fix: str | None = None,
            releases_root: str | None = None) -> Target:
    """Install (or locate) the code ``spec`` names and read its shape (``releases_root``: where a
    release is installed, default ``root``; the shared dependencies always live in ``root/deps``).

    Raises: UnsupportedSpec (one line) for a spec that is neither a release, a wheel file nor a
    source tree, for a release the package index does not have, for code that does not parse (the
    file and line) or that no adapter drives (the line names what is missing), and for a
    ``revert_fix`` the code does not register (the line lists the names it has); LinkedRoot (an
    UnsupportedSpec) when ``root`` is not given, the default root is a symlink to another folder
    and something is not installed there yet (:func:`linked_root`); PipError (a RuntimeError, one
    line) if pip fails otherwise.
    """
    linked = linked_root(root)
    root = root or default_root()
    spec = spec.strip()
    if not spec:
        raise UnsupportedSpec("empty --sglang spec")
    path = os.path.abspath(os.path.expanduser(spec))
    if spec.endswith(".whl"):
        if not os.path.isfile(path):
            raise UnsupportedSpec(f"wheel file {spec} does not exist")
        digest = _file_hash(path)
        site = os.path.join(root, f"wheel-{digest[:16]}")
        _ensure(site, (path,), log, key=f"sha256:{digest}", linked=linked)
        version = _version_of(site)
        kind, label = "wheel", f"{os.path.basename(path)}"
    elif os.path.isdir(path):
        site = tree_site(path)
        if site is None:
            raise UnsupportedSpec(f"{spec} is a folder without sglang/__init__.py (nor python/sglang/): not an SGLang "
                                  f"source tree")
        kind, label, version = "tree", f"@ {path}", None
    elif RELEASE.match(spec):
        from packaging.version import Version

        if Version(spec) < Version(FIRST_FA3):
            raise UnsupportedSpec(f"sglang {spec!r} predates the FA3 backend (first in {FIRST_FA3}); the default "
                                  f"releases are {','.join(PINS)}")
        site = install_release(spec, releases_root or root, log, linked if releases_root is None else None)
        kind, label, version = "release", spec, spec
    else:
        raise UnsupportedSpec(f"--sglang {spec!r} is neither a release version (e.g. 0.5.14), a wheel file nor an "
                              f"SGLang source tree")
    try:
        shape = detect(site)
    except SyntaxError as e:  # the code under test does not parse: name its file and line
        raise UnsupportedSpec(f"sglang {label}: {e.filename}:{e.lineno}: SyntaxError: {e.msg}") from None
    if shape.adapter is None:
        raise UnsupportedSpec(f"sglang {label}: cannot drive this API shape: {shape.missing}")
    if revert_fix is not None:
        name = revert_fix.lstrip("#")
        if not shape.toggles:
            raise UnsupportedSpec(f"sglang {label} has no fix toggles ({TOGGLES} absent or empty); --revert-fix needs "
                                  f"them")
        if name not in shape.toggles:
            raise UnsupportedSpec(f"sglang {label} registers no fix {revert_fix!r}; its fix toggles: "
                                  f"{', '.join(sorted(shape.toggles, key=int))}")
        revert_fix, label = name, f"{label} -fix {name}"
    if linked is not None and not _installed(os.path.join(root, "deps"), DEPS):
        _ensure(os.path.join(root, "deps"), DEPS, log, linked=linked)  # (raises LinkedRoot)
    return Target(spec, kind, label, site, [site, _deps(root, log)], shape, version, revert_fix)


def ensure(pins=PINS, root: str | None = None, log=print) -> dict[str, list[str]]:
    """``{spec: worker path}`` for each spec (kept for callers of the pinned-pair API)."""
    return {p: resolve(p, root, log).paths for p in pins}
