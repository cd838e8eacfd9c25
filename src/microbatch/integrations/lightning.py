"""Lightning: :class:`KneeBatchSize`, a callback that sets the knee b_m and g before training starts.

In the manner of Lightning's ``BatchSizeFinder``: at ``on_fit_start`` it tunes the module's own
``training_step`` through the strategy, restores everything bitwise, sets the batch-size attribute
to b_m and ``accumulate_grad_batches`` to g with ``b_m × g × world_size == global_batch``.
:class:`~microbatch.integrations.lightning_oom.SplitOnOOM` is re-exported here. What it reads, what
is refused and what it costs: ``docs/integrations.md`` (Lightning).
"""

from __future__ import annotations

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
    options_with_cap,
    quiet_cache,
)
from microbatch.integrations.lightning_logged import LoggedState, muted_logs
from microbatch.integrations.lightning_oom import CallbackBase as _Base
from microbatch.integrations.lightning_oom import SplitOnOOM, _per_token_labels, loss_of
from microbatch.measure.snapshot import restore_rng, save_rng

__all__ = ["KneeBatchSize", "SplitOnOOM", "SUPPORTED_STRATEGIES"]

SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")
"""Lightning strategies the callback tunes under (DeepSpeedStrategy, a DDPStrategy, excluded)."""


def _check_strategy(trainer: Any) -> None:
    strategy = trainer.strategy
    name = type(strategy).__name__
    ok = any(c.__name__ in SUPPORTED_STRATEGIES for c in type(strategy).__mro__)
    if not ok or "DeepSpeed" in name:
        raise ConfigError(
            f"KneeBatchSize cannot tune under strategy {name}: it supports "
            f"{', '.join(SUPPORTED_STRATEGIES)} (FSDP, DeepSpeed and model-parallel strategies shard the "
            "weights and optimizer state the probes must restore); tune with strategy='ddp' on the same "
            "devices, then train under your strategy with the b_m and g it sets"
        )


def _train_loader(trainer: Any) -> Any:
    """The fit loop's train DataLoader, rebuilt from the data source."""
    loop = trainer.fit_loop
    loop._combined_loader = None  # as BatchSizeFinder's _reset_dataloaders: force a reload
    loop.setup_data()
    combined = loop._combined_loader
    if combined is None:
        raise ConfigError(
            "the LightningModule has no train dataloader (or limit_train_batches=0): nothing to probe"
        )
    from torch.utils.data import DataLoader

    if not isinstance(
        combined.iterables, DataLoader
    ):  # a dict or list of loaders: the step takes them together
        raise ConfigError(
            f"train_dataloader() returns {len(combined.flattened)} dataloader(s) in a {type(combined.iterables).__name__} "
            "(a dict, list or CombinedLoader), not one DataLoader: "
            "KneeBatchSize probes the step on one loader's batches; return one DataLoader, or call microbatch.tune() "
            "with a make_batch that builds your combined batch"
        )
    return combined.flattened[0]


