"""Training an EAGLE head for SmolLM2-135M (``python -m refspec train-draft``).

What is trained is the draft exactly as the speculative loops run it, of one of two kinds
(``Recipe.kind``):

* ``"eagle"`` (the committed head): :class:`refspec.model.drafts.EagleDraft`, ``fc`` over
  ``[embed(t_(j+1)); h_j]``, one Llama decoder layer, RMSNorm, the target's tied LM head
  (frozen, shared);
* ``"eagle3"``: :class:`refspec.model.drafts.Eagle3Draft`, EAGLE-3's recipe adapted to
  SmolLM2-135M: the target's hidden states at ``aux_layers`` (low / middle / high, default
  (2, 15, 27)) concatenated and projected by ``fc``, attention over ``[embed; hidden]``, the
  same tied head; trained with EAGLE-3's training-time test (item 2, step weights ``0.8^s``) and
  no feature regression (its hidden is no longer a target feature).

Data: ChatML token rows (:mod:`refspec.real.draft_data`), optionally the target's own greedy
answers (:func:`self_distilled_rows`).

1. **Features** (:func:`extract_features`, :class:`Features`): one target forward per batch of
   rows (bf16 on the GPU, dense causal attention, :class:`RowsBackend`); per position j the
   pre-norm last hidden ``h_j`` (``"eagle3"``: the concatenated aux hidden states) and the
   target's greedy token ``y_j = argmax logits(h_j)`` (the token the target would emit after
   ``t_0..t_j``: the label, never the text's own next token).  ``"eagle"`` extracts them for
   every row once; ``"eagle3"`` runs the target inside each training step (online, as
   SpecForge's online mode), because three states per token do not fit on one GPU for the
   whole set (62,816 rows x 512 x 3 x 576 x 2 bytes = 111 GB in bf16).
2. **Training with the draft's own hidden** (:func:`draft_losses`, "training-time test"):
   step 0 at draft KV index j reads ``(t_(j+1), h_j)`` as draft extend does and is scored on
   ``y_(j+1)``.  Step s >= 1 at index j reads ``(t_(j+1), g^(s-1)_(j-1))``, the draft's own
   hidden of the previous step, as draft decode does, and attends to what that decode step
   would see (:class:`UnrollBackend`): keys ``i <= j - s`` from step 0 (draft extend) and keys
   ``j - r`` (r < s) from step ``s - r``.  Loss: sum over steps of ``w_s`` x cross-entropy on
   ``y_(j+1)``, plus ``hidden_weight`` x smooth-L1 between RMS-normalised ``g^0_j`` and
   ``h_(j+1)`` (SmolLM2's residual stream has outlier dimensions that an unnormalised
   regression lets dominate the loss).  This is EAGLE-3's training-time test (the draft fed
   its own outputs for several steps, ``Model.forward`` in
   `eagle/traineagle3/cnets.py <https://github.com/SafeAILab/EAGLE/blob/9666a8182d9bed8b5b637fd4a126c90d9b9c3db2/eagle/traineagle3/cnets.py>`_,
   step weights ``0.8^s`` in its ``main.py``), with each step's keys exactly those of the decode
   step it stands for (EAGLE-3 keeps every step of a chain in one column, at one position).
3. **Evaluation** (:func:`evaluate`): teacher-forced top-1 agreement per step on held-out rows.
4. **Output** (:func:`save_head`): the head's parameters as bf16 safetensors, its SHA-256, and a
   JSON card (data, recipe, steps, seed, metrics, commit, time); the file's metadata names the
   kind and the aux layers (:func:`refspec.real.eagle_head.load_head` reads them).  Checkpoints
   (:func:`save_checkpoint`) let a run stop at a time bound and resume to the same result as
   an uninterrupted run (bitwise on the CPU).

How the recipe was chosen (measured, with numbers): ``docs/eagle-head.md``.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from refspec.core.args import count, is_int
from refspec.core.mla import finite_number
from refspec.model.drafts import Eagle3Draft, EagleDraft, default_aux_layers
from refspec.model.llama import LlamaModel, check_aux

KINDS = ("eagle", "eagle3")  #: what :class:`Recipe` ``kind`` may be


@dataclass
class Recipe:
    """Training settings (units: rows of ``row_len`` tokens, optimizer steps, seconds).

    ``kind`` (module doc) sets the defaults of ``step_weights`` (``"eagle"``: 1, 0.8, 0.6;
    ``"eagle3"``: ``0.8^s``, EAGLE-3's) and ``hidden_weight`` (0.1; ``"eagle3"``: 0, and nothing
    else is accepted).  ``aux_layers`` (``"eagle3"`` only): the target's hidden-state indices,
    default :func:`~refspec.model.drafts.default_aux_layers` of the target (filled in by
    :func:`train`; an explicit one must hold at least two strictly increasing indices >= 0).
    Raises ValueError naming the setting (counts that are not ints >= 1, ``lr`` / ``clip`` not
    finite and > 0, ``final_lr`` outside [0, 1], ``unroll`` longer than the step weights).
    """

    steps: int = 3000  #: optimizer steps (the LR schedule's length)
    batch_rows: int = 48  #: rows per step
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: int = 100  #: linear warm-up steps, then linear decay to ``final_lr`` x lr
    final_lr: float = 0.1
    clip: float = 1.0
    unroll: int = 3  #: draft steps trained (step 0 = draft extend, then unroll - 1 decode steps)
    step_weights: tuple[float, ...] | None = None
    hidden_weight: float | None = None
    heldout_rows: int = 256  #: rows kept out of training for :func:`evaluate`
    seed: int = 0
    kind: str = "eagle"
    aux_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("steps", "batch_rows", "unroll", "heldout_rows"):
            count(name, getattr(self, name), 1)
        count("warmup", self.warmup)
        count("seed", self.seed)
        for name in ("lr", "clip"):
            if finite_number(name, getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= finite_number("final_lr", self.final_lr) <= 1:
            raise ValueError(f"final_lr (a fraction of lr) must lie in [0, 1], got {self.final_lr!r}")
        eagle3 = self.kind == "eagle3"
        if self.step_weights is not None and len(self.step_weights) < self.unroll:
            raise ValueError(f"unroll={self.unroll} needs that many step_weights, got {self.step_weights}")
        if self.step_weights is None and not eagle3 and self.unroll > 3:
            raise ValueError(f"unroll={self.unroll}: kind 'eagle' has step_weights (1.0, 0.8, 0.6) for at most 3 "
                             "steps; pass Recipe(step_weights=...) of that length, or train kind 'eagle3' "
                             "(--kind eagle3: 0.8^s for any unroll)")
        if self.step_weights is None:
            self.step_weights = tuple(0.8 ** s for s in range(self.unroll)) if eagle3 else (1.0, 0.8, 0.6)
        self.step_weights = tuple(float(w) for w in self.step_weights)
        if self.hidden_weight is None:
            self.hidden_weight = 0.0 if eagle3 else 0.1
        if eagle3 and self.hidden_weight:
            raise ValueError(f"hidden_weight must be 0 for kind eagle3 (EAGLE-3 regresses no feature), "
                             f"got {self.hidden_weight}")
        if self.aux_layers is not None:
            if not eagle3:
                raise ValueError(f"aux_layers is for kind eagle3, got kind {self.kind!r}")
            aux = tuple(self.aux_layers) if isinstance(self.aux_layers, (list, tuple)) else None
            # what needs no target (train() checks the top index against the target's layers)
            if aux is None or len(aux) < 2 or not all(is_int(i) for i in aux) or aux[0] < 0 \
                    or any(b <= a for a, b in zip(aux, aux[1:])):
                raise ValueError(f"aux_layers {self.aux_layers!r}: EAGLE-3 reads at least two target hidden states, "
                                 "strictly increasing indices >= 0 (i = the input of layer i), e.g. (2, 15, 27)")
            self.aux_layers = tuple(int(i) for i in aux)


# ------------------------------------------------------------------ attention over whole rows
@dataclass
class RowsBatch:
    """R rows of T tokens, flattened row-major: ``positions [R*T]`` = 0..T-1 per row (KV indices)."""

    rows: int
    length: int
    positions: torch.Tensor = field(init=False)
    device: str | torch.device = "cpu"

    def __post_init__(self):
        self.positions = torch.arange(self.length, device=self.device).repeat(self.rows)


def _heads(x: torch.Tensor, fb: RowsBatch) -> torch.Tensor:
    return x.view(fb.rows, fb.length, x.shape[1], x.shape[2]).transpose(1, 2)  # [R, heads, T, D]


class RowsBackend:
    """Causal attention within each row (no cache): ``forward(q, k, v, layer, fb)`` as the paged
    backends, for :class:`RowsBatch` inputs.  Shapes: ``q [R*T, H, D]``, ``k, v [R*T, Hkv, D]``."""

    def forward(self, q, k, v, layer, fb: RowsBatch):
        o = F.scaled_dot_product_attention(_heads(q, fb), _heads(k, fb), _heads(v, fb), is_causal=True,
                                           scale=layer.softmax_scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(q.shape)


class UnrollBackend:
    """Attention of draft step s over what that decode step sees (module doc, item 2).

    Call it once per step, s = 0, 1, ...: it keeps every step's k / v.  Step 0 is causal within
    the row; step s's query at index j reads step-0 keys ``i <= j - s`` and, for r < s, the key
    of step ``s - r`` at index ``j - r``.  Shapes as :class:`RowsBackend`.
    """

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def forward(self, q, k, v, layer, fb: RowsBatch):
        s = len(self.k)
        self.k.append(_heads(k, fb))
        self.v.append(_heads(v, fb))
        if s == 0:
            return RowsBackend().forward(q, k, v, layer, fb)
        g = layer.num_heads // layer.num_kv_heads
        Q = _heads(q, fb).float() * layer.softmax_scale  # [R, H, T, D]
        K0 = self.k[0].float().repeat_interleave(g, dim=1)
        V0 = self.v[0].float().repeat_interleave(g, dim=1)
        T = fb.length
        j = torch.arange(T, device=q.device)
        scores = [(Q @ K0.transpose(-1, -2)).masked_fill(j[None, :] > j[:, None] - s, float("-inf"))]
        vals = []
        for r in range(s):  # key j - r of step s - r
            Kr = torch.roll(self.k[s - r].float(), r, dims=2).repeat_interleave(g, dim=1)
            Vr = torch.roll(self.v[s - r].float(), r, dims=2).repeat_interleave(g, dim=1)
            sc = (Q * Kr).sum(-1, keepdim=True)
            scores.append(sc.masked_fill((j < r)[:, None], float("-inf")))
            vals.append(Vr)
        w = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = w[..., :T] @ V0
        for r, Vr in enumerate(vals):
            out = out + w[..., T + r:T + r + 1] * Vr
        return out.to(q.dtype).transpose(1, 2).reshape(q.shape)


# ------------------------------------------------------------------ features
@torch.no_grad()
def extract_features(target: LlamaModel, rows: torch.Tensor, batch: int = 64,
                     aux: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's pre-norm last hidden (or its ``aux`` hidden states) and greedy token at every
    position of every row.

    Shapes: ``rows [R, T]`` int (token ids, on the target's device) -> ``hidden [R, T, W]`` in
    the target's dtype (W = E, or ``len(aux) * E``: the states ``aux`` concatenated, as the
    loops hand them to an EAGLE-3 draft, :func:`~refspec.model.llama.capture_states`),
    ``greedy [R, T]`` int32 (``greedy[r, j]`` = argmax of the logits after ``rows[r, :j+1]``).
    Padded positions get values too; the training masks them.
    """
    R, T = rows.shape
    W = target.config.hidden_size * (1 if aux is None else len(aux))
    dt = next(target.parameters()).dtype
    hidden = torch.empty(R, T, W, dtype=dt, device=rows.device)
    greedy = torch.empty(R, T, dtype=torch.int32, device=rows.device)
    for a in range(0, R, batch):
        ids = rows[a:a + batch].long()
        fb = RowsBatch(ids.shape[0], T, device=rows.device)
        logits, h = target(ids.reshape(-1), fb, RowsBackend(), aux=aux)
        hidden[a:a + batch] = h.view(ids.shape[0], T, W)
        greedy[a:a + batch] = logits.argmax(-1).view(ids.shape[0], T).to(torch.int32)
    return hidden, greedy


