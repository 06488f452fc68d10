"""CUDA graphs of the production top-k > 1 loop (capture + padded in-place replay).

The v1 draft extend is the chain's DRAFT_EXTEND graph (captured at ``Sd + 1`` rows per
request: a tree path has at most that many tokens).  The tree verify and tree draft-decode
graphs are captured here when available (see :func:`capture_tree_graphs`).
"""

from __future__ import annotations

import torch

from refspec.core.modes import ForwardMode
from refspec.graphs.runner import GraphRunner


def capture_tree_graphs(runners, capture_bs, dtype) -> None:
    """Capture the graphs of a :class:`~refspec.speculative.tree_runners.TreeRunners`."""
    ids, E = ((), torch.long), runners.target.config.hidden_size
    hidden = {"hidden": ((E,), dtype)} if runners.draft.uses_hidden else {}
    runners.graph["draft_extend"] = GraphRunner(
        ForwardMode.DRAFT_EXTEND, [runners.draft_be], runners._draft_extend_fn, kv=runners.kv,
        capture_bs=capture_bs, tokens_per_req=runners.Sd + 1, inputs={"ids": ids, **hidden},
        num_draft_tokens=runners.Sd + 1)
