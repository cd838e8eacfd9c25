"""The bound T̂ on the throughput of any b_m larger than the largest measured one.

A line u = a + c·b fitted to the step time per unit of throughput (u = b/T) of the largest
probes: under the roofline the step time is convex in b, so no larger b_m runs faster than
T̂ = 1/c. The knee must clear (1 − τ)·(1 + μ) of the reference, μ being two of the bound's own
relative standard errors (:func:`choice_margin`). The derivation, and why the window, the slack η
and the margin have these values, is in ``docs/knee.md`` ("Reference").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from microbatch.choose.curve import CurvePoint, measured_curve
from microbatch.fit import fit_line

__all__ = [
    "BOUND_WINDOW",
    "BOUND_MIN_POINTS",
    "BOUND_SLACK",
    "BOUND_MARGIN",
    "BOUND_CONFIDENCE",
    "ThroughputBound",
    "bound_or_why",
    "choice_margin",
    "throughput_bound",
]

BOUND_WINDOW = 5
"""How many of the largest measured points the bound's line is fitted on (five doublings)."""
BOUND_MIN_POINTS = 4
"""Fewest points the bound's line is fitted on: on three, a line has one degree of freedom left
and its residual test cannot tell a bend from noise."""
BOUND_SLACK = 0.15
"""η: the largest relative residual of the bound's line for the tail to count as affine (timing
noise); beyond it no bound is given."""
BOUND_MARGIN = 0.05
"""μ when no bound could be fitted (fewer than four points, or a tail that is not affine): with
``reference="bound"`` a point counts as within τ of the reference only if it reaches
(1 − τ)·(1 + μ) of it, and a best measured by a search that stopped early is low by up to a
doubling's gain. With a bound, μ comes from the bound's own error (:func:`choice_margin`)."""
BOUND_CONFIDENCE = 2.0
"""k: with a bound, μ = k·SE(T̂)/T̂, so that the knee is within τ of T̂ raised by k standard errors,
the reference as high as the fit allows at ~95% one-sided confidence (normal approximation; ~91–93%
with the fit's 2–3 degrees of freedom). Compared in a simulation on the 40 recorded CPU sweeps
(``bench/bench_sim_search.py``) with k = 1 and with a fixed μ = 5%: k = 2 keeps the choice within
τ as often as the fixed 5% or more often, and on an H200 curve (μ 3.7%) picks 16 where 5% picked
32."""


@dataclass(frozen=True, kw_only=True)
class ThroughputBound:
    """T̂ = 1/c: no b_m past the largest measured runs faster (see ``docs/knee.md``)."""

    throughput: float
    """T̂, in the curve's throughput unit."""
    slope: float
    """c: least-squares slope of u = b/T against b over ``fitted_on``."""
    intercept: float
    """a: the fit's u at b = 0."""
    max_residual: float
    """Largest |a + c·b − u| / u over ``fitted_on`` (at most η was checked)."""
    relative_error: float
    """Standard error of T̂ relative to T̂: SE(c)/c, SE(c) = s/√Σ(b − b̄)² with s² the residual
    sum of squares over n − 2 (ordinary least squares)."""
    fitted_on: tuple[int, ...]
    """The largest measured b_m the line was fitted on (up to ``BOUND_WINDOW``, at least 4)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        return d


def throughput_bound(
    points: Sequence[CurvePoint], *, slack: float = BOUND_SLACK, window: int = BOUND_WINDOW
) -> ThroughputBound | None:
    """The bound T̂ on the throughput of any b_m larger than the largest measured one.

    Fits u = a + c·b by least squares on the ``window`` largest measured points (at least 4);
    None when there are fewer, when c ≤ 0, or when the tail is not affine within ``slack``
    (some |a + c·b − u| / u > η): :func:`bound_or_why` says which.
    """
    found = bound_or_why(points, slack=slack, window=window)
    return found if isinstance(found, ThroughputBound) else None


def bound_or_why(
    points: Sequence[CurvePoint], *, slack: float = BOUND_SLACK, window: int = BOUND_WINDOW
) -> ThroughputBound | str:
    """:func:`throughput_bound`'s fit, or the reason there is none, in words (a review found one reason printed for
    three: a linear curve's zero slope was said to be too few points)."""
    curve = [p for p in measured_curve(points) if p.measured_throughput > 0][-window:]
    if len(curve) < BOUND_MIN_POINTS:
        return f"{len(curve)} measured point{'s' if len(curve) != 1 else ''}, fewer than the {BOUND_MIN_POINTS} a line is fitted on"
    # fitted in units of the largest rate (u·T_max), so that the squares neither overflow nor vanish at any scale
    # of the unit (1e-250 or 1e200 per second): the residuals and the relative error do not depend on it
    scale = max(p.measured_throughput for p in curve)
    bs = [float(p.micro_batch) for p in curve]
    rates = [p.measured_throughput / scale for p in curve]
    if not all(
        r > 0 for r in rates
    ):  # rates spread so far that T/T_max underflows (1e-320 beside 1e5): no line
        return "the rates span too many orders of magnitude to fit a line"
    us = [b / r for b, r in zip(bs, rates, strict=True)]
    if not all(math.isfinite(u) for u in us):  # b/T overflows: no line to fit
        return "the rates span too many orders of magnitude to fit a line"
    a, c = fit_line(bs, us)
    if not (math.isfinite(a) and math.isfinite(c)) or c <= 0:
        return (
            f"step time (b_m / throughput) does not grow with b_m over {', '.join(str(int(b)) for b in bs)}: "
            "throughput rises as fast as b_m or faster, and nothing bounds a larger b_m"
        )
    worst = max(abs(a + c * b - u) / u for b, u in zip(bs, us, strict=True))
    if not math.isfinite(worst) or worst > slack:
        return (
            f"step time over {', '.join(str(int(b)) for b in bs)} misses a line by {100 * worst:.0f}%, more than "
            f"{100 * slack:g}%"
        )
    b_mean = sum(bs) / len(bs)
    rss = sum((a + c * b - u) ** 2 for b, u in zip(bs, us, strict=True))
    se_c = math.sqrt(rss / (len(bs) - 2) / sum((b - b_mean) ** 2 for b in bs))
    # u(b') ≥ u_n + c·(b' − b_n) for b' > b_n; its intercept decides between 1/c and T(b_n)
    top = scale / c if us[-1] - c * bs[-1] >= 0 else curve[-1].measured_throughput
    return ThroughputBound(
        throughput=top,
        slope=c / scale,
        intercept=a / scale,
        max_residual=worst,
        relative_error=se_c / c,
        fitted_on=tuple(p.micro_batch for p in curve),
    )


def choice_margin(bound: ThroughputBound | None) -> float:
    """μ, the share by which the knee must clear the line (1 − τ)·reference under
    ``reference="bound"``: k = :data:`BOUND_CONFIDENCE` relative standard errors of T̂ when a
    bound was fitted (the reference is known that well and no better), else :data:`BOUND_MARGIN`."""
    return BOUND_CONFIDENCE * bound.relative_error if bound is not None else BOUND_MARGIN
