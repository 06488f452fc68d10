"""Ready-made MLA attention scenarios: one batch of one mode, the latent pool, both wings, eager and graphed.

The MLA twin of :mod:`refspec.harness.scenario` (same modes, same ``lens`` meaning, the same batch
builders), for the tests, tutorials and ``check``::

    sc = MLAScenario(ForwardMode.TARGET_VERIFY, page_size=4, lens=[5, 9], num_draft_tokens=4)
    built = sc.build()
    ref = built.run_oracle()          # fp32 truth: absorbed MLA over the latent rows, by slot
    out = built.run_fa3()             # the FA3 wing: the qv call on the two strided views
    out_g = built.run_fa3_graph()     # the same through a captured (emulated) CUDA graph

A built scenario holds an :class:`~refspec.core.kv_cache.MLAKVPool` (one layer), the absorbed
layer (:func:`~refspec.core.mla.mla_attention_layers`, scale from
:func:`~refspec.core.mla.mla_softmax_scale`) and the absorbed call's inputs: ``q`` (the absorbed
``q_nope``, ``[T, H, R]``), ``q_rope [T, H, Dr]``, ``k`` (the latent, ``[T, 1, R]``) and ``k_rope
[T, 1, Dr]``.  Every key before this forward's tokens holds a random row.  Poisoning
(``poison=True``): slot 0 (page 0) and every page outside all tables hold NaN, slots of a used
page past K_b hold the sentinel 1e4.

``dims`` defaults to a tiny config inside FA3's kernel dims (ML-006: R = 256, Dr = 16, Dn = 16,
Dv = 16, so the ``qv`` call is (16, 256) and the prefill (32, 16)); pass
:data:`~refspec.core.mla.DEEPSEEK_V3_DIMS` for DeepSeek's (R = 512, Dr = 64).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refspec.core import batch as B
from refspec.core.kv_cache import KVCache, MLAKVPool
from refspec.core.layer import AttentionLayer
from refspec.core.mla import (MLADims, check_rope_scaling, expand_latent, mla_attention_layers, mla_softmax_scale,
                               split_kv_b_proj)
from refspec.core.modes import ForwardMode
from refspec.fa3.backend import FlashAttentionBackend
from refspec.fa3.tree_backend import TreeDraftBatch
from refspec.graphs.runner import GraphRunner
from refspec.harness.modes import mode_scenarios
from refspec.harness.scenario import SENTINEL, Scenario
from refspec.harness.tree_scenario import random_parents, tree_batch
from refspec.oracle.backend import OracleBackend
from refspec.speculative.tree import kv as tree_kv

#: a small MLA config for fast CPU tests, inside FA3's kernel dims (ML-006: qv needs Dr <= 64, 256 <= R <= 512)
TINY_DIMS = MLADims(kv_lora_rank=256, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)


@dataclass
class MLAScenario:
    """One MLA batch: ``mode``, ``page_size``, ``lens`` (per mode, as :class:`Scenario`), the
    mode's optional fields, ``num_heads`` H, ``dims`` and the usual knobs (dtype, seed, pages)."""

    mode: ForwardMode
    page_size: int
    lens: list[int]
    num_draft_tokens: int = 4
    num_accept_tokens: list[int] | None = None
    extend_lens: list[int] | None = None
    draft_step: int | None = None
    num_heads: int = 4
    dims: MLADims = TINY_DIMS
    rope_scaling: dict | None = None
    dtype: torch.dtype = torch.float32
    seed: int = 0
    shuffle_pages: bool = True
    poison: bool = True
    device: str = "cpu"
    extra_pages: int = 3

    def __post_init__(self):
        """The MHA scenario's checks (lens per mode, fields per mode, dtype, device), one KV head;
        ``dims`` an :class:`MLADims`, ``rope_scaling`` well formed (:func:`check_rope_scaling`)."""
        if not isinstance(self.dims, MLADims):
            raise ValueError(f"dims must be an MLADims, got {self.dims!r}")
        check_rope_scaling(self.rope_scaling)
        self._sc = Scenario(self.mode, self.page_size, self.lens, num_draft_tokens=self.num_draft_tokens,
                            num_accept_tokens=self.num_accept_tokens, extend_lens=self.extend_lens,
                            draft_step=self.draft_step, num_heads=self.num_heads, num_kv_heads=1,
                            head_dim=self.dims.kv_cache_dim, dtype=self.dtype, seed=self.seed,
                            shuffle_pages=self.shuffle_pages, poison=self.poison, device=self.device,
                            extra_pages=self.extra_pages)
        self.lens = self._sc.lens

    def build(self) -> "MLABuilt":
        sc, d, P = self._sc, self.dims, self.page_size
        dev = torch.device(self.device)
        g = torch.Generator(device=dev).manual_seed(self.seed)
        K, q = sc.kv_and_q_lens()
        num_pages = sum(-(-k // P) for k in K) + self.extra_pages + 1
        kv = KVCache(len(K) + 2, max(K + [1]) + self.num_draft_tokens, num_pages, P, extra=4 + self.num_draft_tokens,
                     device=dev, seed=self.seed if self.shuffle_pages else None)
        pool = MLAKVPool(1, num_pages, P, d.kv_lora_rank, d.qk_rope_head_dim, dtype=self.dtype, device=dev,
                         fill=float("nan") if self.poison else 0.0)
        rows = [kv.alloc_req() for _ in K]
        kv.alloc_extend(rows, [0] * len(K), K)
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev).to(self.dtype)
        buf = pool.get_key_buffer(0)
        for r, k_b, q_b in zip(rows, K, q):
            used = kv.req_to_token[r, :k_b].long()
            if self.poison:  # whole used pages get the sentinel first, then the real prefix
                pages = torch.unique(used // P)
                buf[(pages[:, None] * P + torch.arange(P, device=dev)).flatten()] = SENTINEL
            prefix = used[: k_b - q_b]
            buf[prefix] = rnd(len(prefix), 1, d.kv_cache_dim)
        fb = sc._batch(kv, rows)
        T, H = fb.num_tokens, self.num_heads
        scale = mla_softmax_scale(d, self.rope_scaling)
        layer, mha_layer = mla_attention_layers(0, H, d, scale)
        return MLABuilt(self, kv, pool, fb, layer, mha_layer, q=rnd(T, H, d.kv_lora_rank),
                        q_rope=rnd(T, H, d.qk_rope_head_dim), k=rnd(T, 1, d.kv_lora_rank),
                        k_rope=rnd(T, 1, d.qk_rope_head_dim), K=K, q_lens=q)


@dataclass
class MLABuilt:
    """A built MLA scenario: cache, latent pool, live batch ``fb``, the absorbed and MHA layers, and
    the absorbed call's inputs (module doc)."""

    sc: MLAScenario
    kv: KVCache
    pool: MLAKVPool
    fb: B.ForwardBatch
    layer: AttentionLayer
    mha_layer: AttentionLayer
    q: torch.Tensor
    q_rope: torch.Tensor
    k: torch.Tensor
    k_rope: torch.Tensor
    K: list[int]
    q_lens: list[int]
    extra: dict = field(default_factory=dict)

    def run_oracle(self, upcast: bool = True) -> torch.Tensor:
        """The oracle (absorbed form, keys by slot): ``[T, H, R]``; fp32 unrounded by default."""
        be = OracleBackend(self.pool, self.kv, upcast=upcast, out_dtype=torch.float32 if upcast else None)
        be.init_forward_metadata(self.fb)
        return be.forward(self.q, self.k, self.k, self.layer, self.fb, q_rope=self.q_rope, k_rope=self.k_rope)

    def fa3_backend(self, provider="emulator", validate=True) -> FlashAttentionBackend:
        step = self.sc.draft_step if self.fb.is_draft_decode else None
        return FlashAttentionBackend(self.pool, self.kv, speculative_step_id=step, provider=provider, validate=validate)

    def run_fa3(self, provider="emulator", validate=True) -> torch.Tensor:
        """The eager FA3 wing: ``[T, H, R]``."""
        be = self.fa3_backend(provider, validate)
        self.extra["metadata"] = be.init_forward_metadata(self.fb)
        return be.forward(self.q, self.k, self.k, self.layer, self.fb, q_rope=self.q_rope, k_rope=self.k_rope)

    def graph_runner(self, capture_bs=(1, 2, 4, 8), provider="emulator", validate=True) -> GraphRunner:
        """A runner capturing this scenario's mode (draft decode: the one step ``draft_step``);
        its inputs are the absorbed call's four tensors."""
        if self.fb.forward_mode.is_idle():
            raise ValueError("mode IDLE (the empty batch) is not captured in a graph")
        be = self.fa3_backend(provider, validate)
        sc, d = self.sc, self.sc.dims
        W = 1 if self.fb.forward_mode.is_decode() else sc.num_draft_tokens
        H, R, Dr = sc.num_heads, d.kv_lora_rank, d.qk_rope_head_dim
        dt = sc.dtype
        shapes = dict(q=((H, R), dt), q_rope=((H, Dr), dt), k=((1, R), dt), k_rope=((1, Dr), dt))
        layer = self.layer
        runner = GraphRunner(self.fb.forward_mode, [be],
                             lambda fb, x: be.forward(x["q"], x["k"], x["k"], layer, fb, q_rope=x["q_rope"],
                                                      k_rope=x["k_rope"]),
                             kv=self.kv, capture_bs=capture_bs, tokens_per_req=W, inputs=shapes,
                             num_draft_tokens=sc.num_draft_tokens, draft_step=self.fb.draft_step)
        runner.backend = be
        return runner

    def run_fa3_graph(self, runner: GraphRunner | None = None, **kw) -> torch.Tensor:
        """Replay through a (given or new) graph runner: ``[T, H, R]`` real rows."""
        runner = runner or self.graph_runner(**kw)
        return runner.replay(self.fb, dict(q=self.q, q_rope=self.q_rope, k=self.k, k_rope=self.k_rope))

    def mha_pass_inputs(self, seed: int = 0):
        """The model's side of the non-absorbed prefill (ML-010) of this EXTEND batch, written out:
        random ``kv_b_proj`` weights, the latent rows ``[k | k_rope]`` stored at ``out_cache_loc``
        (the model writes them, the backend stores nothing), every key of every request expanded
        from its latent row (the prefix gathered back from the pool: MHA_ONE_SHOT), a random
        ``q_nope``.  Returns ``(q [T, H, Dn + Dr], k [sum K, H, Dn + Dr], v [sum K, H, Dv], fb)``,
        ``fb`` the batch with ``attn_attend_prefix_cache=False`` (the MHA pass).
        Raises ValueError for a batch that is not EXTEND."""
        fb, d, H = self.fb, self.sc.dims, self.sc.num_heads
        if fb.forward_mode != ForwardMode.EXTEND:
            raise ValueError(f"the MHA pass is a prefill's: mode {fb.forward_mode.name} is not EXTEND (ML-009)")
        g = torch.Generator().manual_seed(seed)
        dev, dt = self.q.device, self.q.dtype
        kv_b = torch.randn(H * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g) / d.kv_lora_rank ** 0.5
        w_kc, w_vc = split_kv_b_proj(kv_b.to(dev), H, d.qk_nope_head_dim)
        self.pool.set_mla_kv_buffer(0, fb.out_cache_loc, self.k, self.k_rope)
        slots = torch.cat([self.kv.req_to_token[r, :K].long() for r, K in zip(fb.req_pool_indices.tolist(), self.K)])
        c, k_pe = self.pool.get_mla_kv_buffer(0, slots)
        k, v = expand_latent(c[:, 0].float(), k_pe[:, 0].float(), w_kc, w_vc)
        q_nope = torch.randn(fb.num_tokens, H, d.qk_nope_head_dim, generator=g).to(dev)
        q = torch.cat([q_nope, self.q_rope.float()], dim=-1)
        return q.to(dt), k.to(dt), v.to(dt), fb.replace(attn_attend_prefix_cache=False)


def mla_mode_scenarios(page_size: int, num_draft_tokens: int = 4, **kw) -> dict[str, MLAScenario]:
    """One 3-request :class:`MLAScenario` per label of :data:`refspec.harness.modes.MODES`, with the
    lens, accept lengths and extends of :func:`~refspec.harness.modes.mode_scenarios` (keys at page
    boundaries); ``kw`` goes to every MLAScenario (dims, heads, dtype, device, seed, ...)."""
    out = {}
    for label, sc in mode_scenarios(page_size, num_draft_tokens).items():
        out[label] = MLAScenario(sc.mode, page_size, list(sc.lens), num_draft_tokens=num_draft_tokens,
                                 num_accept_tokens=sc.num_accept_tokens, extend_lens=sc.extend_lens,
                                 draft_step=sc.draft_step, **kw)
    return out


# ---- top-k > 1 (the MLA cascade, ML-011): the tree scenarios of refspec.harness.tree_scenario on a latent pool ----

def _tree_cache(P: int, B: int, width: int, seed: int, dims: MLADims, dtype, device):
    """KVCache with shuffled pages and a 1-layer latent pool poisoned with NaN."""
    num_pages = B * (-(-width // P) + 2) + 4
    kv = KVCache(B + 1, width, num_pages, P, extra=0, seed=seed, device=device)
    return kv, MLAKVPool(1, num_pages, P, dims.kv_lora_rank, dims.qk_rope_head_dim, dtype=dtype, device=device,
                         fill=float("nan"))


def _write_rows(pool: MLAKVPool, slots: torch.Tensor, gen: torch.Generator) -> None:
    rows = torch.randn((slots.numel(), 1, pool.kv_cache_dim), generator=gen).to(pool.get_key_buffer(0))
    pool.get_key_buffer(0)[slots.long()] = rows


def mla_verify_setup(P: int, Ls: list[int], N: int, seed: int, dims: MLADims = TINY_DIMS, num_heads: int = 4,
                     dtype=torch.float32, device="cpu"):
    """A top-k > 1 TARGET_VERIFY batch on a latent pool: committed rows at 0..L-1 (random), N verify
    slots at L..L+N-1 per request that the forward stores, random trees
    (:func:`refspec.harness.tree_scenario.tree_batch`).  Returns ``(kv, pool, fb, layer, inputs,
    expected_slots)``, ``inputs`` the absorbed call's ``q, q_rope, k, k_rope`` (B*N rows) and
    ``expected_slots[i]`` the slots row i may read (prefix, its ancestors, itself)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(Ls)
    kv, pool = _tree_cache(P, B, max(Ls) + N, seed, dims, dtype, device)
    rows = [kv.alloc_req() for _ in range(B)]
    kv.alloc_extend(rows, [0] * B, Ls)
    kv.alloc_extend(rows, Ls, [L + N for L in Ls])
    for r, L in zip(rows, Ls):
        _write_rows(pool, kv.req_to_token[r, :L], gen)
    parents = [random_parents(N, gen) for _ in Ls]
    fb, expected_slots = tree_batch(kv, rows, Ls, N, parents, device)
    layer, _ = mla_attention_layers(0, num_heads, dims, mla_softmax_scale(dims))
    rnd = lambda *s: torch.randn(s, generator=gen).to(device=device, dtype=dtype)
    T, R, Dr = B * N, dims.kv_lora_rank, dims.qk_rope_head_dim
    inputs = dict(q=rnd(T, num_heads, R), q_rope=rnd(T, num_heads, Dr), k=rnd(T, 1, R), k_rope=rnd(T, 1, Dr))
    return kv, pool, fb, layer, inputs, expected_slots


def mla_draft_setup(P: int, Ls: list[int], topk: int, S: int, seed: int, dims: MLADims = TINY_DIMS,
                    num_heads: int = 4, dtype=torch.float32, device="cpu"):
    """A top-k > 1 draft-decode batch on a latent pool: committed rows (random), the branch regions
    of TR-015 with the partial tail page copied into branches t >= 1
    (:func:`~refspec.speculative.tree.kv.move_kv_cache`, the MLA pool's row move, ML-012), a random
    row at every step slot.  Returns ``(kv, pool, fb,
    layer, rows, loc)`` as :func:`refspec.harness.tree_scenario.draft_setup`."""
    gen = torch.Generator().manual_seed(seed)
    B = len(Ls)
    width = max(tree_kv.draft_alloc_len(L, topk, S, P) for L in Ls)
    kv, pool = _tree_cache(P, B, width, seed, dims, dtype, device)
    rows = [kv.alloc_req() for _ in range(B)]
    kv.alloc_extend(rows, [0] * B, Ls)
    for r, L in zip(rows, Ls):
        _write_rows(pool, kv.req_to_token[r, :L], gen)
    kv.alloc_extend(rows, Ls, [tree_kv.draft_alloc_len(L, topk, S, P) for L in Ls])
    loc = tree_kv.assign_draft_cache_locs(kv, rows, Ls, topk, S)
    src, tgt = tree_kv.tail_copy_slots(kv, rows, Ls, topk, S)
    tree_kv.move_kv_cache(pool, tgt, src)
    _write_rows(pool, loc, gen)  # every step's row (a step-s row may read steps 0..s only)
    fb = TreeDraftBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.tensor(Ls, dtype=torch.int32, device=device), seq_lens_cpu=torch.tensor(Ls),
        out_cache_loc=loc, positions=torch.tensor([L + j for L in Ls for _ in range(topk) for j in range(S)],
                                                  device=device),
        topk=topk, num_steps=S, draft_cache_loc=loc)
    layer, _ = mla_attention_layers(0, num_heads, dims, mla_softmax_scale(dims))
    return kv, pool, fb, layer, rows, loc
