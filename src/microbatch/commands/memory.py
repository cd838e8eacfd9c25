"""``microbatch memory``: per-stage bytes of weights, gradients, optimizer state and activations."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from microbatch.commands._answer_notes import hf_config_notes
from microbatch.commands._common import (
    check_batch_bound,
    emit,
    json_option,
    model_options,
    moe_options,
    moe_split,
    parse_split,
    parse_zero,
    resolve_model,
    stages_option,
    zero_choice,
)
from microbatch.commands._schedule_inputs import ScheduleChoice
from microbatch.commands._state_flags import (
    check_layer_kernels_flag,
    dropout_option,
    precision_options,
    state_settings,
)
from microbatch.commands._texts import CALIBRATION_HELP, PP_GRAD_REDUCE_HELP
from microbatch.predict.collectives import ZERO3_IMPLS
from microbatch.predict.state import PIPELINE_GRAD_REDUCE, REDUCE_DTYPES

if TYPE_CHECKING:
    from microbatch.hardware import Accelerator
from microbatch.show.answers import render_memory

__all__ = ["cmd"]


@click.command("memory")
@model_options
@click.option(
    "--micro-batch",
    "-b",
    "micro_batch",
    type=int,
    callback=check_batch_bound,
    required=True,
    help="b_m: sequences per micro-batch.",
)
@click.option("--tensor-parallel", "-t", "tensor_parallel", type=int, default=1, show_default=True, help="t.")
@stages_option(required=False, default=1)
@click.option(
    "--virtual",
    "-v",
    type=int,
    default=None,
    help="v: chunks per rank (interleaved; default 1, or the schedule's own: 2 for dualpipev).",
)
@click.option("--microbatches", "-m", type=int, help="m per flush (default 4p).")
@click.option(
    "--schedule",
    type=ScheduleChoice(),
    default=None,
    help="Pipeline schedule (default 1f1b; interleaved-1f1b when --virtual > 1).",
)
@click.option("--sequence-parallel", is_flag=True, help="Megatron sequence parallelism (needs t > 1).")
@click.option(
    "--recompute", type=click.Choice(["none", "selective", "full", "op"]), default="none", show_default=True
)
@click.option("--flash-attention/--no-flash-attention", "flash", default=None, help="Default: the model's.")
@dropout_option
@precision_options
@click.option("--zero", type=zero_choice(), default="0", show_default=True, help="ZeRO stage; dist-opt = 1.")
@click.option("--data-parallel", "-d", "data_parallel", type=int, default=1, show_default=True, help="d.")
@moe_options
@click.option(
    "--layers-per-stage",
    help="Uneven split, e.g. 5,6,6,5 (with --virtual, each stage's layers spread over its v chunks).",
)
@click.option(
    "--pp-grad-reduce", "pipeline_grad_reduce", type=click.Choice(list(PIPELINE_GRAD_REDUCE)), default="last",
    show_default=True, help=PP_GRAD_REDUCE_HELP,
)  # fmt: skip
@click.option(
    "--zero3-impl", "zero3_impl", type=click.Choice(list(ZERO3_IMPLS)), default="fsdp2", show_default=True,
    help="Who runs ZeRO-3, as plan's: its reduce dtype follows (--reduce-dtype auto).",
)  # fmt: skip
@click.option(
    "--reduce-dtype", "reduce_dtype", type=click.Choice(list(REDUCE_DTYPES)), default="auto", show_default=True,
    help="What ZeRO-3's reduce-scatter moves, as plan's: its input buffer is held beside the gathered layers.",
)  # fmt: skip
@click.option("--gpu", help="Also say whether the peak fits this accelerator (e.g. a100-80gb).")
@click.option("--calibration", type=click.Path(dir_okay=True), help=CALIBRATION_HELP)
@json_option
def cmd(
    model_spec: dict[str, Any], moe_spec: dict[str, Any], micro_batch: int, tensor_parallel: int, stages: int, virtual: int | None,
    microbatches: int | None, schedule: str | None, sequence_parallel: bool, recompute: str, flash: bool | None,
    dropout: bool | None, precision: str, grad_dtype: str, optimizer: str, moments_dtype: str, master_weights: str, loss_dtype: str, loss_kernel: str | None, layer_kernels: str, zero: str, data_parallel: int, layers_per_stage: str | None,
    pipeline_grad_reduce: str, zero3_impl: str, reduce_dtype: str, gpu: str | None, calibration: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Predict the peak memory of every pipeline stage.

    \b
    Example: microbatch memory --model megatron-22b --micro-batch 4 --tensor-parallel 8 \\
               --sequence-parallel --recompute selective --no-flash-attention
    """
    from microbatch.predict.memory import MemoryConfig, estimate_memory
    from microbatch.schedules.registry import default_schedule

    v_note = _v1_note(virtual, schedule, stages)
    virtual = _chunks_per_rank(virtual, schedule, stages)
    _check_zero3_flags(zero, stages, pipeline_grad_reduce)
    expert_shape, expert_layout = moe_split(moe_spec, precision)
    check_layer_kernels_flag(layer_kernels, calibration)
    state = state_settings(precision, grad_dtype, optimizer, moments_dtype, master_weights, loss_dtype, loss_kernel, layer_kernels)  # fmt: skip
    shape = resolve_model({**model_spec, **expert_shape})
    if dropout is not None:
        shape = replace(shape, dropout=dropout)
    cfg = MemoryConfig(
        micro_batch=micro_batch,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        pipeline_parallel=stages,
        virtual=virtual,
        microbatches=microbatches,
        schedule=schedule or default_schedule(virtual),
        layers_per_stage=parse_split(layers_per_stage),
        data_parallel=data_parallel,
        zero=parse_zero(zero),
        **state,
        recompute=recompute,
        flash_attention=flash,
        pipeline_grad_reduce=pipeline_grad_reduce,
        zero3_impl=zero3_impl,
        reduce_dtype=reduce_dtype,
        **expert_layout,
    )
    acc = _one_gpu(gpu, precision) if gpu is not None else None
    applied = None
    if calibration:
        from microbatch.predict.apply_calibration import PlannedLayout, apply_calibration, fixed_bytes_notes

        layout = PlannedLayout(
            micro_batches=(micro_batch,), tensor_parallel=tensor_parallel, pipeline_parallel=stages,
            data_parallel=data_parallel, zero=cfg.zero, recompute=recompute,
        )  # fmt: skip
        applied = apply_calibration(calibration, shape=shape, precision=precision, layout=layout)
        applied = replace(applied, notes=applied.notes + tuple(fixed_bytes_notes(applied.calibration, acc)))
        cfg = replace(cfg, loss_kernel=loss_kernel or applied.calibration.loss_kernel)  # the loop it measured
    est = estimate_memory(shape, cfg, applied.memory if applied else None)
    out = est.to_dict()
    out["total_params"] = shape.param_count()
    out["active_params"] = shape.active_param_count()  # = total for a dense model
    if applied:
        out.update(applied.to_dict())
    if acc is not None:
        out.update(_fit_fields(est.peak_bytes, acc))
    notes = ([v_note] if v_note else []) + hf_config_notes(
        model_spec, shape, None if calibration else layer_kernels
    )
    if notes:
        out["notes"] = notes
    why = _does_not_fit(out, acc) if acc is not None and not out["fits"] else None
    if why is not None:  # as plan: the estimate kept, exit 2, a kind of its own
        out = {**out, "error": why, "kind": "does_not_fit"}
    emit(out, as_json, lambda: render_memory(shape, cfg, est, out, acc, applied))
    if why is not None:
        click.echo(f"error: {why}", err=True)
        raise click.exceptions.Exit(2)


