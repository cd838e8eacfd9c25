"""Confirm the knee: re-measure it, its neighbour and the fastest point alternately before answering.

The doubling search measures each b_m once, one after the other. Where the curve is flat (on a
CPU, a small model is within 20% of its best from b_m = 8 up), the knee is chosen by a few per
cent of throughput, and a machine shared with other jobs moves a probe's throughput by more
than that between one probe and the next (the bench measured b_m = 4 at 585/s and b_m = 8 at
257/s in one run at load 4.7 on 2 cores, where a quiet machine gives 8 about 10% more than 4): a
small b_m measured in a quiet moment passes the line (1 − τ)(1 + μ)·reference, or the larger ones
measured in a busy moment fall below it, and the answer keeps less than 1 − τ of the throughput
it could have had.

:func:`confirm_knee` runs after the search. When the knee has something to be compared with —
the next larger measured b_m (its neighbour) or a faster point — it measures the knee and those
points again, alternately (knee, neighbour, fastest, knee, ...: the drift of the machine falls on
all of them alike), keeps for each the measurement with the median throughput of the three it
now has (a real measurement, not an average: one disturbed probe cannot move it), and chooses
again. When the knee moves, the new knee and its neighbour are measured again the same way. A
knee that is the largest and fastest point measured (the search settled on it) costs nothing more.

The confirmation is budgeted at what the search's own probes took (``CONFIRM_BUDGET``, timed on
``log.clock``): before re-measuring a knee's points (all their rounds) it estimates their cost from
what those points' latest probes took (``log.seconds``; a point taken from the cache is costed as
the longest probe, and a search that measured nothing confirms nothing) and, when the time the
re-measurements already took plus that estimate would overrun the budget, keeps the points as they
are and says so. A confirmation is therefore expected to at most double the time to answer (a
re-measurement can run longer than its estimate on a busy machine; the next knee's then pays for
it); where the search itself walked to the end of a flat curve (a decode run on the 2-core CPU searched
to 512 in about a sweep's time, then spent ~90 s more re-measuring 128, 256 and 512: 254% of the
sweep, BENCHMARKS.md) the expensive re-measurements of the largest points are the ones it drops,
and a close call found early, where the probes are cheap (64 and 128 after a 21 s search: 64 fell
below the line and the knee moved to 128, 66% → 84% of the sweep's best), is still confirmed.

Points timed by CUDA events are not re-measured: they are the device's own time, which other jobs on
the host do not move, and a probe's repeats agree within 0.1–2.8% from b_m 8 up (the relative
interquartile range ``spread`` of gpt2, gpt2-medium and gpt2-large on the H200,
``bench/results/h200-2026-11-30b/rerun/tune/ours_*.json``), under the margin the choice keeps (two
standard errors of the fitted bound: 3.7% on gpt2 there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from microbatch.choose.config import ChoiceConfig
from microbatch.choose.confirm_rules import comparison_group, median_measurement, with_pooled_noise
from microbatch.choose.knee import Recommendation, recommend_measured
from microbatch.choose.tune.search import SearchLog, curve_point
from microbatch.errors import ConfigError, ProbeTimeoutError
from microbatch.measure.probes import Measurement

__all__ = [
    "CONFIRM_BUDGET",
    "CONFIRM_MIN_S",
    "CONFIRM_ROUNDS",
    "DEVICE_CLOCK",
    "confirm_knee",
]

DEVICE_CLOCK = "cuda-events"
"""The clock of points that are not re-measured (:class:`microbatch.measure.device.Device`'s name for
CUDA-event timing)."""

CONFIRM_ROUNDS = 2
"""Re-measurements of the knee and of the fastest point (alternately): with the search's own
measurement, three of each, whose median survives one disturbed probe."""


CONFIRM_MIN_S = 10.0
"""Seconds of re-measurement always allowed (unless the budget is 0), whatever the search took: a
small model's probes on a CPU cost well under a second each and its whole search 2-5 s, so a budget of
a share of the search alone confirmed nothing on 6 of 10 ``tune --model tiny -B 64`` runs beside a busy
process, whose knees moved over 1, 2, 4 and 8 (bench/bench_knee_noise.py, BENCHMARKS.md). Not a
fitted figure: what a user waits for at most, beyond the search, for an answer the noise does not
decide."""

CONFIRM_BUDGET = 1.0
"""The confirmation's time budget as a share of the time the search's probes took: expected to at
most double the time to answer. Not a tuned figure: a bound on the cost of an insurance that, on the
recorded runs, either paid in cheap probes or not at all (module docstring)."""


def _why_not_remeasured(
    pts: list[Measurement], index: dict[int, int], group: list[int], searched: float, budget: float
) -> str | None:
    """Why the knee's group is not measured again (device timings, nothing searched, no budget), or None."""
    if all(pts[index[b]].clock == DEVICE_CLOCK for b in group):
        return "CUDA-event timings (the device's own time)"
    if not searched:
        return "the search measured nothing (its points came from the cache)"
    if not budget:
        return "the confirmation's budget is 0"
    return None


