"""``python -m refspec conformance``: refspec's FA3 metadata vs SGLang's own backend, run on CPU.

Installs the pinned SGLang releases (``--no-deps``, into ``.conformance/``), runs upstream's
``FlashAttentionBackend`` / ``FlashAttentionMultiStepBackend`` in a subprocess on the same
``req_to_token`` and batches as refspec's FA3 wing (Triton replay kernels in Triton's
interpreter), and compares every kernel-read field bitwise.  Exit 1 on an undocumented
difference or an upstream error that no known upstream bug explains (a row of a known bug is
printed as failing, with the rule it breaks; it does not change the exit status).  See
docs/conformance.md.
"""

from __future__ import annotations

import sys

from refspec.cli._args import PROG, ArgumentParser, choice_list, int_list, run


def main(argv: list[str] | None = None) -> int:
    """Compare; 0 if every case agrees, differs only as documented or fails only on a known upstream
    bug (``known.BUGS``), 1 if not, 2 on a usage error."""
    return run(_main, argv, f"{PROG} conformance")


def _main(argv) -> int:
    from refspec.mutants import tree_variants, variants
    from refspec.conformance import cases, install, run as conformance, tree_cases

    ap = ArgumentParser(prog=f"{PROG} conformance", description=__doc__.splitlines()[0])
    ap.add_argument("--pins", "--pin", type=choice_list(list(install.PINS), "SGLang releases"),
                    default=list(install.PINS), metavar="V[,V...]",
                    help=f"SGLang releases to compare against, comma-separated (default: {','.join(install.PINS)})")
    ap.add_argument("--page-sizes", "--page-size", type=int_list(1, "page sizes"), default=list(cases.PAGE_SIZES),
                    metavar="P[,P...]",
                    help=f"page sizes, comma-separated, from {','.join(map(str, cases.PAGE_SIZES))} (default: all)")
    modes = sorted(cases.MODES) + list(tree_cases.MODES)
    ap.add_argument("--modes", "--mode", type=choice_list(modes, "modes"), default=None,
                    metavar="MODE[,MODE...]",
                    help=f"restrict the modes, comma-separated, from {', '.join(modes)} "
                         "(default: every mode the pin has; the tree_* modes are top-k > 1)")
    ap.add_argument("--topks", "--topk", type=int_list(2, "top-k values"), default=list(tree_cases.TOPKS),
                    metavar="K[,K...]",
                    help=f"top-k values of the tree_* modes, comma-separated, from "
                         f"{','.join(map(str, tree_cases.TOPKS))} (default: all)")
    ap.add_argument("--variant", choices=sorted(variants.VARIANTS) + sorted(tree_variants.TREE_VARIANTS),
                    metavar="NAME", default=None,
                    help="switch a refspec bug variant on (negative control: the run must fail)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="also print every documented difference with both values")
    ap.add_argument("--root", default=None, help="install directory (default: <repo>/.conformance)")
    ns = ap.parse_args(argv)
    bad = [p for p in ns.page_sizes if p not in cases.PAGE_SIZES]
    if bad:
        ap.error(f"argument --page-sizes: {bad} not among the compared page sizes "
                 f"{','.join(map(str, cases.PAGE_SIZES))}")
    bad = [k for k in ns.topks if k not in tree_cases.TOPKS]
    if bad:
        ap.error(f"argument --topks: {bad} not among the compared top-k values {','.join(map(str, tree_cases.TOPKS))}")
    out = conformance.run(ns.pins, ns.page_sizes, ns.modes, ns.variant, ns.root, topks=tuple(ns.topks))
    print(conformance.render(out, ns.verbose))
    sys.stdout.flush()
    return 0 if not out.unexplained else 1
