"""GEMM kernels on the roofline: FLOPs, bytes, and the efficiencies real kernels reach.

A GEMM ``[rows, k] × [k, n]`` moves ``rows·k + k·n + rows·n`` elements and does ``2·rows·k·n`` FLOPs
(Williams, Waterman, Patterson 2009); its time is the longer of FLOPs over the derated peak and bytes
over the derated bandwidth, with wave quantisation, a per-tile overhead and a small-row ramp measured
on an H200 (``bench/gpu_microbench.py``). :mod:`microbatch.predict.roofline` builds a layer from these
and re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from microbatch.errors import ConfigError, plain_numbers
from microbatch.hardware import Accelerator
from microbatch.predict.measured_gemm import MeasuredGemms

__all__ = [
    "COMPILED_NORM_MEMORY",
    "DEFAULT_EFFICIENCY",
    "RooflineEfficiency",
    "gemm_flops",
    "gemm_bytes",
    "arithmetic_intensity",
    "gemm_time_s",
    "wave_efficiency",
    "k_efficiency",
    "row_efficiency",
]


@dataclass(frozen=True, kw_only=True)
class RooflineEfficiency:
    """Fractions of the datasheet peaks that real kernels reach; calibrate from measurements.

    The defaults are assumptions, not measurements: large half-precision GEMMs reach about 80% of
    the dense peak in NVIDIA's own cuBLAS figures ("Matrix Multiplication Background" guide, A100
    and H100 plots), and streaming kernels about 80% of HBM bandwidth (NVIDIA's bandwidthTest /
    STREAM-like figures). ``half_rows`` bends the GEMM efficiency down at small row counts
    (efficiency × rows/(rows + half_rows)): tile and wave quantisation, launch overhead; 0 means
    pure roofline.
    """

    gemm_max: float = 0.8
    """Fraction of peak FLOP/s a large GEMM reaches."""
    memory: float = 0.8
    """Fraction of peak memory bandwidth a streaming kernel reaches."""
    half_rows: float = 0.0
    """Rows b_m·s at which the GEMM efficiency is half of ``gemm_max`` (0: no ramp)."""
    network: float = 1.0
    """Fraction of the link bandwidth collectives reach (bus bandwidth / link bandwidth)."""
    tile_rows: int = 128
    """GEMM output tile height: cuBLAS's large half-precision kernels use 128- and 256-wide tiles
    (NVIDIA "Matrix Multiplication Background" guide, tile and wave quantisation); 0 disables
    quantisation."""
    tile_cols: int = 128
    """GEMM output tile width."""
    tile_overhead_s: float = 2.73e-6
    """Fixed seconds per GEMM output tile besides its k-loop (operand prologue, epilogue store): a GEMM
    with a short inner dimension k spends a larger share of each tile there, efficiency k/(k + k₀)
    with k₀ = this × per-SM FLOP/s / (2·T_r·T_c) (:func:`k_efficiency`). Measured by
    ``bench/gpu_microbench.py`` on an H200 (``bench/results/h200-2026-11-30b/run1/microbench.json``):
    fitting gemm_max·waves·k/(k + k₀)·rows/(rows + R) to its 41 GEMMs (the development set's 32 layer
    GEMMs at 2,048 rows, k 768–25,600; a square 8,192 GEMM; 8 rows 128–16,384) gives k₀ = 625 and
    R = 140 at RMS error 8.4% (16.4% without k₀, 18.0% without R, 21.8% with neither: the row-parallel
    projections with k = h/t reach 0.45–0.70 of peak where the others reach 0.65–0.80); k₀ = 625 is
    625 × 2·128·128 / (989.4 TFLOP/s / 132 SMs) = 2.73 µs. As a time it carries to other GPUs: on an
    A100 (2.89 TFLOP/s per SM) k₀ = 241. 0 disables the term.

    Not one fit with ``gemm_max``: k₀ and R come from the fit with the ceiling free, which put it at 0.88; the
    planner keeps the guide's 0.8 (cited). Against the H200's own 41 GEMMs the shipped three give RMS 12.5% (the
    model slower than measured: 0.73 of peak for the square 8,192 GEMM it measured at 0.777); refitted at 0.8,
    k₀ = 425 and R = 110 give 9.8%. Not taken: that refit moves the development bench to 3.0% mean / 7.4% max on
    the issue-17 rows (2.9% / 6.8%) and the H100 rows further too fast (Megatron-LM README −4.0% → −6.3% mean
    signed), a sign that the 0.8 stands in for costs of a real step no isolated GEMM pays (BENCHMARKS.md, "The
    GEMM constants, one fit or not")."""
    ramp_rows: float = 140.0
    """Rows at which a GPU GEMM reaches half its large-GEMM efficiency (:func:`row_efficiency`):
    R = 140 from the same H200 fit as ``tile_overhead_s`` (its row ramp at k 4,096, n 16,384: 0.35 of
    peak at 128 rows, 0.66 at 2,048, 0.69 at 8,192). Carried to other GPUs as a count of rows (cuBLAS
    picks smaller, less efficient tiles for few rows on every GPU): an assumption, not a measurement
    there. Applies only to accelerators with compute units (GPUs); ``half_rows`` is the ramp a
    calibration fits on top. 0 disables the term."""

    norm_memory: float = 0.44
    """Fraction of memory bandwidth an unfused (eager PyTorch) LayerNorm reaches on a GPU: 0.44, measured by
    ``bench/gpu_microbench.py`` on an H200 (``bench/results/h200-2026-11-30b/run1/microbench.json``,
    ``torch.nn.functional.layer_norm`` over 256 MiB: 2.11 TB/s of 4.8). Used for the norms unless
    ``fused_elementwise``; carried to other GPUs as a fraction (an assumption)."""
    activation_memory: float = 0.48
    """The same for the MLP's activation function: 0.48, the same run's eager GELU (2.31 TB/s of 4.8)."""
    fused_elementwise: bool = False
    """Norms, activation functions, softmax and dropout run fused or compiled (Megatron-LM's fused LayerNorm,
    bias-GELU and scale-mask-softmax kernels, ``torch.compile``): at ``memory``, the streaming rate (the same
    H200 run: copy 0.78, add 0.83 of the bandwidth), the norms at ``fused_norm_memory`` when it is set
    (torch.compile's), and rotary embeddings as one fused kernel. False: eager
    kernels at ``norm_memory``, ``activation_memory``, ``softmax_memory`` and ``dropout_memory``."""

    fused_norm_memory: float | None = None
    """The norms' fraction of bandwidth, forward and backward together, when ``fused_elementwise``: None for
    ``memory`` (hand-written fused kernels: cuDNN's norms on an H200 reach 0.745 of the bandwidth over a forward
    and its backward, cudnn-frontend's norm benchmark, ``bench/bench_norms.py``), or :data:`COMPILED_NORM_MEMORY`
    for ``torch.compile``'s, whose backward reductions run at about half that."""

    softmax_memory: float = 0.356
    """Fraction of memory bandwidth an eager softmax reaches on a GPU: 0.356, measured by
    ``bench/gpu_microbench.py`` on an H200 (``bench/results/h200-2026-11-30b/run1/microbench.json``,
    ``torch.softmax`` over 32 × 2,048 × 2,048 bf16 scores, read + write: 1.71 TB/s of 4.8). Used for the
    attention scores' softmax without flash attention and the loss's softmax over the vocabulary unless
    ``fused_elementwise`` (Megatron's FusedScaleMaskSoftmax, compiled code: the streaming rate)."""
    dropout_memory: float = 0.585
    """The same for an eager dropout: 0.585, the same run's ``torch.nn.functional.dropout`` over the same scores
    (3.37 TB/s counting 3 element passes; 2.81 TB/s counting what it moves, read x, write y, a 1-byte mask:
    2.5 passes at 2 bytes, the count :func:`microbatch.predict.roofline.score_passes` uses)."""
    optimizer_memory: float = 0.751
    """Fraction of memory bandwidth an unfused optimizer's kernels stream at on a GPU: 0.751, measured by
    ``bench/gpu_microbench.py`` on an H200 (``bench/results/h200-2026-11-30b/run1/microbench.json``:
    ``torch.optim.AdamW`` default, foreach, fp32, 268M parameters in 5.96 ms: 3.61 TB/s of 4.8 counting the 80 bytes
    per parameter its kernels read and write, :data:`microbatch.predict.state.EAGER_PASSES`; 1.26 TB/s counting the
    28 the step must move). Each optimizer's passes at this rate; unless ``fused_elementwise`` (Megatron's and apex's
    fused Adam: read and write once, at the streaming rate ``memory``)."""
    launch_s_per_kernel: float = 6.58e-6
    """Host seconds per counted eager kernel (:data:`microbatch.predict.launch.LAUNCH_S_PER_KERNEL`, a bare launch
    measured on an H200 host; a ``bench-gpu`` file sets a real layer's per-kernel host time): on a GPU a layer's pass
    takes at least its kernels × this, on a CPU it is added to the pass (dispatch is synchronous there; the H200
    host's figure is taken as an assumption where no file measured this CPU: here 2.5 µs a bare add, 16 µs a
    counted kernel of a real layer). 0 disables the term."""

    overlap_slowdown: float = 0.189
    """How much longer a GPU's computation takes while an NCCL collective runs beside it (data-parallel
    reduction, ZeRO/FSDP gathers, the MoE all-to-all, the context-parallel ring): 0.189, the mean measured
    in arXiv 2507.03114 (:data:`microbatch.predict.collectives.OVERLAP_COMPUTE_SLOWDOWN`, with its physical
    cause). Applies only to accelerators with compute units; 0 hides overlapped communication for free."""

    gemm_measured: MeasuredGemms | None = None
    """Measured / analytic GEMM times at measured shapes (a kernel microbenchmark's calibration,
    :mod:`microbatch.predict.measured_gemm`): :func:`gemm_time_s` multiplies its time by the ratio read
    there. None: analytic only."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        if self.launch_s_per_kernel < 0:
            raise ConfigError(
                f"efficiency launch_s_per_kernel must be >= 0, got {self.launch_s_per_kernel!r}"
            )
        for name in (
            "gemm_max", "memory", "network", "norm_memory", "activation_memory", "optimizer_memory",
            "softmax_memory", "dropout_memory", "fused_norm_memory",
        ):  # fmt: skip
            v = getattr(self, name)
            if v is None and name == "fused_norm_memory":
                continue
            if isinstance(v, bool):
                raise ConfigError(f"efficiency {name} must be a number, got {v!r}")
            if not (0 < v <= 1):
                raise ConfigError(f"efficiency {name} must be in (0, 1], got {v!r}")
        if self.tile_rows < 0 or self.tile_cols < 0:
            raise ConfigError(
                "efficiency tile_rows and tile_cols must be >= 0 (0 disables tile quantisation)"
            )
        for name in ("tile_overhead_s", "ramp_rows", "overlap_slowdown"):
            if getattr(self, name) < 0:
                raise ConfigError(f"efficiency {name} must be >= 0, got {getattr(self, name)!r}")
        if self.half_rows < 0:
            raise ConfigError(f"efficiency half_rows must be >= 0, got {self.half_rows!r}")

    def elementwise_fractions(self, gpu: bool) -> tuple[float, float]:
        """(norm, activation) fractions of bandwidth: ``memory`` when fused or off a GPU, else the eager ones."""
        if not gpu:
            return self.memory, self.memory
        if self.fused_elementwise:
            return self.fused_norm_memory or self.memory, self.memory
        return self.norm_memory, self.activation_memory

    def score_fractions(self, gpu: bool) -> tuple[float, float]:
        """(softmax, dropout) fractions of bandwidth: ``memory`` when fused or off a GPU, else the eager ones."""
        if self.fused_elementwise or not gpu:
            return self.memory, self.memory
        return self.softmax_memory, self.dropout_memory

    def optimizer_fraction(self, gpu: bool) -> float:
        """Fraction of bandwidth the optimizer update reaches: ``memory`` when fused or off a GPU."""
        return self.memory if self.fused_elementwise or not gpu else self.optimizer_memory

    def overlap_fraction(self, gpu: bool) -> float:
        """Slowdown of computation under an overlapped collective: ``overlap_slowdown`` on a GPU, else 0."""
        return self.overlap_slowdown if gpu else 0.0

    def gemm(self, rows: float) -> float:
        """Fraction of peak FLOP/s a GEMM with ``rows`` rows reaches when compute-bound."""
        return self.gemm_max * rows / (rows + self.half_rows)


COMPILED_NORM_MEMORY = 0.445
"""The fraction of bandwidth a ``torch.compile``-generated RMSNorm/LayerNorm reaches over its forward and backward
on an H200: the median over the 11 model widths of NVIDIA/cudnn-frontend's norm benchmark
(``benchmark/norms/results/h200/``, torch_compile backend: forward 0.53–0.87 of 4.8 TB/s, backward 0.34–0.47, its
weight-gradient reductions), 5 passes (2 + 3) over the two times (``tests/data/norm_bars.json``,
``bench/bench_norms.py``). ``plan --compile`` runs the norms at it, forward and backward alike (the totals right; a
recomputed forward is charged about 1.7× its own, 0.745); carried to other GPUs as a fraction."""

DEFAULT_EFFICIENCY = RooflineEfficiency()


# -- GEMMs ---------------------------------------------------------------------------------------
def gemm_flops(rows: float, k: float, n: float) -> float:
    """2·rows·k·n: one multiply and one add per output element per inner index."""
    return 2.0 * rows * k * n


def gemm_bytes(rows: float, k: float, n: float, dtype_bytes: int = 2) -> float:
    """(rows·k + k·n + rows·n) · e: read both operands once, write the output once (ideal tiling)."""
    return (rows * k + k * n + rows * n) * dtype_bytes


def arithmetic_intensity(rows: float, k: float, n: float, dtype_bytes: int = 2) -> float:
    """FLOP per byte of a GEMM; compare with :meth:`Accelerator.ridge_point`."""
    return gemm_flops(rows, k, n) / gemm_bytes(rows, k, n, dtype_bytes)


def wave_efficiency(
    rows: float, n: float, units: int | None, tile_rows: int = 128, tile_cols: int = 128
) -> float:
    """Useful share of the work when output tiles run in waves of ``units`` at a time.

    tiles = ⌈rows/T_r⌉·⌈n/T_c⌉ run in ⌈tiles/units⌉ waves, each as long as one full tile: efficiency
    rows·n / (waves·units·T_r·T_c) (NVIDIA "Matrix Multiplication Background" guide: tile and wave
    quantisation). 1 when units or tiles are unknown.

    Fewer rows than one tile (rows < T_r) are not charged here: cuBLAS then runs a shorter tile, and the
    cost of that choice is :func:`row_efficiency`'s measured ramp (``RooflineEfficiency.ramp_rows``).
    Charging both, rows/T_r here and rows/(rows + R) there, counted the same loss twice: at 16 rows
    16/128 × 16/156 = 1.3% of the large-GEMM rate where the ramp alone says 10%. The waves over the column
    tiles still count: efficiency n / (waves·units·T_c) with ⌈n/T_c⌉ tiles.
    """
    if not units or not tile_rows or not tile_cols:
        return 1.0
    tiles = math.ceil(rows / tile_rows) * math.ceil(n / tile_cols)
    height = min(float(tile_rows), rows)  # one partial row of tiles: its loss is the small-row ramp's (above)
    waves = math.ceil(tiles / units)
    return rows * n / (waves * units * height * tile_cols)


def k_efficiency(
    k: float, acc: Accelerator, dtype: str = "bf16", efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY
) -> float:
    """Share of a GEMM tile's time spent in its k-loop: k / (k + k₀), k₀ = τ·(peak/SMs) / (2·T_r·T_c).

    Each output tile of T_r × T_c runs k/T_k steps of 2·T_r·T_c·T_k FLOPs at the SM's rate plus a fixed
    τ = ``efficiency.tile_overhead_s`` (loading the first operand slices, storing the tile). k₀ is τ in
    units of the k-loop: the inner dimension whose loop takes as long as the overhead. 1 when the
    accelerator's SM count is unknown or τ = 0.
    """
    units = acc.compute_units
    if not units or not efficiency.tile_overhead_s or not efficiency.tile_rows or not efficiency.tile_cols:
        return 1.0
    k0 = (
        efficiency.tile_overhead_s
        * acc.flops(dtype)
        / units
        / (2.0 * efficiency.tile_rows * efficiency.tile_cols)
    )
    return k / (k + k0)


def row_efficiency(
    rows: float, acc: Accelerator, efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY
) -> float:
    """rows / (rows + R), R = ``efficiency.ramp_rows``: the small-row ramp of GPU GEMMs (measured on an
    H200, see the field); 1 on accelerators without compute units (CPUs) or with R = 0. The one term that
    owns the loss of GEMMs with fewer rows than a tile (:func:`wave_efficiency` does not charge them)."""
    if not acc.compute_units or not efficiency.ramp_rows:
        return 1.0
    return rows / (rows + efficiency.ramp_rows)


def gemm_time_s(
    rows: float,
    k: float,
    n: float,
    acc: Accelerator,
    *,
    dtype: str = "bf16",
    efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY,
) -> float:
    """max(FLOPs / (peak·eff·wave eff·k eff), bytes / (bandwidth·eff)): the roofline time of one GEMM.

    eff = ``efficiency.gemm(rows)`` (the large-GEMM ceiling and a calibrated ramp), wave eff =
    :func:`wave_efficiency` × :func:`k_efficiency` (the fixed cost of each output tile) ×
    :func:`row_efficiency` (the measured small-row ramp). The tile grid's compute is at most that of the
    same GEMM padded to the most rows its waves hold (:func:`_wave_rows`), so without a calibration
    (``half_rows`` 0) the time never falls as rows grow; the bytes are the real operands'. A calibrated
    ramp (``efficiency.gemm``) applies at the real rows, as it was fitted: the measured kernels ran those
    rows, not padded ones (it keeps :func:`microbatch.predict.calibrate.point_efficiency` an exact inverse),
    and within one wave it lets the time fall from a small row count to a larger one.
    """
    e = 4 if dtype == "fp32" else 2
    compute = _tiled_s(rows, k, n, acc, dtype, efficiency)
    padded = _wave_rows(rows, n, acc.compute_units, efficiency.tile_rows, efficiency.tile_cols)
    if padded > rows:  # the tile grid of the last row its waves hold runs no slower (padded with zeros)
        compute = min(compute, _tiled_s(padded, k, n, acc, dtype, efficiency))
    compute /= efficiency.gemm(rows)  # the large-GEMM ceiling and a calibrated ramp, at the real rows
    memory = gemm_bytes(rows, k, n, e) / (acc.memory_bandwidth_bytes_per_s * efficiency.memory)
    measured = efficiency.gemm_measured  # a microbenchmark's ratio at this shape (1 when none)
    if measured is None:
        return max(compute, memory)
    # a ratio measured at one shape and carried to another never runs it past the sustained peak (a review: a small
    # GEMM's 0.51 carried to large ones the analytic terms put at 0.68 of the peak gave 1.3 of it)
    return max(
        max(compute, memory) * measured.factor(rows, k, n),
        gemm_flops(rows, k, n) / acc.sustained_flops(dtype),
    )


def _tiled_s(
    rows: float, k: float, n: float, acc: Accelerator, dtype: str, efficiency: RooflineEfficiency
) -> float:
    """FLOPs over the peak at the tiling's efficiencies (waves, the k-loop's share, the small-row ramp);
    the large-GEMM ceiling ``efficiency.gemm`` is the caller's."""
    waves = wave_efficiency(rows, n, acc.compute_units, efficiency.tile_rows, efficiency.tile_cols)
    waves *= k_efficiency(k, acc, dtype, efficiency) * row_efficiency(rows, acc, efficiency)
    return gemm_flops(rows, k, n) / (acc.flops(dtype) * waves)


def _wave_rows(rows: float, n: float, units: int | None, tile_rows: int, tile_cols: int) -> float:
    """The most rows a GEMM of ``rows`` × ``n`` could have in the same number of waves: ⌊waves·units /
    ⌈n/T_c⌉⌋ row tiles of T_r. A GEMM of fewer rows can always run padded to that many (zero rows cost
    the same time), so its time is at most theirs; without this bound the partial-wave and small-row
    terms made 128 rows slower than 512 (``gemm_time_s(128, 1280, 3840)`` on an H100: 21.8 µs against
    13.3 µs). ``rows`` itself when units or tiles are unknown."""
    if not units or not tile_rows or not tile_cols or rows <= 0:
        return rows
    cols = math.ceil(n / tile_cols)
    waves = math.ceil(math.ceil(rows / tile_rows) * cols / units)
    return max(rows, float(waves * units // cols * tile_rows))
