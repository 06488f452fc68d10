"""The trained EAGLE head for SmolLM2-135M-Instruct that ships with refspec.

``refspec/real/heads/smollm2-135m-eagle.safetensors`` holds the head's own parameters (``fc``,
the decoder ``layer``, ``norm``; bf16) of a :class:`refspec.model.drafts.EagleDraft` trained by
``python -m refspec train-draft`` (:mod:`refspec.real.draft_train`); the embedding and the LM
head are the target's (tied, shared).  Its card (the ``.json`` beside it) records the data, the
recipe, the steps, the seed, the held-out metrics and the commit it was trained at.

:func:`load_eagle_head` checks the file's SHA-256 against :data:`HEAD_SHA256` before loading, so a
changed or truncated file is refused by name rather than drafting silently worse.
:func:`real_draft` is what the real-weights commands call: ``"eagle"`` with the real model means
this head; every other spec is returned unchanged for :func:`refspec.model.drafts.make_draft`.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import json
from pathlib import Path


from refspec.model.drafts import EagleDraft
from refspec.real.draft_train import sha256_file

HEAD_FILE = Path(__file__).with_name("heads") / "smollm2-135m-eagle.safetensors"
#: the committed head's SHA-256 (its card's ``sha256``)
HEAD_SHA256 = "7476513b8d4ecdfca7a163a461a17f92a1d9966b67b2f8ecec6c6ae0b46a3b26"
TARGET_SHAPE = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "intermediate_size": 1536, "vocab_size": 49152}


class HeadMismatch(ValueError):
    """The head file's hash, or the target it is loaded for, is not the one it was trained for."""


def head_card(path: str | Path = HEAD_FILE) -> dict:
    """The JSON card beside a head file (``{}`` if there is none)."""
    card = Path(path).with_suffix(".json")
    return json.loads(card.read_text()) if card.exists() else {}


def is_real_target(target) -> bool:
    """True when ``target``'s config has SmolLM2-135M's shapes (:data:`TARGET_SHAPE`)."""
    cfg = target.config
    return all(getattr(cfg, k, None) == v for k, v in TARGET_SHAPE.items())


def load_eagle_head(target, path: str | Path = HEAD_FILE, sha256: str | None = HEAD_SHA256) -> EagleDraft:
    """The trained head as an :class:`EagleDraft` of ``target`` (its device and dtype).

    Raises :class:`HeadMismatch` when the file's SHA-256 is not ``sha256`` (``None`` skips the
    check, for a head just trained) or ``target`` lacks SmolLM2-135M's shapes;
    ``FileNotFoundError`` naming the file and ``python -m refspec train-draft`` when it is absent.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no trained EAGLE head (python -m refspec train-draft writes one)")
    if not is_real_target(target):
        raise HeadMismatch(f"the head was trained for SmolLM2-135M ({TARGET_SHAPE}); the target has "
                           f"{ {k: getattr(target.config, k, None) for k in TARGET_SHAPE} }")
    got = sha256_file(path)
    if sha256 is not None and got != sha256:
        raise HeadMismatch(f"{path}: sha256 {got} is not the committed head's {sha256}")
    head = EagleDraft(target)
    p = next(target.parameters())
    state = {k: v.to(p.dtype) for k, v in load_file(str(path)).items()}
    head.load_state_dict(state, strict=True)
    return head.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)


def real_draft(spec, target):
    """``"eagle"`` with the real model -> :func:`load_eagle_head`; anything else unchanged."""
    if spec == "eagle" and is_real_target(target):
        return load_eagle_head(target)
    return spec
