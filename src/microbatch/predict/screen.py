"""The planner's closed-form screening of one candidate's memory and time (:func:`screen`).

Per-stage peak memory: each probed stage's weights, gradients and optimizer state under the ZeRO stage
(:func:`_state`) plus its activations under the schedule's in-flight rule (:func:`_flight`,
:func:`_stage_activations`); step time: each stage's F, I and W from the one step-time rule
(:mod:`microbatch.predict.steptime`, :func:`_stage_times`), the schedule's closed form for compute and
bubble (:func:`_pipeline_time`; the forms are listed in :mod:`microbatch.predict.candidate`), and the
data-parallel communication (:mod:`microbatch.predict.dp_comm`). What a (b_m, m, schedule, v, recompute)
fixes is computed once for all its ZeRO stages; the :class:`~microbatch.predict.plan_context.Context`
caches what does not depend on the candidate. :mod:`microbatch.predict.candidate` makes a
:class:`~microbatch.predict.candidate.Candidate` of each row; a layout search
(:func:`~microbatch.predict.plan.search_layouts`) reads the rows and builds one only for a new best.
"""

from __future__ import annotations

from typing import NamedTuple

from microbatch.precision import LOSS_DTYPES
from microbatch.predict.activations import deferred_output_share, output_micro_batches, stage_block_bytes
from microbatch.predict.dp_comm import data_parallel_comm, overlap_sigma
from microbatch.predict.experts import zero3_unit_params
from microbatch.predict.plan_context import (
    Context,
    InFlight,
    LayerCosts,
    ParamTables,
    StageTimes,
    activations,
    layer_costs,
    moe_blocks,
    param_tables,
)
from microbatch.predict.roofline import LayerTime
from microbatch.predict.state import held_grad_bytes, resident_zero, zero3_buffer_bytes
from microbatch.predict.steptime import overlap_expert_comm, pipeline_stage_times
from microbatch.schedules.action import stage_to_rank
from microbatch.schedules.closed_forms import PipelineTime
from microbatch.schedules.in_flight import end_stages_in_flight, in_flight_chunks, served_spec
from microbatch.schedules.registry import get_spec, is_builtin
from microbatch.schedules.spec_checks import check_count, check_step_time

__all__ = ["Screened", "ZeroRow", "screen"]


class Screened(NamedTuple):
    """What one (b_m, m, schedule, v, recompute) fixes for all its ZeRO stages."""

    b: int
    m: int
    sched: str
    v: int
    rc: str
    pipe: float
    """Seconds of compute and bubble of one flush (the schedule's closed form)."""
    bubble: float
    """The closed form's bubble fraction."""
    cast: float
    """FP8 weights cast once a step (Transformer Engine), else 0."""
    gemm_efficiency: float
    """Achieved fraction of peak FLOP/s of one layer's forward."""


class ZeroRow(NamedTuple):
    """One ZeRO stage's memory and time on top of a :class:`Screened`."""

    z: int
    peak: float
    """Peak bytes over the probed stages."""
    stage: int
    """The stage at the peak."""
    parts: tuple[float, float, float, float, float]
    """Its weights, gradients, optimizer state, activations and other bytes."""
    dp: float
    """Exposed data-parallel seconds."""
    zero_s: float
    """Exposed ZeRO-2/3 seconds per step."""
    opt: float
    """The optimizer update's seconds."""
    step_s: float
    """The step: pipe + dp + zero_s + opt + cast."""


