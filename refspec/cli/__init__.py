"""``python -m refspec COMMAND``: info, check, demo, mutants, record, replay, bench, conformance, cite,
train-draft.

Each command lives in its own module and is imported only when it runs.  Errors are one line
and exit status 2 (``--debug`` shows the traceback); list options are comma-separated
(:mod:`refspec.cli._args`).

Instruments, not rules: a learner reading the reference can skip this package.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from refspec.cli._args import PROG, ArgumentParser, run

COMMANDS = {
    "info": ("refspec.cli.info", "which FA3 provider is active and why"),
    "check": ("refspec.cli.check", "oracle vs FA3 matrix: modes x page sizes x providers (+ graphs, loops)"),
    "bench": ("refspec.cli.bench", "benchmarks: kernel vs copy bandwidth, metadata cost, spec rounds"),
    "demo": ("refspec.cli.demo", "SmolLM2 on MT-Bench: greedy vs oracle loop vs production (FA3, graphs); --bug NAME"),
    "record": ("refspec.cli.record", "run the real model once and write its speculative schedule as a trace (JSON)"),
    "replay": ("refspec.cli.replay", "replay a trace through production (graphs) vs the oracle loop (--device cuda)"),
    "conformance": ("refspec.cli.conformance", "refspec's FA3 metadata vs SGLang's own backend (pinned releases, CPU)"),
    "cite": ("refspec.cli.cite", "an invariant ID's rule, conformance level, upstream sources and tests, for a review"),
    "mutants": ("refspec.cli.mutants", "the bug zoo: every wrong variant is caught by a named invariant"),
    "train-draft": ("refspec.cli.train_draft", "train the EAGLE head for SmolLM2-135M (ShareGPT, --device cuda)"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to ``COMMANDS[argv[0]]``; options before the command are ``--version`` / ``--debug``."""
    from refspec import __version__

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog=PROG, description="refspec: reference paged attention + EAGLE speculative "
                            "decoding, the oracle beside SGLang's FA3 CUDA-graph path.",
                            epilog=f"Run '{PROG} COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"refspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), len(argv))
    head, rest = argv[:i + 1], argv[i + 1:]

    def body(_):
        ns = parser.parse_args(head)
        module = importlib.import_module(COMMANDS[ns.command][0])
        debug = "--debug" in head and "--debug" not in rest  # (the sub-parser's own --debug default hides ns.debug)
        return module.main(rest + (["--debug"] if debug else []))

    return run(body, argv, PROG)
