"""Predicted against measured: how far the planner is from the points a calibration came from.

Each measured point is predicted three ways (:func:`validate`): **uncalibrated** (the analytic model alone),
**calibrated on the smallest probes** only (the figure that matters: can a few cheap probes predict the largest
b_m?) and **leave-one-out** (calibrated on every other point), with signed relative errors ``(predicted − measured)
/ measured``. The fits themselves are :mod:`microbatch.predict.calibrate`; the targets are issue 7's, at the largest
probed b_m. :func:`validate_result` is the whole of ``microbatch validate --json`` as one call: it chooses the
accelerator the step times are predicted for (:func:`validation_accelerator`) the way the command does.

Pure Python: no torch, except where :func:`validation_accelerator` measures this CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError, check_positive, check_positive_int
from microbatch.hardware import Accelerator, cpu_accelerator, get_accelerator, match_accelerator
from microbatch.model import ModelShape, model_differences
from microbatch.precision import get_precision
from microbatch.predict.calibrate import (
    MIN_POINTS,
    Calibration,
    calibrate,
    cover_measurements,
    need_points,
    predict_memory_bytes,
)
from microbatch.predict.memory_fit import check_figures
from microbatch.predict.roofline import DEFAULT_EFFICIENCY
from microbatch.predict.steptime import predict_step_time_s
from microbatch.predict.validation_cpu import (
    REMEASURE,
    measure_again,
    probe_threads,
    raw_result,
    recorded_cpu,
    say_remeasured,
)
from microbatch.records import Measurements, read_measurements
from microbatch.units import MIB


def ms_row_value(seconds: float) -> float:
    """A row's milliseconds: to the nanosecond, so that a table formatting them to 2 places rounds once (3 places
    then 2 read 161.09 ms for 0.161095025 s, where the tune table read 161.10)."""
    return round(seconds * 1e3, 6)


__all__ = [
    "ms_row_value",
    "DEFAULT_FIT_ON",
    "MEMORY_TARGET",
    "STEP_TARGET",
    "Validation",
    "validate",
    "validation_accelerator",
    "recorded_cpu",
    "REMEASURE",
    "validate_result",
]

DEFAULT_FIT_ON = 3
"""``validate`` calibrates on the smallest this many probes (e.g. b_m 1, 2, 4) and predicts the rest."""
MEMORY_TARGET = 0.05
"""Issue 7's goal for calibrated peak memory at the largest probed b_m: within 5%."""
STEP_TARGET = 0.10
"""Issue 7's goal for calibrated step time at the largest probed b_m: within 10%."""