def screen(
    ctx: Context, b: int, m: int, sched: str, v: int, rc: str, zs: tuple[int, ...]
) -> tuple[Screened, list[ZeroRow]]:
    """Memory and step time of b_m = ``b``, ``m`` micro-batches, schedule ``sched`` with ``v`` chunks per rank
    and recompute ``rc``, under each ZeRO stage of ``zs``: what they share once, then a row per stage."""
    cfg = ctx.cfg
    flight = _flight(ctx, sched, m, v)
    v_placement = flight.v_placement
    tm = (
        _v_stage_times(ctx, b, rc)
        if v_placement
        else _stage_times(ctx, b, rc, v)  # v = 1 but for an interleaved schedule (its check)
    )
    pipe, bubble = _pipeline_time(ctx, sched, m, v, tm)
    costs = layer_costs(ctx, b)
    # FP8 weights cast once a step (TE): each stage's first forward, one after another along the fill: all L layers
    cast = (
        cfg.shape.layers * costs.layer.weight_cast_s
        if costs.dense is None
        else ctx.moe_layers * costs.layer.weight_cast_s
        + (cfg.shape.layers - ctx.moe_layers) * costs.dense.weight_cast_s
    )
    acts = _stage_activations(ctx, b, rc, flight, v)
    a2a = activations(ctx, b, rc).a2a
    tables = ctx.param_cache[1, False] if ctx.moe_split is None else param_tables(ctx, v, v_placement)
    rows: list[ZeroRow] = []
    seen: dict[int, ZeroRow] = {}
    piped = cfg.pipeline_parallel > 1
    for z in zs:
        same = seen.get(2 if piped and z == 3 else -1)
        if (
            same is not None
        ):  # under a pipeline ZeRO-3 holds and communicates as ZeRO-2 (resident_zero; "pipeline")
            rows.append(ZeroRow(z, *same[1:]))
            continue
        peak, stage, parts = _peak(ctx, z, v_placement, acts, a2a, v)
        key = (b, m, rc, v, v_placement, z)
        comm = ctx.dp_cache.get(key)
        if comm is None:  # the schedules of one placement and v share the stage times, so these seconds
            comm = ctx.dp_cache[key] = _slowest_dp_comm(ctx, m, z, tm, tables, v_placement)
        dp, zero_s, opt = comm
        row = seen[z] = ZeroRow(z, peak, stage, parts, dp, zero_s, opt, pipe + dp + zero_s + opt + cast)
        rows.append(row)
    return Screened(b, m, sched, v, rc, pipe, bubble, cast, costs.gemm_efficiency), rows


def _slowest_dp_comm(
    ctx: Context, m: int, z: int, tm: StageTimes, tables: ParamTables, v_placement: bool
) -> tuple[float, float, float]:
    """The data-parallel (seconds, ZeRO seconds, update seconds) of the stage slowest to reduce and update, every
    stage reducing at once: without expert parallelism the one with the most parameters; with it each probed stage
    with its own experts, which ride their own group (:func:`~microbatch.predict.dp_comm.data_parallel_comm`). The
    most parameters of one stage beside the most experts of another were priced together (DeepSeek-V3 at p 4: the
    embedding's stage with the last one's 16 MoE layers, the reduction 13% short, a review)."""
    params = tables.params_v if v_placement else tables.params
    if ctx.cfg.expert_parallel <= 1:
        return data_parallel_comm(ctx, m, z, tm, max(params.values()), tables.max_experts)
    pairs = {(params[i], tables.expert_params[i]) for i in params}
    return max((data_parallel_comm(ctx, m, z, tm, n, x) for n, x in sorted(pairs)), key=sum)


def _flight(ctx: Context, sched: str, m: int, v: int) -> InFlight:
    """The schedule's in-flight rule on the probed stages, from the one registry
    (:func:`microbatch.schedules.in_flight.in_flight_chunks`): chunks / v layer-micro-batches per stage
    layer, and the micro-batches of the embedding's and the output layer's stages
    (:func:`~microbatch.schedules.in_flight.end_stages_in_flight`); cached per (schedule, m, v)."""
    key = (sched, m, v)
    hit = ctx.flight_cache.get(key)
    if hit is None:
        p = ctx.cfg.pipeline_parallel
        spec = get_spec(sched)
        placement = spec.placement
        v_placement = p > 1 and placement == "v"
        head = stage_to_rank(p * v - 1, p, placement) if p > 1 else 0  # rank of the output layer
        rule = spec.in_flight
        ends = end_stages_in_flight(sched, p, m, v)  # micro-batches on the first and the last virtual stage
        split = p > 1 and spec.split_backward  # the waiting weight gradients hold the logits' gradient
        outputs = output_micro_batches(ends[1], split, _output_share(ctx) if split else 1.0)
        rows = []
        for i in ctx.probe:
            chunks = (  # the rule's answer, checked (a registered rule's too), or in_flight_chunks' error
                check_count(sched, "in_flight", rule(i, p, m, v), m * v)
                if rule is not None
                else in_flight_chunks(sched, i, p, m, v)
            )
            rows.append((ctx.split[i], chunks / v, ends[0] if i == 0 else 0, outputs if i == head else 0.0))
        hit = InFlight(v_placement=v_placement, rows=tuple(rows))
        ctx.flight_cache[key] = hit
    return hit


