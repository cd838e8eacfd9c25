"""What ``plan --calibration`` says it applied: the measured terms a flag overrides said so, and with several
accelerators compared, each one's calibration under its name (split from :mod:`microbatch.commands.plan`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from microbatch.hardware import Accelerator
    from microbatch.predict.apply_calibration import AppliedCalibration
    from microbatch.predict.gemm import RooflineEfficiency
    from microbatch.predict.plan import Plan

__all__ = ["calibration_blocks", "kernel_kept", "record_calibrations", "said_overrides"]


def record_calibrations(out: dict[str, Any], applied: list[AppliedCalibration]) -> None:
    """The calibrations in the answer's JSON: the first (the one) at the top, as before, and with several accelerators
    each in its own plan (a review: the A100's, whose terms were not applied, stood for the H100's too)."""
    if not applied:
        return
    out["calibration"] = applied[0].calibration.to_dict()
    for entry, a in zip(out.get("plans", []), applied, strict=False):
        entry["calibration"] = a.calibration.to_dict()
    out["calibration_notes"] = list(dict.fromkeys(n for a in applied for n in a.notes))


def calibration_blocks(plans: list[Plan], applied: list[AppliedCalibration]) -> list[str]:
    """The lines saying what each calibration applied: one block, or one per accelerator under its name (a review:
    the blocks of two accelerators were run together with their common lines dropped, the second one headless)."""
    from microbatch.show.answers import calibration_lines

    if len(applied) <= 1:
        return [line for a in applied for line in calibration_lines(a)]
    out = []
    for plan, a in zip(plans, applied, strict=True):
        out += [f"calibration for {plan.config.gpu.name}:"] + ["  " + x for x in calibration_lines(a)]
    return out


def said_overrides(a: AppliedCalibration, eff: RooflineEfficiency, named_kernel: bool) -> AppliedCalibration:
    """``a`` with each measured term a flag overrides said so, in the text and in the JSON's ``term_sources``: an
    --attention-kernel runs at its own figures, --fused-kernels and --compile run the norms, activations and the
    optimizer at the streaming rate (a review: they were listed as measured, and dividing them by 4 moved nothing)."""
    src = dict(a.sources)
    if not src:
        return a
    if named_kernel and "attention_fraction" in src:
        src["attention_fraction"] = (
            f"the --attention-kernel's figures, not this measurement ({src['attention_fraction']})"
        )
    if eff.fused_elementwise:
        flag = "--compile" if eff.fused_norm_memory else "--fused-kernels"
        for term in ("norm_memory", "activation_memory", "optimizer_memory"):
            rate = (
                f"compiled code's {eff.fused_norm_memory:.3g} of the bandwidth"
                if term == "norm_memory" and eff.fused_norm_memory
                else "the streaming rate"
            )
            if term in src:
                src[term] = f"not used: {flag} runs it at {rate} ({src[term]})"
    details = {**a.calibration.details, "term_sources": dict(src)}
    return replace(a, sources=src, calibration=replace(a.calibration, details=details))


def kernel_kept(calibrated: Accelerator | None, named: Accelerator) -> Accelerator:
    """``calibrated`` (or ``named`` when there is none) at ``named``'s attention ceiling and ramp."""
    if calibrated is None:
        return named
    return calibrated.with_overrides(
        attention_fraction=named.attention_fraction, attention_ramp=named.attention_ramp
    )
