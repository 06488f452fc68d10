"""Speculative-decoding traces: what a real run *decided*, so that any device can replay it.

A trace (JSON, ``"format": "refspec-trace/1"``) holds the schedule of one production run
(:func:`refspec.speculative.generate`, ``backend="fa3"``), not its numbers:

* ``config``: version (v1 / v2), page size P, Sd (``num_steps``), the draft spec, ``max_batch``,
  ``eos``, ``capture_bs`` and ``model_config`` (the HF config dict of the target);
* ``requests`` (rid = index): ``prompt_ids`` (ChatML token ids), ``max_new_tokens`` (the budget
  asked for), ``output_ids`` and ``finish_reason`` ("eos" / "length"), ``num_accept_tokens`` (a
  per verify round), plus ``question_id`` / ``category`` when the prompt came from MT-Bench;
* ``rounds``, one per production round: ``rids`` (batch membership, in batch order),
  ``seq_lens`` (committed L at the round's start, tokens), ``num_accept_tokens`` (a = n + 1,
  bonus included, SD-001), ``joined`` (prefilled just before) and ``finished`` (left after).
  Under the overlap loop (``config["overlap"]``, optional, default false) a round whose every
  row was dropped (requests finished by an earlier round, known one round late) committed
  nothing and is not written.

**Why a replay is exact on any model.**  The engine's decisions depend on the model only through
a: L grows by a per round (SD-008), a request leaves when its output reaches its budget or EOS,
and a waiting request joins when a batch slot frees (``max_batch``).  So a replay forces
``a`` per request-round (:class:`~refspec.speculative.accept.ScriptedAccept`), turns EOS off and sets
each request's budget to its recorded output length (an EOS that ended a round early then ends
the same round by length).  Batch membership, ``seq_lens``, a, joins and finishes must then equal
the trace round for round, with a random-init model of the same config on any device.

**Tree traces** (top-k > 1, ``"format": "refspec-tree-trace/1"``, config ``topk`` and
``num_draft_tokens``) add a ``tree`` list to every round: what each request's round fed the FA3
wing (:mod:`refspec.traces.tree`).  Their replay re-runs every round's tree
attention instead of the whole engine (:mod:`refspec.traces.replay_tree`).

:func:`check_trace` proves a file is self-consistent before anything runs (ValueError naming the
request / round otherwise).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import json
from pathlib import Path

from refspec.traces.tree import TREE_FORMAT, check_tree_rounds

FORMAT = "refspec-trace/1"
ROUND_KEYS = ("rids", "seq_lens", "num_accept_tokens", "joined", "finished")
CONFIG_KEYS = ("version", "page_size", "num_steps", "draft", "max_batch", "eos", "capture_bs", "model_config")


#: the largest model a replay builds (random init, fp32: 4 GB); SmolLM2-135M is 1.35e8 parameters
MAX_REPLAY_PARAMS = 10**9
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size")


def model_config_problem(mc) -> str | None:
    """Why ``model_config`` is no model a replay can build (a size not an int >= 1, heads not
    grouped, or more than :data:`MAX_REPLAY_PARAMS` parameters), or None."""
    if not isinstance(mc, dict):
        return f"config model_config = {mc!r}: a dict of the model's sizes"
    for k in _SIZES:
        if type(mc.get(k)) is not int or mc[k] < 1:
            return f"config model_config.{k} = {mc.get(k)!r}: an int >= 1"
    E, I, L, H, Hkv, D, V = (mc[k] for k in _SIZES)
    if H % Hkv:
        return f"config model_config: num_attention_heads {H} is not a multiple of num_key_value_heads {Hkv} (GQA)"
    params = V * E + L * (E * (H + 2 * Hkv) * D + H * D * E + 3 * E * I)
    if params > MAX_REPLAY_PARAMS:
        return (f"config model_config describes a {params:.3g}-parameter model; a replay builds it at random in fp32 "
                f"and refuses more than {MAX_REPLAY_PARAMS:.0e} (SmolLM2-135M: 1.35e+08)")
    return None


def largest_batch(trace: dict) -> int:
    """The most requests one round of ``trace`` can hold: ``min(max_batch, number of requests)``
    (a replay sizes its engine by it: a larger ``max_batch`` admits the same requests)."""
    return min(trace["config"]["max_batch"], len(trace["requests"]))


def is_tree_trace(trace: dict) -> bool:
    """Whether ``trace`` holds top-k > 1 rounds (:data:`~refspec.traces.tree.TREE_FORMAT`)."""
    return trace.get("format") == TREE_FORMAT


def trace_from_result(result, prompts: list[list[int]], budgets: list[int], config: dict,
                      questions: list[dict] | None = None, source: dict | None = None,
                      tree_rounds: list | None = None) -> dict:
    """Build a trace from a production :class:`~refspec.speculative.metrics.GenerateResult`.

    Shapes: ``prompts`` B lists of token ids, ``budgets`` B ints (tokens), ``questions`` B dicts.

    Args: ``prompts`` (B lists of token ids), ``budgets`` (B ``max_new_tokens``), ``config``
    (the :data:`CONFIG_KEYS`), ``questions`` (optional per-request metadata: question_id,
    category), ``source`` (free-form provenance), ``tree_rounds`` (a tree run: the
    :class:`~refspec.traces.tree.TreeRecorder` rounds, one per committed round; the
    trace is then a tree trace).  Raises ValueError if ``result`` has no
    per-round trace (the oracle loop has none) or the result is inconsistent.
    """
    if result.trace is None:
        raise ValueError("only a production run (backend 'fa3' / 'paged-oracle') has a per-round trace")
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}")
    reqs = []
    for i, (r, p, m) in enumerate(zip(result.requests, prompts, budgets)):
        meta = {k: questions[i][k] for k in ("question_id", "category")} if questions else {}
        reqs.append({"rid": r.rid, **meta, "prompt_ids": list(p), "max_new_tokens": int(m),
                     "output_ids": list(r.tokens), "finish_reason": r.finish_reason,
                     "num_accept_tokens": list(r.accepts)})
    rounds = [{"rids": t.rids, "seq_lens": t.seq_lens, "num_accept_tokens": t.num_accept_tokens,
               "joined": t.joined, "finished": t.finished} for t in committed_rounds(result.trace)]
    if tree_rounds is not None:
        if len(tree_rounds) != len(rounds):
            raise ValueError(f"{len(tree_rounds)} recorded tree rounds for {len(rounds)} committed rounds")
        for rd, tree in zip(rounds, tree_rounds):
            rd["tree"] = tree
    trace = {"format": FORMAT if tree_rounds is None else TREE_FORMAT, "source": dict(source or {}),
             "config": dict(config), "requests": reqs, "rounds": rounds}
    check_trace(trace)
    return trace


def check_trace(trace: dict) -> None:
    """Raise ValueError unless ``trace`` is a self-consistent :data:`FORMAT` (or tree) trace.

    Checks: the format tag and config keys; rids are 0..B-1; every round's lists align; per
    request, its rounds' ``seq_lens`` start at the prompt length and grow by a (SD-008), their a
    equal the request's ``num_accept_tokens``, each a is in [1, Sd + 1] (SD-003); it finishes
    exactly at its last round; its output length lies in ``(1 + sum(a[:-1]), 1 + sum(a)]`` and
    within its budget (so a budget of that length ends the same round); no round holds more
    than ``max_batch`` requests; ``capture_bs`` are sizes ``1 .. 2 *`` :func:`largest_batch`;
    ``model_config`` is a model a replay can build (:func:`model_config_problem`), ``num_steps``
    at most the largest budget, every prompt and output token inside its vocabulary.  A
    tree trace (:data:`TREE_FORMAT`): also the shapes of its ``tree`` entries, every page id inside
    the recorded ``num_pages`` pool and outside page 0 (PA-011 / PA-008) and every accepted path the
    greedy walk over the recorded tokens (TR-006)
    (:func:`~refspec.traces.tree.check_tree_rounds`); the message names the ID.
    """
    def bad(msg):
        raise ValueError(f"trace: {msg}")

    if trace.get("format") not in (FORMAT, TREE_FORMAT):
        bad(f"format {trace.get('format')!r}, expected {FORMAT!r} or {TREE_FORMAT!r}")
    cfg = trace.get("config", {})
    if any(k not in cfg for k in CONFIG_KEYS):
        bad(f"config lacks {[k for k in CONFIG_KEYS if k not in cfg]}")
    if (why := _field_problem(trace)) is not None:
        bad(why)
    if (why := model_config_problem(cfg["model_config"])) is not None:
        bad(why)
    most_new = max((r["max_new_tokens"] for r in trace["requests"]), default=1)
    if not (type(cfg["num_steps"]) is int and cfg["num_steps"] <= most_new):
        bad(f"config num_steps = {cfg['num_steps']!r}: an int 1 .. {most_new} (the largest budget: a longer "
            f"draft could never be accepted in full)")
    V = cfg["model_config"]["vocab_size"]
    for r in trace["requests"]:
        for name in ("prompt_ids", "output_ids"):
            if not all(type(x) is int and 0 <= x < V for x in r[name]):
                bad(f"request {r['rid']}: {name} holds a token outside the vocabulary 0 .. {V - 1}")
    most, cbs = 2 * largest_batch(trace), cfg["capture_bs"]
    if not (isinstance(cbs, list) and cbs and all(isinstance(c, int) and 1 <= c <= most for c in cbs)):
        bad(f"config capture_bs = {cbs!r}: a non-empty list of graph batch sizes 1 .. {most} (twice the "
            f"largest batch a round of this trace holds, min(max_batch, requests): a bigger graph only pads)")
    N, reqs, rounds = cfg["num_steps"] + 1, trace["requests"], trace["rounds"]
    if [r["rid"] for r in reqs] != list(range(len(reqs))):
        bad("request ids must be 0..B-1 in order")
    seen: dict[int, list[tuple[int, int, int]]] = {r["rid"]: [] for r in reqs}  # rid -> (round, L, a)
    for k, rd in enumerate(rounds):
        if any(k_ not in rd for k_ in ROUND_KEYS) or len({len(rd[x]) for x in ROUND_KEYS[:3]}) != 1:
            bad(f"round {k}: needs aligned rids / seq_lens / num_accept_tokens")
        if len(rd["rids"]) > cfg["max_batch"]:
            bad(f"round {k}: {len(rd['rids'])} requests > max_batch {cfg['max_batch']}")
        dup = next((rid for i, rid in enumerate(rd["rids"]) if rid in rd["rids"][:i]), None)
        if dup is not None:
            bad(f"duplicate rid {dup} in round {k}: rids {rd['rids']} (a request runs at most once a round)")
        for rid, L, a in zip(rd["rids"], rd["seq_lens"], rd["num_accept_tokens"]):
            if rid not in seen:
                bad(f"round {k}: unknown rid {rid} (the requests are rids 0..{len(reqs) - 1})")
            if not 1 <= a <= N:
                bad(f"round {k}: rid {rid} accepts a = {a}, outside [1, N = num_steps + 1 = {N}]")
            seen[rid].append((k, L, a))
        if not set(rd["finished"]) <= set(rd["rids"]):
            bad(f"round {k}: finished {rd['finished']} not all in the batch {rd['rids']}")
    for r in reqs:
        mine, out = seen[r["rid"]], r["output_ids"]
        accepts = [a for _, _, a in mine]
        if accepts != r["num_accept_tokens"]:
            bad(f"request {r['rid']}: rounds give a = {accepts}, the request lists {r['num_accept_tokens']}")
        L = len(r["prompt_ids"])
        for k, Lk, a in mine:
            if Lk != L:
                bad(f"request {r['rid']} round {k}: seq_len {Lk}, expected {L} (prompt + sum of a)")
            L += a
        if not 1 <= len(out) <= r["max_new_tokens"]:
            bad(f"request {r['rid']}: {len(out)} output tokens, budget {r['max_new_tokens']}")
        if mine and not 1 + sum(accepts[:-1]) < len(out) <= 1 + sum(accepts):
            bad(f"request {r['rid']}: {len(out)} output tokens do not end in its last round (a = {accepts})")
        fin = [k for k, rd in enumerate(rounds) if r["rid"] in rd["finished"]]
        if mine and fin != [mine[-1][0]]:
            bad(f"request {r['rid']}: finished in rounds {fin}, its last round is {mine[-1][0]}")
    if (why := schedule_problem(trace)) is not None:
        bad(why)
    if is_tree_trace(trace):
        check_tree_rounds(trace, bad)


def _ints(xs) -> bool:
    return isinstance(xs, list) and all(type(x) is int for x in xs)


def _field_problem(trace: dict) -> str | None:
    """The first field of ``trace`` whose JSON type is wrong (``page_size: "4"``), named, or None."""
    cfg = trace["config"]
    if cfg["version"] not in ("v1", "v2"):
        return f"config version = {cfg['version']!r}: 'v1' or 'v2'"
    for k in ("page_size", "num_steps", "max_batch"):
        if type(cfg[k]) is not int or cfg[k] < 1:
            return f"config {k} = {cfg[k]!r}: an int >= 1"
    reqs, rounds = trace.get("requests"), trace.get("rounds")
    if not (isinstance(reqs, list) and all(isinstance(r, dict) for r in reqs)):
        return "requests: a list of request objects"
    if not (isinstance(rounds, list) and all(isinstance(rd, dict) for rd in rounds)):
        return "rounds: a list of round objects"
    for i, r in enumerate(reqs):
        for k in ("rid", "max_new_tokens"):
            if type(r.get(k)) is not int:
                return f"requests[{i}].{k} = {r.get(k)!r}: an int"
        for k in ("prompt_ids", "output_ids", "num_accept_tokens"):
            if not _ints(r.get(k)):
                return f"requests[{i}].{k} = {r.get(k)!r}: a list of ints"
    for k, rd in enumerate(rounds):
        for key in ROUND_KEYS:
            if key in rd and not _ints(rd[key]):
                return f"round {k}: {key} = {rd[key]!r}: a list of ints"
    return None


def schedule_problem(trace: dict) -> str | None:
    """Why the rounds are no schedule the engine makes (every request arriving at step 0, at most
    ``max_batch`` running, :meth:`~refspec.speculative.engine.Engine.run` and the overlap loop),
    or None: the three hand edits a tree replay could not see otherwise (it does not re-run the
    scheduler, a chain replay does):

    * batch order: round k runs the requests of round k - 1 that did not finish, in their order,
      then its ``joined`` (ascending rid) that it runs;
    * ``joined``: a request joins in the first round that runs it, never after;
    * ``max_batch``: while requests still wait, admission fills the batch up to ``max_batch``
      (requests a round's prefill finished count; with the overlap loop also those the previous
      round finished, whose rows the launch still held).
    """
    rounds, overlap = trace["rounds"], bool(trace["config"].get("overlap", False))
    first = {}
    for k, rd in enumerate(rounds):
        for rid in rd["rids"]:
            first.setdefault(rid, k)
    prev, prev_finished = [], []
    for k, rd in enumerate(rounds):
        carry = [r for r in prev if r not in prev_finished]
        if late := sorted(j for j in rd["joined"] if first.get(j, k) < k):
            return f"round {k}: joined {late}, which ran in an earlier round (a request joins in its first round)"
        new = [j for j in rd["joined"] if j in rd["rids"]]
        if new != sorted(new) or rd["rids"] != carry + new:
            return (f"round {k}: batch {rd['rids']}; the engine runs the unfinished requests of the round before "
                    f"{carry}, then those joining now {sorted(new)}, in that order")
        occupied = len(rd["rids"]) + len(set(rd["joined"]) - set(rd["rids"])) + (len(prev_finished) if overlap else 0)
        waiting = sorted(rid for rid, f in first.items() if f > k)
        if waiting and occupied < trace["config"]["max_batch"]:
            return (f"round {k}: {occupied} of max_batch {trace['config']['max_batch']} slots held while requests "
                    f"{waiting} wait (admission fills the batch): max_batch is not the recording's")
        prev, prev_finished = rd["rids"], rd["finished"]
    return None


def replay_budgets(trace: dict) -> list[int]:
    """Per request, the recorded output length: the replay budget that ends it in the same round."""
    return [len(r["output_ids"]) for r in trace["requests"]]


def accept_table(trace: dict) -> dict[int, list[int]]:
    """``rid -> [a per round]`` for :class:`~refspec.speculative.accept.ScriptedAccept`."""
    return {r["rid"]: list(r["num_accept_tokens"]) for r in trace["requests"]}


def committed_rounds(rounds) -> list:
    """The rounds that committed tokens: all but the overlap loop's all-dropped ones (module doc)."""
    return [t for t in rounds if t.rids or not t.discarded]