def _rebuild_optimizers(trainer: Any) -> None:
    """``configure_optimizers`` again at the chosen b_m and g, as a run set by hand calls it: a schedule sized from
    ``trainer.estimated_stepping_batches`` (OneCycleLR's ``total_steps``) was built for the batch before the tune
    (the strategy built the optimizers before ``on_fit_start``; the tune restored their state, so nothing is lost)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    strategy = trainer.strategy
    strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    _optimizers_to_device(strategy.optimizers, strategy.root_device)


def _drop_dataloaders(trainer: Any) -> None:
    """Leave no loader behind: the fit loop builds (and iterates) its own, as it would without the
    callback, after the generators are restored. Building them here iterated the train loader, which
    drew the sampler's seed from the global generator before the restore undid the draw: the fit
    loop then shuffled with one draw fewer than a run without the callback (issue 30)."""
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop._data_fetcher = None
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


class KneeBatchSize(_Base):
    """Set the batch size to the knee b_m and ``accumulate_grad_batches`` to g before fit trains.

    ``global_batch``: B_global, held exactly (``b_m × g × world_size``). ``memory_budget_bytes``:
    memory per device the choice must fit (None: no limit but ``max_micro_batch``).
    ``tolerance``: τ, the share of the best throughput the knee may give up. ``batch_arg_name``:
    the attribute Lightning's ``BatchSizeFinder`` would scale. Other keywords go to
    :func:`microbatch.tune` (``max_micro_batch``, ``timing``, ``patience``, ``start`` ...);
    ``max_micro_batch`` is capped at ``global_batch / world_size`` and at the rows one process's
    share of the dataset holds.

    After fit starts: :attr:`result` (the :class:`~microbatch.choose.result.TuneResult`),
    :attr:`micro_batch` and :attr:`grad_accum`.
    """

    def __init__(
        self,
        global_batch: int,
        *,
        memory_budget_bytes: int | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        batch_arg_name: str = "batch_size",
        **options: Any,
    ) -> None:
        check_global_batch(global_batch, 1)
        self.global_batch = global_batch
        self.batch_arg_name = batch_arg_name
        self.options: dict[str, Any] = dict(
            options, memory_budget_bytes=memory_budget_bytes, tolerance=tolerance
        )
        # every setting checked now, as tune will read it: a bad value is refused here, not at fit start
        # (tune's own keywords, probe/search/choice/on_point, go to it as they are; a torch.device
        # becomes its name, as tune makes it)
        from microbatch.choose.tune import configs_from_options

        settings = {
            k: v for k, v in self.options.items() if k not in ("probe", "search", "choice", "on_point")
        }
        if settings.get("device") is not None:
            settings["device"] = str(settings["device"])
        configs_from_options(
            "KneeBatchSize",
            self.options.get("probe"),
            self.options.get("search"),
            self.options.get("choice"),
            dict(settings, global_batch=global_batch),
        )
        self.result: TuneResult | None = None
        """The tune's result (after fit started)."""
        self.micro_batch: int | None = None
        """The knee b_m set on the module or datamodule."""
        self.grad_accum: int | None = None
        """g set as ``trainer.accumulate_grad_batches``."""

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        """Check everything that can be checked before any probe."""
        from lightning.pytorch.utilities.parsing import lightning_hasattr

        if stage not in (None, "fit"):
            return
        _check_strategy(trainer)
        check_global_batch(self.global_batch, trainer.world_size)
        if not trainer.fit_loop._data_source.is_module():
            raise ConfigError(
                "KneeBatchSize cannot change the batch size of dataloaders passed to fit() directly; "
                "define train_dataloader() in the LightningModule or a LightningDataModule, using "
                f"self.{self.batch_arg_name}"
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"batch size attribute {self.batch_arg_name!r} was not found in the LightningModule "
                f"{type(pl_module).__name__}, its hparams or the datamodule (the places Lightning's "
                f"BatchSizeFinder looks); add self.{self.batch_arg_name} and use it in train_dataloader(), "
                "or pass batch_arg_name=<your attribute>"
            )
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise ConfigError(
                "KneeBatchSize sets accumulate_grad_batches = g so that b_m × g × world = global_batch; a "
                "GradientAccumulationScheduler changes g by epoch, and the global batch with it; remove one of the "
                "two (to grow the global batch by epoch, tune each phase's global_batch apart)"
            )
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "KneeBatchSize probes automatic optimization only (the module sets automatic_optimization = "
                "False); call microbatch.tune() with your own step instead"
            )
        self._record_before_optimizers(pl_module)

    def _record_before_optimizers(self, pl_module: Any) -> None:
        """Wrap the module's ``configure_optimizers`` (for this fit only) to save the generators just before the
        strategy calls it: after the tune it runs again from that state (:func:`_rebuild_optimizers`), so what it
        draws — the train loader ``trainer.estimated_stepping_batches`` builds and iterates, its sampler's seed — is
        drawn as a run set by hand to the knee draws it. Restored at the fit's start state instead, the loader
        rebuilt for the fit loop drew one seed later: another data order from the first batch (a review, 2026-12-07)."""
        self._before_optimizers: Any = None
        user = pl_module.__dict__.get("configure_optimizers")
        bound = pl_module.configure_optimizers

        def recording(*args: Any, **kwargs: Any) -> Any:
            if self._before_optimizers is None:
                self._before_optimizers = save_rng()
            return bound(*args, **kwargs)

        self._wrapped = (pl_module, user)
        pl_module.configure_optimizers = recording

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Put the module's own ``configure_optimizers`` back (a fit that failed before ``on_fit_start``)."""
        self._unwrap()

    def teardown(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        """Put the module's own ``configure_optimizers`` back, whatever ended the fit."""
        self._unwrap()

    def _unwrap(self) -> None:
        pl_module, user = getattr(self, "_wrapped", (None, None))
        if pl_module is None:
            return
        if user is None:
            pl_module.__dict__.pop("configure_optimizers", None)
        else:
            pl_module.configure_optimizers = user
        self._wrapped = (None, None)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Probe, restore, then set the knee b_m and g."""
        rng = save_rng()  # rebuilding a DataLoader draws from the global generator (Lightning iter()s it)
        try:
            replayed = self._tune(trainer, pl_module, rng)
        except BaseException:
            restore_rng(rng)
            raise
        finally:
            self._unwrap()
        if not replayed:
            restore_rng(rng)

    def _tune(self, trainer: Any, pl_module: Any, rng: Any) -> bool:
        """Tune, set the knee, and build the optimizers again at it; True when they were built from the generators'
        state before the strategy first built them (what they drew then is drawn again, as it was)."""
        from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr

        from microbatch.choose.tune import tune

        world = trainer.world_size
        original = lightning_getattr(pl_module, self.batch_arg_name)
        strategy = trainer.strategy

        def make_batch(b: int) -> Any:
            lightning_setattr(pl_module, self.batch_arg_name, b)
            loader = _train_loader(trainer)
            _check_loader(loader, b, self.batch_arg_name)
            return strategy.batch_to_device(next(iter(loader)))

        from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

        # as Lightning's loop calls it: batch_idx only where the hook takes it (Lightning 2 lets it go)
        index = (0,) if is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2) else ()

        def loss_fn(model: Any, batch: Any) -> Any:
            return loss_of(strategy.training_step(batch, *index), "KneeBatchSize")

        first = _train_loader(trainer)  # checked before any probe, at the user's own batch size
        _check_loader(first, original, self.batch_arg_name)
        per_token = _per_token_labels(next(iter(first)))
        # the rebuilt loader shards the dataset over the ranks (DistributedSampler under DDP)
        options = options_with_cap(
            self.options, self.global_batch, world, data=first.dataset, data_shards=world
        )
        self._epoch = _epoch_rows(first, world)
        del first
        optimizers = trainer.optimizers
        optimizer = optimizers[0] if optimizers else None
        # no result collection before the fit loop runs: the probes' logs go nowhere; the module's torchmetrics, which the probes' training_step updates: put back after (an epoch's accuracy
        # counted the probes' rows: 0.164 for the 0.281 of a run set by hand, a review, 2026-12-07)
        metrics = LoggedState.take(trainer, pl_module)
        try:
            with quiet_cache(), muted_logs(pl_module):  # said below, in Lightning's own way
                result = tune(
                    strategy.model, make_batch, loss_fn=loss_fn, optimizer=optimizer,
                    global_batch=self.global_batch, **options,
                )  # fmt: skip
            b, g = choice_of(result, self.global_batch, world)
        except BaseException:
            lightning_setattr(pl_module, self.batch_arg_name, original)
            _drop_dataloaders(trainer)
            raise
        finally:
            metrics.restore()
        return self._set(
            trainer, pl_module, result, (b, g, original if isinstance(original, int) else b), (per_token, rng)
        )

    def _set(self, trainer: Any, pl_module: Any, result: TuneResult, sizes: tuple[int, int, int],
             context: tuple[bool, Any]) -> bool:  # fmt: skip
        """Set the knee ``sizes`` = (b_m, g, the user's batch size) on the module and the trainer, build the
        optimizers again at it (``context`` = (per-token labels, the generators at the fit's start)) and say it."""
        from lightning.pytorch.utilities import rank_zero_info
        from lightning.pytorch.utilities.parsing import lightning_setattr

        (b, g, original), (per_token, rng), world = sizes, context, trainer.world_size
        lightning_setattr(pl_module, self.batch_arg_name, b)
        if per_token and g > int(trainer.accumulate_grad_batches):
            _warn_mean_of_means(g)
        trainer.accumulate_grad_batches = g
        rescaled = _rescale_batch_counts(trainer, original, b, getattr(self, "_epoch", None))
        _drop_dataloaders(trainer)
        before = getattr(self, "_before_optimizers", None)
        restore_rng(before if before is not None else rng)
        _rebuild_optimizers(trainer)
        if (
            before is None
        ):  # estimated_stepping_batches may have loaded them from the wrong state: the fit loop
            _drop_dataloaders(trainer)  # builds its own
        self.result, self.micro_batch, self.grad_accum = result, b, g
        emit_lines(curve_lines(result, b, g, world), trainer.global_rank)
        emit_lines(choice_lines(result, b, g, world) + rescaled, trainer.global_rank, say=rank_zero_info)
        for logger in trainer.loggers:
            logger.log_hyperparams({"microbatch/micro_batch": b, "microbatch/grad_accum": g,
                                    "microbatch/global_batch": self.global_batch})  # fmt: skip
        return before is not None


def _check_loader(loader: Any, b: object, attr: str) -> None:
    """ConfigError unless the rebuilt DataLoader batches ``b`` samples from a map-style dataset."""
    from torch.utils.data import IterableDataset

    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        raise ConfigError(
            f"the train dataloader reads an iterable dataset ({type(loader.dataset).__name__}): each probe draws "
            "from a fresh iterator and a stream cannot be rewound, so its samples would be lost to training; "
            "use a map-style Dataset, or call microbatch.tune() with your own make_batch"
        )
    if getattr(loader, "batch_size", None) != b:
        raise ConfigError(
            f"the train dataloader's batch size is {getattr(loader, 'batch_size', None)!r} after setting "
            f"{attr} = {b}: it does not follow the attribute (a fixed batch_sampler, or batch_size=None); build "
            f"the DataLoader with batch_size=self.{attr}"
        )


BATCH_COUNTS = ("limit_train_batches", "val_check_interval")
"""The Trainer's settings that an int makes a count of train loader batches (a float is a share of the epoch)."""


def _rescale_batch_counts(trainer: Any, original: int, b: int, epoch: tuple[int, bool] | None) -> list[str]:
    """Each of :data:`BATCH_COUNTS` given as an int, a count of loader batches of ``original`` rows, set to the same
    rows in batches of the knee's ``b`` (a run without the callback trained 10 batches of 8 an epoch; at b_m 4 the
    same 10 batches held half the rows, and its optimizer steps with them); one that does not divide is warned of.
    ``epoch`` = (rows a rank's loader holds, drop_last): ``val_check_interval`` is kept within the batches an epoch
    then has (a partial last batch counted whole made 3 batches of 8 over 20 rows 6 of 4, and Lightning refused it:
    5 there are). Not under ``fast_dev_run`` (its one batch is Lightning's). The lines that say what changed."""
    import math
    import warnings

    said: list[str] = []
    if getattr(trainer, "fast_dev_run", False) or b == original:
        return said
    available = None if epoch is None else (epoch[0] // b if epoch[1] else math.ceil(epoch[0] / b))
    for name in BATCH_COUNTS:
        value = getattr(trainer, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        rows = value * original
        new = rows // b
        if rows % b:
            warnings.warn(
                f"{name}={value} counts loader batches of {original} rows ({rows} rows); at the knee's b_m {b} no whole "
                f"number of batches holds them, so it is left at {value} ({value * b} rows): give {name} as a share "
                "of the epoch (a float) or a count of batches of the knee",
                RuntimeWarning,
                stacklevel=3,
            )
            new = value
        if name == "val_check_interval" and available is not None:
            limit = trainer.limit_train_batches
            most = (
                min(available, limit) if isinstance(limit, int) and not isinstance(limit, bool) else available
            )
            new = min(new, max(1, most))
        if new != value:
            setattr(trainer, name, new)
            said.append(f"{name} {value} → {new}: the same rows ({min(rows, new * b)}) in batches of {b}")
    return said


def _epoch_rows(loader: Any, world: int) -> tuple[int, bool] | None:
    """(rows one rank's share of the loader's dataset holds, the loader's drop_last), None where unknown."""
    import math

    try:
        return math.ceil(len(loader.dataset) / world), bool(getattr(loader, "drop_last", False))
    except TypeError:  # a dataset without a length
        return None


def _warn_mean_of_means(g: int) -> None:
    """Warn that ``g`` accumulated micro-batches make a per-token mean loss a mean of micro-batch means."""
    import warnings

    warnings.warn(
        f"KneeBatchSize set accumulate_grad_batches = {g} on a batch with per-token labels: Lightning averages the "
        f"{g} micro-batches' losses, so a loss that is a mean over tokens becomes a mean of {g} micro-batch means, "
        "another gradient than the unaccumulated step's where their token counts differ; divide the loss's sum by "
        "the step's token count, or keep the batch whole and split it only on out-of-memory with "
        "SplitOnOOM(count_fn=lambda batch: (batch['labels'] != -100).sum()) (batch[1] for an (x, y) batch)",
        RuntimeWarning,
        stacklevel=3,
    )
