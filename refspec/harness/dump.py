"""Check FA3 attention metadata dumped from an SGLang run, with refspec's validators.

A dump is one JSON object per attention-backend call, holding what SGLang's FA3 backend reads,
under SGLang's field names (``ForwardBatch`` in ``python/sglang/srt/model_executor/forward_batch_info.py``,
``FlashAttentionMetadata`` in ``python/sglang/srt/layers/attention/flashattention_backend.py``,
https://github.com/sgl-project/sglang/blob/0bfe1d145/python/sglang/srt/layers/attention/flashattention_backend.py)::

    {"forward_mode": "DRAFT_EXTEND_V2",        # ForwardMode name
     "page_size": 4,                           # tokens per page (server_args.page_size)
     "num_draft_tokens": 4,                    # N = Sd + 1 (TARGET_VERIFY, DRAFT_EXTEND_V2)
     "draft_step": null,                       # s of a draft decode step (speculative_step_id)
     "forward_batch": {"req_pool_indices": [..], "seq_lens": [..], "seq_lens_cpu": [..],
                       "out_cache_loc": [..], "positions": [..],
                       "extend_seq_lens": [..],      # EXTEND, DRAFT_EXTEND_V2
                       "num_accept_tokens": [..]},   # DRAFT_EXTEND (v1): a = n + 1
     "req_to_token": {"3": [slot, ...], ...},  # each used row, at least its first K_b entries
     "metadata": {"cache_seqlens_int32": [..], "cu_seqlens_q": [..], "cu_seqlens_k": [..],
                  "max_seq_len_q": 4, "max_seq_len_k": 16, "page_table": [[page, ...], ...]}}

Units: ``out_cache_loc`` and ``req_to_token`` hold slots, ``page_table`` pages, the lengths tokens.
:func:`check` runs :func:`refspec.fa3.validate.validate_batch` and
:func:`~refspec.fa3.validate.validate_metadata` on it: a wrong dump raises the
:class:`~refspec.core.invariants.InvariantError` of the rule it breaks (MD-005 for a double-counted
``cache_seqlens``, PA-002 for a page table holding slots, ...). :func:`from_built` writes a dump
of a refspec scenario in the same shape (``tutorials/09_check_a_dump.py`` uses both).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from refspec.core.batch import ForwardBatch
from refspec.core.modes import ForwardMode
from refspec.fa3.metadata import FlashAttentionMetadata
from refspec.fa3.validate import validate_batch, validate_metadata

BATCH_FIELDS = ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions")
METADATA_FIELDS = ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "max_seq_len_q", "max_seq_len_k",
                   "page_table")


@dataclass
class Dump:
    """A loaded dump: the batch, the metadata, ``req_to_token`` (int32 ``[rows, width]``, slots;
    rows not in the dump are zero) and the page size."""

    fb: ForwardBatch
    md: FlashAttentionMetadata
    req_to_token: torch.Tensor
    page_size: int


def _ints(d: dict, name: str, where: str) -> list[int]:
    if name not in d:
        raise ValueError(f"dump {where} has no field {name!r}")
    x = d[name]
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise ValueError(f"dump field {where}.{name} must be a list of ints, got {x!r:.80}")
    return x


def _int(d: dict, name: str, where: str, least: int) -> int:
    x = d.get(name)
    if not isinstance(x, int) or isinstance(x, bool) or x < least:
        raise ValueError(f"dump field {where}{name} must be an int >= {least}, got {x!r}")
    return x


def load(src: str | Path | dict) -> Dump:
    """A dump from a JSON file path or an already parsed dict. ValueError names a missing or
    malformed field (the rules themselves are checked by :func:`check`)."""
    d = src if isinstance(src, dict) else json.loads(Path(src).read_text(encoding="utf-8"))
    for key in ("forward_mode", "forward_batch", "req_to_token", "metadata"):
        if key not in d:
            raise ValueError(f"dump has no field {key!r}")
    try:
        mode = ForwardMode[d["forward_mode"]]
    except KeyError:
        raise ValueError(f"dump forward_mode {d['forward_mode']!r} is not one of "
                         f"{[m.name for m in ForwardMode]}") from None
    P = _int(d, "page_size", "", 1)
    b, m = d["forward_batch"], d["metadata"]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    i64 = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    f = {n: _ints(b, n, "forward_batch") for n in BATCH_FIELDS}
    extra = {}
    if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND_V2):
        e = _ints(b, "extend_seq_lens", "forward_batch")
        extra.update(extend_seq_lens=i32(e), extend_seq_lens_cpu=list(e))
    if mode == ForwardMode.DRAFT_EXTEND:
        a = _ints(b, "num_accept_tokens", "forward_batch")
        extra.update(num_accept_tokens=i32(a), num_accept_tokens_cpu=list(a))
    if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        extra["num_draft_tokens"] = _int(d, "num_draft_tokens", "", 1)
    if mode == ForwardMode.DECODE and d.get("draft_step") is not None:
        extra["draft_step"] = _int(d, "draft_step", "", 0)
    fb = ForwardBatch(mode, i64(f["req_pool_indices"]), i32(f["seq_lens"]), i64(f["seq_lens_cpu"]),
                      i64(f["out_cache_loc"]), i64(f["positions"]), **extra)
    pt = m.get("page_table")
    if not isinstance(pt, list) or not all(isinstance(r, list) for r in pt) or len({len(r) for r in pt}) > 1:
        raise ValueError("dump field metadata.page_table must be a list of equal-length lists of ints")
    md = FlashAttentionMetadata(i32(_ints(m, "cache_seqlens_int32", "metadata")),
                                i32(_ints(m, "cu_seqlens_q", "metadata")),
                                i32(_ints(m, "cu_seqlens_k", "metadata")), _int(m, "max_seq_len_q", "metadata.", 0),
                                _int(m, "max_seq_len_k", "metadata.", 0),
                                torch.tensor(pt, dtype=torch.int32).reshape(len(pt), -1))
    rows = {}
    for r in d["req_to_token"]:
        if not str(r).isdigit():
            raise ValueError(f"dump req_to_token row key {r!r} is not a row index")
        rows[int(r)] = _ints(d["req_to_token"], r, "req_to_token")
    width = max([len(s) for s in rows.values()] + [md.page_table.shape[1] * P, 1])
    r2t = torch.zeros(max(list(rows) + f["req_pool_indices"] + [0]) + 1, width, dtype=torch.int32)
    for r, slots in rows.items():
        r2t[r, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return Dump(fb, md, r2t, P)


def check(dump: Dump | str | Path | dict) -> None:
    """Run refspec's FA3 checks on a dump. Raises the violated rule's ``InvariantError`` (or
    ValueError for a malformed dump); returns None when every rule holds."""
    d = dump if isinstance(dump, Dump) else load(dump)
    validate_batch(d.fb, d.req_to_token)
    validate_metadata(d.md, d.fb, d.req_to_token, d.page_size)


def from_built(built, metadata: FlashAttentionMetadata | None = None, note: str = "") -> dict:
    """A dump (dict) of a built :class:`refspec.harness.scenario.Scenario` and its eager FA3
    metadata (``built.run_fa3()`` first, or pass ``metadata``)."""
    fb, md = built.fb, metadata or built.extra["metadata"]
    rows = fb.req_pool_indices.tolist()
    batch = {n: getattr(fb, n).tolist() for n in BATCH_FIELDS}
    if fb.extend_seq_lens is not None:
        batch["extend_seq_lens"] = fb.extend_seq_lens.tolist()
    if fb.num_accept_tokens_cpu is not None and fb.forward_mode == ForwardMode.DRAFT_EXTEND:
        batch["num_accept_tokens"] = list(fb.num_accept_tokens_cpu)
    meta = {n: getattr(md, n).tolist() if torch.is_tensor(getattr(md, n)) else int(getattr(md, n))
            for n in METADATA_FIELDS}
    return {"note": note, "forward_mode": fb.forward_mode.name, "page_size": built.sc.page_size,
            "num_draft_tokens": fb.num_draft_tokens, "draft_step": fb.draft_step, "forward_batch": batch,
            "req_to_token": {str(r): built.kv.req_to_token[r, :k].tolist() for r, k in zip(rows, built.K)},
            "metadata": meta}