class Features:
    """The target's features of the rows ``ids [R, T]`` (module doc, item 1): ``features(idx)``
    -> ``(hidden [B, T, W], greedy [B, T])`` of rows ``idx [B]`` (int64, the rows' device).

    ``online`` False: :func:`extract_features` over every row at construction, then indexed;
    True: the target runs over the B rows at each call (no state kept, so a resumed run sees
    the same features as an uninterrupted one).  ``aux``: the hidden states returned (None =
    the last).
    """

    def __init__(self, target: LlamaModel, ids: torch.Tensor, *, aux=None, online: bool = False, batch: int = 64):
        self.target, self.ids, self.aux, self.online, self.batch = target, ids, aux, online, batch
        self.hidden = self.greedy = None
        if not online:
            self.hidden, self.greedy = extract_features(target, ids, batch=batch, aux=aux)

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.online:
            return extract_features(self.target, self.ids[idx], batch=idx.numel(), aux=self.aux)
        return self.hidden[idx], self.greedy[idx]


# ------------------------------------------------------------------ the losses
def draft_losses(head: EagleDraft, ids: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor,
                 greedy: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, dict]:
    """Loss of one batch and per-step teacher-forced top-1 agreement (module doc, item 2).

    Shapes: ``ids [R, T]`` int64, ``lengths [R]`` (valid tokens), ``hidden [R, T, E]``,
    ``greedy [R, T]``.  Rows are read at draft KV indices j = 0..T-2 (index j consumes
    ``ids[:, j+1]``).  Returns ``(loss, stats)``: ``stats`` holds detached 0-d tensors
    (``{"ce": [...], "top1": [...], "hidden": x}``, one per unrolled step), so a training step
    reads nothing back from the device; :func:`host_stats` makes them floats when they are logged.
    """
    R, T = ids.shape
    n = T - 1
    x = ids[:, 1:]  # t_(j+1)
    y = greedy[:, 1:].long()  # y_(j+1): what the draft at index j must predict
    j = torch.arange(n, device=ids.device)
    valid = j[None, :] < (lengths[:, None] - 1)
    fb = RowsBatch(R, n, device=ids.device)
    be = UnrollBackend()
    total, ce_s, top1_s = 0.0, [], []
    prev = None
    for s in range(recipe.unroll):
        if s == 0:
            h_in = hidden[:, :n]
        else:  # g^(s-1)_(j-1): the previous step's own hidden, one index back
            h_in = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        logits, g = head.forward(x.reshape(-1), h_in.reshape(R * n, -1), fb, be)
        g = g.view(R, n, -1)
        m = valid & (j[None, :] >= s)
        lg = logits.view(R, n, -1)[m].float()
        ce = F.cross_entropy(lg, y[m])
        total = total + recipe.step_weights[s] * ce
        ce_s.append(ce.detach())
        top1_s.append((lg.argmax(-1) == y[m]).float().mean().detach())
        if s == 0 and recipe.hidden_weight:
            def rms(t):
                t = t.float()
                return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
            hl = F.smooth_l1_loss(rms(g[:, :n - 1][valid[:, 1:]]), rms(hidden[:, 1:n][valid[:, 1:]]))
            total = total + recipe.hidden_weight * hl
            hidden_loss = hl.detach()
        prev = g
    return total, {"ce": ce_s, "top1": top1_s, "hidden": hidden_loss if recipe.hidden_weight else 0.0}


