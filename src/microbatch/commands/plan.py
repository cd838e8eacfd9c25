"""``microbatch plan``: choose b_m, m, schedule, recompute and ZeRO for a cluster, and say why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from microbatch.commands._answer_notes import hf_config_notes, rebalance_notes, shared_override, with_notes
from microbatch.commands._common import (
    check_batch_bound,
    emit,
    json_option,
    model_options,
    moe_options,
    moe_split,
    resolve_model,
    stages_option,
)
from microbatch.commands._plan_calibration import (
    calibration_blocks,
    kernel_kept,
    record_calibrations,
    said_overrides,
)
from microbatch.commands._schedule_inputs import ScheduleChoice
from microbatch.commands._state_flags import (
    check_layer_kernels_flag,
    check_zero3_flags,
    dropout_option,
    precision_options,
    state_settings,
)
from microbatch.commands._texts import CALIBRATION_HELP, PP_GRAD_REDUCE_HELP
from microbatch.predict.attention import ATTENTION_KERNELS
from microbatch.predict.collectives import ZERO3_IMPLS
from microbatch.predict.context import CP_EXCHANGES
from microbatch.predict.state import PIPELINE_GRAD_REDUCE, REDUCE_DTYPES

if TYPE_CHECKING:
    from microbatch.hardware import Accelerator
    from microbatch.predict.apply_calibration import AppliedCalibration
    from microbatch.predict.gemm import RooflineEfficiency
    from microbatch.predict.plan import Plan, PlanConfig

__all__ = ["cmd"]


@click.command("plan")
@model_options
@click.option("--gpu", required=True, help="Accelerator name, or several separated by commas to compare.")
@click.option(
    "--global-batch",
    "-B",
    "global_batch",
    type=int,
    callback=check_batch_bound,
    required=True,
    help="B_global (held fixed).",
)
@click.option(
    "--data-parallel",
    "-d",
    "data_parallel",
    type=int,
    callback=check_batch_bound,
    default=1,
    show_default=True,
    help="d.",
)
@stages_option(required=False, default=1)
@click.option("--tensor-parallel", "-t", "tensor_parallel", type=int, default=1, show_default=True, help="t.")
@moe_options
@click.option("--sequence-parallel", is_flag=True, help="Megatron sequence parallelism (needs t > 1).")
@click.option(
    "--schedule", type=ScheduleChoice(("auto",)), default="auto",
    show_default=True,
)  # fmt: skip
@click.option(
    "--virtual", "-v", type=int, help="Only this v for interleaved 1F1B (default: every v that fits)."
)
@click.option(
    "--recompute",
    type=click.Choice(["auto", "none", "selective", "full", "op"]),
    default="auto",
    show_default=True,
    help="auto searches none, selective and full; op is torchtitan's per-op selective recompute.",
)
@click.option(
    "--async-tp", "async_tp", is_flag=True, help="TP collectives overlapped with their GEMMs (needs SP)."
)
@click.option(
    "--ep-overlap", "ep_overlap", is_flag=True,
    help="MoE all-to-all hidden behind another micro-batch's compute in every schedule (dualpipev always does).",
)  # fmt: skip
@click.option(
    "--zero", type=click.Choice(["auto", "0", "1", "2", "3", "dist-opt"]), default="auto", show_default=True
)
@click.option(
    "--micro-batch",
    "-b",
    "micro_batch",
    type=int,
    callback=check_batch_bound,
    help="Only this b_m (default: every divisor of B/d).",
)
@precision_options
@click.option("--flash-attention/--no-flash-attention", "flash", default=None, help="Default: the model's.")
@dropout_option
@click.option(
    "--compile", "compiled", is_flag=True,
    help="torch.compile: activations, softmax, dropout and the optimizer at the streaming rate, the norms at compiled "
    "code's measured 0.445 of the bandwidth (its backward's reductions), not eager.",
)  # fmt: skip
@click.option(
    "--fused-kernels", "fused_kernels", is_flag=True,
    help="Hand-written fused kernels (Megatron's, Transformer Engine's, apex's: norms, bias-activation, softmax, "
    "Adam): all at the streaming rate, not eager.",
)  # fmt: skip
@click.option(
    "--parallel-block/--sequential-block", "parallel_block", default=None,
    help="Attention and MLP in parallel (GPT-J, GPT-NeoX, PaLM): one TP all-reduce per layer and pass; default: the "
    "model's (on for a --hf-config that says so: use_parallel_residual, parallel_attn, GPT-J, Phi).",
)  # fmt: skip
@click.option(
    "--zero3-impl", "zero3_impl", type=click.Choice(list(ZERO3_IMPLS)), default="fsdp2",
    show_default=True,
    help="Who runs ZeRO-3: fsdp2 (fully_shard, torchtitan) copies each gathered layer out on the compute "
    "stream; fsdp1, deepspeed and megatron (its FSDP) compute from the gathered buffer. With -p > 1, ZeRO 2/3 "
    "is FSDP under torch's pipelining whatever this says (DeepSpeed and Megatron take ZeRO <= 1 there).",
)  # fmt: skip
@click.option(
    "--reduce-dtype", "reduce_dtype", type=click.Choice(list(REDUCE_DTYPES)), default="auto", show_default=True,
    help="What ZeRO-3's reduce-scatter moves: auto is fp32 under fsdp2 (torchtitan's mixed_precision_reduce, and "
    "under a pipeline) and the gradients' own dtype otherwise; half for FSDP2 with reduce_dtype=bf16.",
)  # fmt: skip
@click.option(
    "--pp-grad-reduce", "pipeline_grad_reduce", type=click.Choice(list(PIPELINE_GRAD_REDUCE)), default="last",
    show_default=True, help=PP_GRAD_REDUCE_HELP,
)  # fmt: skip
@click.option(
    "--cp-comm", "cp_comm", type=click.Choice(list(CP_EXCHANGES)), default="allgather", show_default=True,
    help="With -c: how K/V reach the c ranks. allgather: one all-gather hidden only behind the local 1/c of "
    "attention (torch context_parallel, torchtitan's default, Llama 3); ring: a send per step behind each "
    "step (Megatron --cp-comm-type p2p, torchtitan rotate method alltoall); ulysses: all-to-alls give each "
    "rank whole sequences of a/c heads, exposed (DeepSpeed Ulysses, Megatron --cp-comm-type a2a; t·c must "
    "divide the heads).",
)  # fmt: skip
@click.option(
    "--attention-kernel", "attention_kernel", type=click.Choice(list(ATTENTION_KERNELS)), default="sdpa",
    show_default=True,
    help="Flash kernel class: sdpa (PyTorch's, as the accelerator row measured it; on an A100 FA2's own figures, "
    "0.694), fa2 (the flash-attn 2 package, and PyTorch's SDPA of 2024, whose flash backend it is: 0.354 of an "
    "H100's peak; on an A100 the same as sdpa), cudnn (cuDNN's "
    "fused attention, Transformer Engine's on Hopper, as of cuDNN 9.19: 0.716 at a 2.3x longer ramp), cudnn-2024 (the "
    "same in 2024's containers: 0.570), fa3 (FlashAttention-3: 0.625), triton (the Triton "
    "flash kernel, llm-foundry's attn_impl triton: 0.296 of an A100's), efficient (SDPA's memory-efficient backend, "
    "causal, where flash cannot run: 0.347 of an A100's; an explicit mask, as padded Hugging Face batches pass, "
    "costs about twice that and is not modelled). On a B200 sdpa and cudnn are cuDNN's 0.636 at a 7.4x longer ramp "
    "(torch picks cuDNN there from NGC 25.09 or pip 2.11; older builds run fa2: 0.182 at 3.1x). fa2 on Hopper, A100 "
    "and B200 rows, cudnn on Hopper and B200, cudnn-2024 and fa3 on Hopper, triton/efficient on A100 rows only; --gpu-set "
    "attention_fraction=F (and attention_ramp=K) overrides.",
)  # fmt: skip
@click.option(
    "--layers-per-stage",
    help="Uneven split, e.g. 7,8,8,7 (every candidate is simulated; interleaved 1F1B spreads each stage's "
    "layers over its v chunks, v at most the fewest layers on a stage).",
)
@click.option(
    "--memory-headroom", type=float, default=None, help="Share of device memory kept free (default 0.1)."
)
@click.option(
    "--gpu-set",
    "gpu_set",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override an accelerator figure, e.g. inter_node_bytes_per_s=25e9 or bf16=250e12 (repeatable); "
    "power_limit_w=500 also lowers the clock GEMMs hold (f ∝ (P − P0)^(1/3)) unless sustained_clock_fraction is given.",
)
@click.option(
    "--grad-clip/--no-grad-clip", "grad_clip", default=True, show_default=True,
    help="Gradients clipped by their global norm each step (Megatron, torch's clip_grad_norm_, DeepSpeed, the "
    "HF Trainer do by default): three passes over the gradients the rank updates.",
)  # fmt: skip
@click.option(
    "--dp-overlap/--no-dp-overlap", "dp_overlap", default=True, show_default=True,
    help="Gradient all-reduce behind the last backward (PyTorch DDP) or after it (Megatron-LM's local DDP).",
)  # fmt: skip
@click.option(
    "--choose", type=click.Choice(["knee", "fastest"]), default="knee", show_default=True,
    help="knee: least memory within 15% (and a 5% margin) of the fastest, as tune chooses; fastest: the fastest that fits.",
)  # fmt: skip
@click.option("--all", "all_rows", is_flag=True, help="Table of the best candidates instead of one per b_m.")
@click.option("--calibration", type=click.Path(dir_okay=True), help=CALIBRATION_HELP)
@json_option
def cmd(
    model_spec: dict[str, Any], moe_spec: dict[str, Any], gpu: str, global_batch: int, data_parallel: int, stages: int, tensor_parallel: int,
    sequence_parallel: bool, schedule: str, virtual: int | None, recompute: str, zero: str, micro_batch: int | None,
    precision: str, grad_dtype: str, optimizer: str, moments_dtype: str, master_weights: str, loss_dtype: str, loss_kernel: str | None, layer_kernels: str, flash: bool | None, dropout: bool | None, compiled: bool, fused_kernels: bool,
    parallel_block: bool | None, zero3_impl: str, reduce_dtype: str, pipeline_grad_reduce: str, cp_comm: str, attention_kernel: str, layers_per_stage: str | None,
    memory_headroom: float | None, async_tp: bool, ep_overlap: bool, gpu_set: tuple[str, ...], grad_clip: bool, dp_overlap: bool, choose: str, all_rows: bool,
    calibration: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Enumerate b_m, schedule, v, recompute and ZeRO; recommend the knee (or the fastest) that fits.

    \b
    Example: microbatch plan --model llama-2-7b --gpu a100-80gb --global-batch 64 -p 4
    Compare accelerators: --gpu a100-40gb,a100-80gb,h100-sxm
    Mixture of experts: --model deepseek-v3 --gpu h100-80gb -B 4096 -d 128 -p 16 -e 64
    """
    from microbatch.commands._common import parse_split, parse_zero
    from microbatch.hardware import DEFAULT_HEADROOM
    from microbatch.predict.plan import PlanConfig

    expert_shape, expert_layout = moe_split(moe_spec, precision)
    _check_cp_comm(cp_comm, expert_layout["context_parallel"])
    check_zero3_flags(zero3_impl, zero, stages)
    kernels_flag = "--compile" if compiled else "--fused-kernels" if fused_kernels else None
    check_layer_kernels_flag(layer_kernels, calibration, kernels_flag)
    state = state_settings(precision, grad_dtype, optimizer, moments_dtype, master_weights, loss_dtype, loss_kernel, layer_kernels)  # fmt: skip
    shape = resolve_model({**model_spec, **expert_shape})
    if dropout is not None:
        shape = replace(shape, dropout=dropout)
    efficiency = _elementwise(compiled, fused_kernels)
    gpus = _accelerators(gpu, attention_kernel, flash, gpu_set)
    cfg = PlanConfig(
        shape=shape,
        gpu=gpus[0],
        global_batch=global_batch,
        data_parallel=data_parallel,
        pipeline_parallel=stages,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        schedules=None if schedule == "auto" else (schedule,),
        virtuals=(virtual,) if virtual is not None else None,
        recompute=None if recompute == "auto" else (recompute,),
        zero=None if zero == "auto" else (parse_zero(zero),),
        micro_batches=(micro_batch,) if micro_batch is not None else None,
        layers_per_stage=parse_split(layers_per_stage),
        **state,
        flash_attention=flash,
        memory_headroom=DEFAULT_HEADROOM if memory_headroom is None else memory_headroom,
        choose=choose,
        dp_overlap=dp_overlap,
        grad_clip=grad_clip,
        async_tp=async_tp,
        ep_overlap=ep_overlap,
        parallel_block=parallel_block,
        cp_comm=cp_comm,
        zero3_impl=zero3_impl,
        reduce_dtype=reduce_dtype,
        pipeline_grad_reduce=pipeline_grad_reduce,
        efficiency=efficiency,
        **expert_layout,
    )
    plans, applied = _plans(cfg, gpus, calibration, attention_kernel != "sdpa", loss_kernel)
    out, render = _answer(plans, applied, all_rows)
    priced = None if calibration or kernels_flag else layer_kernels
    notes = shared_override(gpu_set, gpus) + hf_config_notes(model_spec, shape, priced)
    render = answer_notes(plans, out, render, notes)
    record_calibrations(out, applied)

    nothing_fits = all(pl.recommended is None for pl in plans)
    why = _nothing_fits(plans) + _seq_hint(model_spec, cfg.seq_len) if nothing_fits else None
    if why is not None:  # one object: the plan kept, the error in it, a kind of its own (not a typo's)
        out = {**out, "error": why, "kind": "does_not_fit"}
    emit(out, as_json, render)
    if why is not None:
        click.echo(f"error: {why}", err=True)
        raise click.exceptions.Exit(2)


