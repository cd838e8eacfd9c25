"""The host's kernel launches: a floor under a layer's time on a GPU, added to it on a CPU (eager PyTorch).

A GPU runs kernels asynchronously, so a layer takes max(device time, host issue time): a small model
or a small micro-batch waits on the host (:mod:`microbatch.predict.latency` detects it in probes). A CPU runs
each operator where it is dispatched: the host's time adds. Host time = kernels × seconds per launch
(a ``bench-gpu`` file measures it as a real layer pays it per counted kernel). Pure functions and one measured
constant:

- :data:`LAUNCH_S_PER_KERNEL`: 6.58 µs, measured on an H200 host by ``bench/gpu_microbench.py``
  (``bench/results/h200-2026-11-30b/run1/microbench.json``, ``launch_s_per_kernel``: 2,000 eager
  in-place adds of one element, wall clock per launch). A lower bound for a real layer's kernels,
  whose Python, dispatcher and autograd work per call is larger than a bare add's.
- :func:`layer_kernels`: the kernels of one layer's forward as eager PyTorch issues them; a mixture-of-experts
  MLP's per local expert (:func:`moe_kernels`, :func:`layer_gemm_kernels`); defined in
  :mod:`microbatch.layer_kernels`, where the microbenchmark counts them too.
- :func:`launch_gap_s`: the host time a pass's device time does not cover.

Ignores CUDA graphs (which remove the host's issue time) and the backward's own count (taken as twice
the forward's: an input- and a weight-gradient kernel per GEMM, one or two per elementwise op).
"""

from __future__ import annotations

from typing import Any

from microbatch.layer_kernels import head_kernels, layer_gemm_kernels, layer_kernels, moe_kernels

__all__ = [
    "LAUNCH_S_PER_KERNEL",
    "head_kernels",
    "layer_gemm_kernels",
    "layer_kernels",
    "moe_kernels",
    "launch_gap_s",
    "host_time_s",
    "launch_floor",
]

LAUNCH_S_PER_KERNEL = 6.58e-6
"""Host seconds per eager kernel launch: measured on an H200 host (see the module docstring); the default on a CPU
too, as an assumption, where no ``bench-gpu`` file measured it there."""


def launch_gap_s(kernels: int, launch_s: float, device_s: float) -> float:
    """max(0, kernels × launch − device time): the host's issue time the device's work does not hide."""
    return max(0.0, kernels * launch_s - device_s)


def host_time_s(
    kernels: int, gemms: int, launch_s: float, device_s: float, *, cpu: bool, gemms_measured: bool
) -> float:
    """The host's launch time a pass adds to its device time ``device_s``: on a GPU what the device's work does not
    hide (:func:`launch_gap_s`); on a CPU, which runs each operator where it is dispatched, all of it, less the
    ``gemms`` launches where the GEMMs' times were measured (each timed call carried its own dispatch)."""
    if cpu:
        return (kernels - (gemms if gemms_measured else 0)) * launch_s
    return launch_gap_s(kernels, launch_s, device_s)


def launch_floor(
    shape: Any,
    acc: Any,
    efficiency: Any,
    layout: tuple[bool, int, int, int],
    passes: tuple[float, float, float],
    a2a: float = 0.0,
    rerun_share: float = 0.0,
) -> tuple[float, float, float, tuple[float, float] | None, float]:
    """(forward gap, backward gap, the weight-gradient GEMMs' launches, :attr:`LayerTime.host_slack_s`, the per-op
    recompute's gap) of a device waiting on the host, the layer laid out as ``layout`` = (flash attention, t, expert
    parallelism: E/EP local experts a GPU, ring steps), its ``passes`` = (forward, backward, per-op recompute) device
    seconds but the all-to-all ``a2a``, which is the device's too: the host issues kernels while it runs,
    max(host, device + all-to-all). The per-op recompute reruns the forward's elementwise kernels and ``rerun_share`` of
    its GEMMs' (the even-numbered matmuls, :func:`~microbatch.predict.recompute.op_recompute_gemm_share`): its own
    launches against its own device time, so a faster device never lengthens it (a sweep found the forward's gap
    carried into it: 86.3 → 89.2 ms with four times the FLOP/s).

    A GPU: the host's issue time against all the device does in the pass, exposed communication included: a layer
    takes max(host, device + exposed comm), so a faster device never makes a host-bound layer slower. A CPU runs
    each operator where it is dispatched, so the host's time adds to the compute: all the counted kernels' (those
    but the GEMMs when the GEMMs' times were measured, ``gemm_measured``: each timed call carried its own
    dispatch), no weight-gradient share. Zeros without a launch cost."""
    if not efficiency.launch_s_per_kernel:
        return 0.0, 0.0, 0.0, None, 0.0
    launch = efficiency.launch_s_per_kernel
    flash, t, ep, steps = layout
    local = shape.moe.experts // ep if shape.moe else None
    fused = efficiency.fused_elementwise
    n = layer_kernels(
        shape, flash=flash, tensor_parallel=t, fused=fused, local_experts=local, ring_steps=steps
    )
    g = layer_gemm_kernels(shape, local)
    cpu, measured = not acc.compute_units, efficiency.gemm_measured is not None
    device_s, backward_s, rerun_s = passes
    g_rerun = round(rerun_share * g)
    # what the per-op recompute does not rerun: the attention kernels and the ring's steps (their outputs saved, as
    # torchtitan's op list saves SDPA's) and the tensor-parallel collectives (the reduce-scatter saved too)
    kept = (1 + 3 * (max(1, steps) - 1) if flash else 4) + (2 if t > 1 else 0)
    return (
        host_time_s(n, g, launch, device_s + a2a, cpu=cpu, gemms_measured=measured),
        host_time_s(2 * n, 2 * g, launch, backward_s + a2a, cpu=cpu, gemms_measured=measured),
        0.0 if cpu else g * launch,
        None if cpu else (n * launch - device_s, 2 * n * launch - backward_s),
        host_time_s(n - g - kept + g_rerun, g_rerun, launch, rerun_s, cpu=cpu, gemms_measured=measured),
    )
