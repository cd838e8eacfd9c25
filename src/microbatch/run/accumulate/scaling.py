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
import numbers
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from microbatch.errors import ConfigError
from microbatch.run.accumulate.microbatches import Batch

__all__ = [
    "check_callables",
    "check_loss",
    "CountFn",
    "count_items",
    "loss_scale",
    "sync_unless_last",
    "is_ddp",
    "is_fsdp",
    "uncompiled",
    "grad_sq_norm",
    "group_and_world",
    "model_device",
    "as_number",
    "checked_counts",
    "to_mean",
    "total_of",
    "to_float",
    "check_params_in_model",
]

CountFn = Callable[[Batch], "int | float | torch.Tensor"]


def uncompiled(model: Any) -> Any:
    """``model`` under any ``torch.compile`` wrappers (``OptimizedModule._orig_mod``): ``torch.compile(DDP(m))``, the
    order torch's DDP notes give, is a DDP whose ``no_sync`` and process group accumulate needs (a review,
    2026-12-08: seen as one process, it all-reduced every micro-batch with the wrong scale and the ranks drifted
    apart, or hung where they ran different numbers of micro-batches)."""
    while type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), torch.nn.Module
    ):
        model = model._orig_mod
    return model


def is_ddp(model: Any) -> bool:
    """True when ``model`` is a ``torch.nn.parallel.DistributedDataParallel`` (under any ``torch.compile``)."""
    return isinstance(uncompiled(model), torch.nn.parallel.DistributedDataParallel)


_FSDP = {"FSDPModule", "FullyShardedDataParallel"}
"""The class names FSDP2's ``fully_shard`` and the older wrapper give a module (checked by name: no import)."""


def is_fsdp(model: Any) -> bool:
    """True when ``model`` is sharded by FSDP (``fully_shard`` or the older wrapper): it reduces every backward's
    gradients across the ranks, the first micro-batch's too."""
    return bool(_FSDP & {c.__name__ for c in type(uncompiled(model)).__mro__})


def _distributed() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def group_and_world(model: Any) -> tuple[Any, int]:
    """(process group, world size) over which ``model``'s gradients are averaged; ``(None, 1)`` for one process.

    DDP and FSDP's older wrapper: their ``process_group``. FSDP2 (``fully_shard`` applied to the root module):
    the one-dimensional device mesh of its parameters, whose reduce-scatter averages like DDP's all-reduce
    (torch's default gradient divide factor, the mesh size). A two-dimensional mesh (HSDP, or FSDP with tensor
    parallelism) averages over only some of its ranks: ConfigError, since the counts would be summed over
    the wrong ranks.
    """
    model = uncompiled(model)
    if is_ddp(model):
        group = getattr(model, "process_group", None)
        return group, torch.distributed.get_world_size(group)
    kinds = {c.__name__ for c in type(model).__mro__}
    if not kinds & _FSDP:
        if (
            _distributed()  # no FSDP module exists without a process group: one walk of the modules only then
            and hasattr(model, "modules")
            and any(_FSDP & {c.__name__ for c in type(m).__mro__} for m in model.modules())
        ):
            raise ConfigError(
                "this model shards some of its modules with FSDP but not its root: the root's own parameters are "
                "never reduced and accumulate cannot see the ranks; apply fully_shard (or the FSDP wrapper) to the "
                "root module too"
            )
        return None, 1
    if "FullyShardedDataParallel" in kinds:
        if "HYBRID" in str(getattr(model, "sharding_strategy", "")):
            raise ConfigError(
                f"FSDP with {model.sharding_strategy} averages over the shard and the replicate groups; accumulate "
                "sums the valid items over one group only; use FULL_SHARD or SHARD_GRAD_OP, or scale the losses "
                "yourself with count_items and loss_scale"
            )
        group = model.process_group
        return group, torch.distributed.get_world_size(group)
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is None:
        return None, 1
    if mesh.ndim != 1:
        raise ConfigError(
            f"this FSDP model's parameters live on a {mesh.ndim}-D device mesh {tuple(mesh.shape)} (HSDP, or FSDP "
            "with tensor parallelism); accumulate sums the valid items over the data-parallel ranks only on a 1-D "
            "mesh; shard over a 1-D mesh, or scale the losses yourself with count_items and loss_scale"
        )
    return mesh.get_group(), mesh.size()


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
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"{name} must be a number or a 1-element tensor, got {type(value).__name__} {value!r}; return an int "
            "(len(rows)), a float or a tensor such as (labels != -100).sum()"
        )
    count: int | float = (
        int(value) if isinstance(value, numbers.Integral) else float(value)
    )  # NumPy's as Python's
    if not math.isfinite(count) or count < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {count!r}")
    return count


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
    values = [as_number("count_fn(micro_batch)", count_fn(mb)) for mb in micro_batches]
    checked_counts("count_fn(micro_batch)", values)
    total = total_of(values)
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
        no_sync: contextlib.AbstractContextManager[object] = uncompiled(model).no_sync()
        return no_sync
    return contextlib.nullcontext()