def host_stats(stats: dict) -> dict:
    """:func:`draft_losses`' stats as floats (one device -> host read for all of them)."""
    flat = [*stats["ce"], *stats["top1"], stats["hidden"]]
    vals = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=stats["ce"][0].device).reshape(())
                        for v in flat]).tolist()
    n = len(stats["ce"])
    return {"ce": vals[:n], "top1": vals[n:2 * n], "hidden": vals[-1]}


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def lr_at(step: int, recipe: Recipe) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warm-up, then linear decay."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (1.0 - (1.0 - recipe.final_lr) * min(1.0, frac))


def new_head(target: LlamaModel, seed: int, recipe: Recipe | None = None) -> EagleDraft | Eagle3Draft:
    """The head of ``recipe.kind`` (default ``"eagle"``: an :class:`EagleDraft`; ``"eagle3"``: an
    :class:`Eagle3Draft` over ``recipe.aux_layers``) on the target's device with fp32 master weights."""
    if recipe is not None and recipe.kind == "eagle3":
        head = Eagle3Draft(target, aux_layers=recipe.aux_layers, seed=seed + 1)
    else:
        head = EagleDraft(target, seed=seed + 1)
    init = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF-style small init (init_random_'s gain-2 init is for stable random tokens)
        for _, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=init) * 0.02)
            else:
                p.fill_(1.0)
    return head.float().requires_grad_(True)


