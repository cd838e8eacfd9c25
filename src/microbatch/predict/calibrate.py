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
are extrapolated, and :func:`calibration_notes` says so. ``MemoryCalibration`` allows no
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
transfers to that accelerator.

**The CPU.** The planner's accelerators are GPUs; a CPU gets an :class:`Accelerator` built from
a quick measured fp32 matmul peak and copy bandwidth (:func:`~microbatch.hardware.measure_cpu`),
or from figures given (:func:`~microbatch.hardware.cpu_accelerator`); where the measurements are
faster than that peak allows (a busy machine understates it), :func:`cover_measurements` doubles
it until the efficiency fit needs no clamp, and says so. The uncalibrated CPU prediction (80% of
that peak, no runtime in the memory) is far off; the calibrated one absorbs both the choice of
peak and the runtime.

How well this predicts the measured points themselves (uncalibrated, from the smallest probes,
leave-one-out) is :mod:`microbatch.predict.validation`.

Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError
from microbatch.fit import fit_line
from microbatch.hardware import ACCELERATORS, Accelerator, match_accelerator
from microbatch.model import ModelShape, get_model
from microbatch.predict.memory import MemoryCalibration, MemoryConfig, estimate_memory
from microbatch.predict.roofline import DEFAULT_EFFICIENCY, RooflineEfficiency, layer_forward, logits_forward

__all__ = [
    "MIN_POINTS",
    "CALIBRATION_HELP",
    "MeasuredPoint",
    "Measurements",
    "Calibration",
    "read_measurements",
    "cover_measurements",
    "predict_memory_bytes",
    "predict_step_time_s",
    "analytic_memory_line",
    "fit_memory_calibration",
    "point_efficiency",
    "fit_efficiency",
    "calibrate",
    "load_calibration",
    "calibration_notes",
    "calibrated_inputs",
    "AppliedCalibration",
    "apply_calibration",
]

MIN_POINTS = 2
"""Distinct b_m (not out of memory) a fit needs: two parameters per fit (a line)."""

CALIBRATION_HELP = (
    "Measured points: a `tune --out DIR` result.json (or DIR), or JSON with micro_batch, throughput, "
    "peak_memory_bytes, step_time_s plus model, seq, precision, checkpointing, device. Fits, for that "
    "implementation, the activation scale and fixed bytes of the memory model and the GEMM efficiency "
    "against rows b_m·s. Assumes activations linear in b_m (2+ points needed) and backward = 2× forward; "
    "the analytic terms are scaled, not replaced, so another s, layout or b_m range is an extrapolation "
    "(the output says which). The efficiency applies only on the GPU it was measured on; another model is "
    "an error, another precision a warning."
)
"""Help text of ``--calibration`` on ``memory`` and ``plan``."""

_GEOMETRY = (
    "layers", "hidden", "heads", "kv", "ffn", "vocab", "gated_mlp", "tied_embeddings", "bias", "norm",
    "learned_positions",
)  # fmt: skip
"""Fields that make two shapes the same model (name, seq, positions and training flags aside)."""


# -- the measured points -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MeasuredPoint:
    """One measured b_m, as the fits use it."""

    micro_batch: int
    """b_m."""
    peak_memory_bytes: float | None
    """Measured peak memory (the key chosen by ``memory_key``); None when not measured."""
    step_time_s: float | None
    """Measured time of one micro-step (forward + backward); None when not measured."""


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Measured points plus what they were measured with."""

    shape: ModelShape
    """The model, at the measured sequence length."""
    model: str
    """The model's label in the file."""
    precision: str
    """``fp32``, ``bf16-mixed`` or ``fp16-mixed``."""
    checkpointing: bool
    """Activation checkpointing (full recompute per layer) was on."""
    device: str
    """``cpu`` or ``cuda``."""
    device_name: str = ""
    """The device's name (GPU model), when the file says."""
    points: tuple[MeasuredPoint, ...]
    """Points that did not run out of memory, ascending b_m, one per b_m."""
    oom: tuple[int, ...] = ()
    """b_m that ran out of memory."""
    memory_key: str = "peak_memory_bytes"
    """Which measured memory figure the points hold."""
    time_key: str = "step_time_s"
    """Which measured time the points hold (``micro_step_s`` when given: without the optimizer)."""
    source: str = ""
    """Where the points came from (a path), for messages."""
    notes: tuple[str, ...] = ()
    """What reading the file assumed."""

    @property
    def seq(self) -> int:
        return self.shape.seq

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda") or self.device == "gpu"


