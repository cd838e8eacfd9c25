"""Bytes per pipeline stage: weights, gradients, optimizer state, activations, other.

Peak = model state (:mod:`microbatch.predict.state`: 16 or 18 bytes per parameter with
mixed-precision Adam, sharded by ZeRO) + the activations of the micro-batches in flight
(:mod:`microbatch.predict.activations`: Korthikanti et al. 2022 §4, linear in b_m) + other.
A pipeline stage holds the activations of as many micro-batches as its schedule keeps in
flight: GPipe m; 1F1B min(m, p − i) on stage i; ZB-H1 min(m, p) on every stage (Qi et al. 2024
Table 2: the same p·M_B peak as 1F1B's first stage, but deferred W passes keep it on all); interleaved
1F1B with v > 1 the Megatron-core warm-up count, which on the first stage is L layers' worth
times 1 + (p−1)/(p·v) (Korthikanti et al. 2022 §4.2.3).

Every figure can be scaled by a :class:`MemoryCalibration` (activation scale, fixed offset), which
a later calibration from measurements fills in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from microbatch.errors import (
    ConfigError,
    check_instance,
    check_non_negative,
    check_positive_int,
    plain_numbers,
)
from microbatch.model import ModelShape, check_seq
from microbatch.precision import (
    get_fp8_recipe,
    get_precision,
    loss_bytes,
    saves_fp8_inputs,
    weight_cache_bytes,
)
from microbatch.predict.activations import (
    block_activation_bytes,
    check_recompute,
    embedding_activation_bytes,
    output_activation_bytes,
    stage_block_bytes,
)
from microbatch.predict.context import check_context_layout
from microbatch.predict.experts import check_expert_layout, dispatch_bytes, expert_load, expert_params
from microbatch.predict.recompute import check_every_kth
from microbatch.predict.stages import rank_moe_blocks, split_layers, stage_params
from microbatch.predict.state import (
    check_hybrid,
    check_pipeline_grad_reduce,
    check_zero,
    config_bytes_per_param,
    model_state_bytes,
    resident_zero,
    zero_groups,
)
from microbatch.schedules import registry
from microbatch.schedules.registry import in_flight_layers  # the schedules' in-flight rule, one registry
from microbatch.shape import check_tensor_parallel

__all__ = [
    "MemoryCalibration", "MemoryConfig", "StageMemory", "MemoryEstimate", "split_layers", "in_flight_layers",
    "stage_params", "estimate_memory",
]  # fmt: skip


# -- configuration and estimate ----------------------------------------------------------------------------
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
class MemoryConfig:
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
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1."""
    layers_per_stage: tuple[int, ...] | None = None
    """An uneven split of the layers over the stages; None means even (remainder to the last stages)."""
    data_parallel: int = 1
    """d: data-parallel replicas (ZeRO shards over them, or over groups of ``shard_degree``)."""
    zero: int = 0
    """ZeRO stage 0–3 (1 = Megatron's distributed optimizer)."""
    precision: str = "bf16-mixed"
    """bf16-mixed, fp16-mixed or fp32."""
    grad_dtype: str = "half"
    """Gradient type under mixed precision: half (16 B/param with Adam) or fp32 (18 B/param)."""
    optimizer: str = "adamw"
    """adamw, sgd, sgd-plain or lion (:data:`microbatch.predict.state.OPTIMIZERS`)."""
    moments_dtype: str = "fp32"
    """The optimizer's moment buffers: fp32 or bf16 (:data:`microbatch.predict.state.MOMENT_DTYPES`)."""
    master_weights: str = "fp32"
    """Mixed precision's master copy: fp32, remainder (2 B) or none (:data:`microbatch.predict.state.MASTER_WEIGHTS`)."""
    loss_dtype: str = "fp32"
    """The logits the loss keeps: fp32 (upcast) or half (:data:`microbatch.precision.LOSS_DTYPES`)."""
    recompute: str = "none"
    """Activation recomputation: none, selective, full."""
    flash_attention: bool | None = None
    """Flash attention; None means the model's setting."""
    expert_parallel: int = 1
    """EP: GPUs the routed experts are spread over, inside the data-parallel × context-parallel group (EP
    divides d·c and E; :mod:`microbatch.predict.experts`)."""
    recompute_every: int = 1
    """With ``recompute="full"``: K, full recompute of one layer in K (the others keep everything)."""
    fp8_recipe: str = "tensorwise"
    """With ``precision="fp8"``: the scaling recipe. Transformer Engine's (``te-delayed``, ``te-current``) cache the
    FP8 weights and transposes and save the linear layers' inputs in FP8; torchao's keep the weights and the saved
    activations in bf16 (:mod:`microbatch.precision`)."""
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
        get_fp8_recipe(self.fp8_recipe)
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
        self.state_bytes_per_param()  # validates the precision and the four state settings
        loss_bytes(self.loss_dtype, self.precision)
        check_recompute(self.recompute)
        if self.schedule not in registry.schedule_names(in_flight=True):
            raise ConfigError(
                f"schedule {self.schedule!r} is not known; use one of {', '.join(registry.schedule_names(in_flight=True))}"
            )
        if self.virtual > 1 and registry.get_spec(self.schedule).stages_per_rank == 1:
            raise ConfigError(
                f"virtual {self.virtual} needs interleaved 1F1B, not schedule {self.schedule}; "
                "use schedule interleaved-1f1b or virtual 1",
                params=("virtual", "schedule"),
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

    def state_bytes_per_param(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer) bytes per parameter before sharding (:mod:`microbatch.predict.state`)."""
        return config_bytes_per_param(self)

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
        check_expert_layout(
            shape, self.expert_parallel, self.data_parallel * self.context_parallel, self.capacity_factor
        )
        flash = shape.flash_attention if self.flash_attention is None else self.flash_attention
        check_context_layout(self.seq or shape.seq, self.context_parallel, flash)


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """The bytes one GPU of one pipeline stage holds at its peak."""

    stage: int
    """Stage index i (0 = first)."""
    layers: int
    """Transformer layers on the stage."""
    params: float
    """Parameters this GPU holds (after tensor parallelism, before ZeRO sharding)."""
    in_flight: int
    """Micro-batches in flight at the peak."""
    weights_bytes: float
    """Weight bytes."""
    gradients_bytes: float
    """Gradient bytes."""
    optimizer_bytes: float
    """Optimizer-state bytes (master weights and moments)."""
    activations_bytes: float
    """Activation bytes at the peak (all in-flight micro-batches)."""
    other_bytes: float
    """Buffers: ZeRO-3 gathered layers (not under a pipeline: :func:`~microbatch.predict.state.resident_zero`),
    the calibration's fixed offset."""
    activation_terms: dict[str, float] = field(default_factory=dict)
    """``activations_bytes`` split into transformer layers, embedding, output/loss, recompute working set
    (bytes by term)."""

    @property
    def state_bytes(self) -> float:
        """Model state: weights + gradients + optimizer state."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> float:
        """Everything the stage holds at its peak."""
        return self.state_bytes + self.activations_bytes + self.other_bytes

    def breakdown(self) -> dict[str, float]:
        """The five JSON terms (bytes): weights, gradients, optimizer, activations, other."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "other": self.other_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the peak, its five terms (``memory``) and the activation terms, in bytes."""
        return {
            "stage": self.stage,
            "layers": self.layers,
            "params": self.params,
            "in_flight": self.in_flight,
            "peak_memory_bytes": self.peak_bytes,
            "memory": self.breakdown(),
            "activation_terms": dict(self.activation_terms),
        }


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-stage memory of one configuration."""

    shape: ModelShape
    """The model."""
    config: MemoryConfig
    """The configuration."""
    stages: tuple[StageMemory, ...]
    """One entry per pipeline stage."""

    @property
    def peak_stage(self) -> StageMemory:
        """The stage with the highest peak."""
        return max(self.stages, key=lambda st: st.peak_bytes)

    @property
    def peak_bytes(self) -> float:
        """The highest peak over the stages."""
        return self.peak_stage.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the configuration in effect, the peak stage's terms and every stage."""
        peak = self.peak_stage
        cfg = self.config
        return {
            "model": self.shape.name,
            "model_shape": self.shape.to_dict(),
            "config": {
                "micro_batch": cfg.micro_batch,
                "seq": cfg.seq or self.shape.seq,
                "tensor_parallel": cfg.tensor_parallel,
                "sequence_parallel": cfg.sequence_parallel,
                "pipeline_parallel": cfg.pipeline_parallel,
                "virtual": cfg.virtual,
                "microbatches": cfg.m,
                "schedule": cfg.schedule,
                "data_parallel": cfg.data_parallel,
                "zero": cfg.zero,
                "precision": cfg.precision,
                "fp8_recipe": cfg.fp8_recipe if cfg.precision == "fp8" else None,
                "grad_dtype": cfg.grad_dtype,
                "optimizer": cfg.optimizer,
                "moments_dtype": cfg.moments_dtype,
                "master_weights": cfg.master_weights,
                "loss_dtype": cfg.loss_dtype,
                "recompute": cfg.recompute,
                "recompute_every": cfg.recompute_every,
                "expert_parallel": cfg.expert_parallel,
                "context_parallel": cfg.context_parallel,
                "shard_degree": cfg.shard_degree,
                "capacity_factor": cfg.capacity_factor,
                "expert_imbalance": cfg.expert_imbalance,
                "pipeline_grad_reduce": cfg.pipeline_grad_reduce,
                "flash_attention": self.shape.flash_attention
                if cfg.flash_attention is None
                else cfg.flash_attention,
            },
            "peak_stage": peak.stage,
            "peak_memory_bytes": peak.peak_bytes,
            "memory": peak.breakdown(),
            "stages": [st.to_dict() for st in self.stages],
        }


def _stage_state(
    shape: ModelShape, config: MemoryConfig, i: int, n_layers: int, last: int, k: int
) -> tuple[float, dict[str, float]]:
    """(parameters this GPU of stage ``i`` holds, its model-state bytes by term): the stage's ``n_layers`` blocks,
    ``k`` of them MoE blocks (:func:`rank_moe_blocks`: where the placement puts them), the embedding on rank 0 and the
    output layer on rank ``last`` (rank 0 again under a V placement), over t; routed experts sharded over EP and
    their state over d·c/EP, the rest's over d·c (d·c, or HSDP's group)."""
    p, t, ep = config.pipeline_parallel, config.tensor_parallel, config.expert_parallel
    d = zero_groups(config.data_parallel, config.context_parallel, config.shard_degree)[0]
    params = stage_params(shape, i, p, n_layers, t, moe_blocks=k)
    blocks = shape.blocks_params(n_layers, k)
    if last != p - 1:  # a V placement (dualpipev): the output layer comes back to rank 0
        head = shape.output_params() if i == last else 0
        params = (blocks + shape.embedding_params() * (i == 0) + head) / t
    experts = expert_params(shape, 0, n_layers, k) / t  # sharded over EP, its state over d/EP
    params += experts / ep - experts
    kw = dict(precision=config.precision, grad_dtype=config.grad_dtype, optimizer=config.optimizer,
              moments=config.moments_dtype, master=config.master_weights)  # fmt: skip
    z = resident_zero(config.zero, p, config.pipeline_grad_reduce)  # under a pipeline: ZeRO-1's (or -2's)
    state = model_state_bytes(params - experts / ep, zero=z, data_parallel=d, **kw)
    if experts:
        est = model_state_bytes(experts / ep, zero=z, data_parallel=d // ep, **kw)
        state = {k: state[k] + est[k] for k in state}
    # Transformer Engine's FP8 weights and transposes, cached whole over the step (not sharded by ZeRO)
    cache = weight_cache_bytes(config.precision, config.fp8_recipe)
    if cache:
        state["weights"] += cache * (blocks / t - experts + experts / ep)
    return params, state


def _at_seq(shape: ModelShape, seq: int | None) -> ModelShape:
    """``shape`` at the planned length ``seq``, checked as PlanConfig and ``--seq`` check it (a learned position
    table is at most its length, and is sized to it)."""
    if seq is None or seq == shape.seq:
        return shape
    check_seq(shape, seq)
    return shape.with_seq(seq)


def _blocks(shape: ModelShape, config: MemoryConfig, seq: int, e: int) -> tuple[float, float, float | None]:
    """(bytes a block keeps, the recompute working set, a dense block's bytes where a MoE model has dense blocks too)
    at ``seq`` tokens a GPU (:func:`~microbatch.predict.activations.block_activation_bytes`)."""
    kw: dict[str, Any] = dict(
        seq=seq, tensor_parallel=config.tensor_parallel, sequence_parallel=config.sequence_parallel,
        recompute=config.recompute, flash_attention=config.flash_attention, dtype_bytes=e,
        expert_load=config.expert_load, fp8_inputs=saves_fp8_inputs(config.precision, config.fp8_recipe),
        recompute_every=config.recompute_every,
    )  # fmt: skip
    per_layer, working = block_activation_bytes(shape, config.micro_batch, **kw)
    blended = shape.moe is not None and shape.moe_layer_count(0, shape.layers) < shape.layers
    dense = block_activation_bytes(shape.dense_block(), config.micro_batch, **kw)[0] if blended else None
    return per_layer, working, dense


def estimate_memory(
    shape: ModelShape, config: MemoryConfig, calibration: MemoryCalibration | None = None
) -> MemoryEstimate:
    """Predict every pipeline stage's peak bytes for ``shape`` trained as ``config``.

    Peak = model state (after ZeRO) + in-flight activations (layers, plus the embedding's on the
    first stage and the output layer's and loss's on the last) + other. Full and per-op recompute add the
    working set of the layer being recomputed, what it re-materialises beyond what it keeps
    (:func:`~microbatch.predict.recompute.recompute_working`); ZeRO-3 adds two
    gathered layers (the current and the prefetched one); ZeRO-2/3 under a pipeline hold ZeRO-1's state
    (:func:`~microbatch.predict.state.resident_zero`). Assumes all peaks coincide (they nearly
    do: activations peak at the end of the warm-up, while the state is resident throughout).
    """
    check_instance("shape", shape, ModelShape, "estimate_memory(shape, config): a ModelShape first")
    check_instance("config", config, MemoryConfig, "estimate_memory(shape, config): a MemoryConfig second")
    cal = calibration or MemoryCalibration()
    check_instance("calibration", cal, MemoryCalibration, "build MemoryCalibration(...) or leave it out")
    shape = _at_seq(shape, config.seq)
    config.validate_for(shape)
    p, t, m, v = config.pipeline_parallel, config.tensor_parallel, config.m, config.virtual
    split = split_layers(shape.layers, p, config.layers_per_stage)
    e = get_precision(config.precision).weight_bytes  # activations are kept in the compute dtype
    c = config.context_parallel  # each GPU holds s/c tokens of every sequence
    seq, sp = (config.seq or shape.seq) // c, config.sequence_parallel
    load = config.expert_load
    per_layer, working, dense = _blocks(shape, config, seq, e)  # the largest block's working set
    place = registry.get_spec(config.schedule).placement if p > 1 else "loop"  # where the dense blocks are
    ks = rank_moe_blocks(shape, split, v, place)  # each rank's MoE blocks
    w_bytes = config.state_bytes_per_param()[0]
    stages: list[StageMemory] = []
    last = registry.stage_ranks(config.schedule, p, v)[-1] if p > 1 else 0  # rank of the output layer
    ep = config.expert_parallel
    d = zero_groups(config.data_parallel, c, config.shard_degree)[0]  # state shards over d·c (or HSDP's)
    for i, n_layers in enumerate(split):
        params, state = _stage_state(shape, config, i, n_layers, last, ks[i])
        held = registry.in_flight_microbatches(config.schedule, i, p, m, v)
        per = per_layer if dense is None else stage_block_bytes(per_layer, dense, n_layers, ks[i]) / n_layers
        terms = {"layers": per * in_flight_layers(config.schedule, i, p, m, v, n_layers)}
        if i == 0:
            emb = embedding_activation_bytes(
                shape, config.micro_batch, seq=seq, tensor_parallel=t, sequence_parallel=sp
            )
            terms["embedding"] = emb * held
        if i == last:
            out = output_activation_bytes(
                shape, config.micro_batch, seq=seq, tensor_parallel=t, sequence_parallel=sp, dtype_bytes=e,
                logits_bytes=loss_bytes(config.loss_dtype, config.precision),
            )  # fmt: skip
            terms["output"] = out * held
        if working:
            terms["recompute_working"] = working
        terms = {k: val * cal.activation_scale for k, val in terms.items()}
        other = cal.fixed_bytes
        if resident_zero(config.zero, p, config.pipeline_grad_reduce) >= 3 and d > 1:
            other += 2 * shape.layer_params() / t * w_bytes
        if ep > 1:  # the all-to-all send and receive buffers of the layer in flight
            other += 2 * dispatch_bytes(shape, config.micro_batch, seq, dtype_bytes=e, load=load)
        stages.append(
            StageMemory(
                stage=i,
                layers=n_layers,
                params=params,
                in_flight=held,
                weights_bytes=state["weights"],
                gradients_bytes=state["gradients"],
                optimizer_bytes=state["optimizer"],
                activations_bytes=sum(terms.values()),
                other_bytes=other,
                activation_terms=terms,
            )
        )
    return MemoryEstimate(shape=shape, config=config, stages=tuple(stages))
