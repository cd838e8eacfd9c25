"""One candidate of the planner: a way to run the step, with its predicted memory and step time.

:func:`evaluate` predicts one candidate (b_m, m, schedule, v, recompute, ZeRO) of a
:class:`~microbatch.predict.plan_config.PlanConfig` by closed forms: per-stage peak memory
(:mod:`microbatch.predict.memory`), step time (each stage's F, I and W from the one step-time rule,
:mod:`microbatch.predict.steptime`, plus the pipeline's bubble), tokens/s and MFU, and whether it
fits with the headroom asked; :func:`with_simulation` replays it with :func:`microbatch.schedules.simulate.simulate`.
A :class:`~microbatch.predict.plan_context.Context` (:mod:`microbatch.predict.plan_context`) caches what does
not depend on the candidate, and this module caches per (schedule, m, v), per ZeRO stage and per (b_m,
recompute), so the planner's enumeration stays cheap (``bench/bench_plan.py``; the shortcuts are held to
the plain computation value for value in ``tests/predict/test_candidate.py``).

Step time of one optimizer step (bottleneck stage k with forward F_k and backward B_k per
micro-batch, T_k = F_k + B_k; Narayanan et al. 2021 §2.2):

- GPipe and 1F1B: (m − 1)·T_k + Σ_i T_i  (= (m + p − 1)·T for equal stages);
- interleaved 1F1B: m·T_k + (p − 1)·T_k / v;
- ZB-H1: m·T_k + (p − 1)·(F_k + I_k − W_k), the backward split into input (I) and weight (W)
  gradients (Qi et al. 2024, Table 2);
- DualPipeV (two chunks of L/(2p) layers per rank in a V, the output layer back on rank 0): m·T_k plus
  the idle of :func:`microbatch.schedules.simulate.dualpipev_idle_time` on the per-chunk times of a chunk
  of layers (stage 0's; DeepSeek-V3 report 2024, sec 3.2.1, as torch runs it; exact for equal chunks when
  T_W <= T_I, which the step-time rule gives: W is the forward's GEMMs again, I those GEMMs plus the
  rest of the backward). With the output layer on rank 0 the chunks are not equal and m·T_k counts rank
  0's extra work in every slot: on four plans (gpt2 p 3, Llama-2 7B p 4 and p 8, Llama-2 13B p 4 t 2;
  H100) the pipeline time was 0.2–12.5% (mean 1.4–5.4%) longer than the simulation's, ZB-H1's form
  0.1–23% (mean 0.7–8.1%) on the same plans; the leaders and the knee are replayed by the simulator;

plus the exposed data-parallel gradient reduction (overlapped with the last backward, or whole after it
with ``PlanConfig.dp_overlap=False``), ZeRO-2/3
communication per micro-step (overlapped with compute where shorter; under a pipeline once per step, as FSDP
runs in torch's pipelining: :mod:`microbatch.predict.dp_comm`), and the optimizer update.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from microbatch.errors import ConfigError
from microbatch.predict.dp_comm import data_parallel_comm, overlap_sigma
from microbatch.predict.plan_context import (
    Context,
    InFlight,
    LayerCosts,
    StageTimes,
    activations,
    layer_costs,
    make_context,
)
from microbatch.predict.state import resident_zero
from microbatch.predict.steptime import overlap_expert_comm, pipeline_stage_times
from microbatch.schedules.action import stage_to_rank
from microbatch.schedules.registry import get_spec, in_flight_chunks

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
    and interleaved at m >= p; interleaved at m < p runs one round, :func:`microbatch.schedules.closed_forms.
    fill_drain_bubble`). Stage imbalance is in ``step_time_s``; the simulator's idle share, which counts it,
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
    fits_device: bool | None = None
    """Peak ≤ capacity: with ``fits`` False, a tight candidate — inside the device, not its headroom (runs
    this close do work when nothing else holds memory; the headroom is a policy,
    :data:`microbatch.hardware.DEFAULT_HEADROOM`). None when not known (a plan read back from an older file)."""
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
    optimizer_s, fp8_weight_cast_s; simulated_idle (a fraction) when simulated."""
    simulated: bool = False
    """True when the pipeline time comes from the event simulator."""
    expert_parallel: int = 1
    """EP: GPUs the routed experts are spread over (inside d·c)."""
    context_parallel: int = 1
    """c: GPUs each sequence is split over."""
    cp_comm: str = "allgather"
    """How the c ranks exchange K/V (``PlanConfig.cp_comm``)."""
    shard_degree: int | None = None
    """Hybrid sharding's group of data-parallel ranks (``PlanConfig.shard_degree``); None: all d."""
    total_params: int = 0
    """The model's parameters, every expert counted."""
    active_params: int = 0
    """The parameters one token uses (K routed experts per MoE block); = total for a dense model."""
    moments_dtype: str = "fp32"
    """The optimizer's moments (``PlanConfig.moments_dtype``): an export refuses what its config cannot set."""
    master_weights: str = "fp32"
    """The master copy (``PlanConfig.master_weights``)."""
    grad_clip: bool = True
    """Whether the step priced a global-norm gradient clip (``PlanConfig.grad_clip``); exports write it."""

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
            "fits_device": self.fits_device,
            "global_batch": self.global_batch,
            "data_parallel": self.data_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "tensor_parallel": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel,
            "peak_stage": self.peak_stage,
            "gemm_efficiency": self.gemm_efficiency,
            "time": dict(self.time),
            "simulated": self.simulated,
            "expert_parallel": self.expert_parallel,
            "context_parallel": self.context_parallel,
            "cp_comm": self.cp_comm,
            "shard_degree": self.shard_degree,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "moments_dtype": self.moments_dtype,
            "master_weights": self.master_weights,
            "grad_clip": self.grad_clip,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        """A candidate from :meth:`to_dict` output (for example read back from ``plan --json``)."""
        names = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise ConfigError(
                f"not a plan candidate ({e}); give a candidate of a plan's JSON output (Candidate.to_dict)"
            ) from None


