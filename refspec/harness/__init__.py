"""Ready-made batches (``scenario``: one-shot rows; ``grown``: rows grown over speculative rounds),
pictures and the spec-ID index for tests, docs and tutorials."""
