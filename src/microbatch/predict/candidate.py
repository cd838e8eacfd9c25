"""One candidate of the planner: a way to run the step, with its predicted memory and step time.

:func:`evaluate` predicts one candidate (b_m, m, schedule, v, recompute, ZeRO) of a
:class:`~microbatch.predict.plan_config.PlanConfig` by closed forms: per-stage peak memory
(:mod:`microbatch.predict.memory`), step time (each stage's F, I and W from the one step-time rule,
:mod:`microbatch.predict.steptime`, plus the pipeline's bubble), tokens/s and MFU, and whether it
fits with the headroom asked; :func:`with_simulation` replays it with :func:`microbatch.schedules.simulate.simulate`.
A :class:`Context` caches what does not depend on the candidate, so the planner's enumeration stays cheap.

Step time of one optimizer step (bottleneck stage k with forward F_k and backward B_k per
micro-batch, T_k = F_k + B_k; Narayanan et al. 2021 §2.2):

- GPipe and 1F1B: (m − 1)·T_k + Σ_i T_i  (= (m + p − 1)·T for equal stages);
- interleaved 1F1B: m·T_k + (p − 1)·T_k / v;
- ZB-H1: m·T_k + (p − 1)·(F_k + I_k − W_k), the backward split into input (I) and weight (W)
  gradients (Qi et al. 2024, Table 2);

plus the exposed data-parallel gradient reduction (overlapped with the last backward, or whole after it
with ``PlanConfig.dp_overlap=False``), ZeRO-2/3
communication per micro-step (overlapped with compute where shorter), and the optimizer update.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from microbatch.errors import ConfigError
from microbatch.precision import get_precision
from microbatch.predict.activations import (
    embedding_activation_bytes,
    layer_activation_bytes,
    output_activation_bytes,
)
from microbatch.predict.memory import split_layers, stage_params
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.roofline import (
    LayerTime,
    allgather_time_s,
    allreduce_time_s,
    group_bandwidth,
    layer_forward,
    logits_forward,
    p2p_time_s,
    reduce_scatter_time_s,
)
from microbatch.predict.state import bytes_per_param
from microbatch.predict.steptime import pipeline_stage_times
from microbatch.schedules.registry import in_flight_chunks

__all__ = ["Candidate", "Context", "LayerCosts", "evaluate", "layer_costs", "make_context", "with_simulation"]


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field (bytes, seconds, fractions)."""
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
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        """A candidate from :meth:`to_dict` output (for example read back from ``plan --json``)."""
        names = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise ConfigError(
                f"not a plan candidate ({e}); give the output of `microbatch plan --json`"
            ) from None


class LayerCosts(NamedTuple):
    """Per-micro-batch costs at one b_m that do not depend on the candidate's other choices."""

    layer: LayerTime
    """One layer's forward, by part."""
    logits_s: float
    """The output layer and loss, forward."""
    p2p_s: float
    """One pipeline send of a micro-batch's activations (0 without a pipeline)."""
    gemm_efficiency: float
    """Achieved fraction of peak FLOP/s of one layer's forward."""


class _Acts(NamedTuple):
    per_layer: float
    working: float
    embedding: float
    output: float


@dataclass
class Context:
    """Per-plan caches: everything that does not depend on the candidate."""

    cfg: PlanConfig
    """The plan's configuration."""
    split: tuple[int, ...]
    """Layers per stage."""
    probe: tuple[int, ...]
    """Stages whose peak can be the maximum."""
    params: dict[int, float]
    """Parameters per GPU of each stage."""
    act_kw: dict[str, Any]
    """seq, tensor_parallel, sequence_parallel for the activation formulas."""
    dtype: str
    """Compute dtype of the precision (``bf16``, ``fp16``, ``fp32``)."""
    e: int
    """Bytes per activation element (the compute dtype's)."""
    state_bpp: tuple[int, int, int]
    """Weight, gradient and optimizer-state bytes per parameter."""
    max_params: float = 0.0
    """The most parameters on one GPU over the stages."""
    layer_cache: dict[int, LayerCosts] = field(default_factory=dict)
    act_cache: dict[tuple[int, str], _Acts] = field(default_factory=dict)
    time_cache: dict[tuple[int, str], _Times] = field(default_factory=dict)


def make_context(cfg: PlanConfig) -> Context:
    """The caches for planning ``cfg``."""
    p, t = cfg.pipeline_parallel, cfg.tensor_parallel
    split = split_layers(cfg.shape.layers, p, cfg.layers_per_stage)
    if cfg.layers_per_stage is None:
        # Within a run of equal stages the in-flight count falls with i, so the peak is at the first
        # stage of each run or at the last stage (output layer).
        probe = sorted({0, p - 1} | {i for i in range(1, p) if split[i] != split[i - 1]})
    else:
        probe = list(range(p))
    params = {i: stage_params(cfg.shape, i, p, split[i], t) for i in range(p)}
    prec = get_precision(cfg.precision)
    return Context(
        cfg=cfg,
        split=split,
        probe=tuple(probe),
        params=params,
        max_params=max(params.values()),
        act_kw=dict(seq=cfg.seq, tensor_parallel=t, sequence_parallel=cfg.sequence_parallel),
        dtype=prec.compute_dtype,
        e=prec.weight_bytes,  # activations are kept in the compute dtype
        state_bpp=bytes_per_param(cfg.precision, cfg.grad_dtype, cfg.optimizer),
    )


