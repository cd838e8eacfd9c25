"""The planner's lints and advice in words, and the helpers every plan sentence shares (how the reader names a
setting, bytes in GiB). Split from :mod:`microbatch.show.plan_report`, which re-exports them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from microbatch.predict.plan_advice import (
    Advice,
    BubbleNotBuried,
    FarPastKnee,
    GlobalBatchChanged,
    HoldsEveryMicrobatch,
    Lint,
    TooFewMicrobatches,
    ZeroWithPipeline,
)
from microbatch.schedules.registry import get_spec
from microbatch.units import format_bytes

if TYPE_CHECKING:
    from microbatch.predict.candidate import Candidate

__all__ = ["Words", "advice_lines", "gib", "lint_sentence", "say"]

Words = Mapping[str, str] | None
"""How the reader names the planner's settings: parameter → its name in the caller's words (a command
passes its flags, ``{"zero": "--zero", "choose": "--choose"}``); a setting not in it keeps its parameter
name (``PlanConfig.zero``, ``PlanConfig.choose``)."""


def say(param: str, words: Words) -> str:
    return (words or {}).get(param, param)


def gib(n: float) -> str:
    """Bytes in GiB with one decimal (``"57.0 GiB"``), so that a column reads in one unit."""
    return format_bytes(n, digits=1, unit="GiB")


def _name(schedule: str) -> str:
    spec = get_spec(schedule)
    return spec.label or spec.name


def lint_sentence(lint: Lint, *, words: Words = None) -> str:
    """One pitfall (:func:`microbatch.predict.plan.lint`) as a sentence with its numbers and its fix
    (``words``: :data:`Words`)."""
    if isinstance(lint, GlobalBatchChanged):
        b, g, d = lint.micro_batch, lint.grad_accum, lint.data_parallel
        return (
            f"global batch changed: b_m {b} × g {g} × d {d} = {b * g * d} != B_global {lint.global_batch}; hold "
            "B_global fixed unless you mean to retune"
        )
    if isinstance(lint, TooFewMicrobatches):
        head = f"m = {lint.microbatches} < p = {lint.stages}: some stages never overlap; bubble {lint.bubble_pct:.0f}%; "
        if lint.per_replica is not None and lint.per_replica < lint.stages:
            return head + (
                f"B_global / d = {lint.per_replica} per replica gives m <= {lint.per_replica} at any b_m; raise "
                f"B_global to d·p = {lint.data_parallel * lint.stages} or more, or use p <= {lint.per_replica}"
            )
        return head + f"use b_m <= {lint.max_micro_batch} so that m >= p"
    if isinstance(lint, BubbleNotBuried):
        hint = ""
        if lint.better_micro_batch is not None:
            hint = (
                f"; b_m = {lint.better_micro_batch} gives m = {lint.better_microbatches} at bubble "
                f"{lint.better_bubble_pct:.0f}%"
            )
        return f"m = {lint.microbatches} < 4p = {4 * lint.stages}: the bubble ({lint.bubble_pct:.0f}%) is not buried{hint}"
    if isinstance(lint, HoldsEveryMicrobatch):
        lighter = _name(lint.lighter)
        tail = (
            f" ({lighter}: {gib(lint.lighter_peak_bytes)} at the same bubble)"
            if lint.lighter_peak_bytes is not None
            else ""
        )
        return (
            f"{_name(lint.schedule)} holds all m = {lint.microbatches} micro-batches' activations on each stage: "
            f"{gib(lint.activations_bytes)}; {lighter} holds at most p = {lint.stages}{tail}"
        )
    if isinstance(lint, ZeroWithPipeline):
        alt = lint.alternative
        tail = (
            f" (the best of those here: ZeRO {alt.zero}, {alt.schedule}, {gib(alt.peak_memory_bytes)}, "
            f"{100 * alt.tokens_per_s / lint.tokens_per_s:.0f}% of this throughput)"
            if alt
            else " (none fits at this b_m)"
            if lint.planned_low
            else f" (not planned here: {say('zero', words)} left ZeRO 0 and 1 out)"
        )
        how = (
            "FSDP without no_sync (Llama 3's), where the stage keeps its weights whole through the step and "
            "reduce-scatters each micro-batch's gradients behind its backward, keeping a shard (ZeRO 2's memory)"
            if lint.each
            else "torchtitan (FSDP with pipeline parallelism), where the stage keeps its weights and gradients "
            "whole through the step (ZeRO 1's memory) and reduce-scatters them once after the last backward, exposed"
        )
        return (
            f"ZeRO {lint.zero} with p = {lint.stages} pipeline stages runs in {how}; DeepSpeed's pipeline engine "
            "takes ZeRO 0 or 1 and Megatron-LM shards only the optimizer: "
            f"for those, plan with {say('zero', words)} 1{' (without the per-micro-batch reduction)' if lint.each else ''}"
            f"{tail}"
        )
    assert isinstance(lint, FarPastKnee)
    return (
        f"b_m = {lint.micro_batch} is far past the kernel-efficiency knee: b_m = {lint.knee} reaches "
        f"{100 * lint.knee_efficiency:.0f}% of peak (vs {100 * lint.efficiency:.0f}%) and "
        f"{100 * lint.knee_tokens_per_s / lint.tokens_per_s:.0f}% of the throughput with "
        f"{gib(lint.saved_bytes)} less activation memory"
    )


_SETTINGS = {
    "zero": "ZeRO as the planner chooses it",
    "recompute": "recompute as the planner chooses it",
    "schedules": "the schedule the planner chooses",
    "micro_batches": "b_m as the planner chooses it",
    "sequence_parallel": "sequence parallel (at tensor-parallel {})",
    "pipeline_parallel": "pipeline-parallel {}",
    "tensor_parallel": "tensor-parallel {} with sequence parallel",
    "data_parallel": "data-parallel {} with ZeRO",
}
"""How each layout change of the advice reads."""


def _gpus(c: Candidate) -> int:
    """GPUs a candidate's layout takes: t · p · d · c."""
    return c.tensor_parallel * c.pipeline_parallel * c.data_parallel * c.context_parallel


