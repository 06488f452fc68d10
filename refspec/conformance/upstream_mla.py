"""SGLang's MLA forward path on a CPU (worker subprocess only): the jobs of
:mod:`refspec.conformance.mla_forward`, driven through the adapter of the code's API shape.

For a job of mode ``mla_<mode>`` the release's own ``FlashAttentionBackend`` (or
``FlashAttentionMultiStepBackend``) is built with ``model_config.attention_arch =
AttentionArch.MLA`` (its ``use_mla``) on the release's own KV pool class,
``MLATokenToKVPool``, constructed on the CPU and filled with the job's rows (so the store is
upstream's own writer: ``set_mla_kv_buffer`` and its Triton kernel, run by Triton's
interpreter).  The metadata is built by the adapter's hooks (eager; capture and padded replay
through the graph hooks or the legacy hooks), then the release's own ``forward`` runs the way
DeepSeek's model calls it: ``forward(q_nope_absorbed, k_nope, k_nope, attn_mqa, fb, q_rope=,
k_rope=)`` on the absorbed path, ``forward(q, k, v, attn_mha, fb, save_kv_cache=False)`` with
``fb.attn_attend_prefix_cache = False`` on the prefix-free prefill (the model wrote the latent
rows itself).  The kernel globals the backend module looks up (``flash_attn_with_kvcache``,
``flash_attn_varlen_func``, ``merge_state_v2``) are :class:`~refspec.conformance.recorder.Recorder` s
around refspec's emulator and merge rule, so every call is recorded (tensors that are views of
the pool by their geometry: shape, strides, offset into the pool's row storage) and the output
is computed.  Each phase starts from the job's pool; the rows it wrote and the output come back.

At a graph phase the forward runs on the padded static batch after the hooks, its inputs in
static buffers: at capture the call a graph records; at replay a fresh forward (the output and
the store a replay computes) and, as the kernel is handed it, the captured call's tensors read
again (legacy hooks, which rewrite the captured buffers in place outside the graph) or the fresh
call's tensors with the captured call's scalars (graph hooks, whose in-graph part re-runs).

Top-k > 1: the tree's mask and positions are refspec's (the tree is compared on its own by the
MHA tree jobs); before the draft-decode forwards upstream's own code copies the prefix's partial
tail page into the branches (``move_kv_cache`` on the real pool): 0.5.23's spec-v2
``eagle_worker_common.prepare_for_draft``, or the v1 worker's ``EAGLEWorker._draft_preprocess_decode``
(0.5.12.post1; its allocator calls replaced by the job's slots, the same slots refspec allocated).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import contextlib

import torch

from refspec.conformance import lines
from refspec.conformance import upstream_common as uc
from refspec.conformance.recorder import Call, Recorder, _caller, installed

#: the key of a result's fields holding the MLA part (output, rows written, moves)
MLA = "mla"
#: the recorded kernel globals of the backend module (each release imports them from its own place)
KERNELS = ("flash_attn_with_kvcache", "flash_attn_varlen_func", "merge_state_v2")


def pool_view(t: torch.Tensor, buf: torch.Tensor) -> dict | None:
    """``t``'s geometry when it is a view of the pool buffer ``buf`` (the same storage): shape,
    strides (None for a dim of size 1: never used to address), offset in elements from the
    buffer's first element; None for any other tensor."""
    if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return None
    return {"pool_view": True, "shape": tuple(t.shape),
            "stride": tuple(None if n == 1 else s for n, s in zip(t.shape, t.stride())),
            "offset": int(t.storage_offset() - buf.storage_offset()), "dtype": str(t.dtype).replace("torch.", "")}


def plain_calls(calls, buf: torch.Tensor) -> list[dict]:
    """The recorded calls as plain dicts, every tensor argument that is a view of the pool
    replaced by its geometry (:func:`pool_view`; its contents are the pool, compared as the rows
    written)."""
    out = []
    for c in calls:
        p = c.plain()
        args = dict(p["args"])
        for name, t in c.refs.items():
            v = pool_view(t, buf)
            if v is not None:
                args[name] = v
        out.append(dict(p, args=args))
    return out


def written(before: torch.Tensor, after: torch.Tensor) -> dict:
    """``{"slots": int64 [n], "rows": [n, 1, D]}``: the pool rows that differ after a forward."""
    n = before.shape[0]
    diff = (before.reshape(n, -1) != after.reshape(n, -1)).any(1)
    slots = diff.nonzero().flatten()
    return {"slots": slots, "rows": after[slots].clone()}


