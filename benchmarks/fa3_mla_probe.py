"""Probe FlashAttention-3's MLA call (q/k head dim 64, V head dim 512, ``qv``, bf16, paged KV).

Runs SGLang's absorbed-MLA kernel call, as the FA3 backend makes it, on whatever
``flash_attn_interface`` is first on ``sys.path``, and compares it with an fp32 reference written
here in plain torch. Used by ``benchmarks/gpu_fa3_mla.sh probe`` (one process per FA3 build, since
a from-source build and tokenspeed-fa3 share the module and torch-op names).

The call (SGLang v0.5.23 flashattention_backend.py, absorbed path, keywords only)::

    flash_attn_with_kvcache(q=q_rope [T,H,64], k_cache=k_rope [pages,P,1,64],
        v_cache=c_kv [pages,P,1,512], qv=q_nope [T,H,512], page_table [B,max_pages] int32,
        cache_seqlens [B] int32, cu_seqlens_q [B+1] int32, max_seqlen_q, softmax_scale,
        causal, num_splits, return_softmax_lse)

``k_rope`` and ``c_kv`` are strided views of ONE pool buffer [slots,1,576] (row = [c_kv 512 |
k_rope 64]), viewed as [slots/P, P, 1, 576] and split at 512, so both have strides
(576*P, 576, 576, 1). ``q_rope`` is a slice of a wider per-head row and ``qv`` the [T,H,512]
transpose of a [H,T,512] batched-matmul output, as in the model (layout ``sglang``); layout
``contiguous`` passes packed copies.

Math of the reference (FA3's own test_util.py reference, in fp32):
``S[h,i,j] = scale * (q_rope[i,h] . k_rope[j] + qv[i,h] . c_kv[j])`` over the request's keys
j < K_b = cache_seqlens[b], read through the page table (slot = page_table[b, j // P] * P + j % P);
causal masks j > i + K_b - n_b (bottom-right, n_b = the request's query rows);
``out[i,h] = softmax_j(S) . c_kv`` (512 wide); ``lse[h,i] = logsumexp_j S`` (natural log).

Pass rule per configuration (FA3's test style): finite output and
``max|out - ref| <= 2 * max|out_r - ref| + 1e-3`` where ``out_r`` is the reference with the two
roundings a correct bf16 kernel makes (probabilities and output to bf16); LSE (when returned):
``max|lse - lse_ref| <= 1e-3 + 1e-3 * max|lse_ref|``.

Modes (SGLang's absorbed-MLA batches): decode (1 row a request), extend (prefix + new rows),
verify (4 draft rows a request), cascade (the top-k > 1 prefix call: causal=False, LSE on),
decode128 (128 query heads: reaches FA3's TMA paged path at P = 64), plus one pack_gqa=False call
(the only way to reach the non-pack-GQA translation unit). Grid: P in (1, 16, 64), num_splits in
(0, 1, 3), return_softmax_lse off/on.

Usage:
  device: ``PYTHONPATH=/tmp/fa3mla python3 benchmarks/fa3_mla_probe.py --label built``
          ``PYTHONPATH=/tmp/site python3 benchmarks/fa3_mla_probe.py --label tokenspeed-fa3
          --negative-control`` (exit 0 when every configuration FAILS, as expected there)
  CPU:    ``python benchmarks/fa3_mla_probe.py --dry-run`` (an independent emulator stands in for
          the kernel and must PASS; an emulator of a kernel that ignores ``qv`` and writes 64 of
          the 512 V columns must FAIL, and so must one whose softmax scale is 2% off; this checks
          the harness and the tightness of its bound, not FA3)
Exit status: 0 when the outcome is the expected one (all PASS, or all FAIL under
--negative-control), 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

D_ROPE, D_LATENT = 64, 512
ROW = D_LATENT + D_ROPE  # 576
SCALE = 0.1352  # DeepSeek-V3: 192**-0.5 * mscale**2 with YaRN (factor 40): not FA3's 576**-0.5


def make_case(mode: str, P: int, device: str, gen: torch.Generator) -> dict:
    """Build one batch: pool, paged views, page table, metadata, q_rope and qv.

    Returns a dict of tensors and ints; ``n`` (query rows) and ``K`` (keys) are per-request lists.
    """
    H = 128 if mode == "decode128" else 16
    if mode in ("decode", "decode128"):
        n = [1, 1, 1, 1, 1]
        K = [1, 37, 64, 129, 700]
    elif mode in ("extend", "cascade", "nopackgqa"):
        n = [1, 7, 33, 100]
        K = [1 + 0, 7 + 50, 33 + 200, 100 + 3]
    elif mode == "verify":
        n = [4, 4, 4]
        K = [4 + 10, 4 + 200, 4 + 511]
    else:
        raise ValueError(mode)
    B = len(n)
    pages_per = [math.ceil(k / P) for k in K]
    num_pages = sum(pages_per) + 3  # + page 0 (holds the padding slot 0) and two unused pages
    kv = torch.randn(num_pages * P, 1, ROW, generator=gen).to(torch.bfloat16).to(device)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # physical pages, never page 0
    page_table = torch.zeros(B, max(pages_per), dtype=torch.int32)
    for b in range(B):
        page_table[b, : pages_per[b]] = torch.tensor(perm[: pages_per[b]], dtype=torch.int32)
        perm = perm[pages_per[b]:]
    T = sum(n)
    # SGLang layouts: q_rope a slice of a wider row; qv the transpose of a [H, T, 512] bmm output
    q_wide = torch.randn(T, H, 192, generator=gen).to(torch.bfloat16).to(device)
    qv_bmm = torch.randn(H, T, D_LATENT, generator=gen).to(torch.bfloat16).to(device)
    kv_paged = kv.view(-1, P, 1, ROW)
    return dict(
        H=H, B=B, n=n, K=K, P=P, kv=kv,
        k_rope=kv_paged[..., D_LATENT:], c_kv=kv_paged[..., :D_LATENT],
        q_rope=q_wide[..., 128:], qv=qv_bmm.transpose(0, 1),
        page_table=page_table.to(device),
        cache_seqlens=torch.tensor(K, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0] + list(torch.cumsum(torch.tensor(n), 0).tolist()), dtype=torch.int32,
                                  device=device),
        max_seqlen_q=max(n),
    )


def reference(c: dict, causal: bool, kernel_rounding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLA math request by request in fp32 from the bf16 inputs.

    ``kernel_rounding=True`` adds the two roundings a correct bf16 FA3 kernel makes (the softmax
    probabilities to bf16 before the P.V product, the output to bf16): its distance to the plain
    fp32 result sets the pass bound. Returns out [T,H,512] (fp32) and lse [H,T] (fp32).
    """
    P, kv = c["P"], c["kv"]
    outs, lses = [], []
    row0 = 0
    for b in range(c["B"]):
        n_b, K_b = c["n"][b], c["K"][b]
        j = torch.arange(K_b, device=kv.device)
        slots = c["page_table"][b, j // P].long() * P + j % P
        keys = kv[slots, 0].float()  # [K, 576]
        ck, kr = keys[:, :D_LATENT], keys[:, D_LATENT:]
        qr = c["q_rope"][row0: row0 + n_b].float()  # [n, H, 64]
        qv = c["qv"][row0: row0 + n_b].float()  # [n, H, 512]
        s = (torch.einsum("ihd,jd->hij", qr, kr) + torch.einsum("ihd,jd->hij", qv, ck)) * SCALE
        if causal:
            i = torch.arange(n_b, device=kv.device)[:, None]
            s = s.masked_fill(j[None, :] > i + K_b - n_b, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [H, n]
        p = torch.softmax(s, dim=-1)
        if kernel_rounding:
            p = p.to(torch.bfloat16).float()
        o = torch.einsum("hij,jd->ihd", p, ck)
        outs.append(o.to(torch.bfloat16).float() if kernel_rounding else o)
        lses.append(lse)
        row0 += n_b
    return torch.cat(outs, 0), torch.cat(lses, 1)


def emulate_kvcache(q, k_cache, v_cache, qv=None, page_table=None, cache_seqlens=None, cu_seqlens_q=None,
                    max_seqlen_q=None, softmax_scale=None, causal=False, num_splits=0, pack_gqa=None,
                    return_softmax_lse=False, broken=False, scale_error=1.0):
    """CPU stand-in for FA3's ``flash_attn_with_kvcache`` (``--dry-run`` only), written apart from
    ``reference``: every request's keys padded to the longest, one masked fp32 softmax.

    ``broken=True`` mimics a kernel compiled without the (64, 512) instantiation: qv ignored, only
    the first 64 V columns written, the rest left uninitialised (NaN here). ``scale_error`` scales
    the softmax scale (a subtly wrong kernel, to show how tight the pass bound is).
    """
    del num_splits, pack_gqa, max_seqlen_q
    B, max_pages = page_table.shape
    P = k_cache.shape[1]
    kmax = max_pages * P
    j = torch.arange(kmax)
    slots_page = page_table[:, j // P].long()  # [B, kmax]
    kr = k_cache[slots_page, j % P, 0].float()  # [B, kmax, 64]
    ck = v_cache[slots_page, j % P, 0].float()  # [B, kmax, 512]
    out = torch.full((q.shape[0], q.shape[1], v_cache.shape[-1]), float("nan"))
    lse = torch.empty(q.shape[1], q.shape[0])
    for b in range(B):
        r0, r1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        K_b = int(cache_seqlens[b])
        s = torch.einsum("ihd,jd->hij", q[r0:r1].float(), kr[b])
        if not broken:
            s = s + torch.einsum("ihd,jd->hij", qv[r0:r1].float(), ck[b])
        s = s * (softmax_scale * scale_error)
        i = torch.arange(r1 - r0)[:, None]
        invisible = (j[None, :] >= K_b) | ((j[None, :] > i + K_b - (r1 - r0)) if causal else False)
        s = s.masked_fill(invisible, float("-inf"))
        o = torch.einsum("hij,jd->ihd", torch.softmax(s, -1), ck[b])
        if broken:
            out[r0:r1, :, :64] = o[..., :64]
        else:
            out[r0:r1] = o
        lse[:, r0:r1] = torch.logsumexp(s, -1)
    out = out.to(torch.bfloat16)
    return (out, lse) if return_softmax_lse else out


def predicted_tu(c: dict, num_splits: int, pack_gqa) -> str:
    """Which hdim64_512 translation unit FA3's host code should pick (flash_api_stable.cpp logic).

    TMA paging needs P % kBlockN(64) == 0 and max_seqlen_q * (H / H_k) > kBlockM(64); pack-GQA is
    always chosen for varlen q; a split (num_splits > 1, or chosen by the heuristic at 0) picks the
    _split unit. '?' marks what the heuristic decides at run time.
    """
    tma = c["P"] % 64 == 0 and c["max_seqlen_q"] * c["H"] > 64
    split = {0: "?", 1: "", 3: "_split"}[num_splits]
    base = "" if tma else "_paged"
    if split == "?":
        return f"{base or '_packgqa'}|{base}_split"
    if split:
        return base + split
    if tma:
        return "" if pack_gqa is False else "_packgqa"
    return "_paged"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="built")
    ap.add_argument("--negative-control", action="store_true",
                    help="expect every configuration to FAIL (a build without the 64/512 kernel)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: emulators instead of FA3 (checks the harness)")
    args = ap.parse_args(argv)

    if args.dry_run:
        device = "cpu"
        impls = [("emulator", emulate_kvcache, False),
                 ("emulator-without-qv", lambda *a, **k: emulate_kvcache(*a, broken=True, **k), True),
                 ("emulator-scale+2%", lambda *a, **k: emulate_kvcache(*a, scale_error=1.02, **k), True)]
    else:
        device = "cuda"
        import flash_attn_interface as fai  # noqa: PLC0415 - the module under test, from PYTHONPATH

        so = sys.modules.get("flash_attn_3._C")
        print(f"[{args.label}] flash_attn_interface: {fai.__file__}; _C: {getattr(so, '__file__', '?')}")
        try:
            import flash_attn_config  # noqa: PLC0415

            off = [k for k, v in flash_attn_config.CONFIG["build_flags"].items() if v]
            print(f"[{args.label}] build flags on: {', '.join(off)}")
        except Exception as exc:  # noqa: BLE001 - informational only
            print(f"[{args.label}] no flash_attn_config ({exc})")
        print(f"[{args.label}] torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name()}")
        impls = [(args.label, fai.flash_attn_with_kvcache, args.negative_control)]

    gen = torch.Generator().manual_seed(0)
    cases = []
    for P in (1, 16, 64):
        for mode in ("decode", "decode128", "extend", "verify", "cascade"):
            cases.append((mode, P))
    cases.append(("nopackgqa", 64))
    rc = 0
    for name, fn, expect_fail in impls:
        n_pass = n_fail = n_err = 0
        t0 = time.time()
        for mode, P in cases:
            c = make_case(mode, P, device, gen)
            causal = mode != "cascade"
            ref, lse_ref = reference(c, causal)
            pt, _ = reference(c, causal, kernel_rounding=True)
            err_pt = (pt - ref).abs().max().item()
            for layout in ("sglang", "contiguous") if P == 16 else ("sglang",):
                q_rope, qv = c["q_rope"], c["qv"]
                if layout == "contiguous":
                    q_rope, qv = q_rope.contiguous(), qv.contiguous()
                for num_splits in (0, 1, 3):
                    for want_lse in ((True,) if mode == "cascade" else (False, True)):
                        pack_gqa = False if mode == "nopackgqa" else None
                        tag = (f"{mode:9s} P={P:<2d} H={c['H']:<3d} splits={num_splits} lse={int(want_lse)} "
                               f"{layout:10s} tu=hdim64_512_bf16{predicted_tu(c, num_splits, pack_gqa)}")
                        try:
                            res = fn(q=q_rope, k_cache=c["k_rope"], v_cache=c["c_kv"], qv=qv,
                                     page_table=c["page_table"], cache_seqlens=c["cache_seqlens"],
                                     cu_seqlens_q=c["cu_seqlens_q"], max_seqlen_q=c["max_seqlen_q"],
                                     softmax_scale=SCALE, causal=causal, num_splits=num_splits,
                                     pack_gqa=pack_gqa, return_softmax_lse=want_lse)
                            out, lse = (res[0], res[1]) if want_lse else (res, None)
                            if device == "cuda":
                                torch.cuda.synchronize()
                        except Exception as exc:  # noqa: BLE001 - a failing kernel is a result here
                            n_err += 1
                            print(f"[{name}] ERROR {tag}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                            continue
                        out = out.float()
                        finite = bool(torch.isfinite(out).all())
                        err = (out - ref).abs().max().item() if finite else float("nan")
                        ok = finite and err <= 2 * err_pt + 1e-3
                        lse_msg = ""
                        if lse is not None:
                            lse_err = (lse.float() - lse_ref).abs().max().item()
                            lse_ok = lse_err <= 1e-3 + 1e-3 * lse_ref.abs().max().item()
                            ok = ok and lse_ok
                            lse_msg = f" lse_err={lse_err:.2e}"
                        nan_share = (~torch.isfinite(out)).float().mean().item()
                        verdict = "PASS" if ok else "FAIL"
                        n_pass += ok
                        n_fail += not ok
                        print(f"[{name}] {verdict} {tag} err={err:.2e} bound={2 * err_pt + 1e-3:.2e}"
                              f"{lse_msg} nonfinite={nan_share:.0%}")
        total = n_pass + n_fail + n_err
        wall = time.time() - t0
        if expect_fail:
            good = n_pass == 0
            print(f"PROBE {name}: {n_fail + n_err}/{total} configurations FAIL or raise "
                  f"({'as expected: negative control' if good else 'UNEXPECTED PASSES'}); {wall:.1f} s")
        else:
            good = n_pass == total
            print(f"PROBE {name}: {'PASS' if good else 'FAIL'} ({n_pass}/{total} pass, {n_fail} fail, "
                  f"{n_err} raise); {wall:.1f} s")
        rc |= 0 if good else 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
