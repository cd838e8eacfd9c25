"""Ranks agreeing on an out-of-memory split under DDP: what the step's one ``all_reduce`` carries.

With ``on_oom="split"`` under DDP (:func:`microbatch.run.accumulate.exact.accumulate`), every micro-batch
runs under ``no_sync`` and the step's one ``all_reduce`` of the loss and item sums also carries,
in the same float64 tensor (:func:`agreement_parts`): whether this rank ran out of memory, whether
it could not set aside the gradients present before the step, its micro-batch size and that size
squared (so the check that every rank runs the same size, :func:`sizes_agree`, is exact for any
number of ranks), the most rows it ran, and one flag per parameter: whether the rank holds a
gradient for it. After the reduction every rank knows the same things, so all take the same path:
all redo the step at the same smaller size, or all raise, or all sum their gradients
(:func:`all_reduce_grads`) over the parameters some rank has a gradient for; a parameter no rank
touched keeps ``.grad = None``, as DDP leaves a globally unused parameter (``find_unused_parameters
=True``), so an optimizer such as AdamW skips it instead of decaying it.

:func:`check_can_agree` refuses, before any work, the models whose forward makes a collective of its
own (DDP broadcasting buffers, FSDP): a rank that stops early would leave the others waiting there.
"""

from __future__ import annotations

import math
from typing import Any

from microbatch.errors import ConfigError
from microbatch.run.accumulate.oom import set_aside_error
from microbatch.run.accumulate.scaling import group_and_world, is_ddp, model_device, uncompiled

__all__ = [
    "agreement_parts",
    "all_reduce_sums",
    "sizes_agree",
    "all_reduce_grads",
    "check_can_agree",
    "settle_ddp_buckets",
    "FLAGS",
    "OOM",
    "COPY_FAILED",
    "SIZE",
    "SIZE_SQ",
    "ROWS",
]

# Positions, after the loss and item sums, of what agreement_parts adds to the all_reduce tensor.
OOM, COPY_FAILED, SIZE, SIZE_SQ, ROWS = range(2, 7)
FLAGS = 7  # then one "has a gradient" flag per parameter


def agreement_parts(
    *, oom: bool, copy_failed: bool, size: int, rows: int, has_grad: list[bool]
) -> list[float]:
    """This rank's share of the all_reduce, after its loss and item sums (positions :data:`OOM` ...)."""
    return [float(oom), float(copy_failed), float(size), float(size) ** 2, float(rows)] + [
        float(h) for h in has_grad
    ]


def sizes_agree(size: int, world: int, size_sum: float, size_sq_sum: float) -> bool:
    """Whether every rank ran ``size``, from the reduced Σ size and Σ size² (exact in float64).

    Σ (x − s)² = Σ x² − 2s Σ x + n s², which is 0 only when every x equals s: so Σ x = n s and
    Σ x² = n s² hold together exactly when all ranks agree, and when they do not, every rank sees
    it (the sum alone passes a rank at the mean: 2, 4, 6 sum to 3 × 4). Sizes are whole numbers far
    below 2^26, so the float64 sums are exact.
    """
    return size_sum == world * size and size_sq_sum == world * float(size) ** 2


def all_reduce_grads(params: list[Any], used: list[bool], group: Any) -> None:
    """SUM the gradients over the ranks, in place, of the parameters some rank has one for (``used``).

    A rank without a gradient for a used parameter joins with zeros (every rank reduces the same
    tensors, in parameter order); an unused parameter is not reduced and its ``.grad`` stays None.
    """
    import torch

    works = []
    for p, u in zip(params, used, strict=True):
        if not u:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        works.append(torch.distributed.all_reduce(p.grad, group=group, async_op=True))
    for w in works:
        if w is not None:
            w.wait()