def advice_lines(advice: Advice) -> list[str]:
    """When nothing fits (:func:`microbatch.predict.plan.what_would_fit`): the headline with the smallest
    peak, then one line per layout change tried."""
    best = advice.smallest
    out = [
        f"nothing fits in {gib(advice.budget_bytes)} ({gib(advice.memory_bytes)} × (1 − headroom "
        f"{advice.headroom:g})); the smallest peak is {gib(best.peak_memory_bytes)} at b_m = {best.micro_batch}, "
        f"{best.schedule if best.pipeline_parallel > 1 else 'no pipeline'}, recompute {best.recompute}, ZeRO "
        f"{best.zero} (weights {gib(best.memory['weights'])}, "
        f"optimizer {gib(best.memory['optimizer'])}, activations {gib(best.memory['activations'])})"
    ]
    if best.peak_memory_bytes <= advice.memory_bytes:  # tight: inside the device, not its headroom
        out[0] += (
            f"; that is inside the device's {gib(advice.memory_bytes)} — it may run with nothing else on the "
            "GPU (set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation); "
            "a memory headroom of 0 plans with it"
        )
    gpus = _gpus(best)
    for a in advice.alternatives:
        label, c = _SETTINGS[a.setting].format(a.value), a.best
        if a.setting == "data_parallel":  # the stage it tried: 3 alone, or 1 under a pipeline
            label += f"-{c.zero}"
        if _gpus(c) != gpus:  # the other sizes held: the change takes more GPUs
            label += f" ({_gpus(c):,} GPUs, not {gpus:,})"
        if a.fits:
            out.append(
                f"{label} would fit: {gib(c.peak_memory_bytes)} at b_m = {c.micro_batch}"
                + (
                    f", {c.schedule}" + (f" v {c.virtual}" if c.virtual > 1 else "")
                    if a.setting in ("pipeline_parallel", "schedules")
                    else ""
                )
                + f", recompute {c.recompute}, ZeRO {c.zero}, {c.tokens_per_s:,.0f} tokens/s (its recommendation)"
            )
        else:
            out.append(f"{label}: still {gib(c.peak_memory_bytes)} at best")
    return out
