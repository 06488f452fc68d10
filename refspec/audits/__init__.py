"""Audits of a running engine: KV accounting (:mod:`~refspec.audits.kv`), host <-> device syncs
(:mod:`~refspec.audits.sync`) and host ops per round (:mod:`~refspec.audits.launch`).

Instruments, not rules: a learner reading the reference can skip this package.
"""
