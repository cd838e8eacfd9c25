"""A plan as DeepSpeed's JSON (:func:`deepspeed_config`): ``train_batch_size`` = B, ``train_micro_batch_size_per_gpu``
= b_m, ``gradient_accumulation_steps`` = g (the pipeline engine's m), ``zero_optimization.stage``, the precision and
``data_types.grad_accum_dtype``; what DeepSpeed sets in model code or the launcher goes in notes. Split from
:mod:`microbatch.show.export`, which dispatches to it."""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.predict.stages import split_layers
from microbatch.show.export_common import Json, clip_norm, deepspeed_moe_note, precision_of, schedule_spec

__all__ = ["check_deepspeed_grad_dtype", "deepspeed_config", "deepspeed_native"]


def deepspeed_config(c: Json) -> tuple[Json, list[str]]:
    p, t, d = c.get("pipeline_parallel", 1), c.get("tensor_parallel", 1), c["data_parallel"]
    if p > 1 and c.get("zero", 0) >= 2:
        raise ConfigError(
            f"DeepSpeed's pipeline engine refuses ZeRO stage {c['zero']} (it supports stage 0 or 1 with "
            f"pipeline parallelism, here p = {p}); plan again with zero 1 (or 0), or export to torchtitan",
            params=("zero",),
        )
    _check_pipeline_bf16(c, p, d)
    cfg: Json = {
        "train_batch_size": c["global_batch"],
        "train_micro_batch_size_per_gpu": c["micro_batch"],
        "gradient_accumulation_steps": c["grad_accum"],
        # bf16+fp32 is DeepSpeed's bf16 optimizer, which its engine picks at ZeRO 1 (one rank: the same bytes as 0)
        "zero_optimization": {"stage": 1 if c.get("grad_dtype") == "bf16+fp32" else c.get("zero", 0)},
    }
    if (clip := clip_norm(c)) is not None:  # DeepSpeed's default was 0 (off) before its 2026 releases
        cfg["gradient_clipping"] = clip
    prec = precision_of(c)
    if prec == "bf16-mixed":
        cfg["bf16"] = {"enabled": True}
    elif prec == "fp16-mixed":
        cfg["fp16"] = {"enabled": True}
    if c.get("grad_dtype") in ("fp32", "bf16+fp32"):  # gradients accumulated in fp32 (18 or 20 B/param)
        check_deepspeed_grad_dtype(c, prec)
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    notes = [
        f"DeepSpeed checks train_batch_size = micro × accumulation × data-parallel world size "
        f"({c['micro_batch']} × {c['grad_accum']} × {d}); launch with d = {d} "
        f"data-parallel ranks (world size {d * p * t})"
    ]
    if p == 1 and prec == "bf16-mixed" and cfg["zero_optimization"]["stage"] == 0:
        notes.append(
            "bf16 without ZeRO needs DeepSpeed 0.17.6 or later (#7515, its non-ZeRO bf16 mode); older engines raise "
            '"Bfloat16 wrapper must use a gradient accumulation type of fp32, enable ZeRO to use Bfloat16 gradient '
            'accumulation"'
        )
    if t > 1 and p == 1:
        notes.append(
            f"tensor parallelism t = {t} without a pipeline: pass mpu= (your model-parallel unit, whose "
            f"get_data_parallel_world_size() is {d}) to deepspeed.initialize; without it DeepSpeed takes all "
            f"{d * t} ranks as data-parallel and refuses train_batch_size {c['global_batch']} != "
            f"{c['micro_batch']} × {c['grad_accum']} × {d * t}"
        )
    if p > 1:
        notes += _pipeline_notes(c, p, t, d)
    if c.get("recompute", "none") != "none":
        every = c.get("recompute_every", 1)
        notes.append(
            f"recompute {c['recompute']}{f' of every {every}th layer' if every > 1 else ''}: wrap the layers with "
            "deepspeed.checkpointing.checkpoint (activation checkpointing is set in model code)"
        )
    if (ep := c.get("expert_parallel", 1)) > 1:
        if c.get("zero", 0) == 3:
            raise ConfigError(
                f"DeepSpeed's MoE layers (deepspeed.moe.layer.MoE, for expert_parallel {ep}) refuse ZeRO stage 3 "
                '("Native DeepSpeed MoE is not supported with ZeRO Stage 3"); plan again with zero 1 or 2, or export '
                "this plan to torchtitan",
                params=("zero",),
            )
        notes.append(deepspeed_moe_note(ep, c.get("capacity_factor"), t))
    for key, what in (("async_tp", "tensor-parallel collectives overlapped with their GEMMs (async TP)"),
                      ("ep_overlap", "expert all-to-alls hidden behind other micro-batches' work")):  # fmt: skip
        if c.get(key):
            notes.append(f"the plan priced {what}; DeepSpeed's config has no such setting: they run exposed")
    return cfg, notes