def _one_gpu(gpu: str, precision: str) -> Accelerator:
    """The one accelerator ``--gpu`` names, its GEMM dtype checked for ``precision``."""
    from microbatch.errors import ConfigError
    from microbatch.hardware import get_accelerator
    from microbatch.precision import check_gemm_dtype

    if not gpu.strip() or "," in gpu:  # '' was ignored; a list named "unknown accelerator" two known ones
        raise ConfigError(
            f"--gpu {gpu!r} names {'no' if not gpu.strip() else 'more than one'} accelerator; memory checks one "
            "(a100-80gb, h100-sxm, ...): give one name, or compare several with plan --gpu a,b"
        )
    acc = get_accelerator(gpu)
    check_gemm_dtype(precision, acc.name, acc.peak_flops)
    return acc


def _check_zero3_flags(zero: str, stages: int, grad_reduce: str = "last") -> None:
    """A ConfigError for --zero3-impl or --reduce-dtype given where they change no memory: ZeRO below 3, or a pipeline,
    which keeps ZeRO-1's memory — but for the reduce dtype under a pipeline with ZeRO 2/3 reducing after the last
    micro-batch, in which FSDP2 holds the gradients (:func:`microbatch.predict.state.held_grad_bytes`)."""
    from microbatch.commands._common import parse_zero
    from microbatch.commands._schedule_inputs import user_gave
    from microbatch.errors import ConfigError

    holds = (
        stages > 1 and parse_zero(zero) >= 2 and grad_reduce == "last"
    )  # gradients held in the reduce dtype
    if user_gave("reduce_dtype") and stages > 1 and parse_zero(zero) >= 2 and grad_reduce == "each":
        raise ConfigError(
            "reduce_dtype with pipeline_grad_reduce each: the gradients are reduce-scattered after every micro-batch "
            "and a shard kept in their own dtype, so the memory would not change (plan prices the reduce-scatter's "
            "time by it); drop reduce_dtype here, or give pipeline_grad_reduce last",
            params=("reduce_dtype", "pipeline_grad_reduce"),
        )
    given = [
        f for f in ("zero3_impl", "reduce_dtype") if user_gave(f) and not (f == "reduce_dtype" and holds)
    ]
    if given and (parse_zero(zero) < 3 or stages > 1):
        why = (
            f"zero is {zero}"
            if parse_zero(zero) < 3
            else f"pipeline_parallel is {stages} (FSDP2 whatever it says)"
        )
        raise ConfigError(
            f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} ZeRO-3's buffers, and {why}: the memory would not change; give zero 3 "
            "without a pipeline, or drop " + " and ".join(given),
            params=(*given, "zero", "pipeline_parallel"),
        )


