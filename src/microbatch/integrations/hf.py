"""Hugging Face Trainer: :func:`tune_trainer` sets the knee b_m and g on the Trainer's arguments.

The replacement for ``TrainingArguments(auto_find_batch_size=True)``: that flag halves the batch
size on out-of-memory until one fits — the largest size that fits, not the knee — and changes the
effective batch (``per_device_train_batch_size × gradient_accumulation_steps × world``) as it
goes. :func:`tune_trainer` measures the Trainer's own step — its ``compute_loss`` (so a custom
``compute_loss`` or ``compute_loss_func``), its data collator with the unused columns removed, its
mixed-precision context (``compute_loss_context_manager``), its activation checkpointing setting,
and the optimizer ``create_optimizer`` builds — on batches of its ``train_dataset``; restores the
model and the optimizer bitwise (:mod:`microbatch.choose.snapshot`); then sets
``per_device_train_batch_size`` = b_m and ``gradient_accumulation_steps`` = g so that
``b_m × g × world_size`` is exactly ``global_batch`` (default: the effective batch the arguments
already give). ``trainer.train()`` then runs at the knee.

Tested on transformers 5.x (``activation_checkpointing``, with ``gradient_checkpointing`` its
deprecated alias) and written for 4.4x–4.5x too (``gradient_checkpointing``): the setting is read
under whichever name the installed version has. Refused before any probe: no ``train_dataset``,
an iterable dataset, DeepSpeed or FSDP enabled (they shard the state the probes must restore),
DataParallel over several GPUs in one process (use ``torchrun``), a global batch the world size
does not divide.
"""

from __future__ import annotations

import sys
from typing import Any

from microbatch.choose.result import TuneResult
from microbatch.errors import ConfigError
from microbatch.integrations.common import (
    check_global_batch,
    choice_of,
    curve_lines,
    emit_lines,
    options_with_cap,
)

__all__ = ["tune_trainer", "checkpointing_setting"]


def checkpointing_setting(args: Any) -> bool:
    """Whether the arguments turn activation checkpointing on (5.x ``activation_checkpointing``, 4.x
    ``gradient_checkpointing``)."""
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        value = getattr(args, name, None)
        if value is not None:
            return bool(value)
    return False


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


def tune_trainer(
    trainer: Any,
    global_batch: int | None = None,
    *,
    memory_budget_bytes: int | None = None,
    tolerance: float = 0.15,
    **options: Any,
) -> TuneResult:
    """Probe ``trainer``'s own step, restore, and set its batch size and accumulation to the knee.

    ``global_batch``: B_global, held exactly (default: ``per_device_train_batch_size ×
    gradient_accumulation_steps × world_size`` as given). Other keywords go to
    :func:`microbatch.tune` (``max_micro_batch`` — capped at ``global_batch / world_size`` —,
    ``timing``, ``patience`` ...). Returns the :class:`~microbatch.choose.result.TuneResult`;
    ``trainer.args`` then holds b_m and g.
    """
    from microbatch.choose.tune import tune

    args = trainer.args
    world = int(args.world_size)
    if global_batch is None:
        global_batch = int(args.per_device_train_batch_size * args.gradient_accumulation_steps * world)
    check_global_batch(global_batch, world)
    _check(trainer)
    dataset = trainer.train_dataset
    model = trainer.model
    created = trainer.optimizer is None
    if created:
        trainer.create_optimizer()
    ckpt_before = bool(getattr(model, "is_gradient_checkpointing", False))
    ckpt = checkpointing_setting(args)
    collate = _collator(trainer)
    data = _without_unused_columns(trainer, dataset)

    def make_batch(b: int) -> Any:
        from torch.utils.data import DataLoader

        batch = next(iter(DataLoader(data, batch_size=b, collate_fn=collate)))
        return trainer._prepare_inputs(batch)

    def loss_fn(m: Any, inputs: Any) -> Any:
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(m, inputs)

    try:
        if ckpt and not ckpt_before and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=getattr(args, "gradient_checkpointing_kwargs", None)
                or {"use_reentrant": False}
            )
        result = tune(
            model, make_batch, loss_fn=loss_fn, optimizer=trainer.optimizer, global_batch=global_batch,
            **options_with_cap(dict(options, memory_budget_bytes=memory_budget_bytes, tolerance=tolerance),
                               global_batch, world),
        )  # fmt: skip
    finally:
        if ckpt and not ckpt_before and hasattr(model, "gradient_checkpointing_disable"):
            model.gradient_checkpointing_disable()  # the Trainer turns it on itself in train()
        if created:
            trainer.optimizer = None  # train() builds its own, as it would have
    b, g = choice_of(result, global_batch, world)
    args.per_device_train_batch_size = b
    args.gradient_accumulation_steps = g
    trainer._train_batch_size = args.train_batch_size  # what get_train_dataloader reads
    emit_lines(curve_lines(result, b, g, world), int(getattr(args, "process_index", 0)))
    return result


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
