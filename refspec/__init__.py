"""refspec: reference paged attention + EAGLE speculative decoding (chains, top-k = 1, and trees, top-k > 1).

Two wings over one small core (``refspec.core``: modes, KV cache, batches): the readable oracle
(``refspec.oracle``) and SGLang's FA3 CUDA-graph path (``refspec.fa3``, ``refspec.graphs``),
proven equal by the test suite.  Every rule has an ID in ``refspec.core.invariants``
(``docs/spec``).  Command line: ``python -m refspec``.

Read in this order (the chain reference; then ``speculative/overlap.py`` and the top-k > 1
siblings ``oracle/tree*.py``, ``fa3/tree_*.py``, ``speculative/tree/``; MLA after 13:
``core/mla.py``, ``MLAKVPool`` in ``core/kv_cache.py``, ``oracle/mla.py``, ``fa3/mla.py``, then the model
``model/deepseek.py`` and its MTP draft ``model/deepseek_nextn.py``)::

     1. refspec/core/modes.py           ForwardMode: the forward modes, the query rows of each, and what v1 / v2 mean
     2. refspec/core/kv_cache.py        req_to_token, the page allocator and the paged KV pool
     3. refspec/core/batch.py           ForwardBatch and its builders, one per mode (SGLang's field names)
     4. refspec/oracle/attention.py     the rule itself: attention over the slots each query may see
     5. refspec/core/backend.py         the backend contract (Protocols) both wings implement: store, then attend,
                                        and the graph hooks
     6. refspec/oracle/backend.py       the paged oracle backend: store, then attend by slot gather
     7. refspec/model/llama.py          a small HF-named Llama whose attention backend is passed in
     8. refspec/model/drafts.py         the draft models (EAGLE head, early exit, small LM) behind one interface
     9. refspec/oracle/dense.py         the oracle loop's cache: one request's dense KV, causal by position
    10. refspec/oracle/loop.py          one request's speculative loop in numbered steps: draft, verify, accept
    11. refspec/fa3/metadata.py         FA3 metadata per mode: cache_seqlens, cu_seqlens_q, page_table
    12. refspec/fa3/emulator.py         the FA3 kernel contract (flash_attn_with_kvcache) in pure PyTorch
    13. refspec/fa3/backend.py          SGLang's FA3 backend: the same store-then-attend on FA3 metadata; read with
                                        fa3/kernel.py, the two calls it makes, store and attend (the real FA3
                                        on Hopper, else 12)
    14. refspec/graphs/capture.py       what a CUDA graph freezes, and the emulated graph that freezes it on CPU
    15. refspec/fa3/graph_metadata.py   capture and in-place replay of the metadata, one rule per function
    16. refspec/graphs/runner.py        batch-size buckets, padded rows, one copy per replay
    17. refspec/speculative/accept.py   greedy acceptance on the device (SD-001)
    18. refspec/speculative/runners.py  each phase's backend (13, or 6 eager) and graph runner (16)
    19. refspec/speculative/future.py   the future map: the next round's inputs, kept on the device by row
    20. refspec/speculative/rounds.py   one batched round, v1 and v2: the production twin of the oracle loop; read
                                        with speculative/round_row.py, the result row it returns per request
    21. refspec/speculative/engine.py   the continuous-batching engine: admit, prefill, rounds, commit

Small helpers met on the way, read when first imported: ``core/args.py`` (argument checks),
``core/invariants.py`` (``require`` and the rule catalogue), ``core/layer.py`` (``AttentionLayer``),
``core/transfer.py`` (host-to-device copies that do not stall), ``core/constants.py`` (index constants
built once per shape), ``core/future_batch.py`` (the overlap loop's batch builders: lengths on the device,
bounds on the host), ``core/tolerance.py`` (the T0 / T1 / T2 tiers the tests compare the wings by),
``fa3/validate.py`` (the checks before each kernel call), and the engine's ``speculative/request.py``,
``speculative/drafters.py`` (scripted test drafts) and ``speculative/metrics.py`` (the round trace).

The other folders (``cli``, ``conformance``, ``mutants``, ``harness``, ``traces``, ``audits``,
``real``) are instruments around the reference: a learner can skip them, and the reference never
imports them (``tests/test_layers.py``).

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
