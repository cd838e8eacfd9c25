"""One resolved pipeline run: everything a :class:`PipelineConfig` implies, derived once.

:func:`resolve` reads the config once: the model's shape, the registry entry that torch runs and the
one whose in-flight rule describes the run, the placement of the virtual stages on the ranks, the
stage split (layers per stage) where it is known before the model is built, torch's class and its
action order. The entry points resolve once (:func:`~microbatch.run.pipeline.launch.run_pipeline`,
:func:`~microbatch.run.pipeline.before_run.predict_run`, a worker's main) and hand the
:class:`ResolvedRun` down: every module of the run reads these facts from it instead of asking the
registry or the model table again; a rank builds its layers from it
(:func:`microbatch.run.pipeline.rank.build_full_model`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache

from microbatch.errors import ScheduleError
from microbatch.model import ModelShape
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.schedules.registry import ScheduleSpec, stage_ranks, torch_spec

__all__ = ["ResolvedRun", "resolve"]


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """A pipeline run with its config resolved once (see :func:`resolve`)."""

    cfg: PipelineConfig
    """The run as given."""
    shape: ModelShape | None
    """The built-in model's shape at the run's sequence length; None for a ``module:function`` factory."""
    spec: ScheduleSpec
    """The registry entry whose torch class runs the schedule (zb-h1: zb-interleaved, torch's
    ScheduleInterleavedZeroBubble with one stage per rank); ``cfg.schedule`` names the one asked."""
    rule: ScheduleSpec | None
    """The registry entry whose in-flight rule describes the run (ZB-H1's for torch's interleaved
    zero bubble with v = 1); None when only the simulator counts what a rank holds."""
    placement: tuple[int, ...]
    """Rank of every virtual stage (index = virtual stage)."""
    split: tuple[int, ...] | None
    """Layers (units: embedding, blocks, head) of every virtual stage, where they are known before
    the model is built: a built-in model split by parameter count
    (:func:`~microbatch.run.pipeline.split.shape_unit_params`). None for a ``module:function``
    factory (its layers are known only once it is built, on each rank) and for ``balance="time"``
    (rank 0 times the built layers and broadcasts the split)."""

    @cached_property
    def _order(self) -> tuple[Mapping[int, tuple[str, ...]] | None, ScheduleError | None]:
        from microbatch.schedules.torch_order import torch_order

        c = self.cfg
        try:
            order = torch_order(self.spec.name, c.stages, c.microbatches, c.virtual)
        except ScheduleError as e:
            return None, e
        return {r: tuple(acts) for r, acts in order.items()}, None

    @property
    def order(self) -> Mapping[int, tuple[str, ...]] | None:
        """torch's compute order of every rank (``"2F0"``, ``"1I3"``), derived on first use (its
        length is m·v per rank); None where it cannot be derived on this torch."""
        return self._order[0]

    @property
    def torch_class(self) -> str:
        """Name of the ``torch.distributed.pipelining`` class that runs the schedule."""
        return str(self.spec.torch_name)

    @property
    def factory(self) -> bool:
        """Whether the model is a ``module:function`` factory (no shape known before it is built)."""
        return self.shape is None

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one parameter or activation element in the run's dtype."""
        return 4 if self.cfg.dtype == "float32" else 2

    def stages_of(self, rank: int) -> list[int]:
        """Virtual stages that ``rank`` holds, in increasing order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def fed(self, rank: int) -> set[int]:
        """Stages of ``rank`` whose input arrives in a receive buffer: every stage but the first — from another rank,
        or from this rank's own previous stage in a V placement (the bottom of zbv's and DualPipeV's V), which torch
        hands over into the stage's buffer the same way and keeps per micro-batch (left out, rank p − 1 was
        under-predicted by (m − in-flight) inputs: +8.6% at zbv p 3, m 12, a review)."""
        return {s for s in self.stages_of(rank) if s > 0}

    @cached_property
    def splits_backward(self) -> bool:
        """Whether torch's order runs the backward split into input (I) and weight (W) gradients
        (:func:`microbatch.schedules.torch_order.splits_backward`); raises, as :meth:`torch_order`
        does, where the order cannot be derived."""
        from microbatch.schedules.torch_order import splits_backward

        return splits_backward(self.torch_order())

    def torch_order(self) -> dict[int, list[str]]:
        """torch's order as lists; the :class:`ScheduleError` of why it cannot be derived, if so."""
        order, error = self._order
        if order is None:
            raise error or ScheduleError(f"no torch order for {self.cfg.schedule}")
        return {r: list(acts) for r, acts in order.items()}


@lru_cache(maxsize=32)
def resolve(cfg: PipelineConfig) -> ResolvedRun:
    """The :class:`ResolvedRun` of ``cfg``, derived once per process (the config is frozen and
    hashable, so every later call returns the same value). An unknown built-in model raises the
    model table's :class:`~microbatch.errors.ConfigError`."""
    from microbatch.run.pipeline.config import builtin_shape
    from microbatch.run.pipeline.split import balanced_split, shape_unit_params
    from microbatch.schedules.torch_order import in_flight_spec

    shape = None if ":" in cfg.model else builtin_shape(cfg.model, cfg.seq)
    spec = torch_spec(cfg.schedule)
    rule = in_flight_spec(spec.name, cfg.virtual)
    placement = tuple(stage_ranks(spec.name, cfg.stages, cfg.virtual))
    split = None  # a model too shallow for p·v stages is refused by check_splittable, not here
    if shape is not None and cfg.balance == "params" and cfg.total_stages <= shape.layers + 2:
        split = tuple(balanced_split(shape_unit_params(shape), cfg.total_stages))
    return ResolvedRun(cfg=cfg, shape=shape, spec=spec, rule=rule, placement=placement, split=split)