def _emulated_kvcache(rec):
    """``flash_attn_with_kvcache`` through refspec's emulator, ``qv`` included (ML-005).  Where the
    emulator refuses the call (an argument the real kernel would turn into a read outside the pool
    or the table: PA-003 / PA-010 / PA-011), the refusal is recorded on the call (``refused``) and
    the output is NaN: what the kernel computes there is undefined."""
    def forward(**a):
        from refspec.core.invariants import InvariantError
        from refspec.fa3.emulator import emulate_flash_attn_with_kvcache

        new = [n for n in ("k", "v", "rotary_cos", "cache_batch_idx", "cache_leftpad", "q_descale", "k_descale",
                           "v_descale") if a.get(n) is not None]
        if new:
            raise ValueError(f"the emulator takes the paged call without {', '.join(new)}")
        q, v_cache = a["q"], a["v_cache"]
        lse = bool(a.get("return_softmax_lse"))
        try:
            return emulate_flash_attn_with_kvcache(
                q, a["k_cache"], v_cache, cache_seqlens=a["cache_seqlens"], page_table=a["page_table"],
                cu_seqlens_q=a["cu_seqlens_q"], max_seqlen_q=a["max_seqlen_q"], softmax_scale=a.get("softmax_scale"),
                causal=bool(a.get("causal")), window_size=tuple(a.get("window_size") or (-1, -1)),
                softcap=a.get("softcap") or 0.0, return_softmax_lse=lse, qv=a.get("qv"))
        except InvariantError as e:
            rec.calls[-1].args["refused"] = str(e)
            o = q.new_full((*q.shape[:-1], v_cache.shape[-1]), float("nan"))
            return (o, torch.full((q.shape[1], q.shape[0]), float("nan"))) if lse else o
    return forward


def _emulated_varlen(**a):
    """``flash_attn_varlen_func`` through refspec's emulator (the non-absorbed prefill, ML-010)."""
    from refspec.fa3.emulator import emulate_flash_attn_varlen_func

    out = emulate_flash_attn_varlen_func(
        a["q"], a["k"], a["v"], cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"],
        max_seqlen_q=a["max_seqlen_q"], max_seqlen_k=a["max_seqlen_k"], softmax_scale=a.get("softmax_scale"),
        causal=bool(a.get("causal")), return_softmax_lse=bool(a.get("return_softmax_lse")))
    o = out[0] if isinstance(out, tuple) else out
    if isinstance(a.get("out"), torch.Tensor):
        a["out"].copy_(o)
    return out


def _merge(**a):
    """``merge_state_v2`` by refspec's rule (TR-012, :func:`refspec.fa3.tree_attention.merge_state_torch`)."""
    from refspec.fa3.tree_attention import merge_state_torch

    return merge_state_torch(a["v_a"], a["s_a"], a["v_b"], a["s_b"])


