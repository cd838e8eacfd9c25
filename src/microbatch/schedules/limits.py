"""How large a schedule may be built and simulated: the actions a schedule holds, counted without building it, and
the refusal, before any work, of one over :data:`MAX_SIMULATED_ACTIONS` (naming the count that alone brings it under).
"""

from __future__ import annotations

from collections.abc import Callable

from microbatch.errors import ConfigError
from microbatch.schedules.registry import get_spec

__all__ = ["MAX_SIMULATED_ACTIONS", "check_simulable", "count_actions"]


MAX_SIMULATED_ACTIONS = 1_000_000
"""Largest schedule, in actions over all ranks, that is built and simulated (the ``bubble`` diagram,
``simulate``). Measured: generating and simulating 1F1B at p = 4, m = 250,000 (2,000,000 actions)
took 7.2 s, about 3.6 µs per action, and 1.08 GB peak RSS (2 cores, load 3.9), so this limit is about
4 s and 0.5 GB. Closed forms need no schedule and have no limit."""


def count_actions(name: str, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Actions built for the schedule, without building it: p·v·n × (2 for F, B; 3 for F, I, W — an
    upper bound for DualPipeV, which splits only some backwards), n the micro-batches its generator plans
    (:attr:`ScheduleSpec.planned_microbatches`: zbv's max(m, 2p − 1), whose extra ones it drops), else m."""
    spec = get_spec(name)
    per = 3 if spec.split_backward else 2
    n = spec.planned_microbatches(stages, microbatches) if spec.planned_microbatches else microbatches
    return stages * virtual * n * per


def _most_under(count: Callable[[int], int], value: int) -> int:
    """The largest x <= ``value`` with count(x) within :data:`MAX_SIMULATED_ACTIONS` (count grows with x); 0: none."""
    lo, hi = 0, value
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= MAX_SIMULATED_ACTIONS else (lo, mid - 1)
    return lo


def check_simulable(
    name: str, stages: int, microbatches: int, virtual: int = 1, *, closed_form: str = "bubble_fraction"
) -> None:
    """Raise :class:`ConfigError` before building a schedule over :data:`MAX_SIMULATED_ACTIONS`; ``closed_form``:
    the caller's words for the bubble without a schedule (a command passes its own)."""
    n = count_actions(name, stages, microbatches, virtual)
    if n <= MAX_SIMULATED_ACTIONS:
        return
    spec = get_spec(name)
    counts: tuple[tuple[str, str, int, Callable[[int], int]], ...] = (
        ("microbatches", "m", microbatches, lambda x: count_actions(name, stages, x, virtual)),
        ("virtual", "v", virtual, lambda x: count_actions(name, stages, microbatches, x)),
        ("stages", "p", stages, lambda x: count_actions(name, x, microbatches, virtual)),
    )
    # the first that alone brings it under: m, v (when > 1), p
    fits = [
        (c, most)
        for c in counts
        if (most := _most_under(c[3], c[2])) >= 1 and (c[0] != "virtual" or c[2] > 1)
    ]
    (key, letter, value, _), most = fits[0] if fits else (counts[-1], 1)
    has_closed = spec.fill_drain_bubble or spec.idle_closed_form is not None
    tail = (
        f" (the bubble of a larger {letter} is its closed form: {closed_form})"
        if closed_form and has_closed
        else f" ({name} has no closed form here: its bubble is known by simulating it)"
    )
    raise ConfigError(
        f"{key} = {value}: {name} with p·v = {stages * virtual} and m = {microbatches} has {n:,} actions, over the "
        f"simulation limit of {MAX_SIMULATED_ACTIONS:,} (about 4 s and 0.5 GB); use {key} {most:,} or fewer{tail}",
        params=(key,),
    )
