"""``python -m refspec COMMAND``: info, check, demo, mutants, record, replay, bench, conformance, cite.

Each command lives in its own module and is imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "info": ("refspec.cli.info", "which FA3 provider is active and why"),
    "check": ("refspec.cli.check", "oracle vs FA3 matrix: modes x page sizes x providers (+ graphs, loops)"),
    "bench": ("refspec.cli.bench", "benchmarks: kernel vs copy bandwidth, metadata cost, spec rounds"),
    "demo": ("refspec.cli.demo", "SmolLM2 on MT-Bench: greedy vs oracle loop vs production (FA3, graphs); --bug NAME"),
    "record": ("refspec.cli.record", "run the real model once and write its speculative schedule as a trace (JSON)"),
    "replay": ("refspec.cli.replay", "replay a trace through production (graphs) vs the oracle loop (--device cuda)"),
    "conformance": ("refspec.cli.conformance", "refspec's FA3 metadata vs SGLang's own backend (pinned releases, CPU)"),
    "cite": ("refspec.cli.cite", "an invariant ID's rule, conformance level, upstream sources and tests, for a review"),
    "mutants": ("refspec.cli.mutants", "the bug zoo: every wrong variant of refspec.mutants.variants is caught (--device cpu|cuda)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m refspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv[:1])
    module = importlib.import_module(COMMANDS[ns.command][0])
    return int(module.main(argv[1:]) or 0)
