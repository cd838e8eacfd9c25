"""Measured GEMM times as a correction of the analytic GEMM model, read between the measured shapes.

A kernel microbenchmark (:mod:`microbatch.measure.microbench`) times GEMMs at a set of shapes
(rows, k, n). At each, the ratio ``measured seconds / analytic seconds`` (the analytic time is
:func:`~microbatch.predict.gemm.gemm_time_s` with the same efficiency, on the planned accelerator) says
how far the model is off there. At any other shape the planner multiplies its analytic time by a ratio
read between the measured ones: inverse-distance weighting (Shepard 1968, weights 1/d²) over the
:data:`NEIGHBOURS` nearest measured shapes in (log rows, log k, log n), exact at a measured shape. The
analytic model keeps the shape dependence (tiles, waves, the row ramp, short inner dimensions) between
and beyond the measured points; the measurement fixes its level where it was taken.

What it ignores: a ratio measured in one dtype applied to another (the caller warns); shapes far from
every measured one get the nearest ratios (no trend is extrapolated). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["NEIGHBOURS", "MeasuredGemms", "interpolate_ratio"]

NEIGHBOURS = 4
"""Measured shapes that weigh in on one query (the nearest in log space)."""


@lru_cache(maxsize=65536)
def interpolate_ratio(
    points: tuple[tuple[float, float, float, float], ...], rows: float, k: float, n: float
) -> float:
    """The ratio at (rows, k, n): the measured one at a measured shape, else Σ wᵢ·rᵢ / Σ wᵢ with wᵢ = 1/dᵢ²
    over the :data:`NEIGHBOURS` nearest points, dᵢ the Euclidean distance in (ln rows, ln k, ln n).
    1 when there are no points."""
    if not points:
        return 1.0
    q = (math.log(rows), math.log(k), math.log(n))
    dist = []
    for r, kk, nn, ratio in points:
        d2 = (math.log(r) - q[0]) ** 2 + (math.log(kk) - q[1]) ** 2 + (math.log(nn) - q[2]) ** 2
        if d2 < 1e-18:
            return ratio
        dist.append((d2, ratio))
    dist.sort()
    near = dist[:NEIGHBOURS]
    return sum(ratio / d2 for d2, ratio in near) / sum(1.0 / d2 for d2, _ in near)


@dataclass(frozen=True, kw_only=True)
class MeasuredGemms:
    """Measured / analytic GEMM time at measured shapes, for one accelerator and dtype."""

    points: tuple[tuple[float, float, float, float], ...]
    """(rows, k, n, measured seconds / analytic seconds) per measured shape."""
    accelerator: str = ""
    """The accelerator the analytic times (the ratios' denominators) were computed for."""

    def factor(self, rows: float, k: float, n: float) -> float:
        """What the analytic time of a GEMM (rows, k, n) is multiplied by (:func:`interpolate_ratio`)."""
        if rows <= 0 or k <= 0 or n <= 0:
            return 1.0
        return interpolate_ratio(self.points, float(rows), float(k), float(n))