def _output_share(ctx: Context) -> float:
    """:func:`~microbatch.predict.activations.deferred_output_share` of the context's head, as
    :func:`~microbatch.predict.plan_context.activations` prices the output layer."""
    cfg = ctx.cfg
    return deferred_output_share(cfg.shape, dtype_bytes=ctx.e, logits_bytes=LOSS_DTYPES[cfg.loss_dtype],
                                 eager_layers=cfg.layer_kernels == "eager", **ctx.act_kw)  # fmt: skip


def _state(
    ctx: Context, z: int, v_placement: bool, v: int = 1
) -> tuple[tuple[tuple[float, float, float], ...], tuple[float, ...], float]:
    """(weights, gradients, optimizer bytes) of each probed stage under ZeRO ``z``, their sum, and the other bytes (cached
    per ZeRO stage asked, the one it keeps resident under a pipeline computed on a miss); a MoE model with dense
    blocks holds its placement's blocks (:func:`~microbatch.predict.plan_context.param_tables`, ``v`` chunks a rank)."""
    key = (
        z,
        v_placement,
        v,
    )  # v matters only for a MoE model with dense blocks; a few entries more for the others
    hit = ctx.state_cache.get(key)
    if hit is None:
        cfg = ctx.cfg
        tables = param_tables(ctx, v, v_placement)
        wb, gb, ob = ctx.state_bpp
        gb = held_grad_bytes(z, cfg.pipeline_parallel, cfg.pipeline_grad_reduce, gb, cfg.reduce_bytes)
        z = resident_zero(z, cfg.pipeline_parallel, cfg.pipeline_grad_reduce)  # under a pipeline: 1 (or 2)
        d = cfg.zero_group  # d·c (the context-parallel ranks replicate the state too), or HSDP's shard group
        params = tables.params_v if v_placement else tables.params
        de = (
            d // cfg.expert_parallel
        )  # the routed experts' state is sharded over the expert-data-parallel d/EP
        rows = []
        for i in ctx.probe:
            x = tables.expert_params[i]
            n = params[i] - x
            rows.append(
                (n * wb / (d if z >= 3 else 1) + x * wb / (de if z >= 3 else 1) + tables.fp8_cache.get(i, 0.0),
                 n * gb / (d if z >= 2 else 1) + x * gb / (de if z >= 2 else 1),
                 n * ob / (d if z >= 1 else 1) + x * ob / (de if z >= 1 else 1))
            )  # fmt: skip
        other = cfg.memory_calibration.fixed_bytes
        if z >= 3 and d > 1:
            unit = zero3_unit_params(cfg.shape, cfg.tensor_parallel, cfg.expert_parallel, d)
            other += zero3_buffer_bytes(unit, wb, cfg.reduce_bytes)
        hit = (tuple(rows), tuple(w + g + o for w, g, o in rows), other)
        ctx.state_cache[key] = hit
    return hit


def _stage_activations(ctx: Context, b: int, rc: str, flight: InFlight, v: int) -> tuple[float, ...]:
    """Activation bytes of each probed stage at b_m = ``b`` under recompute ``rc`` and the schedule's in-flight
    rule ``flight`` (:func:`_flight`), with the memory calibration's scale."""
    per_layer, working, emb, out, _, dense, loss_tr = activations(ctx, b, rc)
    scale = ctx.cfg.memory_calibration.activation_scale
    ks = moe_blocks(ctx, v, flight.v_placement) if dense is not None else None  # each rank's MoE blocks
    rows = []
    for j, (n_layers, layers_mb, first, head) in enumerate(flight.rows):
        if ks is None:
            acts = per_layer * n_layers * layers_mb + working
        else:
            acts = stage_block_bytes(per_layer, dense, n_layers, ks[ctx.probe[j]]) * layers_mb + working
        acts += emb * first  # micro-batches on the first virtual stage (0 elsewhere)
        if (
            head
        ):  # the loss's backward and the recompute come at different moments: the larger transient counts
            acts += out * head + max(0.0, loss_tr - working)
        rows.append(acts * scale)
    return tuple(rows)


