"""The probes: for each wrong variant of :data:`refspec.variants.VARIANTS`, the scenario(s) that expose it
(the top-k > 1 variants' probes live in :mod:`refspec.mutants.tree_probes`, the MLA ones in
:mod:`refspec.mutants.mla_probes`; both join :data:`PROBES` here).

A probe is ``run(env, found, validate)``: it drives the production wing (eager FA3 metadata,
or a :class:`~refspec.graphs.runner.GraphRunner` replay; the KV allocator for the accounting
variant) with ``validate`` passed to the backend, then runs the suite-side checks of
:mod:`refspec.mutants.checks`, which append what they see to ``found``.  Production errors
propagate.  The runner calls every probe with no variant on (it must see nothing) and with its
variant on.

Scenario numbers follow the public failure cases (B01..B20) where one fits: B04 (stale padding),
B05 (v2 layout), B07 (context wall), B08 (frozen max_seqlen_q), B11 (rebinding), B14 (verify as
decode, horizon probe), B18 (padding with a live page), B20 (draft cache-location layout).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from refspec.core.batch import draft_decode_steps_batch, draft_step_view
from refspec.core.kv_cache import KVCache, KVPool
from refspec.core.modes import ForwardMode as M
from refspec.mutants import replacements as R
from refspec.mutants.audit_probes import grown, paired_probe, replay_validation_probe, window_probe
from refspec.mutants.checks import (Case, Env, Symptom, check_buffers, check_frozen_q, check_kv_writes,
                                    check_metadata, check_padding, compare, kv_snapshot, live)
from refspec.mutants.mla_probes import MLA_PROBES
from refspec.mutants.tree_probes import TREE_PROBES


@dataclass(frozen=True)
class Probe:
    """``label`` names the scenario; ``run(env, found, validate)`` drives it (module doc)."""

    label: str
    run: Callable[[Env, list, bool], None]


# ---- drivers -----------------------------------------------------------------------------

def eager_fa3(env: Env, b, validate: bool, batch=None):
    """Eager FA3 on ``batch = (fb, q, k, v)`` (default: ``b``'s live batch) -> (out, backend)."""
    fb, q, k, v = batch or live(b, None)
    be = b.fa3_backend(env.provider, validate)
    be.init_forward_metadata(fb)
    return be.forward(q, k, v, b.layer, fb), be


def eager_probe(case_fn, batch_fn=None, horizon: bool = False):
    """Eager metadata + FA3 vs the oracle, then the metadata twin check (and the B14 horizon)."""
    def run(env, found, validate):
        case = case_fn(env)
        b = case.build()
        batch = batch_fn(b) if batch_fn else None
        out, be = eager_fa3(env, b, validate, batch)
        fb = (batch or live(b, None))[0]
        if horizon:
            check_horizon(found, out, case)
        compare(env, found, out, case, what="eager FA3")
        check_metadata(found, be.forward_metadata, fb, b.kv.req_to_token, be.page_size, replay=False)
    return run


def graph_probe(case_fn, replays=(None,), capture_bs=(4,), kv_writes=False):
    """Capture once, replay the request subsets ``replays`` in a row; after each replay compare
    the real rows with the oracle (CG-002, or TOL-002 when eager FA3 is wrong too) and run the
    twin, padding, buffer and (``kv_writes``) KV-write checks."""
    def run(env, found, validate):
        case = case_fn(env)
        b = case.build()
        runner = b.graph_runner(capture_bs=capture_bs, provider=env.provider, validate=validate)
        for idx in replays:
            fb, q, k, v = live(b, idx)
            before = kv_snapshot(b.pool) if kv_writes else None
            out = runner.replay(fb, dict(q=q, k=k, v=v))
            bs, P = runner.graph_bs(fb.batch_size), runner.backend.page_size
            n = len(found)
            if not compare(env, found, out, case, idx, inv="CG-002", what=f"replay of {fb.batch_size} in Bg={bs}"):
                if not eager_matches(env, case, idx):
                    found[n].inv_id = "TOL-002"  # the eager path is wrong too: not a replay-only bug
            check_metadata(found, runner.backend.forward_metadata, fb, b.kv.req_to_token, P, replay=True)
            check_padding(found, runner, fb.batch_size, fb.num_tokens, bs)
            check_frozen_q(found, runner, fb, bs)
            for key in runner.backend.graph_state.captured:
                check_buffers(found, runner.backend, key)
            if kv_writes:
                check_kv_writes(found, b.pool, before, fb.out_cache_loc, P)
    return run


def eager_matches(env: Env, case: Case, idx) -> bool:
    """Whether eager FA3 (validation off, the current variants on) matches the oracle."""
    try:
        b = case.build()
        out, _ = eager_fa3(env, b, False, live(b, idx))
        return compare(env, [], out, case, idx)
    except Exception:  # noqa: BLE001 - any failure means "does not match"
        return False


# ---- scenario set-ups ------------------------------------------------------------------

def set_horizon(b) -> None:
    """Horizon probe (case B14): q = 0 and V[slot of position p] = p, so query row j of request
    b outputs the mean of its visible positions, (K_b - q_b + j) / 2."""
    kf, vf = b.pool.get_flat_kv(0)
    for r, K in zip(b.fb.req_pool_indices.tolist(), b.K):
        slots = b.kv.req_to_token[r, :K].long()
        vf[slots] = torch.arange(K, device=vf.device).to(vf.dtype)[:, None, None].expand(K, *vf.shape[1:])
    b.q.zero_()
    b.v.copy_(b.fb.positions.to(b.v.dtype)[:, None, None].expand_as(b.v))


def check_horizon(found: list, out, case: Case) -> None:
    """Each row against the hand formula (K_b - q_b + j) / 2 (PA-004), no oracle involved."""
    K, q = case.sc.kv_and_q_lens()
    want = torch.tensor([(k - n + j) / 2 for k, n in zip(K, q) for j in range(n)], device=out.device)
    got = out.float().mean(dim=(1, 2))
    tol = want.abs() / 128 + 1e-2 if out.dtype != torch.float32 else torch.full_like(want, 1e-4)
    bad = ~((got - want).abs() <= tol)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        err = float((got - want).abs().nan_to_num(float("inf")).max())
        found.append(Symptom("mismatch", "PA-004", f"horizon probe: row {i} reads back {got[i]:.3g}, "
                             f"expected {want[i]:.3g} (keys 0..{2 * want[i]:.0f})", err))


def add_rejected_kv(b) -> None:
    """v1 draft extend after a partial accept: positions L + a .. L + N - 1 (the rejected drafts
    of this round) still hold slots with finite, wrong ("rejected") KV."""
    sc, rows = b.sc, b.fb.req_pool_indices.tolist()
    ends = [x + sc.num_draft_tokens for x in sc.lens]
    b.kv.alloc_extend(rows, b.K, ends)
    g = torch.Generator().manual_seed(sc.seed + 1)
    kf, vf = b.pool.get_flat_kv(0)
    for r, k0, k1 in zip(rows, b.K, ends):
        slots = b.kv.req_to_token[r, k0:k1].long()
        kf[slots] = torch.randn(kf[slots].shape, generator=g).to(kf)
        vf[slots] = 3 * torch.randn(vf[slots].shape, generator=g).to(vf)


SD = 3  #: draft steps of the B20 probe


def draft_steps_view(b):
    """The production draft-decode input: all Sd - 1 steps request-major, step ``draft_step`` cut
    by :func:`refspec.core.batch.draft_step_view` (case B20)."""
    rows = b.fb.req_pool_indices.tolist()
    steps = draft_decode_steps_batch(b.kv, rows, b.sc.lens, SD)
    return draft_step_view(steps, b.sc.draft_step, SD), b.q, b.k, b.v


# ---- the KV accounting probe (KV-004) ---------------------------------------------------

def free_tail_probe(env: Env, found: list, validate: bool) -> None:
    """v1 P > 1 rejected-slot free (docs/spec/kv.md#kv-004), P = 4, N = 4, L = 5, no draft accepted.

    Request A holds positions 0..8 (pages X0: 0-3, X1: 4-7, X2: 8); it commits 6 tokens
    (0..5), so only X2 may be freed.  With ``validate``: the page holding position 5 must still
    be in use (KV-004).  Without: request B then takes every free page and writes its KV; A's
    committed KV must be unchanged, and finishing both must free every page exactly once
    (KV-003) and bring the free count back to its start (KV-006)."""
    P, N, L = 4, 4, 5
    keep, alloc = L + 1, L + N
    kv = KVCache(4, 16, 1 + 3 + 1, P, extra=4 + N, device=env.device)
    pool = KVPool(1, kv.allocator.num_pages, P, 1, 8, dtype=env.dtype, device=env.device)
    start = kv.allocator.num_free_pages
    a = kv.alloc_req()
    kv.alloc_extend([a], [0], [alloc])
    committed = kv.req_to_token[a, :keep].long()
    vals = torch.arange(1, keep + 1, device=env.device).to(env.dtype)[:, None, None].expand(keep, 1, 8)
    pool.set_kv_buffer(0, committed, vals, vals)
    kv.free_tail(a, keep, alloc)
    page = int(committed[-1]) // P
    if validate:
        if not kv.allocator.is_in_use(page):
            found.append(Symptom("check", "KV-004", f"page {page} holds committed position {keep - 1} but was freed"))
        return
    other = kv.alloc_req()
    n = kv.allocator.num_free_pages * P
    locs = kv.alloc_extend([other], [0], [n])
    pool.set_kv_buffer(0, locs, torch.full((n, 1, 8), -7.0, dtype=env.dtype, device=env.device),
                       torch.full((n, 1, 8), -7.0, dtype=env.dtype, device=env.device))
    got = pool.get_flat_kv(0)[0][committed]
    if not torch.equal(got, vals):
        err = float((got - vals).abs().max())
        found.append(Symptom("mismatch", "KV-004", f"request A's committed KV (page {page}) was overwritten by "
                             "request B", err))
    kv.free_req(other, n)
    kv.free_req(a, keep)
    if kv.allocator.num_free_pages != start:
        found.append(Symptom("check", "KV-006", f"{kv.allocator.num_free_pages} pages free after both "
                             f"finished, {start} at the start"))


# ---- the catalogue ---------------------------------------------------------------------

def _case(label, mode, prepare=None, **kw):
    """``env -> Case``: the scenario is built on the probe's device and dtype."""
    return lambda env: Case(label, env.scenario(mode, **kw), prepare)


# seed-page-table: slot ids < NP, so the slot-as-page reads hit real pages (no crash); poison off,
# so the symptom is finite garbage (docs/spec/paging-attention.md#pa-002), not NaN
SEED_VERIFY = _case("seed/verify", M.TARGET_VERIFY, page_size=2, lens=[3, 5], num_draft_tokens=4,
                    shuffle_pages=False, extra_pages=12, poison=False)
SEED_DRAFT = _case("seed/draft", M.DECODE, draft_step=1, page_size=2, lens=[3, 5], shuffle_pages=False,
                   extra_pages=12, poison=False)
DE_V1 = _case("de-v1", M.DRAFT_EXTEND, page_size=4, lens=[9, 14, 5], num_draft_tokens=4,
              num_accept_tokens=[2, 4, 1])
DE_V2 = _case("B05", M.DRAFT_EXTEND_V2, page_size=4, lens=[12, 30, 7], num_draft_tokens=4,
              num_accept_tokens=[2, 4, 1])
B04 = _case("B04", M.TARGET_VERIFY, page_size=16, lens=[57, 47, 79, 58], num_draft_tokens=4)
B07 = _case("B07", M.TARGET_VERIFY, page_size=16, lens=[61, 20], num_draft_tokens=4)
B08 = _case("B08", M.DRAFT_EXTEND, page_size=4, lens=[16, 8, 38], num_draft_tokens=4,
            num_accept_tokens=[4, 1, 3], num_heads=16, num_kv_heads=1)
B11 = {P: _case(f"B11/P{P}", M.DECODE, page_size=P, lens=[10, 37, 5, 64, 3, 100, 1, 50]) for P in (1, 16)}
B14 = _case("B14", M.TARGET_VERIFY, set_horizon, page_size=16, lens=[30, 45], num_draft_tokens=4)
B18 = _case("B18", M.TARGET_VERIFY, page_size=16, lens=[28, 44, 29], num_draft_tokens=4)
B20 = _case("B20", M.DECODE, draft_step=SD - 2, page_size=4, lens=[9, 14])
WINDOW = _case("window", M.TARGET_VERIFY, page_size=4, lens=[20, 33], num_draft_tokens=4, window_left=5)
MIRROR = _case("mirror", M.TARGET_VERIFY, page_size=4, lens=[9, 14, 5], num_draft_tokens=4)
REJECTED = _case("de-v1/rejected", M.DRAFT_EXTEND, add_rejected_kv, page_size=4, lens=[9, 14, 5],
                 num_draft_tokens=4, num_accept_tokens=[2, 4, 1], extra_pages=8)

_de_v1 = Probe("DRAFT_EXTEND replay, a=[2,4,1], B=3 in Bg=4", graph_probe(DE_V1))
_de_v2 = Probe("B05 DRAFT_EXTEND_V2 replay, a=[2,4,1], B=3 in Bg=4", graph_probe(DE_V2))
_b11 = [Probe(f"B11 DECODE P={P}: replay 4 requests, then 3 others in Bg=4",
              graph_probe(B11[P], replays=([0, 1, 2, 3], [4, 5, 6]))) for P in (1, 16)]

PROBES: dict[str, list[Probe]] = {
    "seed-page-table": [
        Probe("TARGET_VERIFY replay P=2, B=2 in Bg=4", graph_probe(SEED_VERIFY)),
        Probe("draft decode step 1 replay P=2, B=2 in Bg=4", graph_probe(SEED_DRAFT))],
    "de-v1-uniform-cu-q": [_de_v1],
    "de-v2-packed-cu-q": [_de_v2],
    "de-v1-accept-off-by-one": [_de_v1],
    "de-v2-k-double-count": [Probe("B05 DRAFT_EXTEND_V2 eager, B=3", eager_probe(DE_V2)), _de_v2],
    "replay-rebind-page-table": _b11,
    "replay-rebind-cache-seqlens": _b11[1:],
    "stale-padded-rows": [Probe("B04 TARGET_VERIFY replay 4 then 3 requests in Bg=4",
                                graph_probe(B04, replays=([0, 1, 2, 3], [0, 1, 2]), kv_writes=True))],
    "pad-seq-lens-zero": [Probe("B03/B10 DRAFT_EXTEND replays, B=3 then 2 in Bg=4",
                                graph_probe(DE_V1, replays=([0, 1, 2], [2, 1])))],
    "capture-max-seqlen-q-small": [Probe("B08 DRAFT_EXTEND capture bs=3, a=[4,1,3], GQA 16",
                                         graph_probe(B08, capture_bs=(3,)))],
    "page-table-width-from-context": [Probe(f"B07 TARGET_VERIFY replay at the context wall, ctx {R.B07_CONTEXT}",
                                            graph_probe(B07, capture_bs=(2,)))],
    "free-last-committed-page": [Probe("v1 free_tail P=4, L=5, N=4, n=0; then a 2nd request",
                                       free_tail_probe),
                                 Probe("grown rows v1 P=4 TARGET_VERIFY: both wings on one batch",
                                       paired_probe(grown(M.TARGET_VERIFY, 4)))],
    "de-v1-attend-rejected": [Probe("DRAFT_EXTEND eager, a=[2,4,1], rejected slots allocated",
                                    eager_probe(REJECTED))],
    "verify-as-decode": [Probe("B14 TARGET_VERIFY eager, horizon probe", eager_probe(B14, horizon=True))],
    "draft-loc-step-major": [Probe("B20 draft decode step 1 eager, B=2, Sd=3",
                                   eager_probe(B20, batch_fn=draft_steps_view)),
                             Probe("grown rows v2 P=4 draft decode step 1, B=3: both wings on one batch",
                                   paired_probe(grown(M.DECODE, 4, version="v2", draft_step=1)))],
    "pad-rows-live-page": [Probe("B18 TARGET_VERIFY replays, B=3 then 2 in Bg=4",
                                 graph_probe(B18, replays=([0, 1, 2], [2, 0])))],
    "fa3-window-minus-one": [Probe("TARGET_VERIFY eager, window w=5, P=4, GQA 8/2", window_probe(WINDOW))],
    "emulator-window-edge": [Probe("TARGET_VERIFY eager on the emulator, window w=5, P=4",
                                   window_probe(WINDOW, provider="emulator"))],
    "replay-skips-validate-batch": [Probe("TARGET_VERIFY replay of a batch with seq_lens_cpu out of step",
                                          replay_validation_probe(MIRROR))],
    "positions-one-early": [Probe("grown rows v1 P=4 TARGET_VERIFY: both wings on one batch",
                                  paired_probe(grown(M.TARGET_VERIFY, 4))),
                            Probe("grown rows v2 P=16 DECODE: both wings on one batch",
                                  paired_probe(grown(M.DECODE, 16, version="v2")))],
}
PROBES.update({name: [Probe(label, run) for label, run in runs]
               for name, runs in (*TREE_PROBES.items(), *MLA_PROBES.items())})
