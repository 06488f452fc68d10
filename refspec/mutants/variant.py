"""A named wrong variant of a production seam (the record every bug-zoo registry holds).

:mod:`refspec.mutants.variants` (the chain seams) and :mod:`refspec.mutants.tree_variants` (the
FA3 top-k > 1 seams) list them; ``VARIANTS`` there is the whole zoo.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """A named wrong variant: ``replacement`` stands in for the production seam ``target``
    (in every module that binds it, or only in module ``within``)."""

    name: str
    target: Callable  #: the production function (seam) replaced
    replacement: Callable
    changes: str  #: what the variant changes (the one-line diff)
    source: str  #: where it was seen: upstream PR / commit links, or the docs page of the rule
    symptom: str  #: what it does when it runs
    caught_by: tuple[str, ...]  #: invariant IDs whose checks catch it (``python -m refspec mutants``)
    within: str | None = None  #: restrict the replacement to this module's call sites
    only_with_validation: bool = False  #: it removes a check: nothing to see with validation off

    @property
    def seam(self) -> str:
        """``module.function`` of the replaced production function."""
        return f"{self.target.__module__}.{self.target.__qualname__}"
