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
clean run.

Any other buffer a forward rewrites (a quantisation observer's min/max, an exponential moving average, a MoCo
queue, a step counter) is taken too: in a model's first step every other buffer, where they hold at most
:data:`FIRST_STEP_BYTES` together; after it, those whose version counter (or whose tensor, where a forward
assigns a new one) has moved between two steps' starts (once seen moving, always). One the step did not take and the failed attempt changed (a
first step's buffers over the cap) cannot be put back: a warning names it.

:func:`~microbatch.measure.norm_layers.norm_layers_warning` (re-exported here) says what no redo can change.
"""

from __future__ import annotations

import warnings
import weakref
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


FIRST_STEP_BYTES = 64 * 2**20
"""The most bytes of other buffers a model's first step copies (before any step has shown which a forward
rewrites): copies held beside the activations of a step that may be near the device's memory. A MoCo queue of
65,536 keys × 128 fp32 values is 32 MiB; a causal mask of 2,048² bytes 4 MiB; rotary tables well under 1 MiB."""

_SEEN: weakref.WeakKeyDictionary[Any, tuple[dict[tuple[int, str], tuple[int, int]], set[tuple[int, str]]]] = (
    weakref.WeakKeyDictionary()
)
"""Each model's other buffers at its last step's start, (module id, name) -> (tensor id, version counter), and those
seen moving between two steps' starts."""


def _initialised(tensor: Any) -> bool:
    from torch.nn.parameter import UninitializedBuffer

    return tensor is not None and not isinstance(tensor, UninitializedBuffer)


class StepState:
    """The random states and the buffers a forward rewrites at the start of a step (:meth:`take`), put back by
    :meth:`restore` before a redo."""

    def __init__(
        self,
        cpu_rng: Any,
        cuda_rng: list[Any] | None,
        buffers: list[tuple[Any, Any]],
        lazy: list[Any],
        others: tuple[list[tuple[Any, str, Any, Any]], list[tuple[Any, str, Any, int]]] = ([], []),
    ) -> None:
        self._cpu_rng = cpu_rng
        self._cuda_rng = cuda_rng
        self._buffers = buffers
        self._lazy = lazy
        self._others, self._unkept = (
            others  # (module, name, tensor, copy) taken; (module, name, tensor, version) not
        )
        owners = {id(m): m for m, *_ in self._others}
        self._plain = [(m, _plain_attributes(m)) for m in owners.values()]

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
        taken = [(b, b.detach().clone()) for b in running + vectors]
        return cls(torch.get_rng_state(), cuda, taken, lazy, _other_buffers(model, {id(b) for b, _ in taken}))

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
            for module, name, live, saved in self._others:
                # a copy of the copy goes back, never the copy itself: a redo that writes the buffer in place would
                # write into it, and a second restore would put back the failed redo's values
                if (
                    module._buffers.get(name) is not live
                ):  # the forward assigned a new tensor: the old goes back
                    module._buffers[name] = saved.clone()
                elif live.shape == saved.shape and live.dtype == saved.dtype:
                    live.copy_(saved)
                else:  # resized in place (a per-channel observer's min/max start empty)
                    live.set_(saved.clone())
            for module, plain in self._plain:  # and what the module keeps beside them (a cache's length)
                module.__dict__.update(plain)
        moved = [n for m, n, live, v in self._unkept if m._buffers.get(n) is not live or live._version != v]
        if moved:
            warnings.warn(
                f"the attempt that ran out of memory changed the buffer(s) {', '.join(moved[:5])}, which a model's "
                f"first step does not copy beyond {FIRST_STEP_BYTES // 2**20} MiB of buffers: the redo updates them "
                "again (counted twice); later steps copy the buffers a forward changes",
                stacklevel=4,
            )


def _plain_attributes(module: Any) -> dict[str, Any]:
    """The module's own attributes that are plain values (numbers, strings, None): what a forward may change beside
    a buffer it rewrites (Hugging Face's dynamic rotary embedding grows ``inv_freq`` and sets ``max_seq_len_cached``;
    a redo that found the length but the old frequencies would not rebuild them)."""
    return {k: v for k, v in vars(module).items() if v is None or isinstance(v, (bool, int, float, str))}


def _other_buffers(
    model: Any, taken: set[int]
) -> tuple[list[tuple[Any, str, Any, Any]], list[tuple[Any, str, Any, int]]]:
    """The model's buffers other than ``taken`` (ids), split into those copied now (module, name, tensor, copy) and
    those only watched (module, name, tensor, version): see the module's docstring; remembers this step's versions."""
    found, seen = [], set(taken)
    for module in model.modules() if hasattr(model, "modules") else []:
        for name, b in module._buffers.items():
            if _initialised(b) and id(b) not in seen:
                seen.add(id(b))
                found.append((module, name, b))
    now = {(id(m), name): (id(b), b._version) for m, name, b in found}
    try:
        last, moving = _SEEN.get(model, (None, set()))
        if last is not None:
            moving |= {key for key, seen in now.items() if last.get(key) != seen}
        _SEEN[model] = (now, moving)
    except TypeError:  # not weakly referable: every step is a first step
        last, moving = None, set()
    if last is None:
        small = sum(b.numel() * b.element_size() for _, _, b in found) <= FIRST_STEP_BYTES
        copy = found if small else []
    else:
        copy = [(m, name, b) for m, name, b in found if (id(m), name) in moving]
    chosen = {id(b) for _, _, b in copy}
    kept = [(m, name, b, b.detach().clone()) for m, name, b in copy]
    watched = [(m, name, b, b._version) for m, name, b in found if id(b) not in chosen]
    return kept, watched


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
