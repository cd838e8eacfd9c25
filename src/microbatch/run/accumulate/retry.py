"""What a redone step must find as the failed attempt found it: the random streams and the buffers a forward rewrites.

An attempt that runs out of memory has already run some forwards. Each drew random numbers (dropout masks),
each BatchNorm forward in training mode updated its running mean, variance and batch count, and each spectral
norm in training mode ran a power iteration on its vectors. Redone as it was, the step would draw other masks
and count those statistics twice: its gradient would be that of another step. :class:`StepState` takes the
random states (the CPU generator's and, where CUDA is initialised, every CUDA device's), the normalisation
layers' running buffers (modules of ``torch.nn.modules.batchnorm._NormBase``: BatchNorm, SyncBatchNorm,
InstanceNorm with running stats; a lazy one not yet initialised is reset to its initial statistics instead) and
the spectral norms' power-iteration vectors (``torch.nn.utils.parametrizations.spectral_norm``'s ``_u``/``_v``
and the older ``torch.nn.utils.spectral_norm``'s ``<name>_u``/``<name>_v``) before the first attempt and puts
them back before each redo; on the CPU the redone step's masks are then those of a clean run at the smaller
size (the CPU generator fills b rows twice as it fills 2b once), and on a GPU the step is as reproducible as a
clean run. Other buffers a forward rewrites (an exponential moving average kept by a custom module) are not
taken: name them in a bug report.

:func:`~microbatch.measure.norm_layers.norm_layers_warning` (re-exported here) says what no redo can change.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.measure.norm_layers import norm_layers, norm_layers_warning, spectral_norms, warn_norm_layers

__all__ = [
    "StepState",
    "check_weights_kept",
    "weight_versions",
    "norm_layers",
    "spectral_norms",
    "norm_layers_warning",
    "warn_norm_layers",
]


def _initialised(tensor: Any) -> bool:
    from torch.nn.parameter import UninitializedBuffer

    return tensor is not None and not isinstance(tensor, UninitializedBuffer)


class StepState:
    """The random states and the buffers a forward rewrites at the start of a step (:meth:`take`), put back by
    :meth:`restore` before a redo."""

    def __init__(
        self, cpu_rng: Any, cuda_rng: list[Any] | None, buffers: list[tuple[Any, Any]], lazy: list[Any]
    ) -> None:
        self._cpu_rng = cpu_rng
        self._cuda_rng = cuda_rng
        self._buffers = buffers
        self._lazy = lazy

    @classmethod
    def take(cls, model: Any) -> StepState:
        import torch

        started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all() if started else None
        norms = norm_layers(model)
        running = [
            b
            for m in norms
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if _initialised(b)
        ]
        # a lazy norm not initialised yet: its first forward creates the statistics, a redo starts them anew
        lazy = [m for m in norms if not _initialised(m.running_mean)]
        vectors = [b for _, pair in spectral_norms(model) for b in pair]
        return cls(torch.get_rng_state(), cuda, [(b, b.detach().clone()) for b in running + vectors], lazy)

    def restore(self) -> None:
        import torch

        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        with torch.no_grad():
            for live, saved in self._buffers:
                live.copy_(saved)
            for m in self._lazy:
                if _initialised(m.running_mean):
                    m.reset_running_stats()


def weight_versions(params: list[Any]) -> list[int]:
    """The parameters' version counters (bumped by every in-place write), -1 for a lazy module's not yet made (its
    first forward writes it), for :func:`check_weights_kept`."""
    from torch.nn.parameter import is_lazy

    return [-1 if is_lazy(p) else p._version for p in params]


def check_weights_kept(params: list[Any], versions: list[int] | None) -> None:
    """ConfigError when every tracked parameter (two or more) changed in place during the micro-batches
    (``versions``: their counters before), as an ``optimizer.step()`` inside ``loss_fn`` changes them. Some of them
    moving is a forward's own: ``nn.Embedding(max_norm=...)`` renormalises its rows in place at each call."""
    tracked = [] if versions is None else [(p, v) for p, v in zip(params, versions, strict=True) if v >= 0]
    moved = sum(p._version != v for p, v in tracked)
    if len(tracked) >= 2 and moved == len(tracked):
        raise ConfigError(
            f"loss_fn changed all {moved} of the model's trainable parameters in place (an "
            "optimizer.step() or an in-place update inside it?): a step inside the accumulation acts on part of the "
            "gradient; return (loss_sum, n_items) from loss_fn and step the optimizer after accumulate returns"
        )
