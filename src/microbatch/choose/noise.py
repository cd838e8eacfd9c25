"""Noise the answer owns: each point's standard error and the b_m the measurements cannot tell from
the knee.

Pure Python (no torch). A probe's throughput is the median of its timed repeats, and its spread is
their relative interquartile range (:func:`microbatch.measure.timing.spread`). Two b_m whose
throughputs differ by less than the noise of the two measurements cannot be told apart, and a knee
chosen between them by which one the noise put above the line (1 − τ)(1 + μ)·reference moves from
run to run (on the 2-core VM beside one busy process, three ``tune --model tiny -B 64`` chose 2, 8
and 4: issue 30). So the answer states the set of b_m the measurements cannot separate from its knee
(:func:`indistinguishable`); the knee's confirmation (:mod:`microbatch.choose.tune.confirm`) re-measures
the knee, its neighbour and the fastest point, alternately, before the choice, where its budget
allows; and among the indistinguishable b_m the knee stays the rule's: the least memory whose
median reaches the line — not the fastest measured among them, which is the noise's pick.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

from microbatch.choose.bound import BOUND_SLACK
from microbatch.choose.curve import TIE, CurvePoint
from microbatch.fit import fit_line

__all__ = [
    "MAD_SIGMA",
    "MEDIAN_SE",
    "NOISE_Z",
    "TAIL_POINTS",
    "between_se",
    "indistinguishable",
    "relative_se",
    "residual_scatter",
]

MEDIAN_SE = math.sqrt(math.pi / 2) / 1.349
"""SE of a sample median over (IQR / median) · 1/√n, for a normal population: the median's
asymptotic standard error is √(π/2)·σ/√n (Laplace; e.g. Kendall & Stuart, *The Advanced Theory of
Statistics* vol. 1, §10.10) and the interquartile range of a normal is 1.349·σ. ≈ 0.929."""

MAD_SIGMA = 1.4826
"""σ over the median absolute deviation for a normal population (1 / Φ⁻¹(3/4))."""

NOISE_Z = 2.0
"""Standard errors two measurements must differ by to be told apart (two-sided ~95% for a normal
difference): the same k = 2 as the bound's margin (:data:`microbatch.choose.bound.BOUND_CONFIDENCE`)."""


def relative_se(spread: float | None, repeats: int) -> float:
    """Relative standard error of a probe's median time (and so of its throughput, to first order):
    :data:`MEDIAN_SE` · spread / √repeats; 0 without a spread or with fewer than two repeats."""
    if not spread or repeats < 2 or not math.isfinite(spread):
        return 0.0
    return MEDIAN_SE * spread / math.sqrt(repeats)


def between_se(throughputs: Sequence[float]) -> float:
    """Relative standard error of the median of k repeated measurements of one point, from their own
    scatter (the between-probe noise a machine's drift adds, which one probe's repeats do not see):
    √(π/2) · 1.4826·MAD / (median · √k), the median absolute deviation scaled to a normal's σ
    (robust, as the median it describes: one disturbed probe of three moves neither); 0 for fewer
    than two."""
    k = len(throughputs)
    if k < 2:
        return 0.0
    med = statistics.median(throughputs)
    if med <= 0:
        return 0.0
    mad = statistics.median(abs(t - med) for t in throughputs)
    return math.sqrt(math.pi / 2) * MAD_SIGMA * mad / (med * math.sqrt(k))


TAIL_POINTS = 5
"""Points the residual scatter is read on: the largest measured, as the bound's line
(:data:`microbatch.choose.bound.BOUND_WINDOW`), where the knee is decided."""