def _cost_s(log: SearchLog, pts: list[Measurement], todo: list[int], rounds: int) -> float:
    """The seconds ``rounds`` re-measurements of ``todo`` should take, from their own probe times."""
    longest = max(log.seconds.values())  # a point taken from the cache: costed as the longest probe
    return rounds * sum(log.seconds.get((pts[i].micro_batch, pts[i].checkpointing), longest) for i in todo)


def _remeasure(
    measure: Callable[[int, bool], Measurement],
    pts: list[Measurement],
    todo: list[int],
    rounds: int,
    log: SearchLog,
    on_point: Callable[[Measurement, bool], None] | None,
) -> tuple[dict[int, list[Measurement]], float]:
    """The points ``todo`` measured ``rounds`` more times, alternately: each one's measurements (the
    search's first) and the seconds the re-measurements took."""
    spent = 0.0
    again: dict[int, list[Measurement]] = {i: [pts[i]] for i in todo}
    for _ in range(rounds):
        for i in todo:
            key = (pts[i].micro_batch, pts[i].checkpointing)
            t0 = log.clock()
            m = measure(*key)
            spent += log.clock() - t0
            if on_point is not None:
                on_point(m, False)  # progress: each re-measurement, as the search's own probes
            log.probes += 1
            log.oom_events += int(m.oom)
            again[i].append(m)
    return again, spent


def _choosable(pts: list[Measurement], rec: Recommendation) -> dict[int, int]:
    """b_m -> index into ``pts`` of the points the choice may take: measured, and not left out by ``rec`` (past a
    limit, or above an out-of-memory: never chosen, so never re-measured)."""
    left = {b for b, _ in rec.left_out}
    return {
        p.micro_batch: i
        for i, p in enumerate(pts)
        if not p.oom and p.throughput and p.micro_batch not in left
    }


def _take(
    pts: list[Measurement], again: dict[int, list[Measurement]], confirmed: set[int], groups: list[list[float]],
    log: SearchLog,
) -> None:  # fmt: skip
    """Put each re-measured point's median in ``pts`` (its throughputs in ``groups``), or, where any of its runs ran
    out of memory, that run: out of memory once is out of memory (it had fitted by chance, or with more free)."""
    for i, ms in again.items():
        confirmed.add(i)
        oom = next((m for m in ms if m.oom), None)
        if oom is not None:
            pts[i] = oom
            log.stop_reason += (
                f"; b_m {oom.micro_batch} ran out of memory when re-measured: taken as out of memory"
            )
            continue
        pts[i] = median_measurement(ms)
        groups.append([m.throughput for m in ms if not m.oom and m.throughput])


def _moved(log: SearchLog, first: int | None, knee: int) -> None:
    if first is not None and knee != first:
        log.stop_reason += f"; the knee moved from {first} to {knee} on the re-measured points"


@dataclass
class _Budget:
    """The confirmation's time: what it may take, what it took."""

    share: float
    """The share of the search's probe time allowed."""
    searched_s: float
    """What the search's probes took (0: all from the cache)."""
    min_s: float
    """Seconds always allowed."""
    agree: Callable[[bool], bool] | None
    """Makes the decision the same on every rank (None: one process)."""
    spent: float = 0.0
    """What the re-measurements took so far."""

    @property
    def allowed_s(self) -> float:
        return max(self.share * self.searched_s, self.min_s) if self.searched_s else 0.0

    def over(self, cost_s: float, sizes: list[int]) -> str | None:
        """Why re-measuring ``sizes`` (about ``cost_s``) would overrun, or None. Read off this process's
        clock: under torch.distributed every rank must take the same branch, or their probes fall out
        of step, so the decision goes through ``agree``."""
        over = self.spent + cost_s > self.allowed_s
        if self.agree is not None:
            over = self.agree(over)
        if not over:
            return None
        return (
            f"{', '.join(map(str, sizes))} would take about {cost_s:.1f} s, more than the "
            f"{max(self.allowed_s - self.spent, 0.0):.1f} s left of the confirmation's budget (max of "
            f"{self.share:g} × the search's {self.searched_s:.1f} s and {self.min_s:g} s)"
        )


