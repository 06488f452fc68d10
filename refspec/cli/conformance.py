"""``python -m refspec conformance``: refspec's FA3 metadata vs SGLang's own backend, run on CPU.

Installs the pinned SGLang releases (``--no-deps``, into ``.conformance/``), runs upstream's
``FlashAttentionBackend`` / ``FlashAttentionMultiStepBackend`` in a subprocess on the same
``req_to_token`` and batches as refspec's FA3 wing (Triton replay kernels in Triton's
interpreter), and compares every kernel-read field bitwise.  Exit 1 on an undocumented
difference or an upstream error.  See docs/conformance.md.
"""

from __future__ import annotations

import argparse
import sys

from refspec.conformance import cases, install, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m refspec conformance", description=__doc__.splitlines()[0])
    ap.add_argument("--pin", nargs="+", choices=install.PINS, default=list(install.PINS),
                    help="SGLang releases to compare against (default: both pins)")
    ap.add_argument("--page-size", nargs="+", type=int, choices=cases.PAGE_SIZES, default=list(cases.PAGE_SIZES))
    ap.add_argument("--mode", nargs="+", choices=sorted(cases.MODES), default=None,
                    help="restrict the modes (default: every mode the pin has)")
    ap.add_argument("--variant", metavar="NAME", default=None,
                    help="switch a refspec bug variant on (negative control: the run must fail)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="also print every documented difference with both values")
    ap.add_argument("--root", default=None, help="install directory (default: <repo>/.conformance)")
    ns = ap.parse_args(argv)
    out = run.run(ns.pin, ns.page_size, ns.mode, ns.variant, ns.root)
    print(run.render(out, ns.verbose))
    sys.stdout.flush()
    return 0 if out.ok else 1
