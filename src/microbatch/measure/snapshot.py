"""Tune leaves no trace: a host copy of everything a probe changes, and its bitwise restore.

Probing the user's own step runs forward, backward and optimizer steps on the user's model: the
weights move, the optimizer gains state, gradients are left behind, the random number generators
advance, ``model.train()`` is called. :func:`leave_no_trace` takes a :class:`StateSnapshot` before
and restores it after — on return, on out-of-memory, on any exception and on ``KeyboardInterrupt``.

What is kept, and restored bitwise (``torch.equal``):

- every parameter and buffer of the model, and every parameter the optimizer steps beside it (a loss
  module's learnable temperature, a head held apart) — copied back in place, so the optimizer's
  references to the parameters stay valid;
- every such parameter's ``.grad`` (None stays None);
- the optimizer's per-parameter state (Adam's moments and step; the tensors go back to the
  device and dtype they had) and its ``param_groups`` settings (lr, betas, ...);
- the random number generators: torch's CPU generator, every CUDA device's generator (when CUDA
  is initialised), Python's ``random`` and NumPy's global generator (when NumPy is imported);
- ``training`` of every sub-module, and the mark a learning-rate scheduler reads on the optimizer
  (``_opt_called``: torch warns of a ``scheduler.step()`` before any ``optimizer.step()`` only without it);
- the activation checkpointing switches of every sub-module (:data:`CHECKPOINTING_ATTRS`): a tune
  with ``checkpointing="on"`` or ``"auto"``, or an integration that turns the framework's setting on
  to probe, leaves the model as it found it — the flags back to their values and attributes that
  were not there before removed (Hugging Face's ``gradient_checkpointing_disable`` would leave
  ``_gradient_checkpointing_func`` behind).

**Cost.** The copies live in host memory, never on the device: parameters + buffers + gradients
+ optimizer state (about 4× the parameters' bytes for fp32 AdamW after its first step: weights,
two moments, no gradients) — :attr:`StateSnapshot.host_bytes` says how much; taking and restoring
each copy once costs two device-to-host transfers of that size (a 124M-parameter fp32 model with
AdamW state: about 1.5 GiB of host memory). Nothing is added to device memory, so the probes
measure the same peak as training would.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from microbatch.measure.device import gc_frozen

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKPOINTING_ATTRS",
    "StateSnapshot",
    "leave_no_trace",
    "gc_frozen",
    "save_rng",
    "restore_rng",
    "save_flags",
    "restore_flags",
]

CHECKPOINTING_ATTRS = ("checkpointing", "gradient_checkpointing", "_gradient_checkpointing_func")
"""The sub-module attributes that switch activation checkpointing: the built-in GPT's
``checkpointing`` (:func:`microbatch.measure.probes.set_checkpointing`); Hugging Face's per-module
``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``, which
``gradient_checkpointing_enable`` (4.x) and ``activation_checkpointing_enable`` (5.x) set."""

_ABSENT = object()


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (a clone when it is already on the CPU)."""
    return t.detach().to("cpu", copy=True)


def _back(saved: torch.Tensor, like_device: torch.device) -> torch.Tensor:
    return saved.to(like_device, copy=True)


