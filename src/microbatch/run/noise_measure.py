"""Measuring the gradient noise scale over batches: :func:`measure_noise_scale`.

It joins the two rooms below it without making them import each other: the arithmetic of
:mod:`microbatch.run.noise` (estimators and smoothing, no torch) and the gradients of
:mod:`microbatch.run.accumulate` (its ``noise=`` hook takes the first micro-batch's gradient
norm and the whole batch's in the same backward passes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from microbatch.errors import ConfigError
from microbatch.run.accumulate import LossFn, accumulate
from microbatch.run.microbatches import Batch, batch_rows
from microbatch.run.noise import GradientNoiseScale, NoiseEstimate
from microbatch.run.scaling import CountFn

__all__ = ["measure_noise_scale"]


def measure_noise_scale(
    model: Any,
    batches: Iterable[Batch],
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    count_fn: CountFn | None = None,
    decay: float = 1.0,
    step_fn: Callable[[], object] | None = None,
) -> tuple[NoiseEstimate, list[NoiseEstimate]]:
    """Run :func:`microbatch.run.accumulate.accumulate` over ``batches`` (one per step) and estimate B_simple.

    Gradients are cleared (set to None) before each step; ``step_fn`` (e.g. ``optimizer.step``)
    runs after each, if given. Returns the final smoothed estimate and the one after every step.
    Each batch needs at least two micro-batches.
    """
    hook = GradientNoiseScale(decay=decay)
    history: list[NoiseEstimate] = []
    for batch in batches:
        rows = batch_rows(batch)
        if rows <= micro_batch_size:
            raise ConfigError(
                f"a batch of {rows} rows with micro-batch {micro_batch_size} is one micro-batch; the noise "
                "scale needs two batch sizes: use a micro-batch smaller than the global batch"
            )
        for p in model.parameters():
            p.grad = None
        accumulate(model, batch, loss_fn, micro_batch_size=micro_batch_size, count_fn=count_fn, noise=hook)
        if step_fn is not None:
            step_fn()
        estimate = hook.estimate
        if estimate is not None and hook.steps > len(history):
            history.append(estimate)
    if not history:
        raise ConfigError("no step gave a noise estimate; give at least one batch with two micro-batches")
    return history[-1], history
