"""Instrumentation of a pipeline stage: busy intervals, in-flight counts, saved-activation bytes.

:func:`instrument_stage` wraps a ``torch.distributed.pipelining`` stage's
``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` (instance
attributes, so the schedule's calls go through them) and records into a :class:`StageRecorder`:

- every compute interval ``(kind, stage, microbatch, start, end)``: ``time.perf_counter`` on the
  CPU, CUDA events on a GPU (resolved after the step's synchronisation);
- the in-flight count: +1 when a forward ends, −1 when the micro-batch's backward ends (the W
  part for a split backward), summed over the rank's virtual stages; its maximum;
- the bytes autograd saves during each forward (``saved_tensors_hooks``; parameters excluded,
  storages counted once), per micro-batch, and the peak resident sum over the micro-batches in
  flight.

:func:`make_loss_fn` builds the loss (Σ token cross-entropy / tokens in the global batch) and,
given the recorder, adds the loss's time and saved bytes to the forward that produced the logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StageRecorder", "instrument_stage", "make_loss_fn"]


@dataclass
class StageRecorder:
    """What one rank did in one step: compute intervals, in-flight counts, saved bytes."""

    rank: int
    cuda: bool = False
    intervals: list[tuple[str, int, int, Any, Any]] = field(default_factory=list)
    """(kind, stage, microbatch, start, end): start/end are perf_counter seconds or CUDA events."""
    in_flight: int = 0
    peak_in_flight: int = 0
    saved_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    """Saved-activation bytes per (stage, micro-batch) still resident."""
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    per_microbatch_bytes: list[int] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    """Compute actions as run, e.g. ``"0F1"``."""
    pending_forward: int | None = None
    """Index into ``intervals`` of the last forward (the loss extends it)."""
    loss_hooks: Any = None
    """(parameter storages, stage, micro-batch) of the last stage's latest forward, for the loss."""

    def reset(self) -> None:
        self.intervals.clear()
        self.order.clear()
        self.saved_bytes.clear()
        self.per_microbatch_bytes.clear()
        self.in_flight = self.peak_in_flight = 0
        self.resident_bytes = self.peak_resident_bytes = 0
        self.pending_forward = None

    def now(self) -> Any:
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch's stub lacks types
            ev.record()
            return ev
        return time.perf_counter()

    def forward_done(self, stage: int, mb: int, nbytes: int) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.saved_bytes[(stage, mb)] = nbytes
        self.per_microbatch_bytes.append(nbytes)
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def backward_done(self, stage: int, mb: int) -> None:
        self.in_flight -= 1
        self.resident_bytes -= self.saved_bytes.pop((stage, mb), 0)


def _saved_bytes_hooks(param_ptrs: set[int], seen: dict[int, int]) -> Any:
    """``saved_tensors_hooks`` adding each new non-parameter storage's bytes to ``seen``."""
    import torch

    def pack(t: Any) -> Any:
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in param_ptrs and ptr not in seen:
                seen[ptr] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
            seen[id(t)] = t.numel() * t.element_size()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def instrument_stage(stage: Any, rec: StageRecorder) -> None:
    """Wrap ``stage``'s forward/backward calls so that ``rec`` records them (instance attributes)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in stage.submod.parameters()}
    idx = stage.stage_index
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
    bwd_w = getattr(stage, "backward_weight_one_chunk", None)

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        seen: dict[int, int] = {}
        t0 = rec.now()
        with _saved_bytes_hooks(param_ptrs, seen):
            out = fwd(fwd_chunk_id, *args, **kwargs)
        t1 = rec.now()
        rec.intervals.append(("F", idx, fwd_chunk_id, t0, t1))
        rec.order.append(f"{idx}F{fwd_chunk_id}")
        rec.forward_done(idx, fwd_chunk_id, sum(seen.values()))
        rec.pending_forward = len(rec.intervals) - 1 if stage.is_last else None
        rec.loss_hooks = (param_ptrs, idx, fwd_chunk_id)
        return out

    def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", True)
        t0 = rec.now()
        out = bwd(bwd_chunk_id, *args, **kwargs)
        t1 = rec.now()
        kind = "B" if full else "I"
        rec.intervals.append((kind, idx, bwd_chunk_id, t0, t1))
        rec.order.append(f"{idx}{kind}{bwd_chunk_id}")
        if full:
            rec.backward_done(idx, bwd_chunk_id)
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    if bwd_w is not None:

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            t0 = rec.now()
            out = bwd_w(bwd_chunk_id, *args, **kwargs)
            t1 = rec.now()
            rec.intervals.append(("W", idx, bwd_chunk_id, t0, t1))
            rec.order.append(f"{idx}W{bwd_chunk_id}")
            rec.backward_done(idx, bwd_chunk_id)
            return out

        stage.backward_weight_one_chunk = backward_weight_one_chunk


def make_loss_fn(total_tokens: int, rec: StageRecorder | None = None) -> Callable[[Any, Any], Any]:
    """Loss of one micro-batch: Σ token cross-entropy / ``total_tokens`` of the global batch.

    With ``scale_grads=False`` the micro-batch gradients then add up to the gradient of the mean
    loss over the global batch. When ``rec`` is given, the loss's time and saved bytes are
    added to the forward that produced the logits (it runs right after it).
    """
    import torch.nn.functional as F

    def loss_fn(logits: Any, target: Any) -> Any:
        pending = rec.pending_forward if rec is not None else None
        seen: dict[int, int] = {}
        if rec is None or pending is None:
            return (
                F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), reduction="sum")
                / total_tokens
            )
        param_ptrs, stage, mb = rec.loss_hooks
        with _saved_bytes_hooks(param_ptrs, seen):
            loss = (
                F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), reduction="sum")
                / total_tokens
            )
        kind, s, i, t0, _ = rec.intervals[pending]
        rec.intervals[pending] = (kind, s, i, t0, rec.now())
        extra = sum(seen.values())
        rec.saved_bytes[(stage, mb)] = rec.saved_bytes.get((stage, mb), 0) + extra
        rec.per_microbatch_bytes[-1] += extra
        rec.resident_bytes += extra
        rec.peak_resident_bytes = max(rec.peak_resident_bytes, rec.resident_bytes)
        rec.pending_forward = None
        return loss

    return loss_fn
