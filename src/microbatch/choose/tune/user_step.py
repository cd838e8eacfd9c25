"""What :func:`microbatch.tune` needs of the user's own step before it measures: a model the probes can
train, the timing of probes in this process (as the command line times them on a CPU), torch's
threads for the probes (put back after), and the structure of the batches for the cache key."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from microbatch.choose.tune.cache import batch_structure
from microbatch.choose.tune.config import ProbeConfig, SearchConfig
from microbatch.choose.tune.probing import cpu_timing_rule, default_timing
from microbatch.errors import ConfigError
from microbatch.measure.norm_layers import tune_note
from microbatch.measure.timing import TimingConfig

__all__ = [
    "NonFiniteLoss", "batch_structures", "batch_statistics_need_rows", "check_step_args", "check_trainable",
    "in_process_timing", "torch_threads", "training_grad_mode", "user_step_notes",
]  # fmt: skip


class NonFiniteLoss(UserWarning):
    """Warned by :func:`microbatch.tune` when the user's step gave a NaN or infinite loss."""


def check_trainable(model: Any, optimizer: Any) -> None:
    """ConfigError for a model the probes cannot train: parameters on the meta device (no data), or no
    trainable parameter and no optimizer (torch's own message, 'optimizer got an empty parameter
    list', names neither the model nor the fix), or a model that is no torch module."""
    if not callable(getattr(model, "named_parameters", None)):
        raise ConfigError(
            f"tune() measures a torch model's training step: model must be an nn.Module, got {model!r}"
            + (
                f"; for a built-in model by name use microbatch.choose.tune.tune_model({model!r})"
                if isinstance(model, str)
                else ""
            ),
            params=("model",),
        )
    from torch.nn.parameter import UninitializedParameter

    lazy = [name for name, p in model.named_parameters() if isinstance(p, UninitializedParameter)]
    if lazy:
        more = f" and {len(lazy) - 1} more" if len(lazy) > 1 else ""
        raise ConfigError(
            f"parameter {lazy[0]!r}{more} of {type(model).__name__} is not initialised yet (a lazy module: its shape "
            "comes from its first input): run one forward on a batch first, model(make_batch(1)), then tune",
            params=("model",),
        )
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        more = f" and {len(meta) - 1} more" if len(meta) > 1 else ""
        raise ConfigError(
            f"parameter {meta[0]!r}{more} of {type(model).__name__} is on the meta device (shapes, no data): "
            "the probes must run the step; materialise the model first (model.to_empty(device=...) and "
            "initialise it, or load its weights)"
        )
    if optimizer is None and not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"{type(model).__name__} has no trainable parameter (none with requires_grad=True): there is no "
            "training step to tune; unfreeze the parameters to train (p.requires_grad_(True)), or pass the "
            "optimizer you train with"
        )
    groups = getattr(optimizer, "param_groups", None)
    held = {id(p) for g in groups or () if isinstance(g, dict) for p in g.get("params", ())}
    if held and not held & {id(p) for p in model.parameters()}:
        raise ConfigError(
            f"the optimizer holds {len(held)} parameter(s), none of them {type(model).__name__}'s: its steps would "
            "train another model (and time its update, not this one's); build it over this model's parameters, "
            "optimizer=torch.optim.AdamW(model.parameters()), or leave it out for AdamW",
            params=("optimizer",),
        )


def check_step_args(make_batch: Any, optimizer: Any, loss_fn: Any, on_point: Any) -> None:
    """ConfigError for :func:`microbatch.tune`'s step arguments that cannot be what they are for, before any
    probe: ``make_batch`` a function of b, ``optimizer`` an optimizer instance (its ``param_groups`` and
    ``step``: a class, or a name, is not one), ``loss_fn`` and ``on_point`` functions where given."""
    if not callable(make_batch):
        raise ConfigError(
            f"make_batch must be a function of b returning one micro-batch of b samples, got "
            f"{type(make_batch).__name__}; e.g. make_batch=lambda b: tokens[:b]",
            params=("make_batch",),
        )
    if optimizer is not None and (
        isinstance(optimizer, type)
        or not hasattr(optimizer, "param_groups")
        or not callable(getattr(optimizer, "step", None))
    ):
        what = f"the class {optimizer.__name__}" if isinstance(optimizer, type) else repr(optimizer)
        raise ConfigError(
            f"optimizer must be the optimizer instance you train with (its param_groups and step()), got {what}; "
            "e.g. optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4), or leave it out for AdamW",
            params=("optimizer",),
        )
    for name, fn in (("loss_fn", loss_fn), ("on_point", on_point)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"{name} must be a function or None, got {type(fn).__name__}", params=(name,))


