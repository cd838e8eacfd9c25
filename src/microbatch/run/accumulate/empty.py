"""Micro-batches with no items: where ``count_fn`` finds none (one process) they still run for a loss's terms that
are not per item, their gradient added only where finite; under DDP or FSDP a non-finite empty loss is refused on
every rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from microbatch.errors import ConfigError
from microbatch.run.accumulate.microbatches import Batch
from microbatch.run.accumulate.scaling import (
    CountFn,
    as_number,
    checked_counts,
    group_and_world,
    model_device,
    to_float,
)

__all__ = ["Filler", "NoItems", "backward_empty", "check_empty_losses", "same_count", "with_items"]


def backward_empty(loss: torch.Tensor, scale: float, params: Sequence[Any]) -> bool:
    """Add the gradient of a micro-batch with no items (:class:`NoItems`) where it is finite, and say whether it was:
    its terms that are not per item (a z-loss) count, a masked mean's 0/0 (a NaN loss, or a finite ``torch.where``
    whose backward is 0/0) is the 0 a sum over no items is. One read of the device, on these micro-batches only.

    Taken with ``torch.autograd.grad`` (no hook that acts on ``.grad`` runs for a gradient that may be dropped); under
    ``torch.utils.checkpoint(use_reentrant=True)`` in the graph, which refuses ``.grad()`` (and has then used the
    graph up), by a backward into emptied ``.grad`` fields, the earlier gradients set aside and added back."""
    if not math.isfinite(to_float(loss)):
        return False
    if _reentrant_checkpoint(loss):
        grads: Sequence[Any] = _grads_by_backward(loss * scale, params)
    else:
        grads = torch.autograd.grad(loss * scale, list(params), allow_unused=True)
    used = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    values = [g.coalesce().values() if g.is_sparse else g for _, g in used]  # a sparse embedding's rows
    if used and not bool(torch.stack([v.isfinite().all() for v in values]).all()):
        return False
    for p, g in used:
        p.grad = g if p.grad is None else p.grad.add_(g)
    return True


def _reentrant_checkpoint(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s graph holds a ``torch.utils.checkpoint(use_reentrant=True)`` node (its autograd Function,
    ``CheckpointFunction``)."""
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def _grads_by_backward(loss: torch.Tensor, params: Sequence[Any]) -> list[Any]:
    """``loss``'s gradients for ``params`` (None where unused) by ``loss.backward()``, each parameter's ``.grad`` set
    aside before and put back after, whatever the backward raises."""
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        loss.backward()  # type: ignore[no-untyped-call]
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, kept, strict=True):
            p.grad = g


def check_empty_losses(
    model: Any, losses: Sequence[Any], counts: Sequence[Any], loss_total: float, world: int
) -> None:
    """ConfigError, on every rank, when the step's summed loss ``loss_total`` is not finite only because micro-batches
    with 0 items returned a non-finite summed loss (a masked mean × n is 0/0 = NaN there and poisons every
    gradient; under DDP or FSDP such micro-batches still run, as every rank runs the same forwards). Looked at
    only when the total is not finite, which every rank sees alike; where a micro-batch with items is not finite
    either (fp16 overflow, divergence: a correct masked sum is then NaN on an empty one too, inf × 0) the step
    passes through as before, for a GradScaler to skip."""
    if math.isfinite(loss_total):
        return
    bad = [(i, to_float(n) == 0) for i, (loss, n) in enumerate(zip(losses, counts, strict=True))
           if not math.isfinite(to_float(loss))]  # fmt: skip
    empty = [i for i, none in bad if none]
    flags = [
        float(len(empty)),
        float(len(bad) - len(empty)),
    ]  # empty and non-finite; with items and non-finite
    if world > 1:  # the ranks agree (one all_reduce, on this path only), so none waits for another
        flag = torch.tensor(flags, device=model_device(model))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group_and_world(model)[0])
        flags = [float(x) for x in flag.tolist()]
    if flags[0] and not flags[1]:
        where = f"micro-batch {empty[0]} of this rank" if empty else "a micro-batch of another rank"
        raise ConfigError(
            f"loss_fn returned a summed loss of {to_float(losses[empty[0]]) if empty else 'nan'} for {where}, "
            "which has 0 items, so the step's gradient is not finite; the summed loss over no items must be 0: "
            "return the SUM of the per-item losses (e.g. cross_entropy(..., reduction='sum', ignore_index=-100)), "
            "not a masked mean times the count. The gradients are as they were before the call"
        )


class NoItems:
    """A micro-batch ``count_fn`` finds no items in (one process, :func:`with_items`). It still runs: a loss may hold
    terms that are not per item (a z-loss, an auxiliary loss over every row), which the step's gradient includes
    with or without ``count_fn``; its summed loss is taken as 0 only where it is not finite (a masked mean × n is
    0/0 there and would poison every gradient; the sum over no items is 0)."""

    __slots__ = ("batch",)

    def __init__(self, batch: Batch) -> None:
        self.batch = batch


def with_items(micro_batches: Sequence[Batch], count_fn: CountFn) -> tuple[list[Any], float]:
    """One process: the micro-batches, those ``count_fn`` finds no items in marked :class:`NoItems`, and the total.
    (They were left out, and with them a loss's terms that are not per item: a gradient other than the one without
    ``count_fn``.) Not under DDP or FSDP, whose ranks must run the same forwards and backwards, and refuse an empty
    micro-batch's non-finite loss (:func:`check_empty_losses`)."""
    values = [as_number("count_fn(micro_batch)", count_fn(mb)) for mb in micro_batches]
    counts = checked_counts("count_fn(micro_batch)", values)
    total = float(sum(counts))
    if not math.isfinite(total):
        raise ConfigError(f"count_fn gave a total of {total!r} items; counts must be finite and >= 0")
    return [mb if n > 0 else NoItems(mb) for mb, n in zip(micro_batches, counts, strict=True)], total


class Filler:
    """A micro-batch run under FSDP only because another rank runs more (:func:`same_count`): a forward and a backward
    of this rank's last micro-batch with its loss times 0, so that FSDP's all-gathers and reduce-scatters (one set a
    forward and a backward, on every rank) stay in step; it adds nothing to the gradient, the loss or the items."""

    __slots__ = ("batch",)

    def __init__(self, batch: Batch) -> None:
        self.batch = batch


def same_count(model: Any, micro_batches: list[Any]) -> list[Any]:
    """Under FSDP on several ranks, ``micro_batches`` followed by :class:`Filler` ones up to the most any rank runs
    (one ``all_reduce`` of this rank's count and its negative, MAX): every forward and backward there is a
    collective, and a rank that ran fewer would leave the others waiting in an all-gather. ConfigError on every rank
    where one has none (no micro-batch to run a filler of)."""
    group, world = group_and_world(model)
    mine = len(micro_batches)
    both = torch.tensor([float(mine), -float(mine)], device=model_device(model))
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
    most, fewest = int(both[0]), int(-both[1])
    if fewest == 0 and most > 0:
        raise ConfigError(
            f"under FSDP every rank runs the same number of forwards and backwards (each is a collective), but a rank "
            f"of the {world} has no micro-batch this step (this one has {mine}, the most {most}); give every rank at "
            "least one row (a DistributedSampler pads the ranks to the same number of rows, unless drop_last=True "
            "and a short last batch)"
        )
    return [*micro_batches, *(Filler(micro_batches[-1]) for _ in range(most - mine))]
