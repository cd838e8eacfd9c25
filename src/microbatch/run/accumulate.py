"""Exact gradient accumulation: the gradient of the whole batch, one micro-batch at a time.

The loss of an optimizer step is the mean over every valid item (token) of the global batch,
``(Σ loss_sum) / (Σ n_items)`` summed over all micro-batches and all data-parallel ranks. The
mean of per-micro-batch means is a different number whenever the micro-batches hold different
numbers of valid items (padded variable-length sequences, labels of -100): that was the 2024
Hugging Face gradient-accumulation bug. Here every micro-batch's summed loss is scaled by one
factor, ``1 / N_total`` (times the world size under DDP, to undo DDP's averaging), so the
accumulated gradient is exactly the full-batch gradient up to the order of summation.

Two ways to use it:

- :func:`accumulate` (and :func:`accumulate_micro_batches` for a list already split, for
  example by :func:`split_by_tokens`) runs the whole thing and is all-or-nothing: if anything
  raises inside, every parameter's ``.grad`` is put back to what it was before the call.
- the helpers :func:`split`, :func:`split_by_tokens`, :func:`count_items`, :func:`loss_scale`,
  :func:`sync_unless_last` and :func:`grad_sq_norm` for training loops written by hand.

The gradient noise scale rides along (``noise=``): this module takes the two gradient norms
and hands them to the arithmetic of :mod:`microbatch.run.noise`, which imports nothing from here.

torch is imported here at module level; ``import microbatch`` stays light because this module
loads only on first use of ``microbatch.run.accumulate``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from microbatch.errors import ConfigError, check_positive_int
from microbatch.run.noise import GradientNoiseScale, g_sq_estimate, trace_sigma_estimate

__all__ = [
    "accumulate",
    "accumulate_micro_batches",
    "split",
    "split_by_tokens",
    "count_items",
    "loss_scale",
    "sync_unless_last",
    "is_ddp",
    "batch_rows",
    "grad_sq_norm",
]

Batch = Any  # a tensor, a tuple/list of tensors, or a mapping of name -> tensor, all sharing dim 0
LossFn = Callable[[Any, Batch], "tuple[torch.Tensor, int | float | torch.Tensor]"]
CountFn = Callable[[Batch], "int | float | torch.Tensor"]


# -- splitting ---------------------------------------------------------------------------------


def _leaves(batch: Batch) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of ``batch``; ConfigError for any other structure."""
    if isinstance(batch, torch.Tensor):
        items = [("batch", batch)]
    elif isinstance(batch, Mapping):
        items = [(f"batch[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (tuple, list)):
        items = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        raise ConfigError(
            f"batch of type {type(batch).__name__} is not supported; a batch is a tensor, a tuple/list of "
            "tensors or a dict of tensors, all with the rows in dim 0"
        )
    if not items:
        raise ConfigError("batch is empty (no tensors); give at least one tensor with the rows in dim 0")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"{name} is a {type(t).__name__}, not a tensor; every entry of the batch must be a tensor "
                "with the rows in dim 0 (keep other values in loss_fn's closure)"
            )
        if t.dim() == 0:
            raise ConfigError(f"{name} is a 0-dim tensor; every entry needs the rows in dim 0")
    return items


def batch_rows(batch: Batch) -> int:
    """Rows (dim 0) of ``batch``, after checking that every tensor in it has the same number."""
    items = _leaves(batch)
    sizes = {name: t.shape[0] for name, t in items}
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{n} has {s}" for n, s in sizes.items())
        raise ConfigError(
            f"tensors of the batch have different first dimensions ({shown}); every tensor needs the same "
            "number of rows in dim 0"
        )
    return next(iter(sizes.values()))


def _take(
    batch: Batch, start: int, stop: int, width: int | None = None, full_width: int | None = None
) -> Batch:
    """Rows ``start:stop`` of every tensor (views); optionally cut dim 1 from ``full_width`` to ``width``."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        t = t[start:stop]
        if width is not None and t.dim() >= 2 and t.shape[1] == full_width:
            t = t[:, :width]
        return t

    if isinstance(batch, torch.Tensor):
        return cut(batch)
    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items()}
    return type(batch)(cut(v) for v in batch) if isinstance(batch, tuple) else [cut(v) for v in batch]


def split(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Split ``batch`` into consecutive micro-batches of ``micro_batch_size`` rows (views, no copy).

    The last micro-batch holds the remainder and may be smaller; a micro-batch size at least the
    number of rows gives one micro-batch. Tuples stay tuples, lists lists, mappings become dicts.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(
            f"micro_batch_size must be a whole number >= 1, got {micro_batch_size!r}; give the rows per "
            "forward/backward (b_m)"
        )
    rows = batch_rows(batch)
    if rows == 0:
        raise ConfigError("batch has 0 rows; give at least one row")
    return [_take(batch, i, min(i + micro_batch_size, rows)) for i in range(0, rows, micro_batch_size)]


def split_by_tokens(
    batch: Batch,
    max_tokens: int,
    *,
    lengths: Sequence[int] | torch.Tensor,
    trim_padding: bool = True,
) -> list[Batch]:
    """Split ``batch`` into consecutive micro-batches of at most ``max_tokens`` padded tokens each.

    For variable-length data. ``lengths[i]`` is the number of real tokens of row ``i`` (for example
    ``attention_mask.sum(1)``). A micro-batch of ``r`` rows whose longest row has ``l`` tokens costs
    ``r × l`` tokens when ``trim_padding`` is true (every tensor of two or more dims whose dim 1 is
    the batch's padded width is cut to ``l``: right padding assumed, as in training), ``r × width``
    otherwise. Rows keep their order (sort the batch by length first to waste less padding); the
    micro-batch gradient sum does not depend on the grouping. A row longer than ``max_tokens`` on its
    own is an error.
    """
    check_positive_int("max_tokens", max_tokens, fix="give the padded tokens one forward/backward may hold")
    rows = batch_rows(batch)
    if rows == 0:
        raise ConfigError("batch has 0 rows; give at least one row")
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if len(lens) != rows:
        raise ConfigError(
            f"lengths has {len(lens)} entries but the batch has {rows} rows; give one length per row"
        )
    widths = {t.shape[1] for _, t in _leaves(batch) if t.dim() >= 2}
    width = max(widths) if widths else 1
    if any(n < 0 or n > width for n in lens):
        bad = next(n for n in lens if n < 0 or n > width)
        raise ConfigError(f"a row length of {bad} is outside 0..{width} (the padded width); check lengths")
    out: list[Batch] = []
    start, longest = 0, 0
    for i, n in enumerate(lens):
        cost_one = n if trim_padding else width
        if max(cost_one, 1) > max_tokens:
            raise ConfigError(
                f"row {i} alone costs {cost_one} tokens, over max_tokens={max_tokens}; raise max_tokens to at "
                f"least {cost_one} or truncate the row"
            )
        new_longest = max(longest, n)
        cost = (i + 1 - start) * (max(new_longest, 1) if trim_padding else width)
        if cost > max_tokens:
            out.append(_take(batch, start, i, max(longest, 1) if trim_padding else None, width))
            start, new_longest = i, n
        longest = new_longest
    out.append(_take(batch, start, rows, max(longest, 1) if trim_padding else None, width))
    return out


# -- counting and scaling (for hand-written loops too) ------------------------------------------


def is_ddp(model: Any) -> bool:
    """True when ``model`` is a ``torch.nn.parallel.DistributedDataParallel``."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _group_and_world(model: Any) -> tuple[Any, int]:
    if not is_ddp(model):
        return None, 1
    group = getattr(model, "process_group", None)
    return group, torch.distributed.get_world_size(group)


def _device(model: Any) -> torch.device:
    for p in model.parameters():
        device: torch.device = p.device
        return device
    return torch.device("cpu")


def _as_number(name: str, value: Any) -> int | float | torch.Tensor:
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


def _total(values: Sequence[Any]) -> Any:
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


def _to_float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def count_items(micro_batches: Sequence[Batch], count_fn: CountFn, *, model: Any = None) -> float:
    """Valid items over all ``micro_batches`` (and over all ranks when ``model`` is DDP).

    ``count_fn(micro_batch)`` counts without a forward pass, e.g. ``(mb["labels"] != -100).sum()``.
    Under DDP this makes one small ``all_reduce`` (every rank must call it). Returns a float
    (item counts may be weights); raise nothing for a zero total — :func:`loss_scale` does.
    """
    total = _total([_as_number("count_fn(micro_batch)", count_fn(mb)) for mb in micro_batches])
    group, world = _group_and_world(model)
    if world > 1:
        t = torch.as_tensor(total, dtype=torch.float64, device=_device(model)).reshape(1).clone()
        torch.distributed.all_reduce(t, group=group)
        return float(t.item())
    value = _to_float(total)
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
    _, world = _group_and_world(model)
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


# -- the all-or-nothing runner -------------------------------------------------------------------


def _check_loss(out: Any, index: int) -> tuple[torch.Tensor, int | float | torch.Tensor]:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ConfigError(
            f"loss_fn returned {type(out).__name__} for micro-batch {index}; it must return (loss_sum, n_items): "
            "the summed loss over the valid items and how many there are"
        )
    loss_sum, n = out
    if not isinstance(loss_sum, torch.Tensor):
        raise ConfigError(
            f"loss_fn's loss_sum is a {type(loss_sum).__name__}, not a tensor (micro-batch {index})"
        )
    if loss_sum.dim() != 0:
        raise ConfigError(
            f"loss_fn returned a loss of shape {tuple(loss_sum.shape)} for micro-batch {index}; it must be a "
            "scalar: the SUM of the per-item losses (e.g. cross_entropy(..., reduction='sum'))"
        )
    if not loss_sum.requires_grad:
        raise ConfigError(
            f"loss_fn's loss for micro-batch {index} does not require grad; compute it from the model's output "
            "with autograd enabled (not under torch.no_grad())"
        )
    return loss_sum, _as_number("loss_fn's n_items", n)


def accumulate(
    model: Any,
    batch: Batch,
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    count_fn: CountFn | None = None,
    noise: GradientNoiseScale | None = None,
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

    ``noise`` (a :class:`microbatch.run.noise.GradientNoiseScale`) measures the gradient noise scale from
    the first micro-batch's gradient and the whole batch's, with no extra backward.
    """
    return accumulate_micro_batches(
        model, split(batch, micro_batch_size), loss_fn, count_fn=count_fn, noise=noise
    )


def accumulate_micro_batches(
    model: Any,
    micro_batches: Sequence[Batch],
    loss_fn: LossFn,
    *,
    count_fn: CountFn | None = None,
    noise: GradientNoiseScale | None = None,
) -> torch.Tensor:
    """:func:`accumulate` over micro-batches already split (e.g. by :func:`split_by_tokens`)."""
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ConfigError("no micro-batches to accumulate; give at least one")
    group, world = _group_and_world(model)
    params = [p for p in model.parameters() if p.requires_grad]

    # Known before any gradient moves: the scale (with count_fn), or zero items (ConfigError, no harm).
    counted: float | None = None
    scale = 1.0
    if count_fn is not None:
        counted = count_items(micro_batches, count_fn, model=model)
        scale = loss_scale(counted, model=model)

    # Set the old gradients aside: keep a copy, zero in place (tensor identity kept, which DDP's
    # gradient-as-bucket-view relies on). This call then accumulates only its own gradient.
    saved = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    had_grad = [s is not None for s in saved]
    for p, s in zip(params, saved, strict=True):
        if s is not None:
            p.grad.zero_()
    try:
        losses: list[torch.Tensor] = []
        counts: list[Any] = []
        # (items, |g_small|²) of the first micro-batch, for the noise scale
        small: tuple[float, float] | None = None
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            with sync_unless_last(model, i == last):
                loss_sum, n = _check_loss(loss_fn(model, mb), i)
                # Tensor.backward carries no annotations in torch's stubs (it dispatches __torch_function__).
                (loss_sum * scale if scale != 1.0 else loss_sum).backward()  # type: ignore[no-untyped-call]
            losses.append(loss_sum.detach())
            counts.append(n)
            if noise is not None and i == 0 and last > 0:
                n_small = _to_float(n)
                if n_small > 0:
                    small = (n_small, grad_sq_norm(params) / (scale * n_small) ** 2)

        # Global sums of the loss and the items (one small all_reduce under DDP).
        loss_total, n_total = _total(losses), _total(counts)
        if world > 1:
            dev = _device(model)
            sums = torch.stack(
                [
                    torch.as_tensor(loss_total, dtype=torch.float64, device=dev).reshape(()),
                    torch.as_tensor(n_total, dtype=torch.float64, device=dev).reshape(()),
                ]
            )
            torch.distributed.all_reduce(sums, group=group)
            loss_global, n_global = float(sums[0]), float(sums[1])
        else:
            loss_global, n_global = _to_float(loss_total), _to_float(n_total)
        if count_fn is None:
            if not n_global > 0:
                raise ConfigError(
                    f"the whole batch has {n_global:g} valid items; the mean loss needs at least one (check the "
                    "labels: are they all -100?)"
                )
            # The gradients hold ∇Σloss_sum (averaged over ranks by DDP): rescale to the mean.
            rescale = world / n_global
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(rescale)
        elif counted is not None and abs(n_global - counted) > 1e-9 * max(1.0, counted):
            raise ConfigError(
                f"count_fn counted {counted:g} items but loss_fn reported {n_global:g}; they must count the "
                "same valid items (e.g. both (labels != -100).sum(), after the same shift)"
            )
        if noise is not None:
            _noise_update(noise, small, n_global, grad_sq_norm(params), group, world, _device(model))
    except BaseException:
        for p, s, had in zip(params, saved, had_grad, strict=True):
            if had and p.grad is not None:
                p.grad.copy_(s)
            elif had:
                p.grad = s
            else:
                p.grad = None
        raise
    for p, s in zip(params, saved, strict=True):
        if s is not None:
            p.grad.add_(s)
    return torch.tensor(loss_global / n_global, dtype=losses[0].dtype, device=losses[0].device)


def _noise_update(
    noise: GradientNoiseScale,
    small: tuple[float, float] | None,
    n_big: float,
    g_big_sq: float,
    group: Any,
    world: int,
    device: torch.device,
) -> None:
    """Feed this step's unbiased |G|² and tr(Σ) estimates (averaged over ranks) to ``noise``.

    ``small`` is ``(items, |g_small|²)`` of this rank's first micro-batch, or None when it has none
    usable (one micro-batch, or zero items in it). Under DDP every rank joins one small all_reduce.
    """
    est = [0.0, 0.0, 0.0]
    if small is not None and n_big > small[0]:
        n_small, g_small_sq = small
        est = [
            g_sq_estimate(b_small=n_small, g_small_sq=g_small_sq, b_big=n_big, g_big_sq=g_big_sq),
            trace_sigma_estimate(b_small=n_small, g_small_sq=g_small_sq, b_big=n_big, g_big_sq=g_big_sq),
            1.0,
        ]
    if world > 1:
        t = torch.tensor(est, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, group=group)
        est = [float(x) for x in t]
        if est[2] > 0:
            est = [est[0] / est[2], est[1] / est[2], 1.0]
    if est[2] > 0:
        noise.add_estimates(g_sq=est[0], trace_sigma=est[1])
