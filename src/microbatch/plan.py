"""The planner: enumerate micro-batching choices, predict memory and step time, recommend one.

For a model, an accelerator and a layout (d data-parallel replicas, p pipeline stages, t tensor
ranks) the planner holds B_global fixed and enumerates every b_m that divides B/d (so m = g =
B/(d·b_m) micro-batches per flush, one flush per step), every schedule that can serve (p, m, v),
every v for interleaved 1F1B, every recompute mode and every ZeRO stage — the joint search
DeepSpeed's autotuner runs by experiment. For each it predicts per-stage peak memory
(:mod:`microbatch.memory`), step time (:mod:`microbatch.roofline` plus the pipeline's bubble),
tokens/s and MFU, and whether it fits with the headroom asked. Screening uses closed forms;
the leading candidates (and any uneven split) are replayed with :func:`microbatch.simulate.simulate`.

Step time of one optimizer step (bottleneck stage k with forward F_k and backward B_k per
micro-batch, T_k = F_k + B_k; Narayanan et al. 2021 §2.2):

- GPipe and 1F1B: (m − 1)·T_k + Σ_i T_i  (= (m + p − 1)·T for equal stages);
- interleaved 1F1B: m·T_k + (p − 1)·T_k / v;
- ZB-H1: m·T_k + (p − 1)·(F_k + I_k − W_k), the backward split into input (I) and weight (W)
  gradients (Qi et al. 2024, Table 2);

plus the exposed data-parallel gradient reduction (overlapped with the last backward), ZeRO-2/3
communication per micro-step (overlapped with compute where shorter), and the optimizer update.

The library never prints: :func:`plan_table_rows` and :func:`explain` give text for the CLI
and the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .batch import divisors
from .errors import ConfigError, ScheduleError, check_positive_int
from .hardware import Accelerator
from .memory import (
    RECOMPUTE_MODES,
    SCHEDULES,
    MemoryCalibration,
    MemoryConfig,
    bytes_per_param,
    embedding_activation_bytes,
    layer_activation_bytes,
    output_activation_bytes,
    split_layers,
    stage_params,
)
from .model import ModelShape
from .roofline import (
    DEFAULT_EFFICIENCY,
    RooflineEfficiency,
    allgather_time_s,
    allreduce_time_s,
    group_bandwidth,
    layer_forward,
    logits_forward,
    model_flops_per_step,
    p2p_time_s,
    reduce_scatter_time_s,
)

__all__ = [
    "PlanConfig",
    "Candidate",
    "Plan",
    "make_plan",
    "compare_gpus",
    "search_layouts",
    "plan_table_rows",
    "comparison_rows",
    "explain",
    "lint",
    "what_would_fit",
    "DEFAULT_HEADROOM",
    "KNEE_TOLERANCE",
]

DEFAULT_HEADROOM = 0.1
"""Share of device memory the planner keeps free by default: a policy, not a measurement — the CUDA
context (a few hundred MiB), NCCL buffers and the caching allocator's fragmentation live there."""
KNEE_TOLERANCE = 0.1
"""A b_m whose kernel throughput is within 10% of the best is at the knee (DESIGN: "the smallest b_m
whose throughput is within a tolerance of the best")."""
_KNEE_FACTOR = 4
"""Lint b_m at least this many times the knee ("far past the knee")."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What to plan: a model on an accelerator, a layout, and the choices to search."""

    shape: ModelShape
    """The model."""
    gpu: Accelerator
    """The accelerator every rank runs on."""
    global_batch: int
    """B_global: sequences per optimizer step (held fixed)."""
    data_parallel: int = 1
    """d: data-parallel replicas."""
    pipeline_parallel: int = 1
    """p: pipeline stages."""
    tensor_parallel: int = 1
    """t: tensor-parallel ranks."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs t > 1)."""
    seq: int | None = None
    """Sequence length; None means the model's."""
    schedules: tuple[str, ...] | None = None
    """Schedules to consider; None means every one that can serve (p, m, v)."""
    virtuals: tuple[int, ...] | None = None
    """v values for interleaved 1F1B; None means every v > 1 with p·v dividing the layers."""
    recompute: tuple[str, ...] | None = None
    """Recompute modes; None means none, selective and full."""
    zero: tuple[int, ...] | None = None
    """ZeRO stages; None means 0–3 when d > 1, else 0."""
    micro_batches: tuple[int, ...] | None = None
    """b_m values; None means every divisor of B/d."""
    layers_per_stage: tuple[int, ...] | None = None
    """An uneven split of layers over stages; None means even."""
    precision: str = "bf16-mixed"
    """bf16-mixed, fp16-mixed or fp32."""
    grad_dtype: str = "half"
    """Gradients under mixed precision: half (16 B/param) or fp32 (18 B/param)."""
    optimizer: str = "adamw"
    """adamw or sgd."""
    flash_attention: bool | None = None
    """Flash attention; None means the model's setting."""
    memory_headroom: float = DEFAULT_HEADROOM
    """Share of device memory kept free; a candidate fits when peak ≤ capacity × (1 − headroom)."""
    efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY
    """Kernel and link efficiencies (calibratable)."""
    memory_calibration: MemoryCalibration = field(default_factory=MemoryCalibration)
    """Memory corrections (calibratable)."""
    simulate_top: int = 3
    """How many leading candidates to replay with the event simulator."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "data_parallel", "pipeline_parallel", "tensor_parallel"):
            check_positive_int(name.replace("_", "-"), getattr(self, name))
        B, d = self.global_batch, self.data_parallel
        if B % d:
            lo, hi = (B // d) * d, (B // d + 1) * d
            raise ConfigError(
                f"global batch {B} is not divisible by data-parallel {d}; B_global = b_m × g × d needs "
                f"d | B; use global batch {lo or hi} or {hi}, or a data-parallel among {divisors(B)[:12]}"
            )
        if not (0 <= self.memory_headroom < 1):
            raise ConfigError(
                f"memory headroom {self.memory_headroom!r} must be in [0, 1); it is the share of memory kept "
                "free, for example 0.1"
            )
        if self.seq is not None:
            check_positive_int("seq", self.seq)
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError(
                "sequence parallelism needs tensor-parallel > 1; give --tensor-parallel or drop it"
            )
        for s in self.schedules or ():
            if s not in SCHEDULES:
                raise ConfigError(f"schedule {s!r} is not known; use auto or one of {', '.join(SCHEDULES)}")
        for r in self.recompute or ():
            if r not in RECOMPUTE_MODES:
                raise ConfigError(
                    f"recompute {r!r} is not known; use auto or one of {', '.join(RECOMPUTE_MODES)}"
                )
        for z in self.zero or ():
            if isinstance(z, bool) or z not in (0, 1, 2, 3):
                raise ConfigError(f"ZeRO stage {z!r} is not known; use auto or 0, 1, 2, 3")
        for b in self.micro_batches or ():
            check_positive_int("micro-batch", b)
            if (B // d) % b:
                raise ConfigError(
                    f"micro-batch {b} does not divide the per-replica batch B/d = {B}/{d} = {B // d}; "
                    f"B_global = b_m × g × d must hold; use a micro-batch among {divisors(B // d)}"
                )
        bytes_per_param(self.precision, self.grad_dtype, self.optimizer)
        L, p = self.shape.layers, self.pipeline_parallel
        for v in self.virtuals or ():
            check_positive_int("virtual", v)
            if L % (p * v):
                ok = [x for x in range(2, L // p + 1) if L % (p * x) == 0]
                raise ConfigError(
                    f"virtual {v}: interleaved 1F1B needs layers {L} divisible by stages {p} × virtual {v} = {p * v}; "
                    f"use virtual among {ok or 'none (no v > 1 fits; drop --virtual)'}"
                )
        if not isinstance(self.simulate_top, int) or self.simulate_top < 0:
            raise ConfigError(f"simulate_top must be a whole number >= 0, got {self.simulate_top!r}")
        # the rules that need the model (t | heads, p <= layers, uneven split)
        MemoryConfig(
            micro_batch=1,
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            sequence_parallel=self.sequence_parallel,
            layers_per_stage=self.layers_per_stage,
        ).validate_for(self.shape)

    @property
    def num_gpus(self) -> int:
        return self.data_parallel * self.pipeline_parallel * self.tensor_parallel

    @property
    def seq_len(self) -> int:
        return self.seq or self.shape.seq

    @property
    def budget_bytes(self) -> float:
        """Bytes a candidate may use: capacity × (1 − headroom)."""
        return self.gpu.memory_bytes * (1 - self.memory_headroom)

    def to_dict(self) -> dict:
        return {
            "model": self.shape.to_dict(),
            "gpu": self.gpu.to_dict(),
            "global_batch": self.global_batch,
            "data_parallel": self.data_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "tensor_parallel": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel,
            "seq": self.seq_len,
            "precision": self.precision,
            "grad_dtype": self.grad_dtype,
            "optimizer": self.optimizer,
            "memory_headroom": self.memory_headroom,
            "budget_bytes": self.budget_bytes,
            "num_gpus": self.num_gpus,
        }


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run the step: its memory, time and whether it fits."""

    micro_batch: int
    """b_m."""
    microbatches: int
    """m: micro-batches per pipeline flush."""
    grad_accum: int
    """g: micro-batches per replica per optimizer step (= m, one flush per step)."""
    schedule: str
    """Pipeline schedule (1f1b when p = 1: plain gradient accumulation)."""
    virtual: int
    """v: model chunks per rank."""
    recompute: str
    """Activation recomputation mode."""
    zero: int
    """ZeRO stage."""
    bubble_fraction: float
    """Idle share of the schedule with balanced stages (its closed form, (p−1)/(v·m+p−1) for GPipe, 1F1B
    and interleaved). Stage imbalance is in ``step_time_s``; the simulator's idle share, which counts it,
    is ``time["simulated_idle"]`` when ``simulated``."""
    peak_memory_bytes: float
    """Peak bytes of the stage with the highest peak."""
    memory: dict[str, float]
    """weights, gradients, optimizer, activations, other of that stage."""
    step_time_s: float
    """Predicted seconds per optimizer step."""
    tokens_per_s: float
    """B_global · s / step time."""
    mfu: float
    """Model FLOPs utilisation: model FLOPs per step / (step time · GPUs · peak)."""
    fits: bool
    """Peak ≤ capacity × (1 − headroom)."""
    global_batch: int
    """B_global (held fixed)."""
    data_parallel: int
    """d."""
    pipeline_parallel: int
    """p."""
    tensor_parallel: int
    """t."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism."""
    peak_stage: int = 0
    """Index of the stage with the highest peak."""
    gemm_efficiency: float = 0.0
    """Achieved fraction of peak FLOP/s of one layer's forward at this b_m (kernel efficiency)."""
    time: dict[str, float] = field(default_factory=dict)
    """Step time split (seconds): pipeline_s (compute + bubble), bubble_s, dp_comm_s, zero_comm_s,
    optimizer_s; simulated_idle (a fraction) when simulated."""
    simulated: bool = False
    """True when the pipeline time comes from the event simulator."""

    @property
    def bubble_pct(self) -> float:
        return 100 * self.bubble_fraction

    def to_dict(self) -> dict:
        return {
            "micro_batch": self.micro_batch,
            "microbatches": self.microbatches,
            "grad_accum": self.grad_accum,
            "schedule": self.schedule,
            "virtual": self.virtual,
            "recompute": self.recompute,
            "zero": self.zero,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory": dict(self.memory),
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "fits": self.fits,
            "global_batch": self.global_batch,
            "data_parallel": self.data_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "tensor_parallel": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel,
            "peak_stage": self.peak_stage,
            "gemm_efficiency": self.gemm_efficiency,
            "time": dict(self.time),
            "simulated": self.simulated,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Candidate:
        """A candidate from :meth:`to_dict` output (for example read back from ``plan --json``)."""
        names = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise ConfigError(
                f"not a plan candidate ({e}); give the output of `microbatch plan --json`"
            ) from None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's answer for one accelerator."""

    config: PlanConfig
    """What was planned."""
    candidates: tuple[Candidate, ...]
    """Every candidate, fitting ones first, fastest first."""
    recommended: Candidate | None
    """The fastest candidate that fits; None when nothing fits."""
    lints: tuple[str, ...] = ()
    """Pitfalls found (seed 002's list)."""
    advice: tuple[str, ...] = ()
    """When nothing fits: what would, with the numbers."""

    @property
    def evaluated(self) -> int:
        return len(self.candidates)

    def to_dict(self) -> dict:
        d = self.config.to_dict()
        d.update(
            {
                "recommended": self.recommended.to_dict() if self.recommended else None,
                "candidates": [c.to_dict() for c in self.candidates],
                "lints": list(self.lints),
                "advice": list(self.advice),
                "explanation": explain(self),
            }
        )
        return d


# -- evaluation -----------------------------------------------------------------------------------------
def _schedule_options(cfg: PlanConfig, m: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs that can serve (p, m, v) under torch's rules."""
    p, L = cfg.pipeline_parallel, cfg.shape.layers
    if p == 1:
        return [("1f1b", 1)]
    from .schedule import check_servable

    names = cfg.schedules or SCHEDULES
    out = []
    for name in names:
        vs = [1]
        if name == "interleaved-1f1b":
            if cfg.layers_per_stage is not None:
                continue
            vs = (
                list(cfg.virtuals)
                if cfg.virtuals
                else [v for v in divisors(L // p) if v > 1 and L % (p * v) == 0]
            )
        for v in vs:
            if v > 1 and L % (p * v):
                continue
            try:
                check_servable(name, p, m, v)
            except ScheduleError:
                continue
            out.append((name, v))
    return out


@dataclass
class _Ctx:
    """Per-plan caches: everything that does not depend on the candidate."""

    cfg: PlanConfig
    split: tuple[int, ...]
    probe: tuple[int, ...]  # stages whose peak can be the maximum
    params: dict[int, float]
    act_kw: dict
    dtype: str
    e: int
    state_bpp: tuple[int, int, int]
    max_params: float = 0.0
    layer_cache: dict = field(default_factory=dict)
    act_cache: dict = field(default_factory=dict)
    time_cache: dict = field(default_factory=dict)


def _context(cfg: PlanConfig) -> _Ctx:
    p, t = cfg.pipeline_parallel, cfg.tensor_parallel
    split = split_layers(cfg.shape.layers, p, cfg.layers_per_stage)
    if cfg.layers_per_stage is None:
        # Within a run of equal stages the in-flight count falls with i, so the peak is at the first
        # stage of each run or at the last stage (output layer).
        probe = sorted({0, p - 1} | {i for i in range(1, p) if split[i] != split[i - 1]})
    else:
        probe = list(range(p))
    params = {i: stage_params(cfg.shape, i, p, split[i], t) for i in range(p)}
    e = 4 if cfg.precision == "fp32" else 2
    dtype = "fp32" if cfg.precision == "fp32" else ("fp16" if cfg.precision == "fp16-mixed" else "bf16")
    return _Ctx(
        cfg=cfg,
        split=split,
        probe=tuple(probe),
        params=params,
        max_params=max(params.values()),
        act_kw=dict(seq=cfg.seq, tensor_parallel=t, sequence_parallel=cfg.sequence_parallel),
        dtype=dtype,
        e=e,
        state_bpp=bytes_per_param(cfg.precision, cfg.grad_dtype, cfg.optimizer),
    )


def _layer(ctx: _Ctx, b: int):
    """Per-micro-batch times at b_m = b: (layer forward, layer backward parts, logits, p2p)."""
    hit = ctx.layer_cache.get(b)
    if hit is None:
        cfg = ctx.cfg
        lt = layer_forward(
            cfg.shape, b, cfg.gpu, seq=cfg.seq, tensor_parallel=cfg.tensor_parallel,
            sequence_parallel=cfg.sequence_parallel, flash_attention=cfg.flash_attention,
            dtype=ctx.dtype, efficiency=cfg.efficiency,
        )  # fmt: skip
        logit_s, _ = logits_forward(
            cfg.shape, b, cfg.gpu, seq=cfg.seq, tensor_parallel=cfg.tensor_parallel, dtype=ctx.dtype,
            efficiency=cfg.efficiency,
        )  # fmt: skip
        t, p = cfg.tensor_parallel, cfg.pipeline_parallel
        p2p = 0.0
        if p > 1:
            # Megatron's scatter/gather: each tensor rank sends 1/t of the activation (Narayanan 2021 §4.1)
            nbytes = ctx.e * b * cfg.seq_len * cfg.shape.hidden / t
            bw = group_bandwidth(cfg.gpu, p, t * cfg.data_parallel) * cfg.efficiency.network
            p2p = p2p_time_s(nbytes, bw)
        flops_rate = lt.flops / lt.compute_s / cfg.gpu.flops(ctx.dtype) if lt.compute_s else 0.0
        hit = (lt, logit_s, p2p, flops_rate)
        ctx.layer_cache[b] = hit
    return hit


def _act(ctx: _Ctx, b: int, rc: str):
    key = (b, rc)
    hit = ctx.act_cache.get(key)
    if hit is None:
        cfg = ctx.cfg
        per_layer = layer_activation_bytes(
            cfg.shape, b, recompute=rc, flash_attention=cfg.flash_attention, dtype_bytes=ctx.e, **ctx.act_kw
        )
        working = 0.0
        if rc == "full":
            working = layer_activation_bytes(
                cfg.shape, b, recompute="none", flash_attention=cfg.flash_attention, dtype_bytes=ctx.e,
                **ctx.act_kw,
            )  # fmt: skip
        emb = embedding_activation_bytes(cfg.shape, b, **ctx.act_kw)
        out = output_activation_bytes(cfg.shape, b, dtype_bytes=ctx.e, **ctx.act_kw)
        hit = (per_layer, working, emb, out)
        ctx.act_cache[key] = hit
    return hit


def _in_flight(schedule: str, i: int, p: int, m: int, v: int) -> tuple[float, int]:
    """(layer-micro-batches per stage layer, micro-batches) in flight on stage i: see memory.in_flight_layers."""
    if p == 1:
        return (float(m), m) if schedule == "gpipe" else (1.0, 1)
    if schedule == "gpipe":
        return float(m), m
    if schedule == "zb-h1":
        k = min(m, p)
        return float(k), k
    if schedule == "interleaved-1f1b" and v > 1:
        per_round = m // max(1, m // p)  # torch's ScheduleInterleaved1F1B rounds
        chunks = min(m * v, (v - 1) * per_round + 2 * (p - 1 - i) + 1)
        return chunks / v, min(m, -(-chunks // v))
    k = min(m, p - i)
    return float(k), k


def _memory(ctx: _Ctx, b: int, m: int, sched: str, v: int, rc: str, z: int):
    """(peak bytes, stage, breakdown) over the probed stages."""
    cfg = ctx.cfg
    p, d = cfg.pipeline_parallel, cfg.data_parallel
    per_layer, working, emb, out = _act(ctx, b, rc)
    wb, gb, ob = ctx.state_bpp
    scale = cfg.memory_calibration.activation_scale
    other = cfg.memory_calibration.fixed_bytes
    if z >= 3 and d > 1:
        other += 2 * cfg.shape.layer_params() / cfg.tensor_parallel * wb
    best = None
    for i in ctx.probe:
        n = ctx.params[i]
        weights = n * wb / (d if z >= 3 else 1)
        grads = n * gb / (d if z >= 2 else 1)
        opt = n * ob / (d if z >= 1 else 1)
        layers_mb, held = _in_flight(sched, i, p, m, v)
        acts = per_layer * ctx.split[i] * layers_mb + working
        if i == 0:
            acts += emb * held
        if i == p - 1:
            acts += out * held
        acts *= scale
        total = weights + grads + opt + acts + other
        if best is None or total > best[0]:
            best = (total, i, (weights, grads, opt, acts, other))
    return best


def _stage_times(ctx: _Ctx, b: int, rc: str) -> _Times:
    """Per-stage (forward, input-grad, weight-grad) seconds per micro-batch, and the bottleneck stage."""
    hit = ctx.time_cache.get((b, rc))
    if hit is not None:
        return hit
    lt, logit_s, p2p, _ = _layer(ctx, b)
    layer_f = lt.total_s
    w_part = lt.gemm_s  # weight gradients: one GEMM per forward GEMM
    layer_i = 2 * lt.compute_s - w_part + lt.tp_comm_s  # input gradients, attention and elementwise backward
    if rc == "full":
        layer_i += layer_f
    elif rc == "selective":
        layer_i += lt.attention_s
    p = ctx.cfg.pipeline_parallel
    f, i_, w = [], [], []
    for s, n in enumerate(ctx.split):
        extra = logit_s if s == p - 1 else 0.0
        f.append(n * layer_f + extra + p2p)
        i_.append(n * layer_i + extra + p2p)  # the logits' backward ≈ 2× forward: one for I, one for W
        w.append(n * w_part + extra)
    T = [a + b_ + c for a, b_, c in zip(f, i_, w, strict=True)]
    k = max(range(p), key=T.__getitem__)
    hit = _Times(f=f, i=i_, w=w, k=k, Tk=T[k], sumT=sum(T), fk=f[k], ik=i_[k], wk=w[k])
    ctx.time_cache[(b, rc)] = hit
    return hit


class _Times(NamedTuple):
    f: list
    i: list
    w: list
    k: int
    Tk: float
    sumT: float
    fk: float
    ik: float
    wk: float


def _pipeline_time(sched: str, p: int, m: int, v: int, tm: _Times) -> tuple[float, float]:
    """(seconds of compute + bubble, bubble fraction) by the closed forms in the module docstring."""
    Tk = tm.Tk
    if p == 1:
        return m * Tk, 0.0
    if sched == "interleaved-1f1b" and v > 1:
        total = m * Tk + (p - 1) * Tk / v
        return total, (p - 1) / (v * m + p - 1)
    if sched == "zb-h1":
        idle = (p - 1) * max(0.0, tm.fk + tm.ik - tm.wk)
        total = m * Tk + idle
        return total, idle / total
    total = (m - 1) * Tk + tm.sumT
    return total, (p - 1) / (m + p - 1)


def _comm(ctx: _Ctx, m: int, z: int, tm: _Times) -> tuple[float, float, float]:
    """(exposed data-parallel seconds, exposed ZeRO-2/3 per-step seconds, optimizer update seconds)."""
    cfg = ctx.cfg
    d, t = cfg.data_parallel, cfg.tensor_parallel
    wb, gb, ob = ctx.state_bpp
    n = ctx.max_params
    back = tm.ik + tm.wk
    bw_dp = group_bandwidth(cfg.gpu, d, t) * cfg.efficiency.network
    dp = zero_s = 0.0
    if d > 1:
        if z <= 1:
            # gradients reduced once per step, overlapped with the last micro-batch's backward;
            # ZeRO-1 then all-gathers the updated half weights (not hidden)
            dp = max(0.0, (reduce_scatter_time_s(n * gb, d, bw_dp) if z == 1 else allreduce_time_s(n * gb, d, bw_dp))
                     - back)  # fmt: skip
            if z == 1:
                dp += allgather_time_s(n * wb, d, bw_dp)
        elif z == 2:
            # gradients reduce-scattered every micro-step (only a shard is kept), hidden behind its backward
            zero_s = m * max(0.0, reduce_scatter_time_s(n * gb, d, bw_dp) - back)
            dp = allgather_time_s(n * wb, d, bw_dp)
        else:
            # ZeRO-3/FSDP: weights all-gathered for forward and again for backward, gradients
            # reduce-scattered, every micro-step; prefetch hides what compute covers
            ag = allgather_time_s(n * wb, d, bw_dp)
            rs = reduce_scatter_time_s(n * gb, d, bw_dp)
            zero_s = m * (max(0.0, ag - tm.fk) + max(0.0, ag + rs - back))
    # the update streams weights, gradients and optimizer state of the parameters this GPU owns, in and out
    owned = n / d if z >= 1 else n
    opt = 2 * (wb + gb + ob) * owned / (cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory)
    return dp, zero_s, opt


def _evaluate(
    ctx: _Ctx, b: int, m: int, sched: str, v: int, rc: str, z: int, model_flops: float
) -> Candidate:
    cfg = ctx.cfg
    p = cfg.pipeline_parallel
    peak, stage, (wt, gr, op, ac, ot) = _memory(ctx, b, m, sched, v, rc, z)
    tm = _stage_times(ctx, b, rc)
    pipe, bubble = _pipeline_time(sched, p, m, v, tm)
    dp, zero_s, opt = _comm(ctx, m, z, tm)
    step = pipe + dp + zero_s + opt
    return Candidate(
        micro_batch=b,
        microbatches=m,
        grad_accum=m,
        schedule=sched,
        virtual=v,
        recompute=rc,
        zero=z,
        bubble_fraction=bubble,
        peak_memory_bytes=peak,
        memory={"weights": wt, "gradients": gr, "optimizer": op, "activations": ac, "other": ot},
        step_time_s=step,
        tokens_per_s=cfg.global_batch * cfg.seq_len / step,
        mfu=model_flops / (step * cfg.num_gpus * cfg.gpu.flops(ctx.dtype)),
        fits=peak <= cfg.budget_bytes,
        global_batch=cfg.global_batch,
        data_parallel=cfg.data_parallel,
        pipeline_parallel=p,
        tensor_parallel=cfg.tensor_parallel,
        sequence_parallel=cfg.sequence_parallel,
        peak_stage=stage,
        gemm_efficiency=_layer(ctx, b)[3],
        time={"pipeline_s": pipe, "bubble_s": pipe * bubble, "dp_comm_s": dp, "zero_comm_s": zero_s,
              "optimizer_s": opt},
    )  # fmt: skip


def _simulated(ctx: _Ctx, c: Candidate, model_flops: float) -> Candidate:
    """``c`` with its pipeline time and bubble from the event simulator (per-stage times, p2p as comm)."""
    cfg = ctx.cfg
    p = cfg.pipeline_parallel
    if p == 1:
        return c
    from .schedule import generate
    from .simulate import simulate

    tm = _stage_times(ctx, c.micro_batch, c.recompute)
    f, i_, w = tm.f, tm.i, tm.w
    v = c.virtual
    if v > 1:  # per virtual stage: a rank's work split evenly over its v chunks (loop placement)
        f = [f[s % p] / v for s in range(p * v)]
        i_ = [i_[s % p] / v for s in range(p * v)]
        w = [w[s % p] / v for s in range(p * v)]
    sched = generate(c.schedule, p, c.microbatches, v)
    if sched.split_backward:
        res = simulate(sched, forward_time=f, input_time=i_, weight_time=w)
    else:
        res = simulate(sched, forward_time=f, backward_time=[a + b for a, b in zip(i_, w, strict=True)])
    pipe = res.makespan
    step = pipe + c.time["dp_comm_s"] + c.time["zero_comm_s"] + c.time["optimizer_s"]
    time = dict(
        c.time, pipeline_s=pipe, bubble_s=pipe * res.bubble_fraction, simulated_idle=res.bubble_fraction
    )
    return replace(
        c,
        step_time_s=step,
        tokens_per_s=cfg.global_batch * cfg.seq_len / step,
        mfu=model_flops / (step * cfg.num_gpus * cfg.gpu.flops(ctx.dtype)),
        time=time,
        simulated=True,
    )


_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}


def _sort_key(c: Candidate):
    """Fitting first, fastest first; ties (to 6 digits) go to less recompute, lower ZeRO, less memory."""
    primary = float(f"{c.step_time_s:.6g}") if c.fits else c.peak_memory_bytes
    return (not c.fits, primary, _RECOMPUTE_RANK[c.recompute], c.zero, c.peak_memory_bytes)


def _enumerate(cfg: PlanConfig, ctx: _Ctx | None = None) -> list[Candidate]:
    ctx = ctx or _context(cfg)
    per_replica = cfg.global_batch // cfg.data_parallel
    bms = cfg.micro_batches or tuple(divisors(per_replica))
    rcs = cfg.recompute or RECOMPUTE_MODES
    zs = cfg.zero or ((0, 1, 2, 3) if cfg.data_parallel > 1 else (0,))
    model_flops = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    out = []
    for b in bms:
        m = per_replica // b
        for sched, v in _schedule_options(cfg, m):
            for rc in rcs:
                for z in zs:
                    out.append(_evaluate(ctx, b, m, sched, v, rc, z, model_flops))
    return out


def make_plan(cfg: PlanConfig) -> Plan:
    """Enumerate, predict, simulate the leaders, and recommend the fastest candidate that fits."""
    ctx = _context(cfg)
    cands = _enumerate(cfg, ctx)
    if not cands:
        p, per_replica = cfg.pipeline_parallel, cfg.global_batch // cfg.data_parallel
        raise ConfigError(
            f"no schedule in {list(cfg.schedules or SCHEDULES)} can serve p = {p} with at most "
            f"m = B/(d·b_m) = {per_replica} micro-batches (1F1B, ZB-H1 and interleaved need m >= p); "
            f"raise the global batch to at least {p * cfg.data_parallel} or use --schedule gpipe"
        )
    cands.sort(key=_sort_key)
    model_flops = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    uneven = cfg.layers_per_stage is not None
    n_sim = len(cands) if uneven and len(cands) <= 50 else cfg.simulate_top
    lead = [_simulated(ctx, c, model_flops) if c.fits else c for c in cands[:n_sim]]
    cands = sorted(lead + cands[n_sim:], key=_sort_key)
    rec = cands[0] if cands[0].fits else None
    plan = Plan(config=cfg, candidates=tuple(cands), recommended=rec)
    lints = tuple(lint(plan))
    advice = tuple(what_would_fit(cfg, plan)) if rec is None else ()
    return replace(plan, lints=lints, advice=advice)


def compare_gpus(cfg: PlanConfig, gpus: list[Accelerator]) -> list[Plan]:
    """One plan per accelerator, same model, layout and batch ("fewer larger GPUs or more smaller ones")."""
    return [make_plan(replace(cfg, gpu=g)) for g in gpus]


def search_layouts(
    shape: ModelShape,
    gpu: Accelerator,
    *,
    global_batch: int,
    num_gpus: int,
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8),
    **options,
) -> tuple[Candidate | None, int, int]:
    """Search t, p, d with t·p·d = num_gpus as well: (best fitting candidate, evaluated, feasible).

    Layouts that break a rule (t not dividing heads, p > layers, d not dividing B) are skipped.
    Only the screening closed forms run (no simulation), as in calculon's search.
    """
    best, evaluated, feasible = None, 0, 0
    for t in tensor_parallel:
        if num_gpus % t or shape.heads % t:
            continue
        for p in divisors(num_gpus // t):
            if p > shape.layers:
                break
            d = num_gpus // (t * p)
            if global_batch % d:
                continue
            try:
                cfg = PlanConfig(
                    shape=shape, gpu=gpu, global_batch=global_batch, data_parallel=d, pipeline_parallel=p,
                    tensor_parallel=t, simulate_top=0, **options,
                )  # fmt: skip
            except ConfigError:
                continue
            for c in _enumerate(cfg):
                evaluated += 1
                if c.fits:
                    feasible += 1
                    if best is None or c.step_time_s < best.step_time_s:
                        best = c
    return best, evaluated, feasible


# -- advice and pitfalls ----------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def _knee_micro_batch(ctx: _Ctx, bms: list[int]) -> int:
    rates = {b: _layer(ctx, b)[3] for b in bms}
    top = max(rates.values())
    return min(b for b, r in rates.items() if r >= (1 - KNEE_TOLERANCE) * top)


def lint(plan: Plan, candidate: Candidate | None = None) -> list[str]:
    """Seed 002's pitfalls, checked on ``candidate`` (default: the recommendation, else the best row)."""
    cfg = plan.config
    c = candidate or plan.recommended or (plan.candidates[0] if plan.candidates else None)
    if c is None:
        return []
    out = []
    p, d, B = cfg.pipeline_parallel, cfg.data_parallel, cfg.global_batch
    if c.micro_batch * c.grad_accum * d != B:
        out.append(
            f"global batch changed: b_m {c.micro_batch} × g {c.grad_accum} × d {d} = "
            f"{c.micro_batch * c.grad_accum * d} != B_global {B}; hold B_global fixed unless you mean to retune"
        )
    if p > 1 and c.microbatches < p:
        out.append(
            f"m = {c.microbatches} < p = {p}: some stages never overlap; bubble {c.bubble_pct:.0f}%; "
            f"use b_m <= {max(1, B // (d * p))} so that m >= p"
        )
    elif p > 1 and c.microbatches < 4 * p:
        per_replica = B // d
        better = [b for b in divisors(per_replica) if per_replica // b >= 4 * p]
        hint = ""
        if better:
            b4 = max(better)
            hint = f"; b_m = {b4} gives m = {per_replica // b4} at bubble {100 * (p - 1) / (per_replica // b4 + p - 1):.0f}%"
        out.append(
            f"m = {c.microbatches} < 4p = {4 * p}: the bubble ({c.bubble_pct:.0f}%) is not buried{hint}"
        )
    if c.schedule == "gpipe" and p > 1 and c.microbatches > p:
        alt = next(
            (x for x in plan.candidates if x.schedule == "1f1b" and x.micro_batch == c.micro_batch
             and x.recompute == c.recompute and x.zero == c.zero),
            None,
        )  # fmt: skip
        tail = f" (1F1B: {_gib(alt.peak_memory_bytes)} at the same bubble)" if alt else ""
        out.append(
            f"GPipe holds all m = {c.microbatches} micro-batches' activations on each stage: "
            f"{_gib(c.memory['activations'])}; 1F1B holds at most p = {p}{tail}"
        )
    ctx = _context(cfg)
    bms = sorted({x.micro_batch for x in plan.candidates})
    if len(bms) > 1:
        knee = _knee_micro_batch(ctx, bms)
        at_knee = next((x for x in plan.candidates if x.micro_batch == knee and x.fits), None)
        if (
            c.micro_batch >= _KNEE_FACTOR * knee
            and at_knee is not None
            and at_knee.tokens_per_s >= (1 - KNEE_TOLERANCE) * c.tokens_per_s
        ):
            out.append(
                f"b_m = {c.micro_batch} is far past the kernel-efficiency knee: b_m = {knee} reaches "
                f"{100 * _layer(ctx, knee)[3]:.0f}% of peak (vs {100 * c.gemm_efficiency:.0f}%) and "
                f"{100 * at_knee.tokens_per_s / c.tokens_per_s:.0f}% of the throughput with "
                f"{_gib(c.memory['activations'] - at_knee.memory['activations'])} less activation memory"
            )
    return out


def what_would_fit(cfg: PlanConfig, plan: Plan | None = None) -> list[str]:
    """When nothing fits: the smallest peak found, and what changes (b_m, recompute, p, t, ZeRO) would fit."""
    plan = plan or make_plan(cfg)
    budget = cfg.budget_bytes
    best = min(plan.candidates, key=lambda c: c.peak_memory_bytes)
    out = [
        f"nothing fits in {_gib(budget)} ({_gib(cfg.gpu.memory_bytes)} × (1 − headroom {cfg.memory_headroom:g})); "
        f"the smallest peak is {_gib(best.peak_memory_bytes)} at b_m = {best.micro_batch}, {best.schedule}, "
        f"recompute {best.recompute}, ZeRO {best.zero} (weights {_gib(best.memory['weights'])}, optimizer "
        f"{_gib(best.memory['optimizer'])}, activations {_gib(best.memory['activations'])})"
    ]
    tries: list[tuple[str, dict]] = []
    L, heads = cfg.shape.layers, cfg.shape.heads
    for p2 in (2 * cfg.pipeline_parallel, 4 * cfg.pipeline_parallel, 8 * cfg.pipeline_parallel):
        if p2 <= L:
            tries.append((f"pipeline-parallel {p2}", {"pipeline_parallel": p2, "layers_per_stage": None}))
    for t2 in (2 * cfg.tensor_parallel, 4 * cfg.tensor_parallel):
        if heads % t2 == 0 and t2 <= cfg.gpu.gpus_per_node:
            tries.append(
                (
                    f"tensor-parallel {t2} with sequence parallel",
                    {"tensor_parallel": t2, "sequence_parallel": True},
                )
            )
    if cfg.data_parallel == 1:
        for d2 in (8, 64):
            if cfg.global_batch % d2 == 0:
                tries.append((f"data-parallel {d2} with ZeRO-3", {"data_parallel": d2, "zero": (3,)}))
    for label, change in tries:
        try:
            alt = replace(cfg, simulate_top=0, **change)
            cands = _enumerate(alt)
        except ConfigError:
            continue
        fit = [c for c in cands if c.fits]
        if fit:
            c = min(fit, key=lambda c: c.step_time_s)
            out.append(
                f"{label} would fit: {_gib(c.peak_memory_bytes)} at b_m = {c.micro_batch}, recompute "
                f"{c.recompute}, ZeRO {c.zero}, {c.tokens_per_s:,.0f} tokens/s"
            )
        else:
            low = min(cands, key=lambda c: c.peak_memory_bytes)
            out.append(f"{label}: still {_gib(low.peak_memory_bytes)} at best")
    return out


# -- rendering helpers (text; the library never prints) -------------------------------------------------------
TABLE_COLUMNS = (
    "b_m",
    "m",
    "schedule",
    "v",
    "recompute",
    "ZeRO",
    "bubble",
    "peak",
    "step",
    "tokens/s",
    "MFU",
    "fits",
)


def _row(c: Candidate) -> list[str]:
    return [
        str(c.micro_batch),
        str(c.microbatches),
        c.schedule if c.pipeline_parallel > 1 else "-",
        str(c.virtual),
        c.recompute,
        str(c.zero),
        f"{100 * c.bubble_fraction:.1f}%",
        _gib(c.peak_memory_bytes),
        f"{c.step_time_s:.3g} s",
        f"{c.tokens_per_s:,.0f}",
        f"{100 * c.mfu:.1f}%",
        "yes" if c.fits else "no",
    ]


def plan_table_rows(plan: Plan, *, per_micro_batch: bool = True, limit: int = 12) -> list[list[str]]:
    """Rows for a text table, header first.

    ``per_micro_batch``: the best candidate at each b_m (the trade-off across b_m; the
    recommendation marked ``*``); otherwise the ``limit`` best candidates.
    """
    rows = [list(TABLE_COLUMNS)]
    if per_micro_batch:
        seen: dict[int, Candidate] = {}
        for c in plan.candidates:  # sorted: first seen is the best at that b_m
            seen.setdefault(c.micro_batch, c)
        chosen = [seen[b] for b in sorted(seen)]
    else:
        chosen = list(plan.candidates[:limit])
    for c in chosen:
        r = _row(c)
        if c is plan.recommended:
            r[0] = r[0] + "*"
        rows.append(r)
    return rows


def comparison_rows(plans: list[Plan]) -> list[list[str]]:
    """One row per accelerator: its recommendation (header first)."""
    rows = [["gpu", "memory", "b_m", "m", "schedule", "recompute", "ZeRO", "peak", "step", "tokens/s",
             "tokens/s/GPU", "MFU"]]  # fmt: skip
    for pl in plans:
        c = pl.recommended
        g = pl.config.gpu
        if c is None:
            rows.append(
                [g.name, _gib(g.memory_bytes), "-", "-", "-", "-", "-", "nothing fits", "-", "-", "-", "-"]
            )
            continue
        rows.append([
            g.name, _gib(g.memory_bytes), str(c.micro_batch), str(c.microbatches), c.schedule, c.recompute,
            str(c.zero), _gib(c.peak_memory_bytes), f"{c.step_time_s:.3g} s", f"{c.tokens_per_s:,.0f}",
            f"{c.tokens_per_s / pl.config.num_gpus:,.0f}", f"{100 * c.mfu:.1f}%",
        ])  # fmt: skip
    return rows


def explain(plan: Plan) -> str:
    """The trade-off in words: bubble against kernel efficiency against memory."""
    c = plan.recommended
    cfg = plan.config
    if c is None:
        return " ".join(plan.advice) if plan.advice else "nothing fits"
    p = cfg.pipeline_parallel
    parts = [
        f"Recommended b_m = {c.micro_batch} (m = g = {c.microbatches}, "
        f"{c.schedule if p > 1 else 'no pipeline'}"
        + (f", v = {c.virtual}" if c.virtual > 1 else "")
        + f", recompute {c.recompute}, ZeRO {c.zero}): {c.step_time_s:.3g} s per step, "
        f"{c.tokens_per_s:,.0f} tokens/s, MFU {100 * c.mfu:.1f}%, peak {_gib(c.peak_memory_bytes)} of "
        f"{_gib(cfg.budget_bytes)} usable."
    ]
    best_at: dict[int, Candidate] = {}
    for x in plan.candidates:
        best_at.setdefault(x.micro_batch, x)
    smaller = [x for b, x in sorted(best_at.items()) if b < c.micro_batch]
    larger = [x for b, x in sorted(best_at.items()) if b > c.micro_batch]
    if smaller:
        s = smaller[-1]
        if not s.fits:
            why = f"does not fit ({_gib(s.peak_memory_bytes)})"
        elif p == 1:
            why = (
                f"would save {_gib(c.peak_memory_bytes - s.peak_memory_bytes)} but its GEMMs reach "
                f"{100 * s.gemm_efficiency:.0f}% of peak (vs {100 * c.gemm_efficiency:.0f}%) and its step takes "
                f"{s.step_time_s:.3g} s"
            )
        else:
            why = (
                f"would cut the bubble to {100 * s.bubble_fraction:.1f}% (from {100 * c.bubble_fraction:.1f}%) "
                f"but its GEMMs reach {100 * s.gemm_efficiency:.0f}% of peak (vs {100 * c.gemm_efficiency:.0f}%) "
                f"and its step takes {s.step_time_s:.3g} s"
            )
        parts.append(f"Smaller b_m = {s.micro_batch} {why}.")
    if larger:
        g = larger[0]
        if not g.fits:
            why = f"does not fit: {_gib(g.peak_memory_bytes)} > {_gib(cfg.budget_bytes)}"
        else:
            why = (
                f"would run GEMMs at {100 * g.gemm_efficiency:.0f}% of peak but leave "
                f"{100 * g.bubble_fraction:.1f}% of the pipeline idle" if p > 1 else
                f"would run GEMMs at {100 * g.gemm_efficiency:.0f}% of peak for {_gib(g.peak_memory_bytes)}"
            )  # fmt: skip
            why += f"; its step takes {g.step_time_s:.3g} s"
        parts.append(f"Larger b_m = {g.micro_batch} {why}.")
    if plan.lints:
        parts.append("Check: " + " ".join(plan.lints))
    return " ".join(parts)
