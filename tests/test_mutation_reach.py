"""``make mutation`` (benchmarks/mutation.py) reports a mutant that no test reaches as *not
reached*, never as a survivor or an equivalent, and fails on it (issue 42).

mutmut's stats run records which selected tests call each mutated function; a mutant in a
function none of them calls is never run and gets the status "no tests" (exit code 33).  The
classification is checked here on hand-written verdicts (mutmut itself is not needed: it lives in
the ``mutation`` extra, and ``make mutation`` is its own CPU-heavy target).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: mutmut 3.8.1's ``status_by_exit_code`` for the codes used below
STATUS = {1: "killed", 36: "timeout", 0: "survived", 33: "no tests", 5: "no tests"}


@pytest.fixture(scope="module")
def mutation():
    spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "benchmarks" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_function_names_of_mutmut_keys(mutation):
    assert mutation.function_of("refspec.traces.replay.x__check_run__mutmut_7") == "_check_run"
    assert mutation.function_of("refspec.traces.tree.x_from_runs__mutmut_12") == "from_runs"
    assert mutation.function_of("refspec.traces.tree.xǁTreeRecorderǁobserve__mutmut_3") == "TreeRecorder.observe"


def test_a_mutant_no_test_calls_is_not_reached_not_survived_nor_equivalent(mutation, tmp_path):
    (tmp_path / "full_run_wall_s").write_text("12\n")
    mod = mutation.Module("traces.replay", "refspec/traces/replay.py", ("tests/test_replay_verdicts.py",))
    codes = {"refspec.traces.replay.x__check_run__mutmut_1": 1,
             "refspec.traces.replay.x__check_run__mutmut_2": 36,
             "refspec.traces.replay.x_unused__mutmut_1": 33,
             "refspec.traces.replay.x_unused__mutmut_2": 33,
             "refspec.traces.replay.xǁTraceǁload__mutmut_1": 5}
    row = mutation._classify(tmp_path, mod, codes, None, STATUS)
    assert row["total"] == 5 and row["killed"] == 2
    assert row["survived"] == [] and row["equivalent"] == []
    assert row["not_reached"] == {"unused": 2, "Trace.load": 1}
    lines = mutation.not_reached_lines([row])
    assert lines == ["* `traces.replay` `Trace.load`: 1 mutant never run: no test of `tests/test_replay_verdicts.py` "
                     "calls it",
                     "* `traces.replay` `unused`: 2 mutants never run: no test of `tests/test_replay_verdicts.py` "
                     "calls it"]
