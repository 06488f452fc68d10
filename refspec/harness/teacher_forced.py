"""Teacher-forced acceptance: the accept lengths a draft gets on a *fixed* text.

Speculative greedy decoding is lossless (SD-002), so its output is the target's greedy text and
each round's accept length a depends only on that text and the draft.  Fixing the text (the
target's greedy continuation of each prompt, computed once) makes drafts, page sizes, providers
and arithmetic (FA3 vs the emulator, compiled vs eager) comparable on the same tokens: a change
of accept length is then the draft's, never a different text's.

The round at committed length L (the oracle loop's round, :mod:`refspec.oracle.loop`) is
recomputed for *every* L at once:

* the target's hidden ``h_j`` over the whole text, one dense forward;
* the draft's extend over the whole text (draft KV index j consumes ``t_(j+1)`` and ``h_j``,
  SD-007): its row L-1 gives ``d_1`` of the round at L, and its KV is what any draft decode
  step of that round reads below index L (draft extends only ever write committed tokens there);
* Sd - 1 draft decode steps for all L in parallel: the step at index L+s reads keys ``0..L-1``
  of the extend and its own earlier steps' keys ``L..L+s`` (:class:`BranchBackend`);
* n(L) = the longest prefix of ``d_1..d_Sd`` equal to ``t_(L+1)..t_(L+Sd)``, a = n + 1.

Then the rounds are walked from L = len(prompt): a = n(L) + 1, L += a, until the budget or EOS
stops the request, as :func:`refspec.oracle.loop.speculative_greedy` does (its accepts list and
this one agree for chain drafts, v1 and v2: the kept draft-extend row sees committed tokens only).

Top-k > 1 trees (:func:`teacher_forced_tree_accepts`, docs/spec/tree.md) use the same extend:
the round at L takes its k root children from the softmax top-k of the extend's row L-1 (TR-001),
then Sd - 1 draft steps over k frontier rows per round, all rounds in parallel; row t of a round
feeds its frontier token at position L + s with the draft hidden state that produced it (its
parent row's output; the extend's row L-1 at step 0) and sees keys ``0..L-1`` of the extend plus
the keys *its row* kept at steps 0..s (TR-008, the same :class:`BranchBackend`); the frontier is
re-ranked by cumulative score after every step (the oracle's :func:`refspec.oracle.tree.expand`).
The N - 1 drafts are selected and linked by the oracle's ``select`` / ``build_tree`` (TR-002,
TR-003) and accepted greedily along the text (TR-006): the target's argmax at a node on the text
at depth d is ``t_(L+d+1)``.  Round by round a tree accepts at least the chain's drafts only when
it holds the chain's path computed the chain's way (docs/eagle-head.md, "Tree acceptance").

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from einops import einsum, repeat

from refspec.core.args import tree_args
from refspec.model.drafts import aux_layers
from refspec.oracle.dense import DenseBackend, DenseBatch, DenseKV
from refspec.oracle.tree import Acceptance, Candidates, Tree, build_tree, expand, greedy_accept, root_children, select


@dataclass
class BranchBatch:
    """One decode step for many rounds at once: ``positions [S]`` = KV index of each round's
    query (``starts + s``), ``starts [S]`` = each round's committed length L."""

    positions: torch.Tensor
    starts: torch.Tensor


class BranchBackend:
    """Draft decode steps of many rounds in parallel over one shared draft-extend KV.

    ``forward(q, k, v, layer, fb)`` with ``q [S, H, D]``, ``k, v [S, Hkv, D]`` (one row per
    round): keeps k / v as that round's newest key, then attends to the extend's keys
    ``0..L-1`` (``prefix`` :class:`~refspec.oracle.dense.DenseKV`) and every key this round
    kept so far.  Returns ``[S, H, D]`` in ``q.dtype``, computed in fp32.
    """

    def __init__(self, prefix: DenseKV, prefix_len: int):
        self.prefix, self.n = prefix, prefix_len
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def forward(self, q, k, v, layer, fb: BranchBatch):
        lid = layer.layer_id
        self.k.setdefault(lid, []).append(k.float())
        self.v.setdefault(lid, []).append(v.float())
        g = layer.num_heads // layer.num_kv_heads
        K = repeat(self.prefix.k[lid][:self.n].float(), "p hkv d -> p (hkv g) d", g=g)
        V = repeat(self.prefix.v[lid][:self.n].float(), "p hkv d -> p (hkv g) d", g=g)
        Kb = repeat(torch.stack(self.k[lid], 1), "s b hkv d -> s b (hkv g) d", g=g)
        Vb = repeat(torch.stack(self.v[lid], 1), "s b hkv d -> s b (hkv g) d", g=g)
        qf = q.float() * layer.softmax_scale
        sp = einsum(qf, K, "s h d, p h d -> s h p")
        sp = sp.masked_fill(torch.arange(self.n, device=q.device)[None, None, :] >= fb.starts[:, None, None],
                            float("-inf"))
        sb = einsum(qf, Kb, "s h d, s b h d -> s h b")
        w = torch.softmax(torch.cat([sp, sb], dim=-1), dim=-1)
        out = einsum(w[..., :self.n], V, "s h p, p h d -> s h d")
        out = out + einsum(w[..., self.n:], Vb, "s h b, s b h d -> s h d")
        return out.to(q.dtype)


