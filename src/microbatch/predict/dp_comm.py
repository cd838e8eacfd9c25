"""A candidate's data-parallel communication: the gradient reduction, ZeRO-1/2/3 gathers and
reduce-scatters (and FSDP2's copy-out), each exposed past the computation it overlaps, and the
optimizer update. Split from :mod:`microbatch.predict.candidate`, which caches it per (b_m, m, recompute, ZeRO, v,
placement).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

from microbatch.predict.collectives import (
    fsdp2_accumulate_s,
    fsdp2_copy_in_s,
    fsdp2_copy_out_s,
    fsdp_edges_s,
    group_bandwidth,
    overlap_exposed_s,
    ranks_per_node,
    ring_latency_s,
)
from microbatch.predict.plan_context import Context, StageTimes
from microbatch.predict.roofline import allgather_time_s, allreduce_time_s, reduce_scatter_time_s
from microbatch.predict.state import bf16_fp32_accumulate_bytes, held_grad_bytes, reduced_grad_bytes

__all__ = ["CLIP_PASSES", "clip_s", "data_parallel_comm", "overlap_sigma"]


def overlap_sigma(ctx: Context) -> float:
    """The slowdown of computation beside an overlapped collective on this plan's accelerator."""
    return ctx.cfg.efficiency.overlap_fraction(bool(ctx.cfg.gpu.compute_units))


def data_parallel_comm(
    ctx: Context, m: int, z: int, tm: StageTimes, n: float, experts: float | None = None
) -> tuple[float, float, float]:
    """(exposed data-parallel seconds, exposed ZeRO-2/3 per-step seconds, optimizer update seconds, with the
    gradient clip when ``cfg.grad_clip``: :func:`clip_s`) for
    ``n`` parameters on the GPU that holds the most. ZeRO shards over ``cfg.zero_group`` ranks; under hybrid
    sharding the ``cfg.replicas`` copies of each shard also all-reduce its gradients (:func:`_replica_s`),
    right after each reduce-scatter, behind the same backward. The collectives' own times (:func:`_collectives`)
    are the same for every candidate with this ZeRO stage, ``n`` and bottleneck stage: cached in the context;
    what each exposes depends on the candidate's compute. ``experts``: the most routed-expert parameters on one GPU
    (default: over the context's stages, :attr:`~microbatch.predict.plan_context.Context.expert_params`)."""
    cfg = ctx.cfg
    key = (z, n, ctx.split[tm.k], experts)
    c = ctx.collective_cache.get(key)
    if c is None:
        c = ctx.collective_cache[key] = _collectives(ctx, z, tm, n, experts)
    back = tm.ik + tm.wk
    sigma = c.sigma  # computation runs this much slower beside the NCCL kernels it overlaps
    dp = zero_s = 0.0
    if c.kind == "allreduce":
        # ZeRO 0: gradients all-reduced once per step, behind the last micro-batch's backward (or after it)
        dp = overlap_exposed_s(c.reduce, back, sigma) if cfg.dp_overlap else c.reduce
    elif c.kind == "zero1":
        # reduce-scattered once per step like that; ZeRO-1 then all-gathers the updated half weights (not hidden).
        # DeepSpeed's bf16 optimizer all-reduces its fp32 buffer after the backward has returned: exposed whole
        hidden = cfg.dp_overlap and cfg.grad_dtype != "bf16+fp32"
        dp = (overlap_exposed_s(c.reduce, back, sigma) if hidden else c.reduce) + c.gather
    elif c.kind == "pipeline":
        # ZeRO-2/3 under a pipeline (resident_zero): FSDP as torch's pipelining runs it, or reducing every
        # micro-batch's gradients (pipeline_grad_reduce "each")
        each = cfg.pipeline_grad_reduce == "each"
        zero_s = _fsdp_under_pipeline(c, tm, m if each else 0) + (0.0 if each else m * c.accumulate)
    elif c.kind == "zero2":
        # gradients reduce-scattered every micro-step (only a shard is kept), hidden behind its backward
        zero_s = m * overlap_exposed_s(c.reduce, back, sigma)
        dp = c.gather
    elif c.kind == "zero3":
        # ZeRO-3/FSDP: weights all-gathered for forward and again for backward, gradients
        # reduce-scattered (and all-reduced across replicas), every micro-step; prefetch hides what compute covers
        ag, rs = c.gather, c.reduce
        side = _with_replicas(
            ctx, rs, c.replica, c.units
        )  # with hybrid sharding's all-reduce across the replicas
        zero_s = m * (overlap_exposed_s(ag, tm.fk, sigma) + overlap_exposed_s(ag + side, back, sigma))
        # the first unit's gather of each forward and the step's last reduce-scatter (and its all-reduce, which
        # waits for it): never hidden
        zero_s += fsdp_edges_s(ag, rs + c.replica, c.units, m)
        zero_s += m * (2 * c.copy_out + c.copy_in)  # each gather copied out, each reduction copied in (FSDP2)
    if (
        c.kind != "pipeline"
    ):  # bf16+fp32's accumulation, every micro-batch (FSDP2's under a pipeline is above)
        dp += m * c.accumulate
    return dp, zero_s, c.update


