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
rate, a fixed launch or latency cost), each affine in b: so u is convex in b. For three
measured b_1 < b_2 < b_3 with secant slopes c_12 and c_23, convexity gives, for every b' > b_3,
u(b') ≥ u(b_3) + c_23·(b' − b_3) = a + c_23·b' with a = u(b_3) − c_23·b_3, hence

    T(b') = b'/u(b') ≤ b'/(a + c_23·b') ≤ T̂ = 1/c_23        (a ≥ 0)

and T(b') ≤ T(b_3) when a < 0. The bound is only used when the measured tail is nearly
affine, |c_23/c_12 − 1| ≤ η with η = 0.10: a tail still bending the other way (matrix–vector
kernels giving way to matrix–matrix ones at small b_m) has no bound yet, and a sharp kink is
more often one noisy probe than a real cliff (a repeated CPU probe varies by up to 25% on a
shared machine, BENCHMARKS.md), so a kink is left to the flat rule. η admits mild concavity
(a slope falling < 10% per doubling) as noise; there the bound can be low by up to that much.
On a curve that fits u = a + c·b exactly the knee against T̂ is b ≥ (1 − τ)/τ · a/c.

With the bound the knee is the smallest b_i with T_i ≥ (1 − τ)·max(max_j T_j, T̂), or the
fastest point when none reaches it (the curve is still rising at the largest b_m that fits). On
the seed's curve the slope of u nearly doubles from (4, 8) to (8, 16): a kink, so no bound, and
the knee stays 8 (convexity alone would give T̂ = 6364 and move it to 16). The measured
reference stays the default of ``recommend`` (a curve given whole is taken as the truth);
``tune`` needs the bound because it decides where the curve ends.

**Memory fit.** Peak memory M(b) = M_0 + k·b (activations are linear in b_m: Korthikanti et al.
2022, A ∝ b·s·h·L), fitted by least squares on the largest probes (the smallest are dominated
by allocator granularity). Largest fitting b_m under budget B with headroom ε:

    b_max = floor((B·(1 − ε) − M_0) / k)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from .errors import ConfigError, check_positive_int

__all__ = [
    "DEFAULT_RULE",
    "DEFAULT_TOLERANCE",
    "DEFAULT_HEADROOM",
    "RULES",
    "REFERENCES",
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
BOUND_SLACK = 0.10
"""η: how far the step-time slope of the last secant may differ from the one before (timing
noise) for the tail to count as affine; beyond it no bound is given."""
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
    """T̂ = 1/c_23: no b_m past the largest measured runs faster (see the module docstring)."""

    throughput: float
    """T̂, in the curve's throughput unit."""
    slope: float
    """c_23: growth of u = b/T per unit of b between the two largest points."""
    previous_slope: float
    """c_12: the same between the two points before (c_23 ≥ (1 − η)·c_12 was checked)."""
    fitted_on: tuple[int, int, int]
    """b_1, b_2, b_3: the three largest measured b_m."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        return d


def throughput_bound(points: Sequence[CurvePoint], *, slack: float = BOUND_SLACK) -> ThroughputBound | None:
    """The bound T̂ on the throughput of any b_m larger than the largest measured one.

    From the three largest measured points; None when there are fewer, when u = b/T does not grow
    on both secants, or when the tail is not affine within ``slack`` (|c_23/c_12 − 1| > η).
    """
    curve = [p for p in _curve(points) if p.throughput > 0][-3:]
    if len(curve) < 3:
        return None
    (b1, b2, b3) = (p.micro_batch for p in curve)
    u1, u2, u3 = (p.micro_batch / p.throughput for p in curve)
    c12, c23 = (u2 - u1) / (b2 - b1), (u3 - u2) / (b3 - b2)
    if c23 <= 0 or c12 <= 0 or abs(c23 / c12 - 1.0) > slack:
        return None
    a = u3 - c23 * b3
    top = 1.0 / c23 if a >= 0 else curve[-1].throughput
    return ThroughputBound(throughput=top, slope=c23, previous_slope=c12, fitted_on=(b1, b2, b3))


def knee_fraction(
    points: Sequence[CurvePoint], tolerance: float, *, bound: float | None = None
) -> CurvePoint:
    """Smallest b_i with T_i ≥ (1 − τ)·max(max T, T̂) (rule ``fraction``; T̂ = ``bound``, if given);
    the fastest point when none reaches it."""
    curve = _curve(points)
    top = max(p.throughput for p in curve)
    ref = max(top, bound or 0.0)
    within = [p for p in curve if p.throughput >= (1.0 - tolerance) * ref]
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
) -> CurvePoint:
    """The knee of ``points`` by ``rule`` (``fraction`` or ``gain``) at tolerance τ; ``bound``
    (T̂, rule ``fraction`` only) raises the reference above the best measured."""
    _check_rule(rule, tolerance)
    if not _curve(points):
        raise ConfigError("no measured point without out-of-memory to choose from; measure at least one b_m")
    if rule == "fraction":
        return knee_fraction(points, tolerance, bound=bound)
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
    bs = [float(p.micro_batch) for p in known]
    ms = [float(p.peak_memory_bytes) for p in known]
    bbar, mbar = sum(bs) / len(bs), sum(ms) / len(ms)
    sxx = sum((b - bbar) ** 2 for b in bs)
    k = sum((b - bbar) * (m - mbar) for b, m in zip(bs, ms, strict=True)) / sxx
    return MemoryFit(
        intercept_bytes=mbar - k * bbar, slope_bytes_per_sample=k, fitted_on=tuple(int(b) for b in bs)
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
    knee = find_knee(cands, rule=rule, tolerance=tolerance, bound=bound.throughput if bound else None)
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