def layer_costs(ctx: Context, b: int) -> LayerCosts:
    """Per-micro-batch costs at b_m = b: layer forward, logits, p2p send, GEMM efficiency."""
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
        hit = LayerCosts(layer=lt, logits_s=logit_s, p2p_s=p2p, gemm_efficiency=flops_rate)
        ctx.layer_cache[b] = hit
    return hit


def _act(ctx: Context, b: int, rc: str) -> _Acts:
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
        hit = _Acts(per_layer=per_layer, working=working, embedding=emb, output=out)
        ctx.act_cache[key] = hit
    return hit


def _in_flight(schedule: str, i: int, p: int, m: int, v: int) -> tuple[float, int]:
    """(layer-micro-batches per stage layer, micro-batches) in flight on stage i: the schedule's
    in-flight rule from the one registry (:func:`microbatch.schedules.registry.in_flight_chunks`)."""
    chunks = in_flight_chunks(schedule, i, p, m, v)
    return chunks / v, min(m, -(-chunks // v))


def _memory(
    ctx: Context, b: int, m: int, sched: str, v: int, rc: str, z: int
) -> tuple[float, int, tuple[float, float, float, float, float]]:
    """(peak bytes, stage, breakdown) over the probed stages."""
    cfg = ctx.cfg
    p, d = cfg.pipeline_parallel, cfg.data_parallel
    per_layer, working, emb, out = _act(ctx, b, rc)
    wb, gb, ob = ctx.state_bpp
    scale = cfg.memory_calibration.activation_scale
    other = cfg.memory_calibration.fixed_bytes
    if z >= 3 and d > 1:
        other += 2 * cfg.shape.layer_params() / cfg.tensor_parallel * wb
    best: tuple[float, int, tuple[float, float, float, float, float]] | None = None
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
    assert best is not None  # ctx.probe always holds stage 0
    return best


def _stage_times(ctx: Context, b: int, rc: str) -> _Times:
    """Per-stage (forward, input-grad, weight-grad) seconds per micro-batch, and the bottleneck stage."""
    hit = ctx.time_cache.get((b, rc))
    if hit is not None:
        return hit
    costs = layer_costs(ctx, b)
    p = ctx.cfg.pipeline_parallel
    f, i_, w = pipeline_stage_times(
        costs.layer, costs.logits_s, split=ctx.split, p2p_s=costs.p2p_s, recompute=rc
    )
    T = [a + b_ + c for a, b_, c in zip(f, i_, w, strict=True)]
    k = max(range(p), key=T.__getitem__)
    hit = _Times(f=f, i=i_, w=w, k=k, Tk=T[k], sumT=sum(T), fk=f[k], ik=i_[k], wk=w[k])
    ctx.time_cache[(b, rc)] = hit
    return hit


class _Times(NamedTuple):
    f: list[float]
    i: list[float]
    w: list[float]
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


def _comm(ctx: Context, m: int, z: int, tm: _Times) -> tuple[float, float, float]:
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
            # gradients reduced once per step, overlapped with the last micro-batch's backward (exposed
            # whole when not dp_overlap); ZeRO-1 then all-gathers the updated half weights (not hidden)
            reduce = reduce_scatter_time_s(n * gb, d, bw_dp) if z == 1 else allreduce_time_s(n * gb, d, bw_dp)
            dp = max(0.0, reduce - back) if cfg.dp_overlap else reduce
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


def evaluate(
    ctx: Context, b: int, m: int, sched: str, v: int, rc: str, z: int, model_flops: float
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
        fits=peak <= cfg.memory_budget_bytes,
        global_batch=cfg.global_batch,
        data_parallel=cfg.data_parallel,
        pipeline_parallel=p,
        tensor_parallel=cfg.tensor_parallel,
        sequence_parallel=cfg.sequence_parallel,
        peak_stage=stage,
        gemm_efficiency=layer_costs(ctx, b).gemm_efficiency,
        time={"pipeline_s": pipe, "bubble_s": pipe * bubble, "dp_comm_s": dp, "zero_comm_s": zero_s,
              "optimizer_s": opt},
    )  # fmt: skip


def with_simulation(ctx: Context, c: Candidate, model_flops: float) -> Candidate:
    """``c`` with its pipeline time and bubble from the event simulator (per-stage times, p2p as comm)."""
    cfg = ctx.cfg
    p = cfg.pipeline_parallel
    if p == 1:
        return c
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate

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
