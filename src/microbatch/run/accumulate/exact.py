"""Exact gradient accumulation: the gradient of the whole batch, one micro-batch at a time.

The loss of an optimizer step is the mean over every valid item (token) of the global batch,
``(Σ loss_sum) / (Σ n_items)`` summed over all micro-batches and all data-parallel ranks. The
mean of per-micro-batch means is a different number whenever the micro-batches hold different
numbers of valid items (padded variable-length sequences, labels of -100): that was the 2024
Hugging Face gradient-accumulation bug. Here every micro-batch's summed loss is scaled by one
factor, ``1 / N_total`` (times the world size under DDP, to undo DDP's averaging), so the
accumulated gradient is exactly the full-batch gradient up to the order of summation.

:func:`accumulate` (and :func:`accumulate_micro_batches` for a list already split, for example
by :func:`~microbatch.run.accumulate.microbatches.split_by_tokens`) is all-or-nothing: if anything raises
inside, every parameter's ``.grad`` is put back to what it was before the call. That is what lets
``on_oom="split"`` (or a :class:`~microbatch.run.accumulate.controller.MicroBatchController`) redo a step that
ran out of memory with micro-batches of half the size: the redone step's gradient is the one the
step would have given. Under DDP the ranks agree on it in the step's one ``all_reduce``.

The rooms around it: splitting (:mod:`microbatch.run.accumulate.microbatches`), counting and scaling for
hand-written loops (:mod:`microbatch.run.accumulate.scaling`; both re-exported here), out-of-memory
(:mod:`microbatch.run.accumulate.oom`), what the ranks agree on (:mod:`microbatch.run.accumulate.agree`), the size across steps (:mod:`microbatch.run.accumulate.controller`) and the
noise-scale arithmetic (:mod:`microbatch.run.noise`, fed through ``noise=``).

torch is imported here at module level; ``import microbatch`` stays light because this module
loads only on first use of ``microbatch.run.accumulate``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from microbatch.errors import ConfigError, check_instance, check_positive_int
from microbatch.run.accumulate import agree as ag
from microbatch.run.accumulate.agree import (
    check_can_agree as _check_can_agree,  # the name bench/bench_oom.py imports
)
from microbatch.run.accumulate.controller import MicroBatchController
from microbatch.run.accumulate.empty import (
    Filler,
    NoItems,
    backward_empty,
    check_empty_losses,
    same_count,
    with_items,
)
from microbatch.run.accumulate.grad_hooks import MicroBatchNorms, Reading
from microbatch.run.accumulate.microbatches import Batch, batch_rows, split, split_by_tokens
from microbatch.run.accumulate.noise_step import NoiseStep, noise_reading, noise_smalls, noise_update
from microbatch.run.accumulate.oom import (
    free_memory,
    is_out_of_memory,
    one_row_error,
    set_aside,
    short_error,
)
from microbatch.run.accumulate.retry import StepState, check_weights_kept, warn_norm_layers, weight_versions
from microbatch.run.accumulate.scaling import (
    CountFn,
    check_callables,
    check_loss,
    checked_counts,
    count_items,
    grad_sq_norm,
    group_and_world,
    is_ddp,
    is_fsdp,
    loss_scale,
    model_device,
    params_once,
    sync_unless_last,
    to_float,
    to_mean,
    total_of,
)
from microbatch.run.noise import GradientNoiseScale

__all__ = [
    "accumulate",
    "accumulate_micro_batches",
    "MicroBatchController",
    "split",
    "split_by_tokens",
    "count_items",
    "loss_scale",
    "sync_unless_last",
    "is_ddp",
    "batch_rows",
    "grad_sq_norm",
]

LossFn = Callable[[Any, Batch], "tuple[torch.Tensor, int | float | torch.Tensor]"]
ON_OOM = ("raise", "split")


def accumulate(
    model: Any,
    batch: Batch,
    loss_fn: LossFn,
    *,
    micro_batch_size: int | None = None,
    count_fn: CountFn | None = None,
    noise: GradientNoiseScale | None = None,
    on_oom: str | None = None,
    controller: MicroBatchController | None = None,
) -> torch.Tensor:
    """Accumulate into ``.grad`` exactly the gradient of the whole ``batch``'s mean loss.

    ``batch`` (a tensor, a tuple/list or a dict of tensors sharing dim 0) is split into micro-batches
    of ``micro_batch_size`` rows (the last may be smaller). ``loss_fn(model, micro_batch)`` returns
    ``(loss_sum, n_items)``: the summed loss over the micro-batch's valid items and their number.
    Afterwards every parameter's ``.grad`` has gained exactly ``∇ (Σ loss_sum) / (Σ n_items)`` over
    the whole batch (and over all ranks under DDP), whatever the counts per micro-batch; gradients
    present before the call are kept and added to, as ``backward()`` does. Returns that mean loss,
    detached.

    With ``count_fn(micro_batch) -> n_items`` the total is known before the first backward and each
    micro-batch's loss is scaled by ``1/total``; without it the gradients are rescaled at the end.

    Under DDP (``model`` is a ``DistributedDataParallel``) gradients are all-reduced once (``no_sync``
    on all but the last micro-batch), counts are summed over ranks and DDP's averaging is undone, so
    ``.grad`` equals the single-process full-batch gradient. Gradients present before the call are
    added after the all-reduce, not averaged with the other ranks'.

    All or nothing: if anything raises (loss_fn, backward, a bad return value, an interrupt), every
    ``.grad`` is restored to its value before the call (``None`` stays ``None``) and the exception
    propagates. The cost: a copy of the gradients that existed before the call, only when they exist.

    ``on_oom``: ``"raise"`` (the default) lets an out-of-memory error propagate (after the restore).
    ``"split"`` redoes the step with micro-batches of half the size, down to one row (see
    :mod:`microbatch.run.accumulate.oom` for what counts as out of memory); the gradient and the loss are those
    of the step without the error, and one row out of memory raises
    :class:`microbatch.errors.OutOfMemoryError` with the gradients as they were (a
    :class:`~microbatch.errors.MeasurementError`, not a ``torch.OutOfMemoryError``: catch it by that
    type). So does an out-of-memory while setting aside the gradients present before the call: that
    is not the micro-batch's size, so it is not split. ``controller`` (a
    :class:`~microbatch.run.accumulate.controller.MicroBatchController`, in place of ``micro_batch_size``) keeps
    the size that worked from step to step and implies ``"split"``. Under DDP the ranks agree on a
    split in the step's one ``all_reduce`` and all redo the step at the same size; the gradients are
    then all-reduced after the last backward instead of during it, and a parameter no rank has a
    gradient for keeps ``.grad = None``, as under DDP's own reduction (:mod:`microbatch.run.accumulate.agree`).

    ``noise`` (a :class:`microbatch.run.noise.GradientNoiseScale`) pairs each micro-batch's gradient (this rank's,
    read as autograd passes it: :mod:`~microbatch.run.accumulate.grad_hooks`) with the whole batch's, no extra backward.
    """
    check_callables(model, loss_fn, count_fn)
    if noise is not None:
        check_instance(
            "noise", noise, GradientNoiseScale, "pass noise=GradientNoiseScale(decay=0.95) or leave it out"
        )
        if "FullyShardedDataParallel" in {c.__name__ for c in type(model).__mro__}:
            raise ConfigError(
                "noise with FSDP's older wrapper (FullyShardedDataParallel): its gradients are each rank's flat shard, "
                "whose norm is not the gradient's; measure the noise scale under fully_shard (FSDP2) or DDP, or leave "
                "noise out",
                params=("noise",),
            )
    on_oom = _resolve_on_oom(micro_batch_size, on_oom, controller)
    warn_norm_layers(
        model, controller.micro_batch_size if controller else micro_batch_size or 1, batch_rows(batch)
    )
    if on_oom == "raise":
        assert micro_batch_size is not None
        return _accumulate_list(model, split(batch, micro_batch_size), loss_fn, count_fn, noise, "raise")
    if controller is None:
        assert micro_batch_size is not None
        controller = MicroBatchController(micro_batch_size, one_call=True)  # this call only
    rows = batch_rows(batch)
    if rows == 0:
        raise ConfigError("batch has 0 rows; give at least one row")
    return _accumulate_splitting(
        model, lambda size: split(batch, size), rows, loss_fn, count_fn, noise, controller
    )


def _resolve_on_oom(
    micro_batch_size: int | None, on_oom: str | None, controller: MicroBatchController | None
) -> str:
    """``on_oom`` checked against the size or controller given (a controller implies ``"split"``)."""
    if controller is not None:
        if micro_batch_size is not None:
            raise ConfigError(
                f"give micro_batch_size ({micro_batch_size!r}) or controller, not both; the controller holds "
                "the size (MicroBatchController(initial=...))"
            )
        if not isinstance(controller, MicroBatchController):
            raise ConfigError(
                f"controller must be a MicroBatchController, got {type(controller).__name__}; make one with "
                "microbatch.MicroBatchController(initial=b_m), or give micro_batch_size=b_m instead"
            )
        if on_oom not in (None, "split"):
            raise ConfigError(f"on_oom={on_oom!r} with a controller; a controller splits on out-of-memory")
        on_oom = "split"
    else:
        check_positive_int(
            "micro_batch_size",
            micro_batch_size,
            fix="give the rows per forward/backward (b_m), or controller=MicroBatchController(initial=b_m)",
        )
    on_oom = on_oom or "raise"
    if on_oom not in ON_OOM:
        raise ConfigError(f"on_oom must be one of {', '.join(map(repr, ON_OOM))}, got {on_oom!r}")
    return on_oom


def _accumulate_splitting(
    model: Any,
    pieces: Callable[[int], list[Batch]],
    rows: int,
    loss_fn: LossFn,
    count_fn: CountFn | None,
    noise: GradientNoiseScale | None,
    controller: MicroBatchController,
    *,
    same_size: bool = True,
) -> torch.Tensor:
    """``on_oom="split"``: attempts at halving sizes until one completes on every rank.

    ``pieces(size)``: the step's micro-batches of at most ``size`` rows; ``rows``: the most a micro-batch
    can hold (the batch's rows, or the largest micro-batch given). ``same_size``: every rank runs the
    controller's size (checked in the step's all_reduce) and all go on at half the agreed rows; else
    (micro-batches given, which differ by rank) each rank halves its own and all stop together, when
    every rank is down to one row.
    """
    _, world = group_and_world(model)
    agree = world > 1
    _check_can_agree(model)
    if agree:
        ag.settle_ddp_buckets(model)  # DDP's one-time bucket broadcast, here on every rank, not in a forward
    controller.start_step()  # growth after clean optimizer steps, when the controller counts them
    counted: float | None = None
    state = StepState.take(model)  # random streams and BatchNorm statistics, put back before a redo
    while True:
        size = controller.micro_batch_size
        ran = min(size, rows)  # the most rows a micro-batch of this attempt holds (on this rank)
        micro_batches = pieces(size)
        if count_fn is not None and not agree:
            micro_batches, counted = with_items(micro_batches, count_fn)
        elif count_fn is not None and counted is None:  # the total does not depend on the split
            counted = count_items(micro_batches, count_fn, model=model)
        reason: str | None = None
        if agree:
            mine = ran
            loss, reason, ran = _run(
                model, micro_batches, loss_fn, count_fn, noise, counted, (size if same_size else 0, ran)
            )
        else:
            mine = ran
            try:
                loss = _run(model, micro_batches, loss_fn, count_fn, noise, counted, None)[0]
            except Exception as e:  # noqa: BLE001 - only out-of-memory is kept; anything else propagates
                if not is_out_of_memory(e):
                    raise
                loss, reason = None, short_error(e)
            # here the exception and its frames (the failed step's tensors) are gone
        if loss is not None:
            controller.record_step()
            return loss
        del micro_batches
        free_memory(model_device(model))
        if ran <= 1:  # every rank is down to one row: the step is given up as it was found
            state.restore()
            raise one_row_error(controller.where(), reason or "out of memory")
        new = ran // 2 if same_size else max(1, mine // 2)
        if new < size:
            controller.record_split(new, reason or "out of memory")
            warn_norm_layers(model, new, rows)
        state.restore()


def accumulate_micro_batches(
    model: Any,
    micro_batches: Sequence[Batch],
    loss_fn: LossFn,
    *,
    count_fn: CountFn | None = None,
    noise: GradientNoiseScale | None = None,
    on_oom: str | None = None,
) -> torch.Tensor:
    """:func:`accumulate` over micro-batches already split (e.g. by :func:`split_by_tokens`).

    ``on_oom="split"``: an out-of-memory puts the gradients back and redoes the step with every
    micro-batch cut into pieces of at most half the rows of the largest (then half again ...), down to
    one row; the gradient and the loss are those of the step without the error (the sum over items
    does not depend on the grouping). Each split is logged as by a
    :class:`~microbatch.run.accumulate.controller.MicroBatchController`, but nothing is remembered for the next
    call: the caller chose the micro-batches (a token budget, say), so give the next call smaller ones
    (``split_by_tokens(..., max_tokens // 2)``) if splits recur. Under DDP the ranks agree on a split in
    the step's one ``all_reduce``, each halving its own micro-batches, and stop together when every
    rank is down to one row. Layers that normalise by the rows they see together (BatchNorm) are warned of, as by
    :func:`accumulate`.
    """
    check_callables(model, loss_fn, count_fn)
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ConfigError("no micro-batches to accumulate; give at least one")
    try:  # rows counted where the layout allows (a caller's own split may hold anything)
        sizes = [batch_rows(mb) for mb in micro_batches]
    except ConfigError:
        sizes = []
    if sizes:
        warn_norm_layers(model, max(sizes), sum(sizes))
    return _accumulate_list(model, micro_batches, loss_fn, count_fn, noise, on_oom)


def _accumulate_list(
    model: Any,
    micro_batches: list[Batch],
    loss_fn: LossFn,
    count_fn: CountFn | None,
    noise: GradientNoiseScale | None,
    on_oom: str | None,
) -> torch.Tensor:
    """:func:`accumulate_micro_batches` once its arguments are checked and its warning given."""
    on_oom = on_oom or "raise"
    if on_oom not in ON_OOM:
        raise ConfigError(f"on_oom must be one of {', '.join(map(repr, ON_OOM))}, got {on_oom!r}")
    if on_oom == "split":
        rows = max(batch_rows(mb) for mb in micro_batches)

        def pieces(size: int) -> list[Batch]:
            return (
                list(micro_batches) if size >= rows else [p for mb in micro_batches for p in split(mb, size)]
            )

        controller = MicroBatchController(
            max(rows, 1), one_call=True
        )  # this call: its log lines, the halving
        return _accumulate_splitting(
            model, pieces, rows, loss_fn, count_fn, noise, controller, same_size=False
        )
    counted = None
    if count_fn is not None and group_and_world(model)[1] == 1:
        micro_batches, counted = with_items(micro_batches, count_fn)
    elif count_fn is not None:
        counted = count_items(micro_batches, count_fn, model=model)
    loss = _run(model, micro_batches, loss_fn, count_fn, noise, counted, None)[0]
    assert loss is not None
    return loss


def _run(
    model: Any,
    micro_batches: list[Batch],
    loss_fn: LossFn,
    count_fn: CountFn | None,
    noise: GradientNoiseScale | None,
    counted: float | None,
    agree: tuple[int, int] | None,
) -> tuple[torch.Tensor | None, str | None, int]:
    """One all-or-nothing attempt: ``(mean loss, None, 0)``, or with ``agree``, maybe ``(None, reason, size)``.

    ``agree=(size, rows run)`` (DDP, ``on_oom="split"``): every micro-batch runs under ``no_sync``; an
    out-of-memory here is caught and this rank goes on to the step's all_reduce with a flag, which
    also carries what :mod:`microbatch.run.accumulate.agree` lists (the sizes, which must match, 0 when the
    micro-batches were given, which differ by rank; the most rows each ran; which parameters have a
    gradient); if any rank failed, every rank restores its gradients and returns ``(None, reason,
    the ranks' mean of those rows rounded up)``; otherwise the gradients are all-reduced after the
    last backward. Without ``agree`` any exception propagates after the restore, and DDP all-reduces
    during the last backward as usual. An out-of-memory while setting the old gradients aside raises
    :func:`~microbatch.run.accumulate.oom.set_aside_error` (on every rank, after the all_reduce, with ``agree``).
    """
    group, world = group_and_world(model)
    manual = agree is not None and world > 1
    average = world if world > 1 and not manual else 1  # DDP divides by the world size; a manual SUM does not
    params = [p for p in model.parameters() if p.requires_grad]
    # no count_fn on one process: each loss over the first micro-batch's count (:func:`_backward_each`)
    scale = loss_scale(counted) * average if counted is not None else (1.0 if world > 1 else None)
    saved, copy_failed = set_aside(model_device(model), params, manual)

    def restore() -> None:
        if copy_failed is not None:
            return  # nothing was changed
        for p, s in zip(params, saved, strict=True):
            if s is not None and p.grad is not None:
                p.grad.copy_(s)
            else:
                p.grad = s

    try:
        todo = micro_batches if copy_failed is None else []
        losses, counts, smalls, reason, applied = _backward_each(
            model, todo, loss_fn, params, scale, manual, noise
        )
        if reason is not None:
            restore()
            losses, counts, smalls = [], [], []

        # Global sums of the loss and the items: the step's one all_reduce under DDP, which also
        # carries the agreement (microbatch.run.accumulate.agree) with on_oom="split".
        checked_counts(
            "loss_fn's n_items", counts
        )  # tensors read back once: a negative count named, not summed
        loss_total, n_total = total_of(losses), total_of(counts)
        if world > 1:
            loss_global, n_global, redo = ag.all_reduce_sums(
                model, params, [loss_total, n_total], agree, reason, copy_failed
            )
            if redo is not None:  # some rank ran out of memory: every rank redoes the step
                if reason is None:
                    restore()
                    reason = redo[0]
                return None, reason, redo[1]
        else:
            loss_global, n_global = to_float(loss_total), to_float(n_total)
        check_empty_losses(model, losses, counts, loss_global, world)  # raises into the restore below
        to_mean(params, count_fn, counted, n_global, average, applied)
        if noise is not None:
            step = NoiseStep(
                tuple(smalls), n_global, grad_sq_norm(params), group, world, first_reduced=is_fsdp(model)
            )
            noise_update(noise, step, model_device(model))
    except BaseException:
        restore()
        raise
    for p, s in zip(params, saved, strict=True):
        if s is not None:
            p.grad.add_(s)
    # The loss's dtype and device: a micro-batch with items (an empty one may return a stand-in zero).
    like = next((x for x, n in zip(losses, counts, strict=True) if to_float(n) > 0), losses[0])
    return torch.tensor(loss_global / n_global, dtype=like.dtype, device=like.device), None, 0


def _backward_each(
    model: Any,
    micro_batches: list[Batch],
    loss_fn: LossFn,
    params: list[Any],
    scale: float | None,
    manual: bool,
    noise: GradientNoiseScale | None,
) -> tuple[list[torch.Tensor], list[Any], list[tuple[float, float]], str | None, float]:
    """Forward and backward of each micro-batch: the detached loss sums, the item counts, ``(items, |g|²)`` of
    the micro-batches' own mean gradients (for ``noise``: :func:`_noise_smalls`), the reason of an
    out-of-memory caught under ``manual`` agreement (anything else propagates) and the factor the sums were
    multiplied by.

    ``scale`` None (no ``count_fn``, one process): every loss sum times 1/max(1, n) of the first micro-batch, one
    factor for all (a tensor where n is one: no read of the device), undone by :func:`to_mean`. A backward of the
    sum itself puts n times a mean's gradient through the activations, past half precision's range under a
    ``GradScaler`` (fp16: 7 of 20 steps skipped at 512 items, against none for the mean loop it replaces). A
    ConfigError when ``loss_fn`` changed every parameter (an ``optimizer.step()`` inside it): version counters, read
    before and after (not under FSDP, whose unsharding writes them, nor for a lazy module's, set by its first
    forward)."""
    versions = None if is_fsdp(model) else weight_versions(params)
    if (
        versions is None and group_and_world(model)[1] > 1
    ):  # FSDP: as many forwards and backwards as every rank
        micro_batches = same_count(model, micro_batches)
    losses: list[torch.Tensor] = []
    counts: list[Any] = []
    readings: list[tuple[Any, Reading | None]] = []  # (items, Σ|g|²) of each micro-batch, for noise
    hooks = MicroBatchNorms(params) if noise is not None and not is_fsdp(model) else None
    last = len(micro_batches) - 1
    try:
        for i, mb in enumerate(micro_batches):
            with sync_unless_last(model, i == last and not manual):
                if isinstance(
                    mb, Filler
                ):  # FSDP's collectives kept in step with a rank that runs more; adds 0
                    (check_loss(loss_fn(model, mb.batch), i)[0] * 0.0).backward()  # type: ignore[no-untyped-call]
                    continue
                empty = isinstance(mb, NoItems)  # count_fn found no items: run for terms not per item
                once = params_once(model, loss_fn, params) if i == 0 else (None, None)
                loss_sum, n = check_loss(loss_fn(model, mb.batch if empty else mb), i, *once)
                if scale is None:
                    scale = _first_scale(loss_sum, n)
                # no items: its gradient added where finite (a masked mean's 0/0 is the 0 of no items)
                if empty and not backward_empty(loss_sum, scale, params):
                    loss_sum = torch.zeros_like(loss_sum.detach())
                elif not empty:  # Tensor.backward carries no annotations in torch's stubs (it dispatches __torch_function__)
                    with hooks.arming() if hooks is not None else contextlib.nullcontext():
                        unit = isinstance(scale, float) and scale == 1.0
                        (loss_sum if unit else loss_sum * scale).backward()  # type: ignore[no-untyped-call]
            losses.append(loss_sum.detach())
            counts.append(n)
            del loss_sum
            if noise is not None and not empty:
                readings.append((n, noise_reading(hooks, params, i == 0 and last > 0)))
    except Exception as e:
        if not (manual and is_out_of_memory(e)):
            raise
        return losses, counts, [], short_error(e), 1.0  # the text only: the frames hold the failed tensors
    finally:
        if hooks is not None:
            hooks.close()
    check_weights_kept(params, versions)
    applied = 1.0 if scale is None else to_float(scale)
    return losses, counts, noise_smalls(readings, applied), None, applied


def _first_scale(loss_sum: torch.Tensor, n: Any) -> Any:
    """1 / max(1, n): the factor of every loss sum of a step without ``count_fn`` (:func:`_backward_each`), a tensor in
    the loss's precision (at least fp32) where ``n`` is one."""
    if isinstance(n, torch.Tensor):
        return 1 / n.detach().clamp(min=1).to(torch.promote_types(loss_sum.dtype, torch.float32))
    return 1.0 / max(1.0, float(n))
