"""The one least-squares line, used by the calibration fits and the knee's throughput bound."""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.errors import ConfigError

__all__ = ["fit_line"]


def fit_line(
    xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None
) -> tuple[float, float]:
    """(intercept, slope) of the weighted least-squares line y = c₀ + c₁·x.

    c₁ = Σw(x−x̄)(y−ȳ) / Σw(x−x̄)², c₀ = ȳ − c₁·x̄ with weighted means (unit weights by
    default: the ordinary least-squares line). Needs two distinct x.
    """
    w = list(weights) if weights is not None else [1.0] * len(xs)
    sw = sum(w)
    xbar = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    ybar = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sw
    sxx = sum(wi * (x - xbar) ** 2 for wi, x in zip(w, xs, strict=True))
    if sxx <= 0:
        raise ConfigError("a line needs at least two distinct x values")
    slope = sum(wi * (x - xbar) * (y - ybar) for wi, x, y in zip(w, xs, ys, strict=True)) / sxx
    return ybar - slope * xbar, slope
