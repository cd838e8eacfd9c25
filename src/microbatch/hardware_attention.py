"""The flash-attention figures of the accelerator table: each family's causal ceiling f∞ (a share of its bf16 peak)
and, where its kernels ramp more slowly than the FA2 H100 curves the shape comes from, its ramp k (the curves read
at s/k: :func:`microbatch.predict.attention.flash_shape_factor`'s s₀ stretched k times). Pure constants with their
sources; :mod:`microbatch.hardware` builds its rows from them and :func:`microbatch.predict.attention.attention_ceiling`
reads the per-kernel ones.
"""

from __future__ import annotations

__all__ = [
    "AMPERE", "ATTENTION_SOURCES", "ATTN_AMPERE", "ATTN_BLACKWELL", "ATTN_HOPPER", "BLACKWELL",
    "BLACKWELL_FA2", "HOPPER", "RAMP_BLACKWELL", "RAMP_FIT_FROM",
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
ATTN_BLACKWELL = 0.636
"""Causal flash ceiling on Blackwell (B200): PyTorch's SDPA on its cuDNN backend, which Transformer Engine runs there
and which torch puts first on sm90 and sm100 when its cuDNN is recent enough (``sdp_utils.cpp``
``check_prefer_cudnn_attention``: NGC containers from 25.09, pip wheels from about 2.11; older builds run SDPA's flash
backend, :data:`BLACKWELL_FA2`: state ``--attention-kernel fa2`` then). From NVIDIA/cudnn-frontend's B200 training
benchmark (``benchmark/sdpa_benchmark_training/artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv`` at 0b1577c;
torch 2.9 nv25.09, cuDNN 9.13; batch 1, 128 query and 8 K/V heads of 128, causal: forward 479, 856, 1,171, 1,332,
1,419, 1,382, 1,355 TFLOP/s and backward 371, 701, 943, 1,075, 1,109, 1,073, 1,048 at s = 2k … 128k), forward +
backward fitted minimax to :func:`~microbatch.predict.attention.flash_fwd_bwd_factor` at s/:data:`RAMP_BLACKWELL`
from 2k: 0.636 of 2,250, within 12.2% at every length from 2k (the forward alone within 21% at 2k and 10.5% from
4k, the backward within 15.4%); the kernel peaks at 32k and loses 4.5% past it, which the curve's plateau cannot
follow. Below 2k the curve is off more (+30% at 512, −8% at 1k: the benchmark's batch-1 kernels at their shortest)."""
RAMP_BLACKWELL = 7.4
"""How much more slowly cuDNN's attention reaches its plateau on a B200 than FA2 on an H100 (the curves' s₀ × 7.4;
fitted with :data:`ATTN_BLACKWELL`): its forward at 4k is 0.60 of its 32k rate, where the H100 curves' 4k is 0.92 of
their 32k. Fitted on causal d-128 kernels; carried to the unmasked ring steps, sliding windows and other head
dimensions as an assumption."""
RAMP_FIT_FROM = 2048
"""The shortest key length the ramped (B200) curves were fitted from; a calibration inverts no timing below it."""
BLACKWELL_FA2 = (0.182, 3.1)
"""(ceiling, ramp) of ``--attention-kernel fa2`` on a B200: the same benchmark's PyTorch flash backend
(``pyt_flash_attention``, SDPA's vendored FlashAttention-2: forward 242, 325, 373, 394, 404, 409, 411 and backward
186, 256, 299, 320, 331, 335, 336 TFLOP/s at 2k … 128k), forward + backward fitted the same way from 2k, within 3.2%
at every length there (the forward within 5%, the backward within 4.8%). The flash-attn package itself (the CSV's
``flash_attention`` rows, 2.7.4) runs 4-8% faster than this."""
HOPPER = ("h100-sxm", "h100-96gb", "h100-pcie", "h100-nvl", "h800", "h200")
"""The Hopper rows: the FlashAttention-3 paper's H100 SXM5 kernel figures carry to them as shares of their peak."""
AMPERE = ("a100-40gb", "a100-80gb")
"""The Ampere rows: FlashAttention-2's A100 kernel figures carry to them as shares of their peak."""
BLACKWELL = ("b200",)
"""The Blackwell rows: cudnn-frontend's B200 figures."""

ATTENTION_SOURCES = {
    ATTN_HOPPER: "; attention: causal flash ceiling 0.417 of peak (H200 SDPA measured, bench/gpu_microbench.py)",
    ATTN_AMPERE: "; attention: causal flash ceiling 0.694 of peak (FlashAttention-2's A100 benchmark)",
    ATTN_BLACKWELL: "; attention: causal flash ceiling 0.636 of peak at a 7.4x longer ramp (SDPA on cuDNN, "
    "cudnn-frontend's B200 benchmark)",
}
"""The note each row's source gets for its ceiling."""
