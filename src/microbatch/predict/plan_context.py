"""The planner's per-plan caches: everything a candidate's prediction needs that does not depend on it.

:func:`make_context` builds a :class:`Context` for one :class:`~microbatch.predict.plan_config.PlanConfig`
(layer split, parameters per stage in loop and V placement, bytes per parameter, the constants of the
tokens/s and MFU); :func:`layer_costs` and :func:`activations` fill its caches per b_m. The evaluation
of one candidate is :mod:`microbatch.predict.candidate`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from microbatch.model import ModelShape
from microbatch.precision import LOSS_DTYPES, get_precision, saves_fp8_inputs, weight_cache_bytes
from microbatch.predict.activations import (
    block_activation_bytes,
    embedding_activation_bytes,
    loss_backward_bytes,
    output_activation_bytes,
)
from microbatch.predict.collectives import pipeline_hop_bandwidth
from microbatch.predict.experts import dispatch_bytes, expert_params
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.roofline import (
    LayerTime,
    group_bandwidth,
    layer_forward,
    logits_forward,
    scatter_gather_send_s,
)
from microbatch.predict.stages import rank_moe_blocks, split_layers, stage_params
from microbatch.predict.state import config_eager_update_bytes
from microbatch.schedules.closed_forms import PipelineTime

__all__ = [
    "Activations",
    "Context",
    "InFlight",
    "LayerCosts",
    "StageTimes",
    "activations",
    "layer_costs",
    "make_context",
    "moe_blocks",
    "param_tables",
    "ParamTables",
]


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
    dense: LayerTime | None = None
    """A mixture-of-experts model with dense blocks too: its dense block's forward (``layer`` is its MoE block's)."""


class Activations(NamedTuple):
    """Activation bytes of one micro-batch at one b_m and recompute mode."""

    per_layer: float
    """One transformer layer's stashed activations."""
    working: float
    """The working set of the layer being recomputed (full or per-op recompute: what it re-materialises beyond
    what it keeps, :func:`~microbatch.predict.recompute.recompute_working`), else 0."""
    embedding: float
    """The embedding's (first stage)."""
    output: float
    """The output layer's and the loss's (the stage holding the head)."""
    a2a: float = 0.0
    """Expert parallelism: the all-to-all send and receive buffers of the layer in flight (other bytes)."""
    dense_per_layer: float | None = None
    """A mixture-of-experts model with dense blocks too (:attr:`Context.moe_split`): a dense block's ``per_layer``."""
    loss_backward: float = 0.0
    """An eager loss's backward: two more copies of the logits on the stage holding the head
    (:func:`~microbatch.predict.activations.loss_backward_bytes`); with ``working`` the larger counts there."""


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
    """Parameters per GPU of each probed stage (routed experts counted once per GPU: 1/EP of them)."""
    expert_params: dict[int, float]
    """Of those, the routed-expert parameters per GPU of each probed stage (state sharded over d/EP)."""
    act_kw: dict[str, Any]
    """seq, tensor_parallel, sequence_parallel for the activation formulas."""
    dtype: str
    """Compute dtype of the precision (``bf16``, ``fp16``, ``fp32``)."""
    e: int
    """Bytes per activation element (the compute dtype's)."""
    state_bpp: tuple[int, int, int]
    """Weight, gradient and optimizer-state bytes per parameter."""
    eager_update_bpp: float
    """Bytes an unfused optimizer step moves per parameter (:func:`microbatch.predict.state.eager_update_bytes`)."""
    total_params: int = 0
    """The model's parameters (every expert)."""
    active_params: int = 0
    """The parameters one token uses."""
    max_params: float = 0.0
    """The most parameters on one GPU over the stages."""
    params_v: dict[int, float] = field(default_factory=dict)
    """Parameters per GPU of each probed rank under a V placement (DualPipeV): the embedding and the output
    layer both on rank 0, no second copy of a tied embedding (:func:`microbatch.predict.memory.estimate_memory`)."""
    max_params_v: float = 0.0
    """The most parameters on one GPU under a V placement."""
    tokens_per_step: float = 0.0
    """B_global · s."""
    num_gpus: int = 1
    """d·p·t."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one GPU in the dtype its GEMMs run in (fp8's under ``--precision fp8``, else the compute
    dtype's): the MFU's denominator, so an fp8 plan's MFU is a share of the fp8 peak (its model FLOPs count the
    whole attention matrix, which a causal kernel halves: :attr:`~microbatch.predict.candidate.Candidate.mfu`)."""
    budget: float = 0.0
    """Bytes a candidate may use (:attr:`PlanConfig.memory_budget_bytes`)."""
    split_runs: tuple[tuple[int, int], ...] = ()
    """The stages before the last as runs of equal layer counts: (layers, stages)."""
    moe_split: tuple[int, ...] | None = None
    """A mixture-of-experts model with dense blocks too (DeepSeek-V3's first three, Llama 4's every other): the MoE
    blocks of each rank holding consecutive blocks, each block timed and held at its kind
    (:func:`~microbatch.predict.steptime.pipeline_stage_times`, :func:`moe_blocks` for chunked placements); None for
    a dense model and one whose every block has the experts. Every stage is probed then."""
    moe_layers: int = 0
    """The model's MoE blocks (all L but where :attr:`moe_split` is given)."""
    moe_blocks_cache: dict[tuple[int, bool], tuple[int, ...]] = field(default_factory=dict)
    """Per (v, V placement): :func:`moe_blocks`."""
    param_cache: dict[tuple[int, bool], Any] = field(default_factory=dict)
    """Per (v, V placement): :class:`ParamTables` (:func:`param_tables`)."""
    sim_cache: dict[tuple[str, int, int, int, str], tuple[float, float]] = field(default_factory=dict)
    """Per (schedule, m, v, b_m, recompute): the simulated pipeline's (makespan, bubble fraction), which its stage
    times fix and the ZeRO stage does not (:func:`~microbatch.predict.candidate.with_simulation`)."""
    bw_dp: float = 0.0
    """Achieved bytes/s of the data-parallel group (link bandwidth × network efficiency)."""
    bw_zero: float = 0.0
    """Achieved bytes/s of ZeRO's shard group (the data-parallel group unless hybrid sharding)."""
    bw_rep: float = 0.0
    """Achieved bytes/s across the replicas of a shard under hybrid sharding (0 without)."""
    bw_pp: float = 0.0
    """Achieved bytes/s between pipeline stages."""
    fp8_cache: dict[int, float] = field(default_factory=dict)
    """Bytes of Transformer Engine's cached FP8 weights on each probed stage (0 unless a caching recipe)."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """The candidate fields every candidate of this plan shares (filled by the first evaluation)."""
    layer_cache: dict[int, LayerCosts] = field(default_factory=dict)
    forward_cache: dict[int, tuple[LayerTime, float, LayerTime | None]] = field(default_factory=dict)
    """Per b_m: one layer's forward and the output layer's (:func:`layer_forward`, :func:`logits_forward`), which
    read neither p nor d: shared by the contexts of one layout search (:func:`make_context`'s ``like``)."""
    act_cache: dict[tuple[int, str], Activations] = field(default_factory=dict)
    time_cache: dict[tuple[int, str, int], StageTimes] = field(default_factory=dict)
    vtime_cache: dict[tuple[int, str], StageTimes] = field(default_factory=dict)
    flight_cache: dict[tuple[str, int, int], InFlight] = field(default_factory=dict)
    step_time_cache: dict[str, PipelineTime | None] = field(default_factory=dict)
    """Each schedule's step-time closed form (:attr:`~microbatch.schedules.registry.ScheduleSpec.step_time`)."""
    state_cache: dict[
        tuple[int, bool, int], tuple[tuple[tuple[float, float, float], ...], tuple[float, ...], float]
    ] = field(default_factory=dict)
    collective_cache: dict[tuple[int, float, int, float | None], Any] = field(default_factory=dict)
    """Per (ZeRO stage, parameters, FSDP units, expert parameters): :class:`microbatch.predict.dp_comm.Collectives`."""
    dp_cache: dict[tuple[int, int, str, int, bool, int], tuple[float, float, float]] = field(
        default_factory=dict
    )
    """Per (b_m, m, recompute, v, V placement, ZeRO stage): :func:`microbatch.predict.dp_comm.data_parallel_comm`'s
    seconds, which read the candidate's stage times and nothing of its schedule: the schedules that share a
    placement and v share them."""


_LAYOUT_FIELDS = frozenset({"pipeline_parallel", "data_parallel"})
"""The fields a layout search varies that neither a layer's forward and output layer nor the activations read."""


def make_context(cfg: PlanConfig, like: Context | None = None) -> Context:
    """The caches for planning ``cfg``. ``like``: another plan's context; where its configuration differs from
    ``cfg`` in p and d alone (:func:`~microbatch.predict.plan.search_layouts`' neighbours), the per-b_m forward
    and activation caches are shared with it, not recomputed (each plan's own p2p, memory and times are not)."""
    p, t = cfg.pipeline_parallel, cfg.tensor_parallel
    split = split_layers(cfg.shape.layers, p, cfg.layers_per_stage)
    shape = cfg.shape
    firsts = [sum(split[:i]) for i in range(p)]
    moe_layers = shape.moe_layer_count(0, shape.layers) if shape.moe is not None else 0
    blended = shape.moe is not None and moe_layers < shape.layers
    if cfg.layers_per_stage is None and not blended:
        # Within a run of like stages (as many layers, as many of them dense) the in-flight count falls with
        # i, so the peak is at the first stage of each run or at the last stage (output layer); a MoE model with
        # dense blocks too has them where the schedule's placement puts them (rank_moe_blocks): every stage
        kind = [(split[i], shape.moe_layer_count(firsts[i], split[i])) for i in range(p)]
        probe = sorted({0, p - 1} | {i for i in range(1, p) if kind[i] != kind[i - 1]})
    else:
        probe = list(range(p))
    experts, params, fp8_cache, params_v = _param_tables(cfg, split, probe)
    prec = get_precision(cfg.precision)
    moe_split = rank_moe_blocks(shape, split) if blended else None
    runs: list[list[int]] = []
    for n in split[:-1]:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    d, net, c = cfg.shard_group, cfg.efficiency.network, cfg.context_parallel
    ctx = Context(
        cfg=cfg,
        split=split,
        probe=tuple(probe),
        params=params,
        expert_params=experts,
        total_params=shape.param_count(),
        active_params=shape.active_param_count(),
        max_params=max(params.values()),
        params_v=params_v,
        max_params_v=max(params_v.values()),
        fp8_cache=fp8_cache,
        act_kw=dict(seq=cfg.seq_len // c, tensor_parallel=t, sequence_parallel=cfg.sequence_parallel),
        dtype=prec.compute_dtype,
        e=prec.weight_bytes,  # activations are kept in the compute dtype
        state_bpp=cfg.state_bytes_per_param(),
        eager_update_bpp=config_eager_update_bytes(cfg),
        tokens_per_step=cfg.global_batch * cfg.seq_len,
        num_gpus=cfg.num_gpus,
        peak_flops=cfg.gpu.flops(prec.gemm_dtype or prec.compute_dtype),
        budget=cfg.memory_budget_bytes,
        split_runs=tuple((n, c) for n, c in runs),
        moe_split=moe_split,
        moe_layers=moe_layers,
        bw_dp=group_bandwidth(cfg.gpu, d, t) * net,
        bw_zero=group_bandwidth(cfg.gpu, cfg.zero_group, t) * net,
        bw_rep=group_bandwidth(cfg.gpu, cfg.replicas, t * cfg.zero_group) * net if cfg.replicas > 1 else 0.0,
        # each stage hands off to the next: point-to-point, one NIC where the chain leaves a node; stages are t·c·d
        # ranks apart (Megatron's order: tensor, context, data, then pipeline)
        bw_pp=pipeline_hop_bandwidth(cfg.gpu, p, t * cfg.context_parallel * d) * net,
    )
    if like is not None and _same_but_layout(like.cfg, cfg):
        ctx.forward_cache, ctx.act_cache = like.forward_cache, like.act_cache
    param_tables(ctx, 1, False)  # the consecutive blocks' tables, read directly by the planner's hot loop
    return ctx


def _same_but_layout(a: PlanConfig, b: PlanConfig) -> bool:
    """``a`` and ``b`` equal in every field but p and d (:data:`_LAYOUT_FIELDS`), neither with a layer split."""
    if a.layers_per_stage is not None or b.layers_per_stage is not None:
        return False
    return all(getattr(a, f) == getattr(b, f) for f in a.__dataclass_fields__ if f not in _LAYOUT_FIELDS)


def layer_costs(ctx: Context, b: int) -> LayerCosts:
    """Per-micro-batch costs at b_m = b: layer forward, logits, p2p send, GEMM efficiency."""
    hit = ctx.layer_cache.get(b)
    if hit is None:
        cfg = ctx.cfg
        lt, logit_s, dense = ctx.forward_cache.get(b) or _forward(ctx, b)
        t, p = cfg.tensor_parallel, cfg.pipeline_parallel
        p2p = 0.0
        if p > 1:
            # Megatron's scatter/gather: 1/t per tensor rank, then an NVLink all-gather unless SP (collectives)
            nbytes = ctx.e * b * cfg.seq_len // cfg.context_parallel * cfg.shape.hidden
            bw_tp = group_bandwidth(cfg.gpu, t, 1) * cfg.efficiency.network
            p2p = scatter_gather_send_s(nbytes, t, ctx.bw_pp, bw_tp, cfg.sequence_parallel)
        # the linear layers' FLOPs over their own time: the attention core is counted whole (s x s) in the model's
        # FLOPs but run causal, and a share of peak over both passed 100% at long sequences (107% at s 65,536)
        flops_rate = lt.gemm_flops / lt.gemm_s / ctx.peak_flops if lt.gemm_s else 0.0  # FP8's peak under FP8
        hit = LayerCosts(layer=lt, logits_s=logit_s, p2p_s=p2p, gemm_efficiency=flops_rate, dense=dense)
        ctx.layer_cache[b] = hit
    return hit


def _forward(ctx: Context, b: int) -> tuple[LayerTime, float, LayerTime | None]:
    """One layer's forward (and a dense block's, where :attr:`Context.moe_split`) and the output layer's at b_m =
    ``b``, into ``ctx.forward_cache``."""
    cfg = ctx.cfg

    def block(shape: ModelShape) -> LayerTime:
        return layer_forward(
            shape, b, cfg.gpu, seq=cfg.seq, tensor_parallel=cfg.tensor_parallel,
            sequence_parallel=cfg.sequence_parallel, flash_attention=cfg.flash_attention,
            dtype=ctx.dtype, efficiency=cfg.efficiency, moe_layout=(cfg.expert_parallel, cfg.expert_load),
            context_parallel=cfg.context_parallel,
            fp8_recipe=cfg.fp8_recipe if get_precision(cfg.precision).gemm_dtype == "fp8" else None,
            async_tp=cfg.async_tp, parallel_block=cfg.block_parallel, cp_comm=cfg.cp_comm,
        )  # fmt: skip

    lt = block(cfg.shape)
    dense = block(cfg.shape.dense_block()) if ctx.moe_split is not None else None
    logit_s, _ = logits_forward(
        cfg.shape, b, cfg.gpu, seq=cfg.seq_len // cfg.context_parallel, tensor_parallel=cfg.tensor_parallel,
        dtype=ctx.dtype, efficiency=cfg.efficiency, logits_bytes=LOSS_DTYPES[cfg.loss_dtype],
    )  # fmt: skip
    ctx.forward_cache[b] = (lt, logit_s, dense)
    return lt, logit_s, dense


def activations(ctx: Context, b: int, rc: str) -> Activations:
    """Activation bytes at b_m = b under recompute ``rc``: per layer, the recompute working set, the
    embedding's and the output layer's (cached per (b, rc))."""
    key = (b, rc)
    hit = ctx.act_cache.get(key)
    if hit is None:
        cfg = ctx.cfg
        kw = dict(
            recompute=rc, recompute_every=cfg.recompute_every, flash_attention=cfg.flash_attention, dtype_bytes=ctx.e,
            expert_load=cfg.expert_load, fp8_inputs=saves_fp8_inputs(cfg.precision, cfg.fp8_recipe),
            eager_layers=cfg.layer_kernels == "eager", **ctx.act_kw,
        )  # fmt: skip
        per_layer, working = block_activation_bytes(cfg.shape, b, **kw)  # the largest block's working set
        dense = (
            block_activation_bytes(cfg.shape.dense_block(), b, **kw)[0] if ctx.moe_split is not None else None
        )
        emb = embedding_activation_bytes(cfg.shape, b, **ctx.act_kw)
        lb = LOSS_DTYPES[cfg.loss_dtype]
        out = output_activation_bytes(
            cfg.shape,
            b,
            dtype_bytes=ctx.e,
            logits_bytes=lb,
            eager_layers=cfg.layer_kernels == "eager",
            **ctx.act_kw,
        )
        loss_tr = loss_backward_bytes(
            cfg.shape, b, seq=ctx.act_kw["seq"], tensor_parallel=cfg.tensor_parallel, logits_bytes=lb,
            loss_kernel=cfg.loss_kernel,
        )  # fmt: skip
        a2a = 0.0
        if cfg.expert_parallel > 1:
            s_local = cfg.seq_len // cfg.context_parallel
            a2a = 2 * dispatch_bytes(cfg.shape, b, s_local, dtype_bytes=ctx.e, load=cfg.expert_load)
        hit = Activations(
            per_layer=per_layer, working=working, embedding=emb, output=out, a2a=a2a, dense_per_layer=dense,
            loss_backward=loss_tr,
        )  # fmt: skip
        ctx.act_cache[key] = hit
    return hit


class InFlight(NamedTuple):
    """What a schedule's (m, v) fixes for the memory of the probed stages."""

    v_placement: bool
    """The schedule places its chunks in a V (DualPipeV): the output layer on rank 0, :attr:`Context.params_v`."""
    rows: tuple[tuple[int, float, int, float], ...]
    """Per probed stage: (layers, layer-micro-batches per stage layer in flight, micro-batches of the embedding it
    holds, whole micro-batches' worth of the output layer it holds: 0 where it holds none; under a split backward
    the waiting ones at their share, :func:`~microbatch.predict.activations.output_micro_batches`)."""


class StageTimes(NamedTuple):
    """Seconds per micro-batch by stage (F, I, W lists) and the bottleneck stage k's."""

    f: list[float]
    """Forward per stage (per virtual stage for a V placement)."""
    i: list[float]
    """Input gradients per stage (idem)."""
    w: list[float]
    """Weight gradients per stage (idem)."""
    k: int
    """The bottleneck stage (rank): the largest F + I + W."""
    Tk: float
    """Its F + I + W."""
    sumT: float
    """Σ F + I + W over the stages (ranks)."""
    fk: float
    """Its F (both chunks of a V rank)."""
    ik: float
    """Its I."""
    wk: float
    """Its W."""


def moe_blocks(ctx: Context, v: int, v_placement: bool) -> tuple[int, ...]:
    """The MoE blocks of each rank with ``v`` chunks a rank in the loop or (``v_placement``) the V placement
    (:func:`~microbatch.predict.stages.rank_moe_blocks`; cached); :attr:`Context.moe_split` must be set."""
    key = (v, v_placement)
    hit = ctx.moe_blocks_cache.get(key)
    if hit is None:
        hit = ctx.moe_blocks_cache[key] = rank_moe_blocks(
            ctx.cfg.shape, ctx.split, v, "v" if v_placement else "loop"
        )
    return hit


def _param_tables(
    cfg: PlanConfig,
    split: tuple[int, ...],
    probe: list[int] | tuple[int, ...],
    ks: tuple[int, ...] | None = None,
) -> tuple[dict[int, float], dict[int, float], dict[int, float], dict[int, float]]:
    """(routed-expert parameters per GPU, parameters per GPU, TE's cached FP8 weight bytes, parameters per GPU under
    a V placement) of each probed stage: its blocks consecutive, or ``ks[i]`` of its blocks MoE blocks wherever the
    placement puts them (:func:`moe_blocks`). Only the probed stages: every stage of a run of like stages holds as
    many as the run's first (the embedding is on stage 0, the output layer on p − 1, both probed)."""
    shape, t, ep, p = cfg.shape, cfg.tensor_parallel, cfg.expert_parallel, cfg.pipeline_parallel
    firsts = [sum(split[:i]) for i in range(p)]

    def k(i: int) -> int | None:
        return None if ks is None else ks[i]

    def blocks(i: int) -> int:
        return (
            shape.layers_params(firsts[i], split[i]) if ks is None else shape.blocks_params(split[i], ks[i])
        )

    experts = {i: expert_params(shape, firsts[i], split[i], k(i)) / t for i in probe}  # 1/EP of them per GPU
    params = {
        i: stage_params(shape, i, p, split[i], t, firsts[i], k(i)) - experts[i] * (1 - 1 / ep) for i in probe
    }
    cache = weight_cache_bytes(cfg.precision, cfg.fp8_recipe)  # TE's cached FP8 weights, per layer parameter
    fp8_cache = {i: cache * (blocks(i) / t - experts[i] * (1 - 1 / ep)) for i in probe}
    emb, head = shape.embedding_params(), shape.output_params()
    params_v = {  # as estimate_memory writes it for a V placement (the output layer on rank 0)
        i: (blocks(i) + emb * (i == 0) + (head if i == 0 else 0)) / t - experts[i] * (1 - 1 / ep)
        for i in probe
    }
    return {i: n / ep for i, n in experts.items()}, params, fp8_cache, params_v


class ParamTables(NamedTuple):
    """A placement's parameters per GPU of each probed stage (:func:`param_tables`)."""

    expert_params: dict[int, float]
    params: dict[int, float]
    fp8_cache: dict[int, float]
    params_v: dict[int, float]
    max_params: float
    max_params_v: float
    max_experts: float
    """The most routed-expert parameters on one GPU over the probed stages."""


def param_tables(ctx: Context, v: int, v_placement: bool) -> ParamTables:
    """The parameters per GPU of each probed stage with ``v`` chunks a rank in the loop or (``v_placement``) the V
    placement: the context's own (consecutive blocks) but for a MoE model with dense blocks under a chunked placement,
    whose ranks hold the MoE blocks :func:`moe_blocks` counts (cached)."""
    key = (v, v_placement) if ctx.moe_split is not None and (v > 1 or v_placement) else (1, False)
    hit = ctx.param_cache.get(key)
    if hit is None:
        if key == (1, False):
            tables = (ctx.expert_params, ctx.params, ctx.fp8_cache, ctx.params_v)
        else:
            tables = _param_tables(ctx.cfg, ctx.split, ctx.probe, moe_blocks(ctx, v, v_placement))
        most = max(tables[0].values(), default=0.0)
        hit = ctx.param_cache[key] = ParamTables(
            *tables, max(tables[1].values()), max(tables[3].values()), most
        )
    return hit
