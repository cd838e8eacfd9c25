"""The measured throughput curve: one point per micro-batch size, and the gain per doubling.

Pure Python (no torch). The knee rules (:mod:`microbatch.choose.knee`), the bound on larger
b_m (:mod:`microbatch.choose.bound`) and the memory fit (:mod:`microbatch.choose.memory_fit`)
all read a curve of :class:`CurvePoint`; why and how is in ``docs/knee.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from microbatch.errors import ConfigError, check_positive_int, plain_numbers

__all__ = ["TIE", "CurvePoint", "gain_per_doubling", "measured_curve"]

TIE = 1e-9
"""Relative slack where a rule compares a measured ratio with τ: a point exactly on the line (in decimal) meets it
whatever its float rounding — 80 of 100 at τ 0.2 met it and 5.6 of 7 did not (a helper's review, 2026-12-07); a
15.0% gain per doubling is 0.15 under ``gain``'s τ 0.15 either way. A billionth: far below any measured noise."""


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    """One measured point of the throughput curve."""

    micro_batch: int
    """b_m: sequences per forward/backward."""
    throughput: float | None = None
    """Samples (or tokens) per second; None when the probe ran out of memory."""
    peak_memory_bytes: int | None = None
    """Peak memory of the probe (None when unknown)."""
    oom: bool = False
    """The probe ran out of memory."""
    step_time_s: float | None = None
    """Time of one step (a micro-step in training, one token in decoding), for latency limits."""
    throughput_se: float | None = None
    """Standard error of ``throughput`` relative to it (None or 0: not known;
    :mod:`microbatch.choose.noise`)."""
    checkpointing: bool = False
    """Measured with activation checkpointing on (``tune --checkpointing auto`` turns it on where a b_m does
    not fit without it): its memory and speed are those of that mode, and so is the b_m's advice."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        check_positive_int("micro_batch", self.micro_batch, fix="micro-batch sizes are whole numbers >= 1")
        for name in ("throughput", "peak_memory_bytes", "step_time_s", "throughput_se"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0
            ):
                raise ConfigError(
                    f"{name} {v!r} at micro_batch {self.micro_batch} must be a finite number >= 0 (or None: not "
                    "measured)",
                    params=(name,),
                )
        for name in ("oom", "checkpointing"):  # "no" or 1 is no answer: a point dropped as out of memory
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{name} {getattr(self, name)!r} at micro_batch {self.micro_batch} must be True or False",
                    params=(name,),
                )
        if not self.oom and self.throughput is None:
            raise ConfigError(
                f"point micro_batch {self.micro_batch} has no throughput and is not marked oom; "
                "give a throughput or oom: true"
            )

    @property
    def ok(self) -> bool:
        """Measured without running out of memory (so it has a throughput)."""
        return not self.oom and self.throughput is not None

    @property
    def measured_throughput(self) -> float:
        """The throughput of a measured point; ValueError for an out-of-memory one."""
        if self.oom or self.throughput is None:
            raise ValueError(f"micro_batch {self.micro_batch} ran out of memory: it has no throughput")
        return self.throughput


def gain_per_doubling(b1: int, t1: float, b2: int, t2: float, *, at_least_one: bool = False) -> float:
    """Throughput gain per doubling of b_m between two points: (t2/t1)^(1/log2(b2/b1)) − 1; with ``at_least_one``
    a gain over less than a doubling is taken as it is, (t2/t1) − 1, not raised to a doubling's (which raises its
    noise to the same power: 1.5% between b 56 and 64 reads as 28% a doubling)."""
    if b2 <= b1 or t1 <= 0:
        raise ValueError("need b2 > b1 and t1 > 0")
    doublings = math.log2(b2 / b1)
    return float((t2 / t1) ** (1.0 / (max(1.0, doublings) if at_least_one else doublings)) - 1.0)


def measured_curve(points: Iterable[CurvePoint]) -> list[CurvePoint]:
    """The measured points (out-of-memory ones dropped), one per b_m (the last given), by b_m."""
    best: dict[int, CurvePoint] = {}
    for p in points:
        if p.ok:
            best[p.micro_batch] = p
    return [best[b] for b in sorted(best)]