def schedule_mismatches(trace: dict, rounds) -> list[str]:
    """Where a replayed engine's rounds (:class:`~refspec.speculative.metrics.RoundTrace` list) differ
    from the trace: one line per differing field per round, empty when the schedule is equal."""
    out = []
    rounds = committed_rounds(rounds)
    if len(rounds) != len(trace["rounds"]):
        out.append(f"{len(rounds)} rounds replayed, the trace has {len(trace['rounds'])}")
    for k, (want, got) in enumerate(zip(trace["rounds"], rounds)):
        for key in ROUND_KEYS:
            if list(getattr(got, key)) != list(want[key]):
                out.append(f"round {k}: {key} {list(getattr(got, key))} != trace {want[key]}")
    return out


def dumps(trace: dict) -> str:
    """JSON text with one request / one round per line (small diffs, still one ``json.loads``)."""
    head = {k: v for k, v in trace.items() if k not in ("requests", "rounds")}
    lines = ["{" + json.dumps(head)[1:-1] + ","]
    for key in ("requests", "rounds"):
        items = [json.dumps(x, separators=(",", ":")) for x in trace[key]]
        lines.append(f' "{key}": [' + ("\n  " + ",\n  ".join(items) + "\n " if items else "") + "]"
                     + ("," if key == "requests" else ""))
    return "\n".join(lines) + "}\n"


def save_trace(trace: dict, path: str | Path) -> Path:
    """Check and write ``trace`` (:func:`dumps`); returns the path."""
    check_trace(trace)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(trace), encoding="utf-8")
    return path


def load_trace(path: str | Path) -> dict:
    """Read and :func:`check_trace` a trace file.

    Raises: OSError (FileNotFoundError, ...) if it cannot be read; ValueError naming the file if
    it is not JSON, not a trace object, or inconsistent (:func:`check_trace`).
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        trace = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer literal beyond Python's digit limit
        raise ValueError(f"trace {path}: not JSON refspec can read ({e})") from e
    if not isinstance(trace, dict):
        raise ValueError(f"trace {path}: expected a JSON object with format {FORMAT!r}, got {type(trace).__name__}")
    try:
        check_trace(trace)
    except ValueError as e:
        raise ValueError(f"trace {path}: {str(e).removeprefix('trace: ')}") from e
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a field missing or of the wrong type
        raise ValueError(f"trace {path}: malformed ({type(e).__name__}: {e})") from e
    return trace
