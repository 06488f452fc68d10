"""The files a user of the package expects, and what they must say."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_is_the_apache_2_text_and_spdx_in_pyproject():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS" in text
    proj = PYPROJECT["project"]
    assert proj["license"] == "Apache-2.0"  # SPDX expression, not the deprecated {text = ...} table
    assert proj["license-files"] == ["LICENSE"]


def test_project_urls_and_typed_marker():
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Documentation", "Repository", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    assert (ROOT / "refspec" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["refspec"]


def test_changelog_states_the_id_policy_and_has_both_sections():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(r"never reused and never renumbered", text)
    assert "## [Unreleased]" in text and re.search(r"## \[0\.1\.0\]", text)
    assert PYPROJECT["project"]["version"] == "0.1.0"


def test_contributing_says_how_to_add_a_rule_a_variant_a_tutorial():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    for heading in ("## Add a rule", "## Add a bug variant", "## Add a tutorial"):
        assert heading in text
    for cmd in ("make test", "make conformance", "pytest -m gpu", "tests/test_spec_ids.py"):
        assert cmd in text


def test_ruff_runs_in_make_test_and_is_clean():
    assert "ruff>=" in " ".join(PYPROJECT["project"]["optional-dependencies"]["test"])
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    test_recipe = make.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check refspec tests docs" in test_recipe
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff not installed (the `test` extra has it)")
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "refspec", "tests", "docs"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
