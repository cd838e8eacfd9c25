"""The board a GPU benchmark ran on: its power limit, and the SM clock it held under a long GEMM.

A datasheet's tensor peak is computed at one clock; under a long dense GEMM at its power limit a GPU holds
another (:mod:`microbatch.hardware_clocks`). Both are read from the driver, not derived: ``nvidia-smi
--query-gpu=power.limit,clocks.sm,clocks.max.sm`` (NVIDIA's System Management Interface, CSV without units),
sampled from a thread while the caller's GEMMs keep the device busy, so the clock is the one the kernels ran
at. Where the tool is missing or says nothing usable (no NVIDIA driver, another vendor, a CPU) nothing is
read and the result says so; nothing here is estimated.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BoardReading", "read_board", "clock_under_load", "QUERY", "MIN_SAMPLES"]

QUERY = (
    "nvidia-smi",
    "--query-gpu=enforced.power.limit,clocks.sm,clocks.max.sm",
    "--format=csv,noheader,nounits",
)
"""The driver query: the enforced power limit (W), the current and the maximum SM clock (MHz)."""
MIN_SAMPLES = 3
"""Readings under load below which no clock is reported (one or two could fall before the clock settles)."""

Runner = Callable[[list[str]], str | None]
"""Runs a command and returns its standard output, or None when it could not run."""


@dataclass(frozen=True, kw_only=True)
class BoardReading:
    """What the driver said of one GPU."""

    power_limit_w: float | None
    """The enforced power limit in watts."""
    sm_clock_mhz: float | None
    """The SM clock at the moment of reading (MHz)."""
    max_sm_clock_mhz: float | None
    """The highest SM clock the board allows (MHz)."""


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _number(text: str) -> float | None:
    try:
        v = float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None
    return v if v > 0 else None


def read_board(ident: str, run: Runner = _run) -> BoardReading | None:
    """The driver's reading of the GPU ``ident`` (its UUID ``GPU-…``, which ``CUDA_VISIBLE_DEVICES`` does not
    renumber, or a physical index), or None when nothing usable came back."""
    out = run([*QUERY, f"--id={ident}"])
    if not out or not out.strip():
        return None
    fields = out.strip().splitlines()[0].split(",")
    if len(fields) != 3:
        return None
    power, clock, top = (_number(f) for f in fields)
    if power is None and clock is None and top is None:
        return None
    return BoardReading(power_limit_w=power, sm_clock_mhz=clock, max_sm_clock_mhz=top)


def clock_under_load(
    work: Callable[[], object], seconds: float, ident: str, run: Runner = _run, every_s: float = 0.1
) -> BoardReading | None:
    """Call ``work`` repeatedly for ``seconds`` while a thread reads the board every ``every_s``; the reading
    with the median SM clock of the samples taken while it ran (a reading that returns after the load ended is
    dropped; the first quarter, while the clock settles, left out). None when fewer than :data:`MIN_SAMPLES`
    remain or the driver gave no clock. ``work`` must wait for its kernels (synchronise) so that the loop's
    time is the device's."""
    samples: list[BoardReading] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            r = read_board(ident, run)
            if r is not None and r.sm_clock_mhz is not None and not stop.is_set():  # still under load
                samples.append(r)
            stop.wait(every_s)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            work()
    finally:
        stop.set()
        t.join(timeout=5)
    kept = samples[len(samples) // 4 :]
    if len(kept) < MIN_SAMPLES:
        return None
    mid = statistics.median_low([r.sm_clock_mhz or 0.0 for r in kept])
    return next(r for r in kept if r.sm_clock_mhz == mid)
