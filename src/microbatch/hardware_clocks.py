"""The clocks the accelerator table's tensor peaks are computed at, and the sustained-clock evidence (issue 28).

One entry per part: (``sustained_clock_fraction``, the sentence its row's ``source`` carries). A datasheet
tensor peak is SMs × FLOP per clock per SM × one clock; a long dense GEMM at the power limit may hold a lower
clock. The fraction is the cited sustained clock over the datasheet's clock, 1 where no reading was found
(the sentence says so). :mod:`microbatch.hardware` builds its rows with these.
"""

from __future__ import annotations

__all__ = ["CLOCK_A100", "CLOCK_H100_SXM", "CLOCK_H200", "CLOCK_PCIE", "CLOCK_NVL", "CLOCK_B200"]

# fmt: off
_NONE = "sustained clock under a long bf16 GEMM: no cited reading, fraction 1"
CLOCK_A100 = (1.0, (
    "clock: 312 = 108 SMs x 2,048 FLOP/clock x 1,410 MHz, boost = maximum (NVIDIA developer forums, 'how to "
    f"calculate the tensor core fp16 performance of H100'); TDP 400 W; {_NONE} (A100 HPL is rated at 1,305 MHz "
    "held at 400 W in FP64, glennklockwood.com/garden/peak-FLOPS; H. He, thonking.ai 'Strangely, matrix "
    "multiplications...': bf16 8192^3 cuBLAS 257 TFLOP/s on random inputs, 295 on zeros, clock not given)"))
CLOCK_H100_SXM = (1.0, (
    "clock: 989.4 = 132 SMs x 4,096 FLOP/clock x 1,830 MHz (glennklockwood.com/garden/processors/h100; maximum "
    f"1,980 MHz); TDP 700 W; {_NONE} (nearest: the H200's, same die and limit, 0.82, not applied there either)"))
CLOCK_H200 = (1.0, (
    "clock: 1,830 MHz as the H100 SXM; TDP 700 W; sustained 1,500 MHz: H200s at 700 W 'cannot reliably sustain "
    "a locked 1830 MHz graphics/SM clock under full load', 1,500 is what they hold (github.com/tile-ai/TileOPs "
    "issue 1587): 1,500/1,830 = 0.820, a lower bound (the sustained clock lies in 1,500-1,830 MHz); NOT applied "
    "(fraction 1): the table's GEMM shape terms and the Hopper attention ceiling were measured on an H200 "
    "(bench/gpu_microbench.py, seconds-long kernels) and already carry the clock it held, so 0.82 on top would "
    "count it twice"))
CLOCK_PCIE = (1.0, (
    "clock: 756.5 = 114 SMs x 4,096 x 1,620 MHz, the whitepaper's tensor boost (board maximum 1,755; NVIDIA "
    f"forums, as A100); TDP 350 W (product brief PB-11133-001); {_NONE} (reanimator/bee's clock notes: 1,384 "
    "MHz average in a chassis 'not designed for it', thermal)"))
CLOCK_NVL = (1.0, (
    "clock: 835.5 = 132 SMs x 4,096 x 1,545 MHz, below the 1,785 MHz maximum (fp32's 60 is at ~1,775); dense = "
    f"the sparse figure halved; TDP 350-400 W, 400 taken; {_NONE}"))
CLOCK_B200 = (1.0, (
    "clock: 2,250 = 148 SMs x 8,192 x ~1,860 MHz, the 'tensor clock' hmc-tech.com lists (boost 1,980; 8,192 per "
    f"SM inferred from the peak); TDP 1,000 W (HGX B200); {_NONE}"))
# fmt: on
