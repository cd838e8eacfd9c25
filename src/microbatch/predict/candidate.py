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
from microbatch.predict.plan_context import Context, LayerCosts, layer_costs, make_context
from microbatch.predict.screen import Screened, ZeroRow, _stage_times, _v_stage_times, screen
from microbatch.schedules.registry import get_spec

__all__ = [
    "Candidate",
    "Context",
    "LayerCosts",
    "evaluate",
    "layer_costs",
    "make_context",
    "simulation_key",
    "with_simulation",
]


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
    """Model FLOPs utilisation: model FLOPs per step / (step time · GPUs · peak). The model FLOPs count attention's
    whole s×s matrix (:func:`~microbatch.predict.roofline.model_flops_per_step`: Narayanan et al. 2021 Eq. 3, PaLM's
    6N + 12·L·H·Q·T), where a causal flash kernel runs half of it, so at long sequences the MFU passes the attention
    kernel's share of the peak and can pass 1 (Llama-3-8B at 262,144 tokens on one A100: 1.02); the FLOPs the GPU
    ran are ``time``'s terms, not this figure."""
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


def evaluate(
    ctx: Context, b: int, m: int, sched: str, v: int, rc: str, z: int, model_flops: float
) -> Candidate:
    """Predict one candidate: b_m = ``b``, ``m`` micro-batches, schedule ``sched`` with ``v`` chunks per rank,
    recompute ``rc``, ZeRO ``z``; ``model_flops`` per step for the MFU."""
    return evaluate_zeros(ctx, b, m, sched, v, rc, (z,), model_flops)[0]


def evaluate_zeros(
    ctx: Context, b: int, m: int, sched: str, v: int, rc: str, zs: tuple[int, ...], model_flops: float
) -> list[Candidate]:
    """:func:`evaluate` for each ZeRO stage of ``zs``, sharing what they share (:func:`~microbatch.predict.screen.
    screen`): the planner's inner loop."""
    head, rows = screen(ctx, b, m, sched, v, rc, zs)
    return [to_candidate(ctx, head, row, model_flops) for row in rows]


def to_candidate(ctx: Context, head: Screened, row: ZeroRow, model_flops: float) -> Candidate:
    """The :class:`Candidate` of one screened row (:func:`~microbatch.predict.screen.screen`), with its tokens/s
    and MFU (``model_flops`` per step)."""
    step = row.step_s
    wt, gr, op, ac, ot = row.parts
    return _fast_candidate(
        {
            "micro_batch": head.b,
            "microbatches": head.m,
            "grad_accum": head.m,
            "schedule": head.sched,
            "virtual": head.v,
            "recompute": head.rc,
            "zero": row.z,
            "bubble_fraction": head.bubble,
            "peak_memory_bytes": row.peak,
            "memory": {"weights": wt, "gradients": gr, "optimizer": op, "activations": ac, "other": ot},
            "step_time_s": step,
            "tokens_per_s": ctx.tokens_per_step / step,
            "mfu": model_flops / (step * ctx.num_gpus * ctx.peak_flops),
            "fits": row.peak <= ctx.budget,
            "fits_device": row.peak <= ctx.cfg.gpu.memory_bytes,
            "peak_stage": row.stage,
            "gemm_efficiency": head.gemm_efficiency,
            "time": {"pipeline_s": head.pipe, "bubble_s": head.pipe * head.bubble, "dp_comm_s": row.dp,
                     "zero_comm_s": row.zero_s, "optimizer_s": row.opt, "fp8_weight_cast_s": head.cast},
        },
        ctx.fixed or _fixed_fields(ctx),
    )  # fmt: skip


def _fixed_fields(ctx: Context) -> dict[str, Any]:
    """The candidate fields every candidate of this plan shares, built once into ``ctx.fixed``."""
    cfg = ctx.cfg
    ctx.fixed.update(
        global_batch=cfg.global_batch, data_parallel=cfg.data_parallel, pipeline_parallel=cfg.pipeline_parallel,
        tensor_parallel=cfg.tensor_parallel, sequence_parallel=cfg.sequence_parallel, simulated=False,
        expert_parallel=cfg.expert_parallel, context_parallel=cfg.context_parallel, cp_comm=cfg.cp_comm,
        shard_degree=cfg.shard_degree,
        total_params=ctx.total_params, active_params=ctx.active_params, moments_dtype=cfg.moments_dtype,
        master_weights=cfg.master_weights, grad_clip=cfg.grad_clip,
    )  # fmt: skip
    return ctx.fixed


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


PLAN_SIMULATED_ACTIONS = 200_000
"""The largest schedule (actions over all ranks) the planner simulates for a candidate it keeps: about 0.7 s at the
simulator's measured 3.6 µs an action (:data:`~microbatch.schedules.limits.MAX_SIMULATED_ACTIONS`), a few of them
a plan. Past it (m > 8,000 micro-batches at p = 8) the bubble the simulation refines is under 0.1% of the step, and
the candidate keeps its analytic time (a plan of B = 10⁶ at p = 8 ran for minutes and gigabytes before)."""


def with_simulation(ctx: Context, c: Candidate, model_flops: float) -> Candidate:
    """``c`` with its pipeline time and bubble from the event simulator (per-stage times, p2p as comm); ``c`` as it
    is past :data:`PLAN_SIMULATED_ACTIONS`."""
    cfg = ctx.cfg
    p = cfg.pipeline_parallel
    if p == 1:
        return c
    from microbatch.schedules.limits import count_actions

    if count_actions(c.schedule, p, c.microbatches, c.virtual) > PLAN_SIMULATED_ACTIONS:
        return c
    key = simulation_key(c)
    hit = ctx.sim_cache.get(key)
    if hit is None:  # the ZeRO rows of one (b_m, schedule, v, recompute) share it: simulated once
        hit = ctx.sim_cache[key] = _simulated(ctx, c)
    pipe, fraction = hit
    step = pipe + sum(c.time[k] for k in ("dp_comm_s", "zero_comm_s", "optimizer_s", "fp8_weight_cast_s"))
    time = dict(c.time, pipeline_s=pipe, bubble_s=pipe * fraction, simulated_idle=fraction)
    return replace(
        c,
        step_time_s=step,
        tokens_per_s=cfg.global_batch * cfg.seq_len / step,
        mfu=model_flops / (step * cfg.num_gpus * ctx.peak_flops),
        time=time,
        simulated=True,
    )


def simulation_key(c: Candidate) -> tuple[str, int, int, int, str]:
    """What a candidate's simulation depends on (its ZeRO rows share it): the key of ``Context.sim_cache``."""
    return (c.schedule, c.microbatches, c.virtual, c.micro_batch, c.recompute)


def _simulated(ctx: Context, c: Candidate) -> tuple[float, float]:
    """(makespan, bubble fraction) of ``c``'s schedule simulated on its per-stage times."""
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate

    p, v = ctx.cfg.pipeline_parallel, c.virtual
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
    return res.makespan, res.bubble_fraction
