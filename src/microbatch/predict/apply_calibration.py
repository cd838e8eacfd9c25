"""Apply a calibration to a prediction: read or fit it, check it is for the planned model, and say
what the planned configuration extrapolates from it.

``memory --calibration`` and ``plan --calibration`` call :func:`apply_calibration`; the fits
themselves are :mod:`microbatch.predict.calibrate`'s. The memory corrections apply anywhere (the
analytic terms are scaled, not replaced); the kernel efficiency only on the accelerator it was
fitted against, at the clock it was fitted at (:func:`calibrated_accelerator`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError, check_positive_int, plain_numbers
from microbatch.hardware import ACCELERATORS, Accelerator, match_accelerator
from microbatch.hardware_clocks import MAX_CLOCK_FRACTION
from microbatch.microbench_record import MicrobenchResult, is_microbench
from microbatch.model import ModelShape, model_differences
from microbatch.precision import get_precision
from microbatch.predict.activations import check_recompute
from microbatch.predict.calibrate import Calibration, calibrate, clock_basis
from microbatch.predict.kernel_calibration import kernel_terms, measured_cpu_accelerator, measured_on
from microbatch.predict.memory import MemoryCalibration
from microbatch.predict.roofline import DEFAULT_EFFICIENCY, RooflineEfficiency
from microbatch.predict.state import check_zero
from microbatch.records import load_json, on_gpu, read_measurements
from microbatch.units import format_bytes

__all__ = [
    "PlannedLayout",
    "AppliedCalibration",
    "load_calibration",
    "calibration_notes",
    "calibrated_inputs",
    "calibrated_accelerator",
    "apply_calibration",
    "fixed_bytes_notes",
    "apply_microbench",
]


def load_calibration(
    source: str | Path | dict[str, Any] | list[Any],
    *,
    shape: ModelShape,
    precision: str,
    gpu: Accelerator | None = None,
    strict: bool = True,
) -> tuple[Calibration, list[str]]:
    """(calibration, warnings) for planning ``shape`` in ``precision`` (on ``gpu``, when given).

    ``source`` is a tune result (points: fitted here) or a saved :meth:`Calibration.to_dict`.
    A file for another model raises :class:`ConfigError` naming both (``strict=False``: a
    warning); another precision is a warning naming both (the analytic terms carry the dtype,
    the scale transfers approximately). Too few points raise, saying how many more are needed.
    The efficiency is fitted against ``gpu`` when the file was measured on a GPU of that name
    (or names none); a CPU file gets no efficiency here.
    """
    label = str(source) if isinstance(source, (str, Path)) else "calibration data"
    data = load_json(source, what="calibration file", fix="give a tune's result.json")
    warns: list[str] = []
    if isinstance(data, dict) and data.get("kind") == "calibration":
        cal = Calibration.from_dict(data, label=label)
        cshape = cal.model_shape()
    else:
        meas = read_measurements(data, shape=shape, label=label)
        meas = replace(meas, source=label)
        cshape = meas.shape
        acc = None
        if meas.is_cuda and gpu is not None:
            measured_on = match_accelerator(meas.device_name)
            if measured_on == gpu.name or (measured_on is None and not meas.device_name):
                acc = gpu
                if measured_on is None:
                    warns.append(f"{label} does not name its GPU; assumed it was measured on {gpu.name}")
            elif measured_on is None:  # named, but not a GPU of the table: its times say nothing of this one
                warns.append(
                    f"{label} was measured on {meas.device_name}, which is not in the accelerator table: its step "
                    f"times are not fitted against {gpu.name} (its memory terms are used); time that GPU's kernels "
                    "with bench-gpu, or tune on the plan's GPU"
                )
            else:
                acc = ACCELERATORS[measured_on]
        cal = calibrate(meas, acc)
    diff = model_differences(cshape, shape)
    if diff:
        msg = (
            f"calibration {label} was measured on model {cal.model} but the plan is for {shape.name} "
            f"({', '.join(f'{f} {getattr(cshape, f)} vs {getattr(shape, f)}' for f in diff[:4])}); "
            f"tune {shape.name} and pass that tune's result.json"
        )
        if strict:
            raise ConfigError(msg)
        warns.append(msg + "; used anyway")
    recorded = isinstance(data, dict) and (data.get("kind") == "calibration" or "model_shape" in data)
    if recorded and bool(cshape.dropout) != bool(shape.dropout):  # not geometry, but the scaled terms move
        # (a file without the shape measured names only its model: the registry's dropout is a guess there)
        warns.append(
            f"calibration {label} was measured {'with' if cshape.dropout else 'without'} dropout, the plan is "
            f"{'with' if shape.dropout else 'without'}: the activation scale is applied to the terms "
            f"{'with' if shape.dropout else 'without'} its masks (plan's dropout setting can match it)"
        )
    if cal.precision != precision:
        warns.append(
            f"calibration {label} was measured in {cal.precision} but the plan is in {precision}: the activation "
            f"scale is applied to the {precision} analytic terms (an extrapolation); measure in {precision} to be sure"
        )
    return cal, warns + list(cal.notes)


@dataclass(frozen=True, kw_only=True)
class PlannedLayout:
    """What a calibration is applied to, as far as saying what it extrapolates needs it."""

    seq: int | None = None
    """Planned sequence length; None means the calibration's own (no extrapolation in s)."""
    micro_batches: tuple[int, ...] = ()
    """Planned b_m values (the largest is compared with the largest measured)."""
    tensor_parallel: int = 1
    """t."""
    pipeline_parallel: int = 1
    """p."""
    data_parallel: int = 1
    """d."""
    zero: int | None = 0
    """ZeRO stage; None means not fixed (the plan searches several)."""
    recompute: str | None = None
    """Planned recompute mode; None means not fixed (every mode is searched)."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        if self.seq is not None:
            check_positive_int("seq", self.seq)
        for b in self.micro_batches:
            check_positive_int("micro-batch", b)
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
            check_positive_int(name.replace("_", "-"), getattr(self, name))
        if self.zero is not None:
            check_zero(self.zero)
        if self.recompute is not None:
            check_recompute(self.recompute)


def calibration_notes(
    cal: Calibration, layout: PlannedLayout = PlannedLayout(), *, gpu: Accelerator | None = None
) -> list[str]:
    """The extrapolations a planned configuration makes from ``cal``, in words (empty: none)."""
    seq = layout.seq or cal.seq
    tensor_parallel, pipeline_parallel = layout.tensor_parallel, layout.pipeline_parallel
    data_parallel, zero, recompute = layout.data_parallel, layout.zero, layout.recompute
    out = []
    if seq != cal.seq:
        out.append(
            f"calibrated at s = {cal.seq}, planned at s = {seq}: the activation scale is applied to the analytic "
            f"terms at s = {seq} (terms quadratic in s, and the efficiency at rows outside "
            f"{cal.rows_range[0]}..{cal.rows_range[1]}, are extrapolated)"
        )
    bms = sorted(set(layout.micro_batches))
    if bms and cal.micro_batches and bms[-1] > max(cal.micro_batches):
        out.append(
            f"b_m up to {bms[-1]} planned, calibrated up to {max(cal.micro_batches)}: memory extrapolated on a line "
            f"({bms[-1] / max(cal.micro_batches):.0f}× the largest probe)"
        )
    if tensor_parallel > 1 or pipeline_parallel > 1 or data_parallel > 1 or zero:
        stage = f"ZeRO {zero}" if zero is not None else "each ZeRO stage searched"
        out.append(
            f"calibrated on one device; planned with t = {tensor_parallel}, p = {pipeline_parallel}, d = "
            f"{data_parallel}, {stage}: the scale multiplies the analytic activation terms of this layout and "
            "the fixed bytes are added per stage; communication is not calibrated"
        )
    ckpt_mode = "full" if cal.checkpointing else "none"
    if recompute is not None and recompute != ckpt_mode:
        out.append(
            f"calibrated with recompute {ckpt_mode}, planned with {recompute}: the scale is applied to that mode's terms"
        )
    if gpu is not None and cal.efficiency is not None and cal.accelerator != gpu.name:
        out.append(
            f"kernel efficiency was measured on {cal.device_name or cal.accelerator} ({cal.accelerator}), the plan is for "
            f"{gpu.name}: efficiency NOT applied (the default is used); memory corrections applied"
        )
    elif gpu is not None and cal.efficiency is None:
        out.append(
            f"no kernel efficiency for {gpu.name} in this calibration (measured on {cal.device_name or cal.device}): "
            "default efficiency used; memory corrections applied"
        )
    return out + fixed_bytes_notes(cal, gpu)


def fixed_bytes_notes(cal: Calibration, gpu: Accelerator | None) -> list[str]:
    """What the calibration's fixed bytes stand for on ``gpu``: a CPU process's resident memory, measured on the
    CPU, is the CUDA context only roughly (``plan`` and ``memory`` say it the same way)."""
    if gpu is None or on_gpu(cal.device):
        return []
    return [
        f"the fixed bytes ({format_bytes(cal.memory.fixed_bytes, unit='GiB')}) were measured as a CPU process's resident "
        "memory (Python and torch included); on a GPU they stand for the CUDA context only roughly"
    ]


def calibrated_inputs(
    cal: Calibration, gpu: Accelerator
) -> tuple[MemoryCalibration, RooflineEfficiency, list[str]]:
    """(memory calibration, efficiency, notes) for ``PlanConfig(memory_calibration=..., efficiency=...)``.

    The efficiency applies only on the accelerator it was fitted against; elsewhere the default. It holds at
    the clock it was fitted at: plan on :func:`calibrated_accelerator`'s accelerator where that is not None.
    """
    if cal.efficiency is not None and cal.accelerator == gpu.name:
        return cal.memory, cal.efficiency, []
    return cal.memory, DEFAULT_EFFICIENCY, calibration_notes(cal, gpu=gpu)


def calibrated_accelerator(cal: Calibration, gpu: Accelerator) -> tuple[Accelerator | None, list[str]]:
    """(accelerator, notes): ``gpu`` at the clock ``cal``'s efficiency was fitted at; (None, []) when it is at it.

    A fitted efficiency is relative to the peak × the row's ``sustained_clock_fraction`` at fit time
    (:attr:`Calibration.sustained_clock_fraction`). Where the table's default for the row is now another (a
    file saved when every row had 1, applied to a Hopper row, which has 0.847 now), the efficiency would be
    applied on a clock it was not fitted at: the plan's step would be slower by their ratio. So the plan runs
    at ``gpu``'s fraction × stored / the row's default: the fitted basis, still scaled by a power limit or
    clock given for the plan. Only where the efficiency applies (the same accelerator, a row of the table).
    """
    row = ACCELERATORS.get(gpu.name)
    if cal.efficiency is None or cal.accelerator != gpu.name or row is None:
        return None, []
    stored, default = cal.sustained_clock_fraction, row.sustained_clock_fraction
    if math.isclose(stored, default, rel_tol=1e-9):
        return None, []
    f = gpu.sustained_clock_fraction * stored / default
    if f > MAX_CLOCK_FRACTION:
        raise ConfigError(
            f"the calibration's efficiency was fitted at clock fraction {stored:g} of {gpu.name}'s peak, whose row "
            f"has {default:g}: the plan's {gpu.sustained_clock_fraction:g} would become {f:.3g}, above "
            f"{MAX_CLOCK_FRACTION:g}; give a lower sustained_clock_fraction, or re-fit the calibration (tune)"
        )
    note = (
        f"kernel efficiency was fitted at clock fraction {stored:.3g} of {gpu.name}'s peak (its row has "
        f"{default:.3g} now): applied on that basis, at clock fraction {f:.3g}"
    )
    return replace(gpu, sustained_clock_fraction=f, source=f"{gpu.source}; {note}"), [note]


@dataclass(frozen=True, kw_only=True)
class AppliedCalibration:
    """What ``memory --calibration`` and ``plan --calibration`` pass on, and what they say about it."""

    calibration: Calibration
    """The calibration read or fitted."""
    memory: MemoryCalibration
    """For ``estimate_memory(..., calibration=)`` and ``PlanConfig(memory_calibration=)``."""
    efficiency: RooflineEfficiency
    """For ``PlanConfig(efficiency=)``: the fitted one on its own accelerator, else the default."""
    notes: tuple[str, ...]
    """Warnings (mismatches) and extrapolations, in words, for the output."""
    accelerator: Accelerator | None = None
    """The planned accelerator with measured figures (a microbenchmark's attention ceiling) or at a tune
    calibration's clock (:func:`calibrated_accelerator`); None: as given."""
    sources: dict[str, str] = field(default_factory=dict)
    """Kernel term -> where it came from (a microbenchmark's calibration); empty for a tune result."""

    def to_dict(self) -> dict[str, Any]:
        """The calibration and the notes, for a command's JSON."""
        return {"calibration": self.calibration.to_dict(), "calibration_notes": list(self.notes)}


def apply_calibration(
    source: str | Path | dict[str, Any] | list[Any],
    *,
    shape: ModelShape,
    precision: str,
    gpu: Accelerator | None = None,
    layout: PlannedLayout = PlannedLayout(),
    strict: bool = True,
) -> AppliedCalibration:
    """One call for the commands: :func:`load_calibration`, :func:`calibrated_inputs` and
    :func:`calibration_notes` for the planned model, precision, device and layout (its sequence
    length defaults to the model's)."""
    data = load_json(source, what="calibration file", fix="give a tune result or a bench-gpu result")
    inner = data.get("result", data) if isinstance(data, dict) else data
    if is_microbench(inner):
        label = str(source) if isinstance(source, (str, Path)) else "microbenchmark"
        if gpu is None:
            raise ConfigError(
                f"{label} is a kernel microbenchmark: it measures kernel times, not memory, and calibrates a "
                "step-time prediction on an accelerator; give it to plan, or give a tune result for memory"
            )
        return apply_microbench(
            MicrobenchResult.from_dict(inner, label=label),
            shape=shape,
            precision=precision,
            gpu=gpu,
            label=label,
            layout=layout,
        )
    cal, warns = load_calibration(source, shape=shape, precision=precision, gpu=gpu, strict=strict)
    eff = DEFAULT_EFFICIENCY
    acc: Accelerator | None = None
    gpu_notes: list[str] = []
    if gpu is not None:
        _, eff, gpu_notes = calibrated_inputs(cal, gpu)
        acc, clock_notes = calibrated_accelerator(cal, gpu)
        gpu_notes += clock_notes
    notes = warns + gpu_notes + calibration_notes(cal, replace(layout, seq=layout.seq or shape.seq))
    return AppliedCalibration(
        calibration=cal, memory=cal.memory, efficiency=eff, notes=tuple(dict.fromkeys(notes)), accelerator=acc
    )


def _rows_past_table(table: Any, layout: PlannedLayout, shape: ModelShape) -> list[str]:
    """A note where the plan's largest micro-batch runs GEMMs of more than twice the rows of any measured one (or
    fewer than half the fewest): their ratios are the nearest measured shape's, an extrapolation (a review: 8× the
    largest measured rows went unsaid for the file's own model)."""
    if table is None or not table.points or not layout.micro_batches:
        return []
    seq = layout.seq or shape.seq
    rows = max(layout.micro_batches) * seq
    lo, hi = min(p[0] for p in table.points), max(p[0] for p in table.points)
    if lo / 2 <= rows <= 2 * hi:
        return []
    past = int(2 * hi // seq)  # the largest b_m whose GEMMs are within twice the measured rows
    where = f"b_m above {past} at s = {seq:,}" if past >= 1 else f"every b_m at s = {seq:,}"
    return [
        f"GEMMs of {where} run more than twice the {hi:,.0f} rows measured (or under half the {lo:,.0f}): they take "
        "the nearest measured shape's ratio (an extrapolation); a microbenchmark at the plan's micro-batch and "
        "sequence measures them"
    ]


def apply_microbench(
    result: MicrobenchResult,
    *,
    shape: ModelShape,
    precision: str,
    gpu: Accelerator | None = None,
    label: str = "microbenchmark",
    layout: PlannedLayout = PlannedLayout(),
) -> AppliedCalibration:
    """A kernel microbenchmark as a calibration (:mod:`microbatch.predict.kernel_calibration`): its measured
    kernel terms for ``gpu`` (this CPU, from the file's own figures, when None and it ran on a CPU); memory
    stays analytic. The result's ``details`` carry each term's source and the GEMM ratios."""
    acc = gpu if gpu is not None else (measured_cpu_accelerator(result) if result.device == "cpu" else None)
    if acc is None:
        raise ConfigError(f"{label} was measured on {result.device_name}: give the accelerator to plan for")
    terms = kernel_terms(result, acc)
    warns: list[str] = []
    dtype = get_precision(precision).compute_dtype
    # in another dtype than measured, said where the terms are applied (elsewhere kernel_terms applies none)
    if dtype != result.dtype and measured_on(result) == acc.name:
        warns.append(
            f"{label} was measured in {result.dtype} but the plan computes in {dtype}: the measured ratios and "
            "fractions are applied to the other dtype (an extrapolation)"
        )
    other = [f"model {result.model}" if result.model and result.model != shape.name else "",
             f"s = {result.seq}" if result.seq and result.seq != shape.seq else ""]  # fmt: skip
    if any(other) and measured_on(result) == acc.name:  # bench-gpu times gpt2 by default on a GPU
        warns.append(
            f"{label} timed the layer GEMMs of {' at '.join(x for x in other if x)}, the plan is {shape.name} at "
            f"s = {shape.seq}: its shapes read the nearest measured ratios of the grid (an extrapolation); "
            f"bench-gpu of model {shape.name} times the plan's own"
        )
    table = terms.efficiency.gemm_measured
    warns += _rows_past_table(table, layout, shape)
    cal = Calibration(
        memory=MemoryCalibration(), efficiency=replace(terms.efficiency, gemm_measured=None),
        accelerator=measured_on(result), peak_flops=acc.flops(result.dtype), sustained_clock_fraction=clock_basis(acc),
        model=result.model,
        shape={k: v for k, v in shape.to_dict().items() if k != "param_count"}, seq=result.seq or shape.seq,
        precision=precision, checkpointing=False, device=result.device, device_name=result.device_name,
        micro_batches=result.micro_batches, memory_key="",
        details={
            "from": "microbench", "file": label, "term_sources": dict(terms.sources),
            "gemm_ratios": [list(p) for p in table.points] if table else [],
            "attention_fraction": terms.accelerator.attention_fraction, "torch": result.torch_version,
        },
        notes=tuple(result.notes),
    )  # fmt: skip
    notes = tuple(dict.fromkeys(warns + list(terms.notes)))
    return AppliedCalibration(
        calibration=cal, memory=cal.memory, efficiency=terms.efficiency, notes=notes,
        accelerator=terms.accelerator, sources=dict(terms.sources),
    )  # fmt: skip
