"""Accelerators: peak dense FLOP/s, memory bandwidth and capacity, interconnect; one source per row.

Every figure is the vendor's dense (no structured sparsity) peak from the datasheet named in the row's ``source``.
Interconnect bandwidths are per GPU and per direction (NVIDIA quotes NVLink as the bidirectional total: 600 GB/s on
A100 is 300 GB/s each way). The inter-node figure is the *typical* deployment named in the row (one NIC per GPU),
not a property of the chip: override it for your cluster (:func:`get_accelerator` takes overrides, and
:meth:`Accelerator.with_overrides` replaces any field, for example with a measured value).

Compute units (for GEMM wave quantisation) come from the architecture whitepapers: A100 108 SMs, H100 SXM5 132
(also the H800, H100 NVL, H200 and H100 96 GB), H100 PCIe 114, L4 58 (NVIDIA Ampere, Hopper and Ada
whitepapers), B200 148 (two 74-SM dies, NVIDIA Blackwell technical brief), MI300X 304 CUs (AMD CDNA 3).

Capacities are the marketed size read as binary units (an "80 GB" H100 reports 79.6 GiB total to
``torch.cuda.mem_get_info``), or the usable size where it was read (the H100 96 GB's 94 GiB): the planner keeps
a headroom free. The flash-attention ceiling (``attention_fraction``, with its ``attention_ramp``) is set where
kernel evidence was read or measured (the Hopper, A100 and B200 rows: :mod:`microbatch.hardware_attention`).

Clocks (issue 28): the roofline's compute rate is the peak × ``sustained_clock_fraction``
(:meth:`Accelerator.sustained_flops`), the clock a long dense GEMM holds at the power limit over the clock the
peak is computed at (:mod:`microbatch.hardware_clocks`: each row's evidence; a lower ``power_limit_w`` scales it).

A CPU has no row: :func:`cpu_accelerator` builds one from figures given (:func:`microbatch.measure.cpu.measure_cpu`
from a quick fp32 matmul and copy). This module measures nothing: it is the table and its pure lookups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from microbatch import hardware_clocks as _clk
from microbatch.cpu_quota import usable_cores as usable_cores  # re-exported: callers import it from here
from microbatch.errors import ConfigError, check_positive, check_positive_int, plain_numbers, whole_number
from microbatch.hardware_attention import (
    AMPERE,
    ATTENTION_SOURCES,
    ATTN_AMPERE,
    ATTN_BLACKWELL,
    ATTN_HOPPER,
    BLACKWELL,
    HOPPER,
    RAMP_BLACKWELL,
)
from microbatch.hardware_names import device_key, name_key, typed_key, unknown_name
from microbatch.units import GIB

__all__ = [
    "Accelerator",
    "ACCELERATORS",
    "get_accelerator",
    "accelerator_names",
    "parse_gpus",
    "from_device_name",
    "match_accelerator",
    "cpu_accelerator",
    "DEFAULT_HEADROOM",
    "HOPPER",
    "AMPERE",
    "BLACKWELL",
]

DEFAULT_HEADROOM = 0.1
"""Share of device memory kept free when deciding what fits (the planner's ``memory_headroom``, the knee's
``headroom``): a policy, not a measurement. It covers what neither the analytic model nor a probe sees — the CUDA
context (a few hundred MiB), what the driver keeps of the total it reports (the rows' capacities, :data:`_MIB_H100`:
an H200's 140.4 GiB reads as 139.8 through torch), NCCL or gloo buffers, the caching allocator's fragmentation and
segment rounding, a longer batch than the probe's, and other processes on the device. The memory fit's own error is
under 1% at the largest probe (BENCHMARKS.md); the rest is this margin."""

TB = 1e12
"""Bytes (or FLOP) in one decimal tera-unit, as datasheets use."""
GB = 1e9
"""Bytes in one decimal GB, as datasheets quote bandwidth."""
Gbit = 1e9 / 8
"""Bytes per second in one Gbit/s (network links)."""

MAX_ATTENTION_RAMP = 100.0
"""The largest ``attention_ramp`` accepted: the flash curves reach half their ceiling at s₀ = 404 keys (FA2's causal
forward, :data:`~microbatch.predict.attention.FLASH_SEQ_HALF`) times the ramp; the slowest kernel read ramps 2.3×
(cuDNN 9.19's), and 100× puts the half-way point at 40k keys, past any kernel benchmarked."""

DTYPES = ("bf16", "fp16", "fp32")
"""Data types with a peak FLOP/s entry (fp32 is the non-tensor-core SIMT rate)."""
OPTIONAL_DTYPES = ("fp8",)
"""Data types only some accelerators have tensor cores for (FP8 E4M3/E5M2: Hopper, Ada, Blackwell, MI300)."""


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One accelerator model and the links a typical node gives it."""

    name: str
    """Registry key, for example ``h100-sxm``."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s by data type: ``bf16``, ``fp16``, ``fp32``."""
    memory_bytes: float
    """Device memory capacity in bytes."""
    memory_bandwidth_bytes_per_s: float
    """Device memory (HBM/GDDR) bandwidth in bytes/s."""
    intra_node_bytes_per_s: float
    """GPU-to-GPU bandwidth inside a node, per direction (NVLink, xGMI, or PCIe when none)."""
    inter_node_bytes_per_s: float
    """GPU-to-GPU bandwidth between nodes, per GPU per direction, of a typical deployment."""
    gpus_per_node: int = 8
    """GPUs that share the intra-node fabric (tensor parallelism should stay inside one node)."""
    intra_node_achievable: float = 1.0
    """Fraction of ``intra_node_bytes_per_s`` a collective reaches as bus bandwidth (protocol overhead).
    NVLink: 0.82, from NCCL's maintainer: "With the protocol overhead (~20%) NCCL can get an effective
    NVLink bandwidth of 370GB/s" of the H100's 450 GB/s line rate (github.com/NVIDIA/nccl-tests
    issue 212, S. Jeaugey, 2024); the same NCCL protocol on A100 NVLink3 gives 246 of 300 GB/s."""
    inter_node_achievable: float = 1.0
    """Fraction of ``inter_node_bytes_per_s`` a collective or send reaches. InfiniBand: 0.96, from NVIDIA
    (github.com/NVIDIA/nccl-tests issue 267: "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per
    NIC", 48 of 50 GB/s); HDR's 24 of 25 as A100 users measured: 96 of 100 GB/s peak on 4 NICs (issue 119)."""
    compute_units: int | None = None
    """Streaming multiprocessors (NVIDIA) or compute units (AMD): GEMM tiles run in waves of this many."""
    attention_fraction: float | None = None
    """Share of the bf16 peak a causal flash-attention kernel reaches at long key lengths (its ceiling f∞;
    :func:`microbatch.predict.attention.flash_rate_fraction` bends it down at short ones). None: no kernel
    evidence for this accelerator, the attention core then runs at the GEMM efficiency on the full
    FLOP count (the rule before issue 28). Each row names its evidence."""
    attention_ramp: float = 1.0
    """How many times longer than the FA2 H100 curves' the row's flash kernel takes to reach its ceiling (the curves
    read at s/k); 1 but on Blackwell (:data:`~microbatch.hardware_attention.RAMP_BLACKWELL`). Fitted on causal d-128
    kernels; the unmasked ring steps, sliding windows and other head dimensions take it as an assumption."""
    sustained_clock_fraction: float = 1.0
    """The compute rate a training step's sustained load holds over the rate the row's kernel terms stand for
    (the roofline runs at ``peak × this``, :meth:`sustained_flops`): on the A100 rows the clock a long GEMM holds
    at the power limit over the datasheet peak's clock, 1 where no figure is cited; on the Hopper rows, whose
    kernel terms were measured in bursts on an H200, the sustained over the burst rate (0.847,
    :data:`~microbatch.hardware_clocks.HOPPER_BURST_TO_SUSTAINED`). ``--gpu-set`` replaces it on that basis.
    Each row says which; above 1 where a part sustains more (at most 1.25 is accepted)."""
    power_limit_w: float | None = None
    """The board's power limit in watts at which the row's figures hold; None when not stated."""
    rated_power_w: float | None = None
    """The board's rated maximum (TDP); overriding ``power_limit_w`` alone rescales the clock
    (:func:`~microbatch.hardware_clocks.power_limited_clock`). None: the limit is only recorded."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        if not isinstance(self.peak_flops, dict):
            raise ConfigError(f"{self.name} peak_flops must be a dict of FLOP/s by dtype, got {self.peak_flops!r}; "
                              "e.g. peak_flops={'bf16': 989e12, 'fp32': 67e12}", params=("peak_flops",))  # fmt: skip
        for f in (
            "memory_bytes",
            "memory_bandwidth_bytes_per_s",
            "intra_node_bytes_per_s",
            "inter_node_bytes_per_s",
        ):
            check_positive(f"{self.name} {f}", getattr(self, f), fix="give the device's figure")
        rates = {f: getattr(self, f) for f in ("memory_bandwidth_bytes_per_s", "intra_node_bytes_per_s",
                                              "inter_node_bytes_per_s")}  # fmt: skip
        rates |= {f"peak_flops[{k}]": v for k, v in self.peak_flops.items() if isinstance(v, (int, float))}
        for (
            f,
            v,
        ) in rates.items():  # a step's time divides by them: below 1 a second it runs past float's range
            if isinstance(v, (int, float)) and 0 < v < 1:
                raise ConfigError(f"{self.name} {f} is {v:g} per second; no device runs below 1: give it in bytes "
                                  "(FLOP) per second, e.g. 2.0e12")  # fmt: skip
        lo = _clk.MIN_FIGURE_FRACTION
        for f in ("intra_node_achievable", "inter_node_achievable"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not (lo <= v <= 1):
                raise ConfigError(
                    f"{self.name} {f} must be in [{lo:g}, 1], got {v!r}; give the measured bus bandwidth "
                    "over the link's figure (1 when unknown)"
                )
        v = self.attention_fraction
        if v is not None and (not isinstance(v, (int, float)) or not (lo <= v <= 1)):
            raise ConfigError(
                f"{self.name} attention_fraction must be in [{lo:g}, 1], got {v!r}; give the share of the bf16 "
                "peak a causal flash-attention kernel reaches (or leave it unset)"
            )
        r = self.attention_ramp
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not lo <= r <= MAX_ATTENTION_RAMP:
            raise ConfigError(f"{self.name} attention_ramp must be in [{lo:g}, {MAX_ATTENTION_RAMP:g}], got {r!r}; give 1 "
                              "for the FA2 H100 curves' ramp, more for a kernel that reaches its ceiling later")  # fmt: skip
        v = self.sustained_clock_fraction
        lo, hi = _clk.MIN_CLOCK_FRACTION, _clk.MAX_CLOCK_FRACTION
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi):
            raise ConfigError(
                f"{self.name} sustained_clock_fraction must be in [{lo:g}, {hi:g}], got {v!r}; give the rate a "
                "long dense GEMM sustains over the rate the table's kernel terms stand for (1: that rate; the Hopper "
                "rows take 0.847, their burst-measured terms at a training step's clock)"
            )
        for f in ("power_limit_w", "rated_power_w"):
            if getattr(self, f) is not None:
                check_positive(f"{self.name} {f}", getattr(self, f), fix="give the board's power in watts")
        if self.power_limit_w and self.rated_power_w and self.power_limit_w > self.rated_power_w:
            raise ConfigError(f"{self.name} power_limit_w {self.power_limit_w:g} W is above its rated_power_w "
                              f"{self.rated_power_w:g} W; a board's limit is at most its rating: give rated_power_w "
                              f"{self.power_limit_w:g} or more, or power_limit_w {self.rated_power_w:g} or less")  # fmt: skip
        for dt in DTYPES:
            if dt not in self.peak_flops:
                raise ConfigError(f"{self.name} lacks a peak FLOP/s for {dt}; give peak_flops[{dt!r}]")
        for dt, peak in self.peak_flops.items():  # fp8's too, where given: a GEMM's time divides by it
            if peak is not None:
                check_positive(
                    f"{self.name} peak_flops[{dt}]", peak, fix="give the device's dense peak FLOP/s"
                )
        if self.compute_units is not None:
            check_positive_int(f"{self.name} compute_units", self.compute_units,
                               fix="give the SMs (NVIDIA) or compute units (AMD) the GEMM tiles run on")  # fmt: skip
        if whole_number(self.gpus_per_node) is None or self.gpus_per_node < 1:
            raise ConfigError(
                f"{self.name} gpus_per_node must be a whole number >= 1, got {self.gpus_per_node!r}"
            )

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype`` (``bf16``, ``fp16``, ``fp32``)."""
        if dtype not in self.peak_flops:
            raise ConfigError(f"no peak FLOP/s for dtype {dtype!r}; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def sustained_flops(self, dtype: str) -> float:
        """The compute rate the roofline uses: :meth:`flops` × ``sustained_clock_fraction`` (tensor throughput
        scales with the SM clock: peak = SMs × FLOP per clock × clock)."""
        return self.flops(dtype) * self.sustained_clock_fraction

    def at_sustained_clock(self) -> Accelerator:
        """A copy whose peaks are :meth:`sustained_flops` (fraction 1): what the roofline's kernels see.

        Itself when the fraction is 1.
        """
        f = self.sustained_clock_fraction
        if f == 1:
            return self
        peaks = {k: v * f for k, v in self.peak_flops.items()}
        return replace(self, peak_flops=peaks, sustained_clock_fraction=1.0)

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOP per byte at which the roofline turns from memory- to compute-bound (Williams et al. 2009)."""
        return self.flops(dtype) / self.memory_bandwidth_bytes_per_s

    def with_overrides(self, **values: object) -> Accelerator:
        """A copy with fields replaced (measured bandwidth, a cluster's real network, a derated peak).

        ``bf16``, ``fp16`` and ``fp32`` set one entry of ``peak_flops``.
        """
        known = {f.name for f in fields(self)} - _NOT_FIGURES
        peaks = dict(self.peak_flops)
        other: dict[str, Any] = {}
        for k, v in values.items():
            if k in DTYPES or k in OPTIONAL_DTYPES:
                peaks[k] = float(v)  # type: ignore[arg-type]  # a peak is a number; float() raises otherwise
            elif k in _NOT_FIGURES:
                raise ConfigError(
                    f"{k} is not a figure to override"
                    + ("; set one peak as bf16=, fp16=, fp32= or fp8=" if k == "peak_flops" else "")
                    + f"; known: {', '.join(sorted(known | set(DTYPES) | set(OPTIONAL_DTYPES)))}"
                )
            elif k in known:
                other[k] = v
            else:
                raise ConfigError(
                    f"unknown accelerator field {k!r}; known: "
                    f"{', '.join(sorted(known | set(DTYPES) | set(OPTIONAL_DTYPES)))}"
                )
        out = replace(self, peak_flops=peaks, **other)  # checks every field (a limit within its rating)
        was, now = self.power_limit_w, out.power_limit_w
        if (
            "power_limit_w" not in other
            or {"sustained_clock_fraction", "rated_power_w"} & other.keys()
            or not (was and now)
        ):
            return out
        if out.rated_power_w is None:  # the same board at another limit holds another clock: scale it
            raise ConfigError(
                f"{self.name} has no rated power, so its clock cannot follow power_limit_w; give rated_power_w "
                "with it, or the clock as sustained_clock_fraction"
            )
        f = _clk.power_limited_clock(now, was, out.rated_power_w)
        return replace(out, sustained_clock_fraction=self.sustained_clock_fraction * f)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (``peak_flops`` as a dict)."""
        return asdict(self)


def _acc(
    name: str,
    bf16: float,
    fp16: float,
    fp32: float,
    mem_gib: float,
    bw: float,
    intra: float,
    inter: float,
    units: int,
    source: str,
    gpus_per_node: int = 8,
    links: tuple[float, float] = (1.0, 1.0),
    fp8: float | None = None,
    attention: float | None = None,
    ramp: float = 1.0,
    watts: float | None = None,
    clock: tuple[float, str] = (1.0, ""),
    rated: float | None = None,
) -> Accelerator:
    peaks = {"bf16": bf16 * TB, "fp16": fp16 * TB, "fp32": fp32 * TB} | ({"fp8": fp8 * TB} if fp8 else {})
    return Accelerator(
        name=name,
        peak_flops=peaks,
        memory_bytes=mem_gib * GIB,
        memory_bandwidth_bytes_per_s=bw * GB,
        intra_node_bytes_per_s=intra * GB,
        inter_node_bytes_per_s=inter,
        gpus_per_node=gpus_per_node,
        compute_units=units,
        intra_node_achievable=links[0],
        inter_node_achievable=links[1],
        attention_fraction=attention,
        attention_ramp=ramp,
        sustained_clock_fraction=clock[0],
        power_limit_w=watts,
        rated_power_w=rated or watts,
        source=source
        + (ATTENTION_SOURCES[attention] if attention in ATTENTION_SOURCES else "")
        + (f"; {clock[1]}" if clock[1] else ""),
    )


_MIB_H100 = 81559 / 1024
"""An 80 GB H100's capacity in GiB: the 81,559 MiB its driver reports (nvidia-smi's memory total on the SXM5 HBM3
board, github.com/modal-labs/modal-client PR 2797 and github.com/wilicc/gpu-burn issue 114; the same on the PCIe
board and the H800, github.com/NVIDIA/nccl issue 1264's listings), 79.6 GiB, not 80.

Every row's capacity is the total the driver reports, not the marketed figure: A100 80 GB 81,920 MiB and 40 GB
40,960 MiB (exactly 80 and 40 GiB, modal-client PR 2797), L4 23,034 MiB (the same PR), H200 143,771 MiB (the
nvidia-smi listings of H200 boards; bench/results/h200-2026-11-30b/run1/env.json read 139.8 GiB through torch, which
leaves out what the driver keeps), B200 183,359 MiB (github.com/NVIDIA/TensorRT-LLM issue 10278), H100 NVL 95,830
MiB (nvidia-smi listings of H100 NVL boards), MI300X 192 GiB (rocm-smi's VRAM total reads 206,158,430,208 bytes =
192 GiB on some systems, 205,822,885,888 = 191.7 GiB on others; 192 kept); the 96 GB H100's 94 GiB is its source's
usable figure, no driver listing read. The CUDA context and what torch cannot reach of that total are left to
:data:`DEFAULT_HEADROOM`."""

_NOT_FIGURES = frozenset({"name", "peak_flops", "source"})
"""Fields ``with_overrides`` does not set: the row's name and its source, and the peaks as a whole (each is
set by its dtype, ``bf16=`` ...)."""

_IB_HDR = 200 * Gbit  # one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100 reference architecture)
_IB_NDR = 400 * Gbit  # one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100/H200/B200 reference architecture)
_NVLINK_IB = (0.82, 0.96)  # achievable fractions of NVLink and InfiniBand (Accelerator.intra_node_achievable)

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        _acc("a100-40gb", 312, 312, 19.5, 40, 1555, 300, _IB_HDR, 108,
             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): 312 TFLOP/s bf16/fp16 dense, 19.5 fp32, "
             "1,555 GB/s HBM2, NVLink 600 GB/s (300 each way); DGX A100: one 200 Gb/s HDR NIC per GPU",
             links=_NVLINK_IB, watts=400, clock=_clk.CLOCK_A100, attention=ATTN_AMPERE),
        _acc("a100-80gb", 312, 312, 19.5, 80, 2039, 300, _IB_HDR, 108,
             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s bf16/fp16 dense, 19.5 fp32, "
             "2,039 GB/s HBM2e, NVLink 600 GB/s (300 each way); DGX A100: one 200 Gb/s HDR NIC per GPU",
             links=_NVLINK_IB, watts=400, clock=_clk.CLOCK_A100, attention=ATTN_AMPERE),
        _acc("h100-sxm", 989.4, 989.4, 66.9, _MIB_H100, 3350, 450, _IB_NDR, 132,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 1,979 TFLOP/s bf16 with sparsity = 989 dense, "
             "67 fp32, 3.35 TB/s HBM3, NVLink 900 GB/s (450 each way); DGX H100: one 400 Gb/s NDR NIC per GPU; "
             "3,958 TFLOP/s fp8 with sparsity = 1,979 dense",
             links=_NVLINK_IB, fp8=1978.9, attention=ATTN_HOPPER, watts=700, clock=_clk.CLOCK_H100_SXM),
        _acc("h100-pcie", 756.5, 756.5, 51.2, _MIB_H100, 2000, 64, 200 * Gbit, 114,
             "NVIDIA H100 Tensor Core GPU datasheet (PCIe): 1,513 TFLOP/s bf16 with sparsity = 756 dense, "
             "51 fp32, 2.0 TB/s HBM2e; PCIe Gen5 x16 64 GB/s each way (NVLink bridges pair two cards "
             "only); typical node: 200 Gb/s per GPU; 3,026 TFLOP/s fp8 with sparsity = 1,513 dense", fp8=1513,
             attention=ATTN_HOPPER, watts=350,
             clock=_clk.CLOCK_PCIE),
        _acc("h100-nvl", 835.5, 835.5, 60, 95830 / 1024, 3900, 64, 200 * Gbit, 132,
             "NVIDIA H100 NVL datasheet: 1,671 TFLOP/s bf16 with sparsity = 835.5 dense, 60 fp32, 94 GB HBM3 "
             "at 3.9 TB/s, 350-400 W; NVLink bridge 600 GB/s joins two cards only, so a node's GPUs meet over "
             "PCIe Gen5 x16 (64 GB/s each way); typical node: 200 Gb/s per GPU; 3,341 TFLOP/s fp8 with "
             "sparsity = 1,670.5 dense", fp8=1670.5, attention=ATTN_HOPPER, watts=400,
             clock=_clk.CLOCK_NVL),
        _acc("h800", 989.4, 989.4, 66.9, _MIB_H100, 3350, 200, _IB_NDR, 132,
             "NVIDIA H800 SXM5: the H100 SXM's compute and HBM3 (989 TFLOP/s bf16 dense, 67 fp32, 3.35 TB/s) "
             "with NVLink cut to 400 GB/s (200 each way); one 400 Gb/s NIC per GPU (DeepSeek-V3's H800 "
             "cluster, arXiv 2412.19437 §3.2.2: IB 50 GB/s per GPU against NVLink's 160 GB/s achieved)",
             links=_NVLINK_IB, fp8=1978.9, attention=ATTN_HOPPER, watts=700, clock=_clk.CLOCK_H100_SXM),
        _acc("h200", 989.4, 989.4, 66.9, 143771 / 1024, 4800, 450, _IB_NDR, 132,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM): H100 SXM compute (989 TFLOP/s bf16 dense, "
             "67 fp32), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (450 each way); one 400 Gb/s NIC per GPU; "
             "fp8 as H100 SXM, 1,979 dense",
             links=_NVLINK_IB, fp8=1978.9, attention=ATTN_HOPPER, watts=700, clock=_clk.CLOCK_H200),
        _acc("h100-96gb", 989.4, 989.4, 66.9, 94, 2410, 450, _IB_NDR, 132,
             "H100 SXM5 with six HBM2e stacks, 96 GB (94 GiB usable) at 2.41 TB/s (Ujeniya et al., arXiv "
             "2604.11391, its power-capped H100s); the H100 SXM's 132 SMs, peaks and NVLink; one 400 Gb/s NIC "
             "per GPU", links=_NVLINK_IB, fp8=1978.9, attention=ATTN_HOPPER, watts=500, rated=700,
             clock=_clk.CLOCK_H100_96GB),
        _acc("b200", 2250, 2250, 75, 183359 / 1024, 8000, 900, _IB_NDR, 148,
             "NVIDIA HGX B200 datasheet (per GPU): 4.5 PFLOP/s bf16 with sparsity = 2.25 dense, 75 fp32, "
             "180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s (900 each way); DGX B200: 400 Gb/s per GPU; 9 PFLOP/s "
             "fp8 with sparsity = 4.5 dense",
             links=_NVLINK_IB, fp8=4500, watts=1000, attention=ATTN_BLACKWELL, ramp=RAMP_BLACKWELL,
             clock=_clk.CLOCK_B200),
        _acc("l4", 121, 121, 30.3, 23034 / 1024, 300, 32, 100 * Gbit / 8, 58,
             "NVIDIA L4 Tensor Core GPU datasheet: 242 TFLOP/s bf16 with sparsity = 121 dense, 30.3 fp32, "
             "24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 32 GB/s each way, no NVLink; typical cloud node "
             "(8 L4s): 100 Gb/s shared by 8 GPUs; 485 TFLOP/s fp8 with sparsity = 242.5 dense; TDP 72 W", fp8=242.5,
             watts=72),
        _acc("mi300x", 1307.4, 1307.4, 163.4, 192, 5300, 448, _IB_NDR, 304,
             "AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s bf16/fp16 dense, 163.4 fp32, 192 GB HBM3 at "
             "5.3 TB/s, Infinity Fabric 896 GB/s peer aggregate (448 each way); one 400 Gb/s NIC per GPU; "
             "2,614.9 TFLOP/s fp8 dense; board power 750 W",
             links=(1.0, _NVLINK_IB[1]), fp8=2614.9, watts=750),  # no cited figure for xGMI: its line rate; NDR's 0.96
    )
}  # fmt: skip

_ALIASES = {
    "a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb", "h100": "h100-sxm", "h100-80gb": "h100-sxm",
    "h100-96": "h100-96gb", "h100-hbm2e": "h100-96gb", "h200-sxm": "h200", "mi300": "mi300x",
}  # fmt: skip


def accelerator_names() -> list[str]:
    """The registry's names."""
    return list(ACCELERATORS)


def get_accelerator(name: str, **overrides: object) -> Accelerator:
    """The registry's accelerator ``name`` (case-insensitive), with any field overridden.

    An unknown name raises :class:`ConfigError` listing the known ones.
    """
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    key = key if key in ACCELERATORS else typed_key(name, ACCELERATORS) or key  # as nvidia-smi prints it
    if key not in ACCELERATORS:
        raise unknown_name(name, key, list(ACCELERATORS), list(_ALIASES))
    acc = ACCELERATORS[key]
    # its own peaks dict: a caller writing into the row's (acc.peak_flops["bf16"] = ...) changed every later plan
    return acc.with_overrides(**overrides) if overrides else replace(acc, peak_flops=dict(acc.peak_flops))


def parse_gpus(text: str) -> list[Accelerator]:
    """Accelerators from ``--gpu NAME[,NAME…]``."""
    names = [n for n in (part.strip() for part in text.split(",")) if n]
    if not names:
        raise ConfigError(
            f"gpu {text!r} names no accelerator; known: {', '.join(ACCELERATORS)}", params=("gpu",)
        )
    accs = [get_accelerator(n) for n in names]
    return list({a.name: a for a in accs}.values())  # one column per accelerator, however often named


def from_device_name(device_name: str, total_memory_bytes: float | None = None) -> Accelerator | None:
    """The registry row for a device name as torch reports it, with the reported memory; None if unknown
    (:func:`~microbatch.hardware_names.device_key`: an A100 told apart by its memory)."""
    key = device_key(device_name, total_memory_bytes)
    if key is None:
        return None
    acc = ACCELERATORS[key]  # its own peaks dict either way: the row's stay as they are
    return acc.with_overrides(memory_bytes=float(total_memory_bytes or acc.memory_bytes))


def match_accelerator(name: str) -> str | None:
    """The registry name of a device name such as ``NVIDIA H200``; None if unknown (from the name alone,
    :func:`~microbatch.hardware_names.name_key`)."""
    return name_key(name, ACCELERATORS)


# -- the CPU ---------------------------------------------------------------------------------------
def cpu_accelerator(
    *, flops_per_s: float, bytes_per_s: float, memory_bytes: float | None = None, source: str = ""
) -> Accelerator:
    """An :class:`Accelerator` for this CPU: one peak for every dtype, one bandwidth for everything.

    Nominal figures: the calibrated efficiency is relative to ``flops_per_s`` and absorbs its choice.
    """
    if memory_bytes is None:
        memory_bytes = _mem_total_bytes()
    return Accelerator(
        name="cpu",
        peak_flops={"bf16": flops_per_s, "fp16": flops_per_s, "fp32": flops_per_s},
        memory_bytes=memory_bytes,
        memory_bandwidth_bytes_per_s=bytes_per_s,
        intra_node_bytes_per_s=bytes_per_s,
        inter_node_bytes_per_s=bytes_per_s,
        gpus_per_node=1,
        source=source or "nominal CPU figures",
    )


def _mem_total_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(16 * 2**30)  # a placeholder capacity where /proc is absent; only "fits" uses it
