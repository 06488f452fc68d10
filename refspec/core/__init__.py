"""The shared core: forward modes, the paged KV cache, ForwardBatch, layer constants, the
invariant catalogue and the tolerance tiers.  It imports no other refspec folder."""
