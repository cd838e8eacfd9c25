"""Close the loop: calibrate the planner from measured points, and state its error.

A calibration file holds points measured on one implementation (``micro_batch``,
``throughput``, ``peak_memory_bytes``, ``step_time_s`` — the rows ``recommend`` reads) plus what
they were measured with: model, sequence length, precision, checkpointing, device. A ``tune
--out DIR`` ``result.json`` has all of it. From it this module fits two corrections and nothing
else; the analytic model stays the model (its terms are **scaled, not replaced**), so a
calibration made at one sequence length or parallel layout still informs another.

**Memory** (:func:`fit_memory_calibration`). Activations are linear in b_m (Korthikanti et al.
2022), so the analytic peak of one device is ``M_a(b) = S + a·b`` (S: weights, gradients and
optimizer state; a: the analytic activation bytes per sequence at this s, precision and
recompute mode). A least-squares line through the measured peaks, ``M(b) = α + β·b``, gives

    activation_scale = β / a          fixed_bytes = α − S

(:class:`~microbatch.predict.memory.MemoryCalibration`): the scale multiplies every activation term the
planner computes (at any s, t, p, schedule), the fixed bytes are added to every stage. They
absorb the allocator's rounding and cache, buffers the analytic terms omit, the CUDA context,
and on the CPU the whole Python + torch runtime (the peak RSS of the process). Assumed: the
implementation's activation bytes are proportional to the analytic ones *term by term*, so a
scale measured at one s holds at another; terms that are quadratic in s (attention scores
without flash attention) or specific to a layout (tensor-parallel splits, in-flight counts)
are extrapolated, and :func:`~microbatch.predict.apply_calibration.calibration_notes` says so. ``MemoryCalibration`` allows no
negative offset: a fitted ``fixed_bytes < 0`` (the analytic state overcounts) is clamped to 0
and the clamp is noted.

**Kernel efficiency** (:func:`fit_efficiency`). The roofline (:mod:`microbatch.predict.roofline`) of a
training micro-step on one device is

    T(b) = L·(3·compute_layer + 2·tp_comm) [+ L·forward_layer with full recompute] + 3·logits

(backward ≈ 2 × forward, the planner's rule), at rows = b_m·s, where every compute-bound kernel
runs at ``gemm(rows) = gemm_max·rows/(rows + half_rows)`` of the accelerator's peak
(:class:`~microbatch.predict.roofline.RooflineEfficiency`). The efficiency enters T(b) only through the
number gemm(rows_b), so each measured point has exactly one efficiency e_b that makes the
roofline equal the measured time (found by bisection; memory-bound kernels keep the default
bandwidth efficiency). Since

    1/e = 1/gemm_max + (half_rows/gemm_max) · 1/rows

1/e_b is a line in 1/rows: weighted least squares (relative error) gives gemm_max = 1/c₀ and
half_rows = c₁/c₀. A constant per-step overhead (launches, Python) is exactly this ramp.
Clamps: gemm_max ≤ 1 (a measured point faster than the peak means the accelerator's peak is
too low), half_rows ≥ 0 (an efficiency that falls with rows, as CPU caches spill, keeps the
mean instead). The efficiency is relative to the accelerator it was fitted against and only
transfers to that accelerator, at the clock it was fitted at (:attr:`Calibration.sustained_clock_fraction`,
restored by :func:`~microbatch.predict.apply_calibration.calibrated_accelerator` when the table's has changed).

**The CPU.** The planner's accelerators are GPUs; a CPU gets an :class:`Accelerator` built from
a quick measured fp32 matmul peak and copy bandwidth (:func:`~microbatch.measure.cpu.measure_cpu`),
or from figures given (:func:`~microbatch.hardware.cpu_accelerator`); where the measurements are
faster than that peak allows (a busy machine understates it), :func:`cover_measurements` doubles
it for a fit until the fit needs no clamp, and says so (``validate`` raises it for each fit from that
fit's own points and keeps the given, recorded or measured peak for the uncalibrated prediction,
which is far off on a CPU: no runtime in the memory); the calibrated one absorbs both the choice of
peak and the runtime.

Reading the measured points is :func:`microbatch.records.read_measurements`; the step-time rule
is :mod:`microbatch.predict.steptime`'s; applying a calibration to a plan (checking it is for the
planned model, saying what it extrapolates) is :mod:`microbatch.predict.apply_calibration`. How
well this predicts the measured points themselves (uncalibrated, from the smallest probes,
leave-one-out) is :mod:`microbatch.predict.validation`. A kernel microbenchmark (``bench-gpu``) calibrates
otherwise: its measured kernel times replace the analytic terms instead of scaling them
(:mod:`microbatch.predict.kernel_calibration`, applied by the same ``apply_calibration``).

Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from microbatch.errors import ConfigError, plain_numbers
from microbatch.fit import fit_line
from microbatch.hardware import Accelerator
from microbatch.hardware_clocks import MAX_CLOCK_FRACTION
from microbatch.model import ModelShape
from microbatch.precision import check_loss_kernel, get_precision
from microbatch.predict.latency import latency_bound
from microbatch.predict.memory import MemoryCalibration
from microbatch.predict.memory_fit import (
    MEASURED_LOSS_KERNEL,
    MIN_POINTS,
    analytic_memory_line,
    fit_memory_calibration,
    need_points,
    predict_memory_bytes,
)
from microbatch.predict.roofline import DEFAULT_EFFICIENCY, RooflineEfficiency
from microbatch.predict.saved_calibration import (
    EAGER_OPTIMIZER_FIELD,
    check_saved,
    clock_basis,
    saved_efficiency,
)
from microbatch.predict.steptime import predict_step_time_s
from microbatch.records import MeasuredPoint, Measurements, read_measurements

__all__ = [
    "MIN_POINTS",
    "MEASURED_LOSS_KERNEL",
    "MeasuredPoint",
    "Measurements",
    "Calibration",
    "read_measurements",
    "cover_measurements",
    "predict_memory_bytes",
    "predict_step_time_s",
    "analytic_memory_line",
    "need_points",
    "fit_memory_calibration",
    "point_efficiency",
    "fit_efficiency",
    "clock_basis",
    "calibrate",
]


# -- accelerators --------------------------------------------------------------------------------
def cover_measurements(
    acc: Accelerator, meas: Measurements, *, max_doublings: int = 10
) -> tuple[Accelerator, str]:
    """``acc`` with its peak doubled until the fitted efficiency needs no clamp (every point and the
    fitted gemm_max below 1).

    For a CPU's nominal accelerator only: a matmul timed on a busy machine can understate the peak,
    and an efficiency cannot exceed 1. Returns (accelerator, note; "" when unchanged). The
    calibrated efficiency is relative to the peak it was fitted at, so a calibrated prediction is read at that
    raised peak; an uncalibrated one keeps the peak it was given.
    """
    dt = get_precision(meas.precision).compute_dtype
    seq, prec, ckpt = meas.seq, meas.precision, meas.checkpointing
    pts = [p for p in meas.points if p.step_time_s is not None]

    def too_low(a: Accelerator) -> bool:
        if len({p.micro_batch for p in pts}) < MIN_POINTS:
            return any(
                point_efficiency(
                    meas.shape, p.micro_batch, p.step_time_s or 0.0, a, seq=seq, precision=prec, checkpointing=ckpt
                ) >= 1.0
                for p in pts
            )  # fmt: skip
        _, details, _ = fit_efficiency(meas.shape, pts, a, seq=seq, precision=prec, checkpointing=ckpt)
        return bool(details["gemm_max_unclamped"] > 1.0 or max(details["point_efficiency"].values()) >= 1.0)

    k = 0
    while k < max_doublings and pts and too_low(acc):
        peak = 2 * acc.flops(dt)
        acc = acc.with_overrides(bf16=peak, fp16=peak, fp32=peak)
        k += 1
    if not k:
        return acc, ""
    note = f"a measured point was faster than the roofline at this peak: peak raised ×{2**k}"
    return replace(acc, source=f"{acc.source}; {note}"), note


def point_efficiency(
    shape: ModelShape,
    micro_batch: int,
    step_time_s: float,
    acc: Accelerator,
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    memory_efficiency: float = DEFAULT_EFFICIENCY.memory,
) -> float:
    """The GEMM efficiency e in (0, 1] at which the roofline equals the measured micro-step time.

    Bisection on log e (the roofline time falls monotonically as e grows); 1.0 when even the full
    peak is slower than measured (the accelerator's peak is too low for this measurement). A pure function of its
    arguments, kept (:data:`_POINT_EFFICIENCIES`): ``validate`` fits on every leave-one-out subset, which asked for
    each point's 80 roofline evaluations again in every fit (100 points 83 s, quadratic; a helper's run).
    """
    key = (shape, micro_batch, step_time_s, repr(acc), seq, precision, checkpointing, memory_efficiency)
    kept = _POINT_EFFICIENCIES.get(key)
    if kept is None:
        if len(_POINT_EFFICIENCIES) >= _POINT_EFFICIENCIES_MAX:
            _POINT_EFFICIENCIES.clear()
        kept = _POINT_EFFICIENCIES[key] = _point_efficiency(
            shape, micro_batch, step_time_s, acc, seq, precision, checkpointing, memory_efficiency
        )
    return kept


_POINT_EFFICIENCIES: dict[tuple[Any, ...], float] = {}
""":func:`point_efficiency`'s answers, by its arguments (the accelerator by its ``repr``: a dataclass with dicts)."""

