"""Where a pipeline step's time goes between the ops, measured, and a replay of torch's order with it.

:func:`runtime_terms` reads the costs between ops (after a send, after a local op, the hand-off,
the step's start and end) from a run's own intervals; :func:`replay` runs torch's order with
per-stage op times and those terms, the ranks' work sharing the machine's cores in the scheduler's
time slices. Why the time between ops is not one overhead per action (gloo's sends, measured), and
each term's definition: ``docs/pipeline-replay.md``. Plain data in and out; no torch.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from microbatch.errors import ScheduleError
from microbatch.run.pipeline.report import StepIntervals
from microbatch.run.pipeline.resolved import ResolvedRun

__all__ = ["ZERO_TERMS", "parse_action", "replay", "runtime_terms"]

ZERO_TERMS: dict[str, Any] = {
    "after_send_s": {"fwd": 0.0, "bwd": 0.0},
    "after_send_waiting_s": {"fwd": 0.0, "bwd": 0.0},
    "after_local_s": 0.0,
    "hop_s": {"fwd": 0.0, "bwd": 0.0},
    "start_s": 0.0,
    "end_s": 0.0,
}
"""No cost between ops: :func:`replay` then gives the event simulation's makespan."""

Interval = tuple[str, int, int, float, float]


def parse_action(action: str) -> tuple[int, str, int]:
    """``"2I3"`` -> (stage 2, kind ``"I"``, micro-batch 3)."""
    k = next(i for i, c in enumerate(action) if c.isalpha())
    return int(action[:k]), action[k], int(action[k + 1 :])


def _deps(kind: str, s: int, i: int, last: int) -> list[tuple[str, int, int]]:
    """The ops of other stages whose output op (kind, s, i) consumes: F from stage s − 1, B and I
    from stage s + 1 (its B, or its I under a split backward)."""
    if kind == "F" and s > 0:
        return [("F", s - 1, i)]
    if kind in ("B", "I") and s < last:
        return [("B", s + 1, i), ("I", s + 1, i)]
    return []


def _consumers(kind: str, s: int, i: int) -> list[tuple[str, int, int]]:
    """The ops of other stages that consume op (kind, s, i)'s output (the inverse of :func:`_deps`)."""
    if kind == "F":
        return [("F", s + 1, i)]
    if kind in ("B", "I"):
        return [("B", s - 1, i), ("I", s - 1, i)]
    return []


def _sends(kind: str, s: int, placement: Sequence[int]) -> str | None:
    """The direction in which op (kind, s) hands its output to another rank, if it does."""
    if kind == "F" and s + 1 < len(placement) and placement[s + 1] != placement[s]:
        return "fwd"
    if kind in ("B", "I") and s > 0 and placement[s - 1] != placement[s]:
        return "bwd"
    return None


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def runtime_terms(run: ResolvedRun, steps: list[StepIntervals]) -> dict[str, Any]:
    """The terms above from a run's measured steps (:attr:`PipelineReport.step_intervals
    <microbatch.run.pipeline.report.PipelineReport.step_intervals>`: start, end and per rank the
    ``(kind, stage, microbatch, start, end)`` intervals, in one clock, seconds)."""
    placement = run.placement
    last = run.cfg.total_stages - 1
    after: dict[str, list[float]] = {"fwd": [], "bwd": [], "local": [], "fwd_waiting": [], "bwd_waiting": []}
    hop: dict[str, list[float]] = {"fwd": [], "bwd": []}
    start: list[float] = []
    gaps: list[float] = []
    seen: list[tuple[str, float, float, float | None, Interval | None, bool]] = []
    for step in steps:
        span: dict[tuple[str, int, int], float] = {}
        before: dict[tuple[str, int, int], float] = {}  # op -> end of its rank's previous op
        in_order = [sorted(intervals, key=lambda x: x[3]) for intervals in step.ranks]
        for ops in in_order:
            for n, (kind, s, i, _a, e) in enumerate(ops):
                span[(kind, s, i)] = e
                before[(kind, s, i)] = ops[n - 1][4] if n else step.start
        for ops in in_order:
            for n, (kind, s, i, a, _e) in enumerate(ops):
                prev = ops[n - 1] if n else None
                dep = next((d for d in _deps(kind, s, i, last) if d in span), None)
                dep_end = span[dep] if dep is not None and placement[dep[1]] != placement[s] else None
                prev_end = prev[4] if prev is not None else step.start
                gaps.append(a - prev_end)
                if dep_end is not None and dep_end >= prev_end:  # it waited for another rank
                    hop["fwd" if kind == "F" else "bwd"].append(a - dep_end)
                elif prev is None:
                    start.append(a - step.start)
                else:
                    # did the rank prev handed its output to sit waiting for it when prev ended?
                    waited = any(
                        c in before and before[c] <= prev[4] for c in _consumers(prev[0], prev[1], prev[2])
                    )
                    seen.append((kind, a, prev_end, dep_end, prev, waited))
    # a gap after an op is the rank's own cost unless the next op's input arrived within it: its
    # producer on another rank ended less than one (mean) hand-off before the gap began
    hop_mean = {d: _mean(v) for d, v in hop.items()}
    for kind, a, prev_end, dep_end, prev, waited in seen:
        if dep_end is not None and dep_end + hop_mean["fwd" if kind == "F" else "bwd"] > prev_end:
            continue
        if prev is None:
            continue
        direction = _sends(prev[0], prev[1], placement)
        key = "local" if direction is None else direction + ("_waiting" if waited else "")
        after[key].append(a - prev_end)
    after_mean = {d: _mean(v) for d, v in after.items()}
    for d in ("fwd", "bwd"):  # a case the run never showed: the direction's other case
        pooled = _mean(after[d] + after[d + "_waiting"])
        for key in (d, d + "_waiting"):
            if not after[key]:
                after_mean[key] = pooled
    # the step's end beyond the last op's own after-op cost
    end: list[float] = []
    for step in steps:
        last_ops = [max(iv, key=lambda x: x[4]) for iv in step.ranks if iv]
        if not last_ops:
            continue
        ends = [e + after_mean[_sends(k, s, placement) or "local"] for k, s, _i, _a, e in last_ops]
        end.append(max(0.0, step.end - max(ends)))
    return {
        "after_send_s": {"fwd": after_mean["fwd"], "bwd": after_mean["bwd"]},
        "after_send_waiting_s": {"fwd": after_mean["fwd_waiting"], "bwd": after_mean["bwd_waiting"]},
        "after_local_s": after_mean["local"],
        "hop_s": hop_mean,
        "start_s": _mean(start),
        "end_s": _mean(end),
        "mean_gap_s": _mean(gaps),
        "cases": {
            "after_send": {"fwd": len(after["fwd"]), "bwd": len(after["bwd"])},
            "after_send_waiting": {"fwd": len(after["fwd_waiting"]), "bwd": len(after["bwd_waiting"])},
            "after_local": len(after["local"]),
            "hop": {"fwd": len(hop["fwd"]), "bwd": len(hop["bwd"])},
        },
    }


