"""The attention core under a flash-attention kernel: its own rate curve, not the GEMM efficiency.

A flash kernel (Dao et al. 2022, 2023) never writes the s×s scores to memory; its time is its FLOPs
over the rate the kernel reaches, and that rate is far below a large GEMM's: the softmax between the
two matmuls, the causal mask's diagonal blocks and the kernel's own prologue cost it. Four terms,
each a pure function:

- :func:`causal_flash_flops`: a causal kernel skips the blocks above the diagonal, so it runs half
  of the full-matrix FLOPs that :func:`~microbatch.predict.roofline.layer_forward_flops` counts
  (the convention of Narayanan et al. 2021 and of the MFU figures, kept there).
- :func:`flash_backward_flops`: the backward runs five matmuls (S = QKᵀ recomputed, dV = PᵀdO,
  dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q) against the forward's two: 5/2 of the forward's FLOPs
  (FlashAttention-2, Dao 2023, Algorithm 2; the flash-attention repository's benchmark counts the
  backward the same way).
- :func:`flash_shape_factor`: how the kernel's rate moves with key length s, head dimension d, causal
  masking and direction, relative to its long-sequence causal forward rate at d = 128: the FA2 kernel's
  published curves (:data:`FA2_CURVES`), each ``R·s/(s + s₀)``.
- :func:`flash_rate_fraction`: the share of the accelerator's peak the kernel reaches, f∞ × that factor,
  with f∞ the accelerator's ``Accelerator.attention_fraction`` (the causal forward ceiling at d = 128,
  cited in each row).

What it ignores: head dimensions outside 64–128 (taken at the nearer end: no FA2 causal figure for
d = 256 was read), the causal backward (not published: its curve is composed from the causal forward's
and the non-causal backward's, see :data:`FA2_CURVES`), the SDPA backend a framework picks (cuDNN or FA3
on Hopper reach more than the FA2-class kernel the Hopper row describes: :data:`CUDNN_HOPPER_CEILING`,
:data:`FA3_HOPPER_CEILING`; the B200 row is cuDNN's, at its own ramp: ``Accelerator.attention_ramp``).
Pure Python: no torch.
"""

from __future__ import annotations

import math

__all__ = [
    "FA2_CURVES",
    "FLASH_SEQ_HALF",
    "FLASH_BACKWARD_RATIO",
    "FA3_HOPPER_CEILING",
    "CUDNN_HOPPER_CEILING",
    "CUDNN_919_HOPPER",
    "FA2_HOPPER_CEILING",
    "TRITON_AMPERE_CEILING",
    "EFFICIENT_AMPERE_CEILING",
    "ATTENTION_KERNELS",
    "attention_ceiling",
    "kernel_figures",
    "causal_flash_flops",
    "flash_backward_flops",
    "flash_shape_factor",
    "flash_rate_fraction",
    "flash_fwd_bwd_factor",
    "flash_attention_times_s",
]

FA2_CURVES: dict[tuple[int, bool, bool], tuple[float, float]] = {
    (64, False, False): (327.0, 78.0),
    (128, False, False): (377.0, 104.0),
    (64, True, False): (308.0, 359.0),
    (128, True, False): (350.0, 404.0),
    (64, False, True): (296.0, 252.0),
    (128, False, True): (329.0, 274.0),
}
"""(R TFLOP/s, s₀ tokens) of FlashAttention-2 on an H100 SXM5 (bf16, B·s = 16k tokens, H·d = 2,048) by
(head dim, causal, backward): least-squares fits of R·s/(s + s₀) to the FA2 bars of FlashAttention-3's
Figures 5 and 6 (Shah et al. 2024, arXiv 2407.08608), s = 512 … 16k. Forward, not causal, d 64: 282, 306, 318,
321, 322, 324; d 128: 309, 350, 362, 368, 370, 370. Forward, causal, d 64: 180, 229, 262, 284, 295, 299; d 128:
191, 260, 298, 319, 333, 335. Backward, not causal, d 64: 198, 238, 264, 279, 287, 291; d 128: 214, 260, 291,
310, 318, 322. Every point lies within 3.5% of its curve (within 2% but the causal d-128 forward's). A kernel
benchmark, not a step time. The causal mask lengthens the ramp (s₀ 78–104 → 359–404: the diagonal blocks'
masking and their load imbalance), d = 64 lowers the plateau (0.87 of d = 128 forward, 0.90 backward), the
backward runs at 0.87 of the forward's rate. No causal backward is published there: its curve is taken as
the non-causal backward's with the causal forward's ratio of plateaus and its added s₀
(:func:`flash_shape_factor`)."""

