"""refspec: reference paged attention + EAGLE top-k = 1 speculative decoding.

Two wings over one small core (``refspec.core``: modes, KV cache, batches): the readable oracle
(``refspec.oracle``) and SGLang's FA3 CUDA-graph path (``refspec.fa3``, ``refspec.graphs``),
proven equal by the test suite.  Every rule has an ID in ``refspec.core.invariants``
(``docs/spec``).  Command line: ``python -m refspec``.

The public API, importable from here (each name loads its module on first use, so that
``import refspec`` stays fast)::

    from refspec import generate, greedy_reference, Scenario, ForwardMode, InvariantError

* :func:`generate` -- the oracle or the production speculative loop, one call;
* :func:`greedy_reference` -- plain greedy decoding, the lossless reference;
* :class:`Scenario` -- one batch of one forward mode, through both wings, eager and graphed;
* :class:`OracleBackend`, :class:`FlashAttentionBackend` -- the two attention backends;
* :class:`ForwardMode`; :class:`InvariantError` (``.inv_id`` names the rule broken).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "generate": "refspec.speculative.api",
    "greedy_reference": "refspec.speculative.api",
    "Scenario": "refspec.harness.scenario",
    "OracleBackend": "refspec.oracle.backend",
    "FlashAttentionBackend": "refspec.fa3.backend",
    "InvariantError": "refspec.core.invariants",
    "ForwardMode": "refspec.core.modes",
}

__all__ = ["FlashAttentionBackend", "ForwardMode", "InvariantError", "OracleBackend", "Scenario", "__version__",
           "generate", "greedy_reference"]


def __getattr__(name: str):
    """PEP 562: import a public name's module on first access (``refspec.Scenario``)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'refspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from refspec.core.invariants import InvariantError
    from refspec.core.modes import ForwardMode
    from refspec.fa3.backend import FlashAttentionBackend
    from refspec.harness.scenario import Scenario
    from refspec.oracle.backend import OracleBackend
    from refspec.speculative.api import generate, greedy_reference
