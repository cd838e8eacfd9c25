"""The linear memory fit M(b) = M_0 + k·b and the largest b_m it predicts to fit a budget.

Activations are linear in b_m (Korthikanti et al. 2022, A ∝ b·s·h·L), so peak memory is fitted
by least squares on the largest probes (the smallest are dominated by allocator granularity).
The largest fitting b_m under budget B with headroom ε is floor((B·(1 − ε) − M_0) / k); see
``docs/knee.md`` ("Memory fit"). The headroom ε defaults to
:data:`microbatch.hardware.DEFAULT_HEADROOM`, the one margin every layer keeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from microbatch.choose.curve import CurvePoint
from microbatch.fit import fit_line
from microbatch.hardware import DEFAULT_HEADROOM

__all__ = ["MemoryFit", "fit_memory", "max_fitting_micro_batch"]


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """Peak memory M(b) = intercept + slope·b, fitted on measured points."""

    intercept_bytes: float
    """M_0: memory at b_m = 0 (weights, gradients, optimizer state, workspace)."""
    slope_bytes_per_sample: float
    """k: extra bytes per sequence in the micro-batch (activations, and the KV cache when decoding)."""
    fitted_on: tuple[int, ...] = ()
    """The b_m values the fit used."""

    def predict(self, micro_batch: float) -> float:
        """M_0 + k·b."""
        return self.intercept_bytes + self.slope_bytes_per_sample * micro_batch

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        return d


def fit_memory(points: Sequence[CurvePoint], *, largest: int = 3) -> MemoryFit | None:
    """Least-squares line through the ``largest`` biggest b_m with a known peak (None if < 2), among the points
    measured as the largest was, with activation checkpointing or without (a line through both modes is neither's).

    k = Σ(b−b̄)(M−M̄) / Σ(b−b̄)², M_0 = M̄ − k·b̄.
    """
    peaks = {
        p.micro_batch: p for p in points if p.ok and p.peak_memory_bytes is not None
    }  # the last of each b_m
    mode = peaks[max(peaks)].checkpointing if peaks else False
    known = sorted((p for p in peaks.values() if p.checkpointing == mode), key=lambda p: p.micro_batch)[
        -largest:
    ]
    if len(known) < 2:
        return None
    m0, k = fit_line([float(p.micro_batch) for p in known], [float(p.peak_memory_bytes or 0) for p in known])
    return MemoryFit(
        intercept_bytes=m0, slope_bytes_per_sample=k, fitted_on=tuple(p.micro_batch for p in known)
    )


def max_fitting_micro_batch(
    fit: MemoryFit | None, budget_bytes: float | None, *, memory_headroom: float = DEFAULT_HEADROOM
) -> int | None:
    """floor((B·(1 − ε) − M_0) / k); None without a fit, a budget or a positive slope; 0 if nothing fits."""
    if fit is None or budget_bytes is None or fit.slope_bytes_per_sample <= 0:
        return None
    usable = budget_bytes * (1.0 - memory_headroom) - fit.intercept_bytes
    most = usable / fit.slope_bytes_per_sample + 1e-9
    if not math.isfinite(most):  # figures past float's range (a budget of 1e308 bytes): nothing to say
        return None
    return max(0, math.floor(most))
