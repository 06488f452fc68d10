"""``python -m refspec mutants``: run every wrong variant and print which invariant catches it.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import sys

from refspec.mutants import variants
from refspec.cli._args import PROG, ArgumentParser, choice_list, device_name, run


def main(argv: list[str] | None = None) -> int:
    """Run the variants; exit 0 if every one is caught, 1 otherwise, 2 on a usage error."""
    return run(_main, argv, f"{PROG} mutants")


def _main(argv) -> int:
    from refspec.mutants.runner import format_report, run as run_variants

    ap = ArgumentParser(prog=f"{PROG} mutants", description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=device_name, default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--only", type=choice_list(sorted(variants.VARIANTS), "variants"), metavar="NAME[,NAME...]",
                    help="run only these variants, comma-separated (default: all; names as in docs/bug-zoo.md)")
    ap.add_argument("--engine", action="store_true", help="add the token-level probes (whole spec loops; slow)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every detection's full message")
    ns = ap.parse_args(argv)
    rep = run_variants(ns.device, ns.only, engine=ns.engine)
    print(format_report(rep, ns.verbose))
    sys.stdout.flush()
    return 0 if len(rep.caught) == rep.total else 1
