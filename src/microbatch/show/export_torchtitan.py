"""The torchtitan export: a plan as torchtitan's TOML tables (:mod:`microbatch.show.export` writes them).

``training.local_batch_size`` (b_m, or b_m·m with pipelining, which torchtitan splits into micro-batches of
``parallelism.pipeline_parallel_microbatch_size``), ``training.global_batch_size`` = B,
``parallelism.pipeline_parallel_schedule`` (the torch class's name), the plan's stages, FSDP for ZeRO (torchtitan
has no ZeRO-1), expert and context parallelism (with its K/V rotate method), FP8 linears, per-op and every-K-th
recompute and async TP. Split from :mod:`microbatch.show.export`; the helpers both use are in
:mod:`microbatch.show.export_common`.
"""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.predict.state import zero_groups
from microbatch.schedules.registry import DEFAULT_SCHEDULE, torch_spec
from microbatch.show.export_common import Json, precision_of, schedule_spec

__all__ = ["torchtitan_config"]


def _torchtitan_schedule(name: str) -> str:
    """torchtitan's ``pipeline_parallel_schedule``: the name of the torch class that runs ``name``
    without its ``Schedule`` prefix (``Interleaved1F1B``); 1F1B for a schedule torch cannot run."""
    try:
        torch_name = torch_spec(name).torch_name
    except ConfigError:
        return "1F1B"
    return (torch_name or "Schedule1F1B").removeprefix("Schedule")


def torchtitan_config(c: Json) -> tuple[Json, list[str]]:
    p, t, d, z = (
        c.get("pipeline_parallel", 1),
        c.get("tensor_parallel", 1),
        c["data_parallel"],
        c.get("zero", 0),
    )
    b, g, B = c["micro_batch"], c["grad_accum"], c["global_batch"]
    training: Json = {"global_batch_size": B}
    shard = zero_groups(d, 1, c.get("shard_degree"))[0]  # refuses a degree that does not divide d
    parallelism: Json = {
        "data_parallel_replicate_degree": d if z == 0 else d // shard,
        "data_parallel_shard_degree": 1 if z == 0 else shard,  # hybrid sharding (HSDP) when shard < d
        "tensor_parallel_degree": t,
        "pipeline_parallel_degree": p,
    }
    notes = []
    if p > 1:
        # one flush per step: the local batch is the m micro-batches of one flush
        training["local_batch_size"] = b * g
        parallelism["pipeline_parallel_microbatch_size"] = b
        name = c.get("schedule", DEFAULT_SCHEDULE)
        parallelism["pipeline_parallel_schedule"] = _torchtitan_schedule(name)
        notes += _torchtitan_stages(c, parallelism, p)
        spec = schedule_spec(c.get("schedule"))
        if spec is not None and spec.run_as is not None:
            notes.append(
                f"{name} is torch's {torch_spec(name).torch_name} with one stage per rank "
                f"({_torchtitan_schedule(name)})"
            )
    else:
        training["local_batch_size"] = b  # torchtitan accumulates global / (local × dp) micro-batches
    if "seq" in c:
        training["seq_len"] = c["seq"]
    if z in (1, 2):
        parallelism["fsdp_reshard_after_forward"] = "never"
        notes.append(
            f"ZeRO {z} maps to FSDP without resharding after forward (ZeRO-2-like); torchtitan has no ZeRO-1"
        )
    if z >= 1 and p > 1:  # torch's pipelining turns off FSDP's gradient sync until the last micro-batch
        notes.append(
            "under pipeline stages FSDP keeps the stage's weights and gradients whole until the last backward "
            "(ZeRO 1's memory) and reduce-scatters them once after it"
            + (" (the plan timed ZeRO 1 as a reduction overlapped with the last backward)" if z == 1 else "")
        )
    if t > 1 and not c.get("sequence_parallel", False):
        notes.append(
            "torchtitan's tensor parallelism always shards norms and dropout along the sequence (SP)"
        )
    mode = c.get("recompute", "none")
    cfg = {"training": training, "parallelism": parallelism, "activation_checkpoint": {"mode": mode}}
    return cfg, notes + _torchtitan_new(c, cfg)


def _torchtitan_stages(c: Json, parallelism: Json, p: int) -> list[str]:
    """torchtitan's layers per (virtual) stage for the plan's even split: L/(p·v), with its first and last
    stages not shortened (its default takes a layer off each for the embedding and the output layer, which
    would not be the split the plan timed, and with v > 1 would set another number of stages per rank)."""
    v, layers = c.get("virtual", 1) or 1, c.get("layers")
    if not isinstance(layers, int) or layers % (p * v):
        return [
            f"set parallelism.pipeline_parallel_layers_per_stage so each of the {p} ranks holds {v} stage(s) "
            "(the plan's split was not read from the input)"
        ]
    parallelism["pipeline_parallel_layers_per_stage"] = layers // (p * v)
    parallelism["pipeline_parallel_first_stage_less_layers"] = 0
    parallelism["pipeline_parallel_last_stage_less_layers"] = 0
    return []


def _torchtitan_new(c: Json, cfg: Json) -> list[str]:
    """The torchtitan keys of expert and context parallelism, FP8, per-op or every-K recompute and async TP."""
    par, notes = cfg["parallelism"], []
    if (ep := c.get("expert_parallel", 1)) > 1:
        par["expert_parallel_degree"] = ep
        notes.append(f"expert parallelism {ep} is carved out of the data-parallel × context-parallel ranks")
    if (cp := c.get("context_parallel", 1)) > 1:
        par["context_parallel_degree"] = cp  # torch's all-to-all rotater is the ring of sends
        par["context_parallel_rotate_method"] = "allgather" if c.get("cp_comm") == "allgather" else "alltoall"
    if c.get("async_tp"):
        par["enable_async_tensor_parallel"] = True
        cfg.setdefault("compile", {})["enable"] = True
        notes.append("async tensor parallelism needs torch.compile (compile.enable = true, written)")
    if precision_of(c) == "fp8":
        cfg.setdefault("model", {})["converters"] = ["quantize.linear.float8"]
        cfg["quantize.linear.float8"] = {"recipe_name": c.get("fp8_recipe", "tensorwise")}
        cfg.setdefault("compile", {})["enable"] = True
        notes.append("float8 linears need torch.compile to fuse the casts (compile.enable = true, written)")
    ac = cfg["activation_checkpoint"]
    if ac["mode"] == "op":
        ac.update(mode="selective", selective_ac_option="op")
    elif ac["mode"] == "full" and c.get("recompute_every", 1) > 1:
        ac.update(mode="selective", selective_ac_option=str(c["recompute_every"]))
    return notes
