"""SmolLM2's tokenizer, rebuilt from the GGUF with the ``tokenizers`` library, and ChatML.

The GGUF stores ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE), ``tokenizer.ggml.pre =
"smollm"``, 49 152 tokens, 48 900 merges and a ``token_type`` per token.  The pipeline mirrors
SmolLM2's ``tokenizer.json``:

* no normaliser;
* pre-tokeniser: ``Digits(individual_digits=True)`` (every digit is its own piece), then
  ``ByteLevel(add_prefix_space=False, use_regex=True)`` (GPT-2 regex + byte-to-unicode map);
* model: BPE over the stored vocab and merges (no unk token, no byte fallback);
* the 17 control tokens (``token_type == 3``: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1,
  ``<|im_end|>`` = 2, ``<repo_name>`` ...) are special added tokens, matched verbatim in the text;
* decoder: ``ByteLevel``.

No BOS is prepended (``add_bos_token = False``); ChatML supplies ``<|im_start|>`` itself.

Caveat (a property of SmolLM2's vocabulary, shared by HF's ``tokenizer.json``): 21 of the 256
byte-level symbols are absent -- the control bytes 0x04 0x06 0x13 0x14 0x16 0x1D, the never-valid
UTF-8 bytes 0xC0 0xC1 0xF5-0xFF, and the lead bytes 0xF1 0xF2 (code points U+40000-U+BFFFF).
With no unk token, BPE silently drops such bytes, so text containing them does not round-trip;
:func:`unrepresentable_bytes` lists them and :func:`representable` checks a string.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

from refspec.real.assets import INSTALL_HINT, RealAssetsMissing, verify_gguf

ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2  #: the EOS of the instruct model's turns
EOS_ID = IM_END_ID
CONTROL_TOKEN_TYPE = 3  #: llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def build_tokenizer(tokens: Sequence[str], merges: Iterable[str], token_types: Sequence[int]):
    """A ``tokenizers.Tokenizer`` from GGUF vocab arrays (see module doc for the pipeline).

    ``tokens[i]`` is the byte-level string of id i, ``merges`` are ``"left right"`` strings in
    rank order, ``token_types[i] == 3`` marks a control (special) token.
    Raises ``ValueError`` on duplicate tokens or mismatched lengths.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if len(tokens) != len(token_types):
        raise ValueError(f"{len(tokens)} tokens but {len(token_types)} token types")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate tokens in the GGUF vocabulary")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, token_types) if int(ty) == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    for t in special:  # added tokens must keep their vocabulary ids
        if tok.token_to_id(t) != vocab[t]:
            raise ValueError(f"special token {t!r} got id {tok.token_to_id(t)}, vocab says {vocab[t]}")
    return tok


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The SmolLM2-135M-Instruct ``tokenizers.Tokenizer`` built from the pinned GGUF (cached).

    Raises :class:`RealAssetsMissing` if ``gguf`` / ``tokenizers`` or the GGUF are missing.
    """
    try:
        import gguf
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise RealAssetsMissing(f"{e.name} is missing; {INSTALL_HINT}") from None
    r = gguf.GGUFReader(str(verify_gguf()))
    fields = {k: r.fields[f"tokenizer.ggml.{k}"].contents() for k in ("model", "tokens", "merges", "token_type")}
    if fields["model"] != "gpt2":
        raise RealAssetsMissing(f"GGUF tokenizer model is {fields['model']!r}, expected 'gpt2' (byte-level BPE)")
    return build_tokenizer(fields["tokens"], fields["merges"], fields["token_type"])


@functools.lru_cache(maxsize=1)
def _plain_tokenizer():
    """A copy of the tokenizer that tokenises control-token strings as ordinary text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(smollm2_tokenizer().to_str())
    tok.encode_special_tokens = True
    return tok


def encode(text: str, *, special: bool = True) -> list[int]:
    """Token ids of ``text`` (no BOS added).

    ``special=True``: control-token strings in ``text`` (``<|im_start|>``...) become their ids;
    ``special=False``: they are tokenised as plain text (use this for untrusted user content).
    Shapes: returns T token ids (``list[int]``, each in [0, 49152)).
    """
    tok = smollm2_tokenizer() if special else _plain_tokenizer()
    return tok.encode(text, add_special_tokens=False).ids


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> unicode map used by byte-level BPE (printable bytes map to themselves,
    the other 68 to U+0100.. in byte order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(0x100 + i) for i, b in enumerate(rest)}}


@functools.lru_cache(maxsize=1)
def unrepresentable_bytes() -> frozenset[int]:
    """Byte values whose byte-level symbol is not in the vocabulary (silently dropped by :func:`encode`)."""
    vocab = smollm2_tokenizer().get_vocab()
    return frozenset(b for b, sym in byte_symbols().items() if sym not in vocab)


def representable(text: str) -> bool:
    """True iff ``decode(encode(text)) == text`` is guaranteed (no byte of its UTF-8 is dropped)."""
    return not (set(text.encode("utf-8")) & unrepresentable_bytes())


def decode(ids: Sequence[int], *, skip_special: bool = False) -> str:
    """Text of token ids; control tokens kept unless ``skip_special``.

    Shapes: ``ids`` T token ids -> one ``str``.  Inverse of :func:`encode` for every
    :func:`representable` text.
    """
    return smollm2_tokenizer().decode(list(ids), skip_special_tokens=skip_special)


def chatml(user: str | Sequence[tuple[str, str]], *, system: str | None = SYSTEM_PROMPT,
           add_generation_prompt: bool = True) -> str:
    """SmolLM2's chat template rendered as text.

    ``user`` is the user message, or a list of ``(role, content)`` turns.  Each turn is
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the default system turn comes first (as the
    GGUF's ``tokenizer.chat_template`` adds it when the first turn is not a system turn); with
    ``add_generation_prompt`` the text ends with ``<|im_start|>assistant\\n``.  ``system=None``
    omits the system turn.
    """
    turns = [("user", user)] if isinstance(user, str) else list(user)
    if system is not None and (not turns or turns[0][0] != "system"):
        turns.insert(0, ("system", system))
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def chat_ids(user: str | Sequence[tuple[str, str]], *, system: str | None = SYSTEM_PROMPT) -> list[int]:
    """Token ids of :func:`chatml` ``(user, system=system)``, ending with the assistant cue.

    Message contents are tokenised as plain text (a ``<|im_end|>`` typed by the user is not a
    control token); only the template's own markers are ids 1 / 2.
    Shapes: returns T prompt token ids (``list[int]``), the last four ``<|im_start|>assistant\\n``.
    """
    turns = [("user", user)] if isinstance(user, str) else list(user)
    if system is not None and (not turns or turns[0][0] != "system"):
        turns.insert(0, ("system", system))
    ids: list[int] = []
    for role, content in turns:
        ids += [IM_START_ID] + encode(f"{role}\n{content}", special=False) + [IM_END_ID] + encode("\n")
    return ids + [IM_START_ID] + encode("assistant\n")
