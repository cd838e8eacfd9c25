"""The attention core under a flash-attention kernel: its own rate curve, not the GEMM efficiency.

A flash kernel (Dao et al. 2022, 2023) never writes the s×s scores to memory; its time is its FLOPs
over the rate the kernel reaches, and that rate is far below a large GEMM's: the softmax between the
two matmuls, the causal mask's diagonal blocks and the kernel's own prologue cost it. Three terms,
each a pure function:

- :func:`causal_flash_flops`: a causal kernel skips the blocks above the diagonal, so it runs half
  of the full-matrix FLOPs that :func:`~microbatch.predict.roofline.layer_forward_flops` counts
  (the convention of Narayanan et al. 2021 and of the MFU figures, kept there).
- :func:`flash_backward_flops`: the backward runs five matmuls (S = QKᵀ recomputed, dV = PᵀdO,
  dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q) against the forward's two: 5/2 of the forward's FLOPs
  (FlashAttention-2, Dao 2023, Algorithm 2; the flash-attention repository's benchmark counts the
  backward the same way).
- :func:`flash_rate_fraction`: the share of the accelerator's peak the kernel reaches at key length
  s, ``f∞ · s / (s + s₀)``, with f∞ the accelerator's ``Accelerator.attention_fraction`` (the
  ceiling, cited in each row) and s₀ = :data:`FLASH_SEQ_HALF` (the ramp, from kernel benchmarks).

What it ignores: the head dimension (kernels at d = 64 reach less than at d = 128), a backward rate
below the forward's (both taken at one rate), the SDPA backend a framework picks (cuDNN or FA3 on
Hopper reach more than the FA2-class kernel the ceilings describe). Pure Python: no torch.
"""

from __future__ import annotations

__all__ = [
    "FLASH_SEQ_HALF",
    "FLASH_BACKWARD_RATIO",
    "FA3_HOPPER_CEILING",
    "causal_flash_flops",
    "flash_backward_flops",
    "flash_rate_fraction",
    "flash_attention_times_s",
]

FLASH_SEQ_HALF = 241.0
"""s₀: the key length at which a flash-attention kernel reaches half its long-sequence rate (tokens).

From an H100 kernel benchmark, not a step time: pytorch/benchmark pull request 2391 (tritonbench
``flash_attention``, d_head 128, B·s = 16,384 tokens, H·d = 2,048) lists the Triton tutorial's FA2
kernel at 329, 390, 434, 458, 471, 477 TFLOP/s and FlashAttention-3 at 430, 517, 566, 590, 614, 621 TFLOP/s
for s = 512 … 16,384. Fitting R·s/(s + s₀) through the two ends gives s₀ = 241 for FA2 (512 and
16,384) and 241 for FA3 (512 and 8,192); every other point of both kernels lies within 1.5% of the curve."""

FA3_HOPPER_CEILING = 0.639
"""Ceiling of a Hopper-specific kernel (FlashAttention-3; cuDNN's fused attention, which Transformer Engine
runs under Megatron-core and NeMo, is taken to be of its class — an assumption, not a measurement): the
same benchmark's FA3 curve R·s/(s + s₀) has R = 632 TFLOP/s, 0.639 of the H100 SXM's 989.4 (forward,
not causal: optimistic for a causal backward). Give it with ``--gpu-set attention_fraction=0.639``; the
accelerator rows carry the FA2-class ceiling PyTorch's SDPA reaches."""

FLASH_BACKWARD_RATIO = 2.5
"""Backward / forward FLOPs of a flash kernel: 5 matmuls against 2 (FlashAttention-2 Algorithm 2)."""


def causal_flash_flops(full_flops: float) -> float:
    """FLOPs a causal flash kernel runs: half of the full s×s count (the blocks above the diagonal skipped)."""
    return full_flops / 2.0


def flash_backward_flops(forward_flops: float) -> float:
    """FLOPs of a flash kernel's backward: 5/2 × its forward's (:data:`FLASH_BACKWARD_RATIO`)."""
    return FLASH_BACKWARD_RATIO * forward_flops


def flash_rate_fraction(seq: float, ceiling: float, seq_half: float = FLASH_SEQ_HALF) -> float:
    """Share of peak FLOP/s a flash kernel reaches at key length ``seq``: ceiling · s / (s + s₀)."""
    if seq <= 0:
        return 0.0
    return ceiling * seq / (seq + seq_half)


def flash_attention_times_s(
    full_flops: float, seq: float, peak_flops_per_s: float, ceiling: float
) -> tuple[float, float]:
    """(forward, backward) seconds of a causal flash-attention core whose full-matrix FLOPs are ``full_flops``.

    forward = (F/2) / (peak · f(s)); backward = 5/2 × that (:func:`causal_flash_flops`,
    :func:`flash_backward_flops`, :func:`flash_rate_fraction`). The memory side (reading Q, K, V and
    writing O) is the caller's roofline bound.
    """
    rate = peak_flops_per_s * flash_rate_fraction(seq, ceiling)
    if rate <= 0:
        return 0.0, 0.0
    forward = causal_flash_flops(full_flops) / rate
    return forward, flash_backward_flops(forward)
