"""Inputs shared by ``bubble``, ``simulate`` and ``pipeline``, checked before any work starts:
the virtual stages a schedule gets when ``--virtual`` is not given, op times, the diagram's most
rows (its width: :func:`microbatch.commands._common.width_option`)."""

from __future__ import annotations

import math

import click
from click.core import ParameterSource

from microbatch.errors import ConfigError
from microbatch.schedules.registry import ScheduleSpec, schedule_names

__all__ = [
    "MAX_DIAGRAM_RANKS",
    "ScheduleChoice",
    "check_times",
    "diagram_rows_note",
    "resolve_virtual",
]

MAX_DIAGRAM_RANKS = 1_000
"""Most ranks (one row each) a terminal diagram is drawn for. A taller one is not readable, and
at p = 100,000 drawing it took 12 s and 0.5 GB (2 cores); the numbers need no diagram."""


class ScheduleChoice(click.Choice[str]):
    """``click.Choice`` over the registry's schedules as they are when the command runs (a schedule
    registered after import is a choice too): those with an in-flight rule, after ``extra`` words."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self._extra = extra
        super().__init__(self.choices)

    @property
    def choices(self) -> tuple[str, ...]:
        """The choices now: ``extra``, then :func:`schedule_names` with ``in_flight=True``."""
        return (*self._extra, *schedule_names(in_flight=True))

    @choices.setter
    def choices(self, value: object) -> None:
        """click sets the choices once; they are read from the registry instead."""


def diagram_rows_note(stages: int) -> str | None:
    """Why no terminal diagram is drawn for ``stages`` ranks, or None when it is drawn."""
    if stages <= MAX_DIAGRAM_RANKS:
        return None
    return (
        f"no diagram: p = {stages:,} ranks is over the diagram limit of {MAX_DIAGRAM_RANKS:,} rows; "
        "draw a smaller p to see the shape, or give --no-diagram"
    )


def resolve_virtual(spec: ScheduleSpec, virtual: int | None, notes: list[str]) -> int:
    """v in effect: ``--virtual`` when given; else 2 for a V placement (zbv, dualpipev: exactly two
    stages per rank) and 1 otherwise, with a note when interleaved 1F1B falls back to one stage per
    rank (it is then plain 1F1B)."""
    given = virtual is not None
    ctx = click.get_current_context(silent=True)
    if ctx is not None and virtual is not None:
        given = ctx.get_parameter_source("virtual") not in (ParameterSource.DEFAULT, None)
    if given and virtual is not None:
        return virtual
    if spec.stages_per_rank is not None:  # a V placement (zbv, dualpipev): exactly two stages per rank
        return spec.stages_per_rank
    if spec.v1_equivalent is not None:
        notes.append(
            f"v = 1 (the default): {spec.name} with one stage per rank is {spec.v1_equivalent.upper()}; give "
            "--virtual 2 or more to interleave"
        )
    return 1


def check_times(**times: float | None) -> None:
    """Every op time given must be a finite number > 0 (``forward_time=0`` is no forward at all);
    ``comm_time`` and ``weight_time`` may be 0. Names the flag."""
    for name, value in times.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        zero_ok = name in ("comm_time", "weight_time")
        ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
        if not ok:
            rule = ">= 0" if zero_ok else "> 0"
            raise ConfigError(
                f"{flag} {value:g}: an op time must be a finite number {rule}; give a measured or estimated "
                f"duration, e.g. {flag} 1"
            )
