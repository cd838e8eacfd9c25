"""Knee rules over a measured throughput curve, the linear memory fit, and the recommendation.

Pure Python (no torch): ``recommend`` and ``tune`` share it, and so can any other source of
measurements.

**The curve.** Points (b_i, T_i): micro-batch size and throughput (samples/s or tokens/s; the
rules only use ratios). Out-of-memory points, points over the memory budget and points slower
than the latency limit are not candidates.

**Rule ``fraction``** (the default): the knee is the smallest b_i with

    T_i ≥ (1 − τ) · max_j T_j

i.e. the smallest micro-batch within a tolerance τ of the best measured throughput. It sees a
curve that falls (on CPUs once the working set leaves the cache): the best is then in the
middle, and nothing past it is ever smaller *and* faster.

**Rule ``gain``**: the knee is the smallest b_i for which no larger point gains τ per doubling,

    g_i = max_{j > i} (T_j / T_i)^(1 / log2(b_j / b_i)) − 1  <  τ

The exponent normalises uneven steps (1 → 4 is two doublings); taking the maximum over all
larger points rather than only the next one keeps a single noisy dip from stopping the search
early. A falling curve gives g_i < 0 and stops there. If every g_i ≥ τ, the curve has not
flattened and the knee is the largest measured point.

**Default: ``fraction`` with τ = 0.15.** Why ``fraction``: it answers the question the user
asks ("how much throughput do I give up?") in one number, it is insensitive to how densely the
curve was sampled, and it handles falling curves directly. Why 15%: (1) the seed's own worked
example calls b_m = 8 the knee at 5000 of a best 5600 tokens/s, i.e. 10.7% below the best, so τ
must exceed 0.107 to reproduce it (0.10 would pick 16); (2) repeated timings on a shared
machine differ by a few per cent (``BENCHMARKS.md``, "Measure: tune": 1–13% between two runs
of the same probe, median 6%), so τ must be well above the noise for the choice to be stable from
run to run; (3) past the knee each doubling of b_m doubles the
activation memory for a gain of ~10% or less, and that memory is worth more as headroom,
longer sequences or less recomputation. With τ = 0.15 both rules pick 8 on the seed curve.
Ask for ``--tolerance 0.05`` to favour throughput.

**Reference: the best measured, or a bound on what a larger b_m can reach.** Rule ``fraction``
measures the knee against a reference throughput. ``reference="measured"`` (the default of
:func:`recommend`) takes the best measured point. That is exact when the curve was measured
past its plateau, but a search that stops early (``tune``) has not seen the best, and "within τ
of the best measured" is then a promise about the points measured, not about the model.
``reference="bound"`` (the default of ``tune``) takes max(best measured, T̂), where T̂ bounds
the throughput of every b_m larger than the largest measured one (:func:`throughput_bound`):

Write u(b) = b / T(b), the step time per unit of throughput (for throughput in samples/s it
is the step time itself). Under the roofline (Williams, Waterman and Patterson, CACM 2009) a
step's time is the largest of its resource times (bytes moved over bandwidth, FLOPs over peak
rate, a fixed launch or latency cost), each affine in b: so u is convex in b. Fit
u ≈ a + c·b by least squares on the k = 5 largest measured points b_1 < … < b_k (at least 4:
on three a line has one degree of freedom left, too few to tell a bend from noise).
The least-squares slope is a weighted mean of the pairwise secant slopes,

    c = Σ_{i<j} w_ij·s_ij,   w_ij = (b_j − b_i)² / Σ (b_j − b_i)²,   s_ij = (u_j − u_i)/(b_j − b_i)

and for a convex u every s_ij ≤ s_{k−1,k}, the last secant's slope; convexity also gives
u(b') ≥ u(b_k) + s_{k−1,k}·(b' − b_k) ≥ u(b_k) + c·(b' − b_k) for every b' > b_k. With
a' = u(b_k) − c·b_k,

    T(b') = b'/u(b') ≤ b'/(a' + c·b') ≤ T̂ = 1/c        (a' ≥ 0)

and T(b') ≤ T(b_k) when a' < 0. The fit over five points rather than the last secant alone is
what makes T̂ usable on a CPU: one probe varies by 3–5% from run to run (up to 25% on a shared
machine, BENCHMARKS.md), a secant's slope amplifies that about three-fold, and five points
average it out; the price is a looser bound (c ≤ s_{k−1,k}) on a curve that is truly convex.

The bound is only used when the tail is nearly affine: every point within η = 15% of the line
(|a + c·b_i − u_i| ≤ η·u_i). A tail with a sharp bend (a cache cliff, matrix–vector kernels
giving way to matrix–matrix ones, the staircase of GPU waves) misses the line by more and gets
no bound; the flat rule then decides. Within η mild concavity passes as noise (on the CPU,
decoding's marginal cost per sequence falls ~4% per doubling as the GEMMs grow), so T̂ can be
low by about that much.

With the bound the knee is the smallest b_i with T_i ≥ (1 − τ)·(1 + μ)·max(max_j T_j, T̂), or
the fastest point when none reaches it (the curve is still rising at the largest b_m that fits).
The margin μ = 5% is there because the reference is an estimate: T̂ fitted on five probes with
~3% noise each is off by ~4%, and the best measured by a search that stopped early is low by up
to a doubling's gain; without it a point just under the line is chosen about half the time. On a
curve that fits u = a + c·b exactly the knee is b ≥ x/(1 − x) · a/c with x = (1 − τ)(1 + μ).

On the seed's four points the line fits within 11%, so the bound is T̂ = 7,978 and the knee moves
to 16, the fastest: against the bound the seed's curve has not flattened yet (16 is at 70% of
T̂), and ``tune`` would go on to 32. The measured
reference stays the default of ``recommend`` (a curve given whole is taken as the truth, and
picks the seed's 8); ``tune`` needs the bound because it decides where the curve ends.

**Memory fit.** Peak memory M(b) = M_0 + k·b (activations are linear in b_m: Korthikanti et al.
2022, A ∝ b·s·h·L), fitted by least squares on the largest probes (the smallest are dominated
by allocator granularity). Largest fitting b_m under budget B with headroom ε:

    b_max = floor((B·(1 − ε) − M_0) / k)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from microbatch.errors import ConfigError, check_positive_int
from microbatch.fit import fit_line

__all__ = [
    "DEFAULT_RULE",
    "DEFAULT_TOLERANCE",
    "DEFAULT_HEADROOM",
    "RULES",
    "REFERENCES",
    "BOUND_WINDOW",
    "BOUND_MIN_POINTS",
    "BOUND_SLACK",
    "BOUND_MARGIN",
    "check_reference",
    "CurvePoint",
    "ThroughputBound",
    "throughput_bound",
    "MemoryFit",
    "Recommendation",
    "gain_per_doubling",
    "knee_fraction",
    "knee_gain",
    "find_knee",
    "fit_memory",
    "max_fitting_micro_batch",
    "recommend",
    "points_from_records",
]

RULES = ("fraction", "gain")
REFERENCES = ("measured", "bound")
"""What rule ``fraction`` measures against: the best measured point, or also the bound on larger b_m."""
BOUND_WINDOW = 5
"""How many of the largest measured points the bound's line is fitted on (five doublings)."""
BOUND_MIN_POINTS = 4
"""Fewest points the bound's line is fitted on: on three, a line has one degree of freedom left
and its residual test cannot tell a bend from noise."""
BOUND_SLACK = 0.15
"""η: the largest relative residual of the bound's line for the tail to count as affine (timing
noise); beyond it no bound is given."""
BOUND_MARGIN = 0.05
"""μ: with ``reference="bound"`` a point counts as within τ of the reference only if it reaches
(1 − τ)·(1 + μ) of it: the reference is an estimate (a bound fitted on five probes with ~3% noise
each has ~4% error; a best measured by a search that stopped early is low by up to a doubling's
gain)."""
DEFAULT_RULE = "fraction"
"""Default knee rule (see the module docstring for why)."""
DEFAULT_TOLERANCE = 0.15
"""Default tolerance τ: 15% of the best throughput (see the module docstring for why)."""
DEFAULT_HEADROOM = 0.10
"""Share of the memory budget kept free when predicting the largest fitting b_m: the fit's own
error is under 1% at the largest probe (BENCHMARKS.md), the rest covers what a probe does not
see — allocator fragmentation and segment rounding, NCCL or gloo buffers, a longer batch than
the probe's, and other processes on the device."""


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    """One measured point of the throughput curve."""

    micro_batch: int
    """b_m: sequences per forward/backward."""
    throughput: float | None = None
    """Samples (or tokens) per second; None when the probe ran out of memory."""
    peak_memory_bytes: int | None = None
    """Peak memory of the probe (None when unknown)."""
    oom: bool = False
    """The probe ran out of memory."""
    step_time_s: float | None = None
    """Time of one step (a micro-step in training, one token in decoding), for latency limits."""

    def __post_init__(self) -> None:
        check_positive_int("micro_batch", self.micro_batch, fix="micro-batch sizes are whole numbers >= 1")
        if self.throughput is not None:
            t = self.throughput
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ConfigError(
                    f"throughput {t!r} at micro_batch {self.micro_batch} must be a finite number >= 0"
                )
        if self.peak_memory_bytes is not None:
            m = self.peak_memory_bytes
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
                raise ConfigError(
                    f"peak_memory_bytes {m!r} at micro_batch {self.micro_batch} must be a finite number >= 0"
                )
        if not self.oom and self.throughput is None:
            raise ConfigError(
                f"point micro_batch {self.micro_batch} has no throughput and is not marked oom; "
                "give a throughput or oom: true"
            )

    @property
    def ok(self) -> bool:
        return not self.oom and self.throughput is not None