def replay(
    run: ResolvedRun,
    order: dict[int, list[str]],
    op_s: dict[tuple[int, str], float],
    terms: dict[str, Any],
    *,
    cores: int | None = None,
    slice_s: float = 0.004,
    others: int = 0,
    after_as_latency: bool = False,
) -> dict[str, Any]:
    """Run ``order`` (rank -> actions like ``"1B0"``) with ``op_s[(stage, kind)]`` seconds per op and
    the measured ``terms``; return the step time, the busy seconds per rank, the bubble
    (1 − Σ busy / (p × step)) and the timeline. Raises :class:`ScheduleError` on a deadlock.

    Without ``cores`` every rank has a core of its own. With ``cores`` the ranks' work (their ops
    and the runtime's work after each op) shares that many cores with ``others`` always-runnable
    threads of other programs, as the kernel's scheduler shares them: runnable work waits in one
    queue, a core runs it for at most ``slice_s`` (the scheduler's time slice, measured by
    :func:`microbatch.run.pipeline.calibrate.machine_load`) and puts it back at the end of the queue
    when others wait. An op's time then counts from when it first gets a core to when it ends, as a
    run measures it, so ``op_s`` is its CPU time alone; a hand-off (``hop_s``) is latency and takes
    no core. ``after_as_latency``: the work after each op is latency too (the rank is busy for it
    but takes no core): for terms measured under the run's own contention, which already hold the
    waits for a core (:func:`microbatch.run.pipeline.calibrate.calibrate_loaded`)."""
    rp = _Replay(run, order, op_s, terms, cores=cores, slice_s=slice_s, others=others, after=after_as_latency)
    while len(rp.done) < rp.total or any(j >= 0 for j in rp.jobs):
        rp.advance()
    p = run.cfg.stages
    step = max(rp.free) + float(terms["end_s"])
    return {
        "step_time_s": step,
        "busy_s": rp.busy,
        "bubble_fraction": 1.0 - sum(rp.busy) / (p * step) if step > 0 else 0.0,
        "timeline": rp.rows,
    }


