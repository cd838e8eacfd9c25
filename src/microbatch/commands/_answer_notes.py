"""The notes a ``plan`` or ``memory`` answer adds below itself: what a ``--hf-config`` answer took from the file, one
``--gpu-set`` over several accelerators, and the uneven split that evens out a pipeline's stages. Split from
:mod:`microbatch.commands.plan` and :mod:`microbatch.commands._common`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from microbatch.hardware import Accelerator
    from microbatch.model import ModelShape
    from microbatch.predict.plan import Plan

__all__ = ["hf_config_notes", "rebalance_notes", "shared_override", "with_notes"]


def hf_config_notes(
    spec: Mapping[str, Any], shape: ModelShape, layers_priced: str | None = None
) -> list[str]:
    """What a ``--hf-config`` answer took from outside the user's words: a sequence length the file gave (its longest
    context, rarely what one trains at: 131,072 for Qwen2.5-7B) or none gave, the GPT-2 block built for a file
    with no ``model_type``, and, where ``layers_priced`` is ``fused`` (no calibration), that transformers' own eager
    layers keep more; [] without ``--hf-config``."""
    from microbatch.hf_config import config_facts

    path = spec.get("hf_config")
    if path is None:
        return []
    family, positions = config_facts(path)
    notes = []
    if spec.get("seq") is None:
        has_positions = positions is not None and shape.seq == positions
        notes.append(
            f"s = {shape.seq:,}: "
            + (
                "the config's longest context (max_position_embeddings)"
                if has_positions
                else "no length in the config"
            )
            + ", not necessarily your data's; give --seq with the length you train at"
        )
    if spec.get("seq") is not None and isinstance(positions, int) and shape.seq > positions:
        notes.append(
            f"s = {shape.seq:,} is past the config's max_position_embeddings {positions:,}: the model was not built "
            "for it (rotary positions run past it, a learned table would not; a rope_scaling in the config is how "
            "its family extends it)"
        )
    if not family:
        notes.append(
            f"{path} has no model_type: built as GPT-2 blocks (LayerNorm, a GeLU MLP of ffn_hidden, learned positions, "
            'tied embeddings, biases); add "model_type": "llama" (or its family) for RMSNorm, rotary and SwiGLU'
        )
    if layers_priced == "fused":
        notes.append(
            "activations priced as fused layers keep them; transformers runs this model's layers op by op, which "
            "keep more (measured: a Llama layer 1.47x, GPT-2's 1.75x): give --layer-kernels eager to price that "
            "(for a model held in bf16; autocast over fp32 weights keeps more still), or measure with tune and plan "
            "with --calibration"
        )
    return notes


def shared_override(gpu_set: tuple[str, ...], gpus: list[Accelerator]) -> list[str]:
    """The note that ``--gpu-set`` changed every accelerator compared (it may be meant for one), or none."""
    if not gpu_set or len(gpus) < 2:
        return []
    return [
        f"--gpu-set {' '.join(gpu_set)} applied to each accelerator compared ({', '.join(g.name for g in gpus)}); "
        "to change one, plan it alone with --gpu NAME --gpu-set KEY=VALUE"
    ]


def rebalance_notes(plans: list[Plan], out: dict[str, Any], render: Callable[[], str]) -> Callable[[], str]:
    """Each plan's recommendation whose stages wait on the end stages (simulated idle past the schedule's bubble): the
    uneven split that runs its settings faster (:func:`~microbatch.predict.plan_balance.balanced_split`), as
    ``rebalance`` in its JSON and a line under its text."""
    from microbatch.predict.plan_balance import balanced_split

    lines = []
    for i, pl in enumerate(plans):
        found = (
            balanced_split(pl.config, pl.recommended)
            if pl.recommended and not pl.config.layers_per_stage
            else None
        )
        if found is None:
            continue
        c, new, split = found.was, found.candidate, ",".join(map(str, found.layers_per_stage))
        record = {
            "layers_per_stage": list(found.layers_per_stage), "step_time_s": new.step_time_s,
            "tokens_per_s": new.tokens_per_s, "simulated_idle": new.time.get("simulated_idle"),
            "peak_memory_bytes": new.peak_memory_bytes, "was_step_time_s": c.step_time_s,
            "was_simulated_idle": c.time.get("simulated_idle"),
        }  # fmt: skip
        (out["plans"][i] if "plans" in out else out)["rebalance"] = record
        lines.append(
            f"note: {pl.config.gpu.name + ': ' if len(plans) > 1 else ''}the recommended layout idles "
            f"{100 * c.time['simulated_idle']:.1f}% of its step (the schedule alone {100 * c.bubble_fraction:.1f}%): "
            f"its end stages also hold the embedding and the output layer; --layers-per-stage {split} runs its "
            f"settings (-b {c.micro_batch} --schedule {c.schedule}"
            + (f" -v {c.virtual}" if c.virtual > 1 else "")
            + f" --recompute {c.recompute} --zero {c.zero}) in {new.step_time_s:.3g} s "
            f"({100 * (new.step_time_s / c.step_time_s - 1):+.1f}%, idle "
            f"{100 * new.time.get('simulated_idle', 0.0):.1f}%, peak {new.peak_memory_bytes / 2**30:.1f} GiB)"
        )
    return render if not lines else (lambda: render() + "".join("\n" + x for x in lines))


def with_notes(render: Callable[[], str], notes: list[str]) -> Callable[[], str]:
    """``render`` with a ``note:`` line after it for each of ``notes``."""
    return lambda: render() + "".join(f"\nnote: {n}" for n in notes)