def _seq_hint(model_spec: dict[str, Any], seq: int) -> str:
    """Where nothing fits a Hugging Face config planned at its longest sequence (no ``--seq``: its
    ``max_position_embeddings``, 131,072 for Llama 3.2 1B), a clause saying so and naming ``--seq``."""
    if model_spec.get("hf_config") is None or model_spec.get("seq") is not None:
        return ""
    return f"; planned at s = {seq:,}, the config's longest sequence (no --seq): give --seq with your data's length"


def _check_cp_comm(cp_comm: str, context_parallel: int) -> None:
    """A ConfigError when ``--cp-comm`` was given (click's parameter source: not its default) with no context
    parallelism: it would change nothing, so it is refused, as ``--fp8-recipe`` without FP8 is."""
    from microbatch.commands._schedule_inputs import user_gave
    from microbatch.errors import ConfigError

    if user_gave("cp_comm") and context_parallel == 1:
        raise ConfigError(
            f"cp_comm {cp_comm} is how context-parallel ranks exchange keys and values, and context_parallel is 1 "
            "(no exchange: it would change nothing); give context_parallel 2 or more with it, or drop cp_comm",
            params=("cp_comm", "context_parallel"),
        )


def _elementwise(compiled: bool, fused_kernels: bool) -> RooflineEfficiency:
    """The default efficiency with ``--compile`` (torch.compile: the norms at its measured rate) or
    ``--fused-kernels`` (hand-written: the streaming rate); both at once refused."""
    from microbatch.errors import ConfigError
    from microbatch.predict.gemm import COMPILED_NORM_MEMORY, DEFAULT_EFFICIENCY

    if compiled and fused_kernels:
        raise ConfigError(
            "--compile (torch.compile's generated kernels) and --fused-kernels (hand-written ones) describe different "
            "code; give the one the run uses"
        )
    return replace(
        DEFAULT_EFFICIENCY,
        fused_elementwise=compiled or fused_kernels,
        fused_norm_memory=COMPILED_NORM_MEMORY if compiled else None,
    )


