"""The flash-attention figures of the accelerator table: each family's causal ceiling f∞ (a share of its bf16 peak)
and, where its kernels ramp more slowly than the FA2 H100 curves the shape comes from, its ramp k (the curves read
at s/k: :func:`microbatch.predict.attention.flash_shape_factor`'s s₀ stretched k times). Pure constants with their
sources; :mod:`microbatch.hardware` builds its rows from them and :func:`microbatch.predict.attention.attention_ceiling`
reads the per-kernel ones.
"""

from __future__ import annotations

__all__ = [
    "AMPERE", "ATTENTION_SOURCES", "ATTN_AMPERE", "ATTN_BLACKWELL", "ATTN_HOPPER", "BLACKWELL",
    "BLACKWELL_FA2", "HOPPER", "RAMP_BLACKWELL",
]  # fmt: skip

ATTN_HOPPER = 0.417
"""Causal flash-attention ceiling on Hopper: 0.348 of the bf16 peak measured on an H200 by ``bench/gpu_microbench.py``
(``bench/results/h200-2026-11-30b/run1/microbench.json``: PyTorch SDPA, is_causal, s 2,048, 32 heads of 128, the
causal half of the FLOPs counted), over the causal forward's ramp 2,048/(2,048 + 404) at d = 128
(:data:`microbatch.predict.attention.FA2_CURVES`): 0.348 × 2,452/2,048 = 0.417. Carried to the other Hopper parts as a
share of their own peak (an assumption: the PCIe and NVL cards' lower power limits may cost more)."""
ATTN_AMPERE = 0.694
"""Causal flash ceiling on Ampere: FlashAttention-2 on an A100 80GB SXM4 (causal d-128 forward + backward, 99, 133,
155, 173, 182, 189 TFLOP/s at s 512 ... 16k: its ``assets/flash2_a100_fwd_bwd_benchmark.png``) fitted to the curves'
forward + backward (:func:`~microbatch.predict.attention.flash_fwd_bwd_factor`): 0.694 of 312. SDPA's flash is FA2."""
ATTN_BLACKWELL = 0.597
"""Causal flash ceiling on Blackwell (B200): PyTorch's SDPA on its cuDNN backend, which torch puts first on sm90 and
sm100 with a recent cuDNN (``sdp_utils.cpp`` ``check_prefer_cudnn_attention``) and Transformer Engine runs there:
NVIDIA/cudnn-frontend's B200 training benchmark (``benchmark/sdpa_benchmark_training/artifacts/
sdpa_bf16_benchmark_results_NVIDIA_B200.csv`` at 0b1577c; torch 2.9 nv25.09, cuDNN 9.13; batch 1, 128 query and 8
K/V heads of 128, causal: forward 856, 1,171, 1,332, 1,419, 1,382, 1,355 TFLOP/s and backward 701, 943, 1,075, 1,109,
1,073, 1,048 at s = 4k … 128k), forward + backward fitted to :func:`~microbatch.predict.attention.flash_fwd_bwd_factor`
at s/:data:`RAMP_BLACKWELL`: 0.597 of 2,250, within 6.7% at every length (the forward alone within 10%, the
backward within 10%: the kernel peaks at 32k and loses 4-5% beyond, which the curve's plateau cannot follow)."""
RAMP_BLACKWELL = 4.4
"""How much more slowly cuDNN's attention reaches its plateau on a B200 than FA2 on an H100 (the curves' s₀ × 4.4;
fitted with :data:`ATTN_BLACKWELL`): 856 TFLOP/s at 4k is 0.60 of its 32k rate, where the H100 curves are at 0.91."""
BLACKWELL_FA2 = (0.177, 2.4)
"""(ceiling, ramp) of FlashAttention-2 on a B200: the same benchmark's PyTorch flash backend (``pyt_flash_attention``,
flash-attn 2 kernels: forward 325, 373, 394, 404, 409, 411 and backward 256, 299, 320, 331, 335, 336 TFLOP/s at 4k
… 128k), forward + backward fitted the same way, within 1.3% at every length (the forward within 4.5%)."""
HOPPER = ("h100-sxm", "h100-96gb", "h100-pcie", "h100-nvl", "h800", "h200")
"""The Hopper rows: the FlashAttention-3 paper's H100 SXM5 kernel figures carry to them as shares of their peak."""
AMPERE = ("a100-40gb", "a100-80gb")
"""The Ampere rows: FlashAttention-2's A100 kernel figures carry to them as shares of their peak."""
BLACKWELL = ("b200",)
"""The Blackwell rows: cudnn-frontend's B200 figures."""

ATTENTION_SOURCES = {
    ATTN_HOPPER: "; attention: causal flash ceiling 0.417 of peak (H200 SDPA measured, bench/gpu_microbench.py)",
    ATTN_AMPERE: "; attention: causal flash ceiling 0.694 of peak (FlashAttention-2's A100 benchmark)",
    ATTN_BLACKWELL: "; attention: causal flash ceiling 0.597 of peak at a 4.4x longer ramp (SDPA on cuDNN, "
    "cudnn-frontend's B200 benchmark)",
}
"""The note each row's source gets for its ceiling."""
