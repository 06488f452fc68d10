"""Apply a wrong variant from outside: rebind, for the duration of a ``with`` block, every module
global of the production package that *is* one production function (a seam), then restore it.

Why by identity: a seam is often imported by name into several modules
(``refspec.fa3.graph_metadata`` does ``from refspec.fa3.metadata import mode_delta``), so
patching one module attribute would miss the other call sites.  Every ``refspec.*`` module
global bound to the original is rebound, except inside :mod:`refspec.mutants` itself: the
replacements call the original through names bound there, which must keep pointing at it.

A variant whose seam has no call site (renamed, inlined, or already replaced by another active
variant) raises instead of silently changing nothing.  Only modules already imported are
rebound: :mod:`refspec.mutants.variants` imports every module that defines a seam, and a module
that is first imported inside the block would bind the original (import it before).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager

PREFIX = "refspec."  #: the production package
SKIP = "refspec.mutants"  #: never rebound: the replacements' own references to the originals


class NoCallSite(LookupError):
    """The seam a variant replaces is bound nowhere in the production modules."""


def call_sites(original: Callable, within: str | None = None) -> list[tuple[object, str]]:
    """``(module, name)`` for every loaded production module global that is ``original``.

    ``within`` restricts the search to one module (a variant that changes one caller only).
    """
    sites = []
    for modname, mod in list(sys.modules.items()):
        if mod is None or not modname.startswith(PREFIX) or modname.startswith(SKIP):
            continue
        if within is not None and modname != within:
            continue
        sites += [(mod, k) for k, v in list(vars(mod).items()) if v is original]
    return sites


@contextmanager
def replaced(original: Callable, replacement: Callable, within: str | None = None):
    """Inside the block every production binding of ``original`` is ``replacement``.

    Raises: NoCallSite if ``original`` is bound nowhere (in ``within``, if given).
    """
    sites = call_sites(original, within)
    if not sites:
        where = within or f"the {PREFIX}* modules"
        raise NoCallSite(f"{original.__module__}.{original.__qualname__} is bound nowhere in {where} "
                         "(renamed, inlined, or already replaced by another variant)")
    for mod, name in sites:
        setattr(mod, name, replacement)
    try:
        yield sites
    finally:
        for mod, name in sites:
            setattr(mod, name, original)
