"""Run a pipeline schedule on op durations: an event simulation, plus the closed forms.

:func:`simulate` replays a :class:`~microbatch.schedules.action.Schedule` as the ranks run it, each
rank its own list in order, an op starting at ``max(rank free, every dependency done + comm)``;
dependency-driven, so linear in the number of actions. Times are in the caller's unit, one number or
one per virtual stage; ``peak_in_flight`` counts micro-batches of a whole rank's layers. The rules
(overlapped forwards, what "in flight" means, the units) are in ``docs/simulate.md``; the bubble's
closed forms are :mod:`microbatch.schedules.closed_forms` (re-exported here), the in-flight ones the
registry's rules (:func:`microbatch.schedules.in_flight.in_flight_formula`).
"""

from __future__ import annotations

import functools
import gc
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import add
from typing import Any, ParamSpec, TypeVar

from microbatch.errors import ConfigError, ScheduleError, plain_number
from microbatch.schedules.action import Action, Schedule
from microbatch.schedules.closed_forms import (
    DUALPIPEV_CLOSED_FORM_RULE,
    ZB_IDLE_SCHEDULES,
    StageTimesLike,
    bubble_fraction,
    bubble_ratio,
    dualpipev_closed_form_holds,
    dualpipev_idle_time,
    dualpipev_step_time,
    non_negative_time,
    zb_h1_closed_form_holds,
    zb_h1_step_time,
    zb_idle_time,
)

__all__ = [
    "DUALPIPEV_CLOSED_FORM_RULE",
    "ZB_IDLE_SCHEDULES",
    "SimResult",
    "Time",
    "dualpipev_flush_time",
    "bubble_fraction",
    "bubble_ratio",
    "dualpipev_closed_form_holds",
    "dualpipev_idle_time",
    "simulate",
    "zb_h1_flush_time",
    "zb_idle_time",
]

P = ParamSpec("P")
R = TypeVar("R")

Time = float | Sequence[float]
"""An op duration: one number for every virtual stage, or one number per virtual stage."""

