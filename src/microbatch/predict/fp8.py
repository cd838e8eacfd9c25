"""FP8 linear layers: the casting traffic of dynamic scaling, per GEMM.

torchao's float8 training (and Transformer Engine's current scaling) computes each GEMM of a linear
layer in FP8: before the GEMM every operand is reduced to its absolute maximum (amax, one read of the
bf16 tensor), scaled and cast (one more read, one 1-byte write); the three GEMMs of a linear are
``out = x·Wᵀ`` (x and W cast), ``dx = dout·W`` (dout cast, W's transpose) and ``dW = doutᵀ·x`` (x's
transpose) (torchao "Quantized Training" docs, the fp8 pseudocode; torchtitan's float8 converter).
Only the traffic is modelled, at the memory bandwidth: forward (2e + 1)·(rows·k + k·n) bytes; backward
(2e + 1)·rows·n for dout plus the transposed copies of x and W, (e + 1) each element with one
tensorwise scale (read, write FP8) or (2e + 1) with rowwise scales (their own amax along the other axis).
Transformer Engine's recipes (``te-delayed``, ``te-current``) cast each operand once with its transpose
(e + 2 bytes an element: read, FP8, FP8 transposed; + e for the amax pass of current scaling), so the backward
casts only dout; their weights are cast once per step and cached (:func:`weight_cast_bytes`), not per GEMM.
Ignores the amax all-reduce of FSDP's precomputed scales (one per step) and kernel fusion by
``torch.compile`` (which merges some of these passes).
"""

from __future__ import annotations

from microbatch.precision import Fp8Recipe

__all__ = ["cast_bytes", "weight_cast_bytes"]


def _fused_cast(recipe: Fp8Recipe, e: int) -> int:
    """Bytes an element of one fused cast-and-transpose: its amax read (unless delayed), read, two FP8 writes."""
    return (e if recipe.amax_pass else 0) + e + 2


def cast_bytes(
    rows: float, k: float, n: float, recipe: Fp8Recipe, dtype_bytes: int = 2
) -> tuple[float, float]:
    """(forward, backward) bytes of FP8 casting for one linear GEMM ``[rows, k] × [k, n]`` each micro-batch (see
    the module): the weight's share is 0 where the recipe caches it (:func:`weight_cast_bytes`, once a step)."""
    e = dtype_bytes
    if recipe.fused_transpose:  # x (with xᵀ) forward, dout (with doutᵀ) backward, the weight once a step
        per = _fused_cast(recipe, e)
        weight = 0.0 if recipe.weight_cache else k * n
        return per * (rows * k + weight), per * rows * n
    operands = rows * k + k * n
    forward = (2 * e + 1) * operands
    transposed = (2 * e + 1) if recipe.backward_amax else (e + 1)
    backward = (2 * e + 1) * rows * n + transposed * operands
    return forward, backward


def weight_cast_bytes(k: float, n: float, recipe: Fp8Recipe, dtype_bytes: int = 2) -> float:
    """Bytes of casting one ``[k, n]`` weight to FP8 (with its transpose) once a step, where ``recipe`` caches the
    FP8 weights over the step's micro-batches; 0 where it casts them every micro-batch (in :func:`cast_bytes`)."""
    return _fused_cast(recipe, dtype_bytes) * k * n if recipe.weight_cache else 0.0