class MLAUpstream:
    """The MLA half of an adapter ``up`` (:class:`refspec.conformance.upstream_common.Adapter`):
    built before the stubs are armed (its imports), then :meth:`run` per MLA job."""

    def __init__(self, up):
        self.up, self.problem = up, None
        try:
            import sglang.srt.mem_cache.memory_pool as mp

            self.Pool = mp.MLATokenToKVPool
        except Exception as e:  # noqa: BLE001 -- said per job (an adapter gap)
            self.Pool, self.problem = None, f"the release's MLATokenToKVPool cannot be imported here: {uc.describe(e)}"
        self.v1 = self.v2 = None
        #: why each of the two tail-copy entry points is not driven here (an import's own error text, or the
        #: entry point the module lacks): said in the adapter gap of a job that needs the copy
        self.why: dict[str, str] = {}
        try:  # the v1 EAGLE worker (0.5.12.post1): its draft preprocess calls the pool's move_kv_cache
            import sglang.srt.speculative.eagle_worker as ew

            if hasattr(ew.EAGLEWorker, "_draft_preprocess_decode"):
                self.v1 = ew
            else:  # (0.4.x: the worker allocates the draft slots inline in draft(); no tail copy at P = 1)
                self.why["v1"] = "its EAGLEWorker has no _draft_preprocess_decode"
        except Exception as e:  # noqa: BLE001 -- absent from 0.5.14 on (spec v2 only)
            self.why["v1"] = f"sglang.srt.speculative.eagle_worker cannot be imported: {uc.describe(e)}"
        try:  # the spec-v2 draft preparation (0.5.23): duplicate_prefix_tail_to_draft_branches -> move_kv_cache
            import sglang.srt.speculative.eagle_worker_common as ewc

            self.v2 = ewc if hasattr(ewc, "prepare_for_draft") else None
            if self.v2 is None:
                self.why["v2"] = "its eagle_worker_common has no prepare_for_draft"
        except Exception as e:  # noqa: BLE001 -- absent before spec v2's common module
            self.why["v2"] = f"sglang.srt.speculative.eagle_worker_common cannot be imported: {uc.describe(e)}"

    @contextlib.contextmanager
    def parallel(self):
        """0.5.23's parallel context as a server without decode context parallelism has it: its
        ``publish`` sets ``attn_dcp_rank = 0`` when DCP is off (``runtime_context.py``), which the
        MLA pool's writer reads; the job's server args are installed with ``override_server_args``,
        which publishes no rank, so the worker states that one value for the forward."""
        try:
            from sglang.srt.runtime_context import get_parallel
        except ImportError:  # older releases: no parallel context
            yield
            return
        par = get_parallel()
        try:
            needs = par.attn_dcp_rank is None
        except RuntimeError:
            needs = not par.dcp_enabled
        if not needs:
            yield
            return
        with par.override(attn_dcp_rank=0):
            yield

    # ---- the pieces upstream reads ----
    def pool(self, job: dict):
        """The release's ``MLATokenToKVPool`` on the CPU, ``size + page_size`` slots as the job's
        pool, filled with the job's rows."""
        if self.Pool is None:
            raise uc.AdapterGap(self.problem)
        m, P = job["mla"], job["page_size"]
        rows = m["pool0"]
        pool = uc.call(self.Pool, size=rows.shape[0] - P, page_size=P, dtype=rows.dtype, kv_lora_rank=m["R"],
                       qk_rope_head_dim=m["Dr"], layer_num=1, device="cpu", enable_memory_saver=False)
        _buffer(pool).copy_(rows)
        self.at = {}
        for name in ("set_mla_kv_buffer", "move_kv_cache"):  # where upstream calls them (the findings' lines)
            fn = getattr(pool, name, None)
            if fn is not None:
                setattr(pool, name, self._located(name, fn))
        return pool

    def _located(self, name: str, fn):
        """``fn`` (a method of the pool) recording the ``file:line`` of its caller under ``name``."""
        def call(*args, **kwargs):
            self.at[name] = _caller(2)
            return fn(*args, **kwargs)
        return call

    def runner(self, job: dict, sa, pool, draft: bool):
        """The adapter's model-runner namespace with the MLA arch and the release's MLA pool."""
        up = self.up
        if up.hooks == "graph":
            mr = up.runner(job["req_to_token"], job["page_size"], job["context_len"], draft, sa)
        else:
            mr = up.runner(job, sa)
        mr.model_config = uc.model_config(job["context_len"], up.arch.MLA)
        mr.token_to_kv_pool = pool
        return mr

    def layer(self, job: dict, mha: bool):
        """``attn_mqa`` (absorbed: H query heads over one KV head, head_dim R + Dr, v_head_dim R) or
        ``attn_mha`` (the prefill: H heads, head_dim Dn + Dr, v_head_dim Dv), as DeepSeek's model
        builds its two ``RadixAttention`` layers (``deepseek_v2.py``)."""
        m = job["mla"]
        kind = getattr(self.up.fa, "AttentionType", None)
        extra = {"attn_type": kind.DECODER} if kind is not None and hasattr(kind, "DECODER") else {}
        H = m["H"]
        hk, d, dv = (H, m["Dn"] + m["Dr"], m["Dv"]) if mha else (1, m["R"] + m["Dr"], m["R"])
        return uc.Given("layer", layer_id=0, tp_q_head_num=H, tp_k_head_num=hk, tp_v_head_num=hk, head_dim=d,
                        qk_head_dim=d, v_head_dim=dv, scaling=m["scaling"], logit_cap=0.0, sliding_window_size=-1,
                        is_cross_attention=False, k_scale=None, v_scale=None, k_scale_float=None,
                        v_scale_float=None, **extra)

    def fb(self, base: str, d: dict, job: dict, mr, **extra):
        """The adapter's ``ForwardBatch`` namespace plus the fields the MLA forward reads:
        ``attn_attend_prefix_cache`` (None: the absorbed path; False: the prefix-free prefill),
        ``input_ids`` None (no context parallelism), ``out_cache_loc_is_physical`` (its default),
        ``mha_one_shot`` / ``mha_return_lse`` (the prefill's MHA_ONE_SHOT), the pool."""
        mha = base == "extend"
        fields = dict(token_to_kv_pool=mr.token_to_kv_pool, attn_attend_prefix_cache=False if mha else None,
                      input_ids=None, out_cache_loc_is_physical=False, mha_one_shot=mha, mha_return_lse=False,
                      dcp_kv_mask=None)
        if self.up.hooks == "legacy":
            fields["req_to_token_pool"] = mr.req_to_token_pool
        b = self.up.fb(base, d, job["num_draft_tokens"], **fields, **extra)
        if self.up.hooks == "legacy":
            b.spec_info = self.up.typed(b.spec_info, base)
        return b

    def recorders(self) -> dict:
        fa = self.up.fa
        recs = {n: Recorder(n, original=fa.__dict__.get(n)) for n in KERNELS}
        recs["flash_attn_with_kvcache"].forward = _emulated_kvcache(recs["flash_attn_with_kvcache"])
        recs["flash_attn_varlen_func"].forward = _emulated_varlen
        recs["merge_state_v2"].forward = _merge
        return recs

    def forward(self, be, fb, layer, x: dict, pool, mha: bool):
        """One forward of upstream's backend ``be`` on ``fb`` with the inputs ``x``: ``(calls (the
        Call objects, their tensors kept), output [T, H, Dv], rows written)``; raises what upstream
        raises."""
        buf = _buffer(pool)
        before = buf.clone()
        recs = self.recorders()
        with lines.paused(), installed(self.up.fa, recs, objects=(be,)), self.parallel():
            if mha:
                o = be.forward(x["q"], x["k"], x["v"], layer, fb, save_kv_cache=False)
            else:
                o = be.forward(x["q"], x["k"], x["k"], layer, fb, q_rope=x["q_rope"], k_rope=x["k_rope"])
        calls = sorted((c for r in recs.values() for c in r.calls), key=lambda c: c.order)
        o = o[0] if isinstance(o, tuple) else o
        return calls, o.reshape(x["q"].shape[0], layer.tp_q_head_num, layer.v_head_dim).clone(), \
            written(before, buf)

    def result(self, md_fields: dict, calls, out, rows, buf, extra: dict | None = None) -> dict:
        """One result's fields: the metadata, the kernel calls, the MLA part (the output, the rows
        written and the line that stored them, ``extra``).  ``md_fields`` itself, completed in place:
        the dict ``upstream_common.fields`` marked, by which the worker attaches the phase's executed
        lines (:meth:`refspec.conformance.lines.Tracer.attach`; a copy would carry none)."""
        mla = dict({"out": out, "written": dict(rows, at=self.at.pop("set_mla_kv_buffer", None))}, **(extra or {}))
        md_fields.update({uc.KERNEL: plain_calls(calls, buf), MLA: mla})
        return md_fields

    # ---- the jobs ----
    def run(self, job: dict, sa) -> dict:
        base = job["mode"].removeprefix("mla_")
        return self.run_tree(job, sa, base) if base.startswith("tree_") else self.run_flat(job, sa, base)

    def _attempt(self, out: dict, key, fn):
        """``out[key] = fn()``, or the text of what upstream raised (that result's error)."""
        try:
            out[key] = fn()
        except uc.AdapterGap:
            raise
        except Exception as e:  # noqa: BLE001 -- that phase's own upstream error; the others stand
            out[key] = uc.describe(e)

    def _phase(self, job, base, phase, steps, pool, layer, mha, out, captured=None, static=None):
        """The forwards of one phase (each draft step in turn, from the job's pool), into ``out``."""
        buf = _buffer(pool)
        buf.copy_(job["mla"]["pool0"])
        d = job[phase]
        for s, b in steps:
            x = job["mla"]["inputs"][phase][0 if s is None else s]
            if static is not None:  # the graph's input buffers: rewritten in place at replay
                bufs = static.setdefault(s, {n: t.clone() for n, t in x.items()})
                for n, t in x.items():
                    bufs[n].copy_(t)
                x = bufs
            fb = self.fb(base, _step(d, s, job), job, self.mr)
            md = uc.fields(b.forward_metadata)
            try:
                calls, o, w = self.forward(b, fb, layer, x, pool, mha)
            except uc.AdapterGap:
                raise
            except Exception as e:  # noqa: BLE001 -- the forward's own upstream error (the metadata stands)
                md[uc.KERNEL] = uc.describe(e)  # (in place: the marked dict, its executed lines attached)
                out[(phase, s)] = md
                continue
            out[(phase, s)] = self.result(md, self._shown(phase, s, calls, captured), o, w, buf)

    def _shown(self, phase: str, step, calls, captured: dict | None):
        """The kernel calls a result shows: a capture's are kept in ``captured`` (by draft step), a
        replay shows the captured calls as the replay left them (:meth:`_replayed`), eager its own."""
        if phase == "capture" and captured is not None:
            captured[step] = calls
        if phase == "replay" and captured is not None and step in captured:
            return self._replayed(captured[step], calls)
        return calls

    def _replayed(self, captured, fresh):
        """What a replayed graph hands the kernel (module doc)."""
        if self.up.hooks == "legacy":
            return [c.reread() for c in captured]
        if len(captured) != len(fresh):
            return fresh
        return [Call(f.name, {k: (v if k in f.refs else c.args.get(k, v)) for k, v in f.args.items()}, f.where,
                     f.refs, f.order) for c, f in zip(captured, fresh)]

    def run_flat(self, job: dict, sa, base: str) -> dict:
        """``{(phase, step): fields}`` of one top-k = 1 MLA job (module doc)."""
        fa, Sd = self.up.fa, job["num_steps"]
        pool = self.pool(job)
        mr = self.mr = self.runner(job, sa, pool, base in uc.DRAFT_MODES)
        multi = base == "draft_decode"
        be = fa.FlashAttentionMultiStepBackend(mr, topk=1, speculative_num_steps=Sd) if multi else \
            fa.FlashAttentionBackend(mr)
        steps = uc.draft_steps(be, Sd) if multi else [(None, be)]
        mha = base == "extend"
        layer = self.layer(job, mha)
        out: dict = {}
        be.init_forward_metadata(self.fb(base, job["eager"], job, mr))
        self._phase(job, base, "eager", steps, pool, layer, mha, out)
        if "bs" not in job:
            return out
        captured, static = {}, {}
        try:
            self._hooks(be, multi, job, base, mr, "capture")
        except Exception as e:  # noqa: BLE001 -- the capture's own error: replay has nothing to run on
            out.update({(ph, s): uc.describe(e) for ph in ("capture", "replay") for s, _ in steps})
            return out
        self._phase(job, base, "capture", steps, pool, layer, mha, out, captured, static)
        self._into_static(job)
        try:
            self._hooks(be, multi, job, base, mr, "replay")
        except Exception as e:  # noqa: BLE001 -- the replay's own error
            out.update({("replay", s): uc.describe(e) for s, _ in steps})
            return out
        self._phase(job, base, "replay", steps, pool, layer, mha, out, captured, static)
        return out

    def _into_static(self, job: dict) -> None:
        """Legacy hooks: the replay batch becomes the capture batch's own tensors with the replay's
        values copied in (:func:`~refspec.conformance.upstream_common.into_static`), as SGLang's
        ``cuda_graph_runner`` hands its static buffers (int32 ``seq_lens`` sliced ``[:bs]``, written in
        place) to the replay hook; so a metadata field the capture bound to such a buffer (0.4.7's
        ``cache_seqlens_int32 = seq_lens.to(torch.int32)``, an alias of the int32 buffer) is read
        fresh by the replayed call, and only a field bound to a tensor of the hook's own that the
        replay rebinds reads stale (CG-001).  Graph hooks re-run their in-graph part: no change."""
        if self.up.hooks == "legacy":
            job["replay"] = uc.into_static(job["capture"], job["replay"])

    def _hooks(self, be, multi: bool, job: dict, base: str, mr, phase: str) -> None:
        """The graph hooks of ``phase`` on the job's static batch, as the adapter's shape runs them."""
        fb = self.fb(base, job[phase], job, mr)
        bs = job["bs"]
        if self.up.hooks == "graph":
            if phase == "capture":
                be.init_cuda_graph_state(bs, job["capture"]["num_tokens"])
            be.init_forward_metadata_out_graph(fb, in_capture=phase == "capture")
            be.init_forward_metadata_in_graph(fb)
            return
        if phase == "capture":
            uc.call(be.init_cuda_graph_state, max_bs=bs, max_num_tokens=job["capture"]["num_tokens"])
        uc.legacy_hook(be, phase, fb, bs, job["capture"]["num_tokens"], multi)

    # ---- top-k > 1: the cascade ----
    def tree_fb(self, base: str, d: dict, job: dict, mr, step: int | None = None):
        """A tree batch: TARGET_VERIFY with refspec's tree (mask, positions), or DECODE over the B*k
        branch rows (draft step ``step``: its slots and positions); ``seq_lens`` int64, as
        upstream's scheduler holds it."""
        k, S, N = job["topk"], job["num_steps"], job["num_draft_tokens"]
        draft = base == "tree_draft_decode"
        loc, pos = d["out_cache_loc"], d["positions"]
        if draft and step is not None:
            loc, pos = loc.view(-1, S)[:, step].contiguous(), pos.view(-1, S)[:, step].contiguous()
        ns = uc.Given("spec_info", is_draft_input=lambda: draft, positions=pos, custom_mask=d["custom_mask"], topk=k,
                      num_tokens_per_req=k if draft else N, draft_token_num=N, ragged_verify_layout=None,
                      spec_steps=S)
        if self.up.hooks == "legacy":
            ns = self.up.typed(ns, "draft_decode" if draft else "verify")
        fields = dict(token_to_kv_pool=mr.token_to_kv_pool, attn_attend_prefix_cache=None, input_ids=None,
                      out_cache_loc_is_physical=False, dcp_kv_mask=None, mha_one_shot=False, mha_return_lse=False)
        if self.up.hooks == "legacy":
            fields["req_to_token_pool"] = mr.req_to_token_pool
        return uc.Given("forward_batch", forward_mode=self.up.FM["DECODE" if draft else "TARGET_VERIFY"],
                        batch_size=int(d["req_pool_indices"].numel()), req_pool_indices=d["req_pool_indices"],
                        seq_lens=d["seq_lens"].long(), seq_lens_cpu=d["seq_lens_cpu"],
                        seq_lens_sum=int(d["seq_lens_cpu"].sum()), extend_seq_lens=None, extend_seq_lens_cpu=None,
                        extend_prefix_lens_cpu=None, encoder_lens=None, out_cache_loc=loc, positions=pos,
                        kv_loc_plan=None, kv_loc_cols=None, attn_cp_metadata=None, spec_info=ns, **fields)

    def run_tree(self, job: dict, sa, base: str) -> dict:
        """``{(phase, step): {"prefix", "expand", kernel calls, mla}}`` of one top-k > 1 MLA job."""
        fa, k, S = self.up.fa, job["topk"], job["num_steps"]
        draft = base == "tree_draft_decode"
        pool = self.pool(job)
        mr = self.mr = self.runner(job, sa, pool, draft)
        if draft:
            be = fa.FlashAttentionMultiStepBackend(mr, topk=k, speculative_num_steps=S)
            steps = uc.draft_steps(be, S)
        else:
            be = fa.FlashAttentionBackend(mr)
            steps = [(None, be)]
        layer = self.layer(job, False)
        out: dict = {}
        be.init_forward_metadata(self.tree_fb(base, job["eager"], job, mr))
        move = None
        if draft:  # upstream's own tail copy on the real pool, from the job's unmoved rows
            try:
                move = self.tail_copy(job, pool, mr)
            except uc.AdapterGap:
                raise
            except Exception as e:  # noqa: BLE001 -- upstream's worker fails before any draft forward
                out.update({("eager", s): uc.describe(e) for s, _ in steps})
                move = False
        if move is not False:
            self._tree_phase(job, base, "eager", steps, pool, layer, out, move=move)
        if "bs" not in job:  # an eager-only job
            return out
        bs, N = job["bs"], job["num_draft_tokens"]
        captured, static = {}, {}
        for phase in ("capture", "replay"):
            if phase == "replay":
                self._into_static(job)
            try:
                if phase == "capture":
                    uc.call(be.init_cuda_graph_state, max_bs=bs, max_num_tokens=bs * (k * S if draft else N))
                self._tree_hooks(be, draft, job, base, mr, phase)
            except Exception as e:  # noqa: BLE001 -- the phase's own error
                out.update({(ph, s): uc.describe(e) for ph in ("capture", "replay") for s, _ in steps
                            if (ph, s) not in out})
                return out
            self._tree_phase(job, base, phase, steps, pool, layer, out, captured, static)
        return out

    def _tree_hooks(self, be, draft: bool, job: dict, base: str, mr, phase: str) -> None:
        fb = self.tree_fb(base, job[phase], job, mr)
        bs, N = job["bs"], job["num_draft_tokens"]
        if self.up.hooks == "graph":
            be.init_forward_metadata_out_graph(fb, in_capture=phase == "capture")
            be.init_forward_metadata_in_graph(fb)
        elif phase == "capture":
            if draft:
                be.init_forward_metadata_capture_cuda_graph(fb)
            else:
                be.init_forward_metadata_capture_cuda_graph(bs, bs * N, fb.req_pool_indices, fb.seq_lens, None,
                                                            fb.forward_mode, fb.spec_info)
        elif draft:
            be.init_forward_metadata_replay_cuda_graph(fb, bs)
        else:
            be.init_forward_metadata_replay_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_sum, None,
                                                       fb.forward_mode, fb.spec_info, fb.seq_lens_cpu,
                                                       fb.out_cache_loc)

    def _tree_phase(self, job, base, phase, steps, pool, layer, out, captured=None, static=None, move=None):
        buf = _buffer(pool)
        if phase != "eager":  # the graph phases start from refspec's moved rows (the copy is no part of a graph)
            buf.copy_(job["mla"].get("pool_moved", job["mla"]["pool0"]))
        d = job[phase]
        for s, b in steps:
            x = job["mla"]["inputs"][phase][0 if s is None else s]
            if static is not None:
                bufs = static.setdefault(s, {n: t.clone() for n, t in x.items()})
                for n, t in x.items():
                    bufs[n].copy_(t)
                x = bufs
            fb = self.tree_fb(base, d, job, self.mr, step=s)
            parts = {"prefix": uc.fields(b.forward_metadata),
                     "expand": uc.fields(b.forward_metadata_spec_decode_expand)}
            try:
                calls, o, w = self.forward(b, fb, layer, x, pool, False)
            except uc.AdapterGap:
                raise
            except Exception as e:  # noqa: BLE001 -- the forward's own upstream error (the metadata stands)
                out[(phase, s)] = dict(parts, **{uc.KERNEL: uc.describe(e)})
                continue
            extra = {"moved": move} if move is not None and s == steps[0][0] else None
            out[(phase, s)] = self.result(parts, self._shown(phase, s, calls, captured), o, w, buf, extra)

    def tail_copy(self, job: dict, pool, mr) -> dict:
        """Upstream's own copy of each request's partial prefix tail page into its branches
        t >= 1 (TR-015, ML-012) on the real pool, before the draft forwards: ``{"slots", "rows"}``
        of the rows it wrote.  Raises what upstream raises (0.5.12.post1's v1 worker: the pool has
        no ``move_kv_cache``, sglang#26982).  A release with neither worker entry point (0.4.x, whose
        worker allocates the draft slots inline) copies nothing where no prefix ends inside a page (at
        P = 1 always: :func:`partial_tail`), and is an :class:`~refspec.conformance.upstream_common.AdapterGap`
        (naming why each entry point is not driven) where one does."""
        buf = _buffer(pool)
        before = buf.clone()
        if self.v2 is not None:
            self._prepare_v2(job, pool)
        elif self.v1 is not None:
            self._preprocess_v1(job, pool)
        elif partial_tail(job):
            raise uc.AdapterGap("refspec cannot run this release's tail copy (a prefix ends inside a page): neither "
                                "the v1 EAGLE worker's _draft_preprocess_decode nor spec-v2's prepare_for_draft is "
                                f"driven here (v1: {self.why.get('v1')}; v2: {self.why.get('v2')})")
        # (else no prefix ends inside a page -- always so at P = 1 --: there is no tail to copy, none is copied)
        return dict(written(before, buf), at=self.at.pop("move_kv_cache", None))

    def _prepare_v2(self, job: dict, pool) -> None:
        """0.5.23: ``eagle_worker_common.prepare_for_draft`` (its ``ForwardBatch.init_new`` returns the
        batch's slots), whose ``duplicate_prefix_tail_to_draft_branches`` calls ``move_kv_cache``."""
        ewc, d = self.v2, job["eager"]
        k, S, P = job["topk"], job["num_steps"], job["page_size"]
        B = int(d["req_pool_indices"].numel())
        batch = uc.NS(forward_mode=self.up.FM["DECODE"], seq_lens=d["seq_lens"].long(),
                      req_pool_indices=d["req_pool_indices"], token_to_kv_pool_allocator=uc.NS(page_size=P),
                      device="cpu", multimodal_inputs=[None] * B, out_cache_loc=None)
        runner = uc.NS(model_config=uc.NS(model_is_mrope=False), token_to_kv_pool=pool,
                       spec_algorithm=uc.NS(is_standalone=lambda: False))
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        spec = EagleDraftInput(topk_p=torch.zeros(B, k), topk_index=torch.zeros(B, k, dtype=torch.long),
                               num_tokens_per_req=k)
        saved = ewc.ForwardBatch
        ewc.ForwardBatch = uc.NS(init_new=lambda b, *a, **kw: uc.NS(out_cache_loc=b.out_cache_loc))
        try:
            with lines.paused():
                ewc.prepare_for_draft(spec, uc.NS(req_to_token=job["req_to_token"]), batch, None, runner, k, S)
        finally:
            ewc.ForwardBatch = saved

    def _preprocess_v1(self, job: dict, pool) -> None:
        """0.5.12.post1: ``EAGLEWorker._draft_preprocess_decode`` on the batch, its allocator calls
        (``alloc_token_slots`` / ``alloc_paged_token_slots_extend``) answered with the slots the job
        allocated (``req_to_token`` past each request's length, as many as the release asks for);
        at P > 1 it copies the tail with ``self.draft_model_runner.token_to_kv_pool.move_kv_cache``."""
        ew, d = self.v1, job["eager"]
        k, S, P = job["topk"], job["num_steps"], job["page_size"]
        R, rows, L = job["req_to_token"], d["req_pool_indices"].tolist(), d["seq_lens_cpu"].tolist()

        def slots(lengths):
            need = [int(x) for x in lengths]
            have = [R.shape[1] - n for n in L]
            if any(a > b for a, b in zip(need, have)):
                raise uc.AdapterGap(f"the release asks for {need} draft slots per request; the job's req_to_token "
                                    f"has room for {have}")
            return torch.cat([R[r, n:n + a].long() for r, n, a in zip(rows, L, need)])

        def alloc(tree_cache, num_tokens, backup_state=False):
            per = int(num_tokens) // len(rows)
            return slots([per] * len(rows)), None

        def alloc_paged(tree_cache, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                        backup_state=False):
            return slots((seq_lens_cpu - prefix_lens_cpu).tolist()), None

        # (the two buffers EAGLEWorker.__init__ makes; the P > 1 branch of the preprocess rebinds them)
        worker = uc.Given("EAGLEWorker", page_size=P, topk=k, speculative_num_steps=S, device="cpu",
                          draft_model_runner=uc.NS(token_to_kv_pool=pool),
                          token_to_kv_pool_allocator=uc.NS(restore_state=lambda s: None),
                          num_new_pages_per_topk=torch.empty((), dtype=torch.int64),
                          extend_lens=torch.empty((), dtype=torch.int64))
        B = len(rows)
        spec = uc.NS(bonus_tokens=None, positions=None)
        batch = uc.Given("ScheduleBatch", maybe_evict_swa=lambda: None, reqs=[uc.NS(decode_batch_idx=0) for _ in rows],
                         batch_size=lambda: B, spec_info=spec,
                         sampling_info=uc.NS(penalizer_orchestrator=uc.NS(is_required=False)), tree_cache=None,
                         req_to_token_pool=uc.NS(req_to_token=R.clone()), req_pool_indices=d["req_pool_indices"],
                         seq_lens=d["seq_lens"].long(), seq_lens_cpu=d["seq_lens_cpu"].long(), out_cache_loc=None,
                         seq_lens_sum=None, return_hidden_states=False)
        with lines.paused(), installed(ew, {"alloc_token_slots": alloc, "alloc_paged_token_slots_extend": alloc_paged}):
            ew.EAGLEWorker._draft_preprocess_decode(worker, batch)