# --------------------------------------------------------------------------------------------
# Simulation


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What a simulated schedule did. Times are in the caller's unit."""

    schedule: Schedule
    """The schedule that ran."""
    intervals: tuple[tuple[tuple[float, float, Action], ...], ...] = field(repr=False)
    """Per rank, ``(start, end, action)`` in the order the rank ran them."""
    makespan: float
    """Time from the first start (0) to the last end over all ranks."""
    busy: tuple[float, ...]
    """Per rank, the sum of its ops' durations."""
    idle: tuple[float, ...]
    """Per rank, ``makespan − busy``: waiting at the start, in the middle and at the end."""
    bubble_fraction: float
    """Total idle over total stage time (p × makespan): the idle share, in [0, 1)."""
    bubble_ratio: float
    """Total idle over total busy time (Megatron's bubble / ideal); infinite if nothing ran."""
    peak_in_flight_chunks: tuple[int, ...]
    """Per rank, the most (virtual stage, micro-batch) activation chunks held at once."""
    comm_time: float = 0.0
    """Point-to-point latency paid on every cross-rank dependency."""

    @property
    def stages(self) -> int:
        """p: ranks."""
        return self.schedule.stages

    @property
    def peak_in_flight(self) -> tuple[float, ...]:
        """Per rank, peak micro-batches in flight in units of a rank's layers (chunks / v)."""
        v = self.schedule.virtual
        return tuple(c if v == 1 else c / v for c in self.peak_in_flight_chunks)

    def stage_stats(self) -> list[dict[str, Any]]:
        """Per rank: ``{stage, busy, idle, peak_in_flight}`` (``stage`` is the rank index)."""
        peaks = self.peak_in_flight  # once: a property that walks every rank
        return [
            {"stage": r, "busy": self.busy[r], "idle": self.idle[r], "peak_in_flight": peaks[r]}
            for r in range(self.stages)
        ]

    def activation_timeline(self) -> list[list[tuple[float, int]]]:
        """Per rank, the steps ``(time, chunks held)``: +1 at a forward's end, −1 at the end of
        the last part of that micro-batch's backward (B, or W when split). Starts at (0, 0)."""
        out = []
        for rank in self.intervals:
            held = 0
            steps = [(0.0, 0)]
            for _, end, a in rank:
                if a.kind == "F":
                    held += 1
                elif a.kind in ("B", "W"):  # a micro-batch ends with B, or with W when split
                    held -= 1
                else:
                    continue
                steps.append((end, held))
            out.append(steps)
        return out

    def timeline_rows(self) -> list[list[tuple[float, float, str, int]]]:
        """Per rank, plain ``(start, end, label, microbatch)`` rows for :mod:`microbatch.show.text`.

        The label is the kind (F, B, I, W), prefixed with the chunk number when v > 1 (``1F``)."""
        v, p = self.schedule.virtual, self.schedule.stages
        rows = []
        for rank in self.intervals:
            if v == 1:
                rows.append([(s, e, a.kind, a.microbatch) for s, e, a in rank])
            else:
                rows.append([(s, e, f"{a.stage // p}{a.kind}", a.microbatch) for s, e, a in rank])
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-op intervals)."""
        return {
            "schedule": self.schedule.name,
            "stages": self.schedule.stages,
            "microbatches": self.schedule.microbatches,
            "virtual": self.schedule.virtual,
            "placement": self.schedule.placement,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "bubble_ratio": self.bubble_ratio,
            "peak_in_flight": list(self.peak_in_flight),
            "comm_time": self.comm_time,
            "stage_stats": self.stage_stats(),
        }


def _per_stage(name: str, value: object, num_stages: int) -> list[float]:
    """``value`` as one float per virtual stage."""
    value = plain_number(value)  # NumPy's and torch's 0-d numbers as Python's
    if isinstance(value, str | bytes | bool):
        non_negative_time(name, value)  # refuses it, naming it
    if isinstance(value, numbers.Real):  # NumPy's numbers too
        return [non_negative_time(name, value)] * num_stages
    try:
        items = list(value)  # type: ignore[call-overload]  # a sequence, or a TypeError below
    except TypeError:
        raise ConfigError(f"{name} must be a number or one number per virtual stage, got {value!r}") from None
    if len(items) != num_stages:
        raise ConfigError(
            f"{name} has {len(items)} values but the schedule has {num_stages} virtual stages (p·v); "
            "give one value per virtual stage, or a single number"
        )
    return [non_negative_time(f"{name}[{i}]", x) for i, x in enumerate(items)]


def _gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with the cyclic garbage collector paused: a simulation allocates ~2 tuples per
    action and no reference cycles, and pausing the collector saves about a third of the time on
    large schedules."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper


@_gc_paused
def simulate(
    schedule: Schedule,
    *,
    forward_time: Time,
    backward_time: Time | None = None,
    input_time: Time | None = None,
    weight_time: Time | None = None,
    comm_time: float = 0.0,
) -> SimResult:
    """Run ``schedule`` on op durations and return the timeline and its statistics.

    ``backward_time`` is the full backward B; ``input_time`` and ``weight_time`` the two parts
    of a split backward (I and W). A schedule with B needs ``backward_time`` (or both parts,
    then B = I + W); a schedule with I and W needs ``input_time`` and ``weight_time``.
    ``comm_time`` is added to every dependency between different ranks. Raises
    :class:`~microbatch.errors.ScheduleError` if the ranks' orders deadlock (see
    :func:`microbatch.schedules.validate.validate` for a full check), and
    :class:`~microbatch.errors.ConfigError` if the times overflow (a makespan past the largest float).
    """
    if not hasattr(schedule, "num_virtual_stages"):
        raise ConfigError(
            f"schedule must be a Schedule (its ranks' orders), got {schedule!r}; build one by name with p, m and v: "
            "microbatch.schedules.registry.generate('1f1b', 4, 8)"
        )
    nst = schedule.num_virtual_stages
    comm = non_negative_time("comm_time", comm_time)
    dur_by_kind = _durations_by_kind(
        schedule,
        _per_stage("forward_time", forward_time, nst),
        None if backward_time is None else _per_stage("backward_time", backward_time, nst),
        None if input_time is None else _per_stage("input_time", input_time, nst),
        None if weight_time is None else _per_stage("weight_time", weight_time, nst),
    )
    plan, durations, deltas = _compile(schedule, dur_by_kind, comm)
    starts, free = _run(schedule, plan)
    return _result(schedule, starts, durations, deltas, free, comm)


_Op = tuple[int, float, int, float, int, float]
"""One compiled action: (completion slot, duration, dependency 1, its comm time, dependency 2, its comm time)."""


def _durations_by_kind(
    schedule: Schedule,
    f_t: list[float],
    b_t: list[float] | None,
    i_t: list[float] | None,
    w_t: list[float] | None,
) -> dict[str, list[float]]:
    """Per kind (F, B, I, W), one duration per virtual stage; refuses times the schedule's kinds lack."""
    nst = schedule.num_virtual_stages
    kinds = {a.kind for rank in schedule.actions for a in rank}
    if kinds & {"I", "W"} and (i_t is None or w_t is None):
        raise ConfigError(
            f"schedule {schedule.name!r} splits the backward into I and W: input_time and weight_time are "
            "required; a full backward time does not say how to split it",
            params=("input_time", "weight_time"),
        )
    if "B" in kinds and b_t is None:
        if i_t is not None and w_t is not None:
            b_t = [a + b for a, b in zip(i_t, w_t, strict=True)]
        else:
            raise ConfigError(
                f"schedule {schedule.name!r} runs full backwards: backward_time is required, "
                "or both input_time and weight_time",
                params=("backward_time", "input_time", "weight_time"),
            )
    zero = [0.0] * nst
    return {"F": f_t, "B": b_t or zero, "I": i_t or zero, "W": w_t or zero}


