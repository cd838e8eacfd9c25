"""Checks of a schedule someone registers (:class:`~microbatch.schedules.registry.ScheduleSpec`), and of what its
rules answer: the registry is open, so a spec's fields and its rules' values are checked where they enter, with the
value, the rule and the fix, not found later as a TypeError deep in the planner or a negative memory.
"""

from __future__ import annotations

import math
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["check_count", "check_spec_fields", "check_step_time"]

_CALLABLES = ("generate", "check")
"""Fields every spec needs as functions."""
_OPTIONAL_CALLABLES = ("in_flight", "ends", "step_time", "planned_microbatches", "overlapped")
"""Fields that are functions or None."""


def check_spec_fields(spec: Any) -> None:
    """ConfigError for a spec field of the wrong type (a name that is no string, aliases not a tuple of strings, a rule
    that is not a function) or a V placement with other than two stages per rank."""
    who = f"schedule {spec.name!r}" if isinstance(spec.name, str) else "a schedule"
    if not isinstance(spec.name, str):
        raise ConfigError(
            f"{who}: name {spec.name!r} is not a string; name it in lower case, e.g. name='my-1f1b'"
        )
    if not isinstance(spec.aliases, tuple) or not all(isinstance(a, str) for a in spec.aliases):
        raise ConfigError(
            f"{who}: aliases {spec.aliases!r} is not a tuple of names; write aliases=('other-name',) (a string alone "
            "would be read letter by letter)"
        )
    for f in _CALLABLES:
        if not callable(getattr(spec, f)):
            raise ConfigError(f"{who}: {f} {getattr(spec, f)!r} is not a function; give {f}=(p, m, v) -> ...")
    for f in _OPTIONAL_CALLABLES:
        value = getattr(spec, f)
        if value is not None and not callable(value):
            raise ConfigError(f"{who}: {f} {value!r} is not a function; give a function or leave {f} out")
    if spec.placement == "v" and spec.stages_per_rank != 2:
        raise ConfigError(
            f"{who}: placement v puts two stages on each rank (stage r down, 2p − 1 − r back), and stages_per_rank "
            f"is {spec.stages_per_rank}; give stages_per_rank=2 with it"
        )


def check_count(name: str, what: str, value: object, most: int) -> int:
    """``value``, a count a schedule's rule answered, if it is a whole number in [1, ``most``]; else a ConfigError naming
    the schedule, the rule and the bound (a rule returning 0, −1 or a thousand times the micro-batches would price
    memory that no run holds)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ConfigError(
            f"schedule {name!r}: its {what} rule answered {value!r}; it must be a whole number from 1 to {most:,} "
            "(no rank holds more than all its chunks of every micro-batch); fix the rule in its ScheduleSpec",
            params=("schedule",),
        )
    return value


def check_step_time(name: str, answer: object) -> tuple[float, float]:
    """``answer``, a schedule's step-time rule's (seconds, bubble fraction), if the seconds are finite and >= 0 and
    the fraction in [0, 1]; else a ConfigError naming the schedule."""
    pair: tuple[Any, ...] = answer if isinstance(answer, tuple) and len(answer) == 2 else (math.nan, math.nan)
    seconds, bubble = pair
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair)
    if not (numbers and 0.0 <= seconds < math.inf and 0.0 <= bubble <= 1.0):
        raise ConfigError(
            f"schedule {name!r}: its step_time rule answered {answer!r}; it must be (seconds >= 0, bubble fraction "
            "in [0, 1]); fix the rule in its ScheduleSpec",
            params=("schedule",),
        )
    return float(seconds), float(bubble)
