"""The Lightning export: a plan as ``Trainer`` keyword arguments and the ``DataLoader``'s batch size
(:mod:`microbatch.show.export` writes them). ZeRO maps to Lightning's registered strategies (DDP, DeepSpeed stages 1
and 2, FSDP); what its Trainer cannot run as planned is refused: pipeline stages, tensor parallelism (no Trainer
keyword), FP8 under FSDP or DeepSpeed. Split from :mod:`microbatch.show.export`."""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.show.export_common import Json, clip_norm, no_pipeline, precision_of

__all__ = ["GPUS_PER_NODE", "lightning_config"]

GPUS_PER_NODE = 8
"""Default accelerators per node for Lightning's ``devices``/``num_nodes`` (an HGX/DGX node holds 8)."""

_LIGHTNING_PRECISION = {"bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "fp32": "32-true",
                        "fp8": "transformer-engine"}  # fmt: skip
"""The plan's precision → Lightning's ``Trainer(precision=...)``; FP8 is Transformer Engine's plugin (delayed scaling)."""

_LIGHTNING_STRATEGY = {0: "ddp", 1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "fsdp"}
"""ZeRO stage → Lightning's registered strategy name (with d > 1)."""


def lightning_config(c: Json) -> tuple[Json, list[str]]:
    prec = precision_of(c)
    d, z = c["data_parallel"], c.get("zero", 0)
    _check_lightning(c)
    trainer: Json = {"accumulate_grad_batches": c["grad_accum"], "precision": _LIGHTNING_PRECISION[prec]}
    if clip_norm(c):  # Lightning clips only when gradient_clip_val is given
        trainer["gradient_clip_val"], trainer["gradient_clip_algorithm"] = clip_norm(c), "norm"
    node = int(c.get("gpus_per_node") or GPUS_PER_NODE)
    per_node = min(d, node)  # d processes on one node of more: devices = d
    if d % per_node:
        raise ConfigError(
            f"{d} processes (d = {d}) do not fill nodes of {per_node} accelerators; give gpus_per_node dividing {d}",
            params=("gpus_per_node",),
        )
    trainer["devices"], trainer["num_nodes"] = per_node, d // per_node
    notes = [f"DataLoader(batch_size={c['micro_batch']}); devices × num_nodes = {per_node} × {d // per_node} "
             f"= {d} processes ({per_node} " + (f"of the node's {node} accelerators" if per_node < node else
             "accelerators per node") + ("" if c.get("gpus_per_node") else ", assumed: gpus_per_node to change")
             + ")"]  # fmt: skip
    if d > 1:
        trainer["strategy"] = _LIGHTNING_STRATEGY[z]
        if (
            z == 3 and trainer.pop("gradient_clip_val", None) is not None
        ):  # FSDPPrecision refuses norm clipping
            del trainer["gradient_clip_algorithm"]
            notes.append(
                f"the plan clips gradients by their norm ({clip_norm(c)}), which Lightning's FSDP refuses as "
                "gradient_clip_algorithm='norm': override configure_gradient_clipping in the LightningModule to call "
                f"self.trainer.model.clip_grad_norm_({clip_norm(c)}) (not written as a Trainer argument)"
            )
    if c.get("recompute", "none") != "none":
        notes.append(f"recompute {c['recompute']}: enable activation checkpointing in the LightningModule")
    return {"trainer": trainer, "dataloader": {"batch_size": c["micro_batch"]}}, notes + _lightning_notes(
        c, trainer
    )


