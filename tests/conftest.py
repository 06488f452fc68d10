"""Shared pytest set-up: the ``spec`` and ``gpu`` markers.

* ``@pytest.mark.spec("CG-004", ...)`` names the invariants a test proves; an unknown ID is a
  collection error (the meta-test in ``test_spec_ids.py`` checks the other direction).
* ``@pytest.mark.gpu`` tests need a Hopper GPU and the real FA3 kernel; elsewhere they skip with
  the reason (never counted as passing).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from refspec.core.invariants import INVARIANTS

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=10_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The suite is thousands of tiny tensor ops; intra-op threads only contend (``make test`` runs
# 2 xdist workers on 2 cores): one thread per worker measured 11 s vs 199 s for the same files.
torch.set_num_threads(int(os.environ.get("REFSPEC_TEST_THREADS", "1")))


def _gpu_skip_reason() -> str | None:
    import torch

    from refspec.fa3.kernel import _real_kernel, hopper_reason

    if not torch.cuda.is_available():
        return "gpu test: no CUDA device"
    why = hopper_reason()
    if why:
        return f"gpu test: {why}"
    k = _real_kernel("fa3")
    return f"gpu test: {k}" if isinstance(k, str) else None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        for m in item.iter_markers("spec"):
            unknown = [i for i in m.args if i not in INVARIANTS]
            if unknown:
                raise pytest.UsageError(f"{item.nodeid} cites unknown invariant id(s) {unknown}")
        if item.get_closest_marker("gpu"):
            if not checked:
                reason, checked = _gpu_skip_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
