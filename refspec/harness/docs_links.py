"""Links to refspec's rule pages (``docs/spec/<page>.md#<id>``) and the docs base URL they go under.

Library functions that ``python -m refspec cite`` and the conformance report
(``refspec/conformance/report.py``) both take; they live below the command line so that the
report does not import ``cli``.  The family -> page table is ``docs/spec_index.py``'s
(``FAMILY_PAGES``), loaded from this checkout.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

#: the checkout's root (``docs/`` and ``tests/`` live there)
ROOT = Path(__file__).resolve().parents[2]
#: environment variable: the base URL put in front of ``docs/...`` links (``cite``, the conformance report)
BASE_URL_ENV = "REFSPEC_DOCS_URL"


class NoCheckout(RuntimeError):
    """refspec does not run from a checkout: ``docs/spec_index.py`` is not there."""


@cache
def load_spec_index():
    """``docs/spec_index.py`` of this checkout (it reads the checkout's ``docs/spec`` and ``tests/``).

    Raises: NoCheckout when refspec does not run from a checkout (an installed wheel has neither)."""
    if "spec_index" in sys.modules:  # already imported with docs/ on sys.path (pytest, the docs build)
        return sys.modules["spec_index"]
    path = ROOT / "docs" / "spec_index.py"
    if not path.is_file():
        raise NoCheckout(f"cite needs a refspec checkout: {path} not found")
    spec = importlib.util.spec_from_file_location("spec_index", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["spec_index"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def spec_link(inv_id: str, base_url: str = "") -> str:
    """The ID's entry: ``docs/spec/<page>.md#<id>`` (repo-relative), under ``base_url`` if given."""
    path = f"docs/spec/{load_spec_index().family_page(inv_id)}#{inv_id.lower()}"
    return f"{base_url.rstrip('/')}/{path}" if base_url else path


def repository_url() -> str:
    """This repository's URL as refspec's package metadata states it (``Project-URL: Repository``
    from ``pyproject.toml``), or '' when none is recorded."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata("refspec").get_all("Project-URL") or []
    except PackageNotFoundError:
        return ""
    return next((u.split(",", 1)[1].strip() for u in urls if u.split(",", 1)[0].strip() == "Repository"), "")


def docs_base(base_url: str = "", repo: str | None = None) -> tuple[str, str]:
    """``(prefix, how)`` for docs links: ``base_url`` (``--base-url`` / ``$REFSPEC_DOCS_URL``); else
    the GitHub blob of this repository's ``main`` when its URL is known (``repo``, default
    :func:`repository_url`); else '' (repo-relative links).  ``how`` is a sentence saying which."""
    if base_url:
        return base_url.rstrip("/"), f"spec links are under {base_url.rstrip('/')} (--base-url / ${BASE_URL_ENV})"
    repo = repository_url() if repo is None else repo
    if repo.startswith("https://github.com/"):
        return f"{repo.rstrip('/')}/blob/main", (f"spec links go to {repo.rstrip('/')}/blob/main (the repository "
                                                 "URL in refspec's package metadata; --base-url URL overrides)")
    return "", ("spec links are repository-relative (docs/spec/...): no repository URL is known; pass --base-url "
                f"URL or set ${BASE_URL_ENV} for absolute links")