_POINT_EFFICIENCIES_MAX = 4096
"""Answers kept before the table starts again (each a float and its key)."""


def _point_efficiency(
    shape: ModelShape, micro_batch: int, step_time_s: float, acc: Accelerator, seq: int | None, precision: str,
    checkpointing: bool, memory_efficiency: float,
) -> float:  # fmt: skip
    """:func:`point_efficiency`'s bisection."""

    def t(e: float) -> float:
        eff = replace(DEFAULT_EFFICIENCY, gemm_max=e, memory=memory_efficiency, half_rows=0.0)
        return predict_step_time_s(
            shape, micro_batch, acc, seq=seq, precision=precision, checkpointing=checkpointing, efficiency=eff
        )

    if t(1.0) >= step_time_s:
        return 1.0
    lo, hi = math.log(1e-9), 0.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if t(math.exp(mid)) > step_time_s:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def fit_efficiency(
    shape: ModelShape,
    points: Sequence[MeasuredPoint],
    acc: Accelerator,
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    source: str = "calibration",
) -> tuple[RooflineEfficiency, dict[str, Any], list[str]]:
    """(efficiency, details, notes): 1/e_b = c₀ + c₁/rows by relative least squares (module docstring)."""
    s = seq or shape.seq
    pts = [p for p in points if p.step_time_s is not None]
    need_points("step time", [p.micro_batch for p in pts], source)
    notes: list[str] = []
    effs = [
        point_efficiency(
            shape, p.micro_batch, p.step_time_s or 0.0, acc, seq=s, precision=precision,
            checkpointing=checkpointing,
        )
        for p in pts
    ]  # fmt: skip
    if any(e >= 1.0 for e in effs):
        notes.append(
            f"measured faster than the roofline at {acc.name}'s full peak at b_m "
            f"{', '.join(str(p.micro_batch) for p, e in zip(pts, effs, strict=True) if e >= 1.0)}: its peak "
            f"({acc.flops(get_precision(precision).compute_dtype) / 1e12:.3g} TFLOP/s) is too low; efficiency clamped to 1"
        )
    xs = [1.0 / (p.micro_batch * s) for p in pts]
    ys = [1.0 / e for e in effs]
    w = [1.0 / y**2 for y in ys]  # relative error in 1/e ≈ relative error in the compute time
    c0, c1 = fit_line(xs, ys, w)
    times = [p.step_time_s or 0.0 for p in sorted(pts, key=lambda p: p.micro_batch)]
    falling = any(b <= a for a, b in zip(times, times[1:], strict=False))  # more work, no more time
    if c1 < 0:
        if not falling:
            notes.append(
                "kernel efficiency falls as rows grow (caches spill?); no ramp fitted (half_rows = 0)"
            )
        c1 = 0.0
        c0 = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sum(w)
    latency = ""
    if falling or (c1 > 0 and c0 > 0 and c1 / c0 > min(p.micro_batch for p in pts) * s):
        latency = latency_bound(shape, pts, acc, seq=s, precision=precision, checkpointing=checkpointing)
    if latency:
        # the ramp the small probes show is the host's floor, not the kernels': credit larger b_m with
        # no more than the largest probe reached
        top = max(range(len(pts)), key=lambda i: pts[i].micro_batch)
        notes.append(latency)
        c0, c1 = ys[top], 0.0
    c0_raw = c0
    if c0 < 1.0:
        notes.append(
            f"fitted gemm_max {1 / c0 if c0 > 0 else math.inf:.3g} > 1 clamped to 1: the accelerator's peak is too low"
        )
        c0 = 1.0
        c1 = max(
            0.0,
            sum(wi * x * (y - 1.0) for wi, x, y in zip(w, xs, ys, strict=True))
            / sum(wi * x * x for wi, x in zip(w, xs, strict=True)),
        )
    eff = replace(DEFAULT_EFFICIENCY, gemm_max=1.0 / c0, half_rows=c1 / c0)
    details = {
        "gemm_max_unclamped": 1.0 / c0_raw if c0_raw > 0 else math.inf,
        "point_efficiency": {str(p.micro_batch): e for p, e in zip(pts, effs, strict=True)},
        "rows": [p.micro_batch * s for p in pts],
        "latency_bound": bool(latency),
    }
    return eff, details, notes