def _accelerators(
    gpu: str, attention_kernel: str, flash: bool | None, gpu_set: tuple[str, ...]
) -> list[Accelerator]:
    """The ``--gpu`` rows at ``--attention-kernel``'s ceiling, then ``--gpu-set`` over any figure; a kernel class
    named with ``--no-flash-attention`` is refused (the classes are flash kernels)."""
    from microbatch.errors import ConfigError
    from microbatch.hardware import parse_gpus
    from microbatch.hardware_overrides import parse_overrides
    from microbatch.predict.attention import kernel_figures

    if flash is False and attention_kernel != "sdpa":
        raise ConfigError(
            f"--attention-kernel {attention_kernel} names a flash kernel, and --no-flash-attention runs the scores "
            "through memory; drop one of the two"
        )
    gpus = []
    for g in parse_gpus(gpu):
        ceiling, ramp = kernel_figures(attention_kernel, g.name, g.attention_fraction, g.attention_ramp)
        g = g.with_overrides(attention_fraction=ceiling, attention_ramp=ramp)
        if attention_kernel != "sdpa":  # the row's source names the figures it now runs at
            g = replace(
                g,
                source=f"{g.source}; --attention-kernel {attention_kernel}: ceiling {ceiling} at ramp {ramp}",
            )
        gpus.append(g)
    if gpu_set:  # after the kernel class: --gpu-set overrides any figure
        overrides = parse_overrides(gpu_set)
        gpus = [g.with_overrides(**overrides) for g in gpus]
    return gpus


