"""The oracle top-k tree loop: one request, dense slots, every attention row's keys listed.

EAGLE v1 (and v2) with ``topk = k``, ``num_steps = Sd``, ``num_draft_tokens = N`` (module
:mod:`refspec.oracle.tree` for the tree rule).  Each model (target, draft) has one slot store
(:class:`SlotKV`): the committed KV of KV index p sits at slot p (KV index = RoPE position,
SD-007); the draft's branch rows get scratch slots above the committed region.  Every forward
names each row's keys outright and attends with
:func:`~refspec.oracle.slots.attention_over_slots`, so the rule is the key lists below and
nothing else.

One round at committed length L (t_0..t_(L-1) have target and draft KV; the root t_L is known;
the draft extend of the previous round left ``topk_p, topk_index`` and a hidden state):

1. draft decode (TR-001, TR-008): the k root children form the frontier; at step s = 0..Sd-2
   frontier row t runs its token at position L + s, writes its KV at its own scratch slot
   ``(t, s)`` and attends to the prefix 0..L-1 plus the slots row t wrote at steps 0..s (its row
   history, which after re-ranking need not be its tree ancestors); then the frontier expands.
2. select and build the tree (TR-002..TR-005): N nodes, node i at position L + depth(i).
3. verify: the target runs the N nodes, node i writing its KV at slot L + i and attending to
   the prefix, its ancestors and itself; ``p_i`` = argmax of row i.
4. accept (TR-006) and commit (TR-007): the path's KV moves to slots L..L+a-1 (its depths are
   0..n, so its RoPE positions are already right); the round emits the n accepted drafts and
   the bonus; the v1 draft extend runs those a tokens at draft KV L..L+a-1 with the target
   hidden of the path nodes and keeps its last row: its softmax top-k are the next root
   children.  v2 runs all N rows at L..L+N-1 with the path compacted to the front (upstream
   ``_compact_accept_to_front``) and keeps row a - 1; rows >= a cannot reach it (SD-006).

Upstream (sgl-project/sglang, at the release tags linked):

* https://github.com/sgl-project/sglang/blob/v0.5.12.post1/python/sglang/srt/speculative/eagle_worker.py#L935
  (v1, last released in v0.5.12.post1)
  ``EAGLEWorker.draft_forward`` (the step loop, ``out_cache_loc`` ``[bs, topk, num_steps]``),
  ``EAGLEWorker.verify`` (``hidden_states[accepted_indices]``), ``forward_draft_extend_after_decode``,
  ``capture_for_decode`` (softmax, then top-k);
* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/layers/attention/flashattention_backend.py#L990
  ``FlashAttentionBackend.init_forward_metadata`` (draft decode, ``topk > 1``: prefix over
  ``seq_lens``, expand page table = the row's own ``cache_loc[:, :speculative_step_id + 1]``) and
  ``forward_decode`` / ``forward_extend`` (prefix + expand merged by ``merge_state_v2``).

* https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/speculative/eagle_worker_common.py#L524
  v2: ``_compact_accept_to_front`` (path KV, predict and hidden
  to the front of the request's N-row block) and ``prepare_for_draft_extend``
  (``DRAFT_EXTEND_V2`` over the N window rows).

Where refspec differs: step s runs at position L + s (SD-007; upstream adds 1 to its positions
before every step), and the path's KV is copied between dense slots (upstream moves slots /
pages, the FA3 tree path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refspec.core.args import tree_args
from refspec.oracle.loop import _check_request, _emit
from refspec.oracle.dense import draft_kv_dims, target_kv_dims
from refspec.oracle.slots import attention_over_slots
from refspec.oracle.tree import (
    Tree,
    build_tree,
    expand,
    greedy_accept,
    root_children,
    select,
    verify_key_slots,
)


@dataclass
class SlotBatch:
    """A forward in the slot oracle: ``positions [T]`` int64 (RoPE), ``out_slots [T]`` (where
    row t's K/V is written), ``key_slots[t]`` (the slots row t attends, its own included)."""

    positions: torch.Tensor
    out_slots: list[int]
    key_slots: list[list[int]]

    @classmethod
    def causal(cls, start: int, length: int, device="cpu") -> SlotBatch:
        """KV indices ``start .. start+length-1`` at slots = positions; row j sees ``0 .. start+j``."""
        pos = list(range(start, start + length))
        return cls(torch.tensor(pos, dtype=torch.long, device=device), pos, [list(range(p + 1)) for p in pos])


class SlotKV:
    """Per-layer K ``[num_slots, Hkv, D]`` and V ``[num_slots, Hkv, Dv]`` (zeros at start) of one
    model, one request (Dv: ``v_head_dim``, default D; an MLA model's naive form, as the dense oracle)."""

    def __init__(self, num_layers, num_slots, num_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 v_head_dim: int | None = None):
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape[:2] + (v_head_dim or head_dim,), dtype=dtype, device=device)
                  for _ in range(num_layers)]

    @classmethod
    def of(cls, dims, num_slots: int, like: torch.Tensor) -> "SlotKV":
        """A store of ``dims = (layers, Hkv, D, Dv)`` (:func:`~refspec.oracle.dense.target_kv_dims`)
        in ``like``'s dtype and device."""
        layers, num_kv_heads, head_dim, v_head_dim = dims
        return cls(layers, num_slots, num_kv_heads, head_dim, like.dtype, like.device, v_head_dim=v_head_dim)

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots ``src`` to ``dst`` in every layer (gathered first, then written)."""
        for K, V in zip(self.k, self.v):
            K[dst], V[dst] = K[src].clone(), V[src].clone()


class SlotBackend:
    """``forward(q, k, v, layer, fb)``: store k/v at ``fb.out_slots``, then attend each row to
    exactly ``fb.key_slots[t]`` (fp32, returned in ``q.dtype``)."""

    name = "slots"

    def __init__(self, kv: SlotKV):
        self.kv = kv

    def forward(self, q, k, v, layer, fb: SlotBatch):
        K, V = self.kv.k[layer.layer_id], self.kv.v[layer.layer_id]
        K[fb.out_slots] = k.to(K.dtype)  # store ...
        V[fb.out_slots] = v.to(V.dtype)
        return attention_over_slots(q, K, V, fb.key_slots, softmax_scale=layer.softmax_scale)  # ... attend


@dataclass
class TreeSpecResult:
    """One request's tree run: generated ``tokens``; per verify round ``accepts`` (a), ``drafts``
    (the N-1 draft tokens in node order), ``emitted`` (tokens appended to the output), ``paths``
    (accepted node ids, root first) and ``trees`` (the :class:`~refspec.oracle.tree.Tree`)."""

    tokens: list[int]
    accepts: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)
    trees: list[Tree] = field(default_factory=list)


def _compact_to_front(emitted: list[int], path: list[int], predict: list[int], Sd: int, N: int):
    """v2 draft-extend rows (upstream ``_compact_accept_to_front``): row j < a holds the path's
    j-th emitted token and the hidden state of path node j; rows a..Sd (padded accept entries)
    repeat node 0, rows Sd+1..N-1 keep their own node.  Non-path rows take the target argmax as
    their token.  Returns (tokens [N], hidden-state node ids [N])."""
    a = len(path)
    nodes = (path + [0] * (Sd + 1 - a))[:N] + list(range(Sd + 1, N))
    return emitted + [predict[i] for i in nodes[a:]], nodes


def _topk_probs(logits_row: torch.Tensor, k: int):
    """The draft's softmax top-k of one row (fp32): ``(topk_p [k], topk_index [k])``."""
    p, i = torch.topk(torch.softmax(logits_row.float(), dim=-1), k)
    return p, i