@contextmanager
def training_grad_mode() -> Iterator[None]:
    """Autograd on and inference mode off for the block: the probes are training steps, and the snapshot put back
    after them must not come back as inference tensors (an optimizer whose state did could not step again)."""
    import torch

    with torch.inference_mode(False), torch.enable_grad():
        yield


def in_process_timing(probe: ProbeConfig, device_type: str) -> tuple[TimingConfig, int | None, str]:
    """The timing, torch threads and a line saying why, for probes in this process: as the command line
    on a CPU (:func:`~microbatch.choose.tune.probing.cpu_timing_rule`: one thread and the process clock on a
    small CPU) unless ``timing`` or ``threads`` was given; the device's default timing elsewhere."""
    from microbatch.hardware import usable_cores
    from microbatch.measure.timing import TimingConfig

    if device_type != "cpu":
        return probe.timing or default_timing(device_type), probe.threads, "timing: CUDA events"
    given_clock = probe.timing.clock if probe.timing is not None else None
    cores = usable_cores()
    threads, clock, chosen = cpu_timing_rule(probe.threads, given_clock, cores)
    base = probe.timing or default_timing("cpu")
    timing = base if base.clock == clock else TimingConfig(**dict(base.__dict__, clock=clock))
    what = "torch's threads" if threads is None else f"{threads} thread{'s' if threads > 1 else ''}"
    why = f"{cores} cores detected" if chosen else "as given"
    return timing, threads, f"timing: {what}, {clock} clock ({why}; threads=/timing= to change)"


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` (None: unchanged) for the block, then put back."""
    import torch

    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def batch_structures(make_batch: Callable[[int], Any], search: SearchConfig) -> list[Any]:
    """What ``make_batch`` returns for the first two b_m the search may probe (shapes and dtypes, no
    values): part of the cache key, so that other data is measured again."""
    first = search.start
    sizes = (
        [first]
        if search.max_micro_batch is not None and search.max_micro_batch <= first
        else [first, 2 * first]
    )
    out = []
    for b in sizes:
        batch = make_batch(b)
        out.append(batch_structure(batch))
        del batch
    return out


@contextmanager
def batch_statistics_need_rows(start: int) -> Iterator[None]:
    """torch's refusal of a one-row BatchNorm in training (raised from the user's forward at b_m = 1) as the
    ConfigError naming the setting to change."""
    try:
        yield
    except ValueError as e:
        if "more than 1 value per channel" not in str(e):
            raise
        raise ConfigError(
            f"the model normalises by batch statistics (BatchNorm in training mode) and torch refuses it on "
            f"{start} row(s) ({e}); start the walk at 2 rows or more: start=2",
            params=("start",),
        ) from None


def user_step_notes(model: Any, first_loss: float | None) -> tuple[str, ...]:
    """The result's notes on the user's step, each also warned (the integrations print the answer, not the notes): the
    first probing step's loss NaN or infinite (:class:`NonFiniteLoss`), and layers that make b_m change the training
    (BatchNorm, :func:`~microbatch.measure.norm_layers.tune_note`)."""
    notes = []
    if first_loss is not None and not math.isfinite(first_loss):
        notes.append(
            f"the loss of the first probing step was {first_loss}: the timings hold, but this step does "
            "not train (check the data, the loss function and the learning rate)"
        )
        warnings.warn(f"microbatch.tune: {notes[-1]}", NonFiniteLoss, stacklevel=3)
    if (norms := tune_note(model)) is not None:
        notes.append(norms)
        warnings.warn(f"microbatch.tune: {norms}", UserWarning, stacklevel=3)
    return tuple(notes)
