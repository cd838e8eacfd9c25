"""``microbatch bench-gpu``: a few seconds of kernel microbenchmarks, written for ``plan --calibration``."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import click

from microbatch.commands._common import emit, json_option, model_options, progress, resolve_model
from microbatch.commands._outputs import check_output_file, force_option, write_out
from microbatch.show.answers import render_microbench

__all__ = ["cmd"]


def _check_counts(device: str, repeats: int, threads: int, budget_s: float) -> None:
    """--repeats and --threads >= 1, the threads no more than this process's cores on a CPU (they would time each
    other's waits), --budget-s a finite number of seconds > 0."""
    from microbatch.errors import ConfigError
    from microbatch.hardware import usable_cores

    for flag, value in (("--repeats", repeats), ("--threads", threads)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if not (budget_s > 0 and math.isfinite(budget_s)):
        raise ConfigError(f"--budget-s {budget_s} must be a finite number > 0 of seconds; e.g. --budget-s 20")
    if not device.startswith("cuda") and threads > (cores := usable_cores()):
        raise ConfigError(
            f"--threads {threads} is more than the {cores} core(s) this process may use: the threads would share "
            f"them and time each other's waits; give --threads {cores} or fewer (1 is steadiest)"
        )


def _parse_bms(text: str) -> tuple[int, ...]:
    from microbatch.errors import ConfigError

    items = [x.strip() for x in text.split(",")]
    try:
        out = tuple(int(x) for x in items)  # an empty item ('', '1,,2') is not a size: refused, not dropped
    except ValueError:
        out = ()
    if not out or any(b < 1 for b in out) or len(set(out)) < len(out):
        raise ConfigError(
            f"--micro-batches {text!r} is not a list of distinct positive integers; e.g. --micro-batches 1,2,4"
        )
    return out


@click.command("bench-gpu")
@model_options
@click.option(
    "--device", default=None, help="cpu or cuda (cuda:N). Default: cuda when torch sees one, else cpu."
)
@click.option(
    "--micro-batches", "micro_batches", default=None,
    help="b_m whose rows b_m·s the layer GEMMs are timed at, comma-separated. Default: 1,2,4,8 (quick: 1,4).",
)  # fmt: skip
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto", show_default=True,
              help="Data type: auto is bf16 on CUDA, fp32 on the CPU.")  # fmt: skip
@click.option(
    "--quick", is_flag=True, help="Small grid and tensors: seconds on a CPU (the model's GEMMs stay)."
)
@click.option(
    "--repeats", type=int, default=10, show_default=True, help="Timed repeats per kernel (median kept)."
)
@click.option("--budget-s", "budget_s", type=float, default=20.0, show_default=True,
              help="Wall seconds for everything; kernels past it are skipped and named.")  # fmt: skip
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads on the CPU.")
@click.option("--soak-s", "soak_s", type=float, default=None,
              help="Seconds of back-to-back calls before each GEMM and attention kernel is timed, so it runs at the "
                   "clock a training step's load holds. Default: 0.1 on a GPU, 0 on the CPU; 0 times bursts.")  # fmt: skip