_REFERENCE = (128, True, False)
"""The curve the accelerator ceilings describe: causal forward at d = 128."""

FLASH_SEQ_HALF = FA2_CURVES[_REFERENCE][1]
"""s₀ of the reference curve (causal forward, d = 128): 404 tokens. A measured causal d-128 forward fraction
f(s) gives the ceiling f∞ = f(s)·(s + s₀)/s (:func:`flash_shape_factor` is s/(s + s₀) there)."""

FA3_HOPPER_CEILING = 0.625
"""Ceiling of FlashAttention-3 on Hopper: the FA3 bars of the causal d-128 forward in FlashAttention-3's
Figure 5 (292, 423, 521, 579, 602, 616 TFLOP/s for s = 512 … 16k) fitted to R·s/(s + 404), the FA2 causal
ramp: R = 618 TFLOP/s, 0.625 of the H100 SXM's 989.4 (within 5% from s = 1k, 18% over at 512). Give it with
``--attention-kernel fa3``; the accelerator rows carry the FA2-class ceiling PyTorch's SDPA reaches."""

CUDNN_HOPPER_CEILING = 0.570
"""Ceiling of cuDNN's fused attention on Hopper, the kernel Transformer Engine runs there (``DotProductAttention``
selects FusedAttention over flash-attn on sm90 from TE v1.4: "Select FusedAttention on sm90 and FlashAttention on
others for performance"), so under Megatron-core, NeMo and Megatron-Bridge: the cuDNN bars of the causal d-128
forward in FlashAttention-3's Figure 5 (315, 410, 484, 518, 529, 539 TFLOP/s for s = 512 … 16k; the repository's
``assets/flash3_fp16_fwd.png``) fitted to R·s/(s + 404): R = 564 TFLOP/s, 0.570 of 989.4, every point within 2.7%.
Its backward keeps the FA2 curves' ratio to the forward (Figure 6(b), not causal: cuDNN 305, 408, 465, 499, 518,
516 against its forward's 497, 574, 617, 609, 600, 595, 0.87 at 16k as FA2's 322/370 and FA3's 561/648), so
:func:`flash_shape_factor` carries. Measured with a mid-2024 cuDNN (``--attention-kernel cudnn-2024``: the NeMo and
Megatron-Core containers of 2024); cuDNN 9.19's is :data:`CUDNN_919_HOPPER`."""

CUDNN_919_HOPPER = (0.716, 2.3)
"""(ceiling, ramp) of cuDNN's fused attention on Hopper as of cuDNN 9.19 (``--attention-kernel cudnn``; the FA3-paper
figures of mid-2024 are ``cudnn-2024``, :data:`CUDNN_HOPPER_CEILING`): NVIDIA/cudnn-frontend's H200 training
benchmark (``benchmark/sdpa_benchmark_training/results/h200_919_only_cudnn/llama3.1_20260227_034703.csv`` at
3929da2; cuDNN 9.19.1, bf16, batch 1, 64 query and 8 K/V heads of 128, causal: forward 484, 591, 644, 673, 688 and
backward 370, 474, 541, 579, 581 TFLOP/s at s = 2k … 32k), forward + backward fitted minimax to
:func:`flash_fwd_bwd_factor` at s/2.3: 0.716 of 989.4, within 1.7% at every length (the forward within 2.4%, the
backward within 2.2%). 26% above the mid-2024 kernel's plateau: containers from 2025 on (Megatron-Bridge's) run
it."""