def _fit_fields(peak: float, acc: Accelerator) -> dict[str, Any]:
    """Whether ``peak`` fits ``acc`` as plan judges it, peak <= capacity × (1 − headroom), and the device itself."""
    from microbatch.hardware import DEFAULT_HEADROOM

    budget = acc.memory_bytes * (1 - DEFAULT_HEADROOM)
    return {
        "gpu": acc.name, "gpu_memory_bytes": acc.memory_bytes, "memory_headroom": DEFAULT_HEADROOM,
        "memory_budget_bytes": budget, "fits": peak <= budget, "fits_device": peak <= acc.memory_bytes,
    }  # fmt: skip


def _v1_note(virtual: int | None, schedule: str | None, stages: int) -> str | None:
    """The note when an interleaving schedule runs at the default v = 1 (its bubble is 1F1B's, not its memory)."""
    if virtual is not None or not schedule or stages == 1:
        return None
    from microbatch.commands._flags import cli_text
    from microbatch.schedules.registry import get_spec
    from microbatch.schedules.virtual import virtual_in_effect

    note = virtual_in_effect(get_spec(schedule), None)[1]
    return cli_text(note, ("virtual",), "memory") if note else None


def _chunks_per_rank(virtual: int | None, schedule: str | None, stages: int) -> int:
    """``--virtual``, else the schedule's own chunks per rank under a pipeline (a V schedule's 2: bubble reads it
    so), else 1."""
    if virtual is not None:
        return virtual
    from microbatch.schedules.registry import get_spec

    return (get_spec(schedule).stages_per_rank if schedule and stages > 1 else None) or 1


def _does_not_fit(out: dict[str, Any], acc: Accelerator) -> str:
    """Why a peak does not fit ``acc`` as plan keeps it (its headroom), whether it fits the device itself, and the
    fixes not already taken (a user given ``--recompute full`` was told to recompute)."""
    config = out.get("config") or {}
    fixes = "shard more (--zero, -t, -p)" + (
        "" if config.get("recompute") == "full" else ", recompute (--recompute full)"
    )
    return (
        f"the peak {out['peak_memory_bytes'] / 2**30:.2f} GiB does not fit {out['memory_budget_bytes'] / 2**30:.2f} "
        f"GiB of {acc.name} (capacity × (1 − headroom {out['memory_headroom']:g}), as plan keeps)"
        + (
            "; it is inside the device itself (plan, with --memory-headroom 0, would run it)"
            if out["fits_device"]
            else ""
        )
        + f"; {fixes} or lower -b"
    )
