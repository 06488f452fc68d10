"""``python -m refspec check``: the oracle-vs-FA3 matrix, one table, non-zero exit on any failure.

Sections (``SECTIONS``: name -> ``fn(device, page_sizes, quick)`` yielding row dicts; a new
section is one more entry):

* ``contract``: direct kernel probes per provider and page size (docs/fa3-contract.md): the horizon probe
  (q = 0, V = position: row i returns (h - 1) / 2, h = its visible-key count), rows with no
  visible key are exactly 0 (PA-005), page-table columns past ``ceil(K / P)`` are never read
  (PA-007: filling them with 2e9 changes nothing, bitwise).
* ``eager``: every mode (:data:`MODES`) through :class:`~refspec.harness.scenario.Scenario`: the eager
  FA3 path vs the fp32 oracle, tier T1 (TOL-002), worst case over dtypes and GQA 1 / 4 / 8.
* ``graph``: every graphed mode through ``Built.run_fa3_graph`` with a live batch of 3 replayed
  in the captured size 4 (padded): graph == eager (T0, TOL-001; on CUDA T1, since the real kernel
  may choose another split-KV at the padded size, docs/kernel-facts.md) and graph vs oracle (T1).
* ``loops``: the speculative loop end to end (:mod:`refspec.cli._check_loops`): lossless yes / no
  per version x page size x eager / graphs.
* ``tree``: top-k > 1 (:mod:`refspec.cli._check_tree`): tree verify and draft decode, eager and
  graphed, k x P in 1, 4, 16, 64, and the tree loop (lossless, equal to the oracle tree loop).
* ``mla``: MLA, DeepSeek's latent attention (:mod:`refspec.cli._check_mla`, docs/mla.md): every
  mode eager and the graphed ones replayed, top-k 1 and 2, P in 1, 4, 16, 64, the FA3 wing's MLA
  branch against the MLA oracle; on CUDA the real kernel's rows skip with the ML-013 refusal where
  the FA3 build lacks the hdim 64 / 512 kernel.

Each row: section, mode, page size P, provider, check, result (pass / FAIL / skip) and the worst
error, as % of the T1 budget, or "bitwise" / the max difference for T0; a legend saying so
(:data:`LEGEND`, :func:`format_legend`) is printed once, above the table.  On CPU the provider is
the emulator; on CUDA the eager and contract sections run the emulator and the real kernel, the
graph section only the real kernel (the emulator syncs with the host, which a CUDA graph forbids).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import torch

from refspec.cli._args import PROG, ArgumentParser, choice_list, device_name, int_list, run
from refspec.fa3 import kernel
from refspec.harness.modes import MODES, mode_scenarios
from refspec.core.tolerance import T1_FLOOR, Verdict, t0, t1

GRAPHED = ["DECODE", "DRAFT_DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2"]
PAGE_SIZES = {"cpu": [1, 2, 3, 4, 16, 64, 128], "cuda": [1, 2, 3, 4, 16, 64, 128, 256]}
QUICK_PAGE_SIZES = [1, 3, 16]
#: rows of ``check --quick`` on a CPU (all sections), as its help says (tests/test_check_cli.py counts them)
QUICK_CHECKS = 159


# ---------------------------------------------------------------------------- helpers
def providers(device: str) -> list[str]:
    """The emulator, plus the real kernel when ``device`` is a CUDA device where one works."""
    real = kernel.select_provider(torch.device(device))
    return ["emulator"] + ([real] if real != "emulator" else [])


def configs(device: str, quick: bool):
    """(dtype, num_kv_heads) pairs with 8 query heads: GQA 1 / 4 / 8 in two dtypes."""
    dtypes = [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.bfloat16]
    if quick:
        return [(dtypes[-1], 2)]
    return [(dt, hkv) for dt in dtypes for hkv in (8, 2, 1)]


def _row(section, mode, P, provider, check, verdicts=(), error=None, skip=None):
    """Fold verdicts (worst first) into a table row."""
    if not (skip or error or verdicts):
        error = "no result"
    if skip or error:
        text = skip or error
        return dict(section=section, mode=mode, P=P, provider=provider, check=check,
                    result="skip" if skip else "FAIL", worst=text if len(text) <= 160 else text[:157] + "...")
    worst = max(verdicts, key=lambda v: (not v.ok, v.pct if v.budget > 0 else v.err))
    ok = all(v.ok for v in verdicts)
    if worst.budget == 0:
        text = "bitwise" if worst.ok else f"max|diff| {worst.err:.3g}"
    elif worst.err == float("inf"):
        text = "non-finite output (NaN / inf)"
    else:
        text = f"{worst.pct:.1f}% of budget"
    return dict(section=section, mode=mode, P=P, provider=provider, check=check,
                result="pass" if ok else "FAIL", worst=text)


def _guard(make):
    """``make()``'s result, or the exception it raised (the caller turns that into a FAIL row)."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - a check that raises is a failed check
        return e