def _compile(
    schedule: Schedule, dur_by_kind: dict[str, list[float]], comm: float
) -> tuple[list[list[_Op]], list[list[float]], list[list[int]]]:
    """Per rank, its actions as flat index rows (``_Op``), their durations and in-flight deltas."""
    m, nst = schedule.microbatches, schedule.num_virtual_stages
    rank_of = [schedule.stage_to_rank(s) for s in range(nst)]

    # Completion times live in one flat list: slot (F = 0, B or I = 1, W = 2; B and I share a
    # slot because "B or I on stage s+1" is one dependency), then stage, then micro-batch. A
    # missing dependency points into a tail of m zeros (done at time 0), so the loop needs no
    # branches. Per rank and kind, a template per stage gives the base indices and durations; it
    # is built on first use, for the stages the rank runs (building one for every rank × every
    # stage up front cost p² time and memory: 4·10⁸ tuples for p = 10,000).
    none_base = 3 * nst * m

    def template(r: int, k: str, st: int) -> tuple[int, float, int, float, int, float, int]:
        """The row of kind ``k`` on virtual stage ``st`` run by rank ``r``."""
        c_prev = comm if st > 0 and rank_of[st - 1] != r else 0.0
        c_next = comm if st < nst - 1 and rank_of[st + 1] != r else 0.0
        # in flight from F's end to the end of B, or of W for a split backward (DualPipeV
        # mixes the two: each micro-batch has either B or I and W)
        delta = 1 if k == "F" else (0 if k == "I" else -1)
        dur = dur_by_kind[k][st]
        if k == "F":
            d1 = (st - 1) * m if st > 0 else none_base
            return (st * m, dur, d1, c_prev, none_base, 0.0, delta)
        if k == "W":
            return ((2 * nst + st) * m, dur, (nst + st) * m, 0.0, none_base, 0.0, delta)
        # B or I: its own F, and B or I of the next stage
        d2 = (nst + st + 1) * m if st < nst - 1 else none_base
        return ((nst + st) * m, dur, st * m, 0.0, d2, c_next, delta)

    def outside(r: int, s: int, k: str, mb: int) -> ScheduleError:
        return ScheduleError(
            f"rank {r}: action {s}{k}{mb} is outside the schedule (p·v = {nst}, m = {m}, kinds F/B/I/W)"
        )

    plan: list[list[_Op]] = []
    durations: list[list[float]] = []
    deltas: list[list[int]] = []
    for r, acts in enumerate(schedule.actions):
        tmpl: dict[str, dict[int, tuple[int, float, int, float, int, float, int]]] = {
            k: {} for k in dur_by_kind
        }
        ops: list[_Op] = []
        durs: list[float] = []
        dels: list[int] = []
        append_op, append_dur, append_del = ops.append, durs.append, dels.append
        for s, k, mb in acts:
            try:
                kb, dur, b1, c1, b2, c2, delta = tmpl[k][s]
            except KeyError:  # first use of (kind, stage) on this rank, or an unknown kind or stage
                if k not in tmpl or not 0 <= s < nst:
                    raise outside(r, s, k, mb) from None
                kb, dur, b1, c1, b2, c2, delta = tmpl[k][s] = template(r, k, s)
            if mb < 0 or mb >= m:
                raise outside(r, s, k, mb)
            append_op((kb + mb, dur, b1 + mb, c1, b2 + mb, c2))
            append_dur(dur)
            append_del(delta)
        plan.append(ops)
        durations.append(durs)
        deltas.append(dels)
    return plan, durations, deltas


