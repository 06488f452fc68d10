"""EAGLE top-k = 1 speculative decoding: drafts, drafters, acceptance, the v1 / v2 engine.

Entry point: :func:`refspec.speculative.api.generate` (re-exported here).
"""

from refspec.speculative.api import generate, greedy_reference

__all__ = ["generate", "greedy_reference"]
