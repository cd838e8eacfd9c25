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

from microbatch.layer_kernels import head_kernels, layer_gemm_kernels, layer_kernels, moe_kernels

__all__ = [
    "LAUNCH_S_PER_KERNEL",
    "head_kernels",
    "layer_gemm_kernels",
    "layer_kernels",
    "moe_kernels",
    "launch_gap_s",
    "host_time_s",
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
