"""The reach of a bug-zoo variant: how many times its replacement ran (issue 42).

A variant proves a checker only on the path its seam is on.  If the probe that "catches" it never
calls the seam, the catch came from something else, and the path the variant claims to break may
be one no probe drives (two tree variants replaced eager-only functions while the graphed tree
verify, which builds the same metadata from other functions inside its graph, never called them).
So every applied variant is counted:

* :func:`counted` wraps a replacement in a counter (:class:`Reach`);
* :func:`refspec.mutants.variants.enabled` installs the counted wrapper at every call site of
  the seam and yields ``{name: Reach}``;
* the runner (``python -m refspec mutants``, :mod:`refspec.mutants.runner`) prints each probe's
  call counts (validation on / off) and fails a variant whose seam was not called in the run
  that caught it ("NOT REACHED"), however right the ID it saw.

Nothing to register: any :class:`~refspec.mutants.variant.Variant` (chain, tree, a new family)
is counted the moment it joins ``VARIANTS``.  What a count means: on the CPU the emulated CUDA
graph re-runs the captured function at every replay, so replays count; on CUDA a captured graph
replays its kernels without calling Python, so there the count is the calls made while capturing
(the graph replays what they recorded) plus the eager ones.  A probe's own direct call of the seam
counts too (``tree_probes.verify_probe`` reads the mask rows through ``verify_mask_rows`` as well
as through the backend): the count says the seam ran in the run, the probe's label says where.
Either way zero means the probe never put the variant on its path.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Reach:
    """Calls of one variant's replacement while it is on (``seam``: ``module.function`` replaced)."""

    seam: str
    calls: int = 0


def counted(replacement: Callable, reach: Reach) -> Callable:
    """``replacement`` with every call counted in ``reach.calls`` (same arguments, same result)."""
    @functools.wraps(replacement)
    def call(*args, **kwargs):
        reach.calls += 1
        return replacement(*args, **kwargs)
    return call