FA2_HOPPER_CEILING = 350.0 / 989.4
"""Ceiling of the FlashAttention-2 kernel itself (the ``flash-attn`` 2 package) on Hopper: the plateau R = 350
TFLOP/s of its causal d-128 forward (:data:`FA2_CURVES`, FlashAttention-3's Figure 5) over the H100 SXM's
989.4 TFLOP/s bf16 peak: 0.354. Below the 0.417 PyTorch's SDPA reached on an H200 with torch 2.11 (the
accelerator rows' ceiling), above which a run's older kernels do not go."""

TRITON_AMPERE_CEILING = 0.296
"""Ceiling of the Triton FlashAttention kernel (the flash-attention repository's ``flash_attn_triton.py``, the kernel
behind MosaicML llm-foundry's ``attn_impl: triton``) on Ampere: its bars in FlashAttention-2's A100 benchmark
(``assets/flash2_a100_fwd_bwd_benchmark.png``, causal d-128 forward + backward: 50, 61, 68, 74, 78, 80 TFLOP/s at
s = 512 ... 16k) fitted to :func:`flash_fwd_bwd_factor` from 2k: 0.296 of 312, within 2.3% there; its ramp is flatter
than FA2's, so the curve falls under its bars below 2k (18% under at 512, 10% at 1k). Its d-64 bars hold at d-128's
level where FA2's drop: a d-64 model runs it 1.09-1.12× faster than this predicts from 4k, up to 1.5× at 512. No
Hopper figure was read: refused there."""

EFFICIENT_AMPERE_CEILING = 0.347
"""Ceiling of xformers' cutlass memory-efficient kernel, which PyTorch's SDPA runs as its EFFICIENT_ATTENTION backend
where flash cannot run (fp32, some head dims), on Ampere, causal: the "xformers" bars of FlashAttention-2's A100
benchmark (the script at that release calls ``xops.fmha.cutlass.FwOp/BwOp``; causal d-128 forward + backward: 58, 72,
82, 87, 91, 92 TFLOP/s at s = 512 ... 16k) fitted to :func:`flash_fwd_bwd_factor` from 2k: 0.347 of 312, within 5%
there (17% under at 512); its unmasked d-128 bars within 6.5% from 2k. At d 64 it loses more than FA2 does: the
curve is 8-28% over its d-64 bars from 2k. Not modelled: an explicit attention mask (as padded Hugging Face batches
pass), under which the kernel computes the whole s×s matrix and reads the mask — about twice this time and more.
No Hopper figure was read: refused there."""

ATTENTION_KERNELS = ("sdpa", "fa2", "cudnn", "cudnn-2024", "fa3", "triton", "efficient")
"""Attention kernel classes a plan can name: ``sdpa`` (the accelerator row's ceiling: PyTorch's
scaled_dot_product_attention as measured, or FA2's own figures on Ampere, SDPA's flash backend there), ``fa2``
(:data:`FA2_HOPPER_CEILING`; the row's on Ampere), ``cudnn`` (cuDNN's fused attention, Transformer Engine's on Hopper,
as of cuDNN 9.19: :data:`CUDNN_919_HOPPER`), ``cudnn-2024`` (the same in mid-2024 containers:
:data:`CUDNN_HOPPER_CEILING`), ``fa3`` (FlashAttention-3, :data:`FA3_HOPPER_CEILING`), ``triton`` (the Triton flash
kernel, Ampere only: :data:`TRITON_AMPERE_CEILING`), ``efficient`` (SDPA's memory-efficient backend, xformers'
cutlass kernel, causal, Ampere only: :data:`EFFICIENT_AMPERE_CEILING`). On the B200 row ``sdpa`` and ``cudnn`` are
cuDNN's and ``fa2`` SDPA's flash backend (:mod:`microbatch.hardware_attention`), each at its own ramp."""


def attention_ceiling(kernel: str, accelerator: str, row_ceiling: float | None) -> float | None:
    """The causal flash ceiling f∞ of attention kernel class ``kernel`` on ``accelerator``: the first of
    :func:`kernel_figures`."""
    return kernel_figures(kernel, accelerator, row_ceiling)[0]


