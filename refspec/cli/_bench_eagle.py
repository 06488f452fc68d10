"""``bench --sections eagle,teacher-forced``: the trained EAGLE head against graph greedy.

* ``eagle`` (CUDA): accept length and tokens/s of the production loop (FA3, CUDA graphs, the
  fused target) with the committed head (:mod:`refspec.real.eagle_head`) at B = 1 and 16 for
  v1 / v2, chain Sd = 3 and 5, P = 16 and 1 (the seed's page comparison), the tree k = 4,
  N = 8 at B = 1, and early-exit:25 beside it; every row against graph greedy measured in the
  same process (``x_graph_greedy``: :func:`~refspec.cli._timing.speedup` of the two decode
  windows, the demo's "x graph greedy") and checked token for token against it (``same_text``).
* ``teacher-forced``: :func:`refspec.harness.teacher_forced.teacher_forced_accepts` on a fixed
  text, the target's greedy continuation of MT-Bench prompts: the trained head (Sd = 3, 5),
  early-exit:25 and early-exit:4 (Sd = 3), on the same tokens; the tree k = 4, N = 8, Sd = 3
  (:func:`~refspec.harness.teacher_forced.teacher_forced_tree_accepts`) for the head and
  early-exit:4 (not with ``--quick``); ``prompt0_accept_length`` is the first prompt's alone
  (the eagle section's B = 1 request); then the production tree loop (FA3, v2, P = 16, eager)
  with the head on the same prompts, with ``same_text`` against the fixed text.  On a CPU with ``--quick``: two
  prompts, 24 tokens, fp32.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import statistics
import time


from refspec.cli._bench_profile import _workload, capture_sizes, profile_config
from refspec.cli import _timing
from refspec.cli._timing import time_greedy
from refspec.speculative.greedy import production_greedy

EAGLE_NEW = 128  #: tokens per request in the eagle section


def _head(model):
    from refspec.real.eagle_head import load_eagle_head
    from refspec.real import missing_reason

    if missing_reason() is not None:
        return None, "real weights not installed"
    try:
        return load_eagle_head(model), "trained head"
    except (FileNotFoundError, ValueError) as e:
        return None, str(e)


def bench_eagle(device, quick):
    """Accept length and tokens/s with the trained head vs graph greedy (module doc)."""
    if device.type != "cuda" or quick:
        return [{"section": "eagle", "what": "skipped: needs a CUDA GPU"}]
    from refspec.model.fused import FusedLlama

    model, all_prompts, label = _workload(16)  # B = 1 runs the first of them (_workload(1)'s prompt)
    head, why = _head(model)
    if head is None:
        return [{"section": "eagle", "what": f"skipped: {why}"}]
    rows = []
    for B in (1, 16):
        prompts = all_prompts[:B]
        fast = FusedLlama(model)
        cap = capture_sizes(B)
        # the second run is timed (compilation in the first), over the decode window
        g, g_time = time_greedy(fast, prompts, [EAGLE_NEW] * B, page_size=16, capture_bs=cap)
        rows.append({"section": "eagle", "B": B, "workload": label, "config": "graph greedy", "accept_length": 1.0,
                     "tok_per_s": g_time.tok_per_s, "x_graph_greedy": 1.0})
        configs = [("v1", 3, 16, "eagle", {}), ("v2", 3, 16, "eagle", {}), ("v2", 5, 16, "eagle", {}),
                   ("v2", 3, 1, "eagle", {}), ("v2", 3, 16, "early-exit:25", {})]
        if B == 1:
            configs.append(("v2", 3, 16, "eagle", {"topk": 4, "num_draft_tokens": 8, "overlap": True}))
        for version, Sd, P, draft, kw in configs:
            tree = f" tree k={kw['topk']} N={kw['num_draft_tokens']}" if kw else ""
            name = f"{draft} {version} Sd={Sd} P={P}{tree}"
            try:
                r = profile_config(fast, prompts, version=version, draft=head if draft == "eagle" else draft, P=P,
                                   num_steps=Sd, max_new=EAGLE_NEW, **kw)
            except Exception as e:  # noqa: BLE001 - one failing configuration is a row, not the end of the run
                rows.append({"section": "eagle", "B": B, "config": name, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            same = sum(a == b for a, b in zip(r["text"], g.tokens))
            rows.append({"section": "eagle", "B": B, "config": name, "accept_length": r["accept_length"],
                         "wall_ms_per_round": r["wall_ms"], "tok_per_s": r["tok_per_s"],
                         "x_graph_greedy": _timing.speedup(r["timed"], g_time), "same_text": f"{same}/{B}"})
    return rows


def bench_teacher_forced(device, quick):
    """Teacher-forced accept lengths of several drafts on one fixed text (module doc)."""
    from refspec.harness.teacher_forced import teacher_forced_accepts, teacher_forced_tree_accepts
    from refspec.model.drafts import make_draft
    from refspec.speculative import generate
    from refspec.speculative.api import greedy_reference

    B, M = (2, 24) if quick else (16, EAGLE_NEW)
    model, prompts, label = _workload(B)
    if device.type == "cpu":
        model = model.float()
    head, why = _head(model)
    t = time.perf_counter()
    if device.type == "cuda":  # the production path's own greedy text (the dense bf16 model's drifts from it)
        from refspec.model.fused import FusedLlama
        g = production_greedy(FusedLlama(model), prompts, [M + 6] * B, page_size=16, validate=False,
                              capture_bs=capture_sizes(B))
        ref = {i: list(p) + list(tk) for i, (p, tk) in enumerate(zip(prompts, g.tokens))}
    else:
        ref = greedy_reference(model, prompts, [M + 6] * B)
    rows = [{"section": "teacher-forced", "workload": label, "what": f"reference: {B} prompts x {M + 6} greedy tokens",
             "seconds": round(time.perf_counter() - t, 1)}]
    tree = {"topk": 4, "num_draft_tokens": 8}  # the eagle section's tree (B = 1 there)
    drafts = ([("eagle (trained head)", head, 3, {}), ("eagle (trained head)", head, 5, {}),
               ("eagle (trained head)", head, 3, tree)] if head is not None else []) + [
        (f"early-exit:{k}", make_draft(f"early-exit:{k}", model), 3, kw) for k in (25, 4)
        for kw in ({}, tree) if k <= model.config.num_hidden_layers and (not kw or (k == 4 and not quick))]
    if head is None:
        rows.append({"section": "teacher-forced", "what": f"trained head not measured: {why}"})
    for name, d, Sd, kw in drafts:
        t = time.perf_counter()
        if kw:
            per = [teacher_forced_tree_accepts(model, d, p, ref[i], num_steps=Sd, max_new_tokens=M, **kw)
                   for i, p in enumerate(prompts)]
        else:
            per = [teacher_forced_accepts(model, d, p, ref[i], num_steps=Sd, max_new_tokens=M)
                   for i, p in enumerate(prompts)]
        acc = [a for x in per for a in x]
        row = {"section": "teacher-forced", "draft": name, "Sd": Sd, "rounds": len(acc),
               "accept_length": statistics.fmean(acc), "prompt0_accept_length": statistics.fmean(per[0]),
               "seconds": round(time.perf_counter() - t, 1)}
        if kw:
            row["tree"] = f"k={kw['topk']} N={kw['num_draft_tokens']}"
        rows.append(row)
    if head is not None:  # the production tree loop on the same prompts, against the teacher-forced row above
        t = time.perf_counter()
        r = generate(model, prompts, backend="fa3", version="v2", draft=head, num_steps=3, max_new_tokens=M,
                     page_size=16, validate=False, **tree)
        same = sum(q.tokens == ref[i][len(prompts[i]):len(prompts[i]) + M] for i, q in enumerate(r.requests))
        rows.append({"section": "teacher-forced", "draft": "eagle (trained head), production tree loop (fa3 v2 P=16)",
                     "Sd": 3, "tree": "k=4 N=8", "rounds": sum(len(q.accepts) for q in r.requests),
                     "accept_length": statistics.fmean(a for q in r.requests for a in q.accepts),
                     "prompt0_accept_length": statistics.fmean(r.requests[0].accepts), "same_text": f"{same}/{B}",
                     "seconds": round(time.perf_counter() - t, 1)})
    return rows
