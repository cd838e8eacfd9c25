"""The host's kernel launches as a floor under a layer's time on a GPU (eager PyTorch).

A GPU runs kernels asynchronously, so a layer takes max(device time, host issue time): a small model
or a small micro-batch waits on the host (:mod:`microbatch.predict.latency` detects it in probes).
Host time = kernels × seconds per launch. Two pure functions and one count:

- :data:`LAUNCH_S_PER_KERNEL`: 6.58 µs, measured on an H200 host by ``bench/gpu_microbench.py``
  (``bench/results/h200-2026-11-30b/run1/microbench.json``, ``launch_s_per_kernel``: 2,000 eager
  in-place adds of one element, wall clock per launch). A lower bound for a real layer's kernels,
  whose Python, dispatcher and autograd work per call is larger than a bare add's.
- :func:`layer_kernels`: the kernels of one layer's forward as eager PyTorch issues them.
- :func:`launch_gap_s`: the host time a pass's device time does not cover.

Ignores CUDA graphs (which remove the host's issue time) and the backward's own count (taken as twice
the forward's: an input- and a weight-gradient kernel per GEMM, one or two per elementwise op).
"""

from __future__ import annotations

from microbatch.model import ModelShape

__all__ = ["LAUNCH_S_PER_KERNEL", "layer_gemm_kernels", "layer_kernels", "launch_gap_s"]

LAUNCH_S_PER_KERNEL = 6.58e-6
"""Host seconds per eager kernel launch: measured on an H200 host (see the module docstring)."""


def layer_kernels(shape: ModelShape, *, flash: bool, tensor_parallel: int, fused: bool) -> int:
    """Kernels of one layer's forward: GEMMs, attention, elementwise ops, tensor-parallel collectives.

    GEMMs: QKV, output projection, the MLP's up (two for a gated MLP: gate and up, as Llama's code runs
    them) and down projections. Attention: one flash kernel, or four unfused (QKᵀ, softmax, dropout, ·V).
    Elementwise, eager: two norms, two residual adds, the activation (and the gate's multiply), dropout
    twice when the model trains with it; fused or compiled (``fused``): three (the norms fused with the
    adds, the activation with its multiply). Rotary embeddings (not with learned positions): five eager
    kernels on each of Q and K (q·cos, the negation and concatenation of rotate_half, ·sin, the add: Hugging
    Face Llama's ``apply_rotary_pos_emb``), one fused kernel on each (Megatron-core's and Transformer
    Engine's fused RoPE). Two collectives per layer with t > 1.
    """
    gated = bool(shape.gated_mlp)
    gemms = layer_gemm_kernels(shape)
    attention = 1 if flash else 4
    if fused:
        elementwise = 3
    else:
        elementwise = 2 + 2 + (2 if gated else 1) + (2 if shape.dropout else 0)
    rotary = 0 if shape.learned_positions else (2 if fused else 10)
    return gemms + attention + elementwise + rotary + (2 if tensor_parallel > 1 else 0)


def layer_gemm_kernels(shape: ModelShape) -> int:
    """GEMM kernels of one layer's forward: QKV, output projection, the MLP's up (gate and up when gated) and
    down; the backward runs one weight-gradient GEMM for each (the W pass of a split backward)."""
    return 4 + (1 if shape.gated_mlp else 0)


def launch_gap_s(kernels: int, launch_s: float, device_s: float) -> float:
    """max(0, kernels × launch − device time): the host's issue time the device's work does not hide."""
    return max(0.0, kernels * launch_s - device_s)
