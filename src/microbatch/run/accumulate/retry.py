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

:func:`norm_layers_warning` says, once per call, what no redo can change: a BatchNorm using batch statistics (in
training mode, or always without running stats) normalises each micro-batch by its own statistics, and a spectral
norm in training mode runs one power iteration per forward, so each micro-batch sees another normalised weight:
accumulated micro-batches are not the full batch (the gradient depends on b_m). InstanceNorm normalises each
sample alone: exact, no warning. Pure bookkeeping; torch is imported on use.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["StepState", "norm_layers", "spectral_norms", "norm_layers_warning", "warn_norm_layers"]


def norm_layers(model: Any) -> list[Any]:
    """The modules of ``model`` that keep running statistics in training mode (BatchNorm, InstanceNorm and kin)."""
    from torch.nn.modules.batchnorm import _NormBase

    if not hasattr(model, "modules"):
        return []
    return [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]


def spectral_norms(model: Any) -> list[tuple[Any, list[Any]]]:
    """(module, its power-iteration vectors) for each spectral norm in ``model``: the parametrization's
    ``_SpectralNorm`` modules (``_u``, ``_v``) and the modules carrying the older forward pre-hook
    (``<name>_u``, ``<name>_v``); both iterate in a forward where that module is in training mode."""
    import importlib

    from torch.nn.utils import parametrizations

    old_style = importlib.import_module(
        "torch.nn.utils.spectral_norm"
    )  # the module: the package's name is the function

    if not hasattr(model, "modules"):
        return []
    param_cls = getattr(parametrizations, "_SpectralNorm", None)
    hook_cls = getattr(old_style, "SpectralNorm", None)
    found = []
    for m in model.modules():
        if param_cls is not None and isinstance(m, param_cls):
            if hasattr(m, "_u"):  # a 1-D weight is only scaled by its norm: no vectors, no iteration
                found.append((m, [m._u, m._v]))
            continue
        for hook in getattr(m, "_forward_pre_hooks", {}).values():
            if hook_cls is not None and isinstance(hook, hook_cls):
                found.append((m, [getattr(m, hook.name + "_u"), getattr(m, hook.name + "_v")]))
    return found


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


def _batch_statistics(model: Any) -> list[Any]:
    """BatchNorm-kin layers that normalise by the batch's statistics now: in training mode, or without running
    statistics (then in eval mode too, as ``F.batch_norm`` is called)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    if not hasattr(model, "modules"):
        return []
    return [
        m for m in model.modules() if isinstance(m, _BatchNorm) and (m.training or not m.track_running_stats)
    ]


def norm_layers_warning(model: Any, micro_rows: int, batch_rows: int) -> str | None:
    """The warning for layers whose forward depends on the rows it sees together (BatchNorm on batch statistics,
    a spectral norm iterating in training mode) when the batch runs in micro-batches smaller than itself."""
    if micro_rows >= batch_rows:
        return None
    batch_norms = _batch_statistics(model)
    spectral = [m for m, _ in spectral_norms(model) if m.training]
    if not batch_norms and not spectral:
        return None
    parts = []
    if batch_norms:
        parts.append(
            f"{len(batch_norms)} {type(batch_norms[0]).__name__} layer(s) normalise each micro-batch of {micro_rows} "
            f"rows by its own statistics, not the {batch_rows}-row batch's"
        )
    if spectral:
        parts.append(
            f"{len(spectral)} spectral norm(s) in training mode run a power iteration in each micro-batch's forward "
            "(the full batch runs one), so each micro-batch sees another normalised weight"
        )
    fixes = []
    if batch_norms:
        fixes.append(
            "use GroupNorm or LayerNorm, or freeze the norm layers' statistics (norm.eval() with running stats)"
        )
    if spectral:
        fixes.append("put the spectral norms in eval mode for all micro-batches but the first")
    return (
        "; ".join(parts)
        + ": the accumulated gradient depends on the micro-batch size (not exact); "
        + "; ".join(fixes)
        + "; or use micro-batches of the whole batch"
    )


def warn_norm_layers(model: Any, micro_rows: int, batch_rows: int) -> None:
    """:func:`norm_layers_warning` as a ``UserWarning`` (Python shows it once per place)."""
    text = norm_layers_warning(model, micro_rows, batch_rows)
    if text is not None:
        warnings.warn(text, stacklevel=3)