# -- the calibration value ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What measurement taught the planner about one implementation, and where it comes from."""

    memory: MemoryCalibration
    """activation_scale (measured slope / analytic slope per sequence) and fixed_bytes (intercept − state)."""
    efficiency: RooflineEfficiency | None
    """gemm_max and half_rows fitted against ``accelerator``'s peak; None when not fitted."""
    accelerator: str
    """The accelerator the efficiency is relative to (a registry name, or ``cpu``)."""
    peak_flops: float
    """That accelerator's peak FLOP/s in the measured dtype (the efficiency's denominator, × the clock fraction)."""
    sustained_clock_fraction: float = 1.0
    """The accelerator row's ``sustained_clock_fraction`` the efficiency was fitted at (:func:`clock_basis`); in a
    file written before this field, the row's then (1 but on the H100 96 GB: ``clock_basis(legacy=True)``)."""
    model: str
    """The model's label."""
    shape: dict[str, Any]
    """The model's shape (``ModelShape.to_dict``), at the measured sequence length."""
    seq: int
    """Sequence length of the measurements."""
    precision: str
    """Precision of the measurements."""
    checkpointing: bool
    """Activation checkpointing was on."""
    device: str
    """``cpu`` or ``cuda``."""
    device_name: str = ""
    """The device's name as measured."""
    micro_batches: tuple[int, ...] = ()
    """The b_m the fits used."""
    memory_key: str = "peak_memory_bytes"
    """The measured memory figure fitted."""
    details: dict[str, Any] = field(default_factory=dict)
    """Fit details: measured line, analytic line, per-point efficiencies."""
    notes: tuple[str, ...] = ()
    """Clamps and assumptions of the fit."""
    loss_kernel: str = "fused"
    """The loss the memory scale was fitted with (:data:`MEASURED_LOSS_KERNEL` for a fit; files saved before the
    field, fused), and the one a calibrated plan prices unless told another."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        check_loss_kernel(self.loss_kernel)
        if not 0 < self.sustained_clock_fraction <= MAX_CLOCK_FRACTION:
            raise ConfigError(
                f"calibration sustained_clock_fraction {self.sustained_clock_fraction!r} is not in (0, "
                f"{MAX_CLOCK_FRACTION:g}]; give the clock fraction its efficiency was fitted at"
            )

    @property
    def n_points(self) -> int:
        return len(self.micro_batches)

    @property
    def rows_range(self) -> tuple[int, int]:
        """Smallest and largest rows b_m·s measured."""
        return (min(self.micro_batches) * self.seq, max(self.micro_batches) * self.seq)

    def model_shape(self) -> ModelShape:
        fields = {k: v for k, v in self.shape.items() if k in ModelShape.__dataclass_fields__}
        return ModelShape(**fields)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``"kind": "calibration"`` so that readers tell it from measured points."""
        return {
            "kind": "calibration",
            "memory": asdict(self.memory),
            "efficiency": asdict(self.efficiency) if self.efficiency else None,
            EAGER_OPTIMIZER_FIELD: True,
            "accelerator": self.accelerator,
            "peak_flops": self.peak_flops,
            "sustained_clock_fraction": self.sustained_clock_fraction,
            "model": self.model,
            "shape": dict(self.shape),
            "seq": self.seq,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "device": self.device,
            "device_name": self.device_name,
            "micro_batches": list(self.micro_batches),
            "n_points": self.n_points,
            "memory_key": self.memory_key,
            "details": self.details,
            "notes": list(self.notes),
            "loss_kernel": self.loss_kernel,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, label: str = "calibration") -> Calibration:
        """A calibration from :meth:`to_dict` output, checked (:func:`check_saved`); ``label`` names the file."""
        check_saved(d, label)
        try:
            eff = saved_efficiency(d)
            return cls(
                memory=MemoryCalibration(**d["memory"]),
                efficiency=RooflineEfficiency(**eff) if eff else None,
                accelerator=d["accelerator"],
                peak_flops=float(d["peak_flops"]),
                sustained_clock_fraction=float(
                    d.get("sustained_clock_fraction", clock_basis(d["accelerator"], legacy=True))
                ),
                model=d["model"],
                shape=dict(d["shape"]),
                seq=int(d["seq"]),
                precision=d["precision"],
                checkpointing=bool(d["checkpointing"]),
                device=d["device"],
                device_name=d.get("device_name", ""),
                micro_batches=tuple(int(b) for b in d.get("micro_batches", ())),
                memory_key=d.get("memory_key", "peak_memory_bytes"),
                details=dict(d.get("details", {})),
                notes=tuple(d.get("notes", ())),
                loss_kernel=d.get("loss_kernel", "fused"),  # saved before the field: fitted on the fused line
            )
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            why = f"it has no {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
            fix = "give a tune result or the calibration a plan saved"
            raise ConfigError(f"{label} is not a calibration ({why}); {fix}") from None


