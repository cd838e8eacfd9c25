"""This CPU's peak and bandwidth for ``validate``: read from the figures recorded with the measurements, or measured now
(several times, to say how much the machine moved). Split from :mod:`microbatch.predict.validation`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError
from microbatch.hardware import Accelerator, cpu_accelerator
from microbatch.records import Measurements, load_json

__all__ = ["REMEASURE", "measure_again", "raw_result", "recorded_cpu", "say_remeasured"]


REMEASURE = 3
"""How many times ``validate`` measures this CPU when no figures were recorded: the first is used,
all of them are reported, to show how much the machine moved."""


def raw_result(tune_result: str | Path | dict[str, Any] | list[Any]) -> Any:
    """The result's JSON (:func:`microbatch.records.load_json`: a path, a folder holding result.json, or the
    loaded value); None if unreadable (read_measurements has said why by then)."""
    try:
        return load_json(tune_result)
    except ConfigError:
        return None


def recorded_cpu(tune_result: str | Path | dict[str, Any] | list[Any]) -> Accelerator | None:
    """This CPU's figures recorded with the measurements, or None.

    Read from an ``accelerator`` object (``peak_flops`` — a number, or a dict by dtype with ``fp32`` —
    and ``memory_bandwidth_bytes_per_s``), as ``validate --json`` and a saved calibration write it.
    """
    raw: Any = raw_result(tune_result)
    if not isinstance(raw, dict):
        return None
    a = raw.get("accelerator")
    if not isinstance(a, dict) or a.get("name", "cpu") != "cpu":
        return None
    peak = a.get("peak_flops")
    if isinstance(peak, dict):
        peak = peak.get("fp32")
    bw = a.get("memory_bandwidth_bytes_per_s")
    ok = [x for x in (peak, bw) if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0]
    if len(ok) != 2:
        return None
    peak, bw = float(ok[0]), float(ok[1])
    return cpu_accelerator(
        flops_per_s=float(peak),
        bytes_per_s=float(bw),
        source=f"recorded: {float(peak) / 1e9:.1f} GFLOP/s, {float(bw) / 1e9:.1f} GB/s",
    )


def measure_again(measure: Callable[..., Accelerator] | None, threads: int | None) -> list[Accelerator]:
    """The CPU measured :data:`REMEASURE` − 1 more times (none without a measure function)."""
    return [measure(threads=threads) for _ in range(REMEASURE - 1)] if measure is not None else []


def say_remeasured(out: dict[str, Any], runs: list[Accelerator]) -> None:
    """Figures measured now: how much this machine moved between the measurements (``runs``: the measurements
    themselves, not a peak raised to cover the points), in ``out`` and its warnings."""
    peaks = [a.flops("fp32") for a in runs]
    bws = [a.memory_bandwidth_bytes_per_s for a in runs]
    moved: dict[str, Any] = {
        "peak_flops": peaks,
        "memory_bandwidth_bytes_per_s": bws,
        "peak_spread": max(peaks) / min(peaks) - 1,
        "bandwidth_spread": max(bws) / min(bws) - 1,
    }
    out["accelerator"]["figures"] = "measured now"
    out["accelerator"]["remeasured"] = moved
    out["warnings"].append(
        f"this CPU's peak and bandwidth were measured now, not recorded with the measurements: {REMEASURE} "
        f"measurements here gave {min(peaks) / 1e9:.1f}–{max(peaks) / 1e9:.1f} GFLOP/s "
        f"({100 * moved['peak_spread']:.0f}% apart) and {min(bws) / 1e9:.1f}–{max(bws) / 1e9:.1f} GB/s "
        f"({100 * moved['bandwidth_spread']:.0f}% apart), so the uncalibrated step-time error moves with the "
        "machine's load from run to run (the calibrated figures are relative to the peak and move less); "
        "for a repeatable figure give cpu_peak_gflops and cpu_bandwidth_gbs, or record them in the file "
        '(an "accelerator" object with peak_flops and memory_bandwidth_bytes_per_s)'
    )


def probe_threads(
    raw: Any, meas: Measurements, cpu_threads: int | None, *, timed_here: bool
) -> tuple[int | None, Measurements]:
    """The threads to time this CPU with: ``cpu_threads`` given, else the file's (the probes' torch threads, as tune
    writes them), at most this machine's cores where the CPU is timed here (``timed_here``: more threads than cores
    time the contention, not the CPU; the flag is refused for it, the file's said in a note: a review, 2026-12-08);
    ConfigError for a file's threads that are no whole number >= 1."""
    from dataclasses import replace

    from microbatch.cpu_quota import usable_cores
    from microbatch.errors import whole_number

    if cpu_threads is not None or not isinstance(raw, dict) or raw.get("threads") is None:
        return cpu_threads, meas
    threads = whole_number(raw["threads"])
    if threads is None or threads < 1:
        raise ConfigError(
            f"{meas.source}: the file's threads {raw['threads']!r} is not a whole number >= 1 (the probes' "
            "torch threads, as tune writes them); correct it, or give cpu_threads",
            params=("cpu_threads",),
        )
    if threads > (cores := usable_cores()) and timed_here and not meas.is_cuda:
        note = f"the file's {threads} threads are more than the {cores} cores here: this CPU timed on {cores}"
        return cores, replace(meas, notes=(*meas.notes, note))
    return threads, meas
