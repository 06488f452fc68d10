"""``python -m refspec replay TRACE.json [--device cuda] [--out SUMMARY.md]``: replay a recorded
schedule through the production path (FA3 wing, CUDA graphs on) and the oracle loop.

The command line of :mod:`refspec.traces.replay` (a chain trace: what a run checks, and why the
schedule replays on a random-init model) and :mod:`refspec.traces.replay_tree` (a tree trace,
top-k > 1, detected by its format and replayed round by round at the attention level).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from refspec.cli._args import (PROG, ArgumentParser, CLIError, choice_list, device_name, draft_spec, int_list,
                               positive_int, run)
from refspec.real.run import set_threads
from refspec.traces.chain import is_tree_trace, load_trace
from refspec.traces.replay import DTYPES, TINY, replay_trace

def main(argv: list[str] | None = None) -> int:
    """Replay a trace; 0 if every run matches it, 1 on a mismatch, 2 on a usage error (one line)."""
    return run(_main, argv, f"{PROG} replay")


def _main(argv) -> int:
    ap = ArgumentParser(
        prog=f"{PROG} replay",
        description="Replay a recorded schedule through the production path (FA3, graphs on) and the "
                    "oracle loop; exit 1 on any mismatch.")
    ap.add_argument("trace", type=Path, help="a trace written by 'python -m refspec record' (JSON)")
    ap.add_argument("--device", type=device_name, default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--versions", type=choice_list(["v1", "v2"], "versions"), metavar="V[,V...]",
                    help="comma-separated, e.g. v1,v2 (default: the trace's version)")
    ap.add_argument("--page-sizes", type=int_list(1, "page sizes"), metavar="P[,P...]",
                    help="comma-separated, e.g. 1,4,16 (default: the trace's page size)")
    ap.add_argument("--seed", type=int, metavar="N", default=0, help="random-init seed of the target (default 0)")
    ap.add_argument("--num-layers", type=positive_int(), metavar="N", help="override the depth (quick CPU checks)")
    ap.add_argument("--tiny", action="store_true",
                    help="2 layers, hidden 64, same vocabulary, draft early-exit:1: a quick CPU check")
    ap.add_argument("--draft", type=draft_spec, metavar="SPEC",
                    help="override the draft, e.g. early-exit:1 with --num-layers 2 (default: the trace's)")
    ap.add_argument("--drafter", choices=["perfect", "model"], default="perfect",
                    help="where draft tokens come from: perfect (default: the target's own greedy "
                         "continuation, so the output stays greedy) or model (the draft's argmax; float32 only)")
    ap.add_argument("--out", type=Path, help="also write the summary as Markdown to this file")
    ap.add_argument("--threads", type=positive_int(), metavar="N", help="torch CPU threads (default 1)")
    ap.add_argument("--no-progress", action="store_true",
                    help="no 'replaying ...' progress lines on stderr (e.g. in logs)")
    ns = ap.parse_args(argv)
    dtype = DTYPES[ns.dtype or ("bfloat16" if ns.device == "cuda" else "float32")]
    if ns.drafter == "model" and dtype != torch.float32:
        raise CLIError(f"--drafter model needs --dtype float32 (got {ns.dtype or 'the cuda default bfloat16'}): "
                       f"its output is not greedy, so the low-precision check has no baseline")
    try:
        trace = load_trace(ns.trace)
    except FileNotFoundError:
        raise CLIError(f"trace file {ns.trace} not found (write one with 'python -m refspec record --out "
                       f"{ns.trace}', or use benchmarks/traces/mtbench_smollm2.json)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read trace file {ns.trace}: {e}") from e
    except ValueError as e:
        raise CLIError(f"{e} (is it a file written by 'python -m refspec record'?)") from e
    if ns.out and ns.out.is_dir():
        raise CLIError(f"--out {ns.out} is a folder; give a file name, e.g. {ns.out / 'replay.md'}")
    set_threads(ns.threads)
    t = time.perf_counter()
    if is_tree_trace(trace):
        report = _replay_tree(trace, ns, dtype)
    else:
        report = _replay_chain(trace, ns, dtype)
    md = report.to_markdown()
    print(md)
    print(f"replay took {time.perf_counter() - t:.1f} s", file=sys.stderr)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(md, encoding="utf-8")
    return 0 if report.ok else 1


def _progress(ns):
    """The ``progress(label)`` callback: one ``replaying ...`` line on stderr, none with ``--no-progress``."""
    return None if ns.no_progress else (lambda s: print(f"replaying {s} ...", file=sys.stderr, flush=True))


def _replay_chain(trace, ns, dtype):
    overrides = {**(TINY if ns.tiny else {}), **({"num_hidden_layers": ns.num_layers} if ns.num_layers else {})}
    draft = ns.draft or ("early-exit:1" if overrides else None)
    return replay_trace(trace, device=ns.device, dtype=dtype, versions=ns.versions,
                        page_sizes=ns.page_sizes, seed=ns.seed, overrides=overrides or None,
                        draft=draft, drafter=ns.drafter, trace_path=str(ns.trace),
                        progress=_progress(ns))


def _replay_tree(trace: dict, ns, dtype):
    """``python -m refspec replay`` on a tree trace: refuse the chain-only flags (CLIError), then replay."""
    given = [f"--{k.replace('_', '-')}" for k in ("versions", "page_sizes", "draft", "num_layers")
             if getattr(ns, k) is not None] + (["--tiny"] if ns.tiny else []) + \
        (["--drafter"] if ns.drafter != "perfect" else [])
    if given:
        raise CLIError(f"{', '.join(given)}: not for a tree trace (its rounds are replayed at the recorded KV layout, "
                       f"P = {trace['config']['page_size']}, with its recorded trees)")
    from refspec.traces.replay_tree import replay_tree_trace

    return replay_tree_trace(trace, device=ns.device, dtype=dtype, seed=ns.seed, trace_path=str(ns.trace),
                             progress=_progress(ns))
