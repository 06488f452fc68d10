"""The top-k > 1 conformance cases and refspec's side of them (the production tree wing, no oracle).

One *tree job* is one (mode, k, P) on a fresh ``req_to_token``: eager, one capture and one padded
replay.  Each result holds two metadata *parts*, compared separately: ``prefix`` (the backend's
``forward_metadata``: committed KV, one sequence per request) and ``expand`` (its
``forward_metadata_spec_decode_expand``: one sequence per query row); verify's eager result
also holds the ``tree`` part (mask, positions, retrive lists), draft step 0's the branch slots
and tail copies (TR-015), compared at the pins where upstream builds them itself
(``refspec.conformance.run.OWN_TREE``).  refspec's metadata comes from
:class:`refspec.fa3.tree_backend.FlashAttentionTreeBackend` (eager) and
:class:`refspec.speculative.tree.graphs.TreeGraphRunner` (capture + padded in-place replay; its
padding is what both sides then see).

Modes:

* ``tree_verify`` (TARGET_VERIFY): N = 2k nodes per request over the committed KV; the job carries
  the draft loop's per-step score / token / parent lists, drawn from random draft probabilities
  through refspec's ``select_top_k_tokens_*``, the verified ids and a target argmax per node, from
  which *each side* selects the drafts (``organize_draft_results``), builds the FULL_MASK tree
  and accepts greedily (upstream with its own ``eagle_utils`` functions and Triton kernels);
* ``tree_draft_decode`` (DECODE, draft steps 0 .. S - 2): the B*k branch rows with the per-branch
  page-aligned regions of TR-015 (``refspec.speculative.tree.kv``), ``out_cache_loc`` laid out
  ``[B, k, S]``.

Inputs per (k, P): k in 2, 4, 8; P in 1, 2, 4, 8, 16, 64; S = 3; committed lengths at page
boundaries +-1 (:func:`refspec.conformance.cases.lengths`), ``req_to_token`` rows SGLang's
speculative headroom wider than ``context_len``
(:func:`refspec.conformance.cases.headroom`, top-k k), rows in shuffled order, pages from a
shuffled free list; B = 3 live requests replayed in a graph of 4 (padded).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from refspec.conformance import cases
from refspec.core.kv_cache import KVCache, KVPool
from refspec.fa3.tree_backend import FlashAttentionTreeBackend
from refspec.speculative.tree import build as tree_build, kv as tree_kv
from refspec.speculative.tree.graphs import TreeGraphRunner
from refspec.speculative.tree.runners import tree_draft_batch, tree_verify_batch

TOPKS = (2, 4, 8)
PAGE_SIZES = (1, 2, 4, 8, 16, 64)
S = 3  #: speculative_num_steps (draft steps 0 and 1, as the top-k = 1 cases)
B, BS = 3, 4  #: live requests, graph batch (padded replay)
MODES = ("tree_verify", "tree_draft_decode")
_PARTS = ("prefix", "expand")


def num_draft_tokens(topk: int) -> int:
    """N = 2k verify nodes (1 root + 2k - 1 drafts, within the k + (S-1) k^2 candidates)."""
    return 2 * topk


def _width(mode: str, Ls: list[int], k: int, P: int, S: int = S) -> int:
    """Upstream's ``context_len`` (tokens): what the mode allocates, rounded up to 64;
    ``req_to_token`` rows are SGLang's headroom wider (:func:`_cache`)."""
    need = [L + num_draft_tokens(k) for L in Ls] if mode == "tree_verify" else \
        [tree_kv.draft_alloc_len(L, k, S, P) for L in Ls]
    return -(-max(need) // 64) * 64


def _cache(width: int, P: int, seed: int, extra: int = 0, B: int = B):
    """``req_to_token`` of ``width + extra`` columns (``extra``: SGLang's headroom,
    :func:`refspec.conformance.cases.headroom` with this top-k), pages shuffled, B rows in shuffled order."""
    kv = KVCache(max_reqs=12, max_context=width, extra=extra, num_pages=width * 6 // P + 2, page_size=P, seed=seed)
    taken = [kv.alloc_req() for _ in range(11)]
    g = torch.Generator().manual_seed(seed)
    rows = [taken[i] for i in torch.randperm(len(taken), generator=g)[:B].tolist()]  # shuffled rows
    pool = KVPool(num_layers=1, num_pages=kv.allocator.num_free_pages + 1, page_size=P, num_kv_heads=1, head_dim=8)
    return kv, pool, rows


def draw_tree(k: int, seed: int, S: int = S, B: int = B) -> dict:
    """SGLang's draft-side tree inputs for B requests from random draft probabilities.

    ``select_top_k_tokens_first`` on the root's k children, then S - 1 expansions
    (``select_top_k_tokens_later``): the per-step lists ``EAGLEWorker.draft_forward`` hands to
    ``organize_draft_results``.  Returns ``score_list`` (fp32 [B, 1, k], then [B, k, k] per step),
    ``token_list`` (int64 [B, k], then [B, k*k]), ``parents_list`` (int64 [B, k + 1], then [B, k])
    and ``verified_id`` int64 [B].
    """
    g = torch.Generator().manual_seed(seed)
    probs = lambda rows: torch.sort(torch.rand((rows, k), generator=g), dim=1, descending=True).values
    ids = lambda rows: torch.randint(3, 1000, (rows, k), generator=g)
    _, _, scores, info = tree_build.select_top_k_tokens_first(probs(B), ids(B), None, k)
    sl, tl_, pl = [info[0]], [info[1]], [info[2]]
    for step in range(1, S):
        _, _, scores, info = tree_build.select_top_k_tokens_later(step, probs(B * k), ids(B * k), None, scores, k)
        sl.append(info[0])
        tl_.append(info[1])
        pl.append(info[2])
    return {"score_list": sl, "token_list": tl_, "parents_list": pl,
            "verified_id": torch.randint(3, 1000, (B,), generator=g)}


def greedy_targets(parents: list[list[int]], tokens: torch.Tensor, N: int, seed: int) -> torch.Tensor:
    """A target argmax per node, int64 [B*N], with a random accepted path: from the root, with
    probability 3/4 the target names one of the node's children (a draft token), else token 1
    (never drafted: the path stops); nodes off the path get random tokens."""
    g = torch.Generator().manual_seed(seed)
    tp = torch.randint(3, 1000, (len(parents) * N,), generator=g)
    for b, par in enumerate(parents):
        cur = 0
        while True:
            kids = [i for i in range(N) if par[i] == cur]
            if not kids or float(torch.rand((), generator=g)) >= 0.75:
                tp[b * N + cur] = 1
                break
            child = kids[int(torch.randint(len(kids), (), generator=g))]
            tp[b * N + cur] = tokens[b * N + child]
            cur = child
    return tp


def snapshot_tree(organized, built: dict, target_predict: torch.Tensor, N: int, S: int = S) -> dict:
    """The ``tree`` part: refspec's ``organize_draft_results`` (``parent_list``,
    ``top_scores_index``), its ``build_tree`` outputs (upstream's ``build_tree_kernel_efficient``
    returns the same six) and ``verify_tree_greedy`` on them (``predicts``, ``accept_index``,
    ``accept_token_num``: upstream's ``verify_tree_greedy_func`` outputs)."""
    out = {f: built[f].clone() for f in ("custom_mask", "positions", "retrive_index", "retrive_next_token",
                                          "retrive_next_sibling", "draft_tokens")}
    out.update(parent_list=organized[0].clone(), top_scores_index=organized[1].clone())
    cand = built["draft_tokens"].view(-1, N)
    acc = tree_build.verify_tree_greedy(cand, built["retrive_index"], built["retrive_next_token"],
                                        built["retrive_next_sibling"], target_predict, S + 1)
    return dict(out, **dict(zip(("predicts", "accept_index", "accept_token_num"), acc)))


def snapshot_branches(kv, rows, Ls, k: int, loc: torch.Tensor, S: int = S) -> dict:
    """The draft ``tree`` part: the branch slots (TR-015) and the tail copies, ``(target, source)``
    slot pairs sorted by target (``refspec.speculative.tree.kv``)."""
    src, tgt = tree_kv.tail_copy_slots(kv, rows, Ls, k, S)
    pairs = torch.stack([tgt.long(), src.long()], dim=1)
    return {"out_cache_loc": loc.clone(), "tail_copy": pairs[torch.argsort(pairs[:, 0])]}


def snapshot_batch(fb) -> dict:
    """Plain copies of a tree batch's fields (live, or a graph runner's padded static batch)."""
    out = {f: getattr(fb, f).clone() for f in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc",
                                               "positions")}
    mask = getattr(fb, "custom_mask", None)
    out["custom_mask"] = None if mask is None else mask.clone()
    return out


def snapshot(be) -> dict:
    """One backend's two parts (copies: graph buffers are rewritten by the next replay)."""
    return {"prefix": cases.snapshot_metadata(be.forward_metadata),
            "expand": cases.snapshot_metadata(be.forward_metadata_spec_decode_expand)}


class _Runners:
    """What :class:`TreeGraphRunner` reads of a ``TreeRunners``: the backends and a forward that
    runs no model (the graph is captured for its metadata buffers only)."""

    def __init__(self, kv, k, N, backends, verify: bool, S: int = S):
        self.kv, self.topk, self.Sd, self.num_draft_tokens = kv, k, S, N
        self.tree_verify_be = backends[0] if verify else None
        self.tree_step_bes = [] if verify else backends
        self.target, self.draft = NS(config=NS(hidden_size=8)), NS(uses_hidden=False)
        self._tree_verify_fn = self._tree_draft_fn = lambda fb, x: (fb.positions.clone(),)


def _job(mode: str, k: int, P: int, seed: int, num_steps: int = S, batch: tuple[int, int] = (B, BS)) -> cases.Job:
    """One tree job (module doc); ``num_steps`` = speculative_num_steps (draft steps 0 .. num_steps - 2);
    ``batch``: (live requests B, graph batch BS), the job id naming them where not the default (3, 4)."""
    N, Sd = num_draft_tokens(k), num_steps
    B, BS = batch
    Ls = cases.lengths(P, B)
    width = _width(mode, Ls, k, P, Sd)
    kv, pool, rows = _cache(width, P, seed, cases.headroom(P, N, Sd, k), B)
    inputs = {"page_size": P, "context_len": width, "topk": k, "num_steps": Sd, "num_draft_tokens": N, "bs": BS}
    kv.alloc_extend(rows, [0] * B, Ls)
    ref: dict = {}
    if mode == "tree_verify":
        kv.alloc_extend(rows, Ls, [L + N for L in Ls])
        tree = draw_tree(k, seed, Sd, B)
        organized = tree_build.organize_draft_results(tree["score_list"], tree["token_list"], tree["parents_list"], N)
        built = tree_build.build_tree(tree["verified_id"], *organized, torch.tensor(Ls), k, N)
        live = tree_verify_batch(kv, rows, Ls, N, k, built["positions"], built["custom_mask"])
        backends = [FlashAttentionTreeBackend(pool, kv, topk=k, num_draft_tokens=N, validate=False)]
        tree["target_predict"] = greedy_targets(built["parents"], built["draft_tokens"], N, seed)
        inputs["tree"] = tree
        x = {"ids": torch.zeros(B * N, dtype=torch.long)}
    else:
        kv.alloc_extend(rows, Ls, [tree_kv.draft_alloc_len(L, k, Sd, P) for L in Ls])
        loc = tree_kv.assign_draft_cache_locs(kv, rows, Ls, k, Sd)
        live = tree_draft_batch(kv, rows, Ls, k, Sd, loc)
        backends = [FlashAttentionTreeBackend(pool, kv, topk=k, num_steps=Sd, speculative_step_id=s, validate=False)
                    for s in range(Sd - 1)]
        x = {"topk_p": torch.zeros(B, k), "topk_index": torch.zeros(B, k, dtype=torch.long)}
    steps = [None] if mode == "tree_verify" else list(range(Sd - 1))
    inputs["req_to_token"] = kv.req_to_token.clone()
    inputs["eager"] = snapshot_batch(live)
    for s, be in zip(steps, backends):
        be.init_forward_metadata(live)
        ref[("eager", s)] = snapshot(be)
    if mode == "tree_verify":
        ref[("eager", None)]["tree"] = snapshot_tree(organized, built, tree["target_predict"], N, Sd)
    else:
        ref[("eager", 0)]["tree"] = snapshot_branches(kv, rows, Ls, k, loc, Sd)
    runner = TreeGraphRunner(_Runners(kv, k, N, backends, mode == "tree_verify", Sd),
                             "verify" if mode == "tree_verify" else "draft", [BS], torch.float32)
    inputs["capture"] = snapshot_batch(runner.static[BS][0])
    for s, be in zip(steps, backends):
        ref[("capture", s)] = snapshot(be)
    runner.replay(live, x)
    inputs["replay"] = snapshot_batch(runner.static[BS][0])
    for s, be in zip(steps, backends):
        ref[("replay", s)] = snapshot(be)
    shape = f"k{k}" + ("" if Sd == S else f" S{Sd}") + ("" if batch == (3, 4) else f" B{B}")
    return cases.Job(f"{mode}/{shape.replace(' ', '/')}/P{P}", mode, P, shape, True, inputs, ref)


def build_jobs(modes=MODES, page_sizes=PAGE_SIZES, topks=TOPKS, seed: int = 0, num_steps=(S,)) -> list[cases.Job]:
    """Every tree job for ``modes`` x ``topks`` x ``page_sizes`` x ``num_steps`` (page sizes outside
    :data:`PAGE_SIZES` are skipped: the tree wing is compared at the sizes it is built for)."""
    return [_job(m, k, P, seed + 7 * P + k + 101 * (Sd - S), Sd) for m in modes if m in MODES for Sd in num_steps
            for k in topks for P in page_sizes if P in PAGE_SIZES]


#: long draft chains (top-k > 1): speculative_num_steps 6 (draft steps 0 .. 4) at small pages,
#: where a branch's steps span more pages than the expand table's decode_length + 1 columns
#: unless the scatter is sliced to decode_length (TR-018)
LONG = {"num_steps": 6, "page_sizes": (2, 8), "topks": (2,)}


#: small batches (top-k > 1): B = 1 and B = 2 live requests (graphs of 2 and 4) at P = 1, k = 2, so that a
#: defect that needs two requests to show (0.4.7's draft expand table, sglang#7239) is seen with its
#: condition: the B = 1 rows hold, the B >= 2 rows fail
SMALL = {"batches": ((1, 2), (2, 4)), "page_sizes": (1,), "topks": (2,)}


def edge_jobs(modes=MODES, page_sizes=PAGE_SIZES, topks=TOPKS, seed: int = 0) -> list[cases.Job]:
    """The long-chain draft-decode jobs (:data:`LONG`) and the small batches (:data:`SMALL`) at the
    selected page sizes and top-k values."""
    jobs = []
    if "tree_draft_decode" in modes:
        jobs += build_jobs(("tree_draft_decode",), [P for P in LONG["page_sizes"] if P in page_sizes],
                           [k for k in LONG["topks"] if k in topks], seed=seed, num_steps=(LONG["num_steps"],))
    jobs += [_job(m, k, P, seed + 7 * P + k + 500 + b, S, (b, bs)) for m in modes if m in MODES
             for k in SMALL["topks"] if k in topks for P in SMALL["page_sizes"] if P in page_sizes
             for b, bs in SMALL["batches"]]
    return jobs

