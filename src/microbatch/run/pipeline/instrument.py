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

__all__ = ["LiveBytes", "StageRecorder", "instrument_stage", "make_loss_fn", "split_backward_kept"]


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
    cpu_s: list[float] = field(default_factory=list)
    """CPU seconds of this thread inside each interval (``time.thread_time``): with the wall time,
    the share of a core the rank's ops got while the pipeline ran."""
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
    per_microbatch_shared_bytes: list[int] = field(default_factory=list)
    """Of :attr:`per_microbatch_bytes`, the bytes on storages an earlier micro-batch of the step saved
    and that are still alive (one storage under several micro-batches: the batch's token ids and
    targets, which torch splits into views): held once, not once per micro-batch."""
    step_ptrs: dict[int, Any] = field(default_factory=dict)
    """Storages saved by the forwards of this step so far -> the (stage, micro-batch) that saved them."""
    order: list[str] = field(default_factory=list)
    """Compute actions as run, e.g. ``"0F1"``."""
    live_trace: list[int] = field(default_factory=list)
    """Saved bytes actually alive right after each action of :attr:`order` (measured, weak references)."""
    pending_forward: int | None = None
    """Index into ``intervals`` of the last forward (the loss extends it)."""
    loss_hooks: Any = None
    """(parameter storages, stage, micro-batch) of the last stage's latest forward, for the loss."""

    def reset(self) -> None:
        self.intervals.clear()
        self.cpu_s.clear()
        self.order.clear()
        self.live_trace.clear()
        self.saved_bytes.clear()
        self.per_microbatch_bytes.clear()
        self.per_microbatch_shared_bytes.clear()
        self.step_ptrs.clear()
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

    def forward_done(self, stage: int, mb: int, nbytes: int, shared: int = 0) -> None:
        self.per_microbatch_shared_bytes.append(shared)
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
    param_ptrs: set[int],
    seen: dict[int, int],
    rec: StageRecorder | None = None,
    key: Any = None,
    shared: dict[int, int] | None = None,
    held_ids: set[int] | None = None,
) -> Any:
    """``saved_tensors_hooks`` adding each new non-parameter storage's bytes to ``seen`` and, given
    ``rec``, tracking the storage in ``rec.live`` (and keeping it in ``rec.leak[key]`` when leaking);
    ``shared`` gets the storages an earlier forward of the step saved that are still alive; ``held_ids``
    the ``id`` of each tensor tracked as itself (no ``grad_fn``: a leaf such as a stage's received input,
    which then stays counted while whoever owns it keeps it)."""
    import torch

    def pack(t: Any) -> Any:
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in param_ptrs and ptr not in seen:
                seen[ptr] = st.nbytes()
                earlier = rec.step_ptrs.get(ptr, key) if rec is not None else key
                if shared is not None and rec is not None and earlier != key and ptr in rec.live.refs:
                    shared[ptr] = st.nbytes()  # alive, so the same storage (no reused address)
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
            seen[id(t)] = t.numel() * t.element_size()
        # Hold a detached alias (same storage, same version counter), never the tensor itself: a
        # saved tensor that carries its grad_fn makes a reference cycle through autograd's C++
        # node (node -> saved object -> tensor -> grad_fn -> node) that Python's collector cannot
        # break. A full backward releases it; torch's split backward does not (its input-gradient
        # pass retains the graph and the weight pass frees only the nodes it traverses), so the
        # saved tensors of the nodes above the weights leaked, 273 KiB per micro-batch on tiny's
        # last stage (measured: process RSS +140 MiB over 400 split backwards with identity hooks,
        # +0.2 MiB without hooks, and the same with a detached alias).
        held = t.detach() if t.grad_fn is not None else t
        if held_ids is not None and held is t:
            held_ids.add(id(t))
        if rec is not None:
            rec.live.track(held, param_ptrs)
            if rec.leaking:
                rec.leak.setdefault(key, []).append(held)
        return held, t._version  # the alias shares the version counter: unpack checks it as autograd would

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack_checked)


