"""``microbatch validate``: predict measured points from the others — the planner's error, stated."""

from __future__ import annotations

from typing import Any

import click

from microbatch.commands._common import MODEL_FLAGS, emit, json_option, model_options, resolve_model
from microbatch.units import format_bytes

__all__ = ["cmd", "render_validation"]

_COLUMNS = (
    ("micro_batch", "b_m", "{}"),
    ("fit", "fit", "{}"),
    ("mem_MiB", "mem MiB", "{:,.1f}"),
    ("mem_uncal_MiB", "uncal", "{:,.1f}"),
    ("mem_uncal_err_%", "err%", "{:+.1f}"),
    ("mem_cal_MiB", "cal", "{:,.1f}"),
    ("mem_cal_err_%", "err%", "{:+.1f}"),
    ("mem_loo_err_%", "loo%", "{:+.1f}"),
    ("step_ms", "step ms", "{:,.2f}"),
    ("step_uncal_ms", "uncal", "{:,.2f}"),
    ("step_uncal_err_%", "err%", "{:+.1f}"),
    ("step_cal_ms", "cal", "{:,.2f}"),
    ("step_cal_err_%", "err%", "{:+.1f}"),
    ("step_loo_err_%", "loo%", "{:+.1f}"),
)


def render_validation(d: dict[str, Any]) -> str:
    """The ``validate --json`` object as text: a table, the summary, the calibration, the warnings."""
    head = [h for _, h, _ in _COLUMNS]
    body = [[("—" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in _COLUMNS] for r in d["rows"]]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        f"{d['model']} s={d['seq']} {d['precision']}, checkpointing {'on' if d['checkpointing'] else 'off'}, "
        f"measured on {d['device_name'] or d['device']} ({d['memory_key']}, {d['time_key']}); step times "
        f"predicted for {d['accelerator']['name']}: {d['accelerator']['source']}",
        "uncal = analytic model; cal = calibrated on the smallest probes (fit = probe); loo = leave-one-out",
        "",
        "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    cal = d["calibration"]
    mem, eff = cal["memory"], cal["efficiency"]
    lines += [
        "",
        d["summary"],
        "",
        f"calibration (b_m {', '.join(map(str, cal['micro_batches']))}): activation_scale "
        f"{mem['activation_scale']:.3f}, fixed_bytes {format_bytes(mem['fixed_bytes'], digits=1, unit='MiB')}"
        + (
            f"; gemm_max {eff['gemm_max']:.3f}, half_rows {eff['half_rows']:,.0f} (vs {cal['accelerator']})"
            if eff
            else ""
        ),
    ]
    if d["oom"]:
        lines.append(f"out of memory (not predicted here): b_m {', '.join(map(str, d['oom']))}")
    lines += [f"note: {w}" for w in d["warnings"]]
    return "\n".join(lines)


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
    from microbatch.predict.validation import validate_result

    cores = usable_cores()
    if cpu_threads is not None and cpu_threads > cores:  # before the CPU is measured (seconds)
        raise ConfigError(
            f"--cpu-threads {cpu_threads} is more than the {cores} cores this process may run on; a matmul "
            f"timed on more threads than cores measures the contention; give --cpu-threads {cores} or fewer"
        )
    shape = resolve_model(model_spec) if any(model_spec.get(k) is not None for k in MODEL_FLAGS) else None
    result = validate_result(
        calibration,
        shape=shape,
        memory_key="peak_allocated_bytes" if memory == "allocated" else "peak_memory_bytes",
        gpu=gpu,
        fit_on=fit_on,
        cpu_peak_gflops=cpu_peak_gflops,
        cpu_bandwidth_gbs=cpu_bandwidth_gbs,
        cpu_threads=cpu_threads,
    )
    emit(result, as_json, lambda: render_validation(result))
