"""``microbatch validate``: predict measured points from the others — the planner's error, stated."""

from __future__ import annotations

from typing import Any

import click

from microbatch.commands._common import MODEL_FLAGS, emit, json_option, model_options, resolve_model
from microbatch.show.validation import render_validation

__all__ = ["cmd", "render_validation"]


@click.command("validate")
@click.option(
    "--calibration",
    "calibration",
    required=True,
    type=click.Path(dir_okay=True),
    help="Measured points: a `tune --out DIR` result.json (or DIR), or JSON with points + model, seq, "
    "precision, checkpointing, device.",
)
@click.option(
    "--gpu",
    help="Accelerator the step times are predicted for (default: the GPU the file names; on the CPU, "
    "this CPU measured now).",
)
@click.option(
    "--fit-on",
    type=int,
    default=3,
    show_default=True,
    help="Calibrate on the smallest N probes and predict the rest.",
)
@click.option(
    "--memory",
    "memory",
    type=click.Choice(["peak", "allocated"]),
    default="peak",
    show_default=True,
    help="peak: peak_memory_bytes (CUDA reserved + context; CPU peak RSS); allocated: CUDA tensors only.",
)
@click.option("--cpu-peak-gflops", type=float, help="CPU peak GFLOP/s instead of measuring a matmul now.")
@click.option(
    "--cpu-bandwidth-gbs", type=float, help="CPU memory bandwidth GB/s instead of measuring a copy now."
)
@click.option(
    "--cpu-threads",
    type=int,
    help="torch threads for the CPU matmul (use the probes' --threads; default torch's).",
)
@model_options
@json_option
def cmd(
    calibration: str,
    gpu: str | None,
    fit_on: int,
    memory: str,
    cpu_peak_gflops: float | None,
    cpu_bandwidth_gbs: float | None,
    cpu_threads: int | None,
    model_spec: dict[str, Any],
    as_json: bool,
) -> None:
    """Predict each measured point uncalibrated, from the smallest probes, and leave-one-out.

    \b
    Example: microbatch tune --model small --out runs/small
             microbatch validate --calibration runs/small
    Calibration fits, for the implementation measured, the activation scale and fixed bytes of
    the memory model (the analytic terms scaled, not replaced) and the GEMM efficiency against
    rows b_m·s (1/eff linear in 1/rows). Assumes activations linear in b_m and a training
    micro-step of forward + 2× forward backward; the CPU's accelerator is a measured (or given)
    matmul peak and copy bandwidth, which the calibrated efficiency absorbs. Targets: memory
    within 5%, step time within 10% at the largest b_m.
    """
    from microbatch.errors import ConfigError
    from microbatch.hardware import usable_cores
    from microbatch.measure.cpu import measure_cpu
    from microbatch.predict.validation import validate_result
    from microbatch.records import on_gpu

    cores = usable_cores()
    if cpu_threads is not None and cpu_threads > cores:  # before the CPU is measured (seconds)
        raise ConfigError(
            f"--cpu-threads {cpu_threads} is more than the {cores} cores this process may run on; a matmul "
            f"timed on more threads than cores measures the contention; give --cpu-threads {cores} or fewer"
        )
    # --seq alone names no model: the file's stands (the note below says --seq was not taken where they differ)
    given = [k for k in MODEL_FLAGS if model_spec.get(k) is not None and k != "seq"]
    shape = resolve_model(model_spec) if given else None
    result = validate_result(
        calibration,
        shape=shape,
        memory_key="peak_allocated_bytes" if memory == "allocated" else "peak_memory_bytes",
        gpu=gpu,
        fit_on=fit_on,
        cpu_peak_gflops=cpu_peak_gflops,
        cpu_bandwidth_gbs=cpu_bandwidth_gbs,
        cpu_threads=cpu_threads,
        measure=measure_cpu,
    )
    from microbatch.commands._flags import cli_text
    from microbatch.show.validation import with_summary

    result = with_summary(result)
    cpu = [f for f, v in (("--cpu-peak-gflops", cpu_peak_gflops), ("--cpu-bandwidth-gbs", cpu_bandwidth_gbs),
                          ("--cpu-threads", cpu_threads)) if v is not None]  # fmt: skip
    if cpu and on_gpu(str(result.get("device", ""))):  # a GPU's points: this CPU's figures unused
        result["warnings"] = [
            *result["warnings"],
            f"{', '.join(cpu)} not used: the points were measured on a GPU",
        ]
    if (seq := model_spec.get("seq")) is not None and seq != result.get("seq"):  # the file's length stands
        result["warnings"] = [
            *result["warnings"],
            f"--seq {seq} not taken: the file says its points were measured at s = {result.get('seq')} (shape flags "
            "fill in what the file lacks, never what it says)",
        ]
    result["warnings"] = [
        cli_text(w, ("cpu_peak_gflops", "cpu_bandwidth_gbs"), "validate") for w in result["warnings"]
    ]
    emit(result, as_json, lambda: render_validation(result))
