"""Counting valid items and scaling losses: the arithmetic of exact accumulation, for any loop.

The loss of an optimizer step is ``(Σ loss_sum) / (Σ n_items)`` over every micro-batch and every
data-parallel rank. :func:`count_items` finds the global total (one ``all_reduce`` under DDP),
:func:`loss_scale` turns it into the factor each micro-batch's summed loss is multiplied by,
:func:`sync_unless_last` keeps DDP from all-reducing before the last micro-batch and
:func:`grad_sq_norm` measures a gradient. :mod:`microbatch.run.accumulate` is built on them; a
training loop written by hand can use them directly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from microbatch.errors import ConfigError
from microbatch.run.accumulate.microbatches import Batch

__all__ = [
    "check_callables",
    "CountFn",
    "count_items",
    "loss_scale",
    "sync_unless_last",
    "is_ddp",
    "grad_sq_norm",
    "group_and_world",
    "model_device",
    "as_number",
    "total_of",
    "to_float",
]

CountFn = Callable[[Batch], "int | float | torch.Tensor"]


def is_ddp(model: Any) -> bool:
    """True when ``model`` is a ``torch.nn.parallel.DistributedDataParallel``."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def group_and_world(model: Any) -> tuple[Any, int]:
    """(process group, world size) of a DDP ``model``; ``(None, 1)`` for any other model."""
    if not is_ddp(model):
        return None, 1
    group = getattr(model, "process_group", None)
    return group, torch.distributed.get_world_size(group)


def model_device(model: Any) -> torch.device:
    """The device of ``model``'s first parameter (the CPU when it has none)."""
    for p in model.parameters():
        device: torch.device = p.device
        return device
    return torch.device("cpu")


def as_number(name: str, value: Any) -> int | float | torch.Tensor:
    """An item count as an int/float, or a detached 1-element tensor; ConfigError otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"{name} must be one number, got a tensor of shape {tuple(value.shape)}; return the count of "
                "valid items, e.g. (labels != -100).sum()"
            )
        return value.detach().reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number or a 1-element tensor, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def total_of(values: Sequence[Any]) -> Any:
    """Sum of numbers and 1-element tensors: one stacked sum (float64) for the tensors, no per-item sync."""
    plain = [v for v in values if not isinstance(v, torch.Tensor)]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    total: Any = sum(plain)
    if tensors:
        try:
            t = torch.stack(tensors).sum(dtype=torch.float64)
        except (RuntimeError, TypeError):  # mixed dtypes or devices
            parts = [x.to(device=tensors[0].device, dtype=torch.float64) for x in tensors]
            t = parts[0]
            for x in parts[1:]:  # left to right, as a plain sum
                t = t + x
        total = t + total if total else t
    return total


def to_float(x: Any) -> float:
    """A number or a 1-element tensor as a Python float."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def count_items(micro_batches: Sequence[Batch], count_fn: CountFn, *, model: Any = None) -> float:
    """Valid items over all ``micro_batches`` (and over all ranks when ``model`` is DDP).

    ``count_fn(micro_batch)`` counts without a forward pass, e.g. ``(mb["labels"] != -100).sum()``.
    Under DDP this makes one small ``all_reduce`` (every rank must call it). Returns a float
    (item counts may be weights); raise nothing for a zero total — :func:`loss_scale` does.
    """
    total = total_of([as_number("count_fn(micro_batch)", count_fn(mb)) for mb in micro_batches])
    group, world = group_and_world(model)
    if world > 1:
        t = torch.as_tensor(total, dtype=torch.float64, device=model_device(model)).reshape(1).clone()
        torch.distributed.all_reduce(t, group=group)
        return float(t.item())
    value = to_float(total)
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"count_fn gave a total of {value!r} items; counts must be finite and >= 0")
    return value


def loss_scale(total_items: float, *, model: Any = None) -> float:
    """The factor each micro-batch's summed loss is multiplied by before ``backward()``.

    ``1 / total_items``, times the world size under DDP, whose all-reduce divides by it:
    ``Σ_ranks Σ_micro ∇loss_sum · world / N / world = ∇(Σ loss_sum) / N``.
    ``total_items`` must be the global total (:func:`count_items` with ``model=``).
    """
    if not total_items > 0 or not math.isfinite(total_items):
        raise ConfigError(
            f"the whole batch has {total_items:g} valid items; the mean loss needs at least one (check the "
            "labels: are they all -100?)"
        )
    _, world = group_and_world(model)
    return world / total_items


def sync_unless_last(model: Any, is_last: bool) -> contextlib.AbstractContextManager[object]:
    """``model.no_sync()`` for all but the last micro-batch under DDP, else a null context.

    DDP then all-reduces the accumulated gradients once, in the last micro-batch's backward.
    """
    if is_ddp(model) and not is_last:
        no_sync: contextlib.AbstractContextManager[object] = model.no_sync()
        return no_sync
    return contextlib.nullcontext()


def grad_sq_norm(parameters: Iterable[torch.Tensor]) -> float:
    """Σ |p.grad|² over ``parameters`` (float64), skipping parameters without a gradient."""
    total = 0.0
    for p in parameters:
        if p.grad is not None:
            total += float(torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2)
    return total


def check_callables(model: Any, loss_fn: Any, count_fn: Any) -> None:
    """ConfigError, before any forward, for a model without parameters() or a loss_fn / count_fn that cannot
    be called."""
    if not callable(getattr(model, "parameters", None)):
        raise ConfigError(
            f"model must be a torch.nn.Module (or DDP around one), got {type(model).__name__}; pass the module "
            "whose gradients accumulate"
        )
    if not callable(loss_fn):
        raise ConfigError(
            f"loss_fn must be callable (model, micro_batch) -> (loss_sum, items), got {type(loss_fn).__name__}"
        )
    if count_fn is not None and not callable(count_fn):
        raise ConfigError(f"count_fn must be callable (micro_batch) -> items, got {type(count_fn).__name__}")