def _step(d: dict, s: int | None, job: dict) -> dict:
    """Draft step ``s`` of a draft-decode batch dict (its slots and positions: request-major
    ``[B * (Sd - 1)]``, entry ``b * (Sd - 1) + s``); the batch itself for any other mode."""
    if s is None:
        return d
    B, S1 = int(d["req_pool_indices"].numel()), job["num_steps"] - 1
    return dict(d, out_cache_loc=d["out_cache_loc"].view(B, S1)[:, s].contiguous(),
                positions=d["positions"].view(B, S1)[:, s].contiguous())


def _buffer(pool) -> torch.Tensor:
    """The pool's layer-0 row buffer (``get_key_buffer(0)``: ``[slots, 1, R + Dr]``), read with line
    tracing paused: the accessor's upstream lines are no phase's metadata lines (run between two
    draft steps' marks they would stand for the second step's: :mod:`refspec.conformance.lines`)."""
    with lines.paused():
        return pool.get_key_buffer(0)


def partial_tail(job: dict) -> bool:
    """Whether a request's prefix of a top-k > 1 draft-decode job ends inside a page (``L % P != 0``,
    ``L`` its ``seq_lens``): only then is there a tail page to copy into the branches (TR-015); never
    at P = 1."""
    P = job["page_size"]
    return P > 1 and any(int(n) % P for n in job["eager"]["seq_lens_cpu"].tolist())