def _extend(target, draft, text: Sequence[int], first: int, num_steps: int):
    """The shared part of every round: the target's hidden over the text, the draft extend over
    it (logits ``[T-1, V]``, draft hidden ``g [T-1, E]`` or None, its KV) and the round starts."""
    Sd, T = num_steps, len(text)
    if first < 1 or T - 1 - Sd < first:
        raise ValueError(f"text of {T} tokens has no round at committed length >= {first} with Sd={Sd} "
                         f"(needs first >= 1 and len(text) >= first + Sd + 1)")
    p = next(target.parameters())
    dev = p.device
    ids = torch.tensor(list(text), dtype=torch.long, device=dev)
    c = target.config
    tkv = DenseKV(c.num_hidden_layers, T, c.num_key_value_heads, c.head_dim, dtype=p.dtype, device=dev)
    _, h = target(ids[:T - 1], DenseBatch.span(0, T - 1, dev), DenseBackend(tkv), aux=aux_layers(draft))
    dkv = DenseKV(draft.num_layers, T, draft.num_kv_heads, draft.head_dim, dtype=p.dtype, device=dev)
    use_h = draft.uses_hidden
    logits, g = draft.forward(ids[1:T], h if use_h else None, DenseBatch.span(0, T - 1, dev), DenseBackend(dkv))
    starts = torch.arange(first, T - Sd, device=dev)
    return ids, logits, g if use_h else None, dkv, starts


@torch.no_grad()
def round_lengths(target, draft, text: Sequence[int], first: int, num_steps: int) -> list[int]:
    """n(L) for every committed length ``L`` in ``first .. len(text) - 1 - num_steps``.

    Shapes: ``text`` T token ids (prompt + the target's greedy continuation); returns a list
    whose item ``L - first`` is the number of drafts the round at L would accept (0..Sd).
    Raises ``ValueError`` if ``first < 1`` or the text is too short for one round.
    """
    Sd, T = num_steps, len(text)
    ids, logits, g, dkv, starts = _extend(target, draft, text, first, Sd)
    tok = logits[starts - 1].argmax(-1)  # d_1 of each round
    hid = None if g is None else g[starts - 1]
    drafts = [tok]
    be = BranchBackend(dkv, T - 1)
    for s in range(Sd - 1):
        lg, hid = draft.forward(tok, hid, BranchBatch(starts + s, starts), be)
        tok = lg.argmax(-1)
        drafts.append(tok)
    d = torch.stack(drafts, 1)  # [S, Sd]
    truth = torch.stack([ids[starts + i + 1] for i in range(Sd)], 1)
    n = (d == truth).int().cumprod(1).sum(1)
    return n.tolist()


@dataclass
class TreeRound:
    """One tree round on the fixed text: all ``cands`` (k + (Sd-1) k^2, candidate-id order), the
    verify ``tree`` (N nodes) and its greedy acceptance ``acc`` along the text (``acc.n`` drafts)."""

    cands: Candidates
    tree: Tree
    acc: Acceptance


@torch.no_grad()
def tree_rounds(target, draft, text: Sequence[int], first: int, *, topk: int, num_steps: int,
                num_draft_tokens: int | None) -> list[TreeRound]:
    """The candidates, the tree and its greedy acceptance along ``text`` of the round at every
    committed length ``L`` in ``first .. len(text) - 1 - num_steps`` (item ``L - first``), module doc.

    Shapes: ``text`` T token ids; k = ``topk``, Sd = ``num_steps``, N = ``num_draft_tokens``
    (root included; None only at k = 1, meaning Sd + 1).  Each :class:`~refspec.oracle.tree.Tree`
    has N nodes, node 0 = ``t_L``.
    Raises ``ValueError`` for bad k / Sd / N (:func:`refspec.core.args.tree_args`, TR-002) or a
    text too short for one round.
    """
    N = tree_args(topk, num_steps, num_draft_tokens)
    k, Sd, T = topk, num_steps, len(text)
    if k > target.config.vocab_size:
        raise ValueError(f"topk k = {k} > vocab_size V = {target.config.vocab_size} (TR-001)")
    ids, logits, g, dkv, starts = _extend(target, draft, text, first, Sd)
    R = starts.numel()
    p0, i0 = torch.topk(torch.softmax(logits[starts - 1].float(), dim=-1), k, dim=-1)  # [R, k] root children
    rounds = [root_children(p0[r], i0[r]) for r in range(R)]  # (Candidates, Frontier) per round
    cands = [c for c, _ in rounds]
    fronts = [f for _, f in rounds]
    row_starts = starts.repeat_interleave(k)  # row r*k + t: round r's frontier row t
    hid = None if g is None else g[starts - 1].repeat_interleave(k, 0)  # step 0: all take the root's
    be = BranchBackend(dkv, T - 1)
    for s in range(Sd - 1):
        tok = torch.cat([f.tokens for f in fronts]).to(ids.device)
        lg, out = draft.forward(tok, hid, BranchBatch(row_starts + s, row_starts), be)
        cp, ci = torch.topk(torch.softmax(lg.float(), dim=-1), k, dim=-1)  # [R*k, k]
        fronts = [expand(cands[r], fronts[r], s + 1, cp[r * k:(r + 1) * k], ci[r * k:(r + 1) * k])
                  for r in range(R)]
        if hid is not None:  # hidden states follow the parent row (TR-001); KV history stays the row's
            hid = out[torch.tensor([r * k + j for r in range(R) for j in fronts[r].parent_row], device=ids.device)]
    result = []
    for r in range(R):
        L = int(starts[r])
        tree = build_tree(text[L], cands[r], select(cands[r], N), L)
        # the target's argmax at a node of depth d on the text is t_(L+d+1); a depth-Sd node has no
        # children, so its entry (past the text in the last round) only names the bonus: unused here
        predict = [text[L + d + 1] if L + d + 1 < T else -1 for d in tree.depth]
        result.append(TreeRound(cands[r], tree, greedy_accept(tree, predict)))
    return result


