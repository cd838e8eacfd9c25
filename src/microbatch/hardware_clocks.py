"""The clocks the accelerator table's tensor peaks are computed at, and the sustained-clock evidence (issue 28).

One entry per part: (``sustained_clock_fraction``, the sentence its row's ``source`` carries). A datasheet
tensor peak is SMs × FLOP per clock per SM × one clock; a long dense GEMM at the power limit may hold a lower
clock. The fraction is the cited sustained clock over the datasheet's clock, 1 where no reading was found
(the sentence says so). :mod:`microbatch.hardware` builds its rows with these.

A board run below its rated power holds a lower clock under the same GEMM: :func:`power_limited_clock` scales
a row's fraction when its ``power_limit_w`` is overridden, and gives the fraction
of the H100 96 GB row, which such clusters run at 500 W of its 700 (:data:`CLOCK_H100_96GB`).
"""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.hardware_attention import BLACKWELL, HOPPER

__all__ = [
    "CLOCK_A100", "CLOCK_H100_SXM", "CLOCK_H200", "CLOCK_PCIE", "CLOCK_NVL", "CLOCK_B200", "CLOCK_H100_96GB",
    "B200_BURST_TO_SUSTAINED", "RATE_PER_CLOCK", "cited_burst_to_sustained",
    "FIXED_POWER_SHARE", "MIN_POWER_SHARE", "MAX_CLOCK_FRACTION", "MIN_CLOCK_FRACTION", "HOPPER_BURST_TO_SUSTAINED", "power_limited_clock",
]  # fmt: skip

MAX_CLOCK_FRACTION = 1.25
"""The largest ``sustained_clock_fraction`` accepted: a part may hold more than its datasheet's clock, and a
calibration's clock may be scaled up to another limit, but not past this."""

MIN_FIGURE_FRACTION = 0.001
"""The smallest share of a rating accepted for a link's achievable fraction, the attention ceiling and the attention
ramp: the lowest figure any table here holds is 0.36 (the H200's eager softmax of its bandwidth), and a thousandth is past
any kernel or link that trains; a denormal one (1e-320) overflowed a step's time to a division by zero."""
MIN_CLOCK_FRACTION = 0.1
"""The smallest ``sustained_clock_fraction`` accepted: the deepest power cap read (a GB300 at 500 W of 1,400 W,
:func:`power_limited_clock`'s citation) held 0.28 of its rate, and the lowest limit a board accepts gives 0.40 by
that law; a tenth is past any board that trains (a smaller value was read as a rate of ~1e-286 FLOP/s)."""

FIXED_POWER_SHARE = 0.2
"""Share of a board's rated power that does not move with its SMs' clock (memory, leakage, the board): an H100
SXM at P0 with 72.8 GB allocated and no kernel running draws 140-145 W of its 700 W (nvidia-smi listing in
github.com/wilicc/gpu-burn issue 114): 140 / 700 = 0.2."""


MIN_POWER_SHARE = 0.25
"""The lowest power limit a board accepts as a share of its rating: an A100's ``nvidia-smi -q`` lists "Min Power
Limit: 100.00 W" and "Max Power Limit: 400.00 W" (github.com/NVIDIA/DCGM issue 152): 0.25. Below it the driver
refuses the limit, and the clock law below would run towards 0."""


RATE_PER_CLOCK = 14.7 / 19.6
"""How much of a clock's relative fall a dense kernel's rate follows: 0.75 (FlashAttention-4 on a B200 lost 14.7% of
its rate when its SM clock fell 19.6%, flashinfer PR 2899: the memory-bound share does not slow with the SMs)."""

