"""The trained EAGLE head for SmolLM2-135M-Instruct that ships with refspec.

``refspec/real/heads/smollm2-135m-eagle.safetensors`` holds the head's own parameters (``fc``,
the decoder ``layer``, ``norm``; bf16) of a :class:`refspec.model.drafts.EagleDraft` trained by
``python -m refspec train-draft`` (:mod:`refspec.real.draft_train`); the embedding and the LM
head are the target's (tied, shared).  Its card (the ``.json`` beside it) records the data, the
recipe, the steps, the seed, the held-out metrics and the commit it was trained at.

:func:`load_eagle_head` checks the file's SHA-256 against :data:`HEAD_SHA256` before loading, so a
changed or truncated file is refused by name rather than drafting silently worse.
:func:`load_head` loads any head ``train-draft`` wrote (the file's metadata names its kind:
:class:`~refspec.model.drafts.EagleDraft` or, with ``--kind eagle3``,
:class:`~refspec.model.drafts.Eagle3Draft` and its ``aux_layers``).
:func:`real_draft` is what the real-weights commands call: ``"eagle"`` with the real model means
the committed head, ``"eagle3:PATH"`` (or ``"eagle:PATH"``) the head file at PATH; every other
spec is returned unchanged for :func:`refspec.model.drafts.make_draft`.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import json
from pathlib import Path


from refspec.model.drafts import Eagle3Draft, EagleDraft
from refspec.real.draft_train import sha256_file

HEAD_FILE = Path(__file__).with_name("heads") / "smollm2-135m-eagle.safetensors"
#: the committed head's SHA-256 (its card's ``sha256``)
HEAD_SHA256 = "7476513b8d4ecdfca7a163a461a17f92a1d9966b67b2f8ecec6c6ae0b46a3b26"
TARGET_SHAPE = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "intermediate_size": 1536, "vocab_size": 49152}


class HeadMismatch(ValueError):
    """The head file's hash, or the target it is loaded for, is not the one it was trained for."""


def head_card(path: str | Path = HEAD_FILE) -> dict:
    """The JSON card beside a head file (``{}`` if there is none).  Raises :class:`HeadMismatch`
    naming the card when it is not a JSON object."""
    card = Path(path).with_suffix(".json")
    if not card.exists():
        return {}
    try:
        data = json.loads(card.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise HeadMismatch(f"{card}: the head's card is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HeadMismatch(f"{card}: the head's card must be a JSON object, got {type(data).__name__}")
    return data


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


def head_kind(path: str | Path) -> tuple[str, tuple[int, ...] | None]:
    """``("eagle", None)`` or ``("eagle3", aux_layers)`` from a head file's safetensors metadata
    (:func:`refspec.real.draft_train.head_metadata`).  Raises :class:`HeadMismatch` for a file
    whose metadata names no refspec head or malformed ``aux_layers``, or that is no readable
    safetensors file (truncated, another format); ``FileNotFoundError`` when it is absent."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such head file (python -m refspec train-draft writes one)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        raise HeadMismatch(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    structure = meta.get("structure")
    if structure == "refspec EagleDraft":
        return "eagle", None
    if structure == "refspec Eagle3Draft" and meta.get("aux_layers"):
        try:
            return "eagle3", tuple(int(x) for x in meta["aux_layers"].split(","))
        except ValueError:
            raise HeadMismatch(f"{path}: metadata aux_layers {meta['aux_layers']!r} is not comma-separated "
                               "ints") from None
    raise HeadMismatch(f"{path}: not a refspec head file (metadata structure {structure!r})")


def load_head(target, path: str | Path, sha256: str | None = None) -> EagleDraft | Eagle3Draft:
    """Any head file ``train-draft`` wrote, as the draft its metadata names (:func:`head_kind`), on
    ``target``'s device and dtype.  ``sha256``: the file's expected hash (None: checked against
    its card beside it, when there is one).  Raises :class:`HeadMismatch` for a hash that differs,
    or a head whose shapes do not fit ``target`` or whose target is no Llama model (naming the
    file); ``FileNotFoundError``."""
    from safetensors.torch import load_file

    from refspec.model.llama import LlamaModel

    path = Path(path)
    kind, aux = head_kind(path)
    if not isinstance(target, LlamaModel):
        raise HeadMismatch(f"{path}: an {kind} head drafts for a LlamaModel target, got {type(target).__name__}")
    got = sha256_file(path)
    want = sha256 or head_card(path).get("sha256")
    if want is not None and got != want:
        raise HeadMismatch(f"{path}: sha256 {got} is not {want} ({'given' if sha256 else 'its card'}'s)")
    try:
        head = Eagle3Draft(target, aux_layers=aux) if kind == "eagle3" else EagleDraft(target)
        p = next(target.parameters())
        head.load_state_dict({k: v.to(p.dtype) for k, v in load_file(str(path)).items()}, strict=True)
    except (RuntimeError, ValueError) as e:
        raise HeadMismatch(f"{path}: this {kind} head does not fit the target "
                           f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    return head.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)


def real_draft(spec, target):
    """``"eagle"`` with the real model -> :func:`load_eagle_head`; ``"eagle3:PATH"`` /
    ``"eagle:PATH"`` -> :func:`load_head` of that file (which must hold that kind); anything else
    unchanged.  Raises :class:`HeadMismatch` for a file of the other kind."""
    if spec == "eagle" and is_real_target(target):
        return load_eagle_head(target)
    name, colon, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if name in ("eagle", "eagle3") and arg:
        kind, _ = head_kind(arg)
        if kind != name:
            raise HeadMismatch(f"{arg}: holds an {kind} head, not {name} (use --draft {kind}:{arg})")
        return load_head(target, arg)
    return spec
