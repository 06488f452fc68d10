"""The ``loops`` section of ``python -m refspec check``: the whole speculative loop, oracle vs
production, v1 and v2, page sizes, eager and CUDA graphs.  One row per configuration:
``lossless: yes / no``.

* CPU (fp32, tolerance T0, TOL-001): the production loop's tokens equal plain greedy decoding of
  the target bit for bit (SD-002) and equal the oracle loop's tokens and accept counts.
* CUDA (bf16 with the real FA3 kernel, tolerance T2, TOL-003): the production loop's tokens equal
  the fp32 oracle's greedy tokens except where a first divergence falls on a near tie (top-2
  margin below delta, delta = max(T2_DELTA, 2x the bf16-vs-fp32 teacher-forced logit error)).

The model is a random-init 2-layer Llama (``tiny_config``), the draft its first layer (early exit), Sd = 3,
five requests of different prompt lengths and budgets (they leave the batch mid-run).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import copy
import random

import torch

from refspec.model.llama import LlamaModel, init_random_, tiny_config
from refspec.oracle.loop import greedy
from refspec.traces.replay import teacher_forced_err
from refspec.speculative import generate
from refspec.core.tolerance import T2_DELTA, t2

PROMPT_LENS, BUDGETS = [3, 9, 14, 5, 17], [12, 8, 14, 10, 12]


def loop_rows(device, page_sizes, quick):
    """Rows: (version, P, graphs) -> lossless yes / no, accept length, host syncs per round."""
    rng = random.Random(7)
    cfg = tiny_config(head_dim=64) if device == "cuda" else tiny_config()
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    m32 = init_random_(LlamaModel(cfg), seed=0).to(device).eval()
    with torch.no_grad():
        base = [greedy(m32, p, b) for p, b in zip(prompts, BUDGETS)]
    ref = {i: p + g.tokens for i, (p, g) in enumerate(zip(prompts, base))}
    ora = generate(m32, prompts, backend="oracle", max_new_tokens=BUDGETS, reference=ref, draft="early-exit:1",
                   num_steps=3)
    cuda = torch.device(device).type == "cuda"
    model = copy.deepcopy(m32).to(torch.bfloat16) if cuda else m32
    delta = max(T2_DELTA, 2 * max(teacher_forced_err(m32, model, ref[i]) for i in ref)) if cuda else None
    sizes = [p for p in page_sizes if p in (1, 4, 16, 64)] if quick else list(page_sizes)
    for version in ("v1", "v2"):
        for P in sizes:
            for graphs in (False, True):
                row = dict(section="loops", mode=f"{version} {'graph' if graphs else 'eager'}", P=P,
                           provider="fa3" if cuda else "emulator")
                try:
                    res = generate(model, prompts, backend="fa3", version=version, page_size=P, graphs=graphs,
                                   max_new_tokens=BUDGETS, reference=ref, draft="early-exit:1", num_steps=3)
                except Exception as e:  # noqa: BLE001 - a loop that raises is a failed check
                    yield dict(row, check="lossless", result="FAIL", worst=f"{type(e).__name__}: {e}"[:160])
                    continue
                if cuda:
                    verdicts = [t2(res.tokens[i], g.tokens, g.margins, delta=delta) for i, g in enumerate(base)]
                    ok = all(v for v, _ in verdicts)
                    why = "; ".join(w for v, w in verdicts if w != "equal") or "tokens equal"
                    check = f"T2 vs fp32 greedy (delta {delta:.2g})"
                else:
                    ok = res.tokens == [g.tokens for g in base] and res.tokens == ora.tokens \
                        and res.accepts == ora.accepts
                    why = "tokens == greedy == oracle loop" if ok else "tokens or accepts differ"
                    check = "T0 vs greedy + oracle loop"
                ok = ok and res.free_pages[0] == res.free_pages[1]
                acc = res.accept_length
                yield dict(row, check=check, result="pass" if ok else "FAIL",
                           worst=f"lossless: {'yes' if ok else 'no'} ({why}); accept length {acc:.2f}; "
                                 f"in-round host syncs {res.host_syncs.get('in_round', 0)} / {len(res.trace)} rounds")
