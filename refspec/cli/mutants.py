"""``python -m refspec mutants``: run every wrong variant and print which invariant catches it."""

from __future__ import annotations

import argparse
import sys

from refspec.mutants import variants
from refspec.mutants.runner import format_report, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m refspec mutants", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(variants.VARIANTS), help="variants to run")
    ap.add_argument("--engine", action="store_true", help="add the token-level probes (whole spec loops; slow)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every detection's full message")
    ns = ap.parse_args(argv)
    rep = run(ns.device, ns.only, engine=ns.engine)
    print(format_report(rep, ns.verbose))
    sys.stdout.flush()
    return 0 if len(rep.caught) == rep.total else 1
