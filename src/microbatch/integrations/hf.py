"""Hugging Face Trainer: :func:`tune_trainer` sets the knee b_m and g on the Trainer's arguments.

The replacement for ``TrainingArguments(auto_find_batch_size=True)``: it measures the Trainer's own
step, restores it bitwise, and sets ``per_device_train_batch_size`` and
``gradient_accumulation_steps`` so that ``b_m × g × world_size == global_batch``; :func:`split_on_oom`
keeps training through out-of-memory. Versions tested, what is refused and why:
``docs/integrations.md`` (Hugging Face Trainer).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from microbatch.choose.config import DEFAULT_TOLERANCE
from microbatch.choose.result import TuneResult
from microbatch.errors import ConfigError
from microbatch.integrations.common import (
    check_global_batch,
    choice_lines,
    choice_of,
    curve_lines,
    emit_lines,
    muted,
    options_with_cap,
    quiet_cache,
)
from microbatch.integrations.hf_loss import (
    items_of,
    loss_identity,
    loss_is_scaled,
    mean_taken_as_share,
    own_copy,
    own_loss_is_mean,
)
from microbatch.measure.snapshot import restore_flags, save_flags
from microbatch.run.accumulate.controller import MicroBatchController

__all__ = ["tune_trainer", "split_on_oom", "checkpointing_setting"]


def checkpointing_setting(args: Any) -> bool:
    """Whether the arguments turn activation checkpointing on (5.x ``activation_checkpointing``, 4.x
    ``gradient_checkpointing``)."""
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        value = getattr(args, name, None)
        if value is not None:
            return bool(value)
    return False


def _checkpointing_on(model: Any, args: Any) -> None:
    """Turn activation checkpointing on through the installed version's method, with the arguments'
    kwargs (``use_reentrant=False`` when none are given): 5.x ``activation_checkpointing_enable(
    activation_checkpointing_kwargs=...)``, 4.x ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``
    (a deprecated alias in 5.x, which warns)."""
    for kind in ("activation", "gradient"):
        enable = getattr(model, f"{kind}_checkpointing_enable", None)
        if enable is not None:
            kwargs = getattr(args, f"{kind}_checkpointing_kwargs", None) or {"use_reentrant": False}
            enable(**{f"{kind}_checkpointing_kwargs": kwargs})
            return


def _check(trainer: Any) -> None:
    from torch.utils.data import IterableDataset

    dataset = trainer.train_dataset
    if dataset is None:
        raise ConfigError(
            "the Trainer has no train_dataset: give Trainer(train_dataset=...) to tune on its batches"
        )
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"train_dataset is an iterable dataset ({type(dataset).__name__}): each probe reads a fresh "
            "iterator and a stream cannot be rewound; give a map-style dataset, or call microbatch.tune() "
            "with your own make_batch"
        )
    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        if getattr(trainer, flag, False):
            raise ConfigError(
                f"tune_trainer cannot tune under {name} (it shards the weights and optimizer state the probes "
                "must restore); tune without it on the same devices (plain or DDP), then train under "
                f"{name} with the b_m and g it sets"
            )
    if getattr(trainer.args, "n_gpu", 0) > 1:
        raise ConfigError(
            f"the Trainer would use DataParallel over {trainer.args.n_gpu} GPUs in one process; launch one "
            "process per GPU (torchrun --nproc_per_node ...) and tune there"
        )
    if getattr(trainer.args, "auto_find_batch_size", False):
        raise ConfigError(
            "TrainingArguments(auto_find_batch_size=True) halves per_device_train_batch_size on an out-of-memory "
            "and leaves gradient_accumulation_steps as they are, so the global batch tune_trainer holds would "
            "shrink; set auto_find_batch_size=False (tune_trainer replaces it), and give on_oom='split' to keep "
            "training through an out-of-memory at the same global batch"
        )


def tune_trainer(
    trainer: Any,
    global_batch: int | None = None,
    *,
    memory_budget_bytes: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    on_oom: str = "raise",
    grow_after: int | None = None,
    **options: Any,
) -> TuneResult:
    """Probe ``trainer``'s own step, restore, and set its batch size and accumulation to the knee.

    ``global_batch``: B_global, held exactly (default: ``per_device_train_batch_size ×
    gradient_accumulation_steps × world_size`` as given). Other keywords go to
    :func:`microbatch.tune` (``max_micro_batch`` — capped at ``global_batch / world_size`` and at the
    dataset's length —,
    ``timing``, ``patience`` ...). Returns the :class:`~microbatch.choose.result.TuneResult`;
    ``trainer.args`` then holds b_m and g.

    ``on_oom="split"``: afterwards :func:`split_on_oom` (``grow_after`` goes to it), so that an
    out-of-memory in training halves the micro-batch and redoes the step exactly; the controller is
    ``trainer.microbatch_controller``. ``"raise"`` (the default) leaves ``training_step`` alone.
    """
    from microbatch.choose.tune import tune

    if not hasattr(trainer, "args") or not hasattr(trainer, "training_step"):
        raise ConfigError(
            f"tune_trainer needs a transformers.Trainer, got {type(trainer).__name__} ({trainer!r:.60}); "
            "build the Trainer with its model, arguments and train_dataset, then call tune_trainer(trainer)"
        )
    args = trainer.args
    world = int(args.world_size)
    if global_batch is None:
        global_batch = int(args.per_device_train_batch_size * args.gradient_accumulation_steps * world)
    check_global_batch(global_batch, world)
    _check(trainer)
    if on_oom not in ("raise", "split"):
        raise ConfigError(f"on_oom must be 'raise' or 'split', got {on_oom!r}")
    if on_oom == "split":
        _check_split(trainer)  # before the probes, not after them
    options = _trainer_precision(args, options)
    dataset = trainer.train_dataset
    model = trainer.model
    created = trainer.optimizer is None
    if created:
        trainer.create_optimizer()
    flags = save_flags(model)  # the checkpointing switches, put back exactly after the probes
    ckpt = checkpointing_setting(args)
    collate = _collator(trainer)
    data = _without_unused_columns(trainer, dataset)

    make_batch, loss_fn = _probe_step(trainer, data, collate)
    asked = (int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps))
    try:
        if ckpt:
            _checkpointing_on(model, args)  # train() will turn it on: probe the step it will run
        with quiet_cache(), muted(trainer, "log"):  # said below, through the Trainer's logger
            result = tune(
                model, make_batch, loss_fn=loss_fn, optimizer=trainer.optimizer, global_batch=global_batch,
                **options_with_cap(dict(options, memory_budget_bytes=memory_budget_bytes, tolerance=tolerance),
                                   global_batch, world, data=data),
            )  # fmt: skip
    finally:
        restore_flags(flags)  # the Trainer turns checkpointing on itself in train()
        if created:
            trainer.optimizer = None  # train() builds its own, as it would have
    b, g = choice_of(result, global_batch, world)
    _set_choice(trainer, result, b, g, world)
    _divide_a_mean(trainer, g, make_batch)
    _say_drop_last(trainer, data, asked, (b, g))
    if on_oom == "split":
        split_on_oom(trainer, knee=b, grow_after=grow_after)
    return result


def _divide_a_mean(trainer: Any, g: int, make_batch: Callable[[int], Any]) -> None:
    """Where transformers would take a per-batch mean for a loss normalised by ``num_items_in_batch`` and add ``g`` of
    them undivided (a gradient g× the unaccumulated step's, so one that moves with the g chosen), set
    ``trainer.model_accepts_loss_kwargs = False``: it then divides each micro-batch's mean by g. The model's own
    forward is read from its source (:func:`~microbatch.integrations.hf_loss.mean_taken_as_share`); a ``compute_loss``
    of the user's own is measured once (:func:`~microbatch.integrations.hf_loss.own_loss_is_mean`: a review found
    ``return model(**inputs).loss`` doubling its gradient when the knee doubled g)."""
    if g <= 1:
        return
    if mean_taken_as_share(trainer):
        who = f"{type(trainer.model).__name__}'s forward averages its own loss (it does not pass num_items_in_batch to it)"
    else:
        with muted(trainer, "log"):
            if not own_loss_is_mean(trainer, lambda: make_batch(min(8, len(trainer.train_dataset)))):
                return
        who = f"{type(trainer).__name__}.compute_loss returns a per-batch mean (it does not divide by num_items_in_batch)"
    trainer.model_accepts_loss_kwargs = False  # the Trainer then divides each micro-batch's mean by g
    emit_lines(
        [f"microbatch: {who}, which transformers takes as normalised and would not divide by the {g} accumulation "
         f"steps (a gradient {g}× the unaccumulated step's): set trainer.model_accepts_loss_kwargs = False, so each "
         "micro-batch's mean is divided by g"],
        int(getattr(trainer.args, "process_index", 0)), say=_trainer_logger().warning,
    )  # fmt: skip


def _say_drop_last(trainer: Any, data: Any, asked: tuple[int, int], chosen: tuple[int, int]) -> None:
    """A warning where ``dataloader_drop_last`` no longer drops what it dropped at the batch the user asked for: it
    drops an incomplete micro-batch, so at another b_m an epoch keeps other rows and ends on a short optimizer step
    (a review: 100 rows at 8 × 2 took 6 steps of 16, at 4 × 4 seven, the last of 4, and the schedule stretched)."""
    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1)))
    if not getattr(args, "dataloader_drop_last", False) or asked == chosen:
        return
    try:
        rows = -(-len(data) // world)  # a rank's share, as the distributed sampler pads it
    except TypeError:
        return

    def epoch(b: int, g: int) -> tuple[int, int]:  # (rows an epoch trains on, its optimizer steps)
        batches = rows // b
        return batches * b, -(-batches // g)

    (kept, steps), (kept2, steps2) = epoch(*asked), epoch(*chosen)
    if (kept, steps) != (kept2, steps2):
        emit_lines(
            [f"microbatch: dataloader_drop_last drops an incomplete micro-batch: at {chosen[0]} × {chosen[1]} an epoch "
             f"of {rows} rows a rank trains on {kept2} rows in {steps2} optimizer steps, where {asked[0]} × "
             f"{asked[1]} trained on {kept} in {steps}; give max_steps for the schedule you meant, or a dataset of a "
             "whole number of global batches"],
            int(getattr(args, "process_index", 0)), say=_trainer_logger().warning,
        )  # fmt: skip


def _trainer_precision(args: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the Trainer's precision where none was given: ``bf16=True`` probes under bf16 autocast, as
    train() runs (transformers 5 takes autocast from Accelerate's prepared model, so the probes, before train(), ran
    fp32 under ``compute_loss_context_manager``: a user's walk-through); fp16 is not measured (fp32, as before)."""
    if "precision" in options or "probe" in options or not getattr(args, "bf16", False):
        return options  # the user's own, as a keyword or in a ProbeConfig
    return {**options, "precision": "bf16-mixed"}


