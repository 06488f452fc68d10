"""refspec: reference paged attention + EAGLE top-k = 1 speculative decoding.

Two wings over one small core (``modes``, ``kv_cache``, ``batch``): the readable oracle
(:mod:`refspec.oracle`) and SGLang's FA3 CUDA-graph path (:mod:`refspec.fa3`,
:mod:`refspec.graphs.capture`, :mod:`refspec.graphs.runner`), proven equal by the test suite.  Every rule
has an ID in :mod:`refspec.core.invariants` (``docs/spec``).  Entry points: ``python -m refspec``.
"""

__version__ = "0.1.0"
