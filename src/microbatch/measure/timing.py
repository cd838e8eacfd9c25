"""Timing one probe: the timing settings, the clocks and the repeat-until-stable loop.

``warmup`` untimed calls (they also absorb ``torch.compile``'s compilation and recompilation for
a new shape), then repeats until the median is stable (the median of all repeats and that of all
but the last differ by less than ``rel_tol``) or a count or time limit is reached. The clocks:
CUDA events on a GPU (:func:`cuda_timer`), ``time.perf_counter`` (:func:`wall_timer`) or
``time.process_time`` (:func:`process_timer`) on the CPU. The spread is kept as the relative
interquartile range (q75 − q25) / median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from microbatch.errors import ConfigError, check_non_negative, check_positive, plain_numbers, whole_number

__all__ = [
    "CLOCKS",
    "Timer",
    "TimingConfig",
    "enough_repeats",
    "spread",
    "time_until_stable",
    "wall_timer",
    "process_timer",
    "cuda_timer",
]

CLOCKS = ("wall", "process")
"""The CPU clocks a probe may use (CUDA always uses events)."""

Timer = Callable[[Callable[[], Any]], float]
"""A clock applied to one call: ``timer(fn)`` runs ``fn`` once and returns its seconds."""


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How long to time one probe."""

    warmup: int = 2
    """Untimed calls first (they absorb lazy allocation and compilation)."""
    min_repeats: int = 3
    """Timed calls before the stability test may stop."""
    max_repeats: int = 20
    """Timed calls at most."""
    max_time_s: float = 5.0
    """Wall time at most for the timed calls of one probe (at least ``min_repeats`` run)."""
    rel_tol: float = 0.03
    """Stop when the median of all repeats and that of all but the last differ by less than this."""
    clock: str = "wall"
    """CPU only: ``wall`` (``perf_counter``) or ``process`` (``process_time``: the CPU time of the
    probe process, steadier on a machine shared with other jobs; meaningful with one thread, where
    it is the time the work would take alone). CUDA always uses events."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        for name in ("warmup", "min_repeats", "max_repeats"):
            if whole_number(getattr(self, name)) is None:
                raise ConfigError(
                    f"timing {name} must be a whole number of calls, got {getattr(self, name)!r}; e.g. warmup 2, "
                    "min_repeats 3, max_repeats 20",
                    params=(name,),
                )
        check_positive("max_time_s", self.max_time_s, fix="e.g. max_time_s 5")
        check_non_negative("rel_tol", self.rel_tol, fix="e.g. rel_tol 0.03")
        if self.warmup < 0 or self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise ConfigError(
                f"timing warmup={self.warmup}, min_repeats={self.min_repeats}, max_repeats={self.max_repeats}: "
                "need warmup >= 0 and 1 <= min_repeats <= max_repeats"
            )
        if self.clock not in CLOCKS:
            raise ConfigError(f"timing clock {self.clock!r} is not known; use wall or process")
        if not (self.max_time_s > 0 and self.rel_tol >= 0):
            raise ConfigError(
                f"timing max_time_s={self.max_time_s} must be > 0 and rel_tol={self.rel_tol} >= 0"
            )


def spread(times: list[float]) -> float:
    """Relative interquartile range (q75 − q25) / median; 0 for fewer than two times."""
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=4, method="inclusive")
    med = statistics.median(times)
    return (q[2] - q[0]) / med if med > 0 else 0.0


def time_until_stable(
    fn: Callable[[], Any],
    timing: TimingConfig,
    *,
    timer: Timer | None = None,
    agree: Callable[[bool], bool] | None = None,
) -> list[float]:
    """Times of ``fn`` in seconds: ``warmup`` untimed calls, then repeats until the median is stable.

    ``timer(fn)`` returns one call's seconds (default ``perf_counter``); ``agree(stop)`` lets
    several processes take the stop decision together (default: each alone).
    """
    clock = timer or wall_timer
    for _ in range(timing.warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while True:
        times.append(clock(fn))
        stop = enough_repeats(times, timing, time.perf_counter() - start)
        if agree is not None:
            stop = agree(stop)
        if stop:
            return times


STALLED = 2.0
"""A median over this many times the fastest repeat is not taken as stable: interference only lengthens a step,
and two stalled repeats of three make a median that agrees with itself. A review saw decode steps on two shared
cores read 100-700x their time in two of three repeats and be accepted (median of 3 = median of the first 2); the
jitter a step has without a stall is a few percent (``rel_tol``), far under 2x."""


def enough_repeats(times: list[float], timing: TimingConfig, elapsed_s: float) -> bool:
    """Whether the timed repeats ``times`` (after the warm-up), taken over ``elapsed_s`` seconds,
    are enough: ``max_repeats`` reached, or at least ``min_repeats`` and either ``max_time_s``
    spent or the median stable (the median of all and that of all but the last differ by less
    than ``rel_tol``) and not stalled (at most :data:`STALLED` times the fastest repeat). The one stop
    rule of every probe (:func:`time_until_stable`, and the Accelerate decorator's step probe, which times
    the user's own loop)."""
    n = len(times)
    if n >= timing.max_repeats:
        return True
    if n < timing.min_repeats:
        return False
    if elapsed_s >= timing.max_time_s:
        return True
    if n < 2:
        return False
    m_all, m_prev = statistics.median(times), statistics.median(times[:-1])
    stalled = m_all > STALLED * min(times)
    return m_all > 0 and abs(m_all - m_prev) / m_all < timing.rel_tol and not stalled


def wall_timer(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn`` by the wall clock (``time.perf_counter``)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def process_timer(fn: Callable[[], Any]) -> float:
    """CPU seconds of this process during one call of ``fn`` (``time.process_time``)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def cuda_timer(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn`` on the current CUDA stream, by CUDA events (waits for the end)."""
    import torch

    event: Any = torch.cuda.Event  # its __init__ carries no annotations
    start, end = event(enable_timing=True), event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3
