"""FP8 linear layers: the casting traffic of dynamic scaling, per GEMM.

torchao's float8 training (and Transformer Engine's current scaling) computes each GEMM of a linear
layer in FP8: before the GEMM every operand is reduced to its absolute maximum (amax, one read of the
bf16 tensor), scaled and cast (one more read, one 1-byte write); the three GEMMs of a linear are
``out = x·Wᵀ`` (x and W cast), ``dx = dout·W`` (dout cast, W's transpose) and ``dW = doutᵀ·x`` (x's
transpose) (torchao "Quantized Training" docs, the fp8 pseudocode; torchtitan's float8 converter).
Only the traffic is modelled, at the memory bandwidth: forward (2e + 1)·(rows·k + k·n) bytes; backward
(2e + 1)·rows·n for dout plus the transposed copies of x and W, (e + 1) each element with one
tensorwise scale (read, write FP8) or (2e + 1) with rowwise scales (their own amax along the other axis).
Ignores the amax all-reduce of FSDP's precomputed scales (one per step) and kernel fusion by
``torch.compile`` (which merges some of these passes).
"""

from __future__ import annotations

from microbatch.precision import Fp8Recipe

__all__ = ["cast_bytes"]


def cast_bytes(
    rows: float, k: float, n: float, recipe: Fp8Recipe, dtype_bytes: int = 2
) -> tuple[float, float]:
    """(forward, backward) bytes of FP8 casting for one linear GEMM ``[rows, k] × [k, n]`` (see the module)."""
    e = dtype_bytes
    operands = rows * k + k * n
    forward = (2 * e + 1) * operands
    transposed = (2 * e + 1) if recipe.backward_amax else (e + 1)
    backward = (2 * e + 1) * rows * n + transposed * operands
    return forward, backward