def gain_per_doubling(b1: int, t1: float, b2: int, t2: float) -> float:
    """Throughput gain per doubling of b_m between two points: (t2/t1)^(1/log2(b2/b1)) − 1."""
    if b2 <= b1 or t1 <= 0:
        raise ValueError("need b2 > b1 and t1 > 0")
    return (t2 / t1) ** (1.0 / math.log2(b2 / b1)) - 1.0


def _curve(points: Iterable[CurvePoint]) -> list[CurvePoint]:
    best: dict[int, CurvePoint] = {}
    for p in points:
        if p.ok:
            best[p.micro_batch] = p
    return [best[b] for b in sorted(best)]


@dataclass(frozen=True, kw_only=True)
class ThroughputBound:
    """T̂ = 1/c: no b_m past the largest measured runs faster (see the module docstring)."""

    throughput: float
    """T̂, in the curve's throughput unit."""
    slope: float
    """c: least-squares slope of u = b/T against b over ``fitted_on``."""
    intercept: float
    """a: the fit's u at b = 0."""
    max_residual: float
    """Largest |a + c·b − u| / u over ``fitted_on`` (at most η was checked)."""
    fitted_on: tuple[int, ...]
    """The largest measured b_m the line was fitted on (up to ``BOUND_WINDOW``, at least 4)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        return d


def throughput_bound(
    points: Sequence[CurvePoint], *, slack: float = BOUND_SLACK, window: int = BOUND_WINDOW
) -> ThroughputBound | None:
    """The bound T̂ on the throughput of any b_m larger than the largest measured one.

    Fits u = a + c·b by least squares on the ``window`` largest measured points (at least 4);
    None when there are fewer, when c ≤ 0, or when the tail is not affine within ``slack``
    (some |a + c·b − u| / u > η).
    """
    curve = [p for p in _curve(points) if p.throughput > 0][-window:]
    if len(curve) < BOUND_MIN_POINTS:
        return None
    bs = [float(p.micro_batch) for p in curve]
    us = [p.micro_batch / p.throughput for p in curve]
    a, c = fit_line(bs, us)
    if c <= 0:
        return None
    worst = max(abs(a + c * b - u) / u for b, u in zip(bs, us, strict=True))
    if worst > slack:
        return None
    # u(b') ≥ u_n + c·(b' − b_n) for b' > b_n; its intercept decides between 1/c and T(b_n)
    top = 1.0 / c if us[-1] - c * bs[-1] >= 0 else curve[-1].throughput
    return ThroughputBound(
        throughput=top,
        slope=c,
        intercept=a,
        max_residual=worst,
        fitted_on=tuple(p.micro_batch for p in curve),
    )


def knee_fraction(
    points: Sequence[CurvePoint],
    tolerance: float,
    *,
    bound: float | None = None,
    margin: float = 0.0,
) -> CurvePoint:
    """Smallest b_i with T_i ≥ (1 − τ)·(1 + μ)·max(max T, T̂) (rule ``fraction``; T̂ = ``bound``,
    if given; μ = ``margin``); the fastest point when none reaches it."""
    curve = _curve(points)
    top = max(p.throughput for p in curve)
    ref = max(top, bound or 0.0)
    line = (1.0 - tolerance) * (1.0 + margin) * ref
    within = [p for p in curve if p.throughput >= line]
    return within[0] if within else max(curve, key=lambda p: (p.throughput, -p.micro_batch))


def knee_gain(points: Sequence[CurvePoint], tolerance: float) -> CurvePoint:
    """Smallest b_i with max_{j>i} (T_j/T_i)^(1/log2(b_j/b_i)) − 1 < τ (rule ``gain``)."""
    curve = _curve(points)
    for i, p in enumerate(curve):
        later = curve[i + 1 :]
        if p.throughput <= 0:
            continue
        if (
            not later
            or max(gain_per_doubling(p.micro_batch, p.throughput, q.micro_batch, q.throughput) for q in later)
            < tolerance
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
    raises the line a point must clear to (1 − τ)·(1 + μ)·reference."""
    _check_rule(rule, tolerance)
    if not _curve(points):
        raise ConfigError("no measured point without out-of-memory to choose from; measure at least one b_m")
    if rule == "fraction":
        return knee_fraction(points, tolerance, bound=bound, margin=margin)
    return knee_gain(points, tolerance)


