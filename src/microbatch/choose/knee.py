"""Knee rules over a measured throughput curve, and the recommendation under the constraints.

Pure Python (no torch): ``recommend`` and ``tune`` share it, and so can any other source of
measurements. The curve is :mod:`microbatch.choose.curve`; the bound on larger b_m is
:mod:`microbatch.choose.bound`; the memory fit is :mod:`microbatch.choose.memory_fit`; the
settings are a :class:`~microbatch.choose.config.ChoiceConfig`.

Rule ``fraction`` (the default): the knee is the smallest b_i with T_i ≥ (1 − τ)·(1 + μ)·ref,
ref = max(best measured, T̂ when ``reference="bound"``). Rule ``gain``: the smallest b_i from
which no larger point gains τ per doubling. The derivation, and why τ = 0.15, is in
``docs/knee.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from microbatch.batch import grad_accum_for
from microbatch.choose.bound import ThroughputBound, bound_or_why, choice_margin
from microbatch.choose.config import (
    DEFAULT_RULE,
    DEFAULT_TOLERANCE,
    REFERENCES,
    ChoiceConfig,
    apply_options,
    check_options_used,
)
from microbatch.choose.curve import TIE, CurvePoint, gain_per_doubling, measured_curve
from microbatch.choose.limits import below_oom, candidates
from microbatch.choose.memory_fit import MemoryFit, fit_memory, max_fitting_micro_batch
from microbatch.choose.noise import NOISE_Z, indistinguishable
from microbatch.choose.rows import points_from_records
from microbatch.errors import ConfigError, check_instance
from microbatch.hardware import DEFAULT_HEADROOM

__all__ = [
    "check_reference",
    "Recommendation",
    "knee_fraction",
    "knee_gain",
    "find_knee",
    "flattened",
    "recommend",
    "recommend_measured",
    "points_from_records",
]


def knee_fraction(
    points: Sequence[CurvePoint],
    tolerance: float,
    *,
    bound: float | None = None,
    margin: float = 0.0,
) -> CurvePoint:
    """Smallest b_i with T_i ≥ (1 − τ)·(1 + μ)·max(max T, T̂) (rule ``fraction``; T̂ = ``bound``,
    if given; μ = ``margin``); the fastest point when none reaches it. A b_m given twice: the last counts
    (:func:`~microbatch.choose.curve.measured_curve`); :func:`find_knee` refuses it."""
    curve = measured_curve(points)
    top = max(p.measured_throughput for p in curve)
    ref = max(top, bound or 0.0)
    line = (1.0 - tolerance) * (1.0 + margin) * ref
    within = [p for p in curve if p.measured_throughput >= line * (1.0 - TIE)]
    return within[0] if within else max(curve, key=lambda p: (p.measured_throughput, -p.micro_batch))


def knee_gain(points: Sequence[CurvePoint], tolerance: float) -> CurvePoint:
    """Smallest b_i with max_{j>i} (T_j/T_i)^(1/max(1, log2(b_j/b_i))) − 1 <= τ (rule ``gain``, up to :data:`TIE`): a
    gain over less than a doubling taken as it is, not raised to a doubling's, which raises its noise to the power
    1/log2(b_j/b_i) (b 56 → 64: 1.5% of noise read as 28% "per doubling", and a sweep in steps of 8 chose 64 where its
    noiseless curve chose 48). Every larger point counts, so one dip at the end does not stop the search. A b_m given
    twice: the last counts, as in :func:`knee_fraction`."""
    curve = measured_curve(points)
    for i, p in enumerate(curve):
        later = curve[i + 1 :]
        t = p.measured_throughput
        if t <= 0:
            continue
        if (
            not later
            or max(
                gain_per_doubling(p.micro_batch, t, q.micro_batch, q.measured_throughput, at_least_one=True)
                for q in later
            )
            <= tolerance + TIE
        ):
            return p
    return curve[-1]


def find_knee(
    points: Sequence[CurvePoint],
    *,
    rule: str = DEFAULT_RULE,
    tolerance: float = DEFAULT_TOLERANCE,
    bound: float | None = None,
    margin: float = 0.0,
) -> CurvePoint:
    """The knee of ``points`` by ``rule`` (``fraction`` or ``gain``) at tolerance τ; ``bound``
    (T̂, rule ``fraction`` only) raises the reference above the best measured, and ``margin`` μ
    raises the line a point must clear to (1 − τ)·(1 + μ)·reference. One point per b_m, and some throughput above
    0 (ConfigError otherwise, as :func:`recommend`)."""
    ChoiceConfig(rule=rule, tolerance=tolerance)  # checks both
    if not (measured := measured_curve(points)):
        raise ConfigError("no measured point without out-of-memory to choose from; measure at least one b_m")
    _check_one_per_micro_batch(points)
    _check_some_throughput(measured)
    if rule == "fraction":
        return knee_fraction(points, tolerance, bound=bound, margin=margin)
    return knee_gain(points, tolerance)


def flattened(points: Sequence[CurvePoint], tolerance: float) -> bool:
    """The curve has flattened or fallen: the largest b_m gains less than τ per doubling over the fastest at half its
    b_m or below (over a whole doubling: the rule ``tune``'s search stops on, whose probes double, so the two never
    disagree); with no point that far down, over the fastest below it, a gain over less than a doubling taken as it
    is (knee_gain's rule: 3% of noise over b 56 → 64 is not 24% a doubling, a review of 2026-12-08)."""
    curve = measured_curve(points)
    if len(curve) < 2:
        return False
    b = curve[-1]
    half = [p for p in curve[:-1] if 2 * p.micro_batch <= b.micro_batch]
    a = max(half or curve[:-1], key=lambda p: p.measured_throughput)
    t_a = a.measured_throughput
    return (
        t_a > 0
        and gain_per_doubling(a.micro_batch, t_a, b.micro_batch, b.measured_throughput, at_least_one=not half)
        <= tolerance + TIE
    )


def check_reference(reference: str) -> None:
    """ConfigError unless ``reference`` is one of :data:`~microbatch.choose.config.REFERENCES`."""
    if reference not in REFERENCES:
        raise ConfigError(f"reference {reference!r} is not known; use one of {', '.join(REFERENCES)}")


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The knee and the fastest fitting b_m of a curve, under the constraints given."""

    knee: CurvePoint
    """The chosen b_m (the knee)."""
    fastest: CurvePoint
    """The fastest measured b_m that fits."""
    best_throughput: float
    """Throughput of ``fastest`` (the reference for fraction_of_best)."""
    rule: str
    """Knee rule used."""
    tolerance: float
    """Tolerance τ used."""
    memory_fit: MemoryFit | None
    """Linear fit of peak memory, when two or more points have a peak."""
    max_fitting_micro_batch: int | None
    """Largest b_m predicted to fit under the budget (None without a budget or a fit)."""
    memory_budget_bytes: int | None = None
    """The budget the choice respected (None: none given)."""
    memory_headroom: float = DEFAULT_HEADROOM
    """Share of the budget kept free in the prediction."""
    global_batch: int | None = None
    """B_global, if given (then g = B / (b_m·d))."""
    data_parallel: int = 1
    """d: data-parallel replicas."""
    flattened: bool = False
    """The curve was measured past its flattening (the last doubling gained < τ, or fell)."""
    out_of_memory_above: bool = False
    """A b_m larger than every measured one ran out of memory: no larger b_m is within reach."""
    reference: str = "measured"
    """What rule ``fraction`` measured against: ``measured`` or ``bound`` (``docs/knee.md``)."""
    bound: ThroughputBound | None = None
    """T̂ when ``reference`` is ``bound`` and the tail gives one (None otherwise)."""
    margin: float = 0.0
    """μ: the knee had to reach (1 − τ)·(1 + μ)·reference (with ``reference="bound"``: two relative
    standard errors of the fitted bound, ``choice_margin``, or ``BOUND_MARGIN`` when no bound was
    fitted; else 0)."""
    left_out: tuple[tuple[int, str], ...] = ()
    """Measured b_m not considered, each with why (over the budget, the latency limit, or b_m·d not
    dividing B_global)."""
    indistinguishable: tuple[int, ...] = ()
    """b_m the measurements cannot separate from the knee at their noise (the knee included;
    :func:`microbatch.choose.noise.indistinguishable`). Empty for rule ``gain``."""
    noise_from: str = "repeats"
    """Where the noise ``indistinguishable`` reads came from: ``repeats`` (the points' standard errors, with the
    curve's scatter as their floor) or ``scatter`` (no point has repeats: the curve's scatter about its line alone,
    :func:`microbatch.choose.noise.residual_scatter`, which a bend of the curve inflates)."""
    bound_contradicted: int | None = None
    """A measured b_m faster than the bound T̂ beyond its noise: the bound was dropped (a projection
    never overrides a measurement) and the reference is the measured best."""
    bound_absent: str | None = None
    """Why no bound was fitted, in words, when ``reference`` is ``bound`` and there is none
    (:func:`~microbatch.choose.bound.bound_or_why`); None otherwise."""

    @property
    def knee_fraction_of_reference(self) -> float:
        """The knee's throughput over the reference (0 when the reference is 0)."""
        ref = self.reference_throughput
        return self.knee.measured_throughput / ref if ref > 0 else 0.0

    @property
    def reference_throughput(self) -> float:
        """The throughput the knee is within τ of: max(best measured, T̂)."""
        return max(self.best_throughput, self.bound.throughput if self.bound else 0.0)

    def grad_accum(self, micro_batch: int) -> int | None:
        """g = B_global // (b_m·d), or None without a global batch."""
        if self.global_batch is None:
            return None
        return grad_accum_for(self.global_batch, micro_batch, self.data_parallel)

    def _point(self, p: CurvePoint) -> dict[str, Any]:
        return {
            "micro_batch": p.micro_batch,
            "grad_accum": self.grad_accum(p.micro_batch),
            "throughput": p.throughput,
            "fraction_of_best": (p.measured_throughput / self.best_throughput)
            if self.best_throughput > 0
            else None,
            "peak_memory_bytes": p.peak_memory_bytes,
            "step_time_s": p.step_time_s,
            "checkpointing": p.checkpointing,
        }

    def to_dict(self) -> dict[str, Any]:
        d = self._point(self.knee)
        d.update(
            fastest_fitting=self._point(self.fastest),
            max_fitting_micro_batch=self.max_fitting_micro_batch,
            memory_fit=self.memory_fit.to_dict() if self.memory_fit else None,
            memory_budget_bytes=self.memory_budget_bytes,
            memory_headroom=self.memory_headroom,
            global_batch=self.global_batch,
            data_parallel=self.data_parallel,
            flattened=self.flattened,
            out_of_memory_above=self.out_of_memory_above,
            rule=self.rule,
            tolerance=self.tolerance,
            reference=self.reference,
            reference_throughput=self.reference_throughput,
            fraction_of_reference=(
                self.knee.measured_throughput / self.reference_throughput
                if self.reference_throughput > 0
                else None
            ),
            throughput_bound=self.bound.to_dict() if self.bound else None,
            left_out=[{"micro_batch": b, "why": why} for b, why in self.left_out],
            bound_margin=self.margin,
            indistinguishable=list(self.indistinguishable),
            noise_from=self.noise_from,
            bound_contradicted=self.bound_contradicted,
            bound_absent=self.bound_absent,
        )
        return d


def _check_some_throughput(measured: list[CurvePoint]) -> None:
    """ConfigError when every measured throughput is 0: the knee is a share of the best, and there is none."""
    if not any(p.measured_throughput > 0 for p in measured):
        raise ConfigError(
            f"every measured throughput is 0 (b_m {', '.join(str(p.micro_batch) for p in measured)}): a knee is a "
            "share of the best, and there is none; give the measured samples or tokens per second"
        )


def recommend(
    points: Sequence[CurvePoint], choice: ChoiceConfig | None = None, **options: Any
) -> Recommendation:
    """Choose the knee among the points that fit the budget, the latency limit and B_global.

    ``choice`` holds the settings (a :class:`~microbatch.choose.config.ChoiceConfig`); its
    fields may also be given as keywords (``recommend(points, tolerance=0.05)``), which override
    it. ``reference`` defaults to ``measured`` here, ``data_parallel`` to 1.

    Candidates: measured without OOM; peak ≤ budget when both are known (a point without a measured peak is out
    when a smaller b_m was measured over the budget, or when the rising memory fit puts it over); step time ≤ the
    latency limit; b_m·d divides B_global when B_global is given. The memory fit uses every
    measured point (including those over the budget: they are the most informative).
    With ``reference="bound"`` (rule ``fraction``) the bound is taken from the candidates' tail
    (``docs/knee.md``).
    """
    options = dict(options)
    if choice is not None:
        check_instance(
            "choice",
            choice,
            ChoiceConfig,
            "build ChoiceConfig(...) or give its fields as keywords: recommend(points, tolerance=0.1)",
        )
    choice = apply_options(choice or ChoiceConfig(), options)
    check_options_used(options, "recommend", ChoiceConfig)
    pts = _curve_points(points)
    _check_one_per_micro_batch(pts)
    return recommend_measured(pts, choice)


def _check_one_per_micro_batch(points: Sequence[CurvePoint]) -> None:
    """ConfigError for a b_m measured twice: which of the two counts would decide the knee by their order."""
    seen: dict[int, int] = {}
    for i, p in enumerate(points):
        if p.ok and p.micro_batch in seen:
            raise ConfigError(
                f"micro_batch {p.micro_batch} is measured twice (points {seen[p.micro_batch] + 1} and {i + 1}); "
                "repeats are refused, not averaged: give one point per micro_batch (for example the median of "
                "your repeated runs)",
                params=("points",),
            )
        if p.ok:
            seen[p.micro_batch] = i


def _curve_points(points: object) -> list[CurvePoint]:
    """``points`` as a list of :class:`CurvePoint`, or a ConfigError naming what was given instead (a dict is a
    point written as a mapping: ``CurvePoint(**d)``)."""
    try:
        pts: list[object] = list(points)  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError(
            f"points must be a list of CurvePoint, got {points!r}", params=("points",)
        ) from None
    for i, p in enumerate(pts):
        if not isinstance(p, CurvePoint):
            raise ConfigError(
                f"point {i + 1} is {p!r}, not a CurvePoint; build each as CurvePoint(micro_batch=..., "
                "throughput=...)" + (" (CurvePoint(**d) for a dict)" if isinstance(p, dict) else ""),
                params=("points",),
            )
    return [p for p in pts if isinstance(p, CurvePoint)]


def _nothing_measured(pts: list[CurvePoint]) -> None:
    """The ConfigError for points none of which ran: all out of memory (what to measure again with), or none."""
    if pts and all(p.oom for p in pts):
        smallest = min(p.micro_batch for p in pts)
        start = "a smaller start (the smallest b_m probed), " if smallest > 1 else ""
        raise ConfigError(
            f"micro-batch {smallest} is already out of memory; measure again (`microbatch tune`) with {start}"
            "checkpointing on (training: decoding has no backward to recompute), a shorter seq or a larger "
            "memory budget",
            params=("start", "checkpointing", "seq") if start else ("checkpointing", "seq"),
        )
    raise ConfigError("no measured point to choose from; give at least one point with a throughput")


def recommend_measured(points: Sequence[CurvePoint], choice: ChoiceConfig) -> Recommendation:
    """:func:`recommend` of ``tune``'s own points, which may hold a b_m twice (measured with checkpointing off,
    then on, or re-measured): the last of each b_m is taken (:func:`~microbatch.choose.curve.measured_curve`)."""
    reference = choice.reference or "measured"
    data_parallel = choice.data_parallel or 1
    pts = list(points)
    measured = measured_curve(pts)
    if not measured:
        _nothing_measured(pts)
    _check_some_throughput(measured)
    fine = {
        (p.micro_batch, p.checkpointing) for p in measured
    }  # an OOM beside a success at its b_m caps nothing
    ooms = [p for p in pts if p.oom and (p.micro_batch, p.checkpointing) not in fine]
    cands, left_out = candidates(measured, choice, data_parallel, ooms)
    if not any(p.measured_throughput > 0 for p in cands):
        raise ConfigError(
            f"every b_m that meets the limits (b_m {', '.join(str(p.micro_batch) for p in cands)}) measured a "
            "throughput of 0, and no knee is a share of nothing; relax the memory budget, the latency limit or "
            "B_global, or measure again"
        )
    against_bound = reference == "bound" and choice.rule == "fraction"
    found = bound_or_why(cands) if against_bound else None
    bound = found if isinstance(found, ThroughputBound) else None
    if (contradicted := _contradicts(cands, bound)) is not None:
        bound = None  # a projection never overrides a measurement
    margin = choice_margin(bound) if against_bound else 0.0
    knee = find_knee(
        cands,
        rule=choice.rule,
        tolerance=choice.tolerance,
        bound=bound.throughput if bound else None,
        margin=margin,
    )
    same: tuple[int, ...] = ()
    if choice.rule == "fraction":
        top = max(cands, key=lambda p: p.measured_throughput)
        ref_abs_se = (
            bound.relative_error * bound.throughput
            if bound is not None and bound.throughput > top.measured_throughput
            else (top.throughput_se or 0.0) * top.measured_throughput
        )
        ref = max(top.measured_throughput, bound.throughput if bound else 0.0)
        same = indistinguishable(cands, knee, (1.0 - choice.tolerance) * (1.0 + margin) * ref, ref_abs_se)
    fastest = max(cands, key=lambda p: (p.measured_throughput, -p.micro_batch))
    fit = fit_memory(pts)
    return Recommendation(
        knee=knee,
        fastest=fastest,
        best_throughput=fastest.measured_throughput,
        rule=choice.rule,
        tolerance=float(choice.tolerance),
        memory_fit=fit,
        max_fitting_micro_batch=below_oom(
            max_fitting_micro_batch(fit, choice.memory_budget_bytes, memory_headroom=choice.memory_headroom),
            ooms,
            measured,
        ),
        memory_budget_bytes=choice.memory_budget_bytes,
        memory_headroom=choice.memory_headroom,
        global_batch=choice.global_batch,
        data_parallel=data_parallel,
        flattened=flattened(measured, choice.tolerance),
        out_of_memory_above=any(p.oom and p.micro_batch > max(q.micro_batch for q in measured) for p in pts),
        reference=reference if choice.rule == "fraction" else "measured",  # rule gain reads no reference line
        bound=bound,
        margin=margin,
        left_out=tuple(left_out),
        indistinguishable=same,
        noise_from="repeats" if any(p.throughput_se for p in cands) else "scatter",
        bound_contradicted=contradicted,
        bound_absent=found if isinstance(found, str) else None,
    )


def _contradicts(cands: Sequence[CurvePoint], bound: ThroughputBound | None) -> int | None:
    """The fastest measured b_m that beats the bound T̂ by more than the noise of both (its own
    standard error and T̂'s), or None: a line through the tail that a measurement outruns is not a
    bound on it."""
    if bound is None:
        return None
    beyond = [
        p
        for p in cands
        if p.measured_throughput - bound.throughput
        > NOISE_Z
        * math.hypot(
            (p.throughput_se or 0.0) * p.measured_throughput, bound.relative_error * bound.throughput
        )
    ]
    return max(beyond, key=lambda p: p.measured_throughput).micro_batch if beyond else None