def calibrate(
    meas: Measurements, acc: Accelerator | None, *, micro_batches: Iterable[int] | None = None
) -> Calibration:
    """Fit memory and (when ``acc`` is given) kernel efficiency on the points at ``micro_batches`` (default: all)."""
    want = set(micro_batches) if micro_batches is not None else None
    pts = [p for p in meas.points if want is None or p.micro_batch in want]
    kw: dict[str, Any] = dict(
        seq=meas.seq, precision=meas.precision, checkpointing=meas.checkpointing, source=meas.source
    )
    mem, mdet, notes = fit_memory_calibration(meas.shape, pts, **kw)
    eff: RooflineEfficiency | None = None
    edet: dict[str, Any] = {}
    if acc is not None:
        eff, edet, enotes = fit_efficiency(meas.shape, pts, acc, **kw)
        notes = notes + enotes
    return Calibration(
        memory=mem,
        efficiency=eff,
        accelerator=acc.name if acc is not None else "",
        peak_flops=acc.flops(get_precision(meas.precision).compute_dtype) if acc is not None else 0.0,
        sustained_clock_fraction=clock_basis(acc) if acc is not None else 1.0,
        model=meas.model,
        shape={k: v for k, v in meas.shape.to_dict().items() if k != "param_count"},
        seq=meas.seq,
        precision=meas.precision,
        checkpointing=meas.checkpointing,
        device=meas.device,
        device_name=meas.device_name,
        micro_batches=tuple(p.micro_batch for p in pts),
        memory_key=meas.memory_key,
        details={**mdet, **edet},
        notes=tuple(meas.notes) + tuple(notes),
        loss_kernel=MEASURED_LOSS_KERNEL,
    )