def confirm_knee(
    measure: Callable[[int, bool], Measurement],
    points: list[Measurement],
    choice: ChoiceConfig,
    log: SearchLog,
    *,
    rounds: int = CONFIRM_ROUNDS,
    budget: float = CONFIRM_BUDGET,
    on_point: Callable[[Measurement, bool], None] | None = None,
    min_budget_s: float = CONFIRM_MIN_S,
    agree: Callable[[bool], bool] | None = None,
) -> list[Measurement]:
    """The search's ``points`` with the knee and the fastest point re-measured (see the module).

    ``measure(b, checkpointing)`` probes one point (the search's own); ``choice`` is the one the
    answer is chosen with; ``log`` counts the extra probes and says what was confirmed. Returns a
    new list: the re-measured points' entries replaced by their median measurement.
    A Ctrl-C keeps what was measured (``log.interrupted``); a point that runs out of memory on any
    re-measurement is taken as out of memory (and so every larger b_m in its checkpointing mode, by
    :func:`~microbatch.choose.knee.recommend_measured`). ``budget`` (≥ 0): the share of the search's probe time (the
    sum of ``log.seconds``) the re-measurements may take; a knee whose re-measurements, estimated
    from those points' own probe times (a cached point: the longest probe), would overrun what is
    left is not re-measured. A search that measured nothing (all from the cache) confirms nothing.
    ``on_point(m, from_cache)`` is called after each re-measurement (progress). ``min_budget_s``: the
    re-measurement seconds always allowed (:data:`CONFIRM_MIN_S`) when ``budget`` is not 0. ``agree(flag)``
    (several processes measuring together): the budget decision, read off each process's own clock, made
    the same on every rank (True on all if on any); every other decision reads the measurements, which
    the probes already make equal on every rank.
    """
    if not budget >= 0:  # also NaN
        raise ConfigError(
            f"confirmation budget {budget!r} must be >= 0 (a share of the search's time; 0: off)"
        )
    pts = list(points)
    searched = sum(log.seconds.values())  # the points taken from the cache took no time
    money = _Budget(share=budget, searched_s=searched, min_s=min_budget_s, agree=agree)
    confirmed: set[int] = set()  # indices into pts re-measured already
    groups: list[list[float]] = []  # the throughputs of each re-measured point (its search probe first)
    first: int | None = None  # the search's knee
    try:
        while True:
            try:
                rec = recommend_measured([curve_point(p) for p in pts], choice)
            except ConfigError:
                return pts  # nothing to choose from: the caller's recommend says why
            index = _choosable(pts, rec)
            knee = rec.knee.micro_batch
            first = knee if first is None else first
            group = comparison_group(rec, index)
            todo = [index[b] for b in group if index[b] not in confirmed]
            if len(group) < 2 or not todo:
                _moved(log, first, knee)
                return pts  # nothing to compare the knee with, or all of it measured again
            why_not = _why_not_remeasured(pts, index, group, searched, budget)
            if why_not:
                log.stop_reason += f"; knee {knee} not re-measured: {why_not}"
                return pts
            why_over = money.over(_cost_s(log, pts, todo, rounds), [pts[i].micro_batch for i in todo])
            if why_over:
                log.stop_reason += f"; knee {knee} not re-measured: {why_over}"
                _moved(log, first, knee)
                return pts
            again, took = _remeasure(measure, pts, todo, rounds, log, on_point)
            money.spent += took
            _take(pts, again, confirmed, groups, log)
            pts = with_pooled_noise(pts, confirmed, groups, rounds)
            log.stop_reason += (
                f"; knee {knee} checked: {', '.join(str(pts[i].micro_batch) for i in todo)} re-measured "
                f"alternately ({rounds} rounds, median of {rounds + 1})"
            )
    except KeyboardInterrupt:
        log.interrupted = True
        log.stop_reason += "; interrupted (Ctrl-C or SIGTERM) while confirming the knee: the points are kept"
        return pts
    except ProbeTimeoutError as e:  # a re-measurement past the probe time limit: the search's points stand
        log.stop_reason += f"; the knee's re-measurement stopped: {e}"
        return pts