class Collectives(NamedTuple):
    """One ZeRO stage's collectives on ``n`` parameters, before any overlap (:func:`_collectives`)."""

    kind: Literal["none", "allreduce", "zero1", "zero2", "zero3", "pipeline"]
    """``none`` (one replica), ``allreduce`` (ZeRO 0), ``zero1``, ``zero2``, ``zero3``, or ``pipeline`` (ZeRO-2/3
    under a pipeline, :func:`_fsdp_under_pipeline`)."""
    reduce: float
    """Seconds of the gradient reduction: the all-reduce (ZeRO 0), the reduce-scatter with the replicas' all-reduce
    (ZeRO-1/2, ZeRO-3's per unit), the stage's reduce-scatter alone under a pipeline."""
    gather: float
    """Seconds of the weights' all-gather (ZeRO ≥ 1)."""
    units: int
    """FSDP's units (the bottleneck stage's layers)."""
    copy_out: float
    """One gather copied out (FSDP2), else 0."""
    copy_in: float
    """One reduction's gradients copied into its reduce-scatter buffer (FSDP2), else 0."""
    replica: float
    """Hybrid sharding's all-reduce across the replicas (:func:`_replica_s`): under a pipeline per unit, else beside or
    after each micro-step's reduce-scatters (:func:`_with_replicas`); 0 without replicas."""
    accumulate: float
    """Under a pipeline reducing after the last micro-batch: one micro-batch's accumulation of the stage's gradients
    (:func:`~microbatch.predict.collectives.fsdp2_accumulate_s`); with ``bf16+fp32`` gradients their add into the fp32
    buffer (:func:`_bf16_fp32_accumulate_s`); else 0."""
    update: float
    """The optimizer update's seconds (and the clip's)."""
    sigma: float
    """:func:`overlap_sigma`."""


