"""What a redone step must find as the failed attempt found it: the random streams and the running statistics.

An attempt that runs out of memory has already run some forwards. Each drew random numbers (dropout masks)
and each BatchNorm forward in training mode updated its running mean, variance and batch count. Redone as
it was, the step would draw other masks and count those statistics twice: its gradient would be that of
another step. :class:`StepState` takes the random states (the CPU generator's and, where CUDA is
initialised, every CUDA device's) and the normalisation layers' running buffers (modules of
``torch.nn.modules.batchnorm._NormBase``: BatchNorm, SyncBatchNorm, InstanceNorm with running stats)
before the first attempt and puts them back before each redo; on the CPU the redone step's masks are
then those of a clean run at the smaller size (the CPU generator fills b rows twice as it fills 2b
once), and on a GPU the step is as reproducible as a clean run. Other buffers a forward rewrites (an
exponential moving average kept by a custom module) are not taken: name them in a bug report.

:func:`norm_layers_warning` says, once per call, what no redo can change: a BatchNorm in training mode
normalises each micro-batch by its own statistics, so accumulated micro-batches are not the full batch
(the gradient depends on b_m). Pure bookkeeping; torch is imported on use.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["StepState", "norm_layers", "norm_layers_warning", "warn_norm_layers"]


def norm_layers(model: Any) -> list[Any]:
    """The modules of ``model`` that keep running statistics in training mode (BatchNorm and kin)."""
    from torch.nn.modules.batchnorm import _NormBase

    if not hasattr(model, "modules"):
        return []
    return [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]


class StepState:
    """The random states and normalisation buffers at the start of a step (:meth:`take`), put back by
    :meth:`restore` before a redo."""

    def __init__(self, cpu_rng: Any, cuda_rng: list[Any] | None, buffers: list[tuple[Any, Any]]) -> None:
        self._cpu_rng = cpu_rng
        self._cuda_rng = cuda_rng
        self._buffers = buffers

    @classmethod
    def take(cls, model: Any) -> StepState:
        import torch

        started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all() if started else None
        buffers = [
            (b, b.detach().clone())
            for m in norm_layers(model)
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]
        return cls(torch.get_rng_state(), cuda, buffers)

    def restore(self) -> None:
        import torch

        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        with torch.no_grad():
            for live, saved in self._buffers:
                live.copy_(saved)


def norm_layers_warning(model: Any, micro_rows: int, batch_rows: int) -> str | None:
    """The warning for a BatchNorm in training mode when the batch runs in micro-batches smaller than itself."""
    if micro_rows >= batch_rows:
        return None
    training = [m for m in norm_layers(model) if m.training]
    if not training:
        return None
    name = type(training[0]).__name__
    return (
        f"{len(training)} {name} layer(s) in training mode normalise each micro-batch of {micro_rows} rows by its "
        f"own statistics, not the {batch_rows}-row batch's: the accumulated gradient depends on the micro-batch "
        "size (not exact); use GroupNorm or LayerNorm, freeze the norm layers' statistics (norm.eval()), or "
        "micro-batches of the whole batch"
    )


def warn_norm_layers(model: Any, micro_rows: int, batch_rows: int) -> None:
    """:func:`norm_layers_warning` as a ``UserWarning`` (Python shows it once per place)."""
    text = norm_layers_warning(model, micro_rows, batch_rows)
    if text is not None:
        warnings.warn(text, stacklevel=3)
