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

from typing import Any

from microbatch.errors import (
    check_instance,
)
from microbatch.model import SHAPE_FIX, ModelShape, check_seq
from microbatch.precision import (
    get_precision,
    loss_bytes,
    saves_fp8_inputs,
    weight_cache_bytes,
)
from microbatch.predict.activations import (
    block_activation_bytes,
    deferred_output_share,
    embedding_activation_bytes,
    loss_backward_bytes,
    output_activation_bytes,
    output_micro_batches,
    stage_block_bytes,
)
from microbatch.predict.experts import dispatch_bytes, expert_params, zero3_unit_params
from microbatch.predict.memory_config import MemoryCalibration, MemoryConfig
from microbatch.predict.memory_estimate import MemoryEstimate, StageMemory
from microbatch.predict.stages import rank_moe_blocks, split_layers, stage_params
from microbatch.predict.state import (
    held_grad_bytes,
    model_state_bytes,
    resident_zero,
    zero3_buffer_bytes,
    zero_groups,
)
from microbatch.schedules import registry
from microbatch.schedules.in_flight import end_stages_in_flight, in_flight_layers, in_flight_microbatches

__all__ = [
    "MemoryCalibration", "MemoryConfig", "StageMemory", "MemoryEstimate", "split_layers", "in_flight_layers",
    "stage_params", "estimate_memory",
]  # fmt: skip


# -- configuration and estimate ----------------------------------------------------------------------------
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
    stored = config.state_bytes_per_param()[1]  # FSDP2 under a pipeline accumulates in its reduce dtype
    held = held_grad_bytes(config.zero, p, config.pipeline_grad_reduce, stored, config.zero3_reduce_bytes())
    state["gradients"] *= held / stored
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
        recompute_every=config.recompute_every, eager_layers=config.layer_kernels == "eager",
    )  # fmt: skip
    per_layer, working = block_activation_bytes(shape, config.micro_batch, **kw)
    blended = shape.moe is not None and shape.moe_layer_count(0, shape.layers) < shape.layers
    dense = block_activation_bytes(shape.dense_block(), config.micro_batch, **kw)[0] if blended else None
    return per_layer, working, dense


def _head_bytes(shape: ModelShape, config: MemoryConfig, seq: int, e: int, held: int) -> tuple[float, float]:
    """(the output layer's and loss's kept bytes of the ``held`` micro-batches on the stage holding the head, the
    loss backward's transient), at ``seq`` tokens a GPU and ``e`` bytes an activation; under a split backward the
    ones whose weight gradient waits keep the logits' gradient for the loss's logits (:func:`deferred_output_share`)."""
    t, b, lb = config.tensor_parallel, config.micro_batch, loss_bytes(config.loss_dtype, config.precision)
    kw = dict(seq=seq, tensor_parallel=t, sequence_parallel=config.sequence_parallel, dtype_bytes=e,
              logits_bytes=lb, eager_layers=config.layer_kernels == "eager")  # fmt: skip
    out = output_activation_bytes(shape, b, **kw)  # type: ignore[arg-type]  # the keywords' own types
    split = config.pipeline_parallel > 1 and registry.get_spec(config.schedule).split_backward
    share = deferred_output_share(shape, **kw) if split else 1.0
    kernel = config.loss_kernel
    return out * output_micro_batches(held, split, share), loss_backward_bytes(
        shape, b, seq=seq, tensor_parallel=t, logits_bytes=lb, loss_kernel=kernel
    )


def estimate_memory(
    shape: ModelShape, config: MemoryConfig, calibration: MemoryCalibration | None = None
) -> MemoryEstimate:
    """Predict every pipeline stage's peak bytes for ``shape`` trained as ``config``.

    Peak = model state (after ZeRO) + in-flight activations (layers, plus the embedding's on the
    first stage and the output layer's and loss's on the last) + other. Full and per-op recompute add the
    working set of the layer being recomputed, what it re-materialises beyond what it keeps
    (:func:`~microbatch.predict.recompute.recompute_working`); an eager loss adds its backward's two copies of the
    logits on the last stage (:func:`~microbatch.predict.activations.loss_backward_bytes`; the larger of the two
    transients counts there); ZeRO-3 adds two
    gathered layers (the current and the prefetched one); ZeRO-2/3 under a pipeline hold ZeRO-1's state
    (:func:`~microbatch.predict.state.resident_zero`). Assumes all peaks coincide (they nearly
    do: activations peak at the end of the warm-up, while the state is resident throughout).
    """
    check_instance(
        "shape", shape, ModelShape, f"estimate_memory(shape, config): a ModelShape first; {SHAPE_FIX}"
    )
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
    ends = end_stages_in_flight(
        config.schedule, p, m, v
    )  # micro-batches on the first and the last virtual stage
    for i, n_layers in enumerate(split):
        params, state = _stage_state(shape, config, i, n_layers, last, ks[i])
        held = in_flight_microbatches(config.schedule, i, p, m, v)
        per = per_layer if dense is None else stage_block_bytes(per_layer, dense, n_layers, ks[i]) / n_layers
        terms = {"layers": per * in_flight_layers(config.schedule, i, p, m, v, n_layers)}
        if i == 0:
            emb = embedding_activation_bytes(
                shape, config.micro_batch, seq=seq, tensor_parallel=t, sequence_parallel=sp
            )
            terms["embedding"] = emb * ends[0]
        out, loss_tr = _head_bytes(shape, config, seq, e, ends[1]) if i == last else (0.0, 0.0)
        if i == last:
            terms["output"] = out
        if max(working, loss_tr):  # the two transients come at different moments: the larger counts
            terms["loss_backward" if loss_tr > working else "recompute_working"] = max(working, loss_tr)
        terms = {k: val * cal.activation_scale for k, val in terms.items()}
        other = cal.fixed_bytes
        if resident_zero(config.zero, p, config.pipeline_grad_reduce) >= 3 and d > 1:
            unit = zero3_unit_params(shape, t, ep, d)
            other += zero3_buffer_bytes(unit, w_bytes, config.zero3_reduce_bytes())
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