def _unpack_checked(packed: tuple[Any, int]) -> Any:
    """The saved tensor, after autograd's own check (which hooks that return the tensor turn off): a tensor
    modified in place after it was saved gives a wrong gradient, so a RuntimeError as torch words it."""
    held, version = packed
    if held._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{held.type()} {list(held.shape)}] is at version {held._version}; expected version {version} instead "
            "(the stage's forward changes a tensor in place after an operation saved it for its backward: "
            "make that operation out of place)"
        )
    return held


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
        shared: dict[int, int] = {}
        c0 = time.thread_time()
        t0 = rec.now()
        with _saved_bytes_hooks(param_ptrs, seen, rec, (idx, fwd_chunk_id), shared):
            out = fwd(fwd_chunk_id, *args, **kwargs)
        t1 = rec.now()
        rec.step_ptrs.update(dict.fromkeys(seen, (idx, fwd_chunk_id)))
        rec.intervals.append(("F", idx, fwd_chunk_id, t0, t1))
        rec.cpu_s.append(time.thread_time() - c0)
        rec.order.append(f"{idx}F{fwd_chunk_id}")
        rec.live_trace.append(rec.live.bytes)
        rec.forward_done(idx, fwd_chunk_id, sum(seen.values()), sum(shared.values()))
        rec.pending_forward = len(rec.intervals) - 1 if stage.is_last else None
        rec.loss_hooks = (param_ptrs, idx, fwd_chunk_id)
        return out

    def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", True)
        c0 = time.thread_time()
        t0 = rec.now()
        out = bwd(bwd_chunk_id, *args, **kwargs)
        t1 = rec.now()
        kind = "B" if full else "I"
        rec.intervals.append((kind, idx, bwd_chunk_id, t0, t1))
        rec.cpu_s.append(time.thread_time() - c0)
        rec.order.append(f"{idx}{kind}{bwd_chunk_id}")
        rec.live_trace.append(rec.live.bytes)
        if full:
            rec.backward_done(idx, bwd_chunk_id)
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    if bwd_w is not None:

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            t0 = rec.now()
            out = bwd_w(bwd_chunk_id, *args, **kwargs)
            t1 = rec.now()
            rec.intervals.append(("W", idx, bwd_chunk_id, t0, t1))
            rec.cpu_s.append(time.thread_time() - c0)
            rec.order.append(f"{idx}W{bwd_chunk_id}")
            rec.live_trace.append(rec.live.bytes)
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
        c0 = time.thread_time()
        shared: dict[int, int] = {}
        with _saved_bytes_hooks(param_ptrs, seen, rec, (stage, mb), shared):
            loss = (
                F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), reduction="sum")
                / total_tokens
            )
        kind, s, i, t0, _ = rec.intervals[pending]
        rec.intervals[pending] = (kind, s, i, t0, rec.now())
        rec.cpu_s[pending] += time.thread_time() - c0
        extra = sum(seen.values())
        rec.saved_bytes[(stage, mb)] = rec.saved_bytes.get((stage, mb), 0) + extra
        rec.per_microbatch_bytes[-1] += extra
        rec.per_microbatch_shared_bytes[-1] += sum(shared.values())
        rec.step_ptrs.update(dict.fromkeys(seen, (stage, mb)))
        rec.resident_bytes += extra
        rec.counted_peak_bytes = max(rec.counted_peak_bytes, rec.resident_bytes)
        rec.pending_forward = None
        return loss

    return loss_fn


def split_backward_kept(
    module: Any, inp: Any, *, first: bool, loss_fn: Any = None, target: Any = None
) -> float | None:
    """Fraction of a stage's saved bytes still alive after torch's input-gradient pass (I), which
    the weight-gradient pass (W) later frees: measured on one micro-batch with torch's own
    ``stage_backward_input`` / ``stage_backward_weight`` and :class:`LiveBytes` (the parameters excluded, and
    the input where autograd saves it as itself: the runtime holds it throughout). 1.0 on the first stage (torch skips its I and runs the whole backward at
    W); None where this torch lacks those functions. The module's gradients are cleared afterwards.

    The I pass keeps the graph (``retain_graph=True``) only through the stage output it still holds;
    on the last stage it detaches the loss, so the nodes above the weights (the loss, the output
    layer's softmax) are freed at I, not at W."""
    if first:
        return 1.0
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:
        return None
    import torch

    params = list(module.parameters())
    skip = {p.untyped_storage().data_ptr() for p in params}
    live = LiveBytes()
    rec = StageRecorder(rank=-1, live=live)
    held: set[int] = set()
    with torch.random.fork_rng(devices=[]), _saved_bytes_hooks(skip, {}, rec, None, held_ids=held):
        out = module(inp)
        outs = [loss_fn(out, target)] if loss_fn is not None else [out]
    # the input saved as itself stays alive here (this function holds it, as torch's runtime does in a run):
    # it is neither freed at I nor at W, so it is left out of both counts; saved only through a view (a Linear
    # flattening its input) it is freed with the view, at W where the weight gradient needs it
    pinned = inp.untyped_storage().nbytes() if id(inp) in held else 0
    saved = live.bytes - pinned
    grads = None if loss_fn is not None else [torch.ones_like(out)]
    try:
        _, groups = stage_backward_input(outs, grads, [inp], iter(params))
    except (TypeError, RuntimeError):  # another torch's private signature: keep everything until W
        module.zero_grad(set_to_none=True)
        return None
    if loss_fn is not None and not out._is_view():
        out.detach_()  # what torch's backward_one_chunk does to the last stage's output
    del outs, out, grads
    kept = live.bytes - pinned
    try:
        stage_backward_weight(iter(params), groups)
    except (TypeError, RuntimeError):
        return None
    finally:
        module.zero_grad(set_to_none=True)
    inp.grad = None
    return kept / saved if saved else 1.0
