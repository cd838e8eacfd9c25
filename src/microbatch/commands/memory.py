"""``microbatch memory``: per-stage bytes of weights, gradients, optimizer state and activations."""

from __future__ import annotations

import click

from microbatch.commands._common import (
    emit,
    json_option,
    model_options,
    precision_options,
    resolve_model,
    stages_option,
)
from microbatch.predict.calibrate import CALIBRATION_HELP

_GIB = 2**30


def _parse_split(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    from microbatch.errors import ConfigError

    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--layers-per-stage {text!r} must be whole numbers separated by commas, e.g. 5,6,6,5"
        ) from None


def zero_choice() -> click.Choice:
    return click.Choice(["0", "1", "2", "3", "dist-opt"])


def parse_zero(text: str) -> int:
    """``dist-opt`` (Megatron's distributed optimizer) shards what ZeRO-1 shards."""
    return 1 if text == "dist-opt" else int(text)


@click.command("memory")
@model_options
@click.option(
    "--micro-batch", "-b", "micro_batch", type=int, required=True, help="b_m: sequences per micro-batch."
)
@click.option("--tensor-parallel", "-t", "tensor_parallel", type=int, default=1, show_default=True, help="t.")
@stages_option(required=False, default=1)
@click.option(
    "--virtual", "-v", type=int, default=1, show_default=True, help="v: chunks per rank (interleaved)."
)
@click.option("--microbatches", "-m", type=int, help="m per flush (default 4p).")
@click.option(
    "--schedule",
    type=click.Choice(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]),
    default=None,
    help="Pipeline schedule (default 1f1b; interleaved-1f1b when --virtual > 1).",
)
@click.option("--sequence-parallel", is_flag=True, help="Megatron sequence parallelism (needs t > 1).")
@click.option(
    "--recompute", type=click.Choice(["none", "selective", "full"]), default="none", show_default=True
)
@click.option("--flash-attention/--no-flash-attention", "flash", default=None, help="Default: the model's.")
@precision_options
@click.option("--zero", type=zero_choice(), default="0", show_default=True, help="ZeRO stage; dist-opt = 1.")
@click.option("--data-parallel", "-d", "data_parallel", type=int, default=1, show_default=True, help="d.")
@click.option("--layers-per-stage", help="Uneven split, e.g. 5,6,6,5.")
@click.option("--gpu", help="Also say whether the peak fits this accelerator (e.g. a100-80gb).")
@click.option("--calibration", type=click.Path(dir_okay=True), help=CALIBRATION_HELP)
@json_option
def cmd(
    model_spec, micro_batch, tensor_parallel, stages, virtual, microbatches, schedule, sequence_parallel,
    recompute, flash, precision, grad_dtype, optimizer, zero, data_parallel, layers_per_stage, gpu, calibration,
    as_json,
):  # fmt: skip
    """Predict the peak memory of every pipeline stage.

    \b
    Example: microbatch memory --model megatron-22b --micro-batch 4 --tensor-parallel 8 \\
               --sequence-parallel --recompute selective --no-flash-attention
    """
    from microbatch.predict.memory import MemoryConfig, bytes_per_param, estimate_memory

    shape = resolve_model(model_spec)
    cfg = MemoryConfig(
        micro_batch=micro_batch,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        pipeline_parallel=stages,
        virtual=virtual,
        microbatches=microbatches,
        schedule=schedule or ("interleaved-1f1b" if virtual > 1 else "1f1b"),
        layers_per_stage=_parse_split(layers_per_stage),
        data_parallel=data_parallel,
        zero=parse_zero(zero),
        precision=precision,
        grad_dtype=grad_dtype,
        optimizer=optimizer,
        recompute=recompute,
        flash_attention=flash,
    )
    acc = None
    if gpu:
        from microbatch.hardware import get_accelerator

        acc = get_accelerator(gpu)
    applied = None
    if calibration:
        from microbatch.predict.calibrate import apply_calibration

        applied = apply_calibration(
            calibration, shape=shape, precision=precision, micro_batches=[micro_batch],
            tensor_parallel=tensor_parallel, pipeline_parallel=stages, data_parallel=data_parallel,
            zero=cfg.zero, recompute=recompute,
        )  # fmt: skip
    est = estimate_memory(shape, cfg, applied.memory if applied else None)
    out = est.to_dict()
    if applied:
        out.update(applied.to_dict())
    if acc is not None:
        out["gpu"] = acc.name
        out["gpu_memory_bytes"] = acc.memory_bytes
        out["fits"] = est.peak_bytes <= acc.memory_bytes

    def render() -> str:
        w, g, o = bytes_per_param(precision, grad_dtype, optimizer)
        lines = [
            f"{shape.name}: {shape.param_count():,} parameters; b_m={micro_batch} s={cfg.seq or shape.seq} "
            f"t={tensor_parallel}{' +SP' if sequence_parallel else ''} p={stages} v={virtual} m={cfg.m} "
            f"{cfg.schedule}; recompute {recompute}; {precision} ({w}+{g}+{o} = {w + g + o} B/param), "
            f"ZeRO {cfg.zero} over d={data_parallel}",
            "",
            f"{'stage':>5} {'layers':>6} {'in-flight':>9} {'weights':>9} {'grads':>9} {'optim':>9} "
            f"{'activ':>9} {'other':>8} {'peak':>9}",
        ]
        peak = est.peak_stage.stage
        for st in est.stages:
            mark = " <- peak" if st.stage == peak else ""
            lines.append(
                f"{st.stage:>5} {st.layers:>6} {st.in_flight:>9} {st.weights / _GIB:>8.2f}G {st.gradients / _GIB:>8.2f}G "
                f"{st.optimizer / _GIB:>8.2f}G {st.activations / _GIB:>8.2f}G {st.other / _GIB:>7.2f}G "
                f"{st.peak_bytes / _GIB:>8.2f}G{mark}"
            )
        if len(est.stages) > 12:
            top = sorted(est.stages, key=lambda s: -s.peak_bytes)[:1]
            lines.append(f"(highest: stage {top[0].stage})")
        terms = ", ".join(f"{k} {v / _GIB:.2f} GiB" for k, v in est.peak_stage.activation_terms.items())
        lines += ["", f"peak {est.peak_bytes / _GIB:.2f} GiB on stage {peak} (activations: {terms})"]
        if acc is not None:
            verdict = "fits" if out["fits"] else "does NOT fit"
            lines.append(f"{verdict} in {acc.name} ({acc.memory_bytes / _GIB:.0f} GiB; keep ~10% headroom)")
        if applied:
            lines += [""] + applied.lines()
        return "\n".join(lines)

    emit(out, as_json, render)