def _flight(ctx: Context, sched: str, m: int, v: int) -> InFlight:
    """The schedule's in-flight rule on the probed stages, from the one registry
    (:func:`microbatch.schedules.registry.in_flight_chunks`): chunks / v layer-micro-batches per stage
    layer and min(m, ⌈chunks / v⌉) micro-batches; cached per (schedule, m, v)."""
    key = (sched, m, v)
    hit = ctx.flight_cache.get(key)
    if hit is None:
        p = ctx.cfg.pipeline_parallel
        placement = get_spec(sched).placement
        v_placement = p > 1 and placement == "v"
        head = stage_to_rank(p * v - 1, p, placement) if p > 1 else 0  # rank of the output layer
        rows = []
        for i in ctx.probe:
            chunks = in_flight_chunks(sched, i, p, m, v)
            rows.append((ctx.split[i], chunks / v, min(m, -(-chunks // v)), i == 0, i == head))
        hit = InFlight(v_placement=v_placement, rows=tuple(rows))
        ctx.flight_cache[key] = hit
    return hit


def _state(ctx: Context, z: int, v_placement: bool) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """(weights, gradients, optimizer bytes) of each probed stage under ZeRO ``z``, and the other bytes."""
    z = resident_zero(
        z, ctx.cfg.pipeline_parallel, ctx.cfg.pipeline_grad_reduce
    )  # under a pipeline: 1 (or 2)
    key = (z, v_placement)
    hit = ctx.state_cache.get(key)
    if hit is None:
        cfg = ctx.cfg
        d = cfg.zero_group  # d·c (the context-parallel ranks replicate the state too), or HSDP's shard group
        wb, gb, ob = ctx.state_bpp
        params = ctx.params_v if v_placement else ctx.params
        de = (
            d // cfg.expert_parallel
        )  # the routed experts' state is sharded over the expert-data-parallel d/EP
        rows = []
        for i in ctx.probe:
            x = ctx.expert_params[i]
            n = params[i] - x
            rows.append(
                (n * wb / (d if z >= 3 else 1) + x * wb / (de if z >= 3 else 1) + ctx.fp8_cache.get(i, 0.0),
                 n * gb / (d if z >= 2 else 1) + x * gb / (de if z >= 2 else 1),
                 n * ob / (d if z >= 1 else 1) + x * ob / (de if z >= 1 else 1))
            )  # fmt: skip
        other = cfg.memory_calibration.fixed_bytes
        if z >= 3 and d > 1:
            other += 2 * cfg.shape.layer_params() / cfg.tensor_parallel * wb
        hit = (tuple(rows), other)
        ctx.state_cache[key] = hit
    return hit


def _memory(
    ctx: Context, b: int, m: int, sched: str, v: int, rc: str, z: int, flight: InFlight | None = None
) -> tuple[float, int, tuple[float, float, float, float, float]]:
    """(peak bytes, stage, breakdown) over the probed stages; ``flight`` is :func:`_flight`'s answer when
    the caller has it."""
    per_layer, working, emb, out, a2a = activations(ctx, b, rc)
    scale = ctx.cfg.memory_calibration.activation_scale
    if flight is None:
        flight = _flight(ctx, sched, m, v)
    states, other = _state(ctx, z, flight.v_placement)
    other += a2a
    best = -1.0
    at = 0
    parts = (0.0, 0.0, 0.0, 0.0, 0.0)
    for j, (n_layers, layers_mb, held, first, head) in enumerate(flight.rows):
        weights, grads, opt = states[j]
        acts = per_layer * n_layers * layers_mb + working
        if first:
            acts += emb * held
        if head:
            acts += out * held
        acts *= scale
        total = weights + grads + opt + acts + other
        if total > best:
            best, at, parts = total, ctx.probe[j], (weights, grads, opt, acts, other)
    return best, at, parts


def _stage_times(ctx: Context, b: int, rc: str, v: int = 1) -> StageTimes:
    """Per-stage (forward, input-grad, weight-grad) seconds per micro-batch, and the bottleneck stage; with
    ``v`` chunks per rank (interleaved 1F1B) a micro-batch crosses v chunk boundaries on each rank: v sends."""
    hit = ctx.time_cache.get((b, rc, v))
    if hit is not None:
        return hit
    costs = layer_costs(ctx, b)
    split = ctx.split
    p = len(split)
    # the step-time rule on each distinct stage (an even split has two or three: the others, and the last
    # with the output layer), then spread over the stages by runs: the numbers of every stage, p times cheaper
    runs = ctx.split_runs
    kinds = tuple(dict.fromkeys(n for n, _ in runs)) + (split[-1],)
    layer = overlap_expert_comm(costs.layer, overlap_sigma(ctx)) if ctx.cfg.ep_overlap else costs.layer
    fu, iu, wu = pipeline_stage_times(
        layer,
        costs.logits_s,
        split=kinds,
        p2p_s=costs.p2p_s,
        recompute=rc,
        recompute_every=ctx.cfg.recompute_every,
        virtual=v,
    )
    tu = [a + b_ + c for a, b_, c in zip(fu, iu, wu, strict=True)]
    at = {n: j for j, n in enumerate(kinds[:-1])}
    f: list[float] = []
    i_: list[float] = []
    w: list[float] = []
    T: list[float] = []
    for n, count in runs:
        j = at[n]
        f += [fu[j]] * count
        i_ += [iu[j]] * count
        w += [wu[j]] * count
        T += [tu[j]] * count
    f.append(fu[-1])
    i_.append(iu[-1])
    w.append(wu[-1])
    T.append(tu[-1])
    k = max(range(p), key=T.__getitem__)
    hit = StageTimes(f=f, i=i_, w=w, k=k, Tk=T[k], sumT=sum(T), fk=f[k], ik=i_[k], wk=w[k])
    ctx.time_cache[(b, rc, v)] = hit
    return hit


def _v_stage_times(ctx: Context, b: int, rc: str) -> StageTimes:
    """A V placement's (DualPipeV's) times: ``f``, ``i``, ``w`` per virtual stage (2p chunks, rank r holding
    stages r and 2p−1−r with half its layers each, the output layer and loss on stage 2p−1, a pipeline send
    on every chunk); ``k`` and the ``*k`` sums are the bottleneck rank's (both its chunks)."""
    hit = ctx.vtime_cache.get((b, rc))
    if hit is not None:
        return hit
    costs = layer_costs(ctx, b)
    p = ctx.cfg.pipeline_parallel
    chunks = tuple(
        ctx.split[s] // 2 if s < p else ctx.split[2 * p - 1 - s] - ctx.split[2 * p - 1 - s] // 2
        for s in range(2 * p)
    )
    f, i_, w = pipeline_stage_times(
        overlap_expert_comm(
            costs.layer, overlap_sigma(ctx)
        ),  # DualPipeV pairs one micro-batch's forward with another's backward
        costs.logits_s,
        split=chunks,
        p2p_s=costs.p2p_s,
        recompute=rc,
        recompute_every=ctx.cfg.recompute_every,
    )
    rf = [f[r] + f[2 * p - 1 - r] for r in range(p)]
    ri = [i_[r] + i_[2 * p - 1 - r] for r in range(p)]
    rw = [w[r] + w[2 * p - 1 - r] for r in range(p)]
    T = [a + b_ + c for a, b_, c in zip(rf, ri, rw, strict=True)]
    k = max(range(p), key=T.__getitem__)
    hit = StageTimes(f=f, i=i_, w=w, k=k, Tk=T[k], sumT=sum(T), fk=rf[k], ik=ri[k], wk=rw[k])
    ctx.vtime_cache[(b, rc)] = hit
    return hit


def _pipeline_time(ctx: Context, sched: str, m: int, v: int, tm: StageTimes) -> tuple[float, float]:
    """(seconds of compute + bubble, bubble fraction): the schedule's step-time closed form from the
    registry (:attr:`microbatch.schedules.registry.ScheduleSpec.step_time`; module docstring)."""
    p = ctx.cfg.pipeline_parallel
    if p == 1:
        return m * tm.Tk, 0.0
    step_time = ctx.step_time_cache.get(sched)
    if step_time is None:
        step_time = ctx.step_time_cache[sched] = get_spec(sched).step_time
        if step_time is None:
            raise ConfigError(
                f"schedule {sched!r} has no step-time closed form; the planner cannot screen it"
            )
    return step_time(p, m, v, tm)


def evaluate(
    ctx: Context, b: int, m: int, sched: str, v: int, rc: str, z: int, model_flops: float
) -> Candidate:
    """Predict one candidate: b_m = ``b``, ``m`` micro-batches, schedule ``sched`` with ``v`` chunks per rank,
    recompute ``rc``, ZeRO ``z``; ``model_flops`` per step for the MFU."""
    cfg = ctx.cfg
    p = cfg.pipeline_parallel
    flight = _flight(ctx, sched, m, v)
    peak, stage, (wt, gr, op, ac, ot) = _memory(ctx, b, m, sched, v, rc, z, flight)
    v_placement = flight.v_placement
    tm = (
        _v_stage_times(ctx, b, rc)
        if v_placement
        else _stage_times(ctx, b, rc, v)  # v = 1 but for an interleaved schedule (its check)
    )
    pipe, bubble = _pipeline_time(ctx, sched, m, v, tm)
    key = (b, m, rc, z, v, v_placement)  # the stage times (v sends per chunk) feed the overlap
    comm = ctx.comm_cache.get(key)
    if comm is None:
        n = ctx.max_params_v if v_placement else ctx.max_params
        comm = ctx.comm_cache[key] = data_parallel_comm(ctx, m, z, tm, n)
    dp, zero_s, opt = comm
    # FP8 weights cast once a step (TE): each stage's first forward, one after another along the fill: all L layers
    cast = cfg.shape.layers * layer_costs(ctx, b).layer.weight_cast_s
    step = pipe + dp + zero_s + opt + cast
    if not ctx.fixed:  # the fields every candidate of this plan shares, built once
        ctx.fixed.update(
            global_batch=cfg.global_batch, data_parallel=cfg.data_parallel, pipeline_parallel=p,
            tensor_parallel=cfg.tensor_parallel, sequence_parallel=cfg.sequence_parallel, simulated=False,
            expert_parallel=cfg.expert_parallel, context_parallel=cfg.context_parallel, cp_comm=cfg.cp_comm,
            shard_degree=cfg.shard_degree,
            total_params=ctx.total_params, active_params=ctx.active_params, moments_dtype=cfg.moments_dtype,
            master_weights=cfg.master_weights, grad_clip=cfg.grad_clip,
        )  # fmt: skip
    return _fast_candidate(
        {
            "micro_batch": b,
            "microbatches": m,
            "grad_accum": m,
            "schedule": sched,
            "virtual": v,
            "recompute": rc,
            "zero": z,
            "bubble_fraction": bubble,
            "peak_memory_bytes": peak,
            "memory": {"weights": wt, "gradients": gr, "optimizer": op, "activations": ac, "other": ot},
            "step_time_s": step,
            "tokens_per_s": ctx.tokens_per_step / step,
            "mfu": model_flops / (step * ctx.num_gpus * ctx.peak_flops),
            "fits": peak <= ctx.budget,
            "fits_device": peak <= ctx.cfg.gpu.memory_bytes,
            "peak_stage": stage,
            "gemm_efficiency": layer_costs(ctx, b).gemm_efficiency,
            "time": {"pipeline_s": pipe, "bubble_s": pipe * bubble, "dp_comm_s": dp, "zero_comm_s": zero_s,
                     "optimizer_s": opt, "fp8_weight_cast_s": cast},
        },
        ctx.fixed,
    )  # fmt: skip


def _fast_candidate(fields: dict[str, Any], fixed: dict[str, Any] | None = None) -> Candidate:
    """``Candidate(**fields)`` for the planner's hot loop, given every field: the frozen dataclass's
    ``__init__`` sets each of its fields through ``object.__setattr__`` (about 4 µs a candidate, a
    fifth of the evaluation); filling the instance dictionary at once takes 0.5 µs. Candidate has no
    ``__post_init__`` and no slots, so the result is the same object (equal, frozen, ``replace``-able;
    tested against the constructor). ``fixed``: the fields every candidate of the plan shares."""
    c = object.__new__(Candidate)
    if fixed:
        c.__dict__.update(fixed)
    c.__dict__.update(fields)
    return c


def with_simulation(ctx: Context, c: Candidate, model_flops: float) -> Candidate:
    """``c`` with its pipeline time and bubble from the event simulator (per-stage times, p2p as comm)."""
    cfg = ctx.cfg
    p = cfg.pipeline_parallel
    if p == 1:
        return c
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate

    v = c.virtual
    if p > 1 and get_spec(c.schedule).placement == "v":  # per virtual stage already (DualPipeV)
        tm = _v_stage_times(ctx, c.micro_batch, c.recompute)
        f, i_, w = tm.f, tm.i, tm.w
    else:
        tm = _stage_times(ctx, c.micro_batch, c.recompute, v)  # a send per chunk: v per rank
        f, i_, w = tm.f, tm.i, tm.w
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
    step = pipe + sum(c.time[k] for k in ("dp_comm_s", "zero_comm_s", "optimizer_s", "fp8_weight_cast_s"))
    time = dict(
        c.time, pipeline_s=pipe, bubble_s=pipe * res.bubble_fraction, simulated_idle=res.bubble_fraction
    )
    return replace(
        c,
        step_time_s=step,
        tokens_per_s=cfg.global_batch * cfg.seq_len / step,
        mfu=model_flops / (step * cfg.num_gpus * ctx.peak_flops),
        time=time,
        simulated=True,
    )
