"""Upstream changes as diffs, applied to a copy of an installed SGLang release.

``refspec/conformance/patches/<name>.diff`` is a ``git diff`` against upstream's tree
(``a/python/sglang/...``) with a ``#`` header that names the PR, links it, names the release it
applies to and says where its text came from (the PR's own diff, or a re-creation, and why).
:func:`patched_copy` builds ``<root>/sglang-<pin>+<names>-<hash>``: a tree of symlinks to the
installed release (cheap: no 130 MB copy) in which only the files a diff touches are real
copies, patched with ``git apply`` (exact context, no fuzz: a diff that no longer applies is an
error, never a silent partial patch).  The directory name carries a hash of the base install's
stamp and of every diff's bytes, so an edited diff builds a new copy and an unchanged one is
reused.  Nothing here writes to the base install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from refspec.conformance.install import STAMP

PATCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")
#: planted mutants of upstream code (no PR: negative controls of the comparison itself), ``patches/mutants/``
MUTANT_DIR = os.path.join(PATCH_DIR, "mutants")
#: refspec's proposed fixes of known upstream bugs no upstream PR addresses yet, ``patches/proposed/``
#: (their header's ``PR:`` says so)
PROPOSED_DIR = os.path.join(PATCH_DIR, "proposed")
#: ``git apply -p2``: ``a/python/sglang/x.py`` -> ``sglang/x.py`` inside an install directory
STRIP = 2
HEADER_KEYS = ("PR", "Base", "Provenance", "Expect")


@dataclass(frozen=True)
class Patch:
    """One stored diff: ``header`` holds its ``Key: value`` lines (PR, Base, Provenance, Expect)."""

    name: str
    path: str
    header: dict

    @property
    def files(self) -> list[str]:
        """The install-relative files it changes (``sglang/...``)."""
        with open(self.path) as f:
            return [line.split()[-1].split("/", STRIP)[-1] for line in f if line.startswith("+++ b/")]


def default_root() -> str:
    """``<repo>/.conformance-patched`` (gitignored; apart from ``.conformance``, which may be shared)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(PATCH_DIR))), ".conformance-patched")


def names() -> list[str]:
    """Every stored patch name (file stem) of an upstream PR, sorted (not the mutants: :func:`mutants`)."""
    return sorted(f[:-5] for f in os.listdir(PATCH_DIR) if f.endswith(".diff"))


def mutants() -> list[str]:
    """Every stored planted mutant (``patches/mutants/<name>.diff``), sorted."""
    return sorted(f[:-5] for f in os.listdir(MUTANT_DIR) if f.endswith(".diff"))


def proposed() -> list[str]:
    """Every stored proposed fix (``patches/proposed/<name>.diff``), sorted."""
    return sorted(f[:-5] for f in os.listdir(PROPOSED_DIR) if f.endswith(".diff"))


def load(name: str) -> Patch:
    """The stored patch (or planted mutant) ``name``.  Raises ValueError naming the known ones if there is none."""
    path = os.path.join(PATCH_DIR, f"{name}.diff")
    for folder in (MUTANT_DIR, PROPOSED_DIR):
        if not os.path.exists(path):
            path = os.path.join(folder, f"{name}.diff")
    if not os.path.exists(path):
        raise ValueError(f"no conformance patch {name!r}; stored: {', '.join(names() + mutants() + proposed())}")
    header, key = {}, None
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            text = line[1:].strip()
            k, sep, v = text.partition(":")
            if sep and k.strip() in HEADER_KEYS:
                key = k.strip()
                header[key] = v.strip()
            elif key:
                header[key] += " " + text
    return Patch(name, path, header)


def _digest(base: str, patches: list[Patch]) -> str:
    h = hashlib.sha256()
    stamp = os.path.join(base, STAMP)
    h.update(open(stamp, "rb").read() if os.path.exists(stamp) else os.path.abspath(base).encode())
    for p in patches:
        h.update(p.name.encode() + b"\0" + open(p.path, "rb").read())
    return h.hexdigest()[:12]


def _link_tree(src: str, dst: str) -> None:
    """``dst`` mirrors ``src``: real directories, files as absolute symlinks."""
    for here, _dirs, files in os.walk(src):
        rel = os.path.relpath(here, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for f in files:
            os.symlink(os.path.abspath(os.path.join(here, f)), os.path.join(dst, rel, f))


def patched_copy(base: str, patch_names, root: str | None = None, log=print) -> str:
    """A directory like ``base`` (an install dir holding ``sglang/``) with ``patch_names`` applied
    in order; built once per (base stamp, diffs) and reused.

    Raises: ValueError (unknown patch), RuntimeError with git's message if a diff does not apply.
    """
    patches = [load(n) for n in patch_names]
    if not patches:
        return base
    root = root or default_root()
    dst = os.path.join(root, f"{os.path.basename(os.path.normpath(base))}+{'+'.join(patch_names)}-"
                             f"{_digest(base, patches)}")
    if os.path.exists(os.path.join(dst, STAMP)):
        return dst
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        _link_tree(base, tmp)
        for p in patches:
            for rel in p.files:
                target = os.path.join(tmp, rel)
                if os.path.islink(target):  # a real file to patch, never the base install's
                    real = os.path.realpath(target)
                    os.unlink(target)
                    shutil.copyfile(real, target)
            # GIT_CEILING_DIRECTORIES: git must not find an enclosing repository (this checkout),
            # which would make it apply the paths relative to that repository's top
            env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(tmp))
            proc = subprocess.run(["git", "apply", f"-p{STRIP}", "--whitespace=nowarn", p.path], cwd=tmp, env=env,
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"patch {p.name} does not apply to {base}:\n{proc.stderr.strip()}")
        stamp = os.path.join(tmp, STAMP)
        if os.path.lexists(stamp):  # the base install's stamp, linked: never write through it
            os.unlink(stamp)
        with open(stamp, "w") as f:
            f.write("\n".join(f"{p.name} {p.header.get('PR', '')}" for p in patches) + "\n")
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"patched copy of {os.path.basename(base)} with {', '.join(patch_names)} in {dst}")
    return dst