def _err(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas == 0:
        return None
    return (pred - meas) / meas


@dataclass(frozen=True, kw_only=True)
class Validation:
    """Each measured point predicted uncalibrated, from the smallest probes, and leave-one-out."""

    measurements: Measurements
    """The points."""
    accelerator: Accelerator
    """The device the step times are predicted for."""
    fit_on: tuple[int, ...]
    """b_m of the smallest probes the "calibrated" predictions use."""
    calibration: Calibration
    """The calibration from ``fit_on``."""
    points: tuple[dict[str, Any], ...]
    """Per b_m, in bytes and seconds: measured, uncal, cal (smallest probes), loo; their errors."""
    notes: tuple[str, ...] = ()
    """Warnings (too few points for leave-one-out, clamps)."""

    def largest(self) -> dict[str, Any]:
        return self.points[-1]

    def errors(self) -> dict[str, Any]:
        """Signed relative errors at the largest b_m, the worst |leave-one-out| errors, and the targets met."""
        last = self.largest()

        def worst(key: str) -> float | None:
            vals = [p[key] for p in self.points if p.get(key) is not None]
            return max(vals, key=abs) if vals else None

        return {
            "largest_micro_batch": last["micro_batch"],
            "memory_uncalibrated": last["memory_uncal_err"],
            "memory_calibrated": last["memory_cal_err"],
            "memory_growth_calibrated": last.get("memory_growth_cal_err"),
            "memory_growth_uncalibrated": last.get("memory_growth_uncal_err"),
            "memory_growth_uncalibrated_eager": last.get("memory_growth_uncal_eager_err"),
            "step_uncalibrated": last["step_uncal_err"],
            "step_calibrated": last["step_cal_err"],
            "memory_loo_worst": worst("memory_loo_err"),
            "step_loo_worst": worst("step_loo_err"),
            "memory_target": MEMORY_TARGET,
            "step_target": STEP_TARGET,
            "memory_met": last["memory_cal_err"] is not None and abs(last["memory_cal_err"]) <= MEMORY_TARGET,
            "step_met": last["step_cal_err"] is not None and abs(last["step_cal_err"]) <= STEP_TARGET,
        }

    def rows(self) -> list[dict[str, Any]]:
        """Flat rows for a table: MiB, ms and % with short keys."""
        out = []
        for p in self.points:

            def mib(k: str, p: dict[str, Any] = p) -> float | None:
                return None if p[k] is None else round(p[k] / MIB, 1)

            def ms(k: str, p: dict[str, Any] = p) -> float | None:
                return None if p[k] is None else ms_row_value(p[k])

            def pct(k: str, p: dict[str, Any] = p) -> float | None:
                return None if p[k] is None else round(100 * p[k], 1)

            out.append(
                {
                    "micro_batch": p["micro_batch"],
                    "fit": "probe" if p["micro_batch"] in self.fit_on else "",
                    "mem_MiB": mib("memory_measured"),
                    "mem_uncal_MiB": mib("memory_uncal"),
                    "mem_uncal_err_%": pct("memory_uncal_err"),
                    "mem_cal_MiB": mib("memory_cal"),
                    "mem_cal_err_%": pct("memory_cal_err"),
                    "mem_loo_err_%": pct("memory_loo_err"),
                    "step_ms": ms("step_measured"),
                    "step_uncal_ms": ms("step_uncal"),
                    "step_uncal_err_%": pct("step_uncal_err"),
                    "step_cal_ms": ms("step_cal"),
                    "step_cal_err_%": pct("step_cal_err"),
                    "step_loo_err_%": pct("step_loo_err"),
                }
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """What ``validate --json`` prints but its summary line (:func:`microbatch.show.validation.with_summary`
        writes it): provenance, the table rows, the errors, the calibration."""
        m = self.measurements
        return {
            "model": m.model,
            "seq": m.seq,
            "precision": m.precision,
            "checkpointing": m.checkpointing,
            "device": m.device,
            "device_name": m.device_name,
            "memory_key": m.memory_key,
            "time_key": m.time_key,
            "accelerator": {
                "name": self.accelerator.name,
                "peak_flops": self.accelerator.peak_flops,
                "memory_bandwidth_bytes_per_s": self.accelerator.memory_bandwidth_bytes_per_s,
                "source": self.accelerator.source,
            },
            "fit_on": list(self.fit_on),
            "oom": list(m.oom),
            "rows": self.rows(),
            "errors": self.errors(),
            "points": [dict(p) for p in self.points],
            "calibration": self.calibration.to_dict(),
            "warnings": list(self.notes),
        }


def _check_fit_on(fit_on: int) -> None:
    if fit_on < MIN_POINTS:
        raise ConfigError(
            f"fit_on {fit_on} must be at least {MIN_POINTS}: a line has two parameters; give fit_on {MIN_POINTS} or more",
            params=("fit_on",),
        )


def _enough_points(meas: Measurements) -> None:
    """ConfigError unless ``meas`` has the points with peak memory and step time :func:`validate` needs."""
    check_figures(meas)  # a figure missing from every point, named first
    have = [
        p.micro_batch for p in meas.points if p.peak_memory_bytes is not None and p.step_time_s is not None
    ]
    need_points("peak memory and step time", have, meas.source, need=MIN_POINTS + 1)


def validate(meas: Measurements, acc: Accelerator, *, fit_on: int = DEFAULT_FIT_ON) -> Validation:
    """Predict every point uncalibrated, from the smallest ``fit_on`` probes, and leave-one-out.

    The smallest-probes fit uses min(fit_on, n − 1) points so that at least the largest is predicted;
    needs 3 points (2 to fit, 1 to predict) and says how many more otherwise.
    """
    pts = [p for p in meas.points if p.peak_memory_bytes is not None and p.step_time_s is not None]
    have = [p.micro_batch for p in pts]
    _enough_points(meas)
    _check_fit_on(fit_on)
    k = min(fit_on, len(pts) - 1)
    small = tuple(have[:k])
    notes = list(meas.notes)
    if k < fit_on:
        notes.append(f"only {len(pts)} points: calibrated on the smallest {k}, not {fit_on}")
    sh = meas.shape
    kw: dict[str, Any] = dict(seq=meas.seq, precision=meas.precision, checkpointing=meas.checkpointing)
    cal_acc, cal, raised = _fit(meas, acc, small)
    notes += [n for n in cal.notes if n not in notes]
    if raised:
        notes.append(
            f"the fit on b_m {', '.join(map(str, small))}: {raised} (the uncalibrated column keeps the peak)"
        )
    loo: dict[int, tuple[Accelerator, Calibration]] = {}
    for p in pts:
        try:
            loo[p.micro_batch] = _fit(meas, acc, tuple(b for b in have if b != p.micro_batch))[:2]
        except ConfigError as e:  # e.g. memory flat without this point
            notes.append(f"leave-one-out at b_m {p.micro_batch}: {e}")
    rows = []
    for p in pts:
        b = p.micro_batch
        m_unc = predict_memory_bytes(sh, b, **kw)
        m_eager = (
            predict_memory_bytes(sh, b, layer_kernels="eager", **kw) if _transformers(meas.label) else None
        )
        t_unc = predict_step_time_s(sh, b, acc, **kw)
        m_cal = predict_memory_bytes(sh, b, calibration=cal.memory, **kw)
        t_cal = predict_step_time_s(sh, b, cal_acc, efficiency=cal.efficiency or DEFAULT_EFFICIENCY, **kw)
        loo_acc, lc = loo.get(b, (acc, None))
        m_loo = predict_memory_bytes(sh, b, calibration=lc.memory, **kw) if lc else None
        t_loo = (
            predict_step_time_s(sh, b, loo_acc, efficiency=lc.efficiency or DEFAULT_EFFICIENCY, **kw)
            if lc
            else None
        )
        rows.append(
            {
                "micro_batch": b,
                "rows": b * meas.seq,
                "memory_measured": p.peak_memory_bytes,
                "memory_uncal": m_unc,
                "memory_uncal_err": _err(m_unc, p.peak_memory_bytes),
                "memory_uncal_eager": m_eager,
                "memory_cal": m_cal,
                "memory_cal_err": _err(m_cal, p.peak_memory_bytes),
                "memory_loo": m_loo,
                "memory_loo_err": _err(m_loo, p.peak_memory_bytes),
                "step_measured": p.step_time_s,
                "step_uncal": t_unc,
                "step_uncal_err": _err(t_unc, p.step_time_s),
                "step_cal": t_cal,
                "step_cal_err": _err(t_cal, p.step_time_s),
                "step_loo": t_loo,
                "step_loo_err": _err(t_loo, p.step_time_s),
            }
        )
    _growth_errors(rows)
    return Validation(
        measurements=meas,
        accelerator=acc,
        fit_on=small,
        calibration=cal,
        points=tuple(rows),
        notes=tuple(notes),
    )


def _growth_errors(rows: list[dict[str, Any]]) -> None:
    """Each row's ``memory_growth_cal_err`` and ``memory_growth_uncal_err``: the calibrated and the uncalibrated
    predictions' errors on what the peak gained over the smallest b_m measured, (m(b) − m(b₀)) against
    (M(b) − M(b₀)); None at b₀ or where the peak did not grow. On a CPU the fixed bytes (interpreter, torch) are nearly
    all of the peak, so the total's error cannot show an activation term that is off (three times the fitted scale
    moved tiny's at b_m 8 by 3.5%); the growth can. The calibrated one fits a slope to the same points, nearly exact
    on a peak linear in b_m whatever the formula; the uncalibrated one is the formula's own activation bytes per
    sample against the machine's (a helper, 2026-12-07: GPT-2 −56%, Gemma 2 −53%, Llama −15%, GPT-NeoX 0%, where
    the calibrated one read 0.0% for all); ``uncal_eager`` the same with eager layers' terms
    (:mod:`microbatch.predict.eager_memory`: what transformers' layers keep, run op by op)."""
    first = rows[0]
    for r in rows:
        grown = r["memory_measured"] - first["memory_measured"]
        for kind in ("cal", "uncal", "uncal_eager"):
            if r[f"memory_{kind}"] is None:  # eager layers' terms only for transformers' models
                r[f"memory_growth_{kind}_err"] = None
                continue
            predicted = r[f"memory_{kind}"] - first[f"memory_{kind}"]
            r[f"memory_growth_{kind}_err"] = (
                (predicted - grown) / grown if r is not first and grown > 0 else None
            )


def _transformers(label: str) -> bool:
    """Whether a tune's ``model`` label is a model transformers built (``hf:<name>``, or a config's path), whose layers
    keep what :mod:`microbatch.predict.eager_memory` prices; the built-in GPT's do not (one-kernel GELU, torch's
    RMSNorm)."""
    return label.startswith("hf:") or label.endswith(".json") or "/" in label or Path(label).is_dir()


MAX_PEAK_RAISE = 16
"""The most a fit may raise a CPU's peak (:func:`~microbatch.predict.calibrate.cover_measurements`) before the points are
refused as not this model on this CPU: a matmul timed on a busy machine reads its peak low by a small factor (this
2-core VM's read 34-41 GFLOP/s across runs of one day, about half beside two busy loops); points that 16x the peak
cannot explain were measured elsewhere or for another model (a tiny model's points labelled small needed 1,024x)."""


def _fit(meas: Measurements, acc: Accelerator, bs: tuple[int, ...]) -> tuple[Accelerator, Calibration, str]:
    """(the accelerator the fit is read at, the calibration on b_m ``bs``, the note of a raised peak): on a CPU the
    peak raised as far as the points fitted need (:func:`~microbatch.predict.calibrate.cover_measurements`; a
    predicted point never moves it, and the uncalibrated prediction keeps the peak given, recorded or measured)."""
    fit_acc, raised = acc, ""
    if acc.name == "cpu":
        fit_acc, raised = cover_measurements(
            acc, replace(meas, points=tuple(p for p in meas.points if p.micro_batch in bs))
        )
        dt = get_precision(meas.precision).compute_dtype
        if fit_acc.flops(dt) > MAX_PEAK_RAISE * acc.flops(dt):
            raise ConfigError(
                f"{meas.source}: b_m {', '.join(map(str, bs))} ran faster than this CPU's roofline for "
                f"{meas.shape.name} allows at {acc.flops(dt) / 1e9:.3g} GFLOP/s and "
                f"{acc.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s, even at {MAX_PEAK_RAISE}x that peak (where the "
                "memory-bound terms alone are slower than the points, no peak covers them: the bandwidth was read "
                "low): measured on another machine or for another model, or the figures read low; validate on the "
                "machine and with the model the points are of, or give that machine's cpu_peak_gflops and "
                "cpu_bandwidth_gbs",
                params=("cpu_peak_gflops", "cpu_bandwidth_gbs"),
            )
    return fit_acc, calibrate(meas, fit_acc, micro_batches=list(bs)), raised


CPU_PEAK_GFLOPS_RANGE = (0.01, 1e6, "GFLOP/s", 200)
"""The CPU peaks ``validate`` takes, in GFLOP/s: 10 MFLOP/s (below any CPU torch runs on) to 1 PFLOP/s, ten times a
56-core Sapphire Rapids' AMX bf16 peak (1,024 FLOP/cycle/core × 2 GHz × 56 ≈ 115 TFLOP/s, Intel's AMX figure). A
figure given in FLOP/s (2e12) lands far above it, and was taken as 2·10²¹ FLOP/s (a fuzzer's run: -83% "errors")."""
CPU_BANDWIDTH_GBS_RANGE = (0.01, 1e5, "GB/s", 50)
"""The CPU memory bandwidths taken, in GB/s: 10 MB/s to 100 TB/s, a hundred times a Xeon Max's HBM (about 1 TB/s,
Intel's figure) — a plausibility bound that catches a figure in bytes per second, not a fit."""


def validation_accelerator(
    meas: Measurements,
    *,
    gpu: str | None = None,
    cpu_peak_gflops: float | None = None,
    cpu_bandwidth_gbs: float | None = None,
    cpu_threads: int | None = None,
    recorded: Accelerator | None = None,
    measure: Callable[..., Accelerator] | None = None,
) -> Accelerator:
    """The accelerator ``validate`` predicts ``meas``'s step times for.

    ``gpu`` (a registry name) when given; else the GPU the points name (:class:`ConfigError` when
    the table lacks it); else this CPU: the peak and bandwidth given, or those ``recorded`` with the
    measurements (:func:`recorded_cpu`), or measured now
    by ``measure`` (the caller's :func:`~microbatch.measure.cpu.measure_cpu`: this module measures nothing;
    with either figure given replacing the measured one),
    as it is: a fit raises the peak for itself where its points are faster than it allows (:func:`_fit`).
    """
    if gpu is not None and not str(gpu).strip():  # '' was read as no GPU named
        raise ConfigError(
            "gpu '' names no accelerator; give a name (e.g. h100-sxm), or leave it out", params=("gpu",)
        )
    for figure, value, (lo, hi, unit, example) in (
        ("cpu_peak_gflops", cpu_peak_gflops, CPU_PEAK_GFLOPS_RANGE),
        ("cpu_bandwidth_gbs", cpu_bandwidth_gbs, CPU_BANDWIDTH_GBS_RANGE),
    ):
        if value is not None and not (lo <= value <= hi):  # NaN fails both
            raise ConfigError(
                f"{figure} {value:g} is outside [{lo:g}, {hi:g}] {unit}: the figure is in {unit} (e.g. {example}), "
                "not in units per second; give this CPU's figure, or leave it out to measure it",
                params=(figure,),
            )
    if gpu and not meas.is_cuda:  # a GPU's predicted step against a CPU's measured one: errors of -80 to -97%
        raise ConfigError(
            f"{meas.source} was measured on {meas.device_name or meas.device!r}, not a GPU: its step times cannot "
            f"validate a prediction for {gpu}; drop gpu (this CPU's peak and bandwidth are used), or validate a tune "
            f"run on a {gpu}",
            params=("gpu",),
        )
    if gpu:
        acc = get_accelerator(gpu)
    elif meas.is_cuda:
        name = match_accelerator(meas.device_name)
        if name is None:
            raise ConfigError(
                f"{meas.source}: device {meas.device_name or meas.device!r} is not in the accelerator table; "
                "give gpu NAME (e.g. h100-sxm)",
                params=("gpu",),
            )
        acc = get_accelerator(name)
    elif cpu_peak_gflops is not None and cpu_bandwidth_gbs is not None:
        acc = cpu_accelerator(
            flops_per_s=cpu_peak_gflops * 1e9,
            bytes_per_s=cpu_bandwidth_gbs * 1e9,
            source=f"given: {cpu_peak_gflops:g} GFLOP/s, {cpu_bandwidth_gbs:g} GB/s",
        )
    elif recorded is None and measure is None:
        raise ConfigError(
            "this CPU's peak and bandwidth are neither given nor recorded with the measurements; give "
            "cpu_peak_gflops and cpu_bandwidth_gbs, or a measure function (microbatch.measure.cpu.measure_cpu)",
            params=("cpu_peak_gflops", "cpu_bandwidth_gbs"),
        )
    else:  # the recorded figures, else measured now; one figure given replaces its own
        acc = recorded if recorded is not None else measure(threads=cpu_threads)  # type: ignore[misc]
        if cpu_peak_gflops is not None or cpu_bandwidth_gbs is not None:
            acc = cpu_accelerator(
                flops_per_s=(cpu_peak_gflops * 1e9) if cpu_peak_gflops is not None else acc.flops("fp32"),
                bytes_per_s=(cpu_bandwidth_gbs * 1e9)
                if cpu_bandwidth_gbs is not None
                else acc.memory_bandwidth_bytes_per_s,
                source=acc.source + " (partly overridden)",
            )
    return acc


def validate_result(
    tune_result: str | Path | dict[str, Any] | list[Any],
    *,
    shape: ModelShape | None = None,
    memory_key: str = "peak_memory_bytes",
    gpu: str | None = None,
    fit_on: int = DEFAULT_FIT_ON,
    cpu_peak_gflops: float | None = None,
    cpu_bandwidth_gbs: float | None = None,
    cpu_threads: int | None = None,
    measure: Callable[..., Accelerator] | None = None,
) -> dict[str, Any]:
    """What ``microbatch validate`` prints as JSON but its summary line, for a tune result (a loaded
    ``result.json`` dict, or its path): :func:`~microbatch.records.read_measurements`,
    :func:`validation_accelerator`, :func:`validate`, :meth:`Validation.to_dict` (``rows``,
    ``errors``, ...; :func:`microbatch.show.validation.with_summary` adds the summary line). The
    keywords are the command's options.

    On the CPU without both figures given the accelerator is measured now, so step-time
    predictions vary from call to call; raises :class:`ConfigError` for too few points.
    """
    # the options first, before the file is read or this CPU measured
    for name, v in (("cpu_peak_gflops", cpu_peak_gflops), ("cpu_bandwidth_gbs", cpu_bandwidth_gbs)):
        if v is not None:
            check_positive(name, v, fix=f"give this CPU's figure, or leave {name} out to measure it now")
    if cpu_threads is not None:
        check_positive_int(
            "cpu_threads", cpu_threads, fix="give the probes' threads, or leave cpu_threads out"
        )
    _check_fit_on(fit_on)
    meas = read_measurements(tune_result, shape=shape, memory_key=memory_key)
    _enough_points(meas)  # before this CPU is measured (seconds), not after
    diff = model_differences(meas.shape, shape) if shape is not None else []
    if diff and shape is not None:  # the file names the model it measured: another one given is a mistake
        raise ConfigError(
            f"{meas.source}: measured with {meas.model} ({meas.shape.param_count():,} parameters), not {shape.name} "
            f"({', '.join(f'{f} {getattr(meas.shape, f)} vs {getattr(shape, f)}' for f in diff[:4])}); give the "
            "model it was measured with, or none (the file names it)",
            params=("shape",),
        )
    raw = raw_result(tune_result)
    recorded = recorded_cpu(raw)
    given = bool(cpu_peak_gflops is not None and cpu_bandwidth_gbs is not None)
    here = measure is not None and not gpu and not given and recorded is None  # this CPU is timed now
    cpu_threads, meas = probe_threads(raw, meas, cpu_threads, timed_here=here)
    taken: list[Accelerator] = []  # what measure gave (each reported: how much the machine moved)

    def measured(**kw: Any) -> Accelerator:
        assert measure is not None
        taken.append(measure(**kw))
        return taken[-1]

    acc = validation_accelerator(
        meas,
        gpu=gpu,
        cpu_peak_gflops=cpu_peak_gflops,
        cpu_bandwidth_gbs=cpu_bandwidth_gbs,
        cpu_threads=cpu_threads,
        recorded=recorded,
        measure=measured if measure is not None else None,
    )
    out = validate(meas, acc, fit_on=fit_on).to_dict()
    if gpu or meas.is_cuda or given:
        return out
    if recorded is not None:
        out["accelerator"]["figures"] = "recorded"
        out["warnings"].append(
            f"step times predicted for this CPU's figures recorded with the measurements ({recorded.source})"
        )
        return out
    say_remeasured(out, (taken or [acc]) + measure_again(measure, cpu_threads))
    return out
