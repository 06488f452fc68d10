"""The README's Python snippet runs as written, ``import refspec`` stays cheap, and its size claim is measured."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _snippet() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## From Python", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README: no ```python block under '## From Python'"
    return m.group(1)


def test_readme_snippet_runs(capsys):
    exec(compile(_snippet(), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "max |FA3 - oracle|:" in out
    assert "PA-008 - [PA-008]" in out


def test_public_api_and_a_fast_import():
    import refspec

    names = {"generate", "greedy_reference", "Scenario", "OracleBackend", "FlashAttentionBackend",
             "InvariantError", "ForwardMode", "__version__"}
    assert names <= set(refspec.__all__) and names <= set(dir(refspec))
    from refspec.core.invariants import InvariantError
    from refspec.speculative.api import generate

    assert refspec.InvariantError is InvariantError and refspec.generate is generate
    # importing the package alone loads none of torch (the names load on first use)
    code = "import sys, refspec; print('torch' in sys.modules, refspec.__version__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and p.stdout.split() == ["False", "0.1.0"], p.stderr


def _size_claim() -> tuple[int, str, int]:
    """The README's "Size:" paragraph: (the chain reference's lines, the command that counts them,
    the package's thousands of lines)."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("Size: the chain reference", 1)[1]
    lines = re.search(r"\*\*([\d,]+) lines\*\*", section)
    cmd = re.search(r"measured with\s+`([^`]+)`", section)
    pkg = re.search(r"is about (\d+)k lines", section)
    assert lines and cmd and pkg, "README: the size paragraph lost its number, command or package size"
    return int(lines.group(1).replace(",", "")), " ".join(cmd.group(1).split()), int(pkg.group(1))


def test_readme_size_claim_is_what_its_command_counts():
    """The bold line count is exactly what the quoted command prints at this commit, and the
    command leaves out every tree-only module (the top-k > 1 siblings and their Triton kernels)."""
    lines, cmd, pkg = _size_claim()
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    *files, total = p.stdout.strip().splitlines()
    assert total.split() == [str(lines), "total"], f"README says {lines:,} lines, the command counts {total}"
    counted = {line.split()[1] for line in files}
    assert "refspec/core/modes.py" in counted and "refspec/speculative/engine.py" in counted
    tree_only = {"refspec/fa3/merge_kernel.py", "refspec/core/triton_kernels.py", "refspec/oracle/slots.py"}
    assert not counted & tree_only and not any("tree" in f for f in counted), sorted(counted)
    package = sum(len(f.read_text(encoding="utf-8").splitlines()) for f in (ROOT / "refspec").rglob("*.py"))
    assert abs(package - pkg * 1000) < 1000, f"README says about {pkg}k lines, the package has {package:,}"