def _check(prompt, reference, num_steps, max_new_tokens) -> list[int]:
    P = len(prompt)
    if P < 1 or max_new_tokens < 1 or num_steps < 1:
        raise ValueError(f"prompt must be non-empty and max_new_tokens, num_steps >= 1, got {P} prompt tokens, "
                         f"max_new_tokens={max_new_tokens}, num_steps={num_steps}")
    if list(reference[:P]) != list(prompt):
        raise ValueError("reference must start with the prompt (prompt + the target's greedy continuation)")
    if len(reference) < P + max_new_tokens + num_steps:
        raise ValueError(f"reference has {len(reference) - P} tokens past the prompt; needs max_new_tokens + "
                         f"num_steps = {max_new_tokens + num_steps} (the last round's drafts are compared too)")
    return list(reference[:P + max_new_tokens + num_steps])


def _walk(n: list[int], text: list[int], P: int, max_new_tokens: int, eos: int | None) -> list[int]:
    """The rounds from L = P with the oracle loop's budget and EOS rules: ``a = n[L - P] + 1``."""
    out, accepts, L = [text[P]], [], P  # the root t_P comes from prefill
    done = len(out) >= max_new_tokens or out[-1] == eos
    while not done:
        a = n[L - P] + 1
        accepts.append(a)
        for t in text[L + 1:L + 1 + a]:
            out.append(t)
            if len(out) >= max_new_tokens or t == eos:
                done = True
                break
        L += a
    return accepts


def teacher_forced_accepts(target, draft, prompt: Sequence[int], reference: Sequence[int], *, num_steps: int,
                           max_new_tokens: int, eos: int | None = None) -> list[int]:
    """The accept length a (= n + 1) of every round a chain speculative run of ``draft`` would
    have on ``reference`` (``prompt`` + the target's greedy continuation), with the oracle loop's
    budget and EOS rules.

    Shapes: ``prompt`` P ids, ``reference`` >= P + ``max_new_tokens`` + ``num_steps`` ids whose
    first P are the prompt.  Returns one int per round (1..Sd+1).
    Raises ``ValueError`` naming the field: an empty prompt, ``reference`` not starting with
    ``prompt`` or too short, ``num_steps`` / ``max_new_tokens`` < 1.
    """
    text = _check(prompt, reference, num_steps, max_new_tokens)
    P = len(prompt)
    return _walk(round_lengths(target, draft, text, P, num_steps), text, P, max_new_tokens, eos)


def teacher_forced_tree_accepts(target, draft, prompt: Sequence[int], reference: Sequence[int], *, topk: int,
                                num_steps: int, num_draft_tokens: int | None, max_new_tokens: int,
                                eos: int | None = None) -> list[int]:
    """The accept length a (= n + 1) of every round a top-k tree run of ``draft`` (k = ``topk``,
    Sd = ``num_steps``, N = ``num_draft_tokens`` nodes, root included; docs/spec/tree.md
    TR-001..TR-006) would have on ``reference``, with the oracle tree loop's budget and EOS
    rules (:func:`refspec.oracle.tree_loop.speculative_tree_greedy`; v1 and v2 alike, TR-007).

    Shapes: as :func:`teacher_forced_accepts`.  Returns one int per round (1..Sd+1).
    Raises ``ValueError`` naming the field: as :func:`teacher_forced_accepts`, and a bad
    ``topk`` / ``num_steps`` / ``num_draft_tokens`` (TR-002: ``N - 1 <= k + (Sd-1) k^2``).
    """
    text = _check(prompt, reference, num_steps, max_new_tokens)
    P = len(prompt)
    rounds = tree_rounds(target, draft, text, P, topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens)
    return _walk([r.acc.n for r in rounds], text, P, max_new_tokens, eos)