HOPPER_BURST_TO_SUSTAINED = 1 - RATE_PER_CLOCK * (1 - 1575 / 1980)
"""The rate a dense kernel holds under a training step's sustained load over the rate it ran at in a short burst,
on a 700 W Hopper part: 0.847. Why the Hopper rows need it: their kernel terms (the GEMM shape terms of
:class:`~microbatch.predict.gemm.RooflineEfficiency`, the causal attention ceiling) were measured on an H200 by
``bench/gpu_microbench.py`` in bursts (3 + 10 calls of 0.04-3 ms per shape: at most ~40 ms of load, with host gaps
between shapes), shorter than the time a GPU runs at full power before its clock is pulled down: on a B200,
FlashAttention-4 ran at 1,425-1,450 TFLOP/s for its first 20 back-to-back calls of ~0.8 ms, throttled from the
30th and held 1,237 from the 70th, the SM clock falling from 1,965 to ~1,580 MHz (github.com/flashinfer-ai/
flashinfer PR 2899): the rate fell 0.75 of the clock's relative fall (14.7% for 19.6%). A training step is
sustained load, computation beside communication: on Hopper that holds 1,575 MHz against the 1,980 MHz a burst
runs at ("when we overlap computation and communication, the power consumption exceeded the limit, resulting in
GPU core frequency reduction (e.g. from 1980MHz to 1575 MHz)", github.com/deepseek-ai/DeepGEMM issue 120; H200s
at 700 W hold 1,500 MHz under full load, tile-ai/TileOPs issue 1587). So 1 − 0.75 × (1 − 1,575/1,980) = 0.847.
Cited, composed from two parts' figures, not measured on the table's H200: ``bench-gpu`` now times a square GEMM
in a burst and under load (``MicrobenchResult.burst_square_flops_per_s`` and
``sustained_square_flops_per_s``), whose ratio replaces it on a lent GPU. The A100 rows do not take it: their
kernel terms are the H200 fit's fractions carried over, not an A100 burst, and sit below what an A100 holds
under load (cuBLAS 8,192³ bf16 257 TFLOP/s on random inputs, thonking.ai, against the carried ~240)."""


def power_limited_clock(power_w: float, reference_w: float, rated_w: float) -> float:
    """Clock a long dense GEMM holds at a power limit ``power_w`` over the one it holds at ``reference_w``.

    The SMs' switching power is α·C·V²·f (CMOS dynamic power) and over the boost range the voltage rises
    with the clock (V ∝ f), so P − P₀ ∝ f³: f(P)/f(P_ref) = ((P − P₀)/(P_ref − P₀))^(1/3), with P₀ =
    :data:`FIXED_POWER_SHARE` × ``rated_w``. A first-order model, not a reading; it is the smaller loss: at a
    deep cap the voltage sits at its floor and the clock falls in proportion to power (a GB300 capped at 500 W
    of 1,400: 617 TFLOP/s of cuBLAS GEMM against 1,600-2,174, github.com/facebookexperimental/triton PR 2023).
    An H100 SXM at 500 W of 700: (360/560)^(1/3) = 0.863. Refuses a limit outside [:data:`MIN_POWER_SHARE` ×
    ``rated_w``, ``rated_w``], the range a board accepts.
    """
    fixed, low = FIXED_POWER_SHARE * rated_w, MIN_POWER_SHARE * rated_w
    for name, w in (("power_limit_w", power_w), ("the reference power", reference_w)):
        if not low <= w <= rated_w:
            raise ConfigError(
                f"{name} {w:g} W is outside [{low:g}, {rated_w:g}] W: a board accepts a limit from "
                f"{MIN_POWER_SHARE:g} of its rated {rated_w:g} W up to the rating; give a limit in that range"
            )
    return float(((power_w - fixed) / (reference_w - fixed)) ** (1 / 3))


# fmt: off
_NONE = "sustained clock under a long bf16 GEMM: no cited reading, fraction 1"
CLOCK_A100 = (1.0, (
    "clock: 312 = 108 SMs x 2,048 FLOP/clock x 1,410 MHz, boost = maximum (NVIDIA developer forums, 'how to "
    f"calculate the tensor core fp16 performance of H100'); TDP 400 W; {_NONE} (A100 HPL is rated at 1,305 MHz "
    "held at 400 W in FP64, glennklockwood.com/garden/peak-FLOPS; H. He, thonking.ai 'Strangely, matrix "
    "multiplications...': bf16 8192^3 cuBLAS 257 TFLOP/s on random inputs, 295 on zeros, clock not given)"))
_BURST = (
    "sustained: 0.847 of the burst rate the Hopper kernel terms were measured at (HOPPER_BURST_TO_SUSTAINED: "
    "1,575 of the 1,980 MHz a burst runs at under computation beside communication, DeepGEMM issue 120; the rate "
    "falls 0.75 of the clock, flashinfer PR 2899)")