def _nothing_fits(plans: list[Plan]) -> str:
    """The refusal when no accelerator fits: the one plan's headline, or each accelerator's, named."""
    from microbatch.show.plan_report import plan_advice

    heads = [(pl.config.gpu.name, (plan_advice(pl) or ["nothing fits"])[0]) for pl in plans]
    if len(heads) == 1:
        return heads[0][1]
    return "no accelerator fits: " + "; ".join(f"on {name}, {head}" for name, head in heads)


PLAN_HEARTBEAT_S = 5.0
"""Seconds of search before ``plan`` says it is still at it (most plans answer in under a second)."""


def _plans(
    cfg: PlanConfig, gpus: list[Accelerator], calibration: str | None, named_kernel: bool = False,
    loss_kernel: str | None = None,
) -> tuple[list[Plan], list[AppliedCalibration]]:  # fmt: skip
    """:func:`_planned`, said on stderr every :data:`PLAN_HEARTBEAT_S` of search (a search of many b_m, stages or
    accelerators takes seconds)."""
    from microbatch.commands._heartbeat import Heartbeat

    which = "the candidates" if len(gpus) == 1 else f"the candidates of {len(gpus)} accelerators"
    with Heartbeat(f"plan: searching {which}", "plan: still searching", every_s=PLAN_HEARTBEAT_S):
        return _planned(cfg, gpus, calibration, named_kernel, loss_kernel)


