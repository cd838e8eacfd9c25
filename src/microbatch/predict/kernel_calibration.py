"""Kernel terms from a microbenchmark of the target accelerator: measured, replacing the analytic ones.

A ``bench-gpu`` result (:class:`~microbatch.microbench_record.MicrobenchResult`) measured on one
accelerator sets, for plans on that accelerator:

- **GEMMs**: at each measured shape the ratio measured / analytic time
  (:mod:`microbatch.predict.measured_gemm`), read between the shapes; ``RooflineEfficiency.gemm_measured``.
- **Attention**: the flash ceiling f∞ (``Accelerator.attention_fraction``) from the measured causal SDPA
  rate f(s, d) at each key length s: f∞ = f(s, d) / φ(s/k, d), k the row's ``attention_ramp`` (inverting
  :func:`~microbatch.predict.attention.flash_rate_fraction`: φ is
  :func:`~microbatch.predict.attention.flash_shape_factor`, causal forward), the median over the measured s.
- **Streaming**: ``memory`` = the median fraction of the bandwidth of copy and add; on a GPU
  ``norm_memory`` = LayerNorm's, ``activation_memory`` = GeLU's; on the CPU (where the planner charges
  every memory-bound kernel at ``memory``) the median of copy, add, GeLU and LayerNorm; on a GPU
  ``optimizer_memory`` = one AdamW step's, counting the 80 B per parameter its unfused kernels move
  (:data:`~microbatch.predict.state.EAGER_PASSES`; the file's row counts 28).
- **Launch floor**: ``launch_s_per_kernel`` = the measured host seconds per counted kernel of a small eager layer's
  forward and backward (``layer_host_s_per_kernel``), else per tiny eager kernel (files without it): a GPU's floor
  under each pass, a CPU's dispatch added to its compute (:func:`microbatch.predict.roofline.layer_forward`).
- **Clock**: the planned accelerator keeps its own ``sustained_clock_fraction``, so the terms a file did not
  measure stay the row's; the measured terms are taken against the accelerator at the power limit the
  measurement ran at, so a plan at another ``power_limit_w`` scales them by the clock law
  (:func:`~microbatch.hardware_clocks.power_limited_clock`). Kernels timed after a soak
  (``MicrobenchResult.soak_s`` > 0) carry the clock a sustained load holds; kernels timed in bursts (a file
  without a soak) are slowed by the square GEMM's sustained over burst rate measured with them, or, where the
  file has none, by the Hopper rows' cited :data:`~microbatch.hardware_clocks.HOPPER_BURST_TO_SUSTAINED` (the B200's
  :data:`~microbatch.hardware_clocks.B200_BURST_TO_SUSTAINED`; other
  GPUs: 1). :attr:`KernelTerms.clock_scale` is the product: measured times are divided by it.
- **Collectives**: ``network`` = the measured all-reduce bus bandwidth over the link's achievable figure
  (``intra_node_bytes_per_s × intra_node_achievable``), when the file has one; ``overlap_slowdown`` = the
  measured slowdown of a GEMM beside an all-reduce (at least 0), when the file has one.

Each fraction is clamped to (0, 1] (a clamp is noted); each term says where it came from
(:attr:`KernelTerms.sources`). A file measured on another accelerator sets nothing. Pure Python.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from microbatch.errors import ConfigError
from microbatch.hardware import ACCELERATORS, Accelerator, cpu_accelerator
from microbatch.hardware_attention import RAMP_FIT_FROM
from microbatch.hardware_clocks import (
    MAX_CLOCK_FRACTION,
    MIN_POWER_SHARE,
    cited_burst_to_sustained,
    power_limited_clock,
)
from microbatch.microbench_record import MicrobenchResult
from microbatch.predict.attention import flash_shape_factor
from microbatch.predict.gemm import DEFAULT_EFFICIENCY, RooflineEfficiency, gemm_time_s
from microbatch.predict.measured_gemm import MeasuredGemms
from microbatch.predict.state import RECORDED_TO_PASSES

__all__ = ["KernelTerms", "measured_cpu_accelerator", "kernel_terms", "measured_on"]


@dataclass(frozen=True, kw_only=True)
class KernelTerms:
    """What a microbenchmark sets for one accelerator, and where each term comes from."""

    accelerator: Accelerator
    """The planned accelerator with the measured attention ceiling (when measured)."""
    efficiency: RooflineEfficiency
    """The efficiency with the measured fractions and GEMM ratios."""
    sources: dict[str, str] = field(default_factory=dict)
    """Term -> where its value comes from (measured: which kernels; else the analytic default)."""
    notes: tuple[str, ...] = ()
    """Clamps and mismatches."""
    clock_scale: float = 1.0
    """The measured kernels' times are divided by this on the plan: the plan's clock over the one the measurement
    held at its power limit, times the sustained over burst rate of kernels timed in bursts."""


def measured_on(result: MicrobenchResult) -> str:
    """The accelerator name a result applies to: its table key, or ``cpu``."""
    return result.accelerator or ("cpu" if result.device == "cpu" else result.device_name)


def measured_cpu_accelerator(result: MicrobenchResult) -> Accelerator:
    """This CPU as an :class:`Accelerator` from the microbenchmark itself: peak = the fastest GEMM measured,
    bandwidth = the fastest streaming kernel (nominal figures the measured terms are fractions of)."""
    flops = max((g.flops_per_s for g in result.gemms), default=1e9)
    bw = max((s.bytes_per_s for s in result.stream), default=1e9)
    return cpu_accelerator(
        flops_per_s=flops,
        bytes_per_s=bw,
        source=f"microbenchmark: fastest GEMM {flops / 1e9:.1f} GFLOP/s, fastest stream {bw / 1e9:.1f} GB/s",
    )


def _clamp(name: str, value: float, notes: list[str]) -> float:
    if value > 1.0:
        notes.append(
            f"measured {name} {value:.3g} of the table's figure > 1: clamped to 1 (the figure is low)"
        )
        return 1.0
    return value


def _gemm_ratios(
    result: MicrobenchResult, acc: Accelerator, eff: RooflineEfficiency, burst: float = 1.0
) -> tuple[tuple[float, float, float, float], ...]:
    """(rows, k, n, sustained / analytic seconds) per measured shape, the analytic time on ``acc`` at its sustained
    clock and the measured one over ``burst`` (the sustained over burst rate of burst-timed kernels); a shape
    measured twice (a layer GEMM that is also on the grid) gets the mean of its seconds."""
    run = acc.at_sustained_clock()
    seen: dict[tuple[int, int, int], list[float]] = {}
    for g in result.gemms:
        seen.setdefault((g.rows, g.k, g.n), []).append(g.seconds)
    return tuple(
        (
            float(r),
            float(k),
            float(n),
            statistics.mean(s) / burst / gemm_time_s(r, k, n, run, dtype=result.dtype, efficiency=eff),
        )
        for (r, k, n), s in seen.items()
    )


def _stream_terms(
    result: MicrobenchResult, acc: Accelerator, sources: dict[str, str], notes: list[str]
) -> dict[str, Any]:
    frac = {s.kernel: s.bytes_per_s / acc.memory_bandwidth_bytes_per_s for s in result.stream}
    if "adamw" in frac:  # the rate of the unfused kernels: the bytes they move, not the 28 the step must
        frac["adamw"] *= RECORDED_TO_PASSES
    out: dict[str, float] = {}
    gpu = bool(acc.compute_units)
    kernels = [k for k in (("copy", "add") if gpu else ("copy", "add", "gelu", "layernorm")) if k in frac]
    if kernels:
        out["memory"] = _clamp("streaming bandwidth", statistics.median(frac[k] for k in kernels), notes)
        sources["memory"] = f"measured: median of {', '.join(kernels)} ({out['memory']:.3f})"
    if gpu:
        pairs = (("norm_memory", "layernorm"), ("activation_memory", "gelu"), ("optimizer_memory", "adamw"))
        for term, kernel in pairs:
            if kernel in frac:
                out[term] = _clamp(f"{kernel} bandwidth", frac[kernel], notes)
                sources[term] = f"measured: {kernel} ({out[term]:.3f})"
    return out


def _attention_fraction(
    result: MicrobenchResult, acc: Accelerator, sources: dict[str, str], notes: list[str], burst: float = 1.0
) -> float | None:
    """The flash ceiling f∞ of the measured causal SDPA rates, against ``acc``'s sustained peak (the rates × the
    sustained over burst rate ``burst`` of burst-timed kernels); None when none was measured."""
    if not result.attention:
        return None
    peak = acc.sustained_flops(result.dtype)
    # a row on its own ramp (the B200's) was fitted from RAMP_FIT_FROM keys: shorter timings are left out
    timed = [
        a for a in result.attention if acc.attention_ramp == 1 or a.seq >= RAMP_FIT_FROM
    ] or result.attention
    ceilings = [
        burst * a.flops_per_s / peak / flash_shape_factor(a.seq / acc.attention_ramp, a.head_dim)
        for a in timed
    ]
    f = _clamp("attention ceiling", statistics.median(ceilings), notes)
    seqs = ", ".join(str(a.seq) for a in timed)
    sources["attention_fraction"] = f"measured: causal SDPA at s = {seqs} (ceiling {f:.3f})"
    return f


def kernel_terms(
    result: MicrobenchResult, acc: Accelerator, base: RooflineEfficiency = DEFAULT_EFFICIENCY
) -> KernelTerms:
    """The measured kernel terms of ``result`` for plans on ``acc`` (module docstring); ``base`` unchanged,
    with every term sourced as analytic, when ``result`` was measured on another accelerator."""
    sources = {
        k: "analytic (default)"
        for k in (
            "gemm",
            "attention_fraction",
            "memory",
            "launch_s_per_kernel",
            "network",
            "overlap_slowdown",
        )
    }
    where = measured_on(result)
    if where != acc.name:
        note = (
            f"kernel microbenchmark measured on {result.device_name} ({where}), the plan is for {acc.name}: "
            "its kernel terms are NOT applied (the analytic ones are used)"
        )
        return KernelTerms(accelerator=acc, efficiency=base, sources=sources, notes=(note,))
    notes: list[str] = []
    values = _stream_terms(result, acc, sources, notes)
    if result.layer_host_s_per_kernel is not None:
        values["launch_s_per_kernel"] = result.layer_host_s_per_kernel
        sources["launch_s_per_kernel"] = (
            f"measured: {result.layer_host_s_per_kernel * 1e6:.2f} µs per kernel of an eager layer's forward and "
            "backward"
        )
    elif result.launch_s_per_kernel is not None:
        values["launch_s_per_kernel"] = result.launch_s_per_kernel
        sources["launch_s_per_kernel"] = (
            f"measured: {result.launch_s_per_kernel * 1e6:.2f} µs per eager kernel"
        )
    ar = [c for c in result.collectives if c.op == "all_reduce"]
    if ar:
        link = acc.intra_node_bytes_per_s * acc.intra_node_achievable
        values["network"] = _clamp("all-reduce bus bandwidth", ar[0].bus_bytes_per_s / link, notes)
        sources["network"] = (
            f"measured: all-reduce over {ar[0].world_size} ranks ({values['network']:.3f} of the link)"
        )
    if result.overlap_slowdown is not None:
        values["overlap_slowdown"] = max(0.0, result.overlap_slowdown)
        sources["overlap_slowdown"] = (
            f"measured: a GEMM beside an all-reduce took {result.overlap_slowdown:+.1%} longer than alone"
        )
    eff = replace(base, **values)
    burst = _burst_factor(acc, result, sources)
    ran, scale = _ran_at(acc, result, sources)
    if result.gemms:
        ratios = _gemm_ratios(result, ran, eff, burst)
        eff = replace(eff, gemm_measured=MeasuredGemms(points=ratios, accelerator=acc.name))
        sources["gemm"] = f"measured: {len(ratios)} GEMM shapes, read between them (measured / analytic time)"
    attn = _attention_fraction(result, ran, sources, notes, burst)
    acc_out = acc.with_overrides(attention_fraction=attn) if attn is not None else acc
    return KernelTerms(accelerator=acc_out, efficiency=eff, sources=sources, notes=tuple(notes),
                       clock_scale=scale * burst)  # fmt: skip


def _ran_at(acc: Accelerator, result: MicrobenchResult, sources: dict[str, str]) -> tuple[Accelerator, float]:
    """(``acc`` at the power limit the measurement ran at — the driver's reading in the file, else (an older file)
    the table row's, said to be assumed —, the plan's clock over that one by
    :func:`~microbatch.hardware_clocks.power_limited_clock`): the measured terms are taken against the first, so a
    plan at another limit scales them by the second."""
    row = ACCELERATORS[acc.name].power_limit_w if acc.name in ACCELERATORS else None
    ran_at, how = (result.power_limit_w, "read") if result.power_limit_w else (row, "the row's, assumed")
    if ran_at is None or acc.power_limit_w in (None, ran_at) or acc.rated_power_w is None:
        return acc, 1.0
    rated = acc.rated_power_w
    held = min(max(ran_at, MIN_POWER_SHARE * rated), rated)  # a reading outside the board's range: its edge
    f = power_limited_clock(acc.power_limit_w, held, rated)
    if f > MAX_CLOCK_FRACTION:  # the clock law is first-order: not stretched this far from the measured point
        raise ConfigError(
            f"the microbenchmark ran at a {ran_at:g} W power limit and the plan is at {acc.power_limit_w:g} W: "
            f"x {f:.2f} on its clock is past the {MAX_CLOCK_FRACTION:g} the clock law is trusted for; run bench-gpu at the plan's "
            "limit, or give power_limit_w nearer the measured one"
        )
    edge = f", taken as {held:g} W, the edge of the board's range" if held != ran_at else ""
    sources["clock"] = (
        f"measured at {ran_at:g} W ({how}{edge}); at {acc.power_limit_w:g} W the clock x {f:.3f}"
        + (f"; {sources['clock']}" if "clock" in sources else "")
    )
    return acc.with_overrides(power_limit_w=held), f


MIN_SUSTAINED_OVER_BURST = 0.5
"""A measured sustained over burst rate below this is taken as a disturbed measurement (another job on the GPU, a
throttled board), not the clock law, and not used: the cited factor stands. The cited falls are 0.80-0.85
(:data:`~microbatch.hardware_clocks.HOPPER_BURST_TO_SUSTAINED`); a board capped deep under its rating falls further,
which ``power_limit_w`` states."""


def _burst_factor(acc: Accelerator, result: MicrobenchResult, sources: dict[str, str]) -> float:
    """1 when the kernels were timed after a soak (they carry the sustained clock) or off a GPU; else, kernels
    timed in bursts, the square GEMM's sustained over burst rate measured with them (at most 1), or the Hopper
    rows' cited one; said in ``sources["clock"]``."""
    if result.soak_s > 0 or not acc.compute_units:
        return 1.0
    ratio = result.sustained_over_burst
    if ratio is not None and ratio >= MIN_SUSTAINED_OVER_BURST:
        r = min(1.0, ratio)
        sources["clock"] = f"kernels timed in bursts: x {r:.3f}, the square GEMM's sustained over burst rate"
        return r
    odd = (
        f" (its measured sustained over burst rate {ratio:.3f} is below {MIN_SUSTAINED_OVER_BURST:g}: not used)"
        if ratio is not None
        else ""
    )
    cited = cited_burst_to_sustained(acc.name)
    if cited is not None:
        sources["clock"] = (
            f"kernels timed in bursts (no soak in the file): x {cited[1]:.3f}, the {cited[0]} cited sustained rate{odd}"
        )
        return cited[1]
    if odd:
        sources["clock"] = f"kernels timed in bursts{odd}"
    return 1.0