def kernel_figures(
    kernel: str, accelerator: str, row_ceiling: float | None, row_ramp: float = 1.0
) -> tuple[float | None, float]:
    """(ceiling f∞, ramp k) of attention kernel class ``kernel`` on ``accelerator``.

    ``sdpa`` keeps the row's own (``row_ceiling``, ``row_ramp``); ``fa2``, ``cudnn`` and ``fa3`` are the
    FlashAttention-3 paper's H100 SXM5 figures, carried to the Hopper rows (:data:`microbatch.hardware.HOPPER`) as a
    share of their peak; on the Ampere rows (:data:`microbatch.hardware.AMPERE`) ``fa2`` is the row's own
    (FlashAttention-2's A100 figures), ``triton`` :data:`TRITON_AMPERE_CEILING` and ``efficient``
    :data:`EFFICIENT_AMPERE_CEILING`; on the Blackwell rows ``cudnn`` is the row's own (cudnn-frontend's B200
    benchmark) and ``fa2`` :data:`microbatch.hardware_attention.BLACKWELL_FA2` with its own ramp. Elsewhere no such
    figure was read, and the error says how to give one.
    """
    from microbatch.errors import ConfigError
    from microbatch.hardware_attention import AMPERE, BLACKWELL, BLACKWELL_FA2, HOPPER

    if kernel not in ATTENTION_KERNELS:
        raise ConfigError(
            f"attention_kernel {kernel!r} is not known; use one of {', '.join(ATTENTION_KERNELS)}",
            params=("attention_kernel",),
        )
    row = (row_ceiling, row_ramp)
    families: tuple[tuple[tuple[str, ...], dict[str, tuple[float | None, float]]], ...] = (
        (HOPPER, {"fa2": (FA2_HOPPER_CEILING, 1.0), "cudnn": CUDNN_919_HOPPER,
                  "cudnn-2024": (CUDNN_HOPPER_CEILING, 1.0), "fa3": (FA3_HOPPER_CEILING, 1.0)}),
        (AMPERE, {"fa2": row, "triton": (TRITON_AMPERE_CEILING, 1.0), "efficient": (EFFICIENT_AMPERE_CEILING, 1.0)}),
        (BLACKWELL, {"cudnn": row, "fa2": BLACKWELL_FA2}),
    )  # fmt: skip
    if kernel == "sdpa":
        return row
    for rows, kernels in families:
        if accelerator in rows and kernel in kernels:
            return kernels[kernel]
    where = [r for rows, kernels in families if kernel in kernels for r in rows]
    raise ConfigError(
        f"attention_kernel {kernel} has a published ceiling only on {', '.join(where)}, not on {accelerator}; "
        "use attention_kernel sdpa, or give the kernel's share of the peak as the accelerator's attention_fraction "
        "(and its ramp over the H100 curves' as attention_ramp)",
        params=("attention_kernel",),
    )


FLASH_BACKWARD_RATIO = 2.5
"""Backward / forward FLOPs of a flash kernel: 5 matmuls against 2 (FlashAttention-2 Algorithm 2)."""


def causal_flash_flops(full_flops: float) -> float:
    """FLOPs a causal flash kernel runs: half of the full s×s count (the blocks above the diagonal skipped)."""
    return full_flops / 2.0


def flash_backward_flops(forward_flops: float) -> float:
    """FLOPs of a flash kernel's backward: 5/2 × its forward's (:data:`FLASH_BACKWARD_RATIO`)."""
    return FLASH_BACKWARD_RATIO * forward_flops


def _curve(head_dim: int, causal: bool, backward: bool) -> tuple[float, float]:
    """(R, s₀) of :data:`FA2_CURVES` at one of its head dims; the causal backward composed (see there)."""
    if causal and backward:
        r_nc, s0_nc = FA2_CURVES[(head_dim, False, True)]
        r_cf, s0_cf = FA2_CURVES[(head_dim, True, False)]
        r_nf, s0_nf = FA2_CURVES[(head_dim, False, False)]
        return r_nc * r_cf / r_nf, s0_nc + s0_cf - s0_nf
    return FA2_CURVES[(head_dim, causal, backward)]


