"""Bytes per pipeline stage: weights, gradients, optimizer state, activations, other.

Two halves. **Model state** is fixed by the parameter count and the numerics; the two common
mixed-precision conventions are named, not hidden behind one flag:

- ``bf16-mixed`` (or ``fp16-mixed``) with **half-precision gradients**: 2 (weights) + 2
  (gradients) + 12 (fp32 master weights and the two Adam moments) = **16 bytes per parameter**
  (Rajbhandari et al., ZeRO, SC20, §3.1: "K = 12").
- the same with **fp32 gradient accumulation**: 2 + 4 + 12 = **18 bytes** (Megatron-LM,
  Korthikanti et al. 2022 Table 3 note; Megatron's distributed-optimizer doc table).
- ``fp32``: 4 + 4 + 8 (two Adam moments) = 16 bytes.

SGD keeps one momentum buffer instead of two moments. ZeRO stage 1 shards the optimizer state
over the d data-parallel replicas (Megatron's *distributed optimizer* is this), stage 2 also the
gradients, stage 3 also the weights.

**Activations** follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198, §4), written term by term so that grouped-query
attention, a gated MLP, an MLP width other than 4h and training without dropout change the
right terms; for a GPT block with dropout they reduce exactly to the paper's
``s·b·h·(34 + 5·a·s/h)`` per layer (and its tensor/sequence-parallel and selective forms).
They are linear in b_m. Flash attention (or selective recompute) drops the ``5·a·s²·b`` term.
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

from microbatch.errors import ConfigError, check_non_negative, check_positive_int
from microbatch.model import ModelShape

__all__ = [
    "PRECISIONS",
    "GRAD_DTYPES",
    "OPTIMIZERS",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "MemoryCalibration",
    "MemoryConfig",
    "StageMemory",
    "MemoryEstimate",
    "bytes_per_param",
    "model_state_bytes",
    "layer_activation_terms",
    "layer_activation_bytes",
    "embedding_activation_bytes",
    "output_activation_bytes",
    "split_layers",
    "in_flight_layers",
    "interleaved_first_stage_factor",
    "stage_params",
    "estimate_memory",
]

PRECISIONS = ("bf16-mixed", "fp16-mixed", "fp32")
"""Training numerics: half-precision compute with fp32 master weights, or fp32 throughout."""
GRAD_DTYPES = ("half", "fp32")
"""Gradient buffer type under mixed precision: ``half`` (ZeRO paper, 16 B/param) or ``fp32`` (Megatron, 18)."""
OPTIMIZERS = ("adamw", "sgd")
"""Optimizers with a state-size rule (Adam/AdamW: two moments; SGD with momentum: one buffer)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation: none, selective (attention core only, Korthikanti §5), full (per layer)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
"""Pipeline schedules whose in-flight count this module knows."""


# -- model state ---------------------------------------------------------------------------------
def bytes_per_param(
    precision: str, grad_dtype: str = "half", optimizer: str = "adamw"
) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter before any sharding.

    Mixed precision keeps 2-byte weights, 2- or 4-byte gradients and fp32 master weights (4) plus
    the optimizer's fp32 buffers (Adam: 8; SGD momentum: 4) — ZeRO §3.1 (16 B with Adam) and
    Megatron (18 B with fp32 gradients). fp32 keeps 4 + 4 + buffers (no master copy). Ignores
    8-bit optimizers and fp32 gradient buffers kept next to half ones.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not known; use one of {', '.join(PRECISIONS)}")
    if grad_dtype not in GRAD_DTYPES:
        raise ConfigError(
            f"grad dtype {grad_dtype!r} is not known; use 'half' (16 B/param, ZeRO) or 'fp32' (18 B/param, Megatron)"
        )
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer {optimizer!r} is not known; use one of {', '.join(OPTIMIZERS)}")
    moments = 8 if optimizer == "adamw" else 4
    if precision == "fp32":
        return 4, 4, moments
    return 2, (2 if grad_dtype == "half" else 4), 4 + moments


