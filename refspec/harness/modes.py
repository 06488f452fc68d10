"""One ready-made 3-request :class:`~refspec.harness.scenario.Scenario` per forward mode, keys at
page boundaries: the rows of ``python -m refspec check``'s eager and graph sections
(:mod:`refspec.cli.check`) and of the metadata tests.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from refspec.core.modes import ForwardMode
from refspec.harness.scenario import Scenario

M = ForwardMode
#: row label -> (mode, draft step); the order of the table
MODES = {
    "DECODE": (M.DECODE, None), "DRAFT_DECODE": (M.DECODE, 1), "EXTEND": (M.EXTEND, None),
    "EXTEND_PREFIX": (M.EXTEND, None), "TARGET_VERIFY": (M.TARGET_VERIFY, None),
    "DRAFT_EXTEND": (M.DRAFT_EXTEND, None), "DRAFT_EXTEND_V2": (M.DRAFT_EXTEND_V2, None), "IDLE": (M.IDLE, None),
}


def mode_scenarios(page_size: int, num_draft_tokens: int = 4, **kw) -> dict[str, Scenario]:
    """One 3-request Scenario per :data:`MODES` label, keys at page boundaries.

    Target key counts (tokens) are ``[max(1, P - 1), P + 1, 2P]`` (below, just past and exactly
    at a page boundary); each mode's ``lens`` is derived so that K_b lands there (clipped so that
    every committed length is >= 1).  N = ``num_draft_tokens``; v1 accepts a = [1, N, 2].
    ``kw`` goes to every Scenario (dtype, heads, device, seed, ...).
    """
    P, N = page_size, num_draft_tokens
    K = [max(1, P - 1), P + 1, 2 * P]
    a = [1, N, 2]
    e = [1, 2, 3]
    mk = lambda label, lens, **x: Scenario(MODES[label][0], P, lens, num_draft_tokens=N,
                                           draft_step=MODES[label][1], **x, **kw)
    return {
        "DECODE": mk("DECODE", K),
        "DRAFT_DECODE": mk("DRAFT_DECODE", [max(1, k - 2) for k in K]),  # step s = 1: K = L + 2
        "EXTEND": mk("EXTEND", [0, 0, 0], extend_lens=K),  # no prefix anywhere: S == Q
        "EXTEND_PREFIX": mk("EXTEND_PREFIX", [max(1, k - x) for k, x in zip(K, e)], extend_lens=e),
        "TARGET_VERIFY": mk("TARGET_VERIFY", [max(1, k - N) for k in K]),
        "DRAFT_EXTEND": mk("DRAFT_EXTEND", [max(1, k - x) for k, x in zip(K, a)], num_accept_tokens=a),
        "DRAFT_EXTEND_V2": mk("DRAFT_EXTEND_V2", [max(1, k - N) for k in K], num_accept_tokens=a),
        "IDLE": mk("IDLE", []),
    }