def _run(schedule: Schedule, plan: list[list[_Op]]) -> tuple[list[list[float]], list[float]]:
    """Each rank's start times and end time: ranks run their lists in order, each op when its inputs
    are done; raises ScheduleError on a deadlock."""
    p, m, nst = schedule.stages, schedule.microbatches, schedule.num_virtual_stages
    none_base = 3 * nst * m
    end = [-1.0] * none_base + [0.0] * m
    starts: list[list[float]] = [[] for _ in range(p)]
    ptr = [0] * p
    free = [0.0] * p
    # a forward overlapped with the next action (torch's OVERLAP_F_B) sends its output after both: its
    # completion is published when the next action ends
    held = schedule.overlapped or tuple(frozenset() for _ in range(p))
    pending = [-1] * p
    waiting: dict[int, list[int]] = {}
    stack = list(range(p - 1, -1, -1))
    while stack:
        r = stack.pop()
        ops = plan[r]
        i, t, n = ptr[r], free[r], len(ops)
        append = starts[r].append
        held_r = held[r]
        while i < n:
            key, dur, d1, c1, d2, c2 = ops[i]
            e1 = end[d1]
            if e1 < 0:
                waiting.setdefault(d1, []).append(r)
                break
            e2 = end[d2]
            if e2 < 0:
                waiting.setdefault(d2, []).append(r)
                break
            e1 += c1
            e2 += c2
            begin = t
            if e1 > begin:
                begin = e1
            if e2 > begin:
                begin = e2
            append(begin)
            t = begin + dur
            if i in held_r:
                pending[r] = key
                i += 1
                continue
            end[key] = t
            i += 1
            if key in waiting:
                stack.extend(waiting.pop(key))
            if pending[r] >= 0:
                pk, pending[r] = pending[r], -1
                end[pk] = t
                if pk in waiting:
                    stack.extend(waiting.pop(pk))
        ptr[r], free[r] = i, t

    for r in range(p):
        if ptr[r] < len(plan[r]):
            a = schedule.actions[r][ptr[r]]
            raise ScheduleError(
                f"rank {r} position {ptr[r]} ({a}) can never start: its dependency never runs or runs later "
                "on a rank that waits for this one (deadlock); check the schedule with microbatch.schedules.validate.validate"
            )
    return starts, free