def _probe_step(
    trainer: Any, data: Any, collate: Any
) -> tuple[Callable[[int], Any], Callable[[Any, Any], Any]]:
    """``make_batch(b)`` from the Trainer's data and collator, and its ``compute_loss``."""

    def make_batch(b: int) -> Any:
        from torch.utils.data import DataLoader

        batch = next(iter(DataLoader(data, batch_size=b, collate_fn=collate)))
        return trainer._prepare_inputs(batch)

    def loss_fn(m: Any, inputs: Any) -> Any:
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(
                m, own_copy(inputs)
            )  # a compute_loss may pop from it: each call its own

    loss_fn.microbatch_identity = loss_identity(trainer)  # type: ignore[attr-defined]  # the tune cache's key
    return make_batch, loss_fn


def _set_choice(trainer: Any, result: TuneResult, b: int, g: int, world: int) -> None:
    """Set b_m and g in ``trainer.args`` and say the curve and the choice (on rank 0)."""
    args = trainer.args
    args.per_device_train_batch_size = b
    args.gradient_accumulation_steps = g
    trainer._train_batch_size = args.train_batch_size  # what get_train_dataloader reads
    rank = int(getattr(args, "process_index", 0))
    emit_lines(curve_lines(result, b, g, world), rank)
    emit_lines(choice_lines(result, b, g, world), rank, say=_trainer_logger().warning)


