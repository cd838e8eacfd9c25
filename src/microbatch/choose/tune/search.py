"""The search: measure throughput and peak memory as b_m doubles, fit memory, stop at the knee.

:func:`search` doubles b_m (along the divisors of B_global / d when B_global is given), never
probes a b_m the memory fit predicts past the budget, and stops when the knee is settled against
the bound, the curve flattens ``patience`` times, memory runs out, a step is over ``max_latency_ms``
beyond its noise, ``max_micro_batch`` is reached or Ctrl-C comes; ``refine`` probes once between
the knee and the point below. The strategy and why each stop rule: ``docs/search.md``. Settings:
:class:`~microbatch.choose.tune.config.SearchConfig` and :class:`~microbatch.choose.config.ChoiceConfig`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from microbatch.batch import first_micro_batch, next_micro_batch, per_replica
from microbatch.choose.bound import BOUND_MIN_POINTS, choice_margin, throughput_bound
from microbatch.choose.config import ChoiceConfig
from microbatch.choose.curve import CurvePoint, gain_per_doubling
from microbatch.choose.knee import knee_fraction, recommend_measured
from microbatch.choose.memory_fit import fit_memory
from microbatch.choose.noise import NOISE_Z, relative_se
from microbatch.choose.tune.config import SearchConfig
from microbatch.errors import ConfigError, MeasurementError, ProbeTimeoutError
from microbatch.measure.batch_check import BatchDidNotGrow
from microbatch.measure.probes import Measurement

__all__ = ["SETTLE_SHARE", "SearchLog", "StopSearch", "curve_point", "search", "Measure", "OnPoint"]


class StopSearch(Exception):
    """Raised by ``measure`` when a b_m cannot be measured and no larger one could be either (the
    user's data holds too few batches of it; a probe past its time limit): the search ends there with the
    points so far, the message as its stop reason. Not for errors that make the earlier points wrong.
    ``params``: the parameters the message names, for the ConfigError raised when nothing was measured."""

    def __init__(self, message: str, *, params: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.params = params


Measure = Callable[[int, bool], Measurement]
"""``measure(b, checkpointing)``: probe one point."""
OnPoint = Callable[[Measurement, bool], None]
"""``on_point(m, from_cache)``: called after each point (progress display)."""

SETTLE_SHARE = 0.5
"""The search settles once a measured point reaches (1 − τ)(1 + μ/2) of the reference (μ: the
choice's margin, :func:`microbatch.choose.bound.choice_margin`): halfway
between the bare line (which settled on a point that only just reached it: a decode run stopped at
64 with 85.1% of T̂, 80% of the sweep's best) and the choice's own line (which costs one more
doubling too often). Chosen by simulation (BENCHMARKS.md, "Measure: tune")."""


def curve_point(m: Measurement) -> CurvePoint:
    """The point of the throughput curve a measurement gives (with its relative standard error)."""
    se = m.throughput_se if m.throughput_se is not None else relative_se(m.spread, m.repeats)
    return CurvePoint(
        micro_batch=m.micro_batch,
        throughput=None if m.oom else m.throughput,
        peak_memory_bytes=m.peak_memory_bytes,
        oom=m.oom,
        step_time_s=m.step_time_s,
        throughput_se=se,
        checkpointing=m.checkpointing,
    )


@dataclass
class SearchLog:
    """What the search did besides measuring."""

    stop_reason: str = ""
    """Why the search stopped."""
    skipped: list[int] = field(default_factory=list)
    """b_m not probed because the fit predicted they would not fit."""
    interrupted: bool = False
    """Ctrl-C ended the search."""
    oom_events: int = 0
    """Probes that ran out of memory."""
    probes: int = 0
    """Probes measured now (not from the cache)."""
    cached: int = 0
    """Points taken from the cache."""
    seconds: dict[tuple[int, bool], float] = field(default_factory=dict)
    """Seconds each point's latest probe took, by (b_m, checkpointing), on ``clock`` (what a
    re-measurement costs; :func:`microbatch.choose.tune.confirm.confirm_knee` budgets with it). The whole
    ``measure`` call: with ``tune``'s child-process prober that includes starting a child when one
    is needed (the first probe, and the one after an out-of-memory kill)."""
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)
    """The clock probes are timed with (a simulation gives its own)."""


class _Walk:
    """The state of one search: the points so far, the checkpointing in use, the log."""

    def __init__(
        self,
        measure: Measure,
        config: SearchConfig,
        choice: ChoiceConfig,
        known: dict[tuple[int, bool], Measurement],
        on_point: OnPoint | None,
        log: SearchLog,
    ) -> None:
        self.measure, self.config, self.choice = measure, config, choice
        self.reference = choice.reference or "bound"
        self.known, self.on_point, self.log = known, on_point, log
        self.points: list[Measurement] = []
        self.ckpt = config.checkpointing == "on"
        d, B = choice.data_parallel or 1, choice.global_batch
        self.per_replica = None if B is None else per_replica(B, d)
        """B_global / d: the search probes only its divisors (:func:`microbatch.batch.next_micro_batch`)."""
        budget = choice.memory_budget_bytes
        self.usable = None if budget is None else budget * (1.0 - choice.memory_headroom)

    def probe(self, b: int) -> Measurement:
        key = (b, self.ckpt)
        if key in self.known:
            m, cached = self.known[key], True
            self.log.cached += 1
        else:
            t0 = self.log.clock()
            try:
                m, cached = self.measure(b, self.ckpt), False
            except ProbeTimeoutError as e:  # a larger b_m takes longer still: the walk ends below it
                raise StopSearch(str(e), params=e.params) from None
            except MeasurementError as e:  # its process crashed, or the model raised at this size
                if not any(not p.oom for p in self.points):  # no measured point stands below it
                    raise
                raise StopSearch(f"{e}; the points below it stand", params=()) from None
            except BatchDidNotGrow as e:  # the data ran out past the points measured (else nothing stands)
                if not e.grown:
                    raise
                raise StopSearch(str(e), params=e.params) from None
            self.log.seconds[key] = self.log.clock() - t0
            self.log.probes += 1
            self.log.oom_events += int(m.oom)
        self.points.append(m)
        if self.on_point is not None:
            self.on_point(m, cached)
        return m

    def mode_points(self) -> list[CurvePoint]:
        return [curve_point(p) for p in self.points if p.checkpointing == self.ckpt]

    def settled(self) -> str | None:
        """Why the knee cannot move any more (rule fraction against the bound), or None."""
        choice, budget = self.choice, self.choice.memory_budget_bytes
        if choice.rule != "fraction" or self.reference != "bound":
            return None
        ok = [
            p for p in self.mode_points() if p.ok and (budget is None or (p.peak_memory_bytes or 0) <= budget)
        ]
        bound = throughput_bound(ok)
        if bound is None:
            return None
        tau = choice.tolerance
        best = max(p.measured_throughput for p in ok)
        margin = choice_margin(bound)
        if best < (1.0 - tau) * (1.0 + SETTLE_SHARE * margin) * max(bound.throughput, best):
            return None  # no measured point reaches the settle line yet
        knee = knee_fraction(ok, tau, bound=bound.throughput, margin=margin)
        first, last = bound.fitted_on[0], bound.fitted_on[-1]
        return (
            f"knee settled: no micro-batch past {last} can beat {bound.throughput:,.1f}/s (the step-time "
            f"line fitted from {first} to {last} as the search stopped), and {knee.micro_batch} is within "
            f"{100 * tau:g}% of it"
        )

    def predicted_not_to_fit(self, b: int) -> bool:
        if self.usable is None:
            return False
        fit = fit_memory(self.mode_points())
        return fit is not None and fit.predict(b) > self.usable

    def flat_stop(self, b: int, m: Measurement, flat: int) -> tuple[int, str | None]:
        """The count of flat doublings in a row after ``m`` at ``b``, and why to stop (or None)."""
        tau = self.choice.tolerance
        ok = [p for p in self.points if not p.oom and p.micro_batch < b and p.throughput]
        if not ok or m.throughput is None:
            return flat, None
        best = max(ok, key=lambda p: p.throughput or 0.0)
        gain = gain_per_doubling(best.micro_batch, best.throughput or 0.0, b, m.throughput)
        flat = flat + 1 if gain < tau else 0
        # against the bound, the flat rule waits until a bound could be fitted: two flat
        # doublings among the first three probes are weak evidence on a noisy machine
        enough = self.reference != "bound" or len(ok) + 1 >= BOUND_MIN_POINTS
        if flat >= self.config.patience and enough:
            return flat, (
                f"throughput flattened: {b} gains {100 * gain:.1f}% per doubling over {best.micro_batch}"
                f" (< {100 * tau:g}%)"
            )
        return flat, None

    def over_latency(self, m: Measurement) -> bool:
        """Whether ``m``'s step is over ``max_latency_ms`` by more than its noise: the lower edge of its band,
        step · (1 − :data:`~microbatch.choose.noise.NOISE_Z` · its relative standard error), past the limit (one
        noisy reading a hair over, where the step is flat in b_m, does not end the walk)."""
        limit, step = self.choice.max_latency_ms, m.step_time_s
        if limit is None or step is None:
            return False
        return step * 1e3 * (1.0 - NOISE_Z * relative_se(m.spread, m.repeats)) > limit

    def walk(self) -> None:
        """Double b_m until a stop rule fires (the log says which)."""
        cap, auto = self.config.max_micro_batch, self.config.checkpointing == "auto"
        b, flat = first_micro_batch(self.config.start, self.per_replica), 0
        while True:
            if cap is not None and b > cap:
                self.log.stop_reason = f"reached the largest micro-batch allowed ({cap})"
                return
            if self.predicted_not_to_fit(b):
                if auto and not self.ckpt:
                    self.ckpt = True
                    continue
                self.log.skipped.append(b)
                self.log.stop_reason = f"micro-batch {b} is predicted not to fit the memory budget"
                return
            m = self.probe(b)
            if m.oom:
                if auto and not self.ckpt:
                    self.ckpt = True
                    continue
                self.log.stop_reason = f"micro-batch {b} ran out of memory"
                return
            if self.over_latency(m):
                # a doubled b_m does the work of two: its step is no shorter (decoding's per-token latency as flat
                # as memory-bound steps run is at worst equal), so it is over the limit too
                self.log.stop_reason = (
                    f"micro-batch {b}'s step, {(m.step_time_s or 0.0) * 1e3:.3g} ms, is over max_latency_ms "
                    f"{self.choice.max_latency_ms:g} by more than its noise; a larger one is no faster"
                )
                return
            why = self.settled()
            if why:
                self.log.stop_reason = why
                return
            flat, why = self.flat_stop(b, m, flat)
            if why:
                self.log.stop_reason = why
                return
            step = next_micro_batch(b, self.per_replica)
            if step is None:
                self.log.stop_reason = (
                    f"reached the per-replica batch B_global / d = {self.per_replica} (g = 1)"
                )
                return
            b = step

    def refine(self) -> None:
        """One more probe halfway between the knee and the measured point below it."""
        ok = [curve_point(p) for p in self.points if not p.oom]
        if len(ok) < 2:
            return
        c = self.choice
        try:
            knee = recommend_measured(
                ok,
                ChoiceConfig(
                    rule=c.rule,
                    tolerance=c.tolerance,
                    memory_budget_bytes=c.memory_budget_bytes,
                    reference=self.reference,
                ),
            ).knee
        except ConfigError:
            return
        lower = [p.micro_batch for p in ok if p.micro_batch < knee.micro_batch]
        if not lower:
            return
        below, half = max(lower), (max(lower) + knee.micro_batch) / 2
        per = self.per_replica  # only a b_m an exact B_global allows, where B_global is given
        between = [b for b in range(below + 1, knee.micro_batch) if per is None or per % b == 0]
        if not between:
            return
        mid = min(between, key=lambda b: (abs(b - half), b))
        if mid in {p.micro_batch for p in self.points} or self.predicted_not_to_fit(mid):
            return
        self.probe(mid)


def search(
    measure: Measure,
    config: SearchConfig | None = None,
    choice: ChoiceConfig | None = None,
    *,
    known: dict[tuple[int, bool], Measurement] | None = None,
    on_point: OnPoint | None = None,
    log: SearchLog | None = None,
) -> list[Measurement]:
    """Doubling search (see the module docstring); every point, in the order measured.

    ``measure(b, checkpointing)`` probes one point; ``config`` says how to walk (default
    :class:`SearchConfig`), ``choice`` gives the stop rules' τ, rule, reference (default
    ``bound``) and memory budget; ``known`` holds cached points; ``on_point(m, from_cache)`` is
    called after each point; ``log`` receives why the search stopped.
    """
    walk = _Walk(
        measure,
        config or SearchConfig(),
        choice or ChoiceConfig(),
        dict(known or {}),
        on_point,
        log if log is not None else SearchLog(),
    )
    try:
        walk.walk()
        if walk.config.refine:
            walk.refine()
    except KeyboardInterrupt:
        walk.log.interrupted = True
        walk.log.stop_reason = "interrupted (Ctrl-C or SIGTERM); the points measured so far are kept"
    except StopSearch as stop:
        if not any(p.throughput for p in walk.points if not p.oom):
            raise ConfigError(str(stop), params=stop.params) from None  # nothing measured: nothing to choose
        walk.log.stop_reason = str(stop)
    return walk.points
