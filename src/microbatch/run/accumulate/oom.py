"""Out of memory inside a training step: recognising it, freeing what it left, and giving up at one row.

**Recognising it.** On CUDA the allocator raises ``torch.OutOfMemoryError`` (also
``torch.cuda.OutOfMemoryError``), caught by type (:func:`microbatch.measure.device.oom_types`,
which adds Python's ``MemoryError``). On the CPU torch raises a plain ``RuntimeError``; torch 2.13
words it (provoked under ``RLIMIT_AS``, in the forward and in the backward alike)::

    [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory:
    you tried to allocate 800000000 bytes. Error code 12 (Cannot allocate memory)

There is no narrower type, so a CPU ``RuntimeError`` counts as out of memory only when its
message holds :data:`CPU_ALLOC_FAILURE`, the allocator's own words; any other ``RuntimeError``
is a bug and propagates. An over-committed host may kill the process instead of raising (the
kernel's OOM killer): nothing in the process can recover from that; run under a hard limit
(``RLIMIT_AS``, a cgroup) to get the exception.

**Freeing.** After the exception has been dropped (its frames hold the failed step's tensors,
which reference counting then frees), :func:`free_memory` collects reference cycles and gives the
allocator's cache back. On CUDA: a full ``gc.collect()``, then ``torch.cuda.empty_cache``. On the
CPU: ``gc.collect(1)``, the two young generations, where the failed step's objects are, then
glibc's ``malloc_trim``. A full collection costs 0.15 s in a process that has imported torch's
optimizers (which import ``torch._dynamo``) against 1.3 ms for the young generations (measured
here, torch 2.13, Python 3.11): on the CPU, where a training step is short, that difference is the
cost of a split; on a GPU it is small against a step and the memory back matters more.
"""

from __future__ import annotations

import gc
from typing import Any

from microbatch.errors import OutOfMemoryError
from microbatch.measure.device import CPU_ALLOC_FAILURE, is_out_of_memory, short_error
from microbatch.measure.hostmem import malloc_trim

__all__ = [
    "CPU_ALLOC_FAILURE",
    "is_out_of_memory",
    "free_memory",
    "one_row_error",
    "set_aside",
    "set_aside_error",
    "short_error",
]


def free_memory(device: Any) -> None:
    """Cycles collected and the allocator's cache back: CUDA's ``empty_cache`` on ``device``, or glibc's heap."""
    if getattr(device, "type", None) == "cuda":
        import torch

        gc.collect()
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    else:
        gc.collect(1)
        malloc_trim()


def one_row_error(where: str, reason: str) -> OutOfMemoryError:
    """The error when a micro-batch of one row is out of memory: there is nothing left to split.

    ``where``: ``"step N"``, or ``"this call"`` when no controller counts the steps
    (:meth:`~microbatch.run.accumulate.controller.MicroBatchController.where`). The type is
    :class:`microbatch.errors.OutOfMemoryError` (a :class:`~microbatch.errors.MeasurementError`), not
    ``torch.OutOfMemoryError``: catch it by the former.
    """
    return OutOfMemoryError(
        f"{where}: a micro-batch of 1 row is out of memory ({reason}); splitting cannot go lower and the "
        "gradients are as they were before the step; free memory (activation checkpointing, a shorter sequence, "
        "a smaller model or optimizer state) or use a device with more"
    )


def set_aside_error(reason: str, *, ranks: tuple[int, int] | None = None) -> OutOfMemoryError:
    """The error when copying the gradients present before a step runs out of memory (before any forward).

    Not the micro-batch's fault, so not split: the copy is the size of the gradients whatever the
    micro-batch. ``ranks``: (ranks whose copy failed, world size) under DDP, where every rank raises it.
    """
    where = "" if ranks is None else f" on {ranks[0]} of {ranks[1]} ranks"
    return OutOfMemoryError(
        f"out of memory setting aside the gradients present before the step{where} ({reason}); this is not the "
        "micro-batch's size, so the step is not split: nothing ran and the gradients are as they were; free "
        "memory (call optimizer.zero_grad(set_to_none=True) before accumulating, or keep fewer tensors alive)"
    )


def set_aside(device: Any, params: list[Any], manual: bool) -> tuple[list[Any], str | None]:
    """Set the old gradients aside: keep a copy, zero in place; ``(copies, None)``, or ``([], reason)``
    when the copy ran out of memory (on ``device``) under ``manual`` agreement (raised otherwise).

    Zeroing in place keeps the tensors' identity, which DDP's gradient-as-bucket-view relies on; the
    call then accumulates only its own gradient. The copy is the step's first allocation: out of
    memory here is not the micro-batch's fault (no split), and with agreement this rank still joins
    the all_reduce, so no other rank waits for it.
    """
    copy_failed: str | None = None
    saved: list[Any] = []
    try:
        saved = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    except Exception as e:  # noqa: BLE001 - only out-of-memory is kept; anything else propagates
        if not is_out_of_memory(e):
            raise
        copy_failed = short_error(e)  # the text only; nothing was changed yet
    if copy_failed is not None:
        free_memory(device)
        if not manual:
            raise set_aside_error(copy_failed)
    else:
        for p, s in zip(params, saved, strict=True):
            if s is not None:
                p.grad.zero_()
    return saved, copy_failed