def _planned(
    cfg: PlanConfig, gpus: list[Accelerator], calibration: str | None, named_kernel: bool = False,
    loss_kernel: str | None = None,
) -> tuple[list[Plan], list[AppliedCalibration]]:  # fmt: skip
    """One plan per accelerator, each with ``calibration`` applied when one is given. With ``named_kernel`` (an
    ``--attention-kernel`` other than sdpa) the rows keep that kernel's attention figures: a calibration measures
    PyTorch's SDPA, not the kernel named. A calibrated plan prices ``loss_kernel``, or when None the loss the
    calibration measured."""
    from microbatch.predict.plan import compare_gpus

    shape, precision = cfg.shape, cfg.precision
    global_batch, data_parallel = cfg.global_batch, cfg.data_parallel
    tensor_parallel, stages = cfg.tensor_parallel, cfg.pipeline_parallel
    applied: list[AppliedCalibration] = []
    if calibration:
        from microbatch.batch import check_data_parallel
        from microbatch.predict.apply_calibration import PlannedLayout, apply_calibration
        from microbatch.predict.plan import make_plan

        layout = PlannedLayout(
            seq=cfg.seq_len,
            micro_batches=cfg.micro_batches or (check_data_parallel(global_batch, data_parallel),),
            tensor_parallel=tensor_parallel,
            pipeline_parallel=stages,
            data_parallel=data_parallel,
            zero=cfg.zero[0] if cfg.zero is not None and len(cfg.zero) == 1 else None,
        )
        applied = [
            said_overrides(
                apply_calibration(calibration, shape=shape, precision=precision, gpu=g, layout=layout),
                cfg.efficiency, named_kernel,
            )
            for g in gpus
        ]  # fmt: skip
        plans = [
            make_plan(
                replace(
                    cfg,
                    gpu=kernel_kept(a.accelerator, g) if named_kernel else a.accelerator or g,
                    memory_calibration=a.memory,
                    loss_kernel=loss_kernel or a.calibration.loss_kernel,
                    efficiency=replace(
                        a.efficiency,
                        fused_elementwise=cfg.efficiency.fused_elementwise,
                        fused_norm_memory=cfg.efficiency.fused_norm_memory,
                    ),  # fmt: skip
                )
            )  # fmt: skip
            for g, a in zip(gpus, applied, strict=True)
        ]
    else:
        plans = compare_gpus(cfg, gpus)
    return plans, applied


