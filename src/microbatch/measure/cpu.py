"""This machine's accelerator, measured: the CPU's fp32 matmul peak and copy bandwidth, CUDA device 0's row.

Moved out of :mod:`microbatch.hardware` (issue 31), which stays a pure table: everything here imports
torch when called (not at import) and times or queries the machine.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

from microbatch.hardware import Accelerator, cpu_accelerator, from_device_name

__all__ = ["measure_cpu", "detect_local"]


def measure_cpu(*, n: int = 1024, repeats: int = 5, threads: int | None = None) -> Accelerator:
    """This CPU as an Accelerator: the best of ``repeats`` n×n fp32 matmuls (2n³ FLOPs) with torch's
    default threads (or ``threads``), and the best of ``repeats`` copies of a 64 MiB tensor (read + write).

    Quick (well under a second) and noisy on a shared machine; the calibration absorbs the choice.
    """
    import time

    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _measure_cpu(torch, time, n, repeats)
    finally:
        torch.set_num_threads(before)


def _measure_cpu(torch: Any, time: ModuleType, n: int, repeats: int) -> Accelerator:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * n**3 / best
    x = torch.empty(16 * 2**20)
    y = torch.empty_like(x)
    y.copy_(x)
    best_c = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        y.copy_(x)
        best_c = min(best_c, time.perf_counter() - t0)
    bw = 2.0 * x.numel() * 4 / best_c
    threads = torch.get_num_threads()
    return cpu_accelerator(
        flops_per_s=flops,
        bytes_per_s=bw,
        source=(
            f"measured here: {n}x{n} fp32 matmul {flops / 1e9:.1f} GFLOP/s, 64 MiB copy "
            f"{bw / 1e9:.1f} GB/s ({threads} thread{'' if threads == 1 else 's'})"
        ),
    )


def detect_local() -> Accelerator | None:
    """The accelerator of CUDA device 0 (imports torch), or None without CUDA or for an unknown device."""
    import torch

    if not torch.cuda.is_available():
        return None
    from microbatch.hardware_overrides import mig_slice

    props = torch.cuda.get_device_properties(0)
    acc = from_device_name(props.name, props.total_memory)
    return None if acc is None else mig_slice(acc, props.multi_processor_count, props.total_memory)
