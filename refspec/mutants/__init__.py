"""The bug zoo: named wrong variants of production seams and the machinery that proves each caught.

Modules: ``variants`` (the registry: ``VARIANTS``, ``enabled``; the record is ``variant.Variant``),
``tree_variants`` (the FA3 top-k > 1 seams' variants) and ``mla_variants`` (the MLA path's), both
part of ``VARIANTS``, ``replacements``
(one small wrong rule per variant), ``replace`` (rebinding a seam at every call site, by
identity), ``reach`` (each replacement's call counter: a variant whose seam its probe never
calls is not caught), ``probes`` / ``audit_probes`` / ``engine_probes`` / ``tree_probes`` / ``mla_probes`` (the
scenarios that expose them),
``checks`` (suite-side references and checks), ``runner`` (``python -m refspec mutants``).
Nothing in production imports this package (``tests/test_layers.py``).

Instruments, not rules: a learner reading the reference can skip this package.
"""
