"""Ready-made batches for tests, docs and tutorials (``scenario``: one-shot rows; ``modes``: one
per forward mode; ``grown``: rows grown over speculative rounds), dumps, exercises and pictures.

Instruments, not rules: a learner reading the reference can skip this package.
"""