def _trainer_logger() -> Any:
    """The Trainer's own logger (``transformers.trainer``): the choice goes there at WARNING, the level
    its default verbosity shows (the Trainer's INFO lines are hidden by default), once, on rank 0."""
    from transformers.utils import logging as hf_logging

    return hf_logging.get_logger("transformers.trainer")


def _check_split(trainer: Any) -> None:
    """ConfigError for the setups where the Trainer's own backward does what :func:`accumulate` cannot."""
    if not hasattr(trainer, "args") or not callable(getattr(trainer, "training_step", None)):
        raise ConfigError(
            f"split_on_oom takes a transformers Trainer (its args and training_step), got {trainer!r}; "
            "e.g. split_on_oom(Trainer(model=..., args=..., train_dataset=...))",
            params=("trainer",),
        )
    args = trainer.args
    refusals = [
        (int(getattr(args, "world_size", 1)) > 1,
         f"world_size {args.world_size}: the Trainer syncs DDP gradients itself across its accumulation "
         "steps; on_oom='split' is single-process for now"),
        (getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False),
         "DeepSpeed or FSDP is enabled: their backward is not loss.backward()"),
        (getattr(args, "n_gpu", 0) > 1, f"DataParallel over {getattr(args, 'n_gpu', 0)} GPUs"),
        (getattr(getattr(trainer, "accelerator", None), "scaler", None) is not None,
         "fp16 loss scaling (a GradScaler) is on: its backward scales the loss; use bf16 or fp32"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"on_oom='split' cannot wrap this Trainer's training_step: {why}")


