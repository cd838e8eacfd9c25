"""Check a schedule: complete, every action on its rank, every dependency met, no deadlock.

:func:`validate` names the first violation with its rank and its position in that rank's list.
"""

from __future__ import annotations

from microbatch.errors import ScheduleError
from microbatch.schedules.action import KINDS, Action, Schedule

__all__ = ["validate"]


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` is complete and that every dependency can be met.

    Rules: every (virtual stage, micro-batch) has exactly one F and either one B or one I and
    one W, each on the rank that owns the stage; F on stage s after F on stage s−1; B or I on
    stage s after its own F and after B or I on stage s+1; W after I. The check replays the
    per-rank orders (a rank runs its list in order and waits when a dependency is not met), so
    a cycle across ranks — a deadlock — is found too. Raises :class:`ScheduleError` naming the
    first violation, its rank and its position in that rank's list.
    """
    seen = _placed_once(schedule)
    _check_complete(schedule, seen)
    _replay(schedule, seen)


def _placed_once(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Each action's (rank, position), checked: a known kind, stage and micro-batch, on the rank that
    owns its stage, listed once."""
    p, m, nst = schedule.stages, schedule.microbatches, schedule.num_virtual_stages
    seen: dict[Action, tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            where = f"rank {rank} position {pos} ({a})"
            if a.kind not in KINDS:
                raise ScheduleError(f"{where}: kind {a.kind!r} is not one of {', '.join(KINDS)}")
            if not 0 <= a.stage < nst:
                raise ScheduleError(
                    f"{where}: stage {a.stage} is outside 0..{nst - 1} (p·v = {p}·{schedule.virtual})"
                )
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"{where}: micro-batch {a.microbatch} is outside 0..{m - 1}")
            owner = schedule.stage_to_rank(a.stage)
            if owner != rank:
                raise ScheduleError(
                    f"{where}: stage {a.stage} belongs to rank {owner} under {schedule.placement!r} placement"
                )
            if a in seen:
                r0, p0 = seen[a]
                raise ScheduleError(f"{where}: duplicate of rank {r0} position {p0}")
            seen[a] = (rank, pos)
    return seen


def _check_complete(schedule: Schedule, seen: dict[Action, tuple[int, int]]) -> None:
    """Every (stage, micro-batch) has one F and either one B or one I and one W."""
    m, nst = schedule.microbatches, schedule.num_virtual_stages
    for s in range(nst):
        for mb in range(m):
            if Action(s, "F", mb) not in seen:
                raise ScheduleError(f"missing action {Action(s, 'F', mb)} (rank {schedule.stage_to_rank(s)})")
            has_b = Action(s, "B", mb) in seen
            has_i = Action(s, "I", mb) in seen
            has_w = Action(s, "W", mb) in seen
            if has_b and (has_i or has_w):
                raise ScheduleError(f"stage {s} micro-batch {mb} has both B and I/W; use B or I+W, not both")
            if not has_b and not (has_i and has_w):
                absent = f"{s}B{mb}" if not (has_i or has_w) else (f"{s}W{mb}" if has_i else f"{s}I{mb}")
                raise ScheduleError(f"missing action {absent} (rank {schedule.stage_to_rank(s)})")


def _replay(schedule: Schedule, seen: dict[Action, tuple[int, int]]) -> None:
    """Replay the ranks' orders: a rank advances while its next action's dependencies are done;
    raises on the first action that can never start (a later one of its own rank first, else a deadlock)."""
    p, nst = schedule.stages, schedule.num_virtual_stages
    done: set[Action] = set()
    ptr = [0] * p
    remaining = schedule.num_actions()
    while remaining:
        progressed = False
        for rank, acts in enumerate(schedule.actions):
            i = ptr[rank]
            while i < len(acts):
                a = acts[i]
                missing = next((d for d in _deps(a, nst) if d not in done and d in seen), None)
                if missing is not None:
                    break
                done.add(a)
                i += 1
                remaining -= 1
                progressed = True
            ptr[rank] = i
        if not progressed:
            blocked = []
            for rank, acts in enumerate(schedule.actions):
                if ptr[rank] < len(acts):
                    a = acts[ptr[rank]]
                    d = next(d for d in _deps(a, nst) if d not in done and d in seen)
                    blocked.append((seen[d][0] != rank, rank, a, d))
            # An action waiting for a later one of its own rank is the root cause; else the lowest rank.
            cross, rank, a, d = min(blocked, key=lambda b: (b[0], b[1]))
            r_d, pos_d = seen[d]
            why = (
                "which is later in its own list"
                if not cross
                else "which waits, directly or not, for this rank (deadlock)"
            )
            raise ScheduleError(
                f"rank {rank} position {ptr[rank]} ({a}) needs {d} (rank {r_d} position {pos_d}), {why}: "
                "reorder so that every dependency comes first"
            )


def _deps(a: Action, num_stages: int) -> list[Action]:
    """Actions that must finish before ``a`` starts (B or I on s+1 may be either kind)."""
    s, k, mb = a
    if k == "F":
        return [Action(s - 1, "F", mb)] if s > 0 else []
    if k in ("B", "I"):
        deps = [Action(s, "F", mb)]
        if s < num_stages - 1:
            deps += [Action(s + 1, "B", mb), Action(s + 1, "I", mb)]
        return deps
    return [Action(s, "I", mb)]  # W