def grad_sq_norm(parameters: Iterable[torch.Tensor]) -> float:
    """Σ |p.grad|² over ``parameters`` (float64), skipping parameters without a gradient; a sparse gradient
    (``nn.Embedding(sparse=True)``) by its coalesced values (a row looked up twice is summed first)."""
    total = 0.0
    for p in parameters:
        g = p.grad
        if g is not None:
            g = g.coalesce().values() if g.is_sparse else g
            total += float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2)
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
    if is_ddp(model):
        model = uncompiled(model)
        if not getattr(model, "require_backward_grad_sync", True):
            raise ConfigError(
                "accumulate was called inside DDP's no_sync(): it syncs the step itself, once, and a gradient left "
                "from a call under no_sync is never all-reduced (the ranks drift apart); call accumulate once per "
                "optimizer step with the whole batch, outside no_sync (or accumulate_micro_batches with its pieces); "
                "inside Accelerate's accelerator.accumulate(model), which enters no_sync on several processes, give "
                "Accelerator(gradient_accumulation_steps=1) and let accumulate split the batch"
            )
        if getattr(model, "static_graph", False):
            raise ConfigError(
                "DistributedDataParallel(static_graph=True) cannot skip the all-reduce of the micro-batches before "
                "the last (torch's reducer asserts under no_sync); wrap the model without static_graph=True"
            )