class _Replay:
    """The state of one replay: each rank's next op and free time, the ops done, and the jobs that
    share the cores (a job: [work left, first time on a core (or -1), 1 for an op / 0 for the work
    after it]; the phantom jobs -1, -2, ... stand for the other programs' runnable threads)."""

    def __init__(
        self,
        run: ResolvedRun,
        order: dict[int, list[str]],
        op_s: dict[tuple[int, str], float],
        terms: dict[str, Any],
        *,
        cores: int | None,
        slice_s: float,
        others: int,
        after: bool,
    ) -> None:
        self.order, self.op_s, self.terms = order, op_s, terms
        self.after_as_latency = after
        self.placement = run.placement
        self.last = run.cfg.total_stages - 1
        self.p = p = run.cfg.stages
        self.acts = [[parse_action(a) for a in order[r]] for r in range(p)]
        self.present = {(k, s, i) for r in range(p) for s, k, i in self.acts[r]}
        self.free = [float(terms["start_s"])] * p
        self.nxt = [0] * p
        self.busy = [0.0] * p
        self.done: dict[tuple[str, int, int], float] = {}
        self.rows: list[list[tuple[float, float, str, int]]] = [[] for _ in range(p)]
        self.jobs: dict[int, list[float]] = {-1 - k: [float("inf"), -1.0, 0.0] for k in range(others)}
        self.queue: deque[int] = deque(self.jobs)
        self.on_core: dict[int, float] = {}  # job -> end of its slice
        self.n_cores = cores if cores is not None else p + others
        self.quantum = slice_s if cores is not None else float("inf")
        self.total = sum(len(a) for a in self.acts)
        self.t = 0.0

    def ready_at(self, r: int) -> float | None:
        """When rank r's next op can start (its rank free, its inputs arrived); None if an input
        is not done yet, the rank is working or has no op left."""
        if r in self.jobs or self.nxt[r] >= len(self.acts[r]):
            return None
        s, kind, i = self.acts[r][self.nxt[r]]
        dep = next((d for d in _deps(kind, s, i, self.last) if d in self.present), None)
        local = ("I", s, i) if kind == "W" else None
        if (dep is not None and dep not in self.done) or (local is not None and local not in self.done):
            return None
        ready = self.free[r]
        if dep is not None:
            hop = self.terms["hop_s"]["fwd" if kind == "F" else "bwd"] if self.placement[dep[1]] != r else 0.0
            ready = max(ready, self.done[dep] + hop)
        return ready

    def waiting(self, c: tuple[str, int, int], t: float) -> bool:
        """Is the rank of op c sitting idle with c as its next op at time t?"""
        r = self.placement[c[1]] if 0 <= c[1] <= self.last else -1
        if r < 0 or r in self.jobs or self.nxt[r] >= len(self.acts[r]) or self.free[r] > t:
            return False
        s, kind, i = self.acts[r][self.nxt[r]]
        return (kind, s, i) == c

    def advance(self) -> None:
        """Move to the next event (an op that can start, a job's work or slice ending) and handle it."""
        p, jobs, on_core, t = self.p, self.jobs, self.on_core, self.t
        starts = {r: a for r in range(p) if (a := self.ready_at(r)) is not None}
        ends = [min(end, t + jobs[j][0]) for j, end in on_core.items()]
        now = min([*ends, *starts.values()], default=float("inf"))
        if now == float("inf"):
            stuck = {r: self.order[r][self.nxt[r]] for r in range(p) if self.nxt[r] < len(self.order[r])}
            raise ScheduleError(f"the order deadlocks in the replay: every rank waits ({stuck})")
        now = max(t, now)
        for j in on_core:
            jobs[j][0] -= now - t
        self.t = t = now
        tol = 1e-12 * max(1.0, t)
        for j in [j for j in on_core if jobs[j][0] <= tol]:  # work done
            self.finish(j)
        for r, a in starts.items():
            if a <= t and r not in jobs:
                s, kind, _i = self.acts[r][self.nxt[r]]
                jobs[r] = [float(self.op_s.get((s, kind), 0.0)), -1.0, 1.0]
                self.queue.append(r)
        for j in [j for j, end in on_core.items() if end <= t + tol]:  # slice over
            if self.queue:
                del on_core[j]
                self.queue.append(j)
            else:
                on_core[j] = t + self.quantum
        while self.queue and len(on_core) < self.n_cores:
            j = self.queue.popleft()
            on_core[j] = t + self.quantum
            if jobs[j][1] < 0:
                jobs[j][1] = t

    def finish(self, j: int) -> None:
        """Job ``j``'s work is done at ``self.t``: an op is recorded and the runtime's work after it
        queued (or, ``after_as_latency``, waited out); the work after an op frees the rank."""
        t, terms = self.t, self.terms
        del self.on_core[j]
        _, first, is_op = self.jobs.pop(j)
        self.free[j] = t
        if not is_op:  # the runtime's work after the op is done: the rank is free
            return
        s, kind, i = self.acts[j][self.nxt[j]]
        self.done[(kind, s, i)] = t
        self.busy[j] += t - first
        self.rows[j].append((first, t, kind, i))
        direction = _sends(kind, s, self.placement)
        self.nxt[j] += 1
        if direction is None:
            after = float(terms["after_local_s"])
        elif any(self.waiting(c, t) for c in _consumers(kind, s, i)):
            after = terms["after_send_waiting_s"][direction]
        else:
            after = terms["after_send_s"][direction]
        if after > 0 and self.after_as_latency:  # measured with its waits for a core: a delay
            self.free[j] = t + float(after)
        elif after > 0:  # the runtime's own work after the op (posting the send, bookkeeping)
            self.jobs[j] = [float(after), t, 0.0]
            self.queue.append(j)
