"""``python -m refspec conformance``: refspec's FA3 metadata vs SGLang's own backend, run on CPU.

``--sglang SPEC[,SPEC...]`` names the code: a release on the package index (``0.5.14``), a wheel
file, or a source tree (an SGLang checkout or its ``python/`` folder, used in place); the default
is the pinned pair.  Installs (``--no-deps``, into ``.conformance/``) are reused; the backend's API
shape is read from the code and picks the adapter and the modes.  Runs upstream's
``FlashAttentionBackend`` / ``FlashAttentionMultiStepBackend`` in a subprocess on the same
``req_to_token`` and batches as refspec's FA3 wing (Triton replay kernels in Triton's
interpreter), runs upstream's forward with a recorder in place of the kernel, and compares every
kernel-read field and kernel argument bitwise.  Every failing row names the rule (ID and level),
both values and the upstream file:line it read.  Exit status: 0 when no rule is broken on the
inputs upstream can reach; 1 when a rule is broken (a known upstream bug reproduced included,
named as known with its PR; ``--expect-bugs LABEL:KEY,...`` states the known bugs expected per
target and makes them strict: the run passes only when exactly those show); 3 when no rule is
broken but refspec's adapter cannot drive some results (an adapter gap: no rule broken; refspec
cannot drive this code yet); 2 on a usage error, on code whose API shape no adapter drives, and on
a selection that compares nothing.  ``--baseline SPEC`` with one ``--sglang SPEC`` reviews a PR:
both run on the same grid and only what changed is reported (new failures: exit 1; adapter gaps
under test: 3; pre-existing ones, fixes, results only the code under test has, the unchanged
count).  See docs/conformance.md.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import argparse
import os
import sys

from refspec.cli._args import PROG, ArgumentParser, CLIError, choice_list, int_list, run


def main(argv: list[str] | None = None) -> int:
    """Compare; 0 if no rule is broken on reachable inputs, 1 if one is (a known upstream bug
    included), 3 on an adapter gap alone, 2 on a usage error."""
    return run(_main, argv, f"{PROG} conformance")


def _main(argv) -> int:
    from refspec.mutants import tree_variants, variants
    from refspec.conformance import cases, install, mla_forward, report, run as conformance, tree_cases

    ap = ArgumentParser(prog=f"{PROG} conformance", description=__doc__.splitlines()[0])
    ap.add_argument("--sglang", "--pins", "--pin", dest="sglang", type=_specs, default=None,
                    metavar="SPEC[,SPEC...]",
                    help=f"the SGLang code to compare against, comma-separated: a release (0.5.14), a wheel "
                         f"file, or a source tree (a checkout or its python/ folder) (default: "
                         f"{','.join(install.PINS)}; --pins is the old name)")
    ap.add_argument("--baseline", metavar="SPEC", type=_one_spec, default=None,
                    help="a PR-scoped review: also run this code (a release, wheel file or source tree, as "
                         "--sglang takes it) on the same grid and report only what the one --sglang SPEC changes "
                         "against it: new failures (exit 1), pre-existing ones (not failing), fixed rows, "
                         "results only the code under test has, and the unchanged count")
    ap.add_argument("--revert-fix", metavar="NAME", default=None,
                    help="run upstream with one of its registered fixes reverted (the PR numbers of "
                         "sglang/srt/debug_utils/pr_fix_toggle.py, e.g. 27360); with --baseline, on the code "
                         "under test only")
    ap.add_argument("--expect-bugs", metavar="LABEL:KEY[,...]", default=None,
                    help="strict expected failures: the known upstream bugs (refspec/conformance/known.py) each "
                         "target is expected to reproduce, e.g. 0.5.23:context-wall-page-table; the run then passes "
                         "only when each target fails on exactly those (a bug that disappears fails it too)")
    ap.add_argument("--report", metavar="FILE.md", default=None,
                    help="also write the failures as a Markdown review comment (rules, values, upstream lines)")
    ap.add_argument("--base-url", default=os.environ.get("REFSPEC_DOCS_URL", ""), metavar="URL",
                    help="put URL in front of the report's docs/spec links (default $REFSPEC_DOCS_URL, else this "
                         "repository's GitHub blob when its URL is known, else repo-relative)")
    ap.add_argument("--sweep", action="store_true",
                    help="run every release from 0.4.4.post2 to 0.5.23 and write the rule x release table "
                         "into docs/versions.md (slow: make sweep)")
    ap.add_argument("--page-sizes", "--page-size", type=int_list(1, "page sizes"), default=list(cases.PAGE_SIZES),
                    metavar="P[,P...]",
                    help=f"page sizes, comma-separated, from {','.join(map(str, cases.PAGE_SIZES))} (default: all)")
    modes = sorted(cases.MODES) + list(tree_cases.MODES) + list(mla_forward.MODES)
    ap.add_argument("--modes", "--mode", type=choice_list(modes, "modes"), default=None,
                    metavar="MODE[,MODE...]",
                    help=f"restrict the modes, comma-separated, from {', '.join(modes)} "
                         "(default: every mode the pin has; the tree_* modes are top-k > 1; the mla_* modes run "
                         "upstream's MLA forward path, docs/conformance.md#mla)")
    ap.add_argument("--mla-grid", choices=mla_forward.GRIDS, default="default",
                    help="the grid of the mla_* modes: default (P = 1, 4, 16, B = 3 in a graph of 4: what CI runs), "
                         "full (also P = 2, 64 and B = 5 in a graph of 8), off (no MLA rows)")
    ap.add_argument("--topks", "--topk", type=int_list(2, "top-k values"), default=list(tree_cases.TOPKS),
                    metavar="K[,K...]",
                    help=f"top-k values of the tree_* modes, comma-separated, from "
                         f"{','.join(map(str, tree_cases.TOPKS))} (default: all)")
    ap.add_argument("--variant", choices=sorted(variants.VARIANTS) + sorted(tree_variants.TREE_VARIANTS),
                    metavar="NAME", default=None,
                    help="switch a refspec bug variant on (negative control: the run must fail)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print every group and finding, every documented difference with both values, and "
                         "the documented-differences table")
    ap.add_argument("--root", default=None, help="install directory (default: <repo>/.conformance)")
    ns = ap.parse_args(argv)
    sizes = sorted(set(cases.PAGE_SIZES) | set(tree_cases.PAGE_SIZES))
    bad = [p for p in ns.page_sizes if p not in sizes]
    if bad:
        ap.error(f"argument --page-sizes: {bad} not among the compared page sizes {','.join(map(str, sizes))}")
    bad = [k for k in ns.topks if k not in tree_cases.TOPKS]
    if bad:
        ap.error(f"argument --topks: {bad} not among the compared top-k values {','.join(map(str, tree_cases.TOPKS))}")
    expect = None
    if ns.expect_bugs is not None:
        try:
            expect = conformance.parse_expected(ns.expect_bugs)
        except (ValueError, KeyError) as e:
            ap.error(f"argument --expect-bugs: {str(e).strip(chr(39))}")
    if ns.baseline is not None:
        if ns.expect_bugs is not None:
            ap.error("argument --expect-bugs: not with --baseline (the baseline sets pre-existing failures apart)")
        if ns.sweep:
            ap.error("argument --baseline: not with --sweep (the sweep runs every release)")
        if ns.sglang is None or len(ns.sglang) != 1:
            got = "none" if ns.sglang is None else f"{len(ns.sglang)}: {','.join(ns.sglang)}"
            ap.error(f"argument --baseline: needs exactly one --sglang SPEC, the code under test (got {got}); "
                     f"e.g. --baseline 0.5.23 --sglang ~/src/sglang")
    if ns.sglang is None:
        ns.sglang = list(install.PINS)
    if ns.report:
        _check_report(ns.report)
    if ns.sweep:
        from refspec.conformance import sweep

        return sweep.main(root=ns.root, argv=argv)
    if ns.baseline is not None:
        return _review(ns, argv)
    try:
        out = conformance.run(ns.sglang, ns.page_sizes, ns.modes, ns.variant, ns.root, topks=tuple(ns.topks),
                              revert_fix=ns.revert_fix, mla_grid=ns.mla_grid)
    except (install.UnsupportedSpec, conformance.NoCases) as e:
        raise CLIError(str(e)) from None
    print(conformance.render(out, ns.verbose, expect))
    if ns.report:
        with open(os.path.expanduser(ns.report), "w") as f:
            f.write(report.markdown(out, " ".join(["python -m refspec conformance", *argv]), ns.base_url) + "\n")
        print(f"wrote {ns.report}")
    sys.stdout.flush()
    return conformance.verdict(out, expect)[0]


def _review(ns, argv) -> int:
    """``--baseline SPEC``: what the one ``--sglang`` SPEC changes against it; exit 1 on a new failure."""
    from refspec.conformance import install, report, run as conformance

    try:
        rev = conformance.review(ns.baseline, ns.sglang[0], ns.page_sizes, ns.modes, ns.variant, ns.root,
                                 topks=tuple(ns.topks), revert_fix=ns.revert_fix, mla_grid=ns.mla_grid)
    except (install.UnsupportedSpec, conformance.NoCases) as e:
        raise CLIError(str(e)) from None
    print(conformance.render_review(rev, ns.verbose))
    if ns.report:
        with open(os.path.expanduser(ns.report), "w") as f:
            f.write(report.review_markdown(rev, " ".join(["python -m refspec conformance", *argv]), ns.base_url)
                    + "\n")
        print(f"wrote {ns.report}")
    sys.stdout.flush()
    return rev.exit_code


def _check_report(path: str) -> None:
    """Before anything runs: ``--report PATH`` must be a file that can be written (CLIError naming it)."""
    full = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise CLIError(f"--report {path}: is a directory, not a file")
    if not os.path.isdir(folder):
        raise CLIError(f"--report {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        raise CLIError(f"--report {path}: not writable")


def _one_spec(text: str) -> str:
    """``--baseline``: one SPEC (a path with a comma is not supported)."""
    items = _specs(text)
    if len(items) != 1:
        raise argparse.ArgumentTypeError(f"{text!r} names {len(items)} SPECs; the baseline is one SPEC")
    return items[0]


def _specs(text: str) -> list[str]:
    """``--sglang`` items: comma-separated, none empty (a path with a comma is not supported)."""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"empty item in {text!r} (comma-separated SPECs)")
    return items
