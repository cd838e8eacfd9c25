"""What every config export reads from a plan: its JSON objects, a candidate's precision, a schedule's spec, the
accelerator a comparison's plan is for, and the words (recompute, precision, schedule) the exports write.

Shared by :mod:`microbatch.show.export` (DeepSpeed, Hugging Face, Lightning) and
:mod:`microbatch.show.export_torchtitan`.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.schedules.registry import ScheduleSpec, get_spec

__all__ = [
    "assumed_notes",
    "CLIP_NORM",
    "Json",
    "no_pipeline",
    "accelerator_key",
    "check_names",
    "clip_norm",
    "precision_of",
    "schedule_spec",
]

Json = dict[str, Any]
"""A JSON object: a plan, a candidate, a configuration."""


CLIP_NORM = 1.0
"""The global-norm threshold an export writes when the plan clips: the common one (Megatron's ``--clip-grad``, the
Hugging Face Trainer's ``max_grad_norm`` and torchtitan's ``max_norm`` defaults); the plan prices the clip's passes,
not its threshold."""


def clip_norm(c: Json) -> float | None:
    """The clip threshold to write: :data:`CLIP_NORM` when the plan clips (``grad_clip``), 0 (off) when it does not,
    None when the candidate does not say (a tune result: the user's loop decides)."""
    clip = c.get("grad_clip")
    return None if clip is None else (CLIP_NORM if clip else 0.0)


def precision_of(c: Json) -> str:
    """The candidate's precision (bf16-mixed when it says none)."""
    return str(c.get("precision", "bf16-mixed"))


def schedule_spec(name: str | None) -> ScheduleSpec | None:
    """The registry's entry of schedule ``name``; None for no name or one the registry does not know."""
    try:
        return None if name is None else get_spec(name)
    except ConfigError:
        return None


def accelerator_key(name: object) -> object:
    """The registry's name of accelerator ``name`` (an alias, such as ``h100-80gb``, resolved; case and ``_``
    ignored); ``name`` itself when the registry does not know it."""
    from microbatch.hardware import get_accelerator

    if not isinstance(name, str):
        return name
    try:
        return get_accelerator(name).name
    except ConfigError:
        return name


_LAYOUT_COUNTS = ("pipeline_parallel", "tensor_parallel", "expert_parallel", "context_parallel", "virtual",
                  "microbatches", "shard_degree", "recompute_every")  # fmt: skip
"""The candidate's counts an export writes: each a whole number >= 1 when present (null: unset)."""


def check_names(c: Json, what: str) -> None:
    """ConfigError for a recompute, schedule or precision the tool does not know, a layout count that is not a whole
    number >= 1, a ZeRO stage outside 0-3 or a flag that is not true or false (a hand-edited plan): the config would
    carry it as it is (torchtitan's ``mode = "bogus"``, DeepSpeed's ``"stage": "9"``, a world size of 0)."""
    from microbatch.precision import PRECISIONS
    from microbatch.predict.activations import RECOMPUTE_CHOICES

    for key in _LAYOUT_COUNTS:
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"the {what}'s {key} must be a whole number >= 1, got {v!r}; plan again")
    z = c.get("zero", 0)
    if isinstance(z, bool) or z not in (0, 1, 2, 3):
        raise ConfigError(f"the {what}'s zero must be a ZeRO stage 0, 1, 2 or 3, got {z!r}; plan again")
    for key in ("sequence_parallel", "async_tp", "grad_clip"):
        if c.get(key) is not None and not isinstance(c[key], bool):
            raise ConfigError(f"the {what}'s {key} must be true or false, got {c[key]!r}; plan again")

    rc = c.get("recompute", "none")
    if rc not in RECOMPUTE_CHOICES:
        raise ConfigError(
            f"the {what}'s recompute {rc!r} is not one of {', '.join(RECOMPUTE_CHOICES)}; plan again"
        )
    if precision_of(c) not in PRECISIONS:
        raise ConfigError(f"the {what}'s precision {precision_of(c)!r} is not one of {', '.join(PRECISIONS)}")
    if c.get("schedule") is not None and schedule_spec(str(c["schedule"])) is None:
        from microbatch.schedules.registry import schedule_names

        raise ConfigError(
            f"the {what}'s schedule {c['schedule']!r} is not one of {', '.join(schedule_names())}; plan again"
        )