def _pipeline_notes(c: Json, p: int, t: int, d: int) -> list[str]:
    """How to build the pipeline engine for the plan (without a topology ``PipelineModule`` counts the t ranks as
    data-parallel, dp = world / p), and the plan's split where DeepSpeed's partition would not give it."""
    notes: list[str] = []
    # DeepSpeed's default partition_method='parameters' balances parameters, not the plan's blocks per stage
    how = "partition_method='type:<YourBlock>'"
    build = (f"PipelineModule(layers, topology=PipeModelDataParallelTopology(num_pp={p}, num_mp={t}, num_dp={d}), "
             f"{how})" if t > 1 else f"PipelineModule(num_stages={p}, {how})")  # fmt: skip
    notes.append(
        f"pipeline engine: gradient_accumulation_steps = m = {c['grad_accum']} micro-batches per flush; "
        f"build {build}; DeepSpeed's engine runs its own 1F1B-like schedule"
        + (f", not {c.get('schedule')}" if not deepspeed_native(c.get("schedule")) else "")
    )
    layers = c.get("layers")
    if not c.get("layers_per_stage") and isinstance(layers, int) and layers % p and layers >= p:
        ours = list(split_layers(layers, p))
        notes.append(
            f"{layers} layers do not split evenly over {p} stages: DeepSpeed's partition (type: or uniform) "
            f"gives the extra layers to the first stages ({ours[::-1]}), where the most micro-batches are in "
            f"flight; the plan timed {ours}, the extra on the last stages: override "
            "PipelineModule._partition_layers to set that split"
        )
    if c.get("layers_per_stage"):
        notes.append(
            f"the plan's uneven split {c['layers_per_stage']} has no partition_method (DeepSpeed splits by "
            "parameters, uniformly or by a layer type): override PipelineModule._partition_layers to set it"
        )
    return notes


def _check_pipeline_bf16(c: Json, p: int, d: int) -> None:
    """ConfigError for a bf16 pipeline plan without ZeRO and with half-precision gradients: DeepSpeed's engine runs a
    bf16 pipeline model through its bf16 optimizer whatever stage 0 says (``_do_optimizer_sanity_check``: model and
    accumulation dtypes both bf16 with pipeline parallelism → ``BFLOAT16``), which shards the fp32 master and moments
    over the d ranks and keeps a model-sized gradient buffer beside the bf16 gradients: not the plan's unsharded
    16 B/param with one all-reduce."""
    if (
        p > 1
        and precision_of(c) == "bf16-mixed"
        and c.get("zero", 0) == 0
        and c.get("grad_dtype", "half") == "half"
    ):
        raise ConfigError(
            f"DeepSpeed's pipeline engine (p = {p}) runs a bf16 model through its bf16 optimizer even at ZeRO stage 0: "
            f"master weights and moments sharded over the {d} data-parallel ranks, a full gradient buffer beside the "
            "bf16 gradients (2 B/param more than the plan priced); plan again with zero 1 (its ZeRO-1 optimizer), or zero "
            "1 and grad_dtype bf16+fp32 (that bf16 optimizer, its buffer in fp32), or export to torchtitan",
            params=("zero", "grad_dtype"),
        )


def check_deepspeed_grad_dtype(c: Json, prec: str) -> None:
    """ConfigError for fp32 gradient accumulation of a bf16 or fp16 model without ZeRO: DeepSpeed's engine
    accumulates in fp32 there only under ZeRO 1–3 (``_do_optimizer_sanity_check``: "unsupported mix")."""
    if c.get("grad_dtype") == "fp32" and prec == "bf16-mixed" and c.get("zero", 0) == 1:
        raise ConfigError(
            "DeepSpeed runs a bf16 model accumulating in fp32 at ZeRO 1 with its bf16 optimizer, "
            "which keeps the bf16 gradients beside the fp32 ones (20 B/param, the plan priced 18) and all-reduces "
            "them in fp32 after the backward; plan again with grad_dtype bf16+fp32 (or zero 2)",
            params=("grad_dtype", "zero"),
        )
    if c.get("grad_dtype") == "fp32" and prec in ("bf16-mixed", "fp16-mixed") and c.get("zero", 0) == 0:
        raise ConfigError(
            f"DeepSpeed accumulates fp32 gradients (grad_dtype fp32) of a {prec} model only under ZeRO 1, 2 or 3: "
            'with ZeRO 0 its engine raises "unsupported mix of model_dtype and grad_accum_dtype"; plan again with '
            "zero 1 (or grad_dtype half)",
            params=("zero", "grad_dtype"),
        )


def deepspeed_native(name: str | None) -> bool:
    """True when there is no schedule (no pipeline) or DeepSpeed's pipeline engine runs it itself."""
    spec = schedule_spec(name)
    return name is None or (spec is not None and spec.deepspeed_native)
