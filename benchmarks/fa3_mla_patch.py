"""Trim an unpacked flash-attention ``hopper/`` tree to the MLA kernel (used by gpu_fa3_mla.sh).

Usage: ``python3 benchmarks/fa3_mla_patch.py HOPPER_DIR [--mla-only | --all-hdim64]``

setup.py's own ``FLASH_ATTENTION_DISABLE_*`` flags (set by gpu_fa3_mla.sh) already leave only the
bf16 sm90 forward kernels of head dim 64: (64, 64), (64, 256) and (64, 512), five translation units
each. They cannot drop (64, 64) or (64, 256): ``run_mha_fwd_constexpr`` in flash_api_stable.cpp
names all three whenever HDIM64 and HDIMDIFF64 are on, so leaving their files out gives an
``undefined symbol`` when ``flash_attn_3._C`` is imported. ``--mla-only`` (the default) therefore

* replaces the two bf16 calls ``run_mha_fwd_<Arch, bfloat16, 64, 256, ...>`` and ``<..., 64, 64,
  ...>`` with a ``STD_TORCH_CHECK(false, ...)`` (a call with head dim <= 64 and V head dim <= 256
  then fails with a clear message instead of running a kernel), and
* makes setup.py drop ``flash_fwd_hdim64_bf16*`` and ``flash_fwd_hdim64_256_bf16*`` from its
  source list (env ``FA3KIT_DROP``, read by the line this script adds).

Both edits and two portability fixes are applied to setup.py in every mode: ``wheel.bdist_wheel``
falls back to setuptools' own class (newer ``wheel`` releases drop the module), and the
``git submodule update`` call is skipped (the kit ships cutlass and is no git checkout).
Each edit asserts that its anchor occurs exactly once, so a changed upstream file fails loudly.
The edits are idempotent (a second run finds them done and changes nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "fa3kit"

SETUP_EDITS = [
    (
        "from wheel.bdist_wheel import bdist_wheel as _bdist_wheel\n",
        "try:  # fa3kit: newer wheel releases no longer ship wheel.bdist_wheel\n"
        "    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel\n"
        "except ImportError:\n"
        "    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel\n",
    ),
    (
        '    subprocess.run(["git", "submodule", "update", "--init", "../csrc/cutlass"])\n',
        "    pass  # fa3kit: cutlass ships in the kit (csrc/cutlass/include); no git checkout here\n",
    ),
    (
        '    sources += ["flash_prepare_scheduler.cu"]\n',
        '    sources += ["flash_prepare_scheduler.cu"]\n'
        "    # fa3kit: drop the translation units named by FA3KIT_DROP (substrings), print the list\n"
        '    _fa3kit_drop = os.environ.get("FA3KIT_DROP", "").split()\n'
        "    sources = [s for s in sources if not any(tag in s for tag in _fa3kit_drop)]\n"
        '    print("fa3kit sources (%d):" % len(sources), " ".join(sources), flush=True)\n',
    ),
]

_CALL = (
    "return run_mha_fwd_<Arch, cutlass::bfloat16_t, 64, %s, Split, PagedKVNonTMA, Has_softcap, PackGQA>"
    "(params, stream);"
)
_MSG = (
    '"fa3kit MLA-only build: only head dim 64 with V head dim 512 (bf16, sm90) was compiled; '
    'this call needs V head dim %s"'
)
API_EDITS = [
    (
        _CALL % 256,
        "{ STD_TORCH_CHECK(false, " + _MSG % "in (64, 256]" + "); return; }  // fa3kit",
    ),
    (
        _CALL % 64,
        "{ STD_TORCH_CHECK(false, " + _MSG % "<= 64" + "); return; }  // fa3kit",
    ),
]

MLA_ONLY_DROP = "flash_fwd_hdim64_bf16 flash_fwd_hdim64_256_bf16"


def _edit(path: Path, edits: list[tuple[str, str]]) -> int:
    """Apply (old, new) replacements to ``path``; each ``old`` must occur exactly once.

    Returns the number of edits made (0 when all were already there). Raises SystemExit naming
    the anchor when one is missing or repeated.
    """
    text = path.read_text()
    done = 0
    for old, new in edits:
        if new in text:
            continue  # applied by an earlier run (a new text may contain its old one)
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{path.name}: anchor found {count} times, expected 1: {old.strip()[:90]!r}")
        text = text.replace(old, new)
        done += 1
    path.write_text(text)
    return done


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    hopper = Path(argv[0])
    mla_only = "--all-hdim64" not in argv[1:]
    n_setup = _edit(hopper / "setup.py", SETUP_EDITS)
    n_api = _edit(hopper / "flash_api_stable.cpp", API_EDITS) if mla_only else 0
    mode = "mla-only (64/512)" if mla_only else "all hdim64 (64/64, 64/256, 64/512)"
    print(f"fa3kit patch: {mode}; setup.py edits {n_setup}, flash_api_stable.cpp edits {n_api}")
    if mla_only:
        print(f"FA3KIT_DROP={MLA_ONLY_DROP}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