def _answer(
    plans: list[Plan], applied: list[AppliedCalibration], all_rows: bool
) -> tuple[dict[str, Any], Callable[[], str]]:
    """The JSON answer and its text: one plan, or the plans side by side."""
    from microbatch.commands._flags import flag_for
    from microbatch.show.plan_report import (
        comparison_records,
        comparison_rows,
        explain,
        plan_dict,
        render_plan,
        text_table,
    )

    cal_lines = calibration_blocks(plans, applied)
    words = {p: flag_for(p, "plan") for p in ("zero", "choose")}  # the settings a sentence names
    if len(plans) == 1:
        out = {**plan_dict(plans[0], words=words), "explanation": explain(plans[0], words=words)}

        def render() -> str:
            return render_plan(plans[0], all_rows=all_rows, words=words) + "".join(
                "\n" + x for x in cal_lines
            )
    else:
        records = comparison_records(plans)
        rows = comparison_rows(records)
        out = {
            "plans": [
                {**plan_dict(pl, words=words), "explanation": explain(pl, words=words)} for pl in plans
            ],
            "comparison": records,
        }

        def render() -> str:
            parts = [render_plan(pl, all_rows=all_rows, words=words) + "\n" for pl in plans]
            parts += ["side by side (same model, layout and B_global)", text_table(rows)] + cal_lines
            return "\n".join(parts)

    return out, render


def answer_notes(
    plans: list[Plan], out: dict[str, Any], render: Callable[[], str], notes: list[str]
) -> Callable[[], str]:
    """``render`` with the rebalance lines and ``notes`` after it; ``notes`` and each ``rebalance`` in ``out``."""
    render = rebalance_notes(plans, out, render)
    if notes:
        out["notes"] = notes
        render = with_notes(render, notes)
    return render
