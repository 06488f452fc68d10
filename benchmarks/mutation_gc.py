"""A pytest plugin for ``make mutation`` (benchmarks/mutation.py passes ``-p mutation_gc``).

Each mutant's tests run in a process forked from one that has imported torch and collected the
tests: tens of thousands of objects that every full garbage collection walks again (pytest's
unraisable-exception cleanup alone collects five times per session, ~3 s of a ~5 s run here).
Freezing them at configure time (``gc.freeze``: moved to a permanent generation, never
collected) leaves the collector only the objects the tests make.  It changes no test's outcome.
"""

import gc


def pytest_configure(config):
    gc.freeze()