@dataclass
class StateSnapshot:
    """Host copies of a model's and an optimizer's state (see the module's docstring)."""

    model: Any
    """The model whose state is kept."""
    optimizer: Any = None
    """The optimizer whose state is kept (None: none)."""
    tensors: list[tuple[Any, Any]] = field(default_factory=list)
    """(live parameter or buffer, host copy)."""
    grads: list[tuple[Any, Any, Any]] = field(default_factory=list)
    """(parameter, host copy of its grad or None, the grad's device)."""
    optimizer_state: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    """(parameter, {key: host copy or value, with the tensor's device})."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """The optimizer's group settings except ``params``."""
    training: list[tuple[Any, bool]] = field(default_factory=list)
    """(module, its ``training`` flag)."""
    rng: dict[str, Any] = field(default_factory=dict)
    """The random generators' states."""
    flags: list[tuple[Any, str, Any]] = field(default_factory=list)
    """(module, attribute, its value or absent): the checkpointing switches (:func:`save_flags`)."""

    @classmethod
    def take(cls, model: Any, optimizer: Any = None) -> StateSnapshot:
        """Copy the state of ``model`` (and ``optimizer``) to host memory."""
        import copy

        import torch

        snap = cls(model=model, optimizer=optimizer)
        params = _stepped(model, optimizer)
        with torch.no_grad():
            seen: set[int] = set()
            for t in [*params, *model.buffers()]:
                if id(t) not in seen:
                    seen.add(id(t))
                    snap.tensors.append((t, _host(t)))
            for p in params:
                g = p.grad
                snap.grads.append((p, None if g is None else _host(g), None if g is None else g.device))
            if optimizer is not None:
                for p, st in optimizer.state.items():
                    kept = {
                        k: (_host(v), v.device) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                        for k, v in st.items()
                    }
                    snap.optimizer_state.append((p, kept))
                snap.param_groups = [
                    {k: copy.deepcopy(v) for k, v in grp.items() if k != "params"}
                    for grp in optimizer.param_groups
                ]
        snap.training = [(m, m.training) for m in model.modules()]
        snap.flags = save_flags(model)
        if (
            optimizer is not None
        ):  # an LRScheduler's "the optimizer has stepped" mark (torch/optim/lr_scheduler.py)
            snap.flags.append((optimizer, "_opt_called", optimizer.__dict__.get("_opt_called", _ABSENT)))
        snap.rng = save_rng()
        return snap

    @property
    def host_bytes(self) -> int:
        """Host memory the copies hold."""
        import torch

        n = sum(c.numel() * c.element_size() for _, c in self.tensors)
        n += sum(c.numel() * c.element_size() for _, c, _ in self.grads if c is not None)
        for _, st in self.optimizer_state:
            for v in st.values():
                if isinstance(v, tuple) and isinstance(v[0], torch.Tensor):
                    n += v[0].numel() * v[0].element_size()
        return int(n)

    def restore(self) -> None:
        """Put everything back, bitwise."""
        import copy

        import torch

        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
            for p, g, dev in self.grads:
                if g is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == g.shape and p.grad.dtype == g.dtype:
                    p.grad.copy_(g)
                else:
                    p.grad = _back(g, dev)
            opt = self.optimizer
            if opt is not None:
                opt.state.clear()
                for p, st in self.optimizer_state:
                    opt.state[p] = {
                        k: _back(v[0], v[1]) if isinstance(v, tuple) and isinstance(v[0], torch.Tensor) else v
                        for k, v in st.items()
                    }
                for grp, kept in zip(opt.param_groups, self.param_groups, strict=True):
                    # exactly the saved settings: keys a probe added go (a scheduler's initial_lr),
                    # and fresh copies, so that a later in-place change cannot reach the snapshot
                    params = grp["params"]
                    grp.clear()
                    grp["params"] = params
                    grp.update(copy.deepcopy(kept))
        for m, flag in self.training:
            m.training = flag
        restore_flags(self.flags)
        restore_rng(self.rng)


def _stepped(model: Any, optimizer: Any) -> list[Any]:
    """The model's parameters, then those the optimizer steps that the model does not hold, each once."""
    params = list(model.parameters())
    seen = {id(p) for p in params}
    for grp in [] if optimizer is None else optimizer.param_groups:
        for p in grp["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def save_flags(model: Any) -> list[tuple[Any, str, Any]]:
    """The activation checkpointing switches of every sub-module of ``model`` (:data:`CHECKPOINTING_ATTRS`):
    (module, attribute, value), with a marker for an attribute the module's instance does not have."""
    return [(m, name, m.__dict__.get(name, _ABSENT)) for m in model.modules() for name in CHECKPOINTING_ATTRS]


def restore_flags(saved: list[tuple[Any, str, Any]]) -> None:
    """Put back the switches :func:`save_flags` returned: values reset, attributes added since deleted."""
    for m, name, value in saved:
        if value is _ABSENT:
            m.__dict__.pop(name, None)
        else:
            m.__dict__[name] = value


def save_rng() -> dict[str, Any]:
    """The states of torch's CPU and CUDA generators, Python's ``random`` and NumPy's global one."""
    import torch

    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        rng["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        rng["numpy"] = np.random.get_state()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Put back the generators' states :func:`save_rng` returned."""
    import torch

    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["random"])
    if "numpy" in rng:
        sys.modules["numpy"].random.set_state(rng["numpy"])


@contextmanager
def leave_no_trace(model: Any, optimizer: Any = None) -> Iterator[StateSnapshot]:
    """Run the block, then restore ``model`` and ``optimizer`` bitwise — whatever the block raised."""
    snap = StateSnapshot.take(model, optimizer)
    try:
        yield snap
    finally:
        snap.restore()
