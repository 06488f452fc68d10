"""Ready-made batches, pictures and the spec-ID index for tests, docs and tutorials."""
