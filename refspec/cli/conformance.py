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
both run on the same grid and only what changed is reported (new failures, a failing row broken
by a new (rule, field) included: exit 1; adapter gaps under test: 3; pre-existing ones, fixes and
partial fixes, results only the code under test has, what is newly checked, the unchanged count).
Every argument is checked before torch loads; with several targets each compares its own subset
of ``--modes`` (``--modes mla``: every MLA mode the code has).  See docs/conformance.md.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import urllib.parse

from refspec.cli._args import PROG, ArgumentParser, CLIError, choice_list, int_list, run


def main(argv: list[str] | None = None) -> int:
    """Compare; 0 if no rule is broken on reachable inputs, 1 if one is (a known upstream bug
    included), 3 on an adapter gap alone, 2 on a usage error."""
    return run(_main, argv, f"{PROG} conformance")


def _main(argv) -> int:
    # light imports only (no torch): every argument is checked before the case builders load (seconds)
    from refspec.conformance import install, names

    ap = ArgumentParser(prog=f"{PROG} conformance", description=__doc__.splitlines()[0])
    ap.add_argument("--sglang", "--pins", "--pin", dest="sglang", type=_specs, default=None,
                    metavar="SPEC[,SPEC...]",
                    help=f"the SGLang code to compare against, comma-separated: a release (0.5.14), a wheel "
                         f"file, or a source tree (a checkout or its python/ folder) (default: "
                         f"{','.join(install.PINS)}; --pins is the old name)")
    ap.add_argument("--baseline", metavar="SPEC", type=_one_spec, default=None,
                    help="a PR-scoped review: also run this code (a release, wheel file or source tree, as "
                         "--sglang takes it) on the same grid and report only what the one --sglang SPEC changes "
                         "against it: new failures (exit 1), pre-existing ones (not failing), fixed and partly "
                         "fixed rows, results only the code under test has, and the unchanged count")
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
    ap.add_argument("--base-url", default=None, metavar="URL",
                    help="put URL (http:// or https://) in front of the report's docs/spec links (default "
                         "$REFSPEC_DOCS_URL, else this repository's GitHub blob when its URL is known, else "
                         "repo-relative)")
    ap.add_argument("--sweep", action="store_true",
                    help="run every release from 0.4.4.post2 to 0.5.23 and write the rule x release table "
                         "into docs/versions.md (slow: make sweep)")
    ap.add_argument("--page-sizes", "--page-size", type=int_list(1, "page sizes"), default=list(names.PAGE_SIZES),
                    metavar="P[,P...]",
                    help=f"page sizes, comma-separated, from {','.join(map(str, names.PAGE_SIZES))} (default: all)")
    ap.add_argument("--modes", "--mode", type=choice_list([*names.MODES, *names.GROUPS], "modes"), default=None,
                    metavar="MODE[,MODE...]",
                    help=f"restrict the modes, comma-separated, from {', '.join(names.MODES)}, or the group "
                         f"{', '.join(names.GROUPS)} (its modes the code has) "
                         "(default: every mode the pin has; the tree_* modes are top-k > 1; the mla_* modes run "
                         "upstream's MLA forward path, docs/conformance.md#mla); with several --sglang targets "
                         "each compares those it has (the others are named as skipped)")
    ap.add_argument("--mla-grid", choices=names.MLA_GRIDS, default="default",
                    help="the grid of the mla_* modes: default (P = 1, 4, 16, B = 3 in a graph of 4: what CI runs), "
                         "full (also P = 2, 64 and B = 5 in a graph of 8), off (no MLA rows)")
    ap.add_argument("--topks", "--topk", type=int_list(2, "top-k values"), default=list(names.TOPKS),
                    metavar="K[,K...]",
                    help=f"top-k values of the tree_* modes, comma-separated, from "
                         f"{','.join(map(str, names.TOPKS))} (default: all)")
    ap.add_argument("--variant", metavar="NAME", default=None,
                    help="switch a refspec bug variant on (negative control: the run must fail); the variants: "
                         "docs/bug-zoo.md")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print every group and finding, every documented difference with both values, and "
                         "the documented-differences table")
    ap.add_argument("--root", default=None,
                    help="install directory (default: <repo>/.conformance; when that is a symlink to another "
                         "folder, a release not installed there yet needs --root)")
    ns = ap.parse_args(argv)
    bad = [p for p in ns.page_sizes if p not in names.PAGE_SIZES]
    if bad:
        ap.error(f"argument --page-sizes: {bad} not among the compared page sizes "
                 f"{','.join(map(str, names.PAGE_SIZES))}")
    bad = [k for k in ns.topks if k not in names.TOPKS]
    if bad:
        ap.error(f"argument --topks: {bad} not among the compared top-k values {','.join(map(str, names.TOPKS))}")
    if ns.expect_bugs is not None:
        try:
            names.parse_expected(ns.expect_bugs)  # the form here; the keys below (known.py loads torch)
        except ValueError as e:
            ap.error(f"argument --expect-bugs: {e}")
    ns.base_url = _base_url(ns.base_url)
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
    if ns.variant is not None:  # (refspec.mutants loads torch: only when a variant is asked for)
        from refspec.mutants import variants

        if ns.variant not in variants.VARIANTS:
            ap.error(f"argument --variant: unknown variant {ns.variant!r}; choose from "
                     f"{', '.join(sorted(variants.VARIANTS))}")
    from refspec.conformance import run as conformance

    expect = None
    if ns.expect_bugs is not None:
        try:
            expect = conformance.parse_expected(ns.expect_bugs)
        except ValueError as e:
            ap.error(f"argument --expect-bugs: {e}")
    if ns.sweep:
        from refspec.conformance import sweep

        return sweep.main(root=ns.root, argv=argv)
    if ns.baseline is not None:
        return _review(ns, argv)
    from refspec.conformance import report

    try:
        out = conformance.run(ns.sglang, ns.page_sizes, ns.modes, ns.variant, ns.root, topks=tuple(ns.topks),
                              revert_fix=ns.revert_fix, mla_grid=ns.mla_grid)
    except (install.UnsupportedSpec, conformance.NoCases) as e:
        raise CLIError(str(e)) from None
    print(conformance.render(out, ns.verbose, expect))
    if ns.report:
        with open(os.path.expanduser(ns.report), "w") as f:
            f.write(report.markdown(out, command(argv), ns.base_url) + "\n")
        print(f"wrote {ns.report}")
    sys.stdout.flush()
    return conformance.verdict(out, expect)[0]