def residual_scatter(points: Sequence[CurvePoint], window: int = TAIL_POINTS) -> float:
    """The between-probe noise the curve itself shows: the relative RMS residual of the step time per
    sample u = b/T around its least-squares line u = a + c·b over the ``window`` largest measured
    points, √(Σ((a + c·b − u)/u)² / (n − 2)) (the line the bound is fitted on, ``docs/knee.md``: the
    roofline's step time is affine in b there, so what the line misses is noise, or a bend the
    noise cannot be told from). 0 with fewer than three points, or where the line misses a point by
    more than the bound's slack η (:data:`microbatch.choose.bound.BOUND_SLACK`: the curve bends
    there, as a GPU's flat small-b_m regime does, and the misfit is not noise).

    Each point of the search is one probe, taken at one moment of the machine: its repeats' spread
    does not see the drift between probes (on the 2-core VM beside busy processes, ten ``tune`` runs
    of one model chose four different knees while every set built from the repeats alone named one
    or two b_m, BENCHMARKS.md), this does."""
    curve = sorted((p for p in points if not p.oom and p.throughput), key=lambda p: p.micro_batch)[-window:]
    if len(curve) < 3:
        return 0.0
    bs = [float(p.micro_batch) for p in curve]
    us = [p.micro_batch / p.measured_throughput for p in curve]
    a, c = fit_line(bs, us)
    rel = [(a + c * b - u) / u for b, u in zip(bs, us, strict=True)]
    if max(abs(r) for r in rel) > BOUND_SLACK:
        return 0.0  # not affine within the bound's slack: a bend of the curve, not noise
    return math.sqrt(sum(r * r for r in rel) / (len(curve) - 2))


def _se(p: CurvePoint) -> float:
    """Absolute standard error of a point's throughput."""
    return (p.throughput_se or 0.0) * p.measured_throughput


def indistinguishable(
    candidates: Sequence[CurvePoint], knee: CurvePoint, line: float, reference_se: float, z: float = NOISE_Z
) -> tuple[int, ...]:
    """The b_m among ``candidates`` (measured, fitting points) that the measurements cannot separate
    from ``knee`` at their noise, ascending, the knee included; ``line`` = (1 − τ)(1 + μ)·reference
    is what the knee had to reach, ``reference_se`` the reference's own absolute standard error.

    Every point's standard error is at least the curve's :func:`residual_scatter` (the noise between
    probes). b belongs when |T_b − T_k| ≤ z·√(se_b² + se_k²) (the same throughput at the noise), when b < k
    could pass the line (T_b + z·√(se_b² + se_L²) ≥ line: the noise could make it the knee), or when
    k could fail the line (T_k − z·√(se_k² + se_L²) < line) and b > k, itself able to pass
    it, is at most the first point above k that passes it surely (one that surely fails is never chosen). With no noise recorded (every se 0) only points of the knee's
    exact throughput belong.
    """
    floor = residual_scatter(candidates)
    pts = [
        replace(p, throughput_se=max(p.throughput_se or 0.0, floor))
        for p in sorted(candidates, key=lambda p: p.micro_batch)
    ]
    knee = next(p for p in pts if p.micro_batch == knee.micro_batch)
    reference_se = max(reference_se, floor * line)
    t_k, se_k = knee.measured_throughput, _se(knee)

    def could_fail(p: CurvePoint) -> bool:  # a point exactly on the line meets it, as knee_fraction reads it
        return p.measured_throughput - z * math.hypot(_se(p), reference_se) < line * (1.0 - TIE)

    def could_pass(p: CurvePoint) -> bool:
        return p.measured_throughput + z * math.hypot(_se(p), reference_se) >= line

    members = {knee.micro_batch}
    for p in pts:
        same = abs(p.measured_throughput - t_k) <= z * math.hypot(_se(p), se_k)
        if same or (p.micro_batch < knee.micro_batch and could_pass(p)):
            members.add(p.micro_batch)
    if could_fail(knee):
        for p in pts:
            if p.micro_batch > knee.micro_batch and could_pass(p):
                members.add(p.micro_batch)
                if not could_fail(p):
                    break  # the first that passes surely: no larger b_m could be chosen
    return tuple(sorted(members))
