"""Driving the probes of a tune: default timing, the memory budget by device, the prober.

On the CPU each probe runs in a child process under a hard memory limit (an over-committed
host kills a process outright, so the child is what dies); on CUDA probes run in this process
and out-of-memory is caught by type. With no budget the search uses the device's total memory
on CUDA and 80% of the available memory on the CPU (the child's hard limit).
"""

from __future__ import annotations

import os
import platform
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from microbatch.choose.config import ChoiceConfig
from microbatch.choose.tune.config import ProbeConfig
from microbatch.errors import ConfigError, ProbeTimeoutError
from microbatch.measure.hostmem import available_host_bytes
from microbatch.measure.probes import Measurement
from microbatch.measure.timing import TimingConfig
from microbatch.units import format_bytes

if TYPE_CHECKING:
    from microbatch.measure.inprocess import Probe
    from microbatch.measure.spec import ProbeSpec

__all__ = [
    "check_host_budget",
    "CPU_TIMING",
    "CUDA_TIMING",
    "Prober",
    "default_timing",
    "device_name",
    "cuda_total_bytes",
    "cpu_default_limit",
    "check_cuda_budget",
    "resolve_budget",
    "open_prober",
]

CPU_TIMING = TimingConfig(warmup=1, min_repeats=3, max_repeats=10, max_time_s=3.0, rel_tol=0.05)
"""Default timing on the CPU: short, because the CPU's knee is found at small b_m."""
CUDA_TIMING = TimingConfig(warmup=3, min_repeats=5, max_repeats=30, max_time_s=3.0, rel_tol=0.02)
"""Default timing on CUDA."""


class Prober(Protocol):
    """What the search drives: an in-process prober or a child process (same three calls)."""

    def start(self) -> None: ...

    def measure(self, micro_batch: int, *, checkpointing: bool = False) -> Measurement: ...

    def close(self) -> None: ...


SMALL_CPU = 4
"""On a CPU with this many cores or fewer, tuning defaults to one thread and the process clock.

Measured on a 2-core machine (BENCHMARKS.md, issue 18): ``tune --model small --memory-budget 4GiB
-B 256`` took 126 s with torch's threads and the wall clock (226 tokens/s at b_m 1, knee 64: the
probe's threads fought the other processes for two cores) against seconds with one thread and the
process clock; on a large machine torch's threads are what a user's run gets."""


def cpu_timing_rule(threads: int | None, clock: str | None, cores: int) -> tuple[int | None, str, bool]:
    """(threads, clock, chosen) for CPU probes: what was given, the rest from the core count
    (``chosen``: neither was given and the rule picked both). One thread with the process clock on a
    CPU of :data:`SMALL_CPU` cores or fewer; torch's threads with the wall clock above. The process
    clock adds up every thread's CPU time, so it measures a step only with one thread."""
    if threads is None and clock is None:
        return (1, "process", True) if cores <= SMALL_CPU else (None, "wall", True)
    if clock is None:
        clock = "process" if threads == 1 else "wall"
    if clock == "process" and threads is not None and threads != 1:
        raise ConfigError(
            f"clock process with threads {threads}: the process clock adds up the CPU time of every thread, "
            "so it would not measure the step; use threads=1 with clock process, or clock wall"
        )
    return (1 if clock == "process" else threads), clock, False


def default_timing(device: str) -> TimingConfig:
    """:data:`CUDA_TIMING` on a CUDA device, :data:`CPU_TIMING` elsewhere."""
    return CUDA_TIMING if device.startswith("cuda") else CPU_TIMING


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(torch.device(device)))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cpus)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def cuda_total_bytes(device: str) -> int:
    """Total memory of a CUDA device (the default budget there: a probe may use it all)."""
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[1])


def cpu_default_limit() -> int | None:
    """80% of MemAvailable: the child's hard limit when no budget is given (protects the host)."""
    avail = available_host_bytes()
    return None if avail is None else int(avail * 0.8)


def check_cuda_budget(probe: Probe, budget: int | None, device: str) -> None:
    """ConfigError when the budget is below the model's static memory on a CUDA device."""
    from microbatch.measure.inprocess import static_bytes
    from microbatch.measure.probes import TrainProbe

    if budget is None:
        return
    need = static_bytes(probe) + probe.dev.context_bytes
    if need > budget:
        raise ConfigError(
            f"memory budget {budget} bytes ({format_bytes(budget, unit='GiB')}) is below the model's static "
            f"memory on {device}: it needs at least {need} bytes ({format_bytes(need, unit='GiB')}: CUDA "
            "context, weights"
            + (", gradients and Adam's state" if isinstance(probe, TrainProbe) else "")
            + "); raise memory_budget_bytes or choose a smaller model",
            params=("memory_budget_bytes",),
        )


def resolve_budget(choice: ChoiceConfig, probe: ProbeConfig) -> tuple[ChoiceConfig, str]:
    """The choice with the default budget filled in, and where the budget came from.

    Given: ``given``; none on CUDA: the device's total (``device total``); none on the CPU with
    a child process: 80% of the available memory; else ``none``.
    """
    if choice.memory_budget_bytes is not None:
        return choice, "given"
    device = probe.device or "cpu"
    if device.startswith("cuda"):
        return replace(choice, memory_budget_bytes=cuda_total_bytes(device)), "device total"
    if not probe.in_process:
        limit = cpu_default_limit()
        if limit is not None:
            return replace(choice, memory_budget_bytes=limit), "80% of available host memory"
    return choice, "none"


def open_prober(spec: ProbeSpec, probe: ProbeConfig, budget: int | None) -> Prober:
    """The prober for ``spec``: in this process (checked against the budget on CUDA), or a
    started child process under the budget as a hard limit (it fails early on a budget below
    the static memory, or when b_m = 1 is out of memory)."""
    from microbatch.measure.childprobe import ChildProber
    from microbatch.measure.inprocess import InProcessProber
    from microbatch.measure.spec import build_probe

    if probe.in_process:
        built = build_probe(spec)
        if spec.device.startswith("cuda"):
            check_cuda_budget(built, budget, spec.device)
        return InProcessProber(built)
    child = ChildProber(spec, limit_bytes=budget, timeout_s=probe.probe_timeout_s)
    try:
        child.start()
    except ProbeTimeoutError as e:  # nothing measured: the limit is too short for this model (bad input)
        raise ConfigError(str(e), params=e.params) from None
    return child


def check_host_budget(budget: int | None, probe: ProbeConfig) -> None:
    """ConfigError when a budget given for child probes on the CPU is over what the host has available: their
    hard limit (``RLIMIT_AS`` at the budget) would then not keep them from the host's own memory."""
    device = probe.device or "cpu"
    avail = (
        None if budget is None or device.startswith("cuda") or probe.in_process else available_host_bytes()
    )
    if budget is not None and avail is not None and budget > avail:
        raise ConfigError(
            f"memory budget {format_bytes(budget)} is over the {format_bytes(avail)} this host has available: "
            "the probes' hard limit would not keep them from the host's own memory; give memory_budget_bytes "
            f"{format_bytes(avail)} or less (or none: 80% of it)",
            params=("memory_budget_bytes",),
        )
