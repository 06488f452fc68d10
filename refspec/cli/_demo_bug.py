"""``python -m refspec demo --bug seed-page-table``: a bug-zoo variant live on the real model.

The seed's bug (``refspec.mutants.variants``, SGLang #5090, fixed by #5318): the draft-decode and
target-verify graph replays copy *token slots* ``req_to_token[r, :max_k]`` into the page table
instead of page ids ``req_to_token[r, ::P] // P``.  With P = 1 a slot is a page id, so CI passed;
with P > 1 FA3 reads column c as page ``slot(c)``, about P times too far into the pool.

The production loop (FA3 wing, graphs on, page size 4) runs three times on the same requests:

1. the correct loop: its text is the reference;
2. the variant switched on, validation on: the replay-time check of the page table
   (:func:`refspec.fa3.validate.validate_metadata`) stops the first graph replay, and its
   :class:`~refspec.core.invariants.InvariantError` (PA-002) is printed;
3. the variant on, validation off: the run completes, and its text is printed next to the
   correct one with both accept lengths.

For step 3 to show garbage rather than an out-of-range read, the engine is built with a pool
where every slot id of a used page is itself a valid page id (pages handed out in order, pool of
``P x`` the pages the run can touch) and a ``req_to_token`` wide enough that the graph page
table (width ``ceil(columns / P)``) holds ``max K`` slot ids.  The wrongly addressed pages then
hold other requests' KV or zeros: finite garbage.  Should an error surface anyway (an emulator
PA-011 out-of-range page, or any exception), it is printed as the symptom.  Works for any
variant in ``refspec.variants.VARIANTS``; the pool set-up is what the seed's bug needs.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from refspec.mutants import variants
from refspec.mutants.sizing import roomy_sizes
from refspec.core.invariants import InvariantError
from refspec.real.run import capture_sizes, first_diff
from refspec.model.drafts import make_draft
from refspec.speculative.engine import Engine


def roomy_engine(model, prompts, max_new, *, page_size, version, num_steps, draft, validate, eos, observer=None):
    """A production :class:`Engine` (FA3, graphs) whose slot ids are all valid page ids, sized by
    :func:`refspec.mutants.sizing.roomy_sizes` (pages handed out in order, no shuffle)."""
    max_context, num_pages = roomy_sizes(prompts, max_new, page_size=page_size, num_steps=num_steps)
    from refspec.real.eagle_head import real_draft

    return Engine(model, make_draft(real_draft(draft, model), model), version=version, num_steps=num_steps,
                  page_size=page_size,
                  max_context=max_context, max_batch=len(prompts), attention="fa3", graphs=True,
                  capture_bs=capture_sizes(len(prompts)), validate=validate, eos=eos,
                  num_pages=num_pages, shuffle_pages=None, observer=observer)


def run_once(model, prompts, max_new, **kw):
    """Run the roomy engine; returns ``(outputs, accept length, None)`` or ``(None, None, exception)``."""
    bar = tqdm(total=sum(max_new), unit="tok", leave=False, desc=kw.pop("desc", "run"), disable=not kw.pop("progress"))

    def obs(event, eng, **info):
        if event == "prefill":
            bar.update(len(info["reqs"]))
        elif event == "round_end":
            bar.update(sum(r.emitted[-1] for r in info["reqs"]))
    try:
        eng = roomy_engine(model, prompts, max_new, observer=obs, **kw)
        for i, (p, m) in enumerate(zip(prompts, max_new)):
            eng.add_request(i, p, m)
        done = sorted(eng.run(), key=lambda r: r.rid)
    except Exception as e:  # the symptom is the point here
        return None, None, e
    finally:
        bar.close()
    rounds = sum(len(r.accepts) for r in done)
    return [r.output for r in done], sum(sum(r.emitted) for r in done) / max(rounds, 1), None


def run_bug_demo(model, questions, prompts, max_new, name, *, page_size=4, version="v1", num_steps=3,
                 draft="early-exit:25", eos=None, progress=True, n_requests=2, out=print) -> int:
    """The three runs of the module doc on the first ``n_requests`` prompts; returns 0 when the
    variant was flagged with validation on and changed (or broke) the output with it off, else 1.
    Raises KeyError for an unknown variant name."""
    bug = variants.VARIANTS[name]
    prompts, max_new, questions = prompts[:n_requests], max_new[:n_requests], questions[:n_requests]
    kw = dict(page_size=page_size, version=version, num_steps=num_steps, draft=draft, eos=eos, progress=progress)
    from refspec.real import decode

    out(f"bug variant {name!r}: {bug.changes}\n  source: {bug.source}\n  expected symptom: {bug.symptom}\n"
        f"  caught by: {', '.join(bug.caught_by)}\n")
    out(f"production loop {version}, page size {page_size}, graphs on, draft {draft}, Sd = {num_steps}, "
        f"{len(prompts)} requests (q{', q'.join(str(q['question_id']) for q in questions)})\n")
    t = time.perf_counter()
    good, good_acc, err = run_once(model, prompts, max_new, validate=True, desc="correct", **kw)
    if err is not None:
        out(f"the CORRECT loop failed: {type(err).__name__}: {err}")
        return 1
    out(f"1. correct loop: accept length {good_acc:.2f} ({time.perf_counter() - t:.1f} s)")
    with variants.enabled(name):
        _, _, flagged = run_once(model, prompts, max_new, validate=True, desc="bug, validated", **kw)
        out(f"\n2. {name} on, validation on -> " + (
            f"stopped by {type(flagged).__name__}:\n   {flagged}" if flagged is not None else "NOT flagged"))
        t = time.perf_counter()
        bad, bad_acc, crash = run_once(model, prompts, max_new, validate=False, desc="bug, unvalidated", **kw)
    out(f"\n3. {name} on, validation off -> " + (
        f"the run breaks instead of printing garbage: {type(crash).__name__}: {crash}" if crash is not None else
        f"it runs ({time.perf_counter() - t:.1f} s), accept length {bad_acc:.2f} (correct: {good_acc:.2f})"))
    differs = crash is not None
    if crash is None:
        for i, q in enumerate(questions):
            j = first_diff(bad[i], good[i])
            differs |= j is not None
            out(f"\n   q{q['question_id']} [{q['category']}] {q['prompt'][:90]!r}")
            out(f"   correct : {decode(good[i], skip_special=True)!r}")
            out(f"   with bug: {decode(bad[i], skip_special=True)!r}")
            out("   (identical)" if j is None else f"   first differing token: #{j}")
    caught = isinstance(flagged, InvariantError) and flagged.inv_id in bug.caught_by
    out(f"\nverdict: flagged by {getattr(flagged, 'inv_id', None) or 'nothing'} with validation on "
        f"({'one of' if caught else 'NOT one of'} {', '.join(bug.caught_by)}); "
        f"output {'corrupted' if differs else 'unchanged'} with validation off")
    return 0 if caught and differs else 1
