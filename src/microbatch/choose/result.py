"""The answer of a tune: the measured curve, the choice made from it, and how it was made.

:class:`TuneResult` is data: :meth:`TuneResult.to_dict` is what ``--json`` prints and
``result.json`` holds (the recommendation's keys, then the points and the provenance);
``show/`` renders it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from microbatch._json import dumps
from microbatch.choose.knee import Recommendation
from microbatch.envelope import envelope
from microbatch.measure.probes import Measurement

__all__ = ["CacheUse", "TuneResult"]


@dataclass(frozen=True, kw_only=True)
class CacheUse:
    """How much of an answer came from the cache: what every entry point says in one line."""

    points: int
    """Points of the answer taken from the cache."""
    measured: int
    """Points measured in this run."""
    oldest_s: float | None
    """When the oldest cached point was measured (seconds since the epoch)."""
    key: str
    """The cache key."""
    file: str
    """The cache file (``tune-<key>.json`` in :func:`microbatch.choose.tune.cache.cache_dir`)."""

    def message(self, again: str = "use_cache=False") -> str:
        """One line: how many points came from the cache, when they were measured, how to measure again
        (``again``: the caller's words for it)."""
        when = (
            ""
            if self.oldest_s is None
            else time.strftime(" (measured from %Y-%m-%d %H:%M UTC", time.gmtime(self.oldest_s))
        )
        when += ")" if when else ""
        return (
            f"{self.points} of {self.points + self.measured} points from the cache{when}, "
            f"{self.file}; {again} measures them again"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": self.points,
            "measured": self.measured,
            "oldest_measured_at": self.oldest_s,
            "key": self.key,
            "file": self.file,
        }


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """The measured curve and the choice made from it."""

    points: list[Measurement]
    """Every point, in the order measured (cached ones included)."""
    recommendation: Recommendation
    """The knee and the fastest fitting b_m."""
    model: str
    """Model name (registry name, config path, or the user's module class)."""
    seq: int | None
    """Sequence length probed (the longest the data holds)."""
    mode: str
    """``train`` or ``decode``."""
    device: str
    """Device type (``cpu``, ``cuda``)."""
    device_name: str
    """The device's name (GPU model or CPU model)."""
    precision: str
    """``fp32`` or ``bf16-mixed``."""
    checkpointing: str
    """The setting asked for: ``off``, ``on`` or ``auto`` (each point says what it used)."""
    torch_version: str
    """torch.__version__ of the run."""
    memory_budget_bytes: int | None
    """The budget given (None: none)."""
    memory_method: str
    """How peak memory was measured."""
    stop_reason: str
    """Why the search stopped."""
    skipped: list[int]
    """b_m not probed because the memory fit predicted they would not fit."""
    interrupted: bool
    """Ctrl-C ended the search."""
    oom_events: int
    """Probes that ran out of memory (in the probe process or caught in this one)."""
    probes: int
    """Points measured in this run."""
    cached: int
    """Points reused from the cache."""
    wall_time_s: float
    """Time of the whole tune (setup included)."""
    memory_budget_source: str = "none"
    """Where the budget came from: ``given``, ``device total`` (CUDA) or ``80% of available host
    memory`` (the CPU child's limit), or ``none``."""
    static_bytes: int | None = None
    """Memory before activations (process, weights, gradients, optimizer state) where measured."""
    fingerprint: str = ""
    """Cache key of the run."""
    cache: CacheUse | None = None
    """How many points of the answer came from the cache, and when they were measured (None: none)."""
    timing_choice: str = ""
    """How the probes were timed and why (threads, clock), where the tuner chose it."""
    notes: tuple[str, ...] = ()
    """What the user should know about the run besides the curve (a NaN loss, ...)."""

    def to_dict(self) -> dict[str, Any]:
        d = self.recommendation.to_dict()
        fit = self.recommendation.memory_fit
        d["predicted_max_micro_batch"] = d["max_fitting_micro_batch"]
        largest = max(
            (p for p in self.points if not p.oom and p.peak_memory_bytes),
            key=lambda p: p.micro_batch,
            default=None,
        )
        peak = largest.peak_memory_bytes if largest is not None else None
        d["memory_fit_error_at_largest"] = (
            (fit.predict(largest.micro_batch) - peak) / peak
            if fit is not None and largest is not None and peak
            else None
        )
        d.update(
            points=[p.to_dict() for p in self.points],
            model=self.model,
            seq=self.seq,
            mode=self.mode,
            device=self.device,
            device_name=self.device_name,
            precision=self.precision,
            checkpointing=self.checkpointing,
            torch_version=self.torch_version,
            memory_method=self.memory_method,
            stop_reason=self.stop_reason,
            skipped=self.skipped,
            interrupted=self.interrupted,
            oom_events=self.oom_events,
            probes=self.probes,
            cached=self.cached,
            wall_time_s=self.wall_time_s,
            static_bytes=self.static_bytes,
            fingerprint=self.fingerprint,
            cache=self.cache.to_dict() if self.cache is not None else None,
        )
        if self.timing_choice:
            d["timing_choice"] = self.timing_choice
        d["notes"] = list(self.notes)
        # The budget is the user's; keep the key even when None (recommend's dict has it).
        d["memory_budget_bytes"] = self.memory_budget_bytes
        d["memory_budget_source"] = self.memory_budget_source
        return d

    def save(self, out_dir: str | os.PathLike[str]) -> Path:
        """Write ``result.json`` (everything in :meth:`to_dict`, in the command line's envelope) under
        ``out_dir``, whole or not at all (:func:`microbatch.files.write_text`: a reader beside a loop of saves read
        an empty file 26 times in 28); return its path."""
        from microbatch.files import write_text

        p = Path(out_dir)
        p.mkdir(parents=True, exist_ok=True)
        path = p / "result.json"
        write_text(path, dumps(envelope(self.to_dict(), "tune")))
        return path