def model_state_bytes(
    params: float,
    *,
    precision: str = "bf16-mixed",
    grad_dtype: str = "half",
    optimizer: str = "adamw",
    zero: int = 0,
    data_parallel: int = 1,
) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state for ``params`` parameters on one GPU.

    ZeRO (Rajbhandari et al. 2020, Fig. 1): stage 1 divides the optimizer state by d, stage 2
    also the gradients, stage 3 also the weights — 16, 4 + 12/d, 2 + 14/d, 16/d bytes per
    parameter with mixed-precision Adam. Ignores temporary buffers (all-gather, bucket copies).
    """
    _check_zero(zero)
    w, g, o = bytes_per_param(precision, grad_dtype, optimizer)
    d = data_parallel
    return {
        "weights": params * w / (d if zero >= 3 else 1),
        "gradients": params * g / (d if zero >= 2 else 1),
        "optimizer": params * o / (d if zero >= 1 else 1),
    }


def _check_zero(zero: object) -> int:
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise ConfigError(
            f"ZeRO stage {zero!r} is not known; use 0 (none), 1 (optimizer state; = distributed optimizer), "
            "2 (+ gradients) or 3 (+ weights)"
        )
    return zero


# -- activations per layer ----------------------------------------------------------------------------
def layer_activation_terms(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool | None = None,
    dtype_bytes: int = 2,
) -> dict[str, float]:
    """Bytes one transformer layer keeps for its backward, for one micro-batch, by term.

    Korthikanti et al. 2022 §4.1 term by term (s = seq, b = micro-batch, h = hidden, a = heads,
    t = tensor parallel; 2-byte activations, 1-byte dropout masks):

    - ``norms``: the two norm inputs, 4sbh; ``attention_input``: QKV input 2sbh; ``mlp_input``:
      first MLP linear input 2sbh — none split by t unless sequence parallel.
    - ``qkv``: Q, K, V 6sbh (K and V scaled by kv_heads/heads); ``attention_output``: the output
      projection input 2sbh — split by t.
    - ``attention_scores``: softmax output 2as²b, its dropout mask as²b and output 2as²b = 5as²b,
      split by t; dropped by flash attention or selective recompute. Flash attention keeps
      instead a 4-byte log-sum-exp per head and row (``attention_stats``), 4asb.
    - ``mlp_hidden``: activation input and output 2 × 2sbf (gated: gate, up and product, 3 × 2sbf),
      split by t (16sbh at f = 4h).
    - ``dropout_masks``: after attention and after the MLP, 2sbh·1 byte, not split unless SP.

    Full recompute keeps only the layer input, 2sbh (split by t with SP) (paper's Eq. for full
    recomputation). Ignores norm statistics (b·s floats), the RNG state, fused-kernel variations.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute {recompute!r} is not known; use one of {', '.join(RECOMPUTE_MODES)}")
    s = seq or shape.seq
    t = tensor_parallel
    b = micro_batch
    h, a, f = shape.hidden, shape.heads, shape.ffn
    sp = t if sequence_parallel else 1
    e = dtype_bytes
    sbh = s * b * h
    if recompute == "full":
        return {"layer_input": e * sbh / sp}
    flash = shape.flash_attention if flash_attention is None else flash_attention
    kv_frac = shape.kv / shape.heads
    terms = {
        "norms": 2 * e * sbh / sp,
        "attention_input": e * sbh / sp,
        "qkv": e * sbh * (1 + 2 * kv_frac) / t,
        "attention_output": e * sbh / t,
        "mlp_input": e * sbh / sp,
        "mlp_hidden": (3 if shape.gated_mlp else 2) * e * s * b * f / t,
        "dropout_masks": (2 * sbh / sp) if shape.dropout else 0.0,
    }
    if flash:
        terms["attention_stats"] = 4 * a * s * b / t
    elif recompute == "none":
        per_score = (2 * e + 1) if shape.dropout else e  # softmax out (+ dropout mask + dropout out)
        terms["attention_scores"] = per_score * a * s * s * b / t
    return terms


def layer_activation_bytes(shape: ModelShape, micro_batch: int, **kwargs) -> float:
    """Sum of :func:`layer_activation_terms`: bytes one layer keeps for one micro-batch."""
    return sum(layer_activation_terms(shape, micro_batch, **kwargs).values())


def embedding_activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """The input embedding's dropout mask, s·b·h bytes (/t with SP); zero without dropout.

    Korthikanti et al. 2022 §4.3. The embedding backward needs only the token ids.
    """
    if not shape.dropout:
        return 0.0
    s = seq or shape.seq
    return s * micro_batch * shape.hidden / (tensor_parallel if sequence_parallel else 1)


def output_activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
) -> float:
    """Final norm input and output-projection input (2 × e·sbh) plus fp32 logits 4·s·b·V/t.

    Korthikanti et al. 2022 §4.3 ("4sbh/t·(1 + v/h)" with SP and 2-byte activations); the logits
    are vocabulary-parallel, so split by t. Ignores the logits' gradient, a transient of the same size.
    """
    s = seq or shape.seq
    sp = tensor_parallel if sequence_parallel else 1
    return (
        2 * dtype_bytes * s * micro_batch * shape.hidden / sp
        + 4 * s * micro_batch * shape.vocab / tensor_parallel
    )


