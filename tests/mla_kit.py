"""Set-up shared by the DeepSeek / MTP tests (not a test module): the tiny MLA target, an MTP draft
whose drafts the target accepts, the prompts and the plain-greedy reference.

Used by ``test_deepseek_model.py``, ``test_mtp_draft.py`` and ``test_mla_lossless.py``.

A random MTP layer almost never guesses the target's next-but-one token (accept length 1 in
nearly every round), which would leave the multi-token paths of the loops (the accepted run, the
tree's path compaction, the MLA rows it moves, ML-012) unexercised.  :func:`accepting_mtp` gives the
MTP layer the target's first decoder layer and an ``eh_proj`` that passes the embedding half
through (``[I | g I]``): over the EAGLE shift (draft KV index p consumes t_(p+1)) it then runs like
a one-layer early exit of the target, and the target accepts 2..4 tokens in many rounds
(measured: ``test_mla_lossless.py`` asserts it).  The hidden half still enters (``g`` = 0.3), so
the target hidden reaches the draft in every forward and the order of the two halves matters.
"""

from __future__ import annotations

import functools
import random

import torch

from refspec.model.deepseek import DeepseekModel, tiny_deepseek_config
from refspec.model.deepseek_nextn import MTPDraft
from refspec.model.llama import init_random_
from refspec.speculative import greedy_reference

#: the tiny target's seed: its greedy margins over the prompts below stay >= 1e-2 (fp32 noise ~1e-6)
SEED = 2
PROMPT_LENS = [3, 9, 14, 5, 17]  # crosses page boundaries for P = 4, 16
BUDGETS = [14, 9, 16, 11, 13]  # different lengths: requests leave the batch mid-run
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def target() -> DeepseekModel:
    return init_random_(DeepseekModel(tiny_deepseek_config()), seed=SEED).eval()


def accepting_mtp(model: DeepseekModel, hidden_gain: float = 0.3, cls=MTPDraft) -> MTPDraft:
    """An MTP draft (``cls``: MTPDraft or a test variant) with the target's layer 0 as its decoder and
    ``eh_proj = [I | hidden_gain * I]`` (module doc); every other weight from the random init."""
    d = cls(model, seed=1)
    E = model.config.hidden_size
    sd = {f"model.decoder.{k}": v for k, v in model.model.layers[0].state_dict().items()}
    sd["model.eh_proj.weight"] = torch.cat([torch.eye(E), hidden_gain * torch.eye(E)], dim=1)
    missing, unexpected = d.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.split(".")[1] in ("enorm", "hnorm", "shared_head") for k in missing), missing
    return d


@functools.lru_cache(maxsize=None)
def draft() -> MTPDraft:
    return accepting_mtp(target())


@functools.lru_cache(maxsize=None)
def reference() -> dict[int, list[int]]:
    return greedy_reference(target(), PROMPTS, [b + 8 for b in BUDGETS])  # + N: the last round's drafts


def baseline(bs: int) -> list[list[int]]:
    """Plain greedy output of the first ``bs`` prompts, each to its budget."""
    return [reference()[i][len(PROMPTS[i]):len(PROMPTS[i]) + BUDGETS[i]] for i in range(bs)]
