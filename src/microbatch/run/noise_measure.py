"""Measuring the gradient noise scale over batches: :func:`measure_noise_scale`.

It joins the two rooms below it without making them import each other: the arithmetic of
:mod:`microbatch.run.noise` (estimators and smoothing, no torch) and the gradients of
:mod:`microbatch.run.accumulate` (its ``noise=`` hook takes every micro-batch's gradient
norm and the whole batch's in the same backward passes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from microbatch.errors import ConfigError
from microbatch.run.accumulate.exact import LossFn, accumulate
from microbatch.run.accumulate.microbatches import Batch
from microbatch.run.accumulate.scaling import CountFn
from microbatch.run.noise import GradientNoiseScale, NoiseEstimate

__all__ = ["NoiseInterrupted", "measure_noise_scale"]


class NoiseInterrupted(KeyboardInterrupt):
    """Ctrl-C (any ``KeyboardInterrupt``) during :func:`measure_noise_scale`,
    carrying what was measured before it: ``final`` (the smoothed estimate after the last whole
    step, None when no step finished) and ``history`` (one estimate per finished step). A caller that
    does not look at them sees the ``KeyboardInterrupt`` it expects."""

    def __init__(self, final: NoiseEstimate | None, history: list[NoiseEstimate]) -> None:
        super().__init__(f"interrupted after {len(history)} measured step(s)")
        self.final, self.history = final, history


def measure_noise_scale(
    model: Any,
    batches: Iterable[Batch],
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    count_fn: CountFn | None = None,
    decay: float = 1.0,
    step_fn: Callable[[], object] | None = None,
    on_step: Callable[[NoiseEstimate], object] | None = None,
) -> tuple[NoiseEstimate, list[NoiseEstimate]]:
    """Run :func:`microbatch.run.accumulate.accumulate` over ``batches`` (one per step) and estimate B_simple.

    Gradients are cleared (set to None) before each step; ``step_fn`` (e.g. ``optimizer.step``)
    runs after each, if given, then ``on_step`` with the estimate so far (a progress display).
    Returns the final smoothed estimate and the one after every step.
    A batch of one micro-batch (a loader's short last batch) and a step whose gradients are not finite (inf or NaN)
    give no estimate: each is skipped with a warning (``GradientNoiseScale.skip``) and the steps measured are kept.
    A Ctrl-C raises :class:`NoiseInterrupted` holding
    the estimates of the steps whose two gradient norms were taken (a step cut short before its whole
    batch's norm counts for nothing; ``accumulate`` restores its gradients).
    """
    hook = GradientNoiseScale(decay=decay)
    history: list[NoiseEstimate] = []
    try:
        _measure(model, batches, loss_fn, micro_batch_size, count_fn, (step_fn, on_step), hook, history)
    except KeyboardInterrupt as e:
        estimate = hook.estimate  # a step whose two norms were both taken counts, even if cut short after
        if estimate is not None and hook.steps > len(history):
            history.append(estimate)
            if on_step is not None:
                on_step(estimate)
        raise NoiseInterrupted(history[-1] if history else None, list(history)) from e
    if not history:
        raise ConfigError(_nothing_measured(hook, micro_batch_size))
    return history[-1], history


def _nothing_measured(hook: GradientNoiseScale, micro_batch_size: int) -> str:
    """Why no step gave an estimate, by what was skipped."""
    if hook.nonfinite:
        return (
            f"no step gave a noise estimate: {hook.nonfinite} step(s) had gradients that are not finite (inf or NaN; "
            "check the loss for NaN, or the loss scale under fp16) and "
            f"{hook.skipped - hook.nonfinite} had one micro-batch"
        )
    if hook.skipped:
        return (
            f"no step gave a noise estimate: all {hook.skipped} batch(es) held at most micro_batch_size "
            f"{micro_batch_size} rows, one micro-batch, and the noise scale needs two batch sizes: give batches "
            "larger than the micro-batch, or a smaller micro_batch_size"
        )
    return (
        "no step gave a noise estimate: batches gave no batch; give at least one batch with two micro-batches"
    )


def _measure(
    model: Any,
    batches: Iterable[Batch],
    loss_fn: LossFn,
    micro_batch_size: int,
    count_fn: CountFn | None,
    after: tuple[Callable[[], object] | None, Callable[[NoiseEstimate], object] | None],
    hook: GradientNoiseScale,
    history: list[NoiseEstimate],
) -> None:
    """The loop of :func:`measure_noise_scale`: appends each finished step's estimate to ``history``;
    ``after`` is (``step_fn``, ``on_step``)."""
    step_fn, on_step = after
    for batch in batches:
        for p in model.parameters():
            p.grad = None
        accumulate(model, batch, loss_fn, micro_batch_size=micro_batch_size, count_fn=count_fn, noise=hook)
        if step_fn is not None:
            step_fn()
        estimate = hook.estimate
        if estimate is not None and hook.steps > len(history):
            history.append(estimate)
            if on_step is not None:
                on_step(estimate)
