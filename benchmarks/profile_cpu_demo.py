"""Profile one run of the CPU ``make demo`` workload (behind benchmarks/results/cpu_demo_profile.md).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_cpu_demo.py PHASE [--profile OUT.prof]

PHASE is one row of the demo's table, run exactly as ``refspec.cli.demo.run_matrix`` runs it (4
MT-Bench questions, budgets 40,32,24,16, EOS, draft early-exit:25, Sd = 3, one torch thread):
``greedy``, ``oracle-v1``, ``oracle-v2``, ``prod-v1-1``, ``prod-v2-1``, ``prod-v1-4``, ``prod-v2-4``
(production: FA3 wing, emulated graphs, validation on, ``audit_kv`` after every round), or
``load`` (the weights and the tokenizer).  Prints wall and CPU seconds (CPU time is what to
compare on a shared machine: wall time there mostly measures the other processes) and, with
``--profile``, cProfile (CPU-time clock) totals by function.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

PHASES = ("load", "greedy", "oracle-v1", "oracle-v2", "prod-v1-1", "prod-v2-1", "prod-v1-4", "prod-v2-4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=PHASES)
    ap.add_argument("--profile", metavar="OUT.prof", help="run under cProfile (CPU clock) and dump the stats")
    ns = ap.parse_args()
    from refspec.oracle.loop import greedy
    from refspec.real import EOS_ID, chat_ids
    from refspec.real.run import (DEFAULT_DRAFT, DEFAULT_NUM_STEPS, budgets, capture_sizes, load_target,
                                  pick_questions, set_threads)
    from refspec.speculative import generate
    from refspec.audits.kv import audit_kv

    set_threads(None)
    qs, max_new = pick_questions(4), budgets(4, "40,32,24,16")
    if ns.phase != "load":
        model, _ = load_target()
        prompts = [chat_ids(q["prompt"]) for q in qs]
    kw = dict(draft=DEFAULT_DRAFT, num_steps=DEFAULT_NUM_STEPS, max_new_tokens=max_new, eos=EOS_ID)
    audits = [0]

    def observer(event, eng, **info):  # the demo's observer, less the progress bar
        if event == "round_end":
            audit_kv(eng)
            audits[0] += 1

    def run() -> int:
        if ns.phase == "load":
            load_target()
            return sum(len(chat_ids(q["prompt"])) for q in qs)
        if ns.phase == "greedy":
            return sum(len(greedy(model, p, m, EOS_ID).tokens) for p, m in zip(prompts, max_new))
        if ns.phase.startswith("oracle"):
            v = ns.phase.split("-")[1]
            return sum(len(generate(model, [p], backend="oracle", version=v, **{**kw, "max_new_tokens": [m]})
                           .tokens[0]) for p, m in zip(prompts, max_new))
        _, v, P = ns.phase.split("-")
        res = generate(model, prompts, backend="fa3", version=v, page_size=int(P), graphs=True, observer=observer,
                       capture_bs=capture_sizes(len(prompts)), **kw)
        return sum(map(len, res.tokens))

    prof = cProfile.Profile(time.process_time) if ns.profile else None
    t, c = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    n = run()
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    unit = "prompt tokens" if ns.phase == "load" else "tokens"
    print(f"{ns.phase}: {n} {unit}; wall {wall:.1f} s ({n / wall:.2f}/s), CPU {cpu:.1f} s ({n / cpu:.2f}/CPU-s); "
          f"KV audits {audits[0]}{' (cProfile on)' if prof else ''}")
    if prof:
        prof.dump_stats(ns.profile)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())


if __name__ == "__main__":
    main()