def _collectives(ctx: Context, z: int, tm: StageTimes, n: float, experts: float | None = None) -> Collectives:
    """The collectives of ZeRO ``z`` over ``n`` parameters (those of the bottleneck stage ``tm.k``: FSDP's units)."""
    cfg = ctx.cfg
    d = cfg.shard_group  # gradients reduced over d·c
    zg, bw_zero = cfg.zero_group, ctx.bw_zero  # ZeRO's shard group: d·c, or shard_degree·c (HSDP)
    wb, gb, _ = ctx.state_bpp
    gr = reduced_grad_bytes(cfg.grad_dtype, gb)  # bf16+fp32 reduces its fp32 buffer
    kind: Literal["none", "allreduce", "zero1", "zero2", "zero3", "pipeline"] = "none"
    reduce, gather, units, copy, copy_in, replica, accumulate = 0.0, 0.0, 0, 0.0, 0.0, 0.0, 0.0
    x = _routed_here(ctx, n, experts)
    if d > 1:
        if z == 0:
            kind, reduce = "allreduce", _split_s(ctx, allreduce_time_s, n * gr, x * gr, d, ctx.bw_dp)
        elif z == 1 or (z == 2 and cfg.pipeline_parallel == 1):
            kind = "zero1" if z == 1 else "zero2"
            # DeepSpeed's bf16 optimizer all-reduces the whole fp32 buffer (ZeRO-1's reduce-scatter elsewhere)
            fn = allreduce_time_s if cfg.grad_dtype == "bf16+fp32" else reduce_scatter_time_s
            reduce = _split_s(ctx, fn, n * gr, x * gr, zg, bw_zero)
            reduce += _replica_s(ctx, tm, n, per_unit=False)
            gather = _split_s(ctx, allgather_time_s, n * wb, x * wb, zg, bw_zero)
        else:
            kind = "pipeline" if cfg.pipeline_parallel > 1 else "zero3"
            gather, reduce, units = _unit_collectives(ctx, tm, n, x)
            sharded = n - x * (zg // max(1, cfg.expert_parallel) <= 1)  # experts on one rank are not gathered
            copy, copy_in = _copy_out_s(ctx, sharded), _copy_in_s(ctx, sharded)
            if kind == "pipeline":
                replica = _replica_s(ctx, tm, n)
                accumulate = _accumulate_s(ctx, n)
            else:
                replica = _replica_s(
                    ctx, tm, n
                )  # beside the reduce-scatters (FSDP2) or after each (the others)
    if cfg.grad_dtype == "bf16+fp32":
        accumulate = _bf16_fp32_accumulate_s(ctx, n)
    update = _update_s(ctx, z, n, experts)
    return Collectives(
        kind, reduce, gather, units, copy, copy_in, replica, accumulate, update, overlap_sigma(ctx)
    )


def _update_s(ctx: Context, z: int, n: float, experts: float | None = None) -> float:
    """The optimizer update of the parameters this GPU owns, with the gradient clip when ``cfg.grad_clip``."""
    cfg = ctx.cfg
    wb, gb, ob = ctx.state_bpp
    gb = reduced_grad_bytes(cfg.grad_dtype, gb)  # bf16+fp32 steps with its fp32 buffer's partition
    zg = cfg.zero_group
    # the update streams weights, gradients and optimizer state of the parameters this GPU owns: in and out once
    # (fused, or a CPU), or as many passes as the optimizer's unfused kernels make (EAGER_PASSES) on a GPU
    owned = n if z < 1 else (n / zg if cfg.expert_parallel == 1 else _owned_with_experts(ctx, n, experts))
    gpu = bool(cfg.gpu.compute_units)
    rate = cfg.efficiency.optimizer_fraction(gpu)
    moved = ctx.eager_update_bpp if gpu and not cfg.efficiency.fused_elementwise else 2 * (wb + gb + ob)
    opt = moved * owned / (cfg.gpu.memory_bandwidth_bytes_per_s * rate)
    stream = cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory
    if cfg.grad_dtype == "bf16+fp32":
        # BF16_Optimizer.step takes the norm over every parameter's fp32 gradient, not the partition's
        # (get_grads_for_norm), clips them all when clipping, and clear_hp_grads zeroes the whole buffer after
        passes = (CLIP_PASSES if cfg.grad_clip else 1) + 1
        opt += passes * n * gb / stream
    elif cfg.grad_clip:
        opt += clip_s(owned * gb, stream)
    return opt


CLIP_PASSES = 3.0
"""Passes over the gradients a global-norm clip makes: one read for the norm (``torch._foreach_norm``; Megatron's
``multi_tensor_l2norm``) and a read and a write to scale them (``torch._foreach_mul_``, every step in torch's
``clip_grad_norm_``, which multiplies by the clamped coefficient; ``multi_tensor_scale`` in Megatron, only when the
norm exceeds the limit: counted always, an upper bound there). apex's ``DistributedFusedAdam`` (NeMo) folds the scale
into its Adam kernel (one pass, the norm's), and Megatron's distributed optimizer takes the norm over fp32 copies of
half gradients: both are priced at these three passes of the gradient type, within a pass either way."""


def clip_s(grad_bytes: float, rate: float) -> float:
    """Seconds of clipping ``grad_bytes`` of gradients by their global norm at ``rate`` bytes/s (a streaming rate):
    :data:`CLIP_PASSES` × bytes / rate. The norm's one-scalar all-reduce (microseconds) is left out. The gradients
    clipped are those the rank updates: its shard under ZeRO ≥ 1 (Megatron's distributed optimizer and DeepSpeed
    clip the shard's norm and all-reduce it), all of them under plain data parallelism."""
    return CLIP_PASSES * grad_bytes / rate


def _owned_with_experts(ctx: Context, n: float, experts: float | None = None) -> float:
    """Under ZeRO ≥ 1 with expert parallelism, the parameters whose update (and clip) this GPU runs: the dense ones'
    1/zero_group share and the routed experts' 1/(zero_group/EP) (their state sharded over the expert-data-parallel
    ranks only, as :func:`microbatch.predict.candidate._state` holds it), the experts those of the stage holding the
    most. (Without EP: n/zero_group; without ZeRO: all n.)"""
    zg, ep = ctx.cfg.zero_group, ctx.cfg.expert_parallel
    x = _routed_here(ctx, n, experts)
    return (n - x) / zg + x / max(1, zg // ep)


def _routed_here(ctx: Context, n: float, experts: float | None = None) -> float:
    """Of the ``n`` parameters on the GPU, the routed experts' (``experts``, default the most of any stage's,
    :attr:`~microbatch.predict.plan_context.Context.expert_params`), when expert parallelism splits them off: 0
    without EP, where every parameter shares one data-parallel group."""
    if ctx.cfg.expert_parallel <= 1:
        return 0.0
    return min(n, max(ctx.expert_params.values(), default=0.0) if experts is None else experts)


Collective = Callable[[float, int, float], float]


def _split_s(ctx: Context, fn: Collective, nbytes: float, routed: float, group: int, bw: float) -> float:
    """Seconds of the collective ``fn`` over a data-parallel ``group`` (at ``bw``) of ``nbytes``, ``routed`` of
    them the routed experts' gradients or weights: those ride the expert-data-parallel group instead, ``group`` / EP
    ranks t·EP apart (Megatron Core's expert ranks: expert-tensor, expert, then data; DeepSpeed-MoE's
    ``expert_data_parallel_group``), at that group's own bandwidth — none where it is one rank (EP = d)."""
    cfg = ctx.cfg
    ep = max(1, cfg.expert_parallel)
    dense = fn(nbytes - routed, group, bw)
    if routed <= 0 or group // ep <= 1:
        return dense
    de = group // ep
    bw_e = group_bandwidth(cfg.gpu, de, cfg.tensor_parallel * ep) * cfg.efficiency.network
    return dense + fn(routed, de, bw_e)


def _unit_collectives(ctx: Context, tm: StageTimes, n: float, x: float = 0.0) -> tuple[float, float, int]:
    """(all-gather seconds, reduce-scatter seconds, units) of FSDP over the stage's ``n`` parameters (``x`` of them
    routed experts, gathered over their own group: :func:`_split_s`): one gather and one reduce-scatter per unit
    (a layer) and group, each with its ring latency (NCCL's model)."""
    cfg = ctx.cfg
    d, units, t = cfg.zero_group, ctx.split[tm.k], cfg.tensor_parallel
    wb = ctx.state_bpp[0]
    alpha = units * ring_latency_s(d, -(-d // ranks_per_node(cfg.gpu, d, t)))
    de = d // max(1, cfg.expert_parallel)
    if x > 0 and de > 1:  # the experts' own gather and reduce-scatter, t·EP apart
        stride = t * cfg.expert_parallel
        alpha += units * ring_latency_s(de, -(-de // ranks_per_node(cfg.gpu, de, stride)))
    ag = _split_s(ctx, allgather_time_s, n * wb, x * wb, d, ctx.bw_zero) + alpha
    rs = (
        _split_s(ctx, reduce_scatter_time_s, n * cfg.reduce_bytes, x * cfg.reduce_bytes, d, ctx.bw_zero)
        + alpha
    )
    return ag, rs, units  # the reduce-scatter in the reduce dtype


def _replica_s(ctx: Context, tm: StageTimes, n: float, per_unit: bool = True) -> float:
    """Hybrid sharding: the all-reduce of this GPU's gradient shard (n/zero_group parameters) across the
    replicas (FSDP2's HSDP all-reduces each reduce-scattered shard across the replicate dimension, every
    micro-step unless ``set_requires_all_reduce(False)`` defers it: taken every micro-step), with one ring
    latency per unit (``per_unit``, FSDP's per-layer groups) or one (a bucketed reduction); 0 without replicas."""
    cfg = ctx.cfg
    r = cfg.replicas
    if r <= 1:
        return 0.0
    units = ctx.split[tm.k] if per_unit else 1
    stride = cfg.tensor_parallel * cfg.zero_group  # replicas sit a whole shard group apart
    alpha = units * ring_latency_s(r, -(-r // ranks_per_node(cfg.gpu, r, stride)), allreduce=True)
    per_grad = (
        cfg.reduce_bytes if per_unit else ctx.state_bpp[1]
    )  # FSDP's shards in its reduce dtype; ZeRO-1/2's
    return allreduce_time_s(n * per_grad / cfg.zero_group, r, ctx.bw_rep) + alpha


def _with_replicas(ctx: Context, reduce: float, replica: float, units: int) -> float:
    """The backward's reductions with hybrid sharding's all-reduce across the replicas: FSDP2 issues each unit's
    all-reduce on a stream of its own (``FSDPCommContext.all_reduce_stream``, torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py: the shard group's reduce-scatters and the replicas' all-reduces use other links), so the two
    queues of per-unit collectives run side by side: the longer one's time and one unit of the other (the first
    reduce-scatter before any all-reduce can start, or the last all-reduce after the last reduce-scatter); FSDP1,
    DeepSpeed and Megatron all-reduce after the reduce-scatter on its stream: the sum (a review, 2026-12-08)."""
    if ctx.cfg.sharding_impl != "fsdp2" or replica <= 0:
        return reduce + replica
    return max(reduce, replica) + min(reduce, replica) / max(1, units)


def _copy_out_s(ctx: Context, n: float) -> float:
    """One gather of ``n`` parameters copied out on the compute stream under FSDP2, else 0."""
    cfg = ctx.cfg
    if cfg.sharding_impl != "fsdp2":
        return 0.0
    rate = cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory
    return fsdp2_copy_out_s(n * ctx.state_bpp[0], rate)


def _copy_in_s(ctx: Context, n: float) -> float:
    """One reduction of ``n`` parameters' gradients copied into FSDP2's reduce-scatter buffer on the compute stream
    (:func:`~microbatch.predict.collectives.fsdp2_copy_in_s`: read in the weights' dtype, written in the reduce
    dtype), else 0."""
    cfg = ctx.cfg
    if cfg.sharding_impl != "fsdp2":
        return 0.0
    rate = cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory
    return fsdp2_copy_in_s(n * ctx.state_bpp[0], n * cfg.reduce_bytes, rate)


def _accumulate_s(ctx: Context, n: float) -> float:
    """One micro-batch's accumulation of ``n`` parameters' gradients under a pipeline's FSDP2, in the dtype
    :func:`~microbatch.predict.state.held_grad_bytes` says (its reduce dtype)."""
    cfg = ctx.cfg
    stored = ctx.state_bpp[1]
    held = held_grad_bytes(3, cfg.pipeline_parallel, cfg.pipeline_grad_reduce, stored, cfg.reduce_bytes)
    rate = cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory
    return fsdp2_accumulate_s(n, held, ctx.state_bpp[0], rate)


def _bf16_fp32_accumulate_s(ctx: Context, n: float) -> float:
    """One micro-batch's accumulation of ``n`` parameters' ``bf16+fp32`` gradients at the streaming rate
    (:func:`~microbatch.predict.state.bf16_fp32_accumulate_bytes`)."""
    cfg = ctx.cfg
    rate = cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory
    return n * bf16_fp32_accumulate_bytes(cfg.grad_dtype, ctx.state_bpp[0]) / rate


def _fsdp_under_pipeline(c: Collectives, tm: StageTimes, each: int = 0) -> float:
    """Exposed seconds per step of ZeRO-2/3 under a pipeline, as FSDP runs in ``torch.distributed.pipelining``
    (:func:`microbatch.predict.state.resident_zero`): the weights gathered once, unit by unit behind the
    first micro-batch's forward (its first unit exposed; FSDP2 copies them out once), and the accumulated
    gradients reduce-scattered once after the last backward with nothing left to hide behind: whole; ``c.sigma``
    the slowdown of the computation beside the gather (:func:`overlap_sigma`). With ``each`` = m (gradients
    reduced after every micro-batch, a shard kept) the m reduce-scatters each hide behind their micro-batch's
    backward, as ZeRO-2 without a pipeline, and the last micro-batch's last unit (1/units of one) is exposed,
    as FSDP's last reduce-scatter is (:func:`~microbatch.predict.collectives.fsdp_edges_s`)."""
    ag, rs, units = c.gather, c.reduce, c.units
    gather = overlap_exposed_s(ag, tm.fk, c.sigma) + ag / max(1, units) + c.copy_out
    if each:  # m reduce-scatters behind their backwards; the last micro-batch's last unit has none after it
        rs += c.replica
        return (
            gather + each * (overlap_exposed_s(rs, tm.ik + tm.wk, c.sigma) + c.copy_in) + rs / max(1, units)
        )
    return gather + rs + c.replica + c.copy_in