def split_on_oom(
    trainer: Any,
    *,
    initial: int | None = None,
    knee: int | None = None,
    grow_after: int | None = None,
    count_fn: Any = None,
) -> MicroBatchController:
    """Make ``trainer``'s training step survive out-of-memory by redoing it with smaller micro-batches.

    Replaces ``training_step`` on this instance (not the class) with a step that splits the rows the
    Trainer hands it into micro-batches of the controller's size and runs them through
    :func:`~microbatch.run.accumulate.accumulate` over the Trainer's own ``compute_loss`` (under
    ``compute_loss_context_manager``), with the Trainer's scaling kept (:func:`~microbatch.integrations.hf_loss.loss_is_scaled`; a ``compute_loss``
    of the user's own is measured once: :func:`~microbatch.integrations.hf_loss._normalised_by_items`): when the loss is normalised by
    ``num_items_in_batch`` (the model takes loss kwargs, or ``compute_loss_func``) each piece's loss
    is already its share of the step and the pieces add up; otherwise (a model that takes no loss
    kwargs, transformers before 4.46) the loss is the model's mean over the piece, and each piece's
    mean is weighted by its share of the items it averages over, then divided by
    ``gradient_accumulation_steps``: ``count_fn(inputs) -> items`` when given; else, for per-token
    labels, those not -100 (``shift_labels``; ``labels`` of an encoder-decoder; ``labels[..., 1:]``,
    the shift of every Hugging Face causal LM, otherwise), and the rows for one label per row. A piece
    without items is not run (its mean would be nan). Exact when that count is what the loss averages
    over; when the Trainer does not confirm the shift (``_loss_shifts_labels``, 5.x, set from the
    model's ``loss_type``) a split step warns once (``RuntimeWarning``): a custom loss may average over
    other items; give ``count_fn`` to say which, e.g. ``lambda inputs: (inputs["labels"][..., 1:] != -100).sum()``.
    The returned loss is the one the unwrapped step returns. ``initial``: the starting size (default
    ``per_device_train_batch_size``); ``knee``, ``grow_after``: see
    :class:`~microbatch.run.accumulate.controller.MicroBatchController`. Returns the controller, also set as
    ``trainer.microbatch_controller`` (its ``summary()`` is JSON-ready for logging). Calling it again
    replaces the controller and keeps a single wrapper.

    A step, for the controller, is an optimizer step (``step_counter`` is the Trainer's
    ``state.global_step``): its ``steps``, the events' ``step``, the log lines and the ``grow_after``
    window count the steps the Trainer counts and logs, while each of the ``gradient_accumulation_steps``
    calls per step is counted in ``calls``.
    """

    _check_split(trainer)
    if count_fn is not None and not callable(count_fn):
        raise ConfigError(f"count_fn must be callable (inputs -> items), got {type(count_fn).__name__}")
    start = int(trainer.args.per_device_train_batch_size) if initial is None else initial
    ctrl = MicroBatchController(
        start,
        knee=max(start, knee or start),
        grow_after=grow_after,
        step_counter=lambda: trainer.state.global_step,
    )
    trainer.microbatch_controller = ctrl
    trainer.microbatch_count_fn = count_fn
    if getattr(trainer.training_step, "_microbatch_split", False):
        return ctrl  # already wrapped: it reads trainer.microbatch_controller at every step
    training_step = _split_training_step(trainer)
    training_step._microbatch_split = True  # type: ignore[attr-defined]
    trainer.training_step = training_step
    return ctrl