def flash_shape_factor(seq: float, head_dim: int = 128, causal: bool = True, backward: bool = False) -> float:
    """Rate of a flash kernel at (s, d, causal, direction) over its causal forward plateau at d = 128.

    φ = (R_x / R_ref) · s / (s + s₀,x), with (R_x, s₀,x) the :data:`FA2_CURVES` entry (the causal backward:
    R = R_bwd·R_causal/R_full and s₀ = s₀,bwd + s₀,causal − s₀,full) and R_ref = 350 TFLOP/s, the causal
    forward at d = 128. Between d = 64 and 128 both R and s₀ are interpolated linearly in log₂ d; outside,
    the nearer end. 0 for s ≤ 0. At the reference and long s, φ → 1.
    """
    if seq <= 0:
        return 0.0
    w = min(1.0, max(0.0, math.log2(max(head_dim, 1) / 64)))  # 0 at d <= 64, 1 at d >= 128
    r64, s64 = _curve(64, causal, backward)
    r128, s128 = _curve(128, causal, backward)
    r, s0 = r64 + w * (r128 - r64), s64 + w * (s128 - s64)
    return r / FA2_CURVES[_REFERENCE][0] * seq / (seq + s0)


def flash_rate_fraction(
    seq: float, ceiling: float, head_dim: int = 128, causal: bool = True, backward: bool = False
) -> float:
    """Share of peak FLOP/s a flash kernel reaches: ceiling · :func:`flash_shape_factor` (s, d, causal, direction).

    ``ceiling`` is f∞ of the causal forward at d = 128 (``Accelerator.attention_fraction``).
    """
    return ceiling * flash_shape_factor(seq, head_dim, causal, backward)


def flash_fwd_bwd_factor(seq: float, head_dim: int = 128, causal: bool = True) -> float:
    """Rate of a flash kernel's forward and backward together over its ceiling: 3.5 / (1/φ_f + 2.5/φ_b).

    The forward's FLOPs F and the backward's 2.5·F (:data:`FLASH_BACKWARD_RATIO`), each at its own
    :func:`flash_shape_factor` φ: (F + 2.5·F) / (F/φ_f + 2.5·F/φ_b). What a forward + backward benchmark reports
    (the flash-attention repository's ``benchmark_flash_attention.py`` counts 3.5 × the forward's FLOPs), so a
    ceiling is fitted to such bars through it. 0 for s ≤ 0.
    """
    f, b = flash_shape_factor(seq, head_dim, causal), flash_shape_factor(seq, head_dim, causal, backward=True)
    if f <= 0 or b <= 0:
        return 0.0
    return (1 + FLASH_BACKWARD_RATIO) / (1 / f + FLASH_BACKWARD_RATIO / b)


def flash_attention_times_s(
    full_flops: float,
    seq: float,
    peak_flops_per_s: float,
    ceiling: float,
    head_dim: int = 128,
    causal: bool = True,
) -> tuple[float, float]:
    """(forward, backward) seconds of a flash-attention core whose full-matrix FLOPs are ``full_flops``.

    forward = F_k / (peak · f_fwd(s, d)); backward = 5/2 · F_k / (peak · f_bwd(s, d)), with F_k = F/2 when
    causal (:func:`causal_flash_flops`), F otherwise, :func:`flash_backward_flops` and each direction at its
    own :func:`flash_rate_fraction`. The memory side (reading Q, K, V and writing O) is the caller's
    roofline bound.
    """
    fwd_rate = peak_flops_per_s * flash_rate_fraction(seq, ceiling, head_dim, causal)
    bwd_rate = peak_flops_per_s * flash_rate_fraction(seq, ceiling, head_dim, causal, backward=True)
    if fwd_rate <= 0 or bwd_rate <= 0:
        return 0.0, 0.0
    kernel = causal_flash_flops(full_flops) if causal else full_flops
    return kernel / fwd_rate, flash_backward_flops(kernel) / bwd_rate