# ---------------------------------------------------------------------------- contract
def _probe(P, reqs, dtype, device, slack_fill=None):
    """q = 0, V = key position, shuffled pages; V is NaN everywhere else (pages outside the
    table, slots past K_b, page 0), and slack columns point at a NaN page (or ``slack_fill``).

    Shapes: q ``[T, 2, 64]``, caches ``[NP, P, 1, 64]`` (GQA 2).  Returns (kernel args without
    provider, expected ``[T]`` row values, empty-row mask ``[T]``).
    """
    g = torch.Generator().manual_seed(P)
    need = [-(-K // P) for _, K in reqs]
    NP = sum(need) + 2
    ids = (torch.randperm(NP - 1, generator=g) + 1).tolist()
    poison, W = ids.pop(), max(need) + 1
    k = torch.randn(NP, P, 1, 64, generator=g).to(dtype).to(device)
    v = torch.full((NP, P, 1, 64), float("nan"), dtype=dtype, device=device)
    table = torch.full((len(reqs), W), poison if slack_fill is None else slack_fill, dtype=torch.int32)
    expected, empty = [], []
    for b, (Q, K) in enumerate(reqs):
        pg, ids = ids[:need[b]], ids[need[b]:]
        table[b, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
        for p in range(K):
            v[pg[p // P], p % P] = p
        for i in range(Q):
            h = K - Q + i + 1
            expected.append((h - 1) / 2 if h > 0 else 0.0)
            empty.append(h <= 0)
    cu = torch.tensor([0] + [sum(Q for Q, _ in reqs[:b + 1]) for b in range(len(reqs))], dtype=torch.int32)
    args = dict(q=torch.zeros(int(cu[-1]), 2, 64, dtype=dtype, device=device), k_cache=k, v_cache=v,
                cache_seqlens=torch.tensor([K for _, K in reqs], dtype=torch.int32, device=device),
                page_table=table.to(device), cu_seqlens_q=cu.to(device), max_seqlen_q=max(Q for Q, _ in reqs))
    return args, torch.tensor(expected), torch.tensor(empty)


def contract_rows(device, page_sizes, quick):
    """Kernel probes per provider x page size (module doc)."""
    dtype = torch.float16 if device == "cuda" else torch.float32  # positions stay exact
    for P in page_sizes:
        reqs = [(4, 2 * P + 1), (1, P), (5, 2), (2, P + 1)]
        for prov in providers(device):
            def horizon():
                args, exp, empty = _probe(P, reqs, dtype, device)
                out = kernel.flash_attn_with_kvcache(**args, provider=prov)[:, :, 0].float().cpu()
                # the T1 floor, relative to the largest expected value (positions up to ~2P)
                budget = T1_FLOOR[dtype] * max(1.0, float(exp.max()))
                err = float((out - exp[:, None]).abs().max()) if torch.isfinite(out).all() else float("inf")
                v = Verdict(err <= budget, err, budget)
                zero = t0(out[empty], torch.zeros_like(out[empty]))
                return [_row("contract", "horizon (h-1)/2", P, prov, "T1 vs exact", [v]),
                        _row("contract", "empty rows", P, prov, "exactly 0 (PA-005)", [zero])]

            def slack():
                a, _, _ = _probe(P, reqs, dtype, device)
                b, _, _ = _probe(P, reqs, dtype, device, slack_fill=2_000_000_000)
                oa = kernel.flash_attn_with_kvcache(**a, provider=prov)
                ob = kernel.flash_attn_with_kvcache(**b, provider=prov)
                return [_row("contract", "slack columns", P, prov, "unread (PA-007, T0)", [t0(ob, oa)])]

            for name, fn in (("horizon (h-1)/2", horizon), ("slack columns", slack)):
                got = _guard(fn)
                yield from (got if isinstance(got, list) else
                            [_row("contract", name, P, prov, "kernel call", error=f"{type(got).__name__}: {got}")])


# ---------------------------------------------------------------------------- eager / graph
def _scenarios(P, device, quick, labels):
    D = 64 if device == "cuda" else 32
    for dt, hkv in configs(device, quick):
        sc = mode_scenarios(P, dtype=dt, num_heads=8, num_kv_heads=hkv, head_dim=D, device=device)
        yield {k: sc[k] for k in labels}


def eager_rows(device, page_sizes, quick):
    """Every mode: eager FA3 vs the fp32 oracle, T1, worst over dtypes x GQA."""
    for P in page_sizes:
        for prov in providers(device):
            verdicts = {m: [] for m in MODES}
            errors = {}
            for scs in _scenarios(P, device, quick, list(MODES)):
                for label, sc in scs.items():
                    got = _guard(lambda: _eager_verdict(sc, prov))
                    if isinstance(got, Exception):
                        errors.setdefault(label, f"{type(got).__name__}: {got}")
                    else:
                        verdicts[label].append(got)
            for label in MODES:
                yield _row("eager", label, P, prov, "T1 vs oracle", verdicts[label], error=errors.get(label))


def _eager_verdict(sc, prov):
    built = sc.build()
    ref, low = built.run_oracle(), built.run_oracle(upcast=False)
    return t1(built.run_fa3(provider=prov), ref, low)


def graph_rows(device, page_sizes, quick):
    """Graphed modes: 3 live requests replayed in the captured size 4; T0 vs eager, T1 vs oracle."""
    provs = [p for p in providers(device) if not (device == "cuda" and p == "emulator")]
    if not provs:
        for label in GRAPHED:
            yield _row("graph", label, "-", "-", "graph", skip="no real kernel for CUDA graphs here")
        return
    for P in page_sizes:
        for prov in provs:
            v0 = {m: [] for m in GRAPHED}
            v1 = {m: [] for m in GRAPHED}
            errors = {}
            for scs in _scenarios(P, device, quick, GRAPHED):
                for label, sc in scs.items():
                    got = _guard(lambda: _graph_verdicts(sc, prov))
                    if isinstance(got, Exception):
                        errors.setdefault(label, f"{type(got).__name__}: {got}")
                    else:
                        v0[label].append(got[0])
                        v1[label].append(got[1])
            for label in GRAPHED:
                yield _row("graph", label, P, prov, "T0 graph == eager", v0[label], error=errors.get(label))
                yield _row("graph", label, P, prov, "T1 graph vs oracle", v1[label], error=errors.get(label))


def _graph_verdicts(sc, prov):
    built = sc.build()
    assert built.fb.batch_size == 3
    ref, low = built.run_oracle(), built.run_oracle(upcast=False)
    eager = built.run_fa3(provider=prov)
    runner = built.graph_runner(capture_bs=(2, 4), provider=prov)
    graph = built.run_fa3_graph(runner)
    assert runner.graph_bs(3) == 4  # the live batch of 3 runs padded
    if graph.is_cuda:  # the real kernel may split KV differently at Bg = 4 and table width M (CG-009)
        return t1(graph, eager.float(), low), t1(graph, ref, low)
    return t0(graph, eager), t1(graph, ref, low)


def loops_rows(device, page_sizes, quick):
    """The whole speculative loop, oracle vs production (:mod:`refspec.cli._check_loops`)."""
    from refspec.cli._check_loops import loop_rows

    yield from loop_rows(device, page_sizes, quick)


def tree_rows(device, page_sizes, quick):
    """Top-k > 1: tree verify / draft decode, eager and graphed, and the tree loop (:mod:`refspec.cli._check_tree`)."""
    from refspec.cli._check_tree import tree_rows as rows

    yield from rows(device, page_sizes, quick, row=_row, guard=_guard, providers=providers)


def mla_rows(device, page_sizes, quick):
    """MLA: every mode, graphs, top-k 1 and 2, against the MLA oracle (:mod:`refspec.cli._check_mla`)."""
    from refspec.cli._check_mla import mla_rows as rows

    yield from rows(device, page_sizes, quick, row=_row, guard=_guard, providers=providers)


SECTIONS = {"contract": contract_rows, "eager": eager_rows, "graph": graph_rows, "loops": loops_rows,
            "tree": tree_rows, "mla": mla_rows}


# ---------------------------------------------------------------------------- table
#: what a section's rows check, for the legend printed above the table (one entry per section)
LEGEND = {
    "contract": "the FA3 kernel contract, probed directly (docs/fa3-contract.md). horizon (h-1)/2: q = 0 and\n"
                "            V = key position, so a row that sees exactly its h keys 0..h-1 (the bottom-right rule\n"
                "            PA-004, through the page table PA-002) returns their mean (h-1)/2. empty rows: a row\n"
                "            with no visible key is exactly 0 (PA-005). slack columns: page-table columns past\n"
                "            ceil(K_b / P) point at a NaN page, then at page 2e9: the output is bitwise the same\n"
                "            (never read, PA-007)",
    "eager": "every forward mode: the FA3 wing vs the fp32 oracle, eager",
    "graph": "the graphed modes: 3 live requests replayed in a graph captured for 4 (one padded row)",
    "loops": "the speculative loop end to end: its tokens == plain greedy == the oracle loop",
    "tree": "top-k > 1: tree verify and draft decode (eager, graphed) and the whole tree loop",
    "mla": "MLA (docs/mla.md): the FA3 wing's MLA branch (the qv call on the two strided views of the\n"
           "            latent pool) vs the MLA oracle: every mode (EXTEND: the non-absorbed prefill, ML-010),\n"
           "            the graphed modes replayed padded (slot 0 never written, ML-002), top-k 2 (ML-011);\n"
           "            P 1, 4, 16, 64 (--quick: 1, 16)",
}


def format_legend(sections) -> str:
    """How to read the table: each run section's rows, the mode and worst columns (printed once, above it)."""
    lines = ["How to read the table (one row per check; exit status 1 on any FAIL):"]
    lines += [f"  {name + ':':<9} {LEGEND[name]}" for name in sections]
    lines += ["  P:        page size; provider: the FA3 contract emulator (PyTorch) or the real kernel (Hopper)",
              "  worst:    the row's worst case (in eager / graph: over dtypes and GQA groupings). N% of budget: the\n"
              "            largest error as a share of the T1 budget (TOL-002: twice the oracle's own low-precision\n"
              "            error, plus a floor per dtype); a row passes up to 100%.\n"
              "            bitwise: exactly equal (T0, TOL-001)."]
    return "\n".join(lines)


COLUMNS = [("section", 9), ("mode", 16), ("P", 4), ("provider", 10), ("check", 20), ("result", 6), ("worst", 0)]


def format_header() -> str:
    """The table's column names and rule (two lines)."""
    return "  ".join(f"{name:<{w}}" if w else name for name, w in COLUMNS) + "\n" + "-" * 100


def format_row(r: dict) -> str:
    """One row of the table (one line)."""
    return "  ".join(f"{str(r[name]):<{w}}" if w else str(r[name]) for name, w in COLUMNS)


def format_summary(rows) -> str:
    """``N checks: a pass, b FAIL, c skip``."""
    n = {k: sum(r["result"] == k for r in rows) for k in ("pass", "FAIL", "skip")}
    return f"{len(rows)} checks: {n['pass']} pass, {n['FAIL']} FAIL, {n['skip']} skip"


def format_table(rows) -> str:
    """The rows as a fixed-width table with a pass / FAIL / skip count at the end."""
    return "\n".join([format_header()] + [format_row(r) for r in rows] + [format_summary(rows)])


def main(argv=None) -> int:
    """Run the sections, print the table; 0 if nothing failed, 1 on any FAIL, 2 on a usage error."""
    return run(_main, argv, f"{PROG} check")


def _main(argv) -> int:
    ap = ArgumentParser(prog=f"{PROG} check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=device_name, default="cpu",
                    help="cpu (default: the emulator) or cuda (the emulator and the real FA3 kernel)")
    ap.add_argument("--quick", action="store_true",
                    help=f"page sizes {','.join(map(str, QUICK_PAGE_SIZES))} (MLA's 1,16), one dtype, GQA 4: "
                         f"{QUICK_CHECKS} checks "
                         "(measured on a shared 2-core CPU machine: 387 s wall, 155 s of CPU, "
                         "benchmarks/results/cpu_learner_times.md)")
    ap.add_argument("--page-sizes", type=int_list(1, "page sizes"), metavar="P[,P...]",
                    help="page sizes to test, comma-separated, e.g. 1,4,16 (default: "
                         f"{','.join(map(str, PAGE_SIZES['cpu']))} on cpu, "
                         f"{','.join(map(str, PAGE_SIZES['cuda']))} on cuda; the tree and mla sections keep "
                         "their own 1,4,16,64, or 1,16 with --quick)")
    ap.add_argument("--sections", type=choice_list(list(SECTIONS), "sections"), default=list(SECTIONS),
                    metavar="NAME[,NAME...]",
                    help=f"which parts to run, comma-separated, from {','.join(SECTIONS)} (default: all)")
    ns = ap.parse_args(argv)
    page_sizes = ns.page_sizes or (QUICK_PAGE_SIZES if ns.quick else PAGE_SIZES[ns.device])
    # row by row, flushed: a CI log (stdout piped) shows progress as the checks run
    print(format_legend(ns.sections) + "\n", flush=True)
    print(format_header(), flush=True)
    rows = []
    for name in ns.sections:
        for row in SECTIONS[name](ns.device, page_sizes, ns.quick):
            rows.append(row)
            print(format_row(row), flush=True)
    print(format_summary(rows), flush=True)
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0