def assumed_notes(c: Json, fmt: str = "") -> tuple[str, ...]:
    """What the plan priced that no exported config sets: an optimizer other than AdamW (the Hugging Face Trainer's
    ``optim`` and torchtitan's ``[optimizer] name`` default to it; DeepSpeed and Lightning take yours), a loss over
    half logits (the Trainer's and torchtitan's losses upcast them), and for the Trainer and Lightning (format
    ``fmt``) a fused loss where theirs is PyTorch's eager cross-entropy (:data:`microbatch.precision.LOSS_KERNELS`)."""
    notes = []
    if c.get("optimizer", "adamw") != "adamw":
        notes.append(
            f"the plan priced the {c['optimizer']} optimizer's state and update; the config does not choose "
            "an optimizer: build that one in your code (the Trainer's optim, torchtitan's [optimizer] name)"
        )
    if c.get("loss_dtype", "fp32") != "fp32":
        notes.append(
            "the plan priced the loss over half logits (Megatron's fp16_lm_cross_entropy); the Trainer's "
            "and torchtitan's losses upcast them to fp32: 2 B a logit more in memory and time than planned"
        )
    kernels = {
        "compiled": "torch.compile's generated",
        "fused": "hand-written fused (Megatron's, TE's, apex's)",
    }
    written = {"hf": "compiled", "torchtitan": "compiled"}  # the formats whose config turns compile on
    if c.get("elementwise") in kernels and written.get(fmt) != c["elementwise"]:
        notes.append(
            f"the plan priced {kernels[c['elementwise']]} elementwise kernels (norms, activations, softmax); the "
            "config does not choose kernels: "
            + (
                "torch.compile the model in your code"
                if c["elementwise"] == "compiled"
                else "build the model with them"
            )
        )
    # torchtitan compiles its loss with the model where compile is on (the export turns it on for these)
    compiled = c.get("elementwise") == "compiled" or precision_of(c) == "fp8" or bool(c.get("async_tp"))
    eager = {"hf": "the Trainer's loss (ForCausalLMLoss)", "lightning": "a LightningModule's F.cross_entropy"}
    if not compiled:
        eager["torchtitan"] = "torchtitan's loss without compile"
    if fmt in eager and c.get("loss_kernel", "fused") != "eager":
        who = eager[fmt]
        notes.append(
            f"the plan priced a fused, in-place loss; {who} is PyTorch's eager cross-entropy, whose backward "
            "holds two more copies of the logits at the peak: plan with loss_kernel eager to price them"
        )
    if fmt == "hf" and not compiled and c.get("layer_kernels", "fused") != "eager":
        notes.append(
            "the plan priced fused layers' activations; the Trainer runs transformers' layers op by op, which keep "
            "more (a Llama layer 1.47x, GPT-2's 1.75x, measured): plan with layer_kernels eager to price them, or "
            "compile the model (torch_compile)"
        )
    return tuple(notes + _zero3_runner_notes(c, fmt))


ZERO3_RUNNERS = {"deepspeed": "deepspeed", "torchtitan": "fsdp2", "lightning": "fsdp1", "hf": "fsdp1"}
"""Who runs ZeRO-3 in each format's config: DeepSpeed's own; torchtitan's FSDP2 (``fully_shard``); Lightning's
``fsdp`` strategy and the Trainer's ``fsdp`` (FullyShardedDataParallel through Accelerate, version 1 by default)."""


def _zero3_runner_notes(c: Json, fmt: str) -> list[str]:
    """A note where the plan priced ZeRO-3 as another runner than the format's (:data:`ZERO3_RUNNERS`): FSDP2 copies
    each gathered layer and each reduction on the compute stream and (auto) reduces in fp32; the others do not."""
    runner, priced = ZERO3_RUNNERS.get(fmt), c.get("zero3_impl", "fsdp2")
    if runner is None or c.get("zero", 0) < 3 or c.get("pipeline_parallel", 1) > 1 or priced == runner:
        return []
    who = (  # the Trainer's config carries no sharding of its own: say what its fsdp= would run
        "the Trainer's fsdp= (FullyShardedDataParallel through Accelerate) runs fsdp1 by default"
        if fmt == "hf"
        else f"this config runs {runner}"
    )
    return [
        f"the plan priced ZeRO-3 as {priced} runs it, and {who}: plan with zero3_impl {runner} for its copies and its "
        "reduce dtype"
    ]


def deepspeed_moe_note(ep: int, capacity_factor: float | None, t: int) -> str:
    """The note on DeepSpeed's MoE layer, whose defaults (capacity_factor=1.0, drop_tokens=True,
    enable_expert_tensor_parallelism=False) are not the plan's: the arguments that make them so."""
    args = [
        f"ep_size={ep}",
        "drop_tokens=False" if capacity_factor is None else f"capacity_factor={capacity_factor}",
    ]
    if t > 1:
        args.append("enable_expert_tensor_parallelism=True")
    why = (
        "routes dropless" if capacity_factor is None else f"caps each expert at {capacity_factor}× its share"
    )
    if t > 1:
        why += f" and splits each expert over the t = {t} tensor-parallel ranks"
    return (
        f"expert parallelism {ep}: build the MoE layers with deepspeed.moe.layer.MoE({', '.join(args)}, ...) in "
        f"model code (the plan {why}; its defaults, capacity_factor=1.0 with drop_tokens=True and no expert tensor "
        "parallelism, are not)"
    )


def no_pipeline(trainer: str, p: int, instead: str) -> ConfigError:
    """The refusal of a pipeline plan by a trainer that runs none (a note let it through: each process would hold the
    whole model whose stages the plan checked for memory)."""
    return ConfigError(
        f"{trainer} runs no pipeline parallelism: each process would hold the whole model the plan splits over "
        f"p = {p} stages, which the memory checked per stage does not cover; export this plan to {instead}, or plan "
        "again with pipeline_parallel 1",
        params=("pipeline_parallel",),
    )