@torch.no_grad()
def speculative_tree_greedy(target, draft, prompt: list[int], *, num_steps: int, topk: int,
                            num_draft_tokens: int, max_new_tokens: int, version: str = "v1",
                            eos: int | None = None, rid: int = 0) -> TreeSpecResult:
    """EAGLE top-k tree speculative decoding of one request (module doc for the round).

    Args:
        target: a :class:`~refspec.model.llama.LlamaModel`; draft: a draft (:mod:`refspec.model.drafts`).
        num_steps: Sd draft steps; topk: k branches; num_draft_tokens: N tree nodes verified
            (root included).  max_new_tokens, eos: as :func:`refspec.oracle.loop.greedy`.
        version: "v1" (draft extend over the a committed tokens) or "v2" (over all N rows, the
            path compacted to the front, keeping row a - 1).
        rid: the request id (reported only).
    Returns: :class:`TreeSpecResult` (ints; fp32 on the model's device).
    Raises: ValueError for a bad request or k / Sd / N (TR-002: ``N - 1 <= k + (Sd-1) k^2``).
    """
    tree_args(topk, num_steps, num_draft_tokens)
    if topk > target.config.vocab_size:
        raise ValueError(f"topk k = {topk} > vocab_size V = {target.config.vocab_size}: a draft step's top-k "
                         f"is over the V tokens (TR-001)")
    if version not in ("v1", "v2"):
        raise ValueError(f"version must be 'v1' or 'v2', got {version!r}")
    _check_request(prompt, max_new_tokens)
    k, Sd, N = topk, num_steps, num_draft_tokens
    like = next(target.parameters())
    dev = like.device
    max_len = len(prompt) + max_new_tokens + N  # committed region: L + N <= max_len in every round
    tkv = SlotKV.of(target_kv_dims(target), max_len, like)
    dkv = SlotKV.of(draft_kv_dims(draft), max_len + k * Sd, like)
    tbe, dbe = SlotBackend(tkv), SlotBackend(dkv)
    use_h = draft.uses_hidden
    # the target hidden states the draft reads: None = the last (EAGLE), else EAGLE-3's layers
    # (the oracle reads the attribute itself: it imports nothing above the core)
    aux = getattr(draft, "aux_layers", None) if draft.uses_hidden else None

    def ids(xs):
        return torch.as_tensor(xs, dtype=torch.long, device=dev)

    # prefill: target KV 0..p-1; its last row gives t_p (emitted, the first root)
    p = L = len(prompt)
    logits, h = target(ids(prompt), SlotBatch.causal(0, p, dev), tbe, aux=aux)
    tokens = list(prompt) + [int(logits[-1].argmax())]
    res = TreeSpecResult(tokens=[])
    _, done = _emit(res.tokens, tokens[-1:], max_new_tokens, eos)
    # draft prefill (EAGLE shift): draft KV j consumes t_(j+1) and h_j; the last row seeds round 1
    dl, dh = draft.forward(ids(tokens[1:]), h if use_h else None, SlotBatch.causal(0, p, dev), dbe)
    topk_p, topk_index = _topk_probs(dl[-1], k)
    root_hidden = dh[-1]

    while not done:
        # 1. draft decode: Sd - 1 forwards over the k frontier rows (TR-001, TR-008)
        cands, front = root_children(topk_p, topk_index)
        row_hidden = root_hidden[None].expand(k, -1)  # step 0: every root child takes the root's
        row_slots: list[list[int]] = [[] for _ in range(k)]
        prefix = list(range(L))
        for s in range(Sd - 1):
            out = [max_len + t * Sd + s for t in range(k)]  # row t's own slot at step s
            for t in range(k):
                row_slots[t].append(out[t])
            fb = SlotBatch(torch.full((k,), L + s, dtype=torch.long, device=dev), out,
                           [prefix + row_slots[t] for t in range(k)])
            dl, hid = draft.forward(front.tokens.to(dev), row_hidden if use_h else None, fb, dbe)
            cp, ci = torch.topk(torch.softmax(dl.float(), dim=-1), k)  # [k, k]
            front = expand(cands, front, s + 1, cp, ci)
            row_hidden = hid[front.parent_row]  # hidden states follow the parent row
        # 2. the tree (TR-002..TR-005)
        tree = build_tree(tokens[L], cands, select(cands, N), L)
        # 3. verify: node i at slot L + i, position L + depth(i), keys prefix + ancestors + self
        node_slots = [L + i for i in range(N)]
        fb = SlotBatch(ids(tree.positions), node_slots, verify_key_slots(tree, prefix, node_slots))
        vl, vh = target(ids(tree.tokens), fb, tbe, aux=aux)
        predict = vl.argmax(-1).tolist()
        acc = greedy_accept(tree, predict)
        # 4. commit the path (TR-007): target KV to L..L+a-1, then the draft extend
        a = acc.a
        tkv.move([node_slots[i] for i in acc.path], list(range(L, L + a)))
        new = acc.emitted  # t_(L+1)..t_(L+a); the last one is the bonus
        if version == "v1":  # the a committed tokens, hidden of the path nodes; keep the last row
            rows, hid_rows = new, acc.path
        else:  # v2: all N rows, the path compacted to the front (rows >= a cannot reach row a-1)
            rows, hid_rows = _compact_to_front(new, acc.path, predict, Sd, N)
        dl, dh = draft.forward(ids(rows), vh[hid_rows] if use_h else None, SlotBatch.causal(L, len(rows), dev), dbe)
        topk_p, topk_index = _topk_probs(dl[a - 1], k)
        root_hidden = dh[a - 1]
        tokens += new
        L += a
        emitted, done = _emit(res.tokens, new, max_new_tokens, eos)
        res.accepts.append(a)
        res.drafts.append(tree.tokens[1:])
        res.emitted.append(emitted)
        res.paths.append(acc.path)
        res.trees.append(tree)
    return res
