"""A candidate's data-parallel communication: the gradient reduction, ZeRO-1/2/3 gathers and
reduce-scatters (and FSDP2's copy-out), each exposed past the computation it overlaps, and the
optimizer update. Split from :mod:`microbatch.predict.candidate`, which caches it per (b_m, m, recompute, ZeRO, v,
placement).
"""

from __future__ import annotations

from microbatch.predict.collectives import (
    fsdp2_copy_out_s,
    fsdp_edges_s,
    overlap_exposed_s,
    ranks_per_node,
    ring_latency_s,
)
from microbatch.predict.plan_context import Context, StageTimes
from microbatch.predict.roofline import allgather_time_s, allreduce_time_s, reduce_scatter_time_s

__all__ = ["data_parallel_comm", "overlap_sigma"]


def overlap_sigma(ctx: Context) -> float:
    """The slowdown of computation beside an overlapped collective on this plan's accelerator."""
    return ctx.cfg.efficiency.overlap_fraction(bool(ctx.cfg.gpu.compute_units))


def data_parallel_comm(ctx: Context, m: int, z: int, tm: StageTimes, n: float) -> tuple[float, float, float]:
    """(exposed data-parallel seconds, exposed ZeRO-2/3 per-step seconds, optimizer update seconds) for
    ``n`` parameters on the GPU that holds the most."""
    cfg = ctx.cfg
    d = cfg.shard_group  # gradients reduced over d·c
    wb, gb, ob = ctx.state_bpp
    back = tm.ik + tm.wk
    bw_dp = ctx.bw_dp
    sigma = overlap_sigma(ctx)  # computation runs this much slower beside the NCCL kernels it overlaps
    dp = zero_s = 0.0
    if d > 1:
        if z <= 1:
            # gradients reduced once per step, overlapped with the last micro-batch's backward (exposed
            # whole when not dp_overlap); ZeRO-1 then all-gathers the updated half weights (not hidden)
            reduce = reduce_scatter_time_s(n * gb, d, bw_dp) if z == 1 else allreduce_time_s(n * gb, d, bw_dp)
            dp = overlap_exposed_s(reduce, back, sigma) if cfg.dp_overlap else reduce
            if z == 1:
                dp += allgather_time_s(n * wb, d, bw_dp)
        elif cfg.pipeline_parallel > 1:  # ZeRO-2/3 under a pipeline: FSDP as torch's pipelining runs it
            zero_s = _fsdp_under_pipeline(ctx, tm, n)
        elif z == 2:
            # gradients reduce-scattered every micro-step (only a shard is kept), hidden behind its backward
            zero_s = m * overlap_exposed_s(reduce_scatter_time_s(n * gb, d, bw_dp), back, sigma)
            dp = allgather_time_s(n * wb, d, bw_dp)
        else:
            # ZeRO-3/FSDP: weights all-gathered for forward and again for backward, gradients
            # reduce-scattered, every micro-step; prefetch hides what compute covers
            ag, rs, units = _unit_collectives(ctx, tm, n)
            zero_s = m * (overlap_exposed_s(ag, tm.fk, sigma) + overlap_exposed_s(ag + rs, back, sigma))
            # the first unit's gather of each forward and the step's last reduce-scatter: never hidden
            zero_s += fsdp_edges_s(ag, rs, units, m)
            zero_s += 2 * m * _copy_out_s(ctx, n)  # each gather (forward, backward) copied out (FSDP2)
    # the update streams weights, gradients and optimizer state of the parameters this GPU owns, in and out
    owned = n / d if z >= 1 else n
    rate = cfg.efficiency.optimizer_fraction(bool(cfg.gpu.compute_units))  # eager AdamW measured at 0.26
    opt = 2 * (wb + gb + ob) * owned / (cfg.gpu.memory_bandwidth_bytes_per_s * rate)
    return dp, zero_s, opt


def _unit_collectives(ctx: Context, tm: StageTimes, n: float) -> tuple[float, float, int]:
    """(all-gather seconds, reduce-scatter seconds, units) of FSDP over the stage's ``n`` parameters: one
    gather and one reduce-scatter per unit (a layer), each with its ring latency (NCCL's model)."""
    cfg = ctx.cfg
    d, units = cfg.shard_group, ctx.split[tm.k]
    wb, gb, _ = ctx.state_bpp
    alpha = units * ring_latency_s(d, -(-d // ranks_per_node(cfg.gpu, d, cfg.tensor_parallel)))
    ag = allgather_time_s(n * wb, d, ctx.bw_dp) + alpha
    rs = reduce_scatter_time_s(n * gb, d, ctx.bw_dp) + alpha
    return ag, rs, units


def _copy_out_s(ctx: Context, n: float) -> float:
    """One gather of ``n`` parameters copied out on the compute stream under FSDP2, else 0."""
    cfg = ctx.cfg
    if cfg.zero3_impl != "fsdp2":
        return 0.0
    rate = cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory
    return fsdp2_copy_out_s(n * ctx.state_bpp[0], rate)


def _fsdp_under_pipeline(ctx: Context, tm: StageTimes, n: float) -> float:
    """Exposed seconds per step of ZeRO-2/3 under a pipeline, as FSDP runs in ``torch.distributed.pipelining``
    (:func:`microbatch.predict.state.resident_zero`): the weights gathered once, unit by unit behind the
    first micro-batch's forward (its first unit exposed; FSDP2 copies them out once), and the accumulated
    gradients reduce-scattered once after the last backward with nothing left to hide behind: whole."""
    ag, rs, units = _unit_collectives(ctx, tm, n)
    return overlap_exposed_s(ag, tm.fk, overlap_sigma(ctx)) + ag / max(1, units) + rs + _copy_out_s(ctx, n)
