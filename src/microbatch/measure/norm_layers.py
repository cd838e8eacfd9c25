"""Layers whose forward depends on the rows it sees together, so that micro-batching changes what the model computes.

:func:`norm_layers_warning` says, once per call, what no redo can change: a BatchNorm using batch statistics (in
training mode, or always without running stats) normalises each micro-batch by its own statistics, and a spectral
norm in training mode runs one power iteration per forward, so each micro-batch sees another normalised weight:
accumulated micro-batches are not the full batch (the gradient depends on b_m). InstanceNorm normalises each
sample alone: exact, no warning. Pure bookkeeping; torch is imported on use.

Read by :mod:`microbatch.run.accumulate` (a warning when a batch runs in smaller micro-batches) and by
:mod:`microbatch.choose.tune` (a note: the knee's b_m changes the training, not only its speed).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = [
    "batch_statistics",
    "norm_layers",
    "spectral_norms",
    "norm_layers_warning",
    "warn_norm_layers",
    "tune_note",
]


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


def batch_statistics(model: Any) -> list[Any]:
    """BatchNorm-kin layers that normalise by the batch's statistics now: in training mode, or without running
    statistics (then in eval mode too, as ``F.batch_norm`` is called)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    if not hasattr(model, "modules"):
        return []
    return [
        m for m in model.modules() if isinstance(m, _BatchNorm) and (m.training or not m.track_running_stats)
    ]


def norm_layers_warning(model: Any, micro_rows: int | None, batch_rows: int | None) -> str | None:
    """The warning for layers whose forward depends on the rows it sees together (BatchNorm on batch statistics,
    a spectral norm iterating in training mode) when the batch runs in micro-batches smaller than itself; with the
    row counts None, for any micro-batch size (``tune``'s note: every b_m it measures trains differently)."""
    if micro_rows is not None and batch_rows is not None and micro_rows >= batch_rows:
        return None
    batch_norms = batch_statistics(model)
    spectral = [m for m, _ in spectral_norms(model) if m.training]
    if not batch_norms and not spectral:
        return None
    parts = []
    if batch_norms:
        parts.append(
            f"{len(batch_norms)} {type(batch_norms[0]).__name__} layer(s) normalise each micro-batch"
            + (f" of {micro_rows} rows" if micro_rows is not None else "")
            + " by its own statistics, not the "
            + (f"{batch_rows}-row batch's" if batch_rows is not None else "whole batch's")
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
    exact = "not exact" if micro_rows is not None else "accumulating g micro-batches is not the whole batch"
    return (
        "; ".join(parts)
        + f": the accumulated gradient depends on the micro-batch size ({exact}); "
        + "; ".join(fixes)
        + "; or use micro-batches of the whole batch"
    )


def warn_norm_layers(model: Any, micro_rows: int, batch_rows: int) -> None:
    """:func:`norm_layers_warning` as a ``UserWarning`` (Python shows it once per place)."""
    text = norm_layers_warning(model, micro_rows, batch_rows)
    if text is not None:
        warnings.warn(text, stacklevel=3)


def tune_note(model: Any) -> str | None:
    """``tune``'s note for a model whose training depends on b_m (:func:`norm_layers_warning` for any micro-batch):
    the knee is the fastest b_m, but unlike elsewhere it also changes what a step computes."""
    text = norm_layers_warning(model, None, None)
    if text is None:
        return None
    return "b_m changes this model's training, not only its speed: " + text