def check_can_agree(model: Any) -> None:
    """ConfigError unless every collective of the step is one the agreement places (a rank may stop early).

    DDP broadcasting buffers makes a collective in every forward; FSDP (``fully_shard`` or the older
    wrapper) gathers parameters in every forward and backward. A rank out of memory skips those, and
    the others would wait in them.
    """
    names = (
        {c.__name__ for m in model.modules() for c in type(m).__mro__} if hasattr(model, "modules") else set()
    )
    if names & {"FSDPModule", "FullyShardedDataParallel"}:
        raise ConfigError(
            "on_oom='split' does not support FSDP: it makes collectives inside every forward and backward, so a "
            "rank out of memory would leave the others waiting there; use on_oom='raise' with FSDP, or DDP"
        )
    model = uncompiled(model)
    if not is_ddp(model):
        return
    will_sync = getattr(model, "will_sync_module_buffers", None)
    if callable(will_sync) and will_sync():
        raise ConfigError(
            "this DDP model broadcasts its buffers in every forward (a collective); with on_oom='split' a rank "
            "that runs out of memory skips forwards and the others would wait there; wrap the model with "
            "DistributedDataParallel(..., forward_sync_buffers=False) (torch >= 2.13; broadcast_buffers=False before)"
        )


def settle_ddp_buckets(model: Any) -> None:
    """Let a DDP model rebuild its gradient buckets now, on every rank together, not in a later forward.

    DDP rebuilds its buckets once, in the first forward after its first synchronised backward
    (``DistributedDataParallel._pre_forward`` calls ``reducer._rebuild_buckets()``, which broadcasts the new
    bucket order from rank 0). A rank that runs out of memory before that forward (moving its micro-batch to
    the device) never makes the broadcast and the others wait in it. Called at the start of a split-mode
    step, where every rank is, it makes the same call the forward would; the forward's then finds nothing
    to do. Nothing for a model that is not DDP, or under ``torch.no_grad`` (the forward would not either)."""
    import torch

    model = uncompiled(model)
    reducer = getattr(model, "reducer", None) if is_ddp(model) else None
    rebuild = getattr(reducer, "_rebuild_buckets", None)
    if callable(rebuild) and torch.is_grad_enabled() and rebuild():
        model._has_rebuilt_buckets = True  # as DDP's _pre_forward marks it (its ZeRO overlap hook reads it)


def all_reduce_sums(
    model: Any,
    params: list[Any],
    parts: list[Any],
    agree: tuple[int, int] | None,
    reason: str | None,
    copy_failed: str | None,
) -> tuple[float, float, tuple[str, int] | None]:
    """The step's one all_reduce: the global loss sum and item count, and with ``agree`` the ranks'
    agreement; ``redo`` = (reason, the ranks' mean rows rounded up) when some rank ran out of memory,
    else the gradients are all-reduced here."""
    import torch

    group, world = group_and_world(model)
    dev = model_device(model)
    if agree is not None:
        has_grad = [p.grad is not None for p in params]
        parts = parts + agreement_parts(
            oom=reason is not None,
            copy_failed=copy_failed is not None,
            size=agree[0],
            rows=agree[1],
            has_grad=has_grad,
        )
    sums = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(()) for x in parts])
    torch.distributed.all_reduce(sums, group=group)
    sums = sums.cpu()  # one copy to the host, not one per read
    loss_global, n_global = float(sums[0]), float(sums[1])
    if agree is not None:
        if not sizes_agree(agree[0], world, float(sums[SIZE]), float(sums[SIZE_SQ])):
            raise ConfigError(
                f"ranks ran different micro-batch sizes (this rank {agree[0]}, mean "
                f"{float(sums[SIZE]) / world:g}); give every rank the same micro_batch_size or controller"
            )
        if float(sums[COPY_FAILED]) > 0:  # every rank raises: the sizes are not at fault
            raise set_aside_error(copy_failed or "on another rank", ranks=(int(sums[COPY_FAILED]), world))
        if float(sums[OOM]) > 0:  # some rank ran out of memory: every rank redoes the step
            why = f"out of memory on {int(sums[OOM])} of {world} ranks"
            return loss_global, n_global, (why, math.ceil(float(sums[ROWS]) / world))
        all_reduce_grads(params, [float(f) > 0 for f in sums[FLAGS:]], group)
    return loss_global, n_global, None
