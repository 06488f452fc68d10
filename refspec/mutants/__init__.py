"""The bug zoo: named wrong variants of production seams and the machinery that proves each caught.

Modules: ``variants`` (the registry: ``Variant``, ``VARIANTS``, ``enabled``), ``replacements``
(one small wrong rule per variant), ``replace`` (rebinding a seam at every call site, by
identity), ``probes`` / ``audit_probes`` / ``engine_probes`` (the scenarios that expose them),
``checks`` (suite-side references and checks), ``runner`` (``python -m refspec mutants``).
Nothing in production imports this package (``tests/test_layers.py``).
"""
