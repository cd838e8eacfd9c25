"""Instrumentation of a pipeline stage: busy intervals, in-flight counts, saved-activation bytes.

:func:`instrument_stage` wraps a ``torch.distributed.pipelining`` stage's
``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` (instance
attributes, so the schedule's calls go through them) and records into a :class:`StageRecorder`:

- every compute interval ``(kind, stage, microbatch, start, end)``: ``time.perf_counter`` on the
  CPU, CUDA events on a GPU (resolved after the step's synchronisation);
- the in-flight count: +1 when a forward ends, −1 when the micro-batch's backward ends (the W
  part for a split backward), summed over the rank's virtual stages; its maximum;
- the bytes autograd saves during each forward (``saved_tensors_hooks``; parameters excluded,
  storages counted once), per micro-batch, and their sum over the micro-batches the schedule
  counts in flight (:attr:`StageRecorder.counted_peak_bytes`: arithmetic on the order, not memory);
- **memory actually held** (:class:`LiveBytes`): every storage autograd saved is counted once while
  any tensor saved on it is alive — released through a weak reference when the last one is freed,
  whenever that happens (after its backward, or later if something keeps it) — and the peak of
  that sum over the step. A leak or a late free raises it; the schedule's count does not see them.

:func:`make_loss_fn` builds the loss (Σ token cross-entropy / tokens in the global batch) and,
given the recorder, adds the loss's time and saved bytes to the forward that produced the logits.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LiveBytes", "StageRecorder", "instrument_stage", "make_loss_fn"]


class LiveBytes:
    """Bytes of the storages autograd has saved that are still alive, and their peak.

    :meth:`track` counts a tensor's storage once (by its address) and attaches a finaliser to the
    tensor; the storage leaves the count when the last tracked tensor on it is freed. Parameters
    are never tracked (they live regardless of the schedule)."""

    def __init__(self) -> None:
        self.refs: dict[int, list[int]] = {}
        """storage address -> [bytes, tracked tensors alive]"""
        self.bytes = 0
        self.peak = 0

    def track(self, t: Any, skip: set[int]) -> None:
        try:
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            return
        if ptr in skip or nbytes == 0:
            return
        entry = self.refs.get(ptr)
        if entry is None:
            entry = self.refs[ptr] = [nbytes, 0]
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.refs.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.refs[ptr]
            self.bytes -= entry[0]

    def reset_peak(self) -> None:
        self.peak = self.bytes


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
    """Saved-activation bytes per (stage, micro-batch) the schedule counts in flight."""
    resident_bytes: int = 0
    counted_peak_bytes: int = 0
    """Most saved bytes of the micro-batches counted in flight at once (the order's arithmetic)."""
    live: LiveBytes = field(default_factory=LiveBytes)
    """Saved storages actually alive (freed through weak references), and their peak."""
    leak: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    """Test hook (``MICROBATCH_PIPELINE_FAULT=rank:leak``): the saved tensors of a micro-batch kept
    until the backward of the next one ends — one micro-batch too long."""
    leaking: bool = False
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
        self.resident_bytes = self.counted_peak_bytes = 0
        self.pending_forward = None
        self.leak.clear()
        self.live.reset_peak()

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
        self.counted_peak_bytes = max(self.counted_peak_bytes, self.resident_bytes)

    def backward_done(self, stage: int, mb: int) -> None:
        self.in_flight -= 1
        self.resident_bytes -= self.saved_bytes.pop((stage, mb), 0)
        if self.leaking:
            self.leak.pop((stage, mb - 1), None)  # the previous micro-batch's, one too late


def _saved_bytes_hooks(
    param_ptrs: set[int], seen: dict[int, int], rec: StageRecorder | None = None, key: Any = None
) -> Any:
    """``saved_tensors_hooks`` adding each new non-parameter storage's bytes to ``seen`` and, given
    ``rec``, tracking the storage in ``rec.live`` (and keeping it in ``rec.leak[key]`` when leaking)."""
    import torch

    def pack(t: Any) -> Any:
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in param_ptrs and ptr not in seen:
                seen[ptr] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
            seen[id(t)] = t.numel() * t.element_size()
        if rec is not None:
            rec.live.track(t, param_ptrs)
            if rec.leaking:
                rec.leak.setdefault(key, []).append(t)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _leak_requested(rank: int) -> bool:
    """``MICROBATCH_PIPELINE_FAULT=rank:leak`` (tests): this rank keeps saved tensors too long."""
    spec = os.environ.get("MICROBATCH_PIPELINE_FAULT", "").split(":")
    return len(spec) >= 2 and spec[1] == "leak" and spec[0] == str(rank)


def instrument_stage(stage: Any, rec: StageRecorder) -> None:
    """Wrap ``stage``'s forward/backward calls so that ``rec`` records them (instance attributes)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in stage.submod.parameters()}
    idx = stage.stage_index
    rec.leaking = _leak_requested(rec.rank)
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
    bwd_w = getattr(stage, "backward_weight_one_chunk", None)

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        seen: dict[int, int] = {}
        t0 = rec.now()
        with _saved_bytes_hooks(param_ptrs, seen, rec, (idx, fwd_chunk_id)):
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
        with _saved_bytes_hooks(param_ptrs, seen, rec, (stage, mb)):
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
        rec.counted_peak_bytes = max(rec.counted_peak_bytes, rec.resident_bytes)
        rec.pending_forward = None
        return loss

    return loss_fn