@torch.no_grad()
def evaluate(head, ids, lengths, features: Features, rows: torch.Tensor, recipe: Recipe, batch: int = 32) -> dict:
    """Held-out teacher-forced top-1 agreement per draft step (token-weighted) over ``rows``
    (indices into ``ids`` / ``lengths``): ``{"top1": [...], "ce": [...]}``."""
    was = head.training
    head.eval()
    sums = np.zeros((2, recipe.unroll))
    count = 0
    dev = ids.device
    for a in range(0, rows.numel(), batch):
        sl = rows[a:a + batch]
        hidden, greedy = features(sl)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            _, st = draft_losses(head, ids[sl], lengths[sl], hidden, greedy, recipe)
        st = host_stats(st)
        w = int((lengths[sl] - 1).clamp(min=0).sum())
        sums += np.array([st["top1"], st["ce"]]) * w
        count += w
    head.train(was)
    return {"top1": [round(float(v), 4) for v in sums[0] / count], "ce": [round(float(v), 4) for v in sums[1] / count]}


# ------------------------------------------------------------------ files
def head_state(head: EagleDraft | Eagle3Draft, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The head's own parameters (not the shared embedding / LM head) as contiguous CPU tensors."""
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def head_metadata(head: EagleDraft | Eagle3Draft) -> dict[str, str]:
    """The safetensors metadata that says which draft a head file holds: ``structure``
    (``refspec EagleDraft`` / ``refspec Eagle3Draft``) and, for EAGLE-3, ``aux_layers`` ("2,15,27")."""
    if isinstance(head, Eagle3Draft):
        return {"format": "pt", "structure": "refspec Eagle3Draft", "aux_layers": ",".join(map(str, head.aux_layers))}
    return {"format": "pt", "structure": "refspec EagleDraft"}


def save_head(head: EagleDraft | Eagle3Draft, path: str | Path, card: dict) -> dict:
    """Write the head as bf16 safetensors at ``path`` (metadata: :func:`head_metadata`) and its
    card (``card`` + sha256, bytes) as ``path`` with suffix ``.json``; returns the card written."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(head_state(head), str(path), metadata=head_metadata(head))
    card = dict(card, file=path.name, sha256=sha256_file(path), bytes=path.stat().st_size)
    path.with_suffix(".json").write_text(json.dumps(card, indent=2) + "\n")
    return card


def save_checkpoint(path: str | Path, head, opt, step: int, order: np.ndarray, recipe: Recipe, log: list) -> None:
    """Everything a resumed run needs: fp32 head, optimizer state, next step, the row order, log."""
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "order": order,
                "recipe": dataclasses.asdict(recipe), "log": log}, path)


# ------------------------------------------------------------------ self-distilled data
@torch.no_grad()
def self_distilled_rows(target: LlamaModel, prompts: list[list[int]], *, max_new_tokens: int, eos: int | None,
                        batch: int = 256, page_size: int = 16, row_len: int = 512, min_len: int = 64,
                        progress=None) -> tuple[np.ndarray, np.ndarray]:
    """The target's own greedy answers to ``prompts`` as training rows (module doc: self-distilled data).

    Each prompt is answered by :func:`~refspec.speculative.greedy.production_greedy` (paged KV,
    the FA3 wing: the real kernel on Hopper, the emulator elsewhere; eager, ``batch`` prompts at a
    time) for at most ``max_new_tokens`` tokens, stopping after ``eos``; prompt + answer is one
    conversation for :func:`~refspec.real.draft_data.token_rows`.  On such a row the text *is*
    the target's greedy continuation, so every unrolled step's input token is the one the
    draft would see when all its earlier drafts were accepted.
    Shapes: ``prompts`` lists of token ids -> ``rows uint16 [R, row_len]``, ``lengths [R]``.
    ``progress(done)`` is called after each batch.  Raises ValueError for an empty prompt list.
    """
    from refspec.real.draft_data import token_rows
    from refspec.speculative.greedy import production_greedy

    if not prompts:
        raise ValueError("self_distilled_rows needs at least one prompt")
    convs = []
    for a in range(0, len(prompts), batch):
        chunk = prompts[a:a + batch]
        run = production_greedy(target, chunk, [max_new_tokens] * len(chunk), page_size=page_size, eos=eos,
                                graphs=False, validate=False)
        convs += [list(p) + list(t) for p, t in zip(chunk, run.tokens)]
        if progress is not None:
            progress(len(convs))
    return token_rows(convs, row_len=row_len, min_len=min_len)


# ------------------------------------------------------------------ the run
CALIBRATION_STEPS = 30  #: warm-up steps timed by ``train_seconds`` (the warm-up LR does not depend on ``steps``)


def train(target: LlamaModel, rows: np.ndarray, lengths: np.ndarray, recipe: Recipe, *,
          checkpoint: str | Path | None = None, resume: bool = False, max_seconds: float | None = None,
          train_seconds: float | None = None, progress=None, feature_batch: int = 64,
          stop_at: int | None = None) -> dict:
    """Extract features, train (or resume), evaluate.

    Args: ``target`` on its device (bf16 on CUDA); ``rows uint16 [R, T]`` / ``lengths [R]``
    (:mod:`refspec.real.draft_data`); ``checkpoint`` path written at the end and when the run
    stops early: at the time bound ``max_seconds`` or at optimizer step ``stop_at`` (then
    ``finished`` is False and a rerun with ``resume`` continues; the resumed run ends with the
    same head, bitwise on the CPU, as one that never stopped); ``progress(step, stats)`` is called
    every 10 steps.  ``train_seconds``: the step count is fixed after :data:`CALIBRATION_STEPS`
    steps (still in the warm-up, whose learning rate does not depend on it) from their speed, so
    that training takes about that long; the result's ``recipe`` has it (``steps``), the
    checkpoint keeps it for a resume, and a rerun with that ``steps`` repeats the run.
    A ``"eagle3"`` recipe without ``aux_layers`` gets :func:`~refspec.model.drafts.default_aux_layers`.
    Returns ``{"head", "finished", "step", "metrics", "log", "recipe", "seconds": {...}, "tokens": n}``.
    Raises ``ValueError`` if there are fewer rows than ``heldout_rows + batch_rows``, for bad
    ``aux_layers``, or when resuming a checkpoint written by a different recipe.
    """
    t0 = time.perf_counter()
    dev = next(target.parameters()).device
    R = rows.shape[0]
    if R < recipe.heldout_rows + recipe.batch_rows:
        raise ValueError(f"{R} rows: need at least heldout_rows + batch_rows = "
                         f"{recipe.heldout_rows + recipe.batch_rows}")
    if recipe.kind == "eagle3":
        L = target.config.num_hidden_layers
        recipe = dataclasses.replace(recipe, aux_layers=check_aux(recipe.aux_layers or default_aux_layers(L), L))
    perm = np.random.default_rng(recipe.seed).permutation(R)
    held, train_idx = perm[:recipe.heldout_rows], perm[recipe.heldout_rows:]
    ids = torch.from_numpy(rows.astype(np.int64)).to(dev)
    lens = torch.from_numpy(lengths.astype(np.int64)).to(dev)
    features = Features(target, ids, aux=recipe.aux_layers, online=recipe.kind == "eagle3", batch=feature_batch)
    _sync(dev)
    t_feat = time.perf_counter() - t0

    torch.manual_seed(recipe.seed)
    head = new_head(target, recipe.seed, recipe)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=recipe.lr, betas=recipe.betas,
                            weight_decay=0.0)
    step, log = 0, []
    rng = np.random.default_rng(recipe.seed + 1)
    planned = recipe.steps if train_seconds is None else max(recipe.steps, 100_000)
    order = np.concatenate([rng.permutation(train_idx) for _ in range(
        math.ceil(planned * recipe.batch_rows / len(train_idx)) + 1)])
    calibrate = train_seconds is not None
    if calibrate:
        if recipe.warmup < CALIBRATION_STEPS:
            raise ValueError(f"train_seconds needs warmup >= {CALIBRATION_STEPS} steps, got {recipe.warmup}")
        recipe = dataclasses.replace(recipe, steps=max(recipe.steps, CALIBRATION_STEPS + 1))
        t_cal = None
    if resume and checkpoint and Path(checkpoint).exists():
        ck = load_checkpoint(checkpoint, dev)
        if calibrate:  # the step count fixed by the run that wrote the checkpoint
            recipe = dataclasses.replace(recipe, steps=ck["recipe"]["steps"])
            calibrate = False
        _same_recipe(ck["recipe"], recipe, checkpoint)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        step, order, log = ck["step"], ck["order"], ck["log"]
    order_dev = torch.from_numpy(order).to(dev)  # once: a per-step pageable copy would wait for the GPU
    t1 = time.perf_counter()
    finished = True
    head.train()
    while step < recipe.steps:
        if (max_seconds is not None and time.perf_counter() - t0 > max_seconds) or (stop_at is not None
                                                                                    and step >= stop_at):
            finished = False
            break
        b = order_dev[step * recipe.batch_rows:(step + 1) * recipe.batch_rows]
        for gparam in opt.param_groups:
            gparam["lr"] = lr_at(step, recipe)
        hidden, greedy = features(b)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss, st = draft_losses(head, ids[b], lens[b], hidden, greedy, recipe)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), recipe.clip)
        opt.step()
        step += 1
        if calibrate:
            if step == 10:
                _sync(dev)
                t_cal = time.perf_counter()
            elif step == CALIBRATION_STEPS:
                _sync(dev)
                rate = (CALIBRATION_STEPS - 10) / (time.perf_counter() - t_cal)
                recipe = dataclasses.replace(recipe, steps=max(step + 1, int(rate * (train_seconds - (
                    time.perf_counter() - t1)))))
        if step % 10 == 0 or step == recipe.steps:
            st = dict(host_stats(st), step=step, steps=recipe.steps, loss=round(float(loss.detach()), 4),
                      lr=lr_at(step - 1, recipe))
            log.append(st)
            if progress is not None:
                progress(step, st)
    t_train = time.perf_counter() - t1
    if checkpoint:
        save_checkpoint(checkpoint, head, opt, step, order, recipe, log)
    held_dev = torch.from_numpy(held).to(dev)
    metrics = evaluate(head, ids, lens, features, held_dev, recipe) if finished else {}
    return {"head": head, "finished": finished, "step": step, "metrics": metrics, "log": log, "recipe": recipe,
            "tokens": int(lengths[train_idx].sum()), "heldout_tokens": int(lengths[held].sum()),
            "seconds": {"features": round(t_feat, 1), "train": round(t_train, 1),
                        "total": round(time.perf_counter() - t0, 1)}}


CHECKPOINT_KEYS = ("head", "opt", "step", "order", "recipe", "log")  #: what :func:`save_checkpoint` writes


def load_checkpoint(path: str | Path, device) -> dict:
    """A checkpoint :func:`save_checkpoint` wrote, onto ``device``.  Raises ValueError naming the
    file when it is no such checkpoint (truncated, another format, a head file given by mistake)."""
    try:
        ck = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # noqa: BLE001 - pickle, zip and torch raise a zoo of types on a bad file
        raise ValueError(f"{path}: not a train-draft checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ck, dict) or k not in ck]
    if missing:
        raise ValueError(f"{path}: not a train-draft checkpoint (no {', '.join(missing)})")
    return ck


def _same_recipe(saved: dict, recipe: Recipe, checkpoint) -> None:
    """ValueError naming the settings where a checkpoint's recipe differs from the run resuming it
    (a setting the checkpoint predates is not compared)."""
    now = dataclasses.asdict(recipe)
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - torch.save keeps tuples, JSON not
    diff = sorted(k for k in now if k in saved and norm(saved[k]) != norm(now[k]))
    if diff:
        what = ", ".join(f"{k}: {saved.get(k)!r} there, {now[k]!r} here" for k in diff)
        raise ValueError(f"{checkpoint}: written by a different recipe ({what}); resume with the same settings "
                         f"or start afresh")
