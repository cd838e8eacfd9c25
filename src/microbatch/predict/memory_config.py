"""What :func:`microbatch.predict.memory.estimate_memory` reads: how one model is trained (:class:`MemoryConfig`,
checked against the model) and the corrections a calibration sets (:class:`MemoryCalibration`)."""

from __future__ import annotations

from dataclasses import dataclass

from microbatch.errors import (
    ConfigError,
    check_non_negative,
    check_positive_int,
    plain_numbers,
)
from microbatch.model import ModelShape
from microbatch.predict.activations import (
    check_recompute,
)
from microbatch.predict.context import check_context_layout
from microbatch.predict.experts import check_expert_layout, ep_group_words, expert_load
from microbatch.predict.recompute import check_every_kth
from microbatch.predict.stages import check_unpipelined, split_layers
from microbatch.predict.state import (
    StateSettings,
    check_bf16_fp32_zero,
    check_hybrid,
    check_pipeline_grad_reduce,
    check_zero,
    reduce_bytes,
    zero_groups,
)
from microbatch.schedules import registry
from microbatch.schedules.in_flight import served_spec
from microbatch.shape import check_tensor_parallel

__all__ = ["MemoryCalibration", "MemoryConfig"]


@dataclass(frozen=True, kw_only=True)
class MemoryCalibration:
    """Corrections a calibration from measurements sets; the defaults leave the analytic model as is."""

    activation_scale: float = 1.0
    """Multiplies every activation term (allocator rounding, kernels that keep extra buffers)."""
    fixed_bytes: float = 0.0
    """Added to every stage (CUDA context, allocator cache, communication buffers)."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        for name in ("activation_scale", "fixed_bytes"):
            check_non_negative(name, getattr(self, name))  # a bool or a str ("1.3") is refused too


@dataclass(frozen=True, kw_only=True)
class MemoryConfig(StateSettings):
    """How one model is trained: what the memory of each pipeline stage depends on."""

    micro_batch: int
    """b_m: sequences per micro-batch."""
    seq: int | None = None
    """Sequence length; None means the model's."""
    tensor_parallel: int = 1
    """t: tensor-parallel ranks (must divide heads and kv heads)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norm and dropout activations split by t too."""
    pipeline_parallel: int = 1
    """p: pipeline stages (at most the number of layers)."""
    virtual: int = 1
    """v: model chunks per pipeline rank (interleaved 1F1B)."""
    microbatches: int | None = None
    """m: micro-batches per pipeline flush; None means 4p (seed 002's rule of thumb m >= 4p)."""
    schedule: str = "1f1b"
    """Pipeline schedule: a registry name or alias with an in-flight rule (gpipe, 1f1b, interleaved-1f1b, zb-h1,
    dualpipev, and any registered with one: :func:`microbatch.schedules.in_flight.served_spec`)."""
    layers_per_stage: tuple[int, ...] | None = None
    """An uneven split of the layers over the stages; None means even (remainder to the last stages)."""
    data_parallel: int = 1
    """d: data-parallel replicas (ZeRO shards over them, or over groups of ``shard_degree``)."""
    zero: int = 0
    """ZeRO stage 0–3 (1 = Megatron's distributed optimizer)."""
    recompute: str = "none"
    """Activation recomputation: none, selective, full."""
    flash_attention: bool | None = None
    """Flash attention; None means the model's setting."""
    expert_parallel: int = 1
    """EP: GPUs the routed experts are spread over, inside the data-parallel × context-parallel group (EP
    divides d·c and E; :mod:`microbatch.predict.experts`)."""
    recompute_every: int = 1
    """With ``recompute="full"``: K, full recompute of one layer in K (the others keep everything)."""
    context_parallel: int = 1
    """c: GPUs each sequence is split over (ring attention, :mod:`microbatch.predict.context`); 2c divides s."""
    shard_degree: int | None = None
    """Hybrid sharding: ZeRO shards over groups of this many data-parallel ranks (× c); None: all d·c
    (:func:`microbatch.predict.state.zero_groups`)."""
    capacity_factor: float | None = None
    """MoE token capacity per expert over the balanced share (GShard); None means dropless."""
    expert_imbalance: float = 1.0
    """Dropless MoE: the most loaded GPU's routed rows over the balanced share (1: even, the assumption)."""
    pipeline_grad_reduce: str = "last"
    """ZeRO-2/3 under a pipeline: gradients reduce-scattered after the last micro-batch (whole until then) or
    after each (a shard kept): :func:`microbatch.predict.state.resident_zero`."""
    zero3_impl: str = "fsdp2"
    """Who runs ZeRO-3, as the plan's (:attr:`microbatch.predict.plan_config.PlanConfig.zero3_impl`)."""
    reduce_dtype: str = "auto"
    """What its reduce-scatter moves, as the plan's: :meth:`zero3_reduce_bytes`."""

    def zero3_reduce_bytes(self) -> int:
        """Bytes per gradient element ZeRO-3 reduces in (:func:`microbatch.predict.state.reduce_bytes`; FSDP2 under a
        pipeline whatever ``zero3_impl`` says)."""
        impl = "fsdp2" if self.pipeline_parallel > 1 else self.zero3_impl
        return reduce_bytes(self.reduce_dtype, impl, self.state_bytes_per_param()[1])

    def __post_init__(self) -> None:
        plain_numbers(self)
        check_positive_int("micro_batch", self.micro_batch, fix="b_m counts whole sequences")
        check_pipeline_grad_reduce(self.pipeline_grad_reduce, self.pipeline_parallel, (self.zero,))
        check_positive_int("expert_parallel", self.expert_parallel)
        check_positive_int("context_parallel", self.context_parallel)
        check_positive_int("recompute_every", self.recompute_every)
        if self.recompute_every > 1 and self.recompute != "full":
            raise ConfigError(
                f"recompute_every {self.recompute_every} is full recomputation of one layer in K; give recompute "
                "full with it, or drop recompute_every",
                params=("recompute_every", "recompute"),
            )
        expert_load(self.capacity_factor, self.expert_imbalance)  # validates both
        if self.seq is not None:
            check_positive_int("seq", self.seq)
        for name in ("tensor_parallel", "pipeline_parallel", "virtual", "data_parallel"):
            check_positive_int(name, getattr(self, name))
        zero_groups(self.data_parallel, self.context_parallel, self.shard_degree)  # validates shard_degree
        check_hybrid(self.shard_degree, self.expert_parallel, (self.zero,))
        if self.microbatches is not None:
            check_positive_int("microbatches", self.microbatches)
        check_zero(self.zero)
        self.check_settings()  # the precision, the four state settings, the loss's dtype and kernel, the FP8 recipe
        group, replicas = zero_groups(self.data_parallel, self.context_parallel, self.shard_degree)
        check_bf16_fp32_zero(self.grad_dtype, (self.zero,), group, replicas > 1)
        check_recompute(self.recompute)
        object.__setattr__(self, "schedule", served_spec(self.schedule).name)  # an alias read as its name
        if self.virtual > 1 and registry.get_spec(self.schedule).stages_per_rank == 1:
            raise ConfigError(
                f"virtual {self.virtual} needs interleaved 1F1B, not schedule {self.schedule}; "
                "use schedule interleaved-1f1b or virtual 1",
                params=("virtual", "schedule"),
            )
        check_unpipelined(
            self.pipeline_parallel,
            (self.schedule,),
            (self.virtual,),
            ("schedule", "virtual", "pipeline_parallel"),
        )
        if self.pipeline_parallel > 1:  # the schedule's own (p, m, v) rule, as bubble and simulate apply it
            registry.check_servable(self.schedule, self.pipeline_parallel, self.m, self.virtual)
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError(
                "sequence_parallel needs tensor_parallel > 1; give tensor_parallel or drop sequence_parallel",
                params=("sequence_parallel", "tensor_parallel"),
            )

    @property
    def m(self) -> int:
        """Micro-batches per flush in effect."""
        return self.microbatches or 4 * self.pipeline_parallel

    @property
    def expert_load(self) -> float:
        """Routed rows over the balanced share: the capacity factor, or the imbalance when dropless."""
        return expert_load(self.capacity_factor, self.expert_imbalance)

    def validate_for(self, shape: ModelShape) -> None:
        """The rules that need the model: t divides heads (and kv heads), p ≤ layers, p·v divides layers."""
        t, p, v = self.tensor_parallel, self.pipeline_parallel, self.virtual
        check_tensor_parallel(shape, t)
        check_every_kth(self.recompute_every, shape.layers, self.pipeline_parallel, self.layers_per_stage)
        if p > shape.layers:
            raise ConfigError(
                f"pipeline-parallel {p} > layers {shape.layers}; every stage needs at least one layer; "
                f"use at most {shape.layers} stages"
            )
        if self.layers_per_stage is not None:  # a well-formed split before any rule reads it
            split_layers(shape.layers, p, self.layers_per_stage)
        fixed = registry.get_spec(self.schedule).stages_per_rank
        if v > 1 and shape.layers % (p * v) and fixed is not None:  # a V schedule: v is not a choice
            ok = [x for x in range(1, shape.layers // v + 1) if shape.layers % (v * x) == 0]
            raise ConfigError(
                f"{self.schedule} needs layers {shape.layers} divisible by {v} × stages {p} = {v * p} "
                f"({'two' if v == 2 else v} chunks per rank); use stages among {ok}"
            )
        if v > 1 and self.layers_per_stage is not None and fixed is None:  # interleaved over uneven stages
            if v > min(self.layers_per_stage):
                raise ConfigError(
                    f"interleaved 1F1B with virtual {v} over layers per stage {list(self.layers_per_stage)} leaves "
                    f"a chunk without a layer; use virtual at most {min(self.layers_per_stage)}"
                )
        elif v > 1 and shape.layers % (p * v):
            ok = [x for x in range(2, shape.layers // p + 1) if shape.layers % (p * x) == 0]
            raise ConfigError(
                f"interleaved 1F1B needs layers {shape.layers} divisible by stages {p} × virtual {v} = {p * v}; "
                f"use virtual among {ok or 'none (no v > 1 fits)'}"
            )
        d, c = self.data_parallel, self.context_parallel
        check_expert_layout(shape, self.expert_parallel, d * c, self.capacity_factor, ep_group_words(d, c))
        flash = shape.flash_attention if self.flash_attention is None else self.flash_attention
        check_context_layout(self.seq or shape.seq, self.context_parallel, flash)