# -- pipeline stages ------------------------------------------------------------------------------------
def split_layers(
    layers: int, stages: int, layers_per_stage: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Layers on each stage: as given, or an even split with the remainder on the last stages.

    The first stage holds the most in-flight micro-batches (and the embedding), so extra layers go
    to the end.
    """
    check_positive_int("pipeline-parallel", stages)
    if stages > layers:
        raise ConfigError(
            f"pipeline-parallel {stages} > layers {layers}; every stage needs at least one layer; "
            f"use at most {layers} stages"
        )
    if layers_per_stage is not None:
        split = tuple(layers_per_stage)
        if (
            len(split) != stages
            or any(not isinstance(n, int) or n < 1 for n in split)
            or sum(split) != layers
        ):
            raise ConfigError(
                f"layers per stage {list(split)} must be {stages} whole numbers >= 1 summing to {layers}; "
                f"for example {list(split_layers(layers, stages))}"
            )
        return split
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if i >= stages - extra else 0) for i in range(stages))


def interleaved_first_stage_factor(stages: int, virtual: int) -> float:
    """1 + (p−1)/(p·v): first-stage activations of interleaved 1F1B, in units of L layers' worth.

    Korthikanti et al. 2022 §4.2.3; applies only when v > 1 (v = 1 is plain 1F1B: factor 1).
    """
    if virtual <= 1:
        return 1.0
    return 1 + (stages - 1) / (stages * virtual)


def in_flight_layers(
    schedule: str, stage: int, stages: int, microbatches: int, virtual: int, stage_layers: int
) -> float:
    """Layer-micro-batches of activations stage ``stage`` holds at its peak.

    - GPipe: all m micro-batches × the stage's layers (seed 002).
    - 1F1B: min(m, p − i) micro-batches (Narayanan et al. 2021).
    - ZB-H1: min(m, p) on every stage — rank i defers i + 1 weight-gradient passes, each holding its
      micro-batch's activations, on top of 1F1B's p − i (Qi et al. 2024 Table 2: peak p·M_B).
    - interleaved 1F1B, v > 1: torch's (and Megatron-core's) warm-up count 2(p − i − 1) + (v − 1)p, plus
      the one in steady state, model chunks of L_stage/v layers, at most m·v; on stage 0 this is
      L_stage·p·(1 + (p−1)/(p·v)).
    With one stage (no pipeline) a micro-batch's activations are freed by its own backward: 1.
    """
    if stages == 1:
        return float(stage_layers) * (microbatches if schedule == "gpipe" else 1)
    if schedule == "gpipe":
        return float(stage_layers * microbatches)
    if schedule == "zb-h1":
        return float(stage_layers * min(microbatches, stages))
    if schedule == "interleaved-1f1b" and virtual > 1:
        chunks = _interleaved_chunks(stage, stages, microbatches, virtual)
        return chunks * stage_layers / virtual
    return float(stage_layers * min(microbatches, stages - stage))


def _interleaved_chunks(stage: int, stages: int, microbatches: int, virtual: int) -> int:
    """Activation chunks stage ``stage`` holds under interleaved 1F1B: warm-up forwards plus one.

    torch's ScheduleInterleaved1F1B warm-up: (v − 1)·n + 2(p − 1 − i), where n = m // max(1, m // p)
    micro-batches per round (n = p when p divides m, Megatron-core's rule), capped at m·v.
    """
    per_round = microbatches // max(1, microbatches // stages)
    return min(microbatches * virtual, (virtual - 1) * per_round + 2 * (stages - 1 - stage) + 1)


def in_flight_microbatches(schedule: str, stage: int, stages: int, microbatches: int, virtual: int) -> int:
    """Micro-batches whose forward has started on ``stage`` but whose backward has not finished."""
    if stages == 1:
        return microbatches if schedule == "gpipe" else 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "zb-h1":
        return min(microbatches, stages)
    if schedule == "interleaved-1f1b" and virtual > 1:
        chunks = _interleaved_chunks(stage, stages, microbatches, virtual)
        return min(microbatches, -(-chunks // virtual))
    return min(microbatches, stages - stage)


def stage_params(
    shape: ModelShape, stage: int, stages: int, stage_layers: int, tensor_parallel: int = 1
) -> float:
    """Parameters one GPU of stage ``stage`` holds: its layers, plus embedding (first) and output (last).

    Megatron layout: the vocabulary-parallel embedding on the first stage, the final norm and
    output layer on the last; with tied embeddings and p > 1 the last stage keeps its own copy of
    the embedding matrix (synchronised by an all-reduce). Everything is divided by t; the few
    parameters tensor parallelism replicates (norms, row-parallel biases) are ignored.
    """
    n = stage_layers * shape.layer_params()
    if stage == 0:
        n += shape.embedding_params()
    if stage == stages - 1:
        n += shape.output_params()
        if shape.tied_embeddings and stages > 1:
            n += shape.vocab * shape.hidden
    return n / tensor_parallel


# -- configuration and estimate ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MemoryCalibration:
    """Corrections a calibration from measurements sets; the defaults leave the analytic model as is."""

    activation_scale: float = 1.0
    """Multiplies every activation term (allocator rounding, kernels that keep extra buffers)."""
    fixed_bytes: float = 0.0
    """Added to every stage (CUDA context, allocator cache, communication buffers)."""

    def __post_init__(self) -> None:
        check_non_negative("activation_scale", self.activation_scale)
        check_non_negative("fixed_bytes", self.fixed_bytes)


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
    """d: data-parallel replicas (ZeRO shards over them)."""
    zero: int = 0
    """ZeRO stage 0–3 (1 = Megatron's distributed optimizer)."""
    precision: str = "bf16-mixed"
    """bf16-mixed, fp16-mixed or fp32."""
    grad_dtype: str = "half"
    """Gradient type under mixed precision: half (16 B/param with Adam) or fp32 (18 B/param)."""
    optimizer: str = "adamw"
    """adamw or sgd."""
    recompute: str = "none"
    """Activation recomputation: none, selective, full."""
    flash_attention: bool | None = None
    """Flash attention; None means the model's setting."""

    def __post_init__(self) -> None:
        check_positive_int("micro-batch", self.micro_batch, fix="b_m counts whole sequences")
        if self.seq is not None:
            check_positive_int("seq", self.seq)
        for name in ("tensor_parallel", "pipeline_parallel", "virtual", "data_parallel"):
            check_positive_int(name.replace("_", "-"), getattr(self, name))
        if self.microbatches is not None:
            check_positive_int("microbatches", self.microbatches)
        _check_zero(self.zero)
        bytes_per_param(self.precision, self.grad_dtype, self.optimizer)  # validates the three
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(
                f"recompute {self.recompute!r} is not known; use one of {', '.join(RECOMPUTE_MODES)}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not known; use one of {', '.join(SCHEDULES)}")
        if self.virtual > 1 and self.schedule != "interleaved-1f1b":
            raise ConfigError(
                f"virtual {self.virtual} needs the interleaved-1f1b schedule (schedule is {self.schedule}); "
                "use --schedule interleaved-1f1b or --virtual 1"
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError(
                "sequence parallelism needs tensor-parallel > 1; give --tensor-parallel or drop it"
            )

    @property
    def m(self) -> int:
        """Micro-batches per flush in effect."""
        return self.microbatches or 4 * self.pipeline_parallel

    def validate_for(self, shape: ModelShape) -> None:
        """The rules that need the model: t divides heads (and kv heads), p ≤ layers, p·v divides layers."""
        t, p, v = self.tensor_parallel, self.pipeline_parallel, self.virtual
        if shape.heads % t:
            ok = [d for d in range(1, shape.heads + 1) if shape.heads % d == 0 and d <= 64]
            raise ConfigError(
                f"tensor-parallel {t} does not divide heads {shape.heads}; each rank needs whole heads; "
                f"use tensor-parallel among {', '.join(map(str, ok))}"
            )
        if shape.kv % t and t % shape.kv:
            raise ConfigError(
                f"tensor-parallel {t} and kv heads {shape.kv} neither divide the other; kv heads are split or "
                f"replicated across tensor ranks; use a tensor-parallel that divides or is a multiple of {shape.kv}"
            )
        if p > shape.layers:
            raise ConfigError(
                f"pipeline-parallel {p} > layers {shape.layers}; every stage needs at least one layer; "
                f"use at most {shape.layers} stages"
            )
        if v > 1 and shape.layers % (p * v):
            ok = [x for x in range(2, shape.layers // p + 1) if shape.layers % (p * x) == 0]
            raise ConfigError(
                f"interleaved 1F1B needs layers {shape.layers} divisible by stages {p} × virtual {v} = {p * v}; "
                f"use virtual among {ok or 'none (no v > 1 fits)'}"
            )
        if self.layers_per_stage is not None:
            split_layers(shape.layers, p, self.layers_per_stage)


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
    weights: float
    """Weight bytes."""
    gradients: float
    """Gradient bytes."""
    optimizer: float
    """Optimizer-state bytes (master weights and moments)."""
    activations: float
    """Activation bytes at the peak (all in-flight micro-batches)."""
    other: float
    """Buffers: ZeRO-3 gathered layers, the calibration's fixed offset."""
    activation_terms: dict[str, float] = field(default_factory=dict)
    """``activations`` split into transformer layers, embedding, output/loss, recompute working set."""

    @property
    def peak_bytes(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other

    def breakdown(self) -> dict[str, float]:
        """The five JSON terms: weights, gradients, optimizer, activations, other."""
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "other": self.other,
        }

    def to_dict(self) -> dict:
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
        return max(self.stages, key=lambda st: st.peak_bytes)

    @property
    def peak_bytes(self) -> float:
        return self.peak_stage.peak_bytes

    def to_dict(self) -> dict:
        peak = self.peak_stage
        cfg = self.config
        return {
            "model": self.shape.to_dict(),
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
                "grad_dtype": cfg.grad_dtype,
                "optimizer": cfg.optimizer,
                "recompute": cfg.recompute,
                "flash_attention": self.shape.flash_attention
                if cfg.flash_attention is None
                else cfg.flash_attention,
            },
            "peak_stage": peak.stage,
            "peak_memory_bytes": peak.peak_bytes,
            "memory": peak.breakdown(),
            "stages": [st.to_dict() for st in self.stages],
        }


def estimate_memory(
    shape: ModelShape, config: MemoryConfig, calibration: MemoryCalibration | None = None
) -> MemoryEstimate:
    """Predict every pipeline stage's peak bytes for ``shape`` trained as ``config``.

    Peak = model state (after ZeRO) + in-flight activations (layers, plus the embedding's on the
    first stage and the output layer's and loss's on the last) + other. Full recompute adds one
    layer's full activations as the working set of the layer being recomputed; ZeRO-3 adds two
    gathered layers (the current and the prefetched one). Assumes all peaks coincide (they nearly
    do: activations peak at the end of the warm-up, while the state is resident throughout).
    """
    cal = calibration or MemoryCalibration()
    config.validate_for(shape)
    p, t, m, v = config.pipeline_parallel, config.tensor_parallel, config.m, config.virtual
    split = split_layers(shape.layers, p, config.layers_per_stage)
    e = 4 if config.precision == "fp32" else 2
    act_kw = dict(
        seq=config.seq, tensor_parallel=t, sequence_parallel=config.sequence_parallel, dtype_bytes=e
    )
    per_layer = layer_activation_bytes(
        shape,
        config.micro_batch,
        recompute=config.recompute,
        flash_attention=config.flash_attention,
        **act_kw,
    )
    working = 0.0
    if config.recompute == "full":
        working = layer_activation_bytes(
            shape, config.micro_batch, recompute="none", flash_attention=config.flash_attention, **act_kw
        )
    emb_kw = dict(seq=config.seq, tensor_parallel=t, sequence_parallel=config.sequence_parallel)
    w_bytes = bytes_per_param(config.precision, config.grad_dtype, config.optimizer)[0]
    stages = []
    for i, n_layers in enumerate(split):
        params = stage_params(shape, i, p, n_layers, t)
        state = model_state_bytes(
            params,
            precision=config.precision,
            grad_dtype=config.grad_dtype,
            optimizer=config.optimizer,
            zero=config.zero,
            data_parallel=config.data_parallel,
        )
        held = in_flight_microbatches(config.schedule, i, p, m, v)
        terms = {"layers": per_layer * in_flight_layers(config.schedule, i, p, m, v, n_layers)}
        if i == 0:
            terms["embedding"] = embedding_activation_bytes(shape, config.micro_batch, **emb_kw) * held
        if i == p - 1:
            terms["output"] = (
                output_activation_bytes(shape, config.micro_batch, dtype_bytes=e, **emb_kw) * held
            )
        if working:
            terms["recompute_working"] = working
        terms = {k: val * cal.activation_scale for k, val in terms.items()}
        other = cal.fixed_bytes
        if config.zero >= 3 and config.data_parallel > 1:
            other += 2 * shape.layer_params() / t * w_bytes
        stages.append(
            StageMemory(
                stage=i,
                layers=n_layers,
                params=params,
                in_flight=held,
                weights=state["weights"],
                gradients=state["gradients"],
                optimizer=state["optimizer"],
                activations=sum(terms.values()),
                other=other,
                activation_terms=terms,
            )
        )
    return MemoryEstimate(shape=shape, config=config, stages=tuple(stages))