def check_loss(
    out: Any, index: int, params: Sequence[Any] | None = None, checked: Callable[[], None] | None = None
) -> tuple[torch.Tensor, int | float | torch.Tensor]:
    """``(loss_sum, n_items)`` of ``loss_fn``'s return for micro-batch ``index``; ConfigError for anything else, and
    (given the model's ``params``: the step's first micro-batch) for a loss on parameters the model lacks
    (:func:`check_params_in_model`; ``checked`` is called once it passes, :func:`params_once`)."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ConfigError(
            f"loss_fn returned {type(out).__name__} for micro-batch {index}; it must return (loss_sum, n_items): "
            "the summed loss over the valid items and how many there are"
        )
    loss_sum, n = out
    if not isinstance(loss_sum, torch.Tensor):
        swapped = " (the two look swapped)" if isinstance(n, torch.Tensor) else ""
        raise ConfigError(
            f"loss_fn's loss_sum is a {type(loss_sum).__name__}, not a tensor (micro-batch {index}){swapped}; return "
            "(loss_sum, n_items) in that order: the summed loss tensor first, then the count of its items"
        )
    if loss_sum.dim() != 0:
        raise ConfigError(
            f"loss_fn returned a loss of shape {tuple(loss_sum.shape)} for micro-batch {index}; it must be a "
            "scalar: the SUM of the per-item losses (e.g. cross_entropy(..., reduction='sum'))"
        )
    if not loss_sum.requires_grad:
        if params is not None and not any(p.requires_grad for p in params):
            raise ConfigError(
                "the model has no parameter that requires grad (every one frozen): there is no gradient to "
                "accumulate; unfreeze the parameters to train (p.requires_grad_(True))"
            )
        raise ConfigError(
            f"loss_fn's loss for micro-batch {index} does not require grad; compute it from the model's output "
            "with autograd enabled (not under torch.no_grad())"
        )
    if params is not None:
        check_params_in_model(loss_sum, params)
        if checked is not None:
            checked()
    return loss_sum, as_number("loss_fn's n_items", n)


_PARAMS_CHECKED: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, set[int]]]] = weakref.WeakKeyDictionary()
"""Per model, the loss functions its parameter check passed for, by id with a reference that says the id still
names them — a function, or a bound method's object with its function's id (the method object is made anew at each
attribute access): weak where the object allows it (a new lambda at a dead one's address is checked again), else
strong (a class with ``__slots__`` and no ``__weakref__``). Unhashable callables (a dataclass's instances) are held
too: the walk runs once per loss function, not every step."""


def params_once(model: Any, loss_fn: Any, params: Sequence[Any]) -> tuple[Sequence[Any] | None, Any]:
    """``(params, mark)`` for :func:`check_loss` the first time ``loss_fn`` runs on ``model`` (``mark`` records the
    check passed), ``(None, None)`` after: :func:`check_params_in_model` walks the whole graph, once is enough."""
    owner, func = getattr(loss_fn, "__self__", None), getattr(loss_fn, "__func__", None)
    holder, token = (owner, id(func)) if owner is not None and func is not None else (loss_fn, 0)
    try:
        table = _PARAMS_CHECKED.setdefault(model, {})
    except TypeError:  # the model not weakly referable: checked every step
        return params, None
    entry = table.get(id(holder))
    if entry is None or _held(entry[0]) is not holder:  # new, or a dead one's address reused
        for key in [k for k, (ref, _) in table.items() if _held(ref) is None]:
            del table[key]  # the dead ones (a lambda a step) go as the next one comes
        try:
            ref: Any = weakref.ref(holder)
        except TypeError:
            ref = holder
        entry = table[id(holder)] = (ref, set())
    done = entry[1]
    return (None, None) if token in done else (params, lambda: done.add(token))


def _held(ref: Any) -> Any:
    """The object an entry of :data:`_PARAMS_CHECKED` holds (None once a weakly held one died)."""
    return ref() if isinstance(ref, weakref.ref) else ref


def check_params_in_model(loss: torch.Tensor, params: Sequence[Any]) -> None:
    """ConfigError, before any backward, when ``loss`` depends on a trainable ``nn.Parameter`` that is not among
    ``params`` (the model's): the call scales, restores and (under DDP) reduces the model's gradients only, so such a
    parameter (a loss module's learnable temperature passed beside the model) would gain the gradient of the summed
    loss, B times the mean's, and keep a failed attempt's part after an out-of-memory split. Walks the loss's autograd
    graph once (the caller: the step's first micro-batch)."""
    if any(type(p).__name__ == "DTensor" for p in params):
        return  # FSDP2 or DTensor TP: the graph's leaves are the gathered copies FSDP2 swaps in, not these
    mine = {id(p) for p in params}
    seen: dict[int, Any] = {}  # the nodes held, so that no id is reused by a wrapper made later in the walk
    stack = [loss.grad_fn]
    outside: list[torch.Tensor] = []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that gets a .grad
        if (
            isinstance(var, torch.nn.Parameter)
            and id(var) not in mine
            and type(var).__name__ != "FlatParameter"
        ):
            outside.append(var)
        stack.extend(nxt for nxt, _ in node.next_functions)
    if outside:
        shapes = ", ".join(str(tuple(p.shape)) for p in outside[:4]) + (", ..." if len(outside) > 4 else "")
        raise ConfigError(
            f"loss_fn's loss depends on {len(outside)} trainable parameter(s) that are not the model's (shapes "
            f"{shapes}): only the model's gradients are normalised to the batch mean and restored on an error, so "
            "theirs would be wrong; make them part of the model (a submodule holding the loss's parameters), "
            "pass a module that holds both, or, if they are not trained by this step (a GAN's discriminator in the "
            "generator's step), freeze them for it (discriminator.requires_grad_(False), and True again after)"
        )


def checked_counts(name: str, values: Sequence[Any]) -> list[float]:
    """``values`` (item counts: numbers, 1-element tensors) as floats, each finite and >= 0, else a ConfigError naming
    the micro-batch: :func:`as_number` checks a number as it comes and leaves a tensor on its device (no wait per
    micro-batch); the tensors are read back here in one transfer, before their total is used."""
    counts = _floats(values)
    for i, n in enumerate(counts):
        if not (math.isfinite(n) and n >= 0):
            raise ConfigError(
                f"{name} must be a finite number >= 0, got {n:g} (a tensor) for micro-batch {i}; count the valid "
                "items, e.g. (labels != -100).sum()"
            )
    return counts


def _floats(values: Sequence[Any]) -> list[float]:
    """Numbers and 1-element tensors as floats, the tensors read back in one transfer (one wait for the device,
    not one per micro-batch) where they share a device."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    try:
        read = iter(torch.stack([t.to(torch.float64) for t in tensors]).tolist())
    except RuntimeError:  # on several devices: one read each
        read = iter([to_float(t) for t in tensors])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def to_mean(
    params: list[Any],
    count_fn: CountFn | None,
    counted: float | None,
    n_global: float,
    average: int,
    applied: float = 1.0,
) -> None:
    """Without ``count_fn``, rescale ∇Σloss_sum (the sums multiplied by ``applied`` before their backward) to the
    mean over ``n_global`` items; with it, check that the items counted before match those the losses reported."""
    if count_fn is None:
        if not n_global > 0:
            raise ConfigError(
                f"the whole batch has {n_global:g} valid items; the mean loss needs at least one (check the "
                "labels: are they all -100?)"
            )
        # The gradients hold ∇Σloss_sum (averaged over ranks by DDP): rescale to the mean.
        rescale = average / (n_global * applied)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(rescale)
    elif counted is not None and abs(n_global - counted) > 1e-9 * max(1.0, counted):
        raise ConfigError(
            f"count_fn counted {counted:g} items but loss_fn reported {n_global:g}; they must count the "
            "same valid items (e.g. both (labels != -100).sum(), after the same shift)"
        )
