"""The gradient noise scale: a measured suggestion for B_global, the statistical choice.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162). With G the true gradient and Σ the per-item gradient covariance, the
gradient of a batch of B items has E|G_B|² = |G|² + tr(Σ)/B. The simple noise scale
``B_simple = tr(Σ) / |G|²`` (their §2.2) approximates the critical batch: below it, doubling the
batch nearly halves the steps; far above it, extra items are mostly wasted.

Two gradient norms per step are enough (their Appendix A.1): a small batch's (here the first
micro-batch of :func:`microbatch.run.accumulate.accumulate`, which costs no extra backward) and the
whole batch's.
Each step gives unbiased estimates of |G|² and tr(Σ); both are smoothed separately over steps and
divided only afterwards (the ratio of unbiased estimates is biased). B is counted in the loss's
items: tokens when the loss is a mean over tokens.

This module is the arithmetic only: no torch, no gradients. The gradient norms are taken by
:mod:`microbatch.run.accumulate` (``grad_sq_norm`` and the ``noise=`` hook), and the measurement
loop over batches is :func:`microbatch.run.noise_measure.measure_noise_scale`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from microbatch.errors import ConfigError

__all__ = [
    "g_sq_estimate",
    "trace_sigma_estimate",
    "b_simple",
    "b_simple_rel_se",
    "g_sq_resolved",
    "b_simple_lower",
    "NoiseEstimate",
    "GradientNoiseScale",
]


def _as_number(name: str, v: object) -> float:
    """``v`` as a Python float (a 0-dim tensor or a NumPy scalar read with ``.item()``); ConfigError otherwise."""
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "ndim", 0) == 0:
        v = item()
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"GradientNoiseScale.update's {name} must be a number, got {v!r}", params=(name,))
    return float(v)


def _check_norms(g_small_sq: float, g_big_sq: float) -> None:
    """ConfigError unless both squared gradient norms are finite and >= 0 (a square is never negative)."""
    for name, v in (("g_small_sq", g_small_sq), ("g_big_sq", g_big_sq)):
        try:
            x = float("nan") if isinstance(v, bool | str) else float(v)
        except (TypeError, ValueError):
            x = float("nan")
        if not math.isfinite(x) or x < 0:
            raise ConfigError(
                f"{name} {v!r} must be a finite number >= 0: it is a squared gradient norm, |G|²",
                params=(name,),
            )


def _check_sizes(b_small: float, b_big: float) -> None:
    if not (b_small > 0 and b_big > b_small and math.isfinite(b_big)):
        raise ConfigError(
            f"batch sizes b_small={b_small!r}, b_big={b_big!r}: the estimates need 0 < b_small < b_big "
            "(two different batch sizes); use at least two micro-batches per step"
        )


def g_sq_estimate(*, b_small: float, g_small_sq: float, b_big: float, g_big_sq: float) -> float:
    """Unbiased estimate of |G|²: ``(B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)``.

    McCandlish et al. 2018, Appendix A.1 (estimator of |G|²). Follows from E|G_B|² = |G|² + tr(Σ)/B
    at two batch sizes; assumes items drawn independently (ignores correlation inside sequences
    when B counts tokens). Can be negative for one step: smooth before use.
    """
    _check_sizes(b_small, b_big)
    _check_norms(g_small_sq, g_big_sq)
    return (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)


def trace_sigma_estimate(*, b_small: float, g_small_sq: float, b_big: float, g_big_sq: float) -> float:
    """Unbiased estimate of tr(Σ): ``(|G_small|² − |G_big|²) / (1/B_small − 1/B_big)``.

    McCandlish et al. 2018, Appendix A.1 (estimator of S = tr(Σ)). Same assumptions as
    :func:`g_sq_estimate`.
    """
    _check_sizes(b_small, b_big)
    _check_norms(g_small_sq, g_big_sq)
    return (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)


def b_simple(*, trace_sigma: float, g_sq: float) -> float:
    """The simple noise scale ``B_simple = tr(Σ) / |G|²`` (McCandlish et al. 2018, §2.2).

    In the units of the items the loss averages over. ``inf`` when |G|² ≤ 0 or tr(Σ) < 0 (the gradient, or the
    noise, is not yet resolved above the estimators' own scatter: both are unbiased differences that can fall below
    zero; smooth over more steps); 0 when tr(Σ) is exactly 0 (no noise: any batch estimates the gradient).
    """
    if not (g_sq > 0 and trace_sigma >= 0):
        return math.inf
    return trace_sigma / g_sq


def _weights(n: int, decay: float) -> tuple[list[float], float]:
    """The weights of an exponential average with bias correction over n steps, the last weighing 1 (decay^(n−1−i)),
    and Σw²/(Σw)²: the variance of the weighted mean of n independent draws over the draws' own (1/n at decay 1, 1 at
    decay 0: the last step alone)."""
    w = [decay ** (n - 1 - i) for i in range(n)]
    return w, sum(x * x for x in w) / sum(w) ** 2


def b_simple_rel_se(per_step: Sequence[tuple[float, float]], decay: float = 1.0) -> float | None:
    """The relative standard error of B_simple = T̄/Ḡ over ``per_step`` (|G|², tr(Σ)) pairs, T̄ and Ḡ their averages
    with ``decay`` (:func:`_weights`: the smoothed estimate the command prints; 1, the plain means), by the delta method
    on a ratio of means: var(ln B) ≈ var(T̄)/T̄² + var(Ḡ)/Ḡ² − 2·cov(T̄, Ḡ)/(T̄·Ḡ), each var and cov of an average the
    steps' sample one × Σw²/(Σw)² (the weights are fixed: the command measures at one set of weights, its steps
    independent draws). None with fewer than two steps or an average not above 0 (no B_simple to err about)."""
    n = len(per_step)
    if n < 2:
        return None
    gs, ts = [p[0] for p in per_step], [p[1] for p in per_step]
    w, share = _weights(n, decay)
    mg, mt = (sum(x * v for x, v in zip(w, gs, strict=True)) / sum(w),
              sum(x * v for x, v in zip(w, ts, strict=True)) / sum(w))  # fmt: skip
    if not (mg > 0 and mt > 0):
        return None
    pg, pt = sum(gs) / n, sum(ts) / n  # the steps' scatter, about their plain means
    var_g = sum((g - pg) ** 2 for g in gs) / (n - 1) * share
    var_t = sum((t - pt) ** 2 for t in ts) / (n - 1) * share
    cov = sum((g - pg) * (t - pt) for g, t in zip(gs, ts, strict=True)) / (n - 1) * share
    return math.sqrt(max(0.0, var_t / mt**2 + var_g / mg**2 - 2 * cov / (mt * mg)))


RESOLVED_STANDARD_ERRORS = 2.0
"""How many standard errors of its mean the |G|² estimate must stand above 0 for B_simple to be read as a value
(:func:`g_sq_resolved`): two, a one-sided 97.7% bound under a normal mean — as Student's t with the steps' n − 1
degrees of freedom (:func:`resolved_errors`), the scatter being estimated from those steps. Below it B_simple = tr(Σ)/|G|² divides by
a denominator its own scatter could put at zero, and the first-order error of :func:`b_simple_rel_se` no longer
holds: a dead-ReLU net whose exact B_simple is 12,766 read 126 (± 46%), 828 (± 101%) and 1,862 (± 208%) after 50
to 400 steps (a read-only audit, 2026-12-07)."""


MIN_STEPS = 5
"""Steps below which no B_simple is judged resolved nor a B_global suggested: with 2, 3 and 5 steps a true B of ∞
read as resolved in 11.5%, 5.0% and 4.0% of runs at two normal standard errors (a helper's 400 runs, 2026-12-07);
with t's quantile (:func:`resolved_errors`) from 5 on."""


MAX_SUGGEST_SE = 0.3
"""The relative standard error of B_simple past which no B_global is suggested: the delta method's first order fails
there (a helper's runs, 2026-12-07: a true B of 1,011 read 142–210 in the runs just resolved, at ± 30–48%; none of the
five covered it)."""


def resolved_errors(n: int) -> float:
    """Student's t quantile at :data:`RESOLVED_STANDARD_ERRORS`' one-sided level (z = 2: 97.7%) with n − 1 degrees of
    freedom, by the Cornish–Fisher expansion (Abramowitz & Stegun 26.7.5, four terms: within 1% from 4 degrees of
    freedom, 2.87 at 4, 2.23 at 19); inf under :data:`MIN_STEPS` steps."""
    if n < MIN_STEPS:
        return math.inf
    z, v = RESOLVED_STANDARD_ERRORS, n - 1
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def g_sq_resolved(per_step: Sequence[tuple[float, float]], decay: float = 1.0) -> bool | None:
    """Whether the average |G|² over ``per_step`` (|G|², tr(Σ)) pairs (with ``decay``, as printed) stands
    :func:`resolved_errors` standard errors above 0; None with fewer than :data:`MIN_STEPS` steps (too little scatter
    to judge by). When it does not, B_simple is at best a lower bound: the true gradient is not yet seen through the
    noise."""
    stats = _g_sq_mean_se(per_step, decay)
    if stats is None or len(per_step) < MIN_STEPS:
        return None
    return stats[0] > resolved_errors(len(per_step)) * stats[1]


def _g_sq_mean_se(per_step: Sequence[tuple[float, float]], decay: float = 1.0) -> tuple[float, float] | None:
    """(average, its standard error) of the |G|² estimates of ``per_step`` with ``decay``; None under two steps."""
    n = len(per_step)
    if n < 2:
        return None
    gs = [p[0] for p in per_step]
    w, share = _weights(n, decay)
    plain = sum(gs) / n
    return sum(x * g for x, g in zip(w, gs, strict=True)) / sum(w), math.sqrt(
        sum((g - plain) ** 2 for g in gs) / (n - 1) * share
    )


def b_simple_lower(per_step: Sequence[tuple[float, float]], decay: float = 1.0) -> float | None:
    """A lower bound on B_simple from ``per_step`` (|G|², tr(Σ)) pairs: mean tr(Σ) over |G|² at its mean plus
    :data:`RESOLVED_STANDARD_ERRORS` standard errors — what to say where |G|² is not resolved (:func:`g_sq_resolved`).
    The point estimate is no bound there: over Monte Carlo runs with a true B of 200 (8 steps), the ratio of the means
    lay above it in 68% of the unresolved runs, this bound in 1.1% (a review, 2026-12-07). None under two steps or
    where mean tr(Σ) is not above 0. Of the averages with ``decay`` (as printed), t's quantile from :data:`MIN_STEPS`
    steps (two standard errors below: no bound is claimed, :func:`g_sq_resolved` is None there)."""
    stats = _g_sq_mean_se(per_step, decay)
    if stats is None:
        return None
    w, _ = _weights(len(per_step), decay)
    mt = sum(x * p[1] for x, p in zip(w, per_step, strict=True)) / sum(w)
    k = resolved_errors(len(per_step))
    top = stats[0] + (k if math.isfinite(k) else RESOLVED_STANDARD_ERRORS) * stats[1]
    return mt / top if mt > 0 and top > 0 else None


@dataclass(frozen=True, kw_only=True)
class NoiseEstimate:
    """The smoothed noise-scale estimate after some steps."""

    steps: int
    """Steps (optimizer steps) that contributed."""
    g_sq: float
    """Smoothed unbiased estimate of |G|², the squared norm of the true gradient."""
    trace_sigma: float
    """Smoothed unbiased estimate of tr(Σ), the trace of the per-item gradient covariance."""
    b_simple: float
    """tr(Σ)/|G|² of the smoothed values, in items (tokens when the loss is per token); inf if |G|² ≤ 0."""
    last_g_sq: float
    """This step's unsmoothed |G|² estimate."""
    last_trace_sigma: float
    """This step's unsmoothed tr(Σ) estimate."""
    decay: float
    """Smoothing weight of the past (1 = plain mean over all steps)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


class GradientNoiseScale:
    """The hook: feed it each step's two gradient norms, read the smoothed B_simple.

    Pass it as ``noise=`` to :func:`microbatch.run.accumulate.accumulate` (it then pairs each micro-batch with
    the whole batch, at no extra backward), or call :meth:`update` from a loop written by hand.
    Smoothing is an exponential moving average with bias correction, ``decay`` weighting the past
    (``decay=1`` is the plain mean over all steps, best for a fixed model; McCandlish et al. smooth
    with an EMA during training). |G|² and tr(Σ) are smoothed separately; B_simple is their ratio.
    """

    def __init__(self, *, decay: float = 0.95) -> None:
        try:
            if isinstance(decay, bool | str):
                raise TypeError
            d = float(decay)
        except (TypeError, ValueError):
            raise ConfigError(f"decay must be a number in [0, 1], got {decay!r}") from None
        if not 0.0 <= d <= 1.0:
            raise ConfigError(
                f"decay {decay!r} is outside [0, 1]; use e.g. 0.95 (recent steps weigh more) or 1 (plain mean)"
            )
        self.decay = d
        self._weight = 0.0
        self._g_sq = 0.0
        self._trace = 0.0
        self._last: tuple[float, float] | None = None
        self.steps = 0
        self.skipped = 0
        """Steps fed no estimate: one micro-batch (or none with items before the last) on every rank, so only one
        batch size was seen, or gradients not finite (:meth:`skip`)."""
        self.nonfinite = 0
        """Of :attr:`skipped`, the steps whose gradient norms were not finite (an fp16 overflow a ``GradScaler`` then
        skips, a NaN loss): left out of the averages rather than stopping the training loop."""

    def add_estimates(self, *, g_sq: float, trace_sigma: float) -> NoiseEstimate:
        """Add one step's unbiased estimates of |G|² and tr(Σ); return the smoothed estimate."""
        if not (math.isfinite(g_sq) and math.isfinite(trace_sigma)):
            raise ConfigError(f"noise estimates must be finite, got |G|²={g_sq!r}, tr(Σ)={trace_sigma!r}")
        self._weight = self.decay * self._weight + 1.0
        self._g_sq = self.decay * self._g_sq + g_sq
        self._trace = self.decay * self._trace + trace_sigma
        self._last = (g_sq, trace_sigma)
        self.steps += 1
        return self._smoothed(self._last)

    def skip(self, *, warn: bool = True, nonfinite: bool = False) -> None:
        """Count a step that saw one batch size only, and on the first warn (``warn``: under DDP rank 0 alone;
        Python shows a warning once per place in a process): B_simple needs two (a micro-batch and the whole
        batch), so a batch split into one micro-batch adds nothing and :attr:`estimate` stays as it was (None before
        any usable step). ``nonfinite``: the step's gradient norms were inf or NaN instead (counted in
        :attr:`nonfinite`, warned on its first)."""
        self.skipped += 1
        if nonfinite:
            self.nonfinite += 1
            if self.nonfinite == 1 and warn:
                warnings.warn(
                    "GradientNoiseScale: a step's gradient norm was not finite (inf or NaN: an fp16 overflow, a NaN "
                    "loss): it was left out of the noise scale (hook.nonfinite counts them)",
                    stacklevel=4,
                )
            return
        if self.skipped - self.nonfinite == 1 and warn:
            warnings.warn(
                "GradientNoiseScale: a step with one micro-batch (or no items before the last) gives one batch size, "
                "and B_simple needs two: it was skipped (hook.skipped counts them); give a micro_batch_size smaller "
                "than the batch",
                stacklevel=4,
            )

    def update(self, *, b_small: float, g_small_sq: float, b_big: float, g_big_sq: float) -> NoiseEstimate:
        """Add one step from the squared gradient norms at two batch sizes (in items).

        ``g_small_sq`` is |∇ mean loss|² over ``b_small`` items, ``g_big_sq`` over ``b_big`` items
        (e.g. one micro-batch and the whole batch). See :func:`g_sq_estimate`. Tensors and NumPy scalars are read
        as Python floats (the estimate's fields are plain numbers).
        """
        b_small, g_small_sq, b_big, g_big_sq = (
            _as_number(k, v)
            for k, v in (
                ("b_small", b_small),
                ("g_small_sq", g_small_sq),
                ("b_big", b_big),
                ("g_big_sq", g_big_sq),
            )
        )
        return self.add_estimates(
            g_sq=g_sq_estimate(b_small=b_small, g_small_sq=g_small_sq, b_big=b_big, g_big_sq=g_big_sq),
            trace_sigma=trace_sigma_estimate(
                b_small=b_small, g_small_sq=g_small_sq, b_big=b_big, g_big_sq=g_big_sq
            ),
        )

    @property
    def estimate(self) -> NoiseEstimate | None:
        """The smoothed estimate so far, or None before the first step."""
        return None if self._last is None else self._smoothed(self._last)

    def _smoothed(self, last: tuple[float, float]) -> NoiseEstimate:
        """The bias-corrected averages of |G|² and tr(Σ), then their ratio; ``last`` is this step's pair."""
        g_sq = self._g_sq / self._weight
        trace = self._trace / self._weight
        return NoiseEstimate(
            steps=self.steps,
            g_sq=g_sq,
            trace_sigma=trace,
            b_simple=b_simple(trace_sigma=trace, g_sq=g_sq),
            last_g_sq=last[0],
            last_trace_sigma=last[1],
            decay=self.decay,
        )

    @property
    def b_simple(self) -> float | None:
        """Smoothed B_simple in items, or None before the first step."""
        est = self.estimate
        return None if est is None else est.b_simple
