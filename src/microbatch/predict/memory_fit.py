"""The memory half of a calibration: the analytic peak line of a measured loop and the fit of the measured one to it.

:mod:`microbatch.predict.calibrate` explains the fit (``activation_scale = β/a``, ``fixed_bytes = α − S``) and holds the
calibration value; this module holds the line and the fit. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.errors import ConfigError
from microbatch.fit import fit_line
from microbatch.model import ModelShape
from microbatch.predict.memory import MemoryCalibration, MemoryConfig, estimate_memory
from microbatch.records import MeasuredPoint, Measurements
from microbatch.units import format_bytes

__all__ = [
    "MIN_POINTS",
    "MEASURED_LOSS_KERNEL",
    "predict_memory_bytes",
    "analytic_memory_line",
    "need_points",
    "check_figures",
    "fit_memory_calibration",
]

MIN_POINTS = 2
"""Distinct b_m (not out of memory) a fit needs: two parameters per fit (a line)."""


MEASURED_LOSS_KERNEL = "eager"
"""The loss of a measured loop, the line a memory calibration is fitted against: PyTorch's eager cross-entropy, as
tune's probes (the built-in GPT's ``F.cross_entropy``, a Hugging Face model's ``ForCausalLMLoss``) and most user
loops compute it (:data:`microbatch.precision.LOSS_KERNELS`)."""


def _memory_config(
    b: int, seq: int, precision: str, checkpointing: bool, loss_kernel: str, layer_kernels: str = "fused"
) -> MemoryConfig:
    rc = "full" if checkpointing else "none"
    return MemoryConfig(
        micro_batch=b, seq=seq, precision=precision, optimizer="adamw", recompute=rc, loss_kernel=loss_kernel,
        layer_kernels=layer_kernels,
    )  # fmt: skip


def predict_memory_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    calibration: MemoryCalibration | None = None,
    loss_kernel: str = MEASURED_LOSS_KERNEL,
    layer_kernels: str = "fused",
) -> float:
    """Peak bytes of one device training ``shape`` at b_m with AdamW, no parallelism (:func:`estimate_memory`)."""
    cfg = _memory_config(micro_batch, seq or shape.seq, precision, checkpointing, loss_kernel, layer_kernels)
    return estimate_memory(shape, cfg, calibration).peak_bytes


def analytic_memory_line(
    shape: ModelShape, *, seq: int | None = None, precision: str = "bf16-mixed", checkpointing: bool = False,
    loss_kernel: str = MEASURED_LOSS_KERNEL,
) -> tuple[float, float]:  # fmt: skip
    """(S, a): the analytic peak is S + a·b_m — model state S and activation bytes a per sequence.

    Exact: every activation term of :mod:`microbatch.predict.memory` is proportional to b_m.
    """
    est = estimate_memory(shape, _memory_config(1, seq or shape.seq, precision, checkpointing, loss_kernel))
    st = est.peak_stage
    return st.state_bytes, st.activations_bytes


def need_points(kind: str, have: Sequence[int], source: str, need: int = MIN_POINTS) -> None:
    """Raise :class:`ConfigError` unless ``have`` holds ``need`` b_m, saying how many more to measure."""
    if len(have) < need:
        more = need - len(have)
        raise ConfigError(
            f"{source}: fitting {kind} needs at least {need} measured b_m (not out of memory, with {kind} "
            f"measured); it has {len(have)} ({', '.join(map(str, have)) or 'none'}): measure {more} more "
            f"(e.g. a tune probes b_m 1, 2, 4, ...)"
        )


def check_figures(meas: Measurements) -> None:
    """ConfigError when none of ``meas``' points gives its memory or its time figure: measuring more (what
    :func:`need_points` would advise) would not help, the figure is missing."""
    for key, got in ((meas.memory_key, [p.peak_memory_bytes for p in meas.points]),
                     (meas.time_key, [p.step_time_s for p in meas.points])):  # fmt: skip
        if meas.points and all(v is None for v in got):
            other = "; or memory_key 'peak_memory_bytes'" if key == "peak_allocated_bytes" else ""
            raise ConfigError(
                f"{meas.source}: none of its {len(meas.points)} measured points gives {key}, which validate fits; "
                f"give the points that figure (a tune writes it){other}",
                params=("memory_key",) if other else (),
            )


def fit_memory_calibration(
    shape: ModelShape,
    points: Sequence[MeasuredPoint],
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    source: str = "calibration",
    loss_kernel: str = MEASURED_LOSS_KERNEL,
) -> tuple[MemoryCalibration, dict[str, float], list[str]]:
    """(calibration, fit details, notes): activation_scale = β/a, fixed_bytes = α − S (module docstring), a the
    analytic bytes per sequence with ``loss_kernel``'s loss."""
    pts = [(p.micro_batch, p.peak_memory_bytes) for p in points if p.peak_memory_bytes is not None]
    need_points("peak memory", [b for b, _ in pts], source)
    alpha, beta = fit_line([b for b, _ in pts], [m for _, m in pts])
    static, per_sample = analytic_memory_line(
        shape, seq=seq, precision=precision, checkpointing=checkpointing, loss_kernel=loss_kernel
    )
    notes = []
    if beta <= 0:
        raise ConfigError(
            f"{source}: measured peak memory does not grow with b_m (slope {beta:.3g} bytes per sequence over "
            f"b_m {', '.join(str(b) for b, _ in pts)}); measure larger b_m, where activations dominate"
        )
    # a peak is a bound to keep under: the line is raised to every measured point (the slope kept), so that no
    # measured b_m is predicted below what it took (a point 3 GB over the others made b_m 32 read 22% low)
    over = max(m - (alpha + beta * b) for b, m in pts)
    if over > 0:
        worst = max(pts, key=lambda p: p[1] - (alpha + beta * p[0]))
        if over > 0.05 * worst[1]:
            notes.append(
                f"the least-squares line missed b_m {worst[0]}'s peak by {format_bytes(over, unit='GiB')} "
                f"({over / worst[1]:.0%}); raised to cover it (a noisy point, or memory not linear in b_m)"
            )
        alpha += over
    fixed = alpha - static
    if fixed < 0:
        notes.append(
            f"fitted fixed bytes {format_bytes(fixed, digits=0, unit='MiB')} < 0 (the analytic model state "
            f"{format_bytes(static, unit='GiB')} "
            "exceeds the measured intercept); clamped to 0"
        )
    details = {
        "measured_intercept_bytes": alpha,
        "measured_slope_bytes_per_sample": beta,
        "analytic_static_bytes": static,
        "analytic_activation_bytes_per_sample": per_sample,
        "fixed_bytes_fitted": fixed,
    }
    return MemoryCalibration(activation_scale=beta / per_sample, fixed_bytes=max(0.0, fixed)), details, notes