def _result(
    schedule: Schedule,
    starts: list[list[float]],
    durations: list[list[float]],
    deltas: list[list[int]],
    free: list[float],
    comm: float,
) -> SimResult:
    """The timeline and its statistics; raises ConfigError when a sum overflows a float."""
    p = schedule.stages
    makespan = max(free) if p else 0.0
    overflow = ConfigError(
        f"the op times given overflow: the makespan is {makespan:.4g}"
        + (
            " (past the largest float, ~1.8e308)"
            if not math.isfinite(makespan)
            else ", its sums over the ranks pass the largest float (~1.8e308)"
        )
        + "; use times below ~1e300 (a larger unit, e.g. ms instead of ns)"
    )
    if not math.isfinite(makespan):
        raise overflow
    intervals = []
    busy = []
    peaks = []
    for r, acts in enumerate(schedule.actions):
        st_r, durs = starts[r], durations[r]
        intervals.append(tuple(zip(st_r, map(add, st_r, durs), acts, strict=True)))
        try:
            busy.append(math.fsum(durs))
        except OverflowError:  # an exact sum past the largest float that the running sum rounded below it
            raise overflow from None
        peaks.append(max(0, max(accumulate(deltas[r]), default=0)))
    idle = [max(0.0, makespan - b) for b in busy]  # floor float noise (fsum vs running sums)
    total_idle = sum(idle)
    total_busy = sum(busy)
    if not (math.isfinite(total_idle) and math.isfinite(total_busy) and math.isfinite(p * makespan)):
        raise overflow  # the makespan fits a float but the sums over the ranks do not
    fraction = total_idle / (p * makespan) if makespan > 0 else 0.0
    ratio = total_idle / total_busy if total_busy > 0 else (0.0 if total_idle == 0 else math.inf)
    return SimResult(
        schedule=schedule,
        intervals=tuple(intervals),
        makespan=makespan,
        busy=tuple(busy),
        idle=tuple(idle),
        bubble_fraction=fraction,
        bubble_ratio=ratio,
        peak_in_flight_chunks=tuple(peaks),
        comm_time=comm,
    )


def zb_h1_flush_time(
    stages: int, microbatches: int, virtual: int, times: StageTimesLike
) -> tuple[float, float]:
    """ZB-H1's step-time form for the planner (:data:`~microbatch.schedules.closed_forms.PipelineTime`):
    the closed form :func:`~microbatch.schedules.closed_forms.zb_h1_step_time` at m >= p where T_W <= T_F and
    T_W <= T_I on the bottleneck rank (Table 2's conditions); elsewhere the event simulation of torch's order
    (:func:`~microbatch.schedules.generators.zb_interleaved_order` at v = 1) on the per-stage times: at m < p
    (one round, 3·m·p actions) and where a longer W makes the closed form only a lower bound (a helper's review,
    2026-12-07: 64 against the simulation's 71 at p = 8, m = 16, F = I = 1, W = 2)."""
    k = times.k
    if microbatches >= stages and zb_h1_closed_form_holds(times.f[k], times.i[k], times.w[k]):
        return zb_h1_step_time(stages, microbatches, virtual, times)
    from microbatch.schedules.generators import zb_interleaved_order

    order = zb_interleaved_order(stages, microbatches, 1)
    return _simulated(Schedule(name="zb-h1", stages=stages, microbatches=microbatches, virtual=1,
                               placement="loop", actions=tuple(tuple(r) for r in order)), times)  # fmt: skip


def dualpipev_flush_time(
    stages: int, microbatches: int, virtual: int, times: StageTimesLike
) -> tuple[float, float]:
    """DualPipeV's step-time form for the planner: the closed form
    :func:`~microbatch.schedules.closed_forms.dualpipev_step_time` where it is exact (T_W <= T_I on the bottleneck
    rank's chunk, :func:`~microbatch.schedules.closed_forms.dualpipev_closed_form_holds`), else — where it is only a
    lower bound (a helper's review, 2026-12-07: 135 against the simulation's 142 at p = 8, m = 16, F = I = 1,
    W = 2) — the event simulation of torch's order on the per-stage times."""
    k = times.k
    if dualpipev_closed_form_holds(times.f[k], times.i[k], times.w[k]):
        return dualpipev_step_time(stages, microbatches, virtual, times)
    from microbatch.schedules.generators import dualpipev_order, dualpipev_overlapped

    order = dualpipev_order(stages, microbatches, virtual)
    return _simulated(Schedule(name="dualpipev", stages=stages, microbatches=microbatches, virtual=virtual,
                               placement="v", actions=tuple(tuple(r) for r in order),
                               overlapped=dualpipev_overlapped(order)), times)  # fmt: skip


def _simulated(sched: Schedule, times: StageTimesLike) -> tuple[float, float]:
    """(makespan, bubble fraction) of ``sched`` simulated on the per-stage F, I and W times."""
    sim = simulate(sched, forward_time=list(times.f), input_time=list(times.i), weight_time=list(times.w))
    return sim.makespan, sim.bubble_fraction