CLOCK_H100_SXM = (HOPPER_BURST_TO_SUSTAINED, (
    "clock: 989.4 = 132 SMs x 4,096 FLOP/clock x 1,830 MHz (glennklockwood.com/garden/processors/h100; maximum "
    f"1,980 MHz); TDP 700 W; {_BURST}"))
CLOCK_H200 = (HOPPER_BURST_TO_SUSTAINED, (
    "clock: 1,830 MHz as the H100 SXM; TDP 700 W; H200s at 700 W 'cannot reliably sustain a locked 1830 MHz "
    "graphics/SM clock under full load', 1,500 is what they hold (github.com/tile-ai/TileOPs issue 1587); "
    f"{_BURST}: the table's GEMM shape terms and attention ceiling were measured on an H200 in bursts "
    "(bench/gpu_microbench.py, 13 calls per shape), which carry the burst clock, not the one a training step holds"))
CLOCK_PCIE = (HOPPER_BURST_TO_SUSTAINED, (
    "clock: 756.5 = 114 SMs x 4,096 x 1,620 MHz, the whitepaper's tensor boost (board maximum 1,755; NVIDIA "
    f"forums, as A100); TDP 350 W (product brief PB-11133-001); {_BURST}, the Hopper kernel terms carried to "
    "this card: at half the SXM's power it may lose more (reanimator/bee's clock notes: 1,384 MHz average in a "
    "chassis 'not designed for it', thermal)"))
CLOCK_NVL = (HOPPER_BURST_TO_SUSTAINED, (
    "clock: 835.5 = 132 SMs x 4,096 x 1,545 MHz, below the 1,785 MHz maximum (fp32's 60 is at ~1,775); dense = "
    f"the sparse figure halved; TDP 350-400 W, 400 taken; {_BURST}, the Hopper kernel terms carried to this card "
    "(at its lower power it may lose more)"))
B200_BURST_TO_SUSTAINED = 1237 / ((1425 + 1450) / 2)
"""The rate a dense kernel holds on a B200 under sustained load over its rate in a burst: 0.861, read on the part
itself: FlashAttention-4 back to back on a B200 ran at 1,425-1,450 TFLOP/s for its first 20 calls of ~0.8 ms and
held 1,237 from the 70th, the SM clock falling from 1,965 to ~1,580 MHz (github.com/flashinfer-ai/flashinfer PR
2899). The B200 row's kernel terms are burst figures: its attention is cudnn-frontend's B200 benchmark, whose script
inserts delays between calls to keep the GPU from throttling (its README), and its GEMM terms are the H200 fit's
burst-measured fractions carried over."""
CLOCK_B200 = (B200_BURST_TO_SUSTAINED, (
    "clock: 2,250 = 148 SMs x 8,192 x ~1,860 MHz, the 'tensor clock' hmc-tech.com lists (boost 1,980; 8,192 per "
    "SM inferred from the peak); TDP 1,000 W (HGX B200); sustained: 0.861 of the burst rate its kernel terms were "
    "measured at (B200_BURST_TO_SUSTAINED: FlashAttention-4 back to back on a B200 held 1,237 TFLOP/s of the "
    "1,425-1,450 its first calls ran at, flashinfer PR 2899)"))
CLOCK_H100_96GB = (HOPPER_BURST_TO_SUSTAINED * power_limited_clock(500, 700, 700), (
    "clock: 1,830 MHz as the H100 SXM; TDP 700 W (the top of the power sweep arXiv 2604.11391 ran on these "
    "boards), run at 500 W: 0.863 of the clock held at 700 W by power_limited_clock (f ∝ (P - P0)^(1/3), P0 = "
    f"140 W), a model, not a reading, on top of the SXM's {_BURST}; override power_limit_w with 700 for the full "
    "limit"))
# fmt: on


def cited_burst_to_sustained(name: str) -> tuple[str, float] | None:
    """(whose figure, the factor) of the cited sustained over burst rate for accelerator row ``name``: the Hopper
    rows' :data:`HOPPER_BURST_TO_SUSTAINED`, the B200's :data:`B200_BURST_TO_SUSTAINED`; None where none was read."""
    if name in HOPPER:
        return "Hopper rows'", HOPPER_BURST_TO_SUSTAINED
    return ("B200 row's", B200_BURST_TO_SUSTAINED) if name in BLACKWELL else None