def flattened(points: Sequence[CurvePoint], tolerance: float) -> bool:
    """The curve has flattened or fallen: the last doubling gained less than τ."""
    curve = _curve(points)
    if len(curve) < 2:
        return False
    a, b = curve[-2], curve[-1]
    return (
        a.throughput > 0
        and gain_per_doubling(a.micro_batch, a.throughput, b.micro_batch, b.throughput) < tolerance
    )


def check_reference(reference: str) -> None:
    """ConfigError unless ``reference`` is one of :data:`REFERENCES`."""
    if reference not in REFERENCES:
        raise ConfigError(f"reference {reference!r} is not known; use one of {', '.join(REFERENCES)}")


def _check_rule(rule: str, tolerance: float) -> None:
    if rule not in RULES:
        raise ConfigError(f"knee rule {rule!r} is not known; use one of {', '.join(RULES)}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (0 <= tolerance < 1):
        raise ConfigError(
            f"tolerance {tolerance!r} must be a number in [0, 1), e.g. 0.15 for 15% of the best"
        )


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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        return d


def fit_memory(points: Sequence[CurvePoint], *, largest: int = 3) -> MemoryFit | None:
    """Least-squares line through the ``largest`` biggest b_m with a known peak (None if < 2).

    k = Σ(b−b̄)(M−M̄) / Σ(b−b̄)², M_0 = M̄ − k·b̄.
    """
    known = sorted(
        {p.micro_batch: p for p in points if p.ok and p.peak_memory_bytes is not None}.values(),
        key=lambda p: p.micro_batch,
    )[-largest:]
    if len(known) < 2:
        return None
    m0, k = fit_line([float(p.micro_batch) for p in known], [float(p.peak_memory_bytes) for p in known])
    return MemoryFit(
        intercept_bytes=m0, slope_bytes_per_sample=k, fitted_on=tuple(p.micro_batch for p in known)
    )


def max_fitting_micro_batch(
    fit: MemoryFit | None, budget_bytes: float | None, *, headroom: float = DEFAULT_HEADROOM
) -> int | None:
    """floor((B·(1 − ε) − M_0) / k); None without a fit, a budget or a positive slope; 0 if nothing fits."""
    if fit is None or budget_bytes is None or fit.slope_bytes_per_sample <= 0:
        return None
    usable = budget_bytes * (1.0 - headroom) - fit.intercept_bytes
    return max(0, math.floor(usable / fit.slope_bytes_per_sample + 1e-9))


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
    headroom: float = DEFAULT_HEADROOM
    """Share of the budget kept free in the prediction."""
    global_batch: int | None = None
    """B_global, if given (then g = B / (b_m·d))."""
    data_parallel: int = 1
    """d: data-parallel replicas."""
    flattened: bool = False
    """The curve was measured past its flattening (the last doubling gained < τ, or fell)."""
    reference: str = "measured"
    """What rule ``fraction`` measured against: ``measured`` or ``bound`` (see the module docstring)."""
    bound: ThroughputBound | None = None
    """T̂ when ``reference`` is ``bound`` and the tail gives one (None otherwise)."""
    margin: float = 0.0
    """μ: the knee had to reach (1 − τ)·(1 + μ)·reference (``BOUND_MARGIN`` with ``reference="bound"``,
    else 0)."""

    @property
    def reference_throughput(self) -> float:
        """The throughput the knee is within τ of: max(best measured, T̂)."""
        return max(self.best_throughput, self.bound.throughput if self.bound else 0.0)

    def grad_accum(self, micro_batch: int) -> int | None:
        if self.global_batch is None:
            return None
        return self.global_batch // (micro_batch * self.data_parallel)

    def _point(self, p: CurvePoint) -> dict:
        return {
            "micro_batch": p.micro_batch,
            "grad_accum": self.grad_accum(p.micro_batch),
            "throughput": p.throughput,
            "fraction_of_best": (p.throughput / self.best_throughput) if self.best_throughput > 0 else None,
            "peak_memory_bytes": p.peak_memory_bytes,
            "step_time_s": p.step_time_s,
        }

    def to_dict(self) -> dict:
        d = self._point(self.knee)
        d.update(
            fastest_fitting=self._point(self.fastest),
            max_fitting_micro_batch=self.max_fitting_micro_batch,
            memory_fit=self.memory_fit.to_dict() if self.memory_fit else None,
            memory_budget_bytes=self.memory_budget_bytes,
            headroom=self.headroom,
            global_batch=self.global_batch,
            data_parallel=self.data_parallel,
            flattened=self.flattened,
            rule=self.rule,
            tolerance=self.tolerance,
            reference=self.reference,
            reference_throughput=self.reference_throughput,
            fraction_of_reference=(
                self.knee.throughput / self.reference_throughput if self.reference_throughput > 0 else None
            ),
            throughput_bound=self.bound.to_dict() if self.bound else None,
            bound_margin=self.margin,
        )
        return d


def recommend(
    points: Sequence[CurvePoint],
    *,
    rule: str = DEFAULT_RULE,
    tolerance: float = DEFAULT_TOLERANCE,
    memory_budget_bytes: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    max_latency_ms: float | None = None,
    global_batch: int | None = None,
    data_parallel: int = 1,
    reference: str = "measured",
) -> Recommendation:
    """Choose the knee among the points that fit the budget, the latency limit and B_global.

    Candidates: measured without OOM; peak ≤ budget when both are known; step time ≤ the
    latency limit; b_m·d divides B_global when B_global is given. The memory fit uses every
    measured point (including those over the budget: they are the most informative).
    ``reference``: ``measured`` or ``bound`` (rule ``fraction``; the bound is taken from the
    candidates' tail, see the module docstring).
    """
    _check_rule(rule, tolerance)
    check_reference(reference)
    check_positive_int("data_parallel", data_parallel)
    if global_batch is not None:
        check_positive_int("global_batch", global_batch)
    if not (0 <= headroom < 1):
        raise ConfigError(f"headroom {headroom!r} must be in [0, 1), e.g. 0.1 to keep 10% of the budget free")
    pts = list(points)
    measured = _curve(pts)
    if not measured:
        if pts and all(p.oom for p in pts):
            smallest = min(p.micro_batch for p in pts)
            raise ConfigError(
                f"micro-batch {smallest} is already out of memory; turn activation checkpointing on "
                "(--checkpointing on), shorten the sequence (--seq) or raise the memory budget"
            )
        raise ConfigError("no measured point to choose from; give at least one point with a throughput")
    cands = measured
    why = []
    if memory_budget_bytes is not None:
        cands = [
            p for p in cands if p.peak_memory_bytes is None or p.peak_memory_bytes <= memory_budget_bytes
        ]
        why.append(f"peak memory <= {memory_budget_bytes} bytes")
    if max_latency_ms is not None:
        if any(p.step_time_s is None for p in cands):
            raise ConfigError("--max-latency-ms needs step_time_s for every point; add a step_time_s column")
        cands = [p for p in cands if p.step_time_s * 1e3 <= max_latency_ms]
        why.append(f"step time <= {max_latency_ms} ms")
    if global_batch is not None:
        per = global_batch / data_parallel
        cands = [p for p in cands if per == int(per) and int(per) % p.micro_batch == 0]
        why.append(f"b_m x d = b_m x {data_parallel} divides global batch {global_batch}")
    if not cands:
        raise ConfigError(
            f"no measured micro-batch meets {' and '.join(why)}; measured: "
            + ", ".join(str(p.micro_batch) for p in measured)
            + "; relax the limit or measure other sizes"
        )
    bound = throughput_bound(cands) if reference == "bound" and rule == "fraction" else None
    margin = BOUND_MARGIN if reference == "bound" and rule == "fraction" else 0.0
    knee = find_knee(
        cands, rule=rule, tolerance=tolerance, bound=bound.throughput if bound else None, margin=margin
    )
    fastest = max(cands, key=lambda p: (p.throughput, -p.micro_batch))
    fit = fit_memory(pts)
    return Recommendation(
        knee=knee,
        fastest=fastest,
        best_throughput=fastest.throughput,
        rule=rule,
        tolerance=float(tolerance),
        memory_fit=fit,
        max_fitting_micro_batch=max_fitting_micro_batch(fit, memory_budget_bytes, headroom=headroom),
        memory_budget_bytes=memory_budget_bytes,
        headroom=headroom,
        global_batch=global_batch,
        data_parallel=data_parallel,
        flattened=flattened(measured, tolerance),
        reference=reference,
        bound=bound,
        margin=margin,
    )


def points_from_records(records: Iterable[dict], *, source: str = "measurements") -> list[CurvePoint]:
    """CurvePoints from dicts with ``micro_batch``, ``throughput``, optional ``peak_memory_bytes``,
    ``oom`` and ``step_time_s`` (extra keys are ignored). Raises ConfigError naming the bad row."""
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ConfigError(
                f"{source}: row {i + 1} is {type(r).__name__}, not an object with micro_batch and throughput"
            )
        if "micro_batch" not in r:
            raise ConfigError(
                f"{source}: row {i + 1} has no 'micro_batch'; each row needs micro_batch and throughput"
            )
        oom = _bool(r.get("oom", False), source, i)
        if "throughput" not in r and not oom:
            raise ConfigError(
                f"{source}: row {i + 1} has no 'throughput'; each row needs micro_batch and throughput"
            )
        try:
            out.append(
                CurvePoint(
                    micro_batch=_num(r["micro_batch"], int),
                    throughput=None if oom else _num(r.get("throughput"), float),
                    peak_memory_bytes=_bytes(_num(r.get("peak_memory_bytes"), float)),
                    oom=oom,
                    step_time_s=_num(r.get("step_time_s"), float),
                )
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: row {i + 1}: {e}") from None
    if not out:
        raise ConfigError(f"{source}: no rows; give a list of {{micro_batch, throughput}} points")
    return out


def _num(v, kind):
    if v is None or v == "":
        return None
    if isinstance(v, bool):
        raise ConfigError(f"{v!r} is not a number")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{v!r} is not a number") from None
    if kind is int:
        if not math.isfinite(f) or f != int(f):
            raise ConfigError(f"micro_batch {v!r} must be a whole number >= 1")
        return int(f)
    if not math.isfinite(f):
        raise ConfigError(f"{v!r} must be finite")
    return f


def _bytes(v):
    if v is None:
        return None
    if v < 0:
        raise ConfigError(f"peak_memory_bytes {v!r} must be >= 0")
    return int(round(v))


def _bool(v, source: str, i: int) -> bool:
    if isinstance(v, bool):
        return v
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "0", "false", "no")) or v == 0:
        return False
    if (isinstance(v, str) and v.strip().lower() in ("1", "true", "yes")) or v == 1:
        return True
    raise ConfigError(f"{source}: row {i + 1}: oom {v!r} must be true or false")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_bytes(text: str | int | float, *, name: str = "memory budget") -> int:
    """Bytes in ``"12GiB"``, ``"500MB"``, ``"1.5g"`` (binary for the one-letter forms) or a plain number."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        s = str(text).strip().lower().replace(" ", "")
        i = len(s)
        while i > 0 and s[i - 1].isalpha():
            i -= 1
        num, unit = s[:i], s[i:]
        try:
            value = float(num)
        except ValueError:
            value = float("nan")
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{name} {text!r} is not a size; give a positive number with a unit, e.g. 12GiB, 500MB or 2e9"
        )
    return int(value * _UNITS[unit])
