"""The shared core: forward modes, the paged KV cache, ForwardBatch, layer constants, the
invariant catalogue, the tolerance tiers and the backend Protocols (``backend``).  It imports no
other refspec folder (``tests/test_layers.py``)."""