@click.option(
    "--out", type=click.Path(dir_okay=False), help="Write the result as JSON here (for plan --calibration)."
)
@force_option
@json_option
def cmd(
    model_spec: dict[str, Any], device: str | None, micro_batches: str | None, dtype: str, quick: bool,
    repeats: int, budget_s: float, threads: int, soak_s: float | None, out: str | None, force: bool,
    as_json: bool,
) -> None:  # fmt: skip
    """Time the kernels the step-time model charges, on this device, for `plan --calibration`.

    Times the layer GEMMs of --model (QKV, projection, MLP, output layer) at rows b_m·s, a small
    M×N×K grid, causal attention (SDPA) at a few sequence lengths (each after --soak-s of
    back-to-back calls: the clock a training step holds, not a burst's), a square GEMM in a burst and
    under up to two seconds of load (5% of --budget-s), streaming kernels (copy, add,
    GeLU, LayerNorm), the per-kernel launch floor, and all-reduce/all-gather when a torch.distributed
    process group is initialised (else skipped, and said); under torchrun the command joins one
    and also times a GEMM beside an all-reduce (how much overlapped communication slows
    computation), rank 0 printing and writing. CUDA events after warm-up on a GPU; on a CPU the
    thread's CPU clock at --threads 1, the wall clock at more. Each figure is a median. --budget-s bounds the
    run: a kernel whose fewest calls (a warm-up and one timed) are predicted past the seconds left is skipped
    and named; one slower than predicted can overrun by its own calls (a 7B layer's GEMM on a loaded CPU: 26 s
    of 20). Default model: gpt2 on CUDA, tiny on the CPU.

    Then plan with the measured terms in place of the analytic ones, on the accelerator it ran on:

    \b
        microbatch bench-gpu --model llama-2-7b --out h100.json
        microbatch plan --model llama-2-7b --gpu h100-sxm -B 512 -d 8 --calibration h100.json
        torchrun --standalone --nproc_per_node 8 -m microbatch bench-gpu --out node.json

    Ctrl-C keeps what was measured (printed, and in --out), then exits 130.
    """
    from microbatch.interrupts import first_interrupt_only
    from microbatch.measure.microbench import MicrobenchConfig, join_launched_group

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    default_model = "gpt2" if device.startswith("cuda") else "tiny"
    shape = resolve_model(model_spec, default=default_model)
    bms = _parse_bms(micro_batches) if micro_batches is not None else ((1, 4) if quick else (1, 2, 4, 8))
    _check_counts(device, repeats, threads, budget_s)
    cfg = MicrobenchConfig(shape=shape, micro_batches=bms, device=device, dtype=dtype, quick=quick,
                           repeats=repeats, budget_s=budget_s, threads=threads, soak_s=soak_s)  # fmt: skip
    _check_fits(cfg)
    check_output_file(out, "--out", (".json",), force=force)  # before any kernel runs
    device, rank, owned = join_launched_group(device)  # under torchrun: one process group, this rank's GPU
    cfg = replace(cfg, device=device)
    progress(f"bench-gpu: {shape.name} on {device}, up to {budget_s:g} s")
    with first_interrupt_only():  # a second Ctrl-C must not lose what the first one kept
        code = _measure_and_keep(cfg, owned, rank, device, out, as_json)
    if owned and not device.startswith("cuda"):
        # gloo's process group aborted the process in its teardown after everything was written (2 of 8
        # two-rank runs with destroy_process_group, 2 of 35 without): leave without running it
        from microbatch.measure.device import exit_past_teardown

        exit_past_teardown(code)
    if code:
        raise click.exceptions.Exit(code)


def _measure_and_keep(cfg: Any, owned: bool, rank: int, device: str, out: str | None, as_json: bool) -> int:
    """Run the microbenchmark, and on rank 0 write (``out``) and print what it measured; 130 when interrupted."""
    from microbatch.measure.microbench import run_microbench

    try:
        result = run_microbench(
            cfg, on_phase=lambda what: progress(f"bench-gpu: {what}") if rank == 0 else None
        )
        if owned:  # every rank done before any tears the group down (gloo aborts a rank still reading)
            import torch.distributed

            torch.distributed.barrier()
    finally:
        if owned and device.startswith("cuda"):  # NCCL wants its group destroyed before exit
            import torch.distributed

            torch.distributed.destroy_process_group()
    code = 0 if result.complete else 130
    if rank == 0:  # rank 0 speaks and writes for the group
        d = result.to_dict()
        if code:
            d["interrupted"] = True  # as tune, noise and pipeline say it
        where = write_out(out, d) if out else None  # kept_in where it could not be written: exit 1 below
        emit(d, as_json, lambda: render_microbench(d))
        if not result.complete:
            progress("interrupted: kept what was measured" + (f" in {where}" if where else ""))
        elif "kept_in" in d:
            code = 1
    return code


def _check_fits(cfg: Any) -> None:
    """ConfigError, before any kernel, when the largest b_m's layer tensors cannot fit here: the GEMM operands
    and output at b_m·s rows (x and the widest of Q/K/V or the MLP, and the result) against the device's
    memory (CUDA's total; on the CPU what the host has available)."""
    from microbatch.errors import ConfigError
    from microbatch.measure.hostmem import available_host_bytes
    from microbatch.units import format_bytes

    sh, b = cfg.shape, max(cfg.micro_batches)
    elem = 4 if cfg.resolved_dtype == "fp32" else 2
    need = b * sh.seq * (sh.hidden + 2 * max(3 * sh.hidden, sh.ffn)) * elem
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return  # the benchmark's own check says there is no CUDA device
        have: int | None = torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory
    else:
        have = available_host_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"--micro-batches {b} at s = {sh.seq:,} needs {format_bytes(need)} for one layer's GEMM operands, "
            f"more than the {format_bytes(have)} {cfg.device} has; give smaller --micro-batches or a smaller --model"
        )
