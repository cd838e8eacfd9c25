"""Latency-bound probes: when a GPU step waits on the host's kernel launches, not on the kernels.

A GPU runs kernels asynchronously: the host enqueues them and the device drains the queue. When the
host's issue time for a step exceeds the device's time, the step takes the host's time, whatever
b_m is — the small probes of a small model are often here. An efficiency fit that reads their
slowness as a GEMM-efficiency ramp over-credits larger b_m (gpt2-xl on an H200, fitted on b_m 1, 2,
4: 19% too fast at 16). :func:`latency_bound` says when probes are in that regime;
:func:`microbatch.predict.calibrate.fit_efficiency` then fits no ramp.

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.hardware import Accelerator
from microbatch.model import ModelShape
from microbatch.predict.steptime import predict_step_time_s
from microbatch.records import MeasuredPoint

__all__ = ["LATENCY_RISE", "latency_bound"]


LATENCY_RISE = 0.10
"""How much the measured time per extra sequence must rise between successive probe pairs, beyond the
roofline's own rise, before the small probes count as latency-bound: above the repeat-to-repeat
spread of the recorded H200 probes at b_m >= 2 (0.4–3%, ``bench/results/h200-2026-11-30/calibrate.json``,
field ``spread``), below the 35% rise that gpt2-xl's b_m 1, 2, 4 show there."""


def latency_bound(
    shape: ModelShape,
    points: Sequence[MeasuredPoint],
    acc: Accelerator,
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
) -> str:
    """A note when the smallest probes are latency-bound, else ``""``.

    The device time of the roofline is T(b) = A + B·b at most (a ramp or a constant overhead: linear;
    waves and memory-bound terms: nearly so), so its cost per extra sequence, m_i = ΔT/Δb between
    successive probes, is flat. When the host issues kernels slower than the device runs them the step
    is max(T_host, T_device(b)) (asynchronous launch): flat at small b_m, then rising — its m_i rises.
    The test: m_{i+1}/m_i measured over the same ratio of the uncalibrated roofline (which has the
    device's own wave quantisation and memory-bound small GEMMs) exceeds 1 + :data:`LATENCY_RISE` for
    some i; or a larger probe measured no slower than a smaller one (the device's time never falls as
    b_m grows). Needs three probes with step times, and an accelerator that launches asynchronously (a GPU:
    ``compute_units`` known); on a CPU the host is the device and a per-step overhead is the ramp.

    Three probes cannot tell a host floor from a steep kernel ramp by their times alone (both bend the
    same way): :func:`~microbatch.predict.calibrate.fit_efficiency` asks this only when the fitted ramp's ``half_rows`` exceeds the
    smallest probe's rows — a kernel efficiency still halving at thousands of rows, after the waves are
    counted, is not what cuBLAS's large half-precision GEMMs show (NVIDIA "Matrix Multiplication
    Background" guide: efficiency flat once the tiles fill the waves), a host floor is. A probe that
    also timed the host's issue would settle it.
    """
    if not acc.compute_units:
        return ""
    pts = sorted((p for p in points if p.step_time_s is not None), key=lambda p: p.micro_batch)
    if len(pts) < 3:
        return ""
    roof = [
        predict_step_time_s(
            shape, p.micro_batch, acc, seq=seq, precision=precision, checkpointing=checkpointing
        )
        for p in pts
    ]
    meas = [p.step_time_s or 0.0 for p in pts]
    bs = [p.micro_batch for p in pts]

    def marginal(ts: list[float], i: int) -> float:
        return (ts[i + 1] - ts[i]) / (bs[i + 1] - bs[i])

    for i in range(len(pts) - 1):
        # a step that got faster with more work is not device time: the device's time never falls
        # as b_m grows (more rows, the same kernels), so the smaller probe waited on something else
        # — the host's launches, or a first-probe cost (allocator growth, kernel selection)
        if meas[i + 1] <= meas[i]:
            return (
                f"b_m {bs[i]} is latency-bound: it measured {1e3 * meas[i]:.3g} ms, no faster than "
                f"b_m {bs[i + 1]} ({1e3 * meas[i + 1]:.3g} ms), which a device's time never is; no "
                f"efficiency ramp fitted, larger b_m are predicted at b_m {bs[-1]}'s efficiency"
            )
    for i in range(len(pts) - 2):
        m0, m1 = marginal(meas, i), marginal(meas, i + 1)
        r0, r1 = marginal(roof, i), marginal(roof, i + 1)
        if m0 > 0 and r0 > 0 and (m1 / m0) / (r1 / r0) > 1 + LATENCY_RISE:
            return (
                f"b_m {bs[i]} is latency-bound: the measured time per extra sequence rises from "
                f"{1e3 * m0:.3g} ms (b_m {bs[i]}→{bs[i + 1]}) to {1e3 * m1:.3g} ms (b_m {bs[i + 1]}→{bs[i + 2]}), "
                "as a step limited by the host's kernel launches does; no efficiency ramp fitted, larger b_m "
                f"are predicted at b_m {bs[-1]}'s efficiency"
            )
    return ""
