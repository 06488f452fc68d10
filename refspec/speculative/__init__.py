"""EAGLE speculative decoding, production side: drafters, acceptance, the v1 / v2 chain engine
(top-k = 1: ``engine``, ``rounds``, ``overlap``) and its top-k > 1 sibling (:mod:`refspec.speculative.tree`).

Entry point: :func:`refspec.speculative.api.generate` (re-exported here).
"""

from refspec.speculative.api import generate, greedy_reference

__all__ = ["generate", "greedy_reference"]
