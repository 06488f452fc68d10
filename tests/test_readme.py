"""The README's Python snippet runs as written, and ``import refspec`` stays cheap."""

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