def _lightning_notes(c: Json, trainer: Json) -> list[str]:
    """What Lightning's strategies and FP8 plugin run otherwise than the plan priced, and the code that matches it
    (lightning 2.6: ``strategies/fsdp.py``, ``connectors/accelerator_connector.py``, ``plugins/precision``)."""
    notes = []
    if trainer.get("strategy") == "fsdp":  # registered with no auto_wrap_policy: one unit, gathered whole
        notes.append(
            "strategy 'fsdp' shards the whole model as one unit (no auto_wrap_policy), gathering every weight at "
            "once; pass strategy=FSDPStrategy(auto_wrap_policy={YourBlock}) with your transformer block class (or "
            "wrap in configure_model) so one block is gathered at a time, as planned"
        )
    if precision_of(c) == "fp8":  # Lightning's export takes only fp32 master weights
        notes.append(
            "precision 'transformer-engine' casts the weights to bf16 (TransformerEnginePrecision(weights_dtype="
            "torch.bfloat16)) before the optimizer is built: no fp32 master copy and the optimizer's buffers in bf16, "
            "where the plan priced fp32 ones (with AdamW 8 B a parameter less than planned; the updates in bf16)"
        )
    if (
        c.get("grad_dtype") == "fp32"
        and precision_of(c) == "bf16-mixed"
        and trainer.get("strategy") == "deepspeed_stage_1"
    ):
        notes.append(  # DeepSpeed runs bf16 with fp32 accumulation at ZeRO 1 as its bf16 optimizer (20 B/param)
            "the plan priced fp32 gradients alone (18 B/param); DeepSpeed at stage 1 accumulating a bf16 model in fp32 "
            "(DeepSpeedStrategy(config={'data_types': {'grad_accum_dtype': 'fp32'}, ...})) runs its bf16 optimizer, "
            "which keeps the bf16 gradients beside them (20 B/param): plan with grad_dtype bf16+fp32 for that, or "
            "keep DeepSpeed's default bf16 accumulation (grad_dtype half)"
        )
    elif c.get("grad_dtype") in ("fp32", "bf16+fp32") and trainer.get("strategy", "ddp") != "ddp":
        notes.append(
            f"the plan priced fp32 gradients (grad_dtype {c['grad_dtype']}); Lightning's DeepSpeed and FSDP strategies keep and "
            "reduce them in the model's dtype unless told: DeepSpeedStrategy(config={'data_types': "
            "{'grad_accum_dtype': 'fp32'}, ...}) or FSDPStrategy(mixed_precision=MixedPrecision(reduce_dtype="
            "torch.float32))"
        )
    return notes


def _check_lightning(c: Json) -> None:
    """ConfigError for tensor parallelism (no Trainer keyword: its DDP over d·t ranks would make the global
    batch t× the plan's) and for FP8 under the FSDP or DeepSpeed strategy (their precision plugins refuse
    ``transformer-engine``)."""
    b, g, d, B = c["micro_batch"], c["grad_accum"], c["data_parallel"], c["global_batch"]
    z, t, p = c.get("zero", 0), c.get("tensor_parallel", 1), c.get("pipeline_parallel", 1)
    if p > 1:
        raise no_pipeline("Lightning's Trainer", p, "torchtitan or DeepSpeed")
    if t > 1:
        raise ConfigError(
            f"Lightning's Trainer has no tensor-parallel keyword: devices for all d × t = {d * t} ranks would run "
            f"DDP over them, and the global batch would be {b} × {g} × {d * t} = {B * t}, not {B}; export this "
            "plan to torchtitan, or write lightning.pytorch.strategies.ModelParallelStrategy("
            f"data_parallel_size={d}, tensor_parallel_size={t}) by hand with the model's configure_model() "
            f"(accumulate_grad_batches={g}, DataLoader batch_size={b}), or plan again with tensor_parallel 1",
            params=("tensor_parallel",),
        )
    if precision_of(c) == "fp8" and d > 1 and z >= 1:
        raise ConfigError(
            f"Lightning's FP8 (precision 'transformer-engine') runs under DDP or on one device: its "
            f"{_LIGHTNING_STRATEGY[z]} strategy, for ZeRO {z}, refuses it; plan again with zero 0, or export this "
            "plan to torchtitan (float8 linears under FSDP)",
            params=("zero",),
        )