def _split_training_step(trainer: Any) -> Callable[..., Any]:
    """The ``training_step`` :func:`split_on_oom` installs: the Trainer's step through
    :func:`~microbatch.run.accumulate.accumulate` with ``trainer.microbatch_controller``."""
    from microbatch.run.accumulate import accumulate

    warned: list[bool] = []  # the inexact-count warning, once per wrapper

    def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        from microbatch.run.accumulate.microbatches import batch_rows

        model.train()
        if callable(getattr(trainer.optimizer, "train", None)):
            trainer.optimizer.train()
        inputs = trainer._prepare_inputs(inputs)
        scaled, divided, assumed = loss_is_scaled(trainer, num_items_in_batch, model, inputs)
        rows = batch_rows(inputs)
        # compute_loss takes num_items_in_batch from 4.46 on (the Trainer passes None before)
        items = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        ga = float(getattr(trainer, "current_gradient_accumulation_steps", None)
                   or trainer.args.gradient_accumulation_steps) if divided else 1.0  # fmt: skip  # < 4.50: args

        count, exact = (batch_rows, True) if scaled else items_of(trainer, inputs)
        if not float(count(inputs)) > 0:
            count = batch_rows  # no items at all: every piece's mean is nan, as the unsplit step's
        like = next(iter(model.parameters()))

        def loss_fn(m: Any, mb: Any) -> tuple[Any, float]:
            n = float(count(mb))  # a Python float: a tensor count would scale in float32
            if not scaled and not n > 0:  # a mean over no items would be nan: it adds nothing
                return like.new_zeros((), requires_grad=True), n
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(m, own_copy(mb), **items)  # a redo calls it again on the piece
            # accumulate divides Σ loss_sum by Σ n: a share of the step times rows, or a piece's mean times its items
            return (loss * rows if scaled else loss * (n / ga)), n

        ctrl = trainer.microbatch_controller
        loss = accumulate(model, inputs, loss_fn, count_fn=count, controller=ctrl)
        why = _split_warning(trainer, assumed, exact)
        if why and ctrl.micro_batch_size < rows and not warned:  # once per wrapper
            import warnings

            warned.append(True)
            warnings.warn(why, RuntimeWarning, stacklevel=2)
        return loss

    return training_step


def _split_warning(trainer: Any, assumed: bool, exact: bool) -> str:
    """What a split step warns of: a custom loss only assumed normalised (:func:`~microbatch.integrations.hf_loss.loss_is_scaled`), or per-piece means
    weighted by a guessed count (:func:`~microbatch.integrations.hf_loss.items_of`); "" when neither."""
    if assumed:
        return (
            f"split_on_oom split a step of {type(trainer).__name__}, whose own compute_loss is taken as normalised "
            "by num_items_in_batch (transformers' rule while loss_is_scaled_for_ga is None): the pieces' losses "
            "are added; if it returns a per-batch mean the split step's gradient is the pieces' count times too "
            "large: set trainer.loss_is_scaled_for_ga = False, or give split_on_oom(trainer, count_fn=...) with "
            "what the mean averages over"
        )
    if not exact:
        return (
            "split_on_oom split a step whose loss is the model's per-token mean (not normalised by "
            "num_items_in_batch); the pieces are weighted by their labels[..., 1:] != -100 (the shift of a "
            "causal LM), exact only if the loss averages over those; say what it averages over: "
            "split_on_oom(trainer, count_fn=lambda inputs: (inputs['labels'][..., 1:] != -100).sum())"
        )
    return ""


def _collator(trainer: Any) -> Any:
    """The Trainer's collator, with the columns the model does not take removed (as its dataloader does)."""
    datasets = sys.modules.get("datasets")  # a datasets.Dataset means the library is imported already
    if datasets is not None and isinstance(trainer.train_dataset, datasets.Dataset):
        return trainer.data_collator
    return trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")


def _without_unused_columns(trainer: Any, dataset: Any) -> Any:
    datasets = sys.modules.get("datasets")
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        return trainer._remove_unused_columns(dataset, description="training")
    return dataset
