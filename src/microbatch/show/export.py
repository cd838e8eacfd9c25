"""A plan as a training framework's configuration: DeepSpeed, Hugging Face, Lightning, torchtitan.

Every format keeps B_global = b_m × g × d: the exporter checks the identity before writing and refuses a plan that
breaks it (seed 002's first pitfall: changing b_m without g silently changes the optimisation).

- **DeepSpeed** JSON: ``train_batch_size`` = B, ``train_micro_batch_size_per_gpu`` = b_m,
  ``gradient_accumulation_steps`` = g — which DeepSpeed's pipeline engine takes as m, the
  micro-batches per flush — ``zero_optimization.stage``, and
  ``data_types.grad_accum_dtype`` = fp32 when the plan accumulates gradients in fp32 (``grad_dtype``).
- **Hugging Face** ``TrainingArguments`` keyword arguments: ``per_device_train_batch_size`` = b_m,
  ``gradient_accumulation_steps`` = g, and ``gradient_checkpointing``, the name transformers 4.x and 5.x
  both read (``activation_checkpointing`` exists only from 5.23, where the old name warns).
- **Lightning**: ``Trainer`` keyword arguments (``accumulate_grad_batches`` = g, ``precision`` in
  Lightning's words: ``16-mixed``, ``32-true``) and the DataLoader's ``batch_size`` = b_m, in two sections.
- **torchtitan** 0.2.x (0.2.0–0.2.2) TOML (:mod:`microbatch.show.export_torchtitan`): ``training.local_batch_size``
  (b_m, or b_m·m with pipelining, which torchtitan splits into micro-batches of
  ``parallelism.pipeline_parallel_microbatch_size``), ``training.global_batch_size`` = B,
  ``parallelism.pipeline_parallel_schedule``.

Input: the output of ``microbatch plan --json`` (a dict, or the ``plans`` of a comparison: then
``gpu`` must say which accelerator's), a :class:`~microbatch.predict.candidate.Candidate`, or a
tune's ``result.json`` (:func:`export_tune`: the knee b_m, g = B / (b_m·d), the precision and
activation checkpointing it was measured with; the tune must have had a global batch).

What each framework refuses is refused here, not written: DeepSpeed's pipeline engine with ZeRO
stage 2 or 3, and fp32 gradient accumulation of a half-precision model without ZeRO; Lightning's Trainer with
tensor parallelism (its DDP would multiply the global batch by t; ``ModelParallelStrategy`` needs the model's own
parallelisation function) and Transformer Engine's FP8 under its FSDP or DeepSpeed strategies.

The layouts of issue 29 (:func:`_check_supported`): torchtitan takes expert parallelism
(``expert_parallel_degree``), context parallelism (``context_parallel_degree``, its rotate method), FP8 linears (the
``quantize.linear.float8`` converter with its ``recipe_name``), per-op and every-K-th-layer recompute
(``selective_ac_option``) and async TP; it refuses a capacity factor (its MoE routes dropless). DeepSpeed
writes MoE as a note (its ``deepspeed.moe.layer.MoE(ep_size=…)`` lives in model code) and refuses context
parallelism (Ulysses is all-to-all, not a ring) and FP8 (no FP8 switch in its config); the Hugging Face
Trainer and Lightning refuse expert and context parallelism; the Trainer refuses FP8 and Lightning writes
Transformer Engine's ``precision="transformer-engine"`` (its delayed scaling: ``te-delayed`` plans only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from microbatch.batch import global_batch_of
from microbatch.errors import ConfigError
from microbatch.fields import MAX_EXACT_WHOLE, short_repr
from microbatch.show.export_common import (
    Json,
    accelerator_key,
    assumed_notes,
    check_names,
    clip_norm,
    no_pipeline,
    precision_of,
)
from microbatch.show.export_deepspeed import deepspeed_config
from microbatch.show.export_lightning import GPUS_PER_NODE, lightning_config
from microbatch.show.export_torchtitan import TORCHTITAN_HEADER, torchtitan_config
from microbatch.show.toml_text import toml_text

__all__ = [
    "FORMATS",
    "GPUS_PER_NODE",
    "Export",
    "export_plan",
    "export_tune",
    "export_result",
    "candidate_from_plan",
    "candidate_from_tune",
]

FORMATS = ("deepspeed", "hf", "lightning", "torchtitan")
"""Output formats."""


_NEEDED = ("micro_batch", "grad_accum", "global_batch", "data_parallel")


@dataclass(frozen=True, kw_only=True)
class Export:
    """One exported configuration."""

    format: str
    """deepspeed, hf, lightning or torchtitan."""
    config: Json
    """The configuration as a dict (for torchtitan, the TOML's tables)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What the format cannot express, or must be set elsewhere (model code, launcher)."""

    def text(self) -> str:
        """The file's text: JSON, or TOML for torchtitan (after a comment naming the releases it is for)."""
        if self.format == "torchtitan":
            return TORCHTITAN_HEADER + "\n" + toml_text(self.config)
        return json.dumps(self.config, indent=2)


def candidate_from_plan(plan: object, gpu: str | None = None) -> Json:
    """The recommended candidate of ``plan`` as a dict with the layout keys filled in.

    ``plan``: a plan dict (``plan --json``), a comparison (``{"plans": [...]}``; ``gpu`` chooses one,
    else the first with a recommendation), a candidate dict, or a :class:`~microbatch.predict.candidate.Candidate`.
    """
    data: Any = plan.to_dict() if hasattr(plan, "to_dict") else plan
    if not isinstance(data, dict):
        raise ConfigError(
            f"a plan must be a JSON object, got {type(data).__name__}; give a plan's JSON output"
        )
    if "plans" in data:
        plans = data["plans"]
        if not isinstance(plans, list) or not plans or not all(isinstance(p, dict) for p in plans):
            raise ConfigError(
                f"the comparison's plans is {short_repr(plans)}, not a list of plans; plan again"
            )
        names = [p.get("gpu", {}).get("name") if isinstance(p.get("gpu"), dict) else None for p in plans]
        want = accelerator_key(gpu)
        if gpu is None:
            raise ConfigError(
                f"the plan compares {len(plans)} accelerators ({', '.join(map(str, names))}): a multi-GPU plan "
                f"needs gpu to pick the one to export, e.g. gpu {names[0]}",
                params=("gpu",),
            )
        chosen = [p for p, name in zip(plans, names, strict=True) if accelerator_key(name) == want]
        if not chosen:
            raise ConfigError(
                f"the comparison has no plan for gpu {gpu!r}; it has {', '.join(map(str, names))}"
            )
        data = chosen[0]
    elif (
        gpu is not None
        and isinstance(data.get("gpu"), dict)
        and accelerator_key(data["gpu"].get("name")) != accelerator_key(gpu)
    ):
        raise ConfigError(
            f"gpu {gpu!r} does not match the plan, which is for {data['gpu'].get('name')!r}; drop gpu or "
            "give the plan made for that accelerator",
            params=("gpu",),
        )
    if "recommended" in data:
        rec = data["recommended"]
        if rec is None:
            raise ConfigError(
                "the plan has no recommendation (nothing fits); follow its advice and plan again before exporting"
            )
        if not isinstance(rec, dict):
            raise ConfigError(
                f"the plan's recommended is {short_repr(rec)}, not a candidate (an object with micro_batch, schedule, "
                "...); give the plan's JSON as plan wrote it"
            )
        cand = dict(rec)
        for key in ("global_batch", "data_parallel", "pipeline_parallel", "tensor_parallel", "sequence_parallel",
                    "precision", "seq", "fp8_recipe", "recompute_every", "async_tp", "capacity_factor",
                    "expert_parallel", "context_parallel", "cp_comm", "shard_degree", "grad_dtype", "reduce_dtype", "zero3_impl",
                    "flash_attention", "pipeline_grad_reduce", "moments_dtype", "master_weights", "grad_clip",
                    "loss_dtype", "loss_kernel", "layer_kernels", "optimizer", "ep_overlap", "elementwise"):  # fmt: skip
            if key in data:
                cand.setdefault(key, data[key])
        shape = data.get("model_shape") if isinstance(data.get("model_shape"), dict) else None
        if cand.get("flash_attention") is None and shape is not None:
            cand["flash_attention"] = shape.get("flash_attention")  # the model's own setting
        if shape is not None:  # torchtitan's receive buffers; an even split: its layers per stage
            cand.setdefault("hidden", shape.get("hidden"))
            cand.setdefault("moe", shape.get("moe") is not None)  # routed experts: torchtitan's grouped FP8
        if shape is not None and data.get("layers_per_stage") is None:
            cand.setdefault("layers", shape.get("layers"))
        elif data.get("layers_per_stage") is not None:
            cand.setdefault("layers_per_stage", data["layers_per_stage"])  # uneven: torchtitan's module lists
    else:
        cand = dict(data)
    missing = [k for k in _NEEDED if k not in cand]
    if missing:
        raise ConfigError(
            f"the plan lacks {', '.join(missing)}; give the JSON the plan command writes (its JSON output), or one "
            "candidate object from its candidates"
        )
    return cand


def _check_identity(c: Json, what: str = "plan") -> None:
    """B_global = b_m × g × d, in whole numbers, in the words of ``what`` was given (a plan, a tune result)."""
    b, g, d, B = c["micro_batch"], c["grad_accum"], c["data_parallel"], c["global_batch"]
    sizes = [("micro_batch", b), ("grad_accum", g), ("data_parallel", d), ("global_batch", B)]
    sizes += [
        (k, c[k])
        for k in ("pipeline_parallel", "tensor_parallel", "context_parallel", "expert_parallel")
        if k in c
    ]
    for name, v in sizes:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_EXACT_WHOLE:
            raise ConfigError(
                f"the {what}'s {name} must be a whole number in 1..2^53, got {short_repr(v)}; give the {what} as "
                "microbatch wrote it"
            )
    if global_batch_of(b, g, d) != B:
        again = "plan again" if what == "plan" else "tune again"
        raise ConfigError(
            f"the {what} breaks B_global = b_m × g × d: {b} × {g} × {d} = {global_batch_of(b, g, d)} != {B}; the exporter never "
            f"changes the global batch silently; {again} or fix grad_accum"
        )


def _hf(c: Json) -> tuple[Json, list[str]]:
    prec = precision_of(c)
    cfg = {
        "per_device_train_batch_size": c["micro_batch"],
        "gradient_accumulation_steps": c["grad_accum"],
        "bf16": prec == "bf16-mixed",
        "fp16": prec == "fp16-mixed",
    }
    if (
        c.get("recompute", "none") != "none"
    ):  # 4.x and 5.x read it; from 5.23 an alias that warns (written when on)
        cfg["gradient_checkpointing"] = True
    if (clip := clip_norm(c)) is not None:  # the Trainer clips at 1.0 unless told
        cfg["max_grad_norm"] = clip
    notes = [f"run on d = {c['data_parallel']} processes (torchrun --nproc_per_node ...); the Trainer multiplies "
             "per_device_train_batch_size by the world size"]  # fmt: skip
    if "gradient_checkpointing" in cfg:
        notes.append("gradient_checkpointing is read by transformers 4.x and 5.x; from 5.23 it is a deprecated alias "
                     "of activation_checkpointing (a FutureWarning)")  # fmt: skip
    if (p := c.get("pipeline_parallel", 1)) > 1:
        raise no_pipeline("the Hugging Face Trainer", p, "DeepSpeed or torchtitan")
    if (
        t := c.get("tensor_parallel", 1)
    ) > 1:  # each of the d processes would hold the whole model, not 1/t of it
        raise ConfigError(
            f"the Hugging Face Trainer's keyword arguments hold no tensor parallelism (transformers 5 takes it as an "
            f"accelerate ParallelismConfig object), and the plan's memory holds only with the model split over "
            f"t = {t}; export this plan to DeepSpeed or torchtitan, or plan again with tensor_parallel 1",
            params=("tensor_parallel",),
        )
    if c.get("recompute") in ("selective", "op"):
        notes.append(f"gradient_checkpointing recomputes every whole layer (full), not {c.get('recompute')}")
    if (every := c.get("recompute_every", 1)) > 1 and c.get("recompute") == "full":
        notes.append(
            f"gradient_checkpointing recomputes every layer, not one layer in {every}: on transformers 5.23+ add "
            f'activation_checkpointing_kwargs={{"every_n_layers": {every}}} (5.22: gradient_checkpointing_kwargs); '
            "not written, as 4.x would pass it on to torch.utils.checkpoint"
        )
    if c.get("zero", 0) > 0:
        notes.append(f"ZeRO {c['zero']}: pass deepspeed=<the DeepSpeed JSON of this plan> or use FSDP")
    if c.get("elementwise") == "compiled":  # the plan priced torch.compile's fused elementwise kernels
        cfg["torch_compile"] = True
    return cfg, notes


def _lacks(c: Json, fmt: str) -> list[str]:
    """What ``fmt`` lacks for this candidate's layout (see the module docstring)."""
    lacks: list[str] = []
    if c.get("capacity_factor") is not None and fmt != "deepspeed":
        lacks.append("MoE capacity factor" + (" (its MoE routes dropless)" if fmt == "torchtitan" else ""))
    if c.get("expert_parallel", 1) > 1 and fmt in ("hf", "lightning"):
        lacks.append("expert parallelism")
    if c.get("context_parallel", 1) > 1 and c.get("cp_comm") == "ulysses":
        lacks.append(
            "Ulysses context parallelism (set Megatron's cp_comm_type a2a or Megatron-DeepSpeed's sequence parallel "
            "size yourself; torchtitan takes cp_comm allgather or ring)"
        )
    elif c.get("context_parallel", 1) > 1 and fmt != "torchtitan":
        lacks.append(
            "all-gather or ring context parallelism"
            + (" (its Ulysses lives in Megatron-DeepSpeed, not in its config)" if fmt == "deepspeed" else "")
        )
    state = [
        f"{v} {what}"
        for v, what in (
            (c.get("moments_dtype", "fp32"), "moments"),
            (c.get("master_weights", "fp32"), "master weights"),
        )
        if v != "fp32"
    ]
    if state:  # none of the four configs sets them: Megatron's precision-aware optimizer and NeMo's do
        lacks.append(f"optimizer state of {' and '.join(state)} (Megatron's precision-aware optimizer and NeMo's "
                     "optim.dtype set them; moments_dtype and master_weights fp32 export)")  # fmt: skip
    if c.get("grad_dtype") == "bf16+fp32" and fmt == "torchtitan":
        lacks.append(
            "DeepSpeed's bf16 optimizer (grad_dtype bf16+fp32: bf16 gradients beside an fp32 buffer)"
        )
    hybrid = c.get("shard_degree") and c["shard_degree"] < c.get("data_parallel", 1)
    if hybrid and c.get("zero", 0) >= 1 and fmt != "torchtitan":
        lacks.append(f"hybrid sharding over groups of {c['shard_degree']} set here")
    recipe = c.get("fp8_recipe", "tensorwise")
    # torchtitan's float8 is torchao's (tensorwise, rowwise); Lightning's FP8 is TE's plugin at its default
    # DelayedScaling (lightning/fabric/plugins/precision/transformer_engine.py: recipe = DelayedScaling() when none is
    # given), which runs neither torchao's dynamic scaling (tensorwise, rowwise) nor TE's current scaling
    theirs = {"torchtitan": ("tensorwise", "rowwise"), "lightning": ("te-delayed",)}.get(fmt, ())
    if precision_of(c) == "fp8" and recipe not in theirs:
        lacks.append(
            f"FP8 {recipe} recipe in its configuration"
            + (
                " (its Transformer Engine plugin runs delayed scaling: fp8_recipe te-delayed)"
                if fmt == "lightning"
                else ""
            )
        )
    each = (
        c.get("pipeline_grad_reduce") == "each"
        and c.get("pipeline_parallel", 1) > 1
        and c.get("zero", 0) >= 2
    )
    # DeepSpeed takes no ZeRO >= 2 with a pipeline at all (its builder refuses)
    if each and fmt != "deepspeed":
        lacks.append(
            "gradient reduce-scatters after each micro-batch under pipelining (torch's stage reduces once)"
        )
    return lacks


def _exports(c: Json, fmt: str) -> bool:
    """Whether ``fmt`` takes this candidate: it lacks nothing of it and its builder refuses nothing."""
    try:
        return not _lacks(c, fmt) and bool(_BUILDERS[fmt](c))
    except ConfigError:
        return False


def _check_supported(c: Json, fmt: str) -> None:
    """ConfigError naming what ``fmt`` lacks for this candidate's layout, and the formats that take it."""
    if lacks := _lacks(c, fmt):  # params: the plan's flags, where a lack names them
        others = [f for f in FORMATS if f != fmt and _exports(c, f)]
        to = f"export this plan to {' or '.join(others)}, or " if others else ""
        raise ConfigError(f"{fmt} has no {' and no '.join(lacks)}; {to}plan again without it",
                          params=("moments_dtype", "master_weights", "fp8_recipe"))  # fmt: skip


_BUILDERS = {
    "deepspeed": deepspeed_config,
    "hf": _hf,
    "lightning": lightning_config,
    "torchtitan": torchtitan_config,
}


def _export(cand: Json, fmt: str, notes: tuple[str, ...] = (), what: str = "plan") -> Export:
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is not known; use one of {', '.join(FORMATS)}")
    _check_identity(cand, what)
    check_names(cand, what)
    _check_supported(cand, fmt)
    cfg, more = _BUILDERS[fmt](cand)
    return Export(format=fmt, config=cfg, notes=tuple(more) + notes + assumed_notes(cand, fmt))


def export_plan(
    plan: object, fmt: str, *, gpu: str | None = None, gpus_per_node: int | None = None
) -> Export:
    """Export ``plan`` (plan JSON dict, comparison, candidate dict or Candidate) as ``fmt``."""
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is not known; use one of {', '.join(FORMATS)}")
    cand = candidate_from_plan(plan, gpu=gpu)
    if gpus_per_node is not None:
        cand["gpus_per_node"] = gpus_per_node
    return _export(cand, fmt)


def candidate_from_tune(result: object) -> Json:
    """The knee of a tune's result (``result.json`` or ``tune --json``) as a candidate dict."""
    data: Any = result.to_dict() if hasattr(result, "to_dict") else result
    if not isinstance(data, dict) or "points" not in data or "micro_batch" not in data:
        raise ConfigError(
            "a tune result must be the JSON object a tune wrote (its result.json, or TuneResult.to_dict())"
        )
    b, g, big_b = data.get("micro_batch"), data.get("grad_accum"), data.get("global_batch")
    if data.get("mode", "train") != "train":  # a KV-cache decoding knee says nothing of a training step
        raise ConfigError(
            f"the tune measured in mode {data.get('mode')!r}: its knee is batched decoding's, not a training step's; "
            "export a tune in mode 'train' (or a plan)"
        )
    if b is None:  # the points a tune kept when none met its limits: no choice to export
        raise ConfigError(
            f"the tune chose no b_m ({data.get('error') or 'no knee in the file'}); nothing to export: tune again "
            "with another limit"
        )
    if big_b is None or g is None:
        raise ConfigError(
            f"the tune chose b_m = {b} without a global batch, so g is unknown and an export would set "
            "B_global silently; tune again with global_batch",
            params=("global_batch",),
        )
    knee = [p for p in data["points"] if p.get("micro_batch") == b and not p.get("oom")]
    ckpt = bool(knee and knee[0].get("checkpointing"))
    cand: Json = {
        "micro_batch": b, "grad_accum": g, "global_batch": big_b,
        "data_parallel": data.get("data_parallel") or 1, "precision": data.get("precision", "fp32"),
        "recompute": "full" if ckpt else "none",
        "loss_kernel": "eager",  # measured with its loop's own loss (tune's probes: PyTorch's eager one)
        "layer_kernels": "eager",  # and its own layers, whatever they keep
    }  # fmt: skip
    if data.get("seq"):
        cand["seq"] = data["seq"]
    return cand


def export_tune(result: object, fmt: str, *, gpus_per_node: int | None = None) -> Export:
    """Export the knee a tune measured as ``fmt`` (B_global = b_m × g × d kept)."""
    cand = candidate_from_tune(result)
    if gpus_per_node is not None:
        cand["gpus_per_node"] = gpus_per_node
    data: Any = result.to_dict() if hasattr(result, "to_dict") else result
    where = data.get("device_name") or data.get("device") or "the tune's machine"
    note = (f"b_m = {cand['micro_batch']} is the knee measured on {where} for {data.get('model')}; on another "
            "accelerator or model, tune there")  # fmt: skip
    cut = f"the tune was interrupted ({data.get('stop_reason') or 'Ctrl-C'}): its knee is that of the points measured"
    cut += " before; tune again to the end before training on it"  # fmt: skip
    return _export(cand, fmt, (note, cut) if data.get("interrupted") else (note,), what="tune result")


def export_result(
    data: object, fmt: str, *, gpu: str | None = None, gpus_per_node: int | None = None
) -> Export:
    """Export a plan or a tune result, told apart by the command that wrote it."""
    from microbatch.records import classify

    if isinstance(data, dict) and classify(data) == "tune":
        if gpu is not None:
            raise ConfigError(
                "gpu picks one plan of a multi-GPU comparison; a tune result has one device: drop it",
                params=("gpu",),
            )
        return export_tune(data, fmt, gpus_per_node=gpus_per_node)
    return export_plan(data, fmt, gpu=gpu, gpus_per_node=gpus_per_node)