def command(argv) -> str:
    """The command line a report echoes, quoted as a shell reads it back (``shlex.join``)."""
    return shlex.join(["python", "-m", "refspec", "conformance", *argv])


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
            f.write(report.review_markdown(rev, command(argv), ns.base_url) + "\n")
        print(f"wrote {ns.report}")
    sys.stdout.flush()
    return rev.exit_code


def _base_url(given: str | None) -> str:
    """``--base-url`` (else ``$REFSPEC_DOCS_URL``, else ''): an ``http://`` / ``https://`` URL with a
    host and no spaces, or '' (CLIError naming the option or the variable)."""
    where, url = ("--base-url", given) if given is not None else \
        ("$REFSPEC_DOCS_URL", os.environ.get("REFSPEC_DOCS_URL", ""))
    if not url:
        return ""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or any(c.isspace() for c in url):
        raise CLIError(f"{where} {url!r}: not an http(s) URL (e.g. https://example.org/refspec/blob/main)")
    return url


def _check_report(path: str) -> None:
    """Before anything runs: ``--report PATH`` must be a file that can be written (CLIError naming it).

    Tried, not guessed from permission bits (root passes ``os.access`` on ``/proc``): an existing
    file is opened for appending (its text kept until the run writes it), a new one is created and
    removed again."""
    full = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise CLIError(f"--report {path}: is a directory, not a file")
    if not os.path.isdir(folder):
        raise CLIError(f"--report {path}: directory {folder} does not exist")
    existed = os.path.exists(full)
    try:
        with open(full, "a" if existed else "x"):
            pass
    except OSError as e:
        raise CLIError(f"--report {path}: cannot be written ({e.strerror or type(e).__name__})") from None
    if not existed:
        os.remove(full)


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