def _peak(
    ctx: Context, z: int, v_placement: bool, acts: tuple[float, ...], a2a: float, v: int = 1
) -> tuple[float, int, tuple[float, float, float, float, float]]:
    """(peak bytes, stage, breakdown) over the probed stages under ZeRO ``z``, their activations ``acts``
    (:func:`_stage_activations`) and expert parallelism's all-to-all buffers ``a2a``."""
    states, held, other = _state(ctx, z, v_placement, v)
    other += a2a
    best, at = -1.0, 0
    for j, state in enumerate(held):
        total = state + acts[j]
        if total > best:  # the first of the largest
            best, at = total, j
    weights, grads, opt = states[at]
    return best + other, ctx.probe[at], (weights, grads, opt, acts[at], other)


def _stage_times(ctx: Context, b: int, rc: str, v: int = 1) -> StageTimes:
    """Per-stage (forward, input-grad, weight-grad) seconds per micro-batch, and the bottleneck stage; with
    ``v`` chunks per rank (interleaved 1F1B) a micro-batch crosses v chunk boundaries on each rank: v sends."""
    hit = ctx.time_cache.get((b, rc, v))
    if hit is not None:
        return hit
    costs = layer_costs(ctx, b)
    split = ctx.split
    layer = overlap_expert_comm(costs.layer, overlap_sigma(ctx)) if ctx.cfg.ep_overlap else costs.layer
    if (
        costs.dense is not None
    ):  # a MoE model with dense blocks: every stage by its own blocks, chunks as placed
        f, i_, w = pipeline_stage_times(
            layer, costs.logits_s, split=split, p2p_s=costs.p2p_s, recompute=rc,
            recompute_every=ctx.cfg.recompute_every, virtual=v, dense=costs.dense, moe_split=moe_blocks(ctx, v, False),
        )  # fmt: skip
        T = [a + b_ + c for a, b_, c in zip(f, i_, w, strict=True)]
    else:
        f, i_, w, T = _spread(ctx, layer, costs, rc, v)
    k = T.index(max(T))  # the first of the slowest
    hit = StageTimes(f=f, i=i_, w=w, k=k, Tk=T[k], sumT=sum(T), fk=f[k], ik=i_[k], wk=w[k])
    ctx.time_cache[(b, rc, v)] = hit
    return hit


def _spread(
    ctx: Context, layer: LayerTime, costs: LayerCosts, rc: str, v: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """F, I, W and their sum of every stage: the step-time rule on each distinct stage (an even split has two or
    three: the others, and the last with the output layer), then spread over the stages by runs (p times cheaper)."""
    split, runs = ctx.split, ctx.split_runs
    kinds = tuple(dict.fromkeys(n for n, _ in runs)) + (split[-1],)
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
    return f, i_, w, T


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
    moe_split = None
    if costs.dense is not None:  # virtual stage s holds the layers after those of stages 0 … s − 1
        shape = ctx.cfg.shape
        moe_split = tuple(shape.moe_layer_count(sum(chunks[:s]), chunks[s]) for s in range(2 * p))
    f, i_, w = pipeline_stage_times(
        overlap_expert_comm(
            costs.layer, overlap_sigma(ctx)
        ),  # DualPipeV pairs one micro-batch's forward with another's backward
        costs.logits_s,
        split=chunks,
        p2p_s=costs.p2p_s,
        recompute=rc,
        recompute_every=ctx.cfg.recompute_every,
        dense=costs.dense,
        moe_split=moe_split,
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
        step_time = ctx.step_time_cache[sched] = _step_time_rule(sched)
    return step_time(p, m, v, tm)


def _step_time_rule(sched: str) -> PipelineTime:
    """The schedule's step-time closed form; a registered one's answers checked (:func:`check_step_time`)."""
    rule = served_spec(sched, planned=True).step_time
    assert rule is not None  # served_spec refuses a spec without one
    if is_builtin(sched):
        return rule
    return lambda p, m, v, tm: check_step_time(sched, rule(p, m, v, tm))