def _shape_of(model: Any, seq: int | None, source: str) -> tuple[ModelShape | None, str]:
    """A shape from the file's ``model`` (registry name, ``hf:name``, or a ModelShape dict)."""
    if isinstance(model, dict):
        fields = {k: v for k, v in model.items() if k in ModelShape.__dataclass_fields__}
        try:
            shape = ModelShape(**fields)
        except (TypeError, ConfigError) as e:
            raise ConfigError(f"{source}: 'model' is not a model shape ({e})") from None
        return (shape.with_seq(seq) if seq else shape), shape.name
    if isinstance(model, str) and model:
        name = model[3:] if model.startswith("hf:") else model
        try:
            return get_model(name, seq=seq), model
        except ConfigError:
            return None, model
    return None, str(model or "")


def _bool_flag(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("on", "true", "yes", "1", "full"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("off", "false", "no", "0", "none"):
        return False
    return None


def read_measurements(
    source: str | Path | dict | list,
    *,
    shape: ModelShape | None = None,
    memory_key: str = "peak_memory_bytes",
    precision: str | None = None,
    device: str | None = None,
    checkpointing: bool | None = None,
) -> Measurements:
    """Measured points and their provenance from a path or an already-loaded JSON value.

    Reads a ``tune --out`` ``result.json`` (or ``tune --json``), or an object ``{"points": [...],
    "model", "seq", "precision", "checkpointing", "device"}``, or a bare list of points (then the
    provenance must come from the keyword arguments). ``shape`` is used when the file names no
    model the registry knows, and its sequence length when the file gives none. Keyword values
    fill in what the file lacks; they never override it. ``memory_key`` chooses the memory
    figure (``peak_memory_bytes``, or ``peak_allocated_bytes`` for CUDA's tensors only).
    """
    label = str(source) if isinstance(source, (str, Path)) else "calibration data"
    data = _load_json(source, label)
    if isinstance(data, list):
        data = {"points": data}
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise ConfigError(
            f"{label}: expected an object with a 'points' list (a `tune --out` result.json) or a list of "
            "points with micro_batch, throughput, peak_memory_bytes, step_time_s"
        )
    if data.get("kind") == "calibration":
        raise ConfigError(f"{label}: holds a fitted calibration, not measured points; give a tune result")
    if data.get("mode", "train") != "train":
        raise ConfigError(
            f"{label}: measured in mode {data.get('mode')!r}; calibration models training micro-steps: "
            "measure with `microbatch tune --mode train`"
        )
    notes: list[str] = []
    seq = data.get("seq")
    seq = int(seq) if isinstance(seq, (int, float)) and not isinstance(seq, bool) and seq > 0 else None
    fshape, model = _shape_of(data.get("model"), seq or (shape.seq if shape else None), label)
    if fshape is None:
        if shape is None:
            raise ConfigError(
                f"{label}: model {model or '(none)'!r} is not in the registry; give the model "
                "(--model NAME or the shape flags) it was measured with"
            )
        fshape = shape.with_seq(seq) if seq else shape
        if model:
            notes.append(f"the file's model {model!r} is not in the registry; assumed it is {shape.name}")
        model = model or shape.name
    prec = data.get("precision") or precision
    if prec is None:
        raise ConfigError(
            f"{label}: no 'precision'; say which (fp32, bf16-mixed) the points were measured in"
        )
    if prec not in ("fp32", "bf16-mixed", "fp16-mixed"):
        raise ConfigError(f"{label}: precision {prec!r} is not known; use fp32, bf16-mixed or fp16-mixed")
    dev = str(data.get("device") or device or "")
    if not dev:
        raise ConfigError(f"{label}: no 'device'; say where (cpu, cuda) the points were measured")
    ckpt = _bool_flag(data.get("checkpointing"))
    if ckpt is None and checkpointing is not None:
        ckpt = checkpointing
    rows = data["points"]
    if ckpt is None:  # "auto", or not given: the points say; keep the larger group (ties: off)
        flags = [bool(r.get("checkpointing")) for r in rows if isinstance(r, dict) and not r.get("oom")]
        ckpt = flags.count(True) > flags.count(False)
        if len(set(flags)) > 1:
            notes.append(
                f"points measured with and without checkpointing; used those with it {'on' if ckpt else 'off'}"
            )
    time_key = (
        "micro_step_s" if any(isinstance(r, dict) and r.get("micro_step_s") for r in rows) else "step_time_s"
    )
    clocks = sorted({str(r["clock"]) for r in rows if isinstance(r, dict) and r.get("clock")})
    if clocks and clocks != ["wall"]:
        notes.append(f"step times measured with clock {', '.join(clocks)} (process = the probe's CPU time)")
    points: dict[int, MeasuredPoint] = {}
    oom: list[int] = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "micro_batch" not in r:
            raise ConfigError(f"{label}: point {i + 1} has no 'micro_batch'")
        b = r["micro_batch"]
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b < 1 or b != int(b):
            raise ConfigError(f"{label}: point {i + 1}: micro_batch {b!r} must be a whole number >= 1")
        if "checkpointing" in r and bool(r["checkpointing"]) != ckpt:
            continue
        if r.get("oom"):
            oom.append(int(b))
            continue
        mem = _positive(r.get(memory_key), label, i, memory_key)
        t = _positive(r.get(time_key), label, i, time_key)
        points[int(b)] = MeasuredPoint(micro_batch=int(b), peak_memory_bytes=mem, step_time_s=t)
    return Measurements(
        shape=fshape,
        model=model,
        precision=prec,
        checkpointing=bool(ckpt),
        device=dev,
        device_name=str(data.get("device_name") or data.get("gpu") or ""),
        points=tuple(points[b] for b in sorted(points)),
        oom=tuple(sorted(set(oom))),
        memory_key=memory_key,
        time_key=time_key,
        source=label,
        notes=tuple(notes),
    )


def _load_json(source: Any, label: str) -> Any:
    if isinstance(source, (dict, list)):
        return source
    p = Path(source)
    if p.is_dir():
        p = p / "result.json"
    if not p.is_file():
        raise ConfigError(
            f"calibration file {str(source)!r} does not exist; give a `tune --out DIR` result.json"
        )
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{label}: not readable JSON ({e}); give a `tune --out DIR` result.json") from None


def _positive(v: Any, label: str, i: int, key: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{label}: point {i + 1}: {key} {v!r} must be a number > 0")
    return float(v)


# -- accelerators --------------------------------------------------------------------------------
def cover_measurements(
    acc: Accelerator, meas: Measurements, *, max_doublings: int = 10
) -> tuple[Accelerator, str]:
    """``acc`` with its peak doubled until the fitted efficiency needs no clamp (every point and the
    fitted gemm_max below 1).

    For a CPU's nominal accelerator only: a matmul timed on a busy machine can understate the peak,
    and an efficiency cannot exceed 1. Returns (accelerator, note; "" when unchanged). The
    calibrated efficiency is relative to the peak, so the choice changes only the uncalibrated figure.
    """
    dt = _dtype(meas.precision)
    kw = dict(seq=meas.seq, precision=meas.precision, checkpointing=meas.checkpointing)
    pts = [p for p in meas.points if p.step_time_s is not None]

    def too_low(a: Accelerator) -> bool:
        if len({p.micro_batch for p in pts}) < MIN_POINTS:
            return any(
                point_efficiency(meas.shape, p.micro_batch, p.step_time_s, a, **kw) >= 1.0 for p in pts
            )
        _, details, _ = fit_efficiency(meas.shape, pts, a, **kw)
        return details["gemm_max_unclamped"] > 1.0 or max(details["point_efficiency"].values()) >= 1.0

    k = 0
    while k < max_doublings and pts and too_low(acc):
        peak = 2 * acc.flops(dt)
        acc = acc.with_overrides(bf16=peak, fp16=peak, fp32=peak)
        k += 1
    if not k:
        return acc, ""
    note = f"a measured point was faster than the roofline at the measured peak: peak raised ×{2**k}"
    return acc.with_overrides(source=f"{acc.source}; {note}"), note


def _memory_config(b: int, seq: int, precision: str, checkpointing: bool) -> MemoryConfig:
    return MemoryConfig(
        micro_batch=b,
        seq=seq,
        precision=precision,
        optimizer="adamw",
        recompute="full" if checkpointing else "none",
    )


def predict_memory_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    calibration: MemoryCalibration | None = None,
) -> float:
    """Peak bytes of one device training ``shape`` at b_m with AdamW, no parallelism (:func:`estimate_memory`)."""
    cfg = _memory_config(micro_batch, seq or shape.seq, precision, checkpointing)
    return estimate_memory(shape, cfg, calibration).peak_bytes


def analytic_memory_line(
    shape: ModelShape, *, seq: int | None = None, precision: str = "bf16-mixed", checkpointing: bool = False
) -> tuple[float, float]:
    """(S, a): the analytic peak is S + a·b_m — model state S and activation bytes a per sequence.

    Exact: every activation term of :mod:`microbatch.predict.memory` is proportional to b_m.
    """
    est = estimate_memory(shape, _memory_config(1, seq or shape.seq, precision, checkpointing))
    st = est.peak_stage
    return st.weights + st.gradients + st.optimizer, st.activations


def _dtype(precision: str) -> str:
    return "fp32" if precision == "fp32" else ("fp16" if precision == "fp16-mixed" else "bf16")


def predict_step_time_s(
    shape: ModelShape,
    micro_batch: int,
    acc: Accelerator,
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY,
) -> float:
    """Roofline time of one training micro-step (forward + backward, no optimizer) on one device.

    T = L·(3·compute + 2·tp_comm) [+ L·forward with full recompute] + 3·logits, each at rows =
    b_m·s (:func:`~microbatch.predict.roofline.layer_forward`, :func:`~microbatch.predict.roofline.logits_forward`):
    backward ≈ 2 × forward, as the planner counts it. Ignores the embedding lookup and launch gaps
    (a calibrated ``half_rows`` absorbs constant overheads).
    """
    s = seq or shape.seq
    kw = dict(seq=s, dtype=_dtype(precision), efficiency=efficiency)
    lt = layer_forward(shape, micro_batch, acc, **kw)
    logits_s, _ = logits_forward(shape, micro_batch, acc, **kw)
    layer = 3 * lt.compute_s + 2 * lt.tp_comm_s + (lt.total_s if checkpointing else 0.0)
    return shape.layers * layer + 3 * logits_s


# -- fits ------------------------------------------------------------------------------------------
def _need(kind: str, have: Sequence[int], source: str, need: int = MIN_POINTS) -> None:
    if len(have) < need:
        more = need - len(have)
        raise ConfigError(
            f"{source}: fitting {kind} needs at least {need} measured b_m (not out of memory, with {kind} "
            f"measured); it has {len(have)} ({', '.join(map(str, have)) or 'none'}): measure {more} more "
            f"(e.g. `microbatch tune --out DIR` probes b_m 1, 2, 4, ...)"
        )


def fit_memory_calibration(
    shape: ModelShape,
    points: Sequence[MeasuredPoint],
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    source: str = "calibration",
) -> tuple[MemoryCalibration, dict[str, float], list[str]]:
    """(calibration, fit details, notes): activation_scale = β/a, fixed_bytes = α − S (module docstring)."""
    pts = [p for p in points if p.peak_memory_bytes is not None]
    _need("peak memory", [p.micro_batch for p in pts], source)
    alpha, beta = fit_line([p.micro_batch for p in pts], [p.peak_memory_bytes for p in pts])
    static, per_sample = analytic_memory_line(
        shape, seq=seq, precision=precision, checkpointing=checkpointing
    )
    notes = []
    if beta <= 0:
        raise ConfigError(
            f"{source}: measured peak memory does not grow with b_m (slope {beta:.3g} bytes per sequence over "
            f"b_m {', '.join(str(p.micro_batch) for p in pts)}); measure larger b_m, where activations dominate"
        )
    fixed = alpha - static
    if fixed < 0:
        notes.append(
            f"fitted fixed bytes {fixed / 2**20:,.0f} MiB < 0 (the analytic model state {static / 2**30:.2f} GiB "
            "exceeds the measured intercept); clamped to 0"
        )
    details = {
        "measured_intercept_bytes": alpha,
        "measured_slope_bytes_per_sample": beta,
        "analytic_static_bytes": static,
        "analytic_activation_bytes_per_sample": per_sample,
        "fixed_bytes_fitted": fixed,
    }
    return MemoryCalibration(activation_scale=beta / per_sample, fixed_bytes=max(0.0, fixed)), details, notes


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
    peak is slower than measured (the accelerator's peak is too low for this measurement).
    """

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
    _need("step time", [p.micro_batch for p in pts], source)
    notes: list[str] = []
    effs = [
        point_efficiency(
            shape, p.micro_batch, p.step_time_s, acc, seq=s, precision=precision, checkpointing=checkpointing
        )
        for p in pts
    ]
    if any(e >= 1.0 for e in effs):
        notes.append(
            f"measured faster than the roofline at {acc.name}'s full peak at b_m "
            f"{', '.join(str(p.micro_batch) for p, e in zip(pts, effs, strict=True) if e >= 1.0)}: its peak "
            f"({acc.flops(_dtype(precision)) / 1e12:.3g} TFLOP/s) is too low; efficiency clamped to 1"
        )
    xs = [1.0 / (p.micro_batch * s) for p in pts]
    ys = [1.0 / e for e in effs]
    w = [1.0 / y**2 for y in ys]  # relative error in 1/e ≈ relative error in the compute time
    c0, c1 = fit_line(xs, ys, w)
    if c1 < 0:
        notes.append("kernel efficiency falls as rows grow (caches spill?); no ramp fitted (half_rows = 0)")
        c1 = 0.0
        c0 = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sum(w)
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
    """That accelerator's peak FLOP/s in the measured dtype (the efficiency's denominator)."""
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

    def to_dict(self) -> dict:
        return {
            "kind": "calibration",
            "memory": asdict(self.memory),
            "efficiency": asdict(self.efficiency) if self.efficiency else None,
            "accelerator": self.accelerator,
            "peak_flops": self.peak_flops,
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
        }

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        """A calibration from :meth:`to_dict` output."""
        try:
            eff = d.get("efficiency")
            return cls(
                memory=MemoryCalibration(**d["memory"]),
                efficiency=RooflineEfficiency(**eff) if eff else None,
                accelerator=d["accelerator"],
                peak_flops=float(d["peak_flops"]),
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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"not a calibration ({type(e).__name__}: {e}); give a tune result or a saved calibration"
            ) from None


def calibrate(
    meas: Measurements, acc: Accelerator | None, *, micro_batches: Iterable[int] | None = None
) -> Calibration:
    """Fit memory and (when ``acc`` is given) kernel efficiency on the points at ``micro_batches`` (default: all)."""
    want = set(micro_batches) if micro_batches is not None else None
    pts = [p for p in meas.points if want is None or p.micro_batch in want]
    kw = dict(seq=meas.seq, precision=meas.precision, checkpointing=meas.checkpointing, source=meas.source)
    mem, mdet, notes = fit_memory_calibration(meas.shape, pts, **kw)
    eff, edet = None, {}
    if acc is not None:
        eff, edet, enotes = fit_efficiency(meas.shape, pts, acc, **kw)
        notes = notes + enotes
    return Calibration(
        memory=mem,
        efficiency=eff,
        accelerator=acc.name if acc is not None else "",
        peak_flops=acc.flops(_dtype(meas.precision)) if acc is not None else 0.0,
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
    )


def _same_model(a: ModelShape, b: ModelShape) -> list[str]:
    """Geometry fields where the two shapes differ."""
    return [f for f in _GEOMETRY if getattr(a, f) != getattr(b, f)]


def load_calibration(
    source: str | Path | dict | list,
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
    data = _load_json(source, str(source) if isinstance(source, (str, Path)) else "calibration data")
    warns: list[str] = []
    label = str(source) if isinstance(source, (str, Path)) else "calibration data"
    if isinstance(data, dict) and data.get("kind") == "calibration":
        cal = Calibration.from_dict(data)
        cshape = cal.model_shape()
    else:
        meas = read_measurements(data, shape=shape)
        meas = replace(meas, source=label)
        cshape = meas.shape
        acc = None
        if meas.is_cuda and gpu is not None:
            measured_on = match_accelerator(meas.device_name)
            if measured_on is None or measured_on == gpu.name:
                acc = gpu
                if measured_on is None:
                    warns.append(f"{label} does not name its GPU; assumed it was measured on {gpu.name}")
            else:
                acc = ACCELERATORS[measured_on]
        cal = calibrate(meas, acc)
    diff = _same_model(cshape, shape)
    if diff:
        msg = (
            f"calibration {label} was measured on model {cal.model} but the plan is for {shape.name} "
            f"({', '.join(f'{f} {getattr(cshape, f)} vs {getattr(shape, f)}' for f in diff[:4])}); "
            f"measure {shape.name} with `microbatch tune --model {shape.name} --out DIR` and pass that file"
        )
        if strict:
            raise ConfigError(msg)
        warns.append(msg + "; used anyway")
    if cal.precision != precision:
        warns.append(
            f"calibration {label} was measured in {cal.precision} but the plan is in {precision}: the activation "
            f"scale is applied to the {precision} analytic terms (an extrapolation); measure in {precision} to be sure"
        )
    return cal, warns + list(cal.notes)


def calibration_notes(
    cal: Calibration,
    *,
    seq: int,
    micro_batches: Iterable[int] = (),
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    data_parallel: int = 1,
    zero: int = 0,
    recompute: str | None = None,
    gpu: Accelerator | None = None,
) -> list[str]:
    """The extrapolations a planned configuration makes from ``cal``, in words (empty: none)."""
    out = []
    if seq != cal.seq:
        out.append(
            f"calibrated at s = {cal.seq}, planned at s = {seq}: the activation scale is applied to the analytic "
            f"terms at s = {seq} (terms quadratic in s, and the efficiency at rows outside "
            f"{cal.rows_range[0]}..{cal.rows_range[1]}, are extrapolated)"
        )
    bms = sorted(set(micro_batches))
    if bms and cal.micro_batches and bms[-1] > max(cal.micro_batches):
        out.append(
            f"b_m up to {bms[-1]} planned, calibrated up to {max(cal.micro_batches)}: memory extrapolated on a line "
            f"({bms[-1] / max(cal.micro_batches):.0f}× the largest probe)"
        )
    if tensor_parallel > 1 or pipeline_parallel > 1 or data_parallel > 1 or zero:
        out.append(
            f"calibrated on one device; planned with t = {tensor_parallel}, p = {pipeline_parallel}, d = "
            f"{data_parallel}, ZeRO {zero}: the scale multiplies the analytic activation terms of this layout and "
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
    if gpu is not None and not cal.device.startswith("cuda"):
        out.append(
            f"the fixed bytes ({cal.memory.fixed_bytes / 2**30:.2f} GiB) were measured as a CPU process's resident "
            "memory (Python and torch included); on a GPU they stand for the CUDA context only roughly"
        )
    return out


def calibrated_inputs(
    cal: Calibration, gpu: Accelerator
) -> tuple[MemoryCalibration, RooflineEfficiency, list[str]]:
    """(memory calibration, efficiency, notes) for ``PlanConfig(memory_calibration=..., efficiency=...)``.

    The efficiency applies only on the accelerator it was fitted against; elsewhere the default.
    """
    if cal.efficiency is not None and cal.accelerator == gpu.name:
        return cal.memory, cal.efficiency, []
    return cal.memory, DEFAULT_EFFICIENCY, calibration_notes(cal, seq=cal.seq, gpu=gpu)


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

    def to_dict(self) -> dict:
        return {"calibration": self.calibration.to_dict(), "calibration_notes": list(self.notes)}

    def lines(self) -> list[str]:
        """Text for a command's output: what was applied, then each note."""
        c, m = self.calibration, self.memory
        head = (
            f"calibrated from {c.model} s={c.seq} {c.precision} on {c.device_name or c.device} (b_m "
            f"{', '.join(map(str, c.micro_batches))}): activations × {m.activation_scale:.3f}, "
            f"+ {m.fixed_bytes / 2**30:.2f} GiB fixed"
        )
        if self.efficiency is c.efficiency and c.efficiency is not None:
            e = c.efficiency
            head += f"; GEMM efficiency {e.gemm_max:.2f} of peak, half of it at {e.half_rows:,.0f} rows"
        return [head] + [f"note: {n}" for n in self.notes]


def apply_calibration(
    source: str | Path | dict | list,
    *,
    shape: ModelShape,
    precision: str,
    gpu: Accelerator | None = None,
    seq: int | None = None,
    micro_batches: Iterable[int] = (),
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    data_parallel: int = 1,
    zero: int = 0,
    recompute: str | None = None,
    strict: bool = True,
) -> AppliedCalibration:
    """One call for the commands: :func:`load_calibration`, :func:`calibrated_inputs` and
    :func:`calibration_notes` for the planned model, precision, device and layout."""
    cal, warns = load_calibration(source, shape=shape, precision=precision, gpu=gpu, strict=strict)
    eff, gpu_notes = DEFAULT_EFFICIENCY, []
    if gpu is not None:
        _, eff, gpu_notes = calibrated_inputs(cal, gpu)
    notes = warns + gpu_notes
    notes += calibration_notes(
        cal, seq=seq or shape.seq, micro_batches=micro_batches, tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel, data_parallel=data_parallel, zero=zero, recompute=recompute,
    )  # fmt: skip
    return AppliedCalibration(
        calibration=cal, memory=cal.memory, efficiency=eff, notes=tuple(dict.fromkeys(notes))
    )
