"""Host <-> device copies that do not stall the stream: pinned staging, ``non_blocking``, events.

Why (CUDA semantics, PyTorch "pinned memory" notes): ``torch.as_tensor(list, device="cuda")``
copies from pageable host memory, which PyTorch does as ``cudaMemcpyAsync`` followed by a
``cudaStreamSynchronize``: the host waits until *everything queued before it* has run, so a
host that prepares round k+1 while round k runs would wait for round k at every such call.
A copy from page-locked (pinned) memory with ``non_blocking=True`` is queued on the stream and
returns at once; PyTorch's caching host allocator keeps the staging block alive until the copy
has run (it records an event on the stream), so the staging tensor may be dropped right away.

The other direction (:class:`ResultCopy`): the results of a round are copied into a pinned
host buffer with ``non_blocking=True`` and an event is recorded after the copy; the host reads
them later, after waiting on that event only, not on the whole stream.  This is SGLang's
``copy_to_cpu`` + ``copy_done`` (``python/sglang/srt/managers/utils.py``, waited on in
``process_batch_result_decode``).

On a CPU device both reduce to plain tensors (there is nothing to overlap), so the CPU suite
runs the same code path.
"""

from __future__ import annotations

import torch


def h2d(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list (or nested list, or a CPU tensor) -> a tensor on ``device`` without a stream sync.

    Shapes: that of ``values``.  On CUDA: staged in pinned memory, copied ``non_blocking``.
    Raises: whatever ``torch.tensor`` raises for ragged or non-numeric input.
    """
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        t = values.to(dtype)
        return t if device.type != "cuda" else t.pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def h2d_many(lists, device: torch.device, dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
    """Several flat host lists -> device tensors in ONE copy (concatenated, then split views)."""
    sizes = [len(x) for x in lists]
    flat = h2d([v for x in lists for v in x], device, dtype)
    return list(torch.split(flat, sizes)) if sizes else []


class ResultCopy:
    """A device -> host copy started now and read later (one round late in the overlap loop).

    ``ResultCopy(t)`` queues ``t``'s copy into a pinned host buffer (CUDA: ``non_blocking`` on
    the current stream, then an event); :meth:`wait` blocks on that event only and returns the
    values as nested Python lists.  Shapes: any; dtype kept.
    """

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = t.detach().clone(), None

    def ready(self) -> bool:
        """Whether the copy has landed (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> list:
        """Block until the copy has landed (CUDA: ``event.synchronize()``); the values as lists."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
