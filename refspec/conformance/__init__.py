"""``python -m refspec conformance``: SGLang's own FA3 backend (pinned releases, CPU) on the same
batches as refspec's FA3 wing, case by case (docs/conformance.md).

Instruments, not rules: a learner reading the reference can skip this package.
"""
