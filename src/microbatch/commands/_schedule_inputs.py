"""Inputs shared by ``bubble``, ``simulate`` and ``pipeline``, checked before any work starts:
whether ``--virtual`` was given (the schedule decides its default), op times, the diagram's most
rows (its width: :func:`microbatch.commands._common.width_option`)."""

from __future__ import annotations

import math
from typing import Any

import click
from click.core import ParameterSource

from microbatch.errors import ConfigError
from microbatch.schedules.registry import get_spec, schedule_names

__all__ = [
    "MAX_DIAGRAM_RANKS",
    "ScheduleChoice",
    "check_times",
    "diagram_rows_note",
    "given_virtual",
    "virtual_note",
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

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """A schedule named as the registry reads names (any case, ``_`` for ``-``, an alias) is its name."""
        if isinstance(value, str):
            key = value.strip().lower().replace("_", "-")
            if key in self._extra:
                value = key
            else:
                try:
                    value = get_spec(value).name
                except ConfigError:
                    pass  # click's own message lists the choices
        return super().convert(value, param, ctx)


def diagram_rows_note(stages: int) -> str | None:
    """Why no terminal diagram is drawn for ``stages`` ranks, or None when it is drawn."""
    if stages <= MAX_DIAGRAM_RANKS:
        return None
    return (
        f"no diagram: p = {stages:,} ranks is over the diagram limit of {MAX_DIAGRAM_RANKS:,} rows; "
        "draw a smaller p to see the shape, or give --no-diagram"
    )


def user_gave(param: str) -> bool:
    """Whether the user set option ``param`` (click's parameter source: the command line or the environment), as
    against its default."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(param) not in (ParameterSource.DEFAULT, None)


def given_virtual(virtual: int | None) -> int | None:
    """``--virtual`` as the user gave it: None when it was left at its default (click's parameter source),
    so the schedule's own default applies (:func:`microbatch.schedules.virtual.virtual_in_effect`)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and virtual is not None:
        if ctx.get_parameter_source("virtual") in (ParameterSource.DEFAULT, None):
            return None
    return virtual


def virtual_note(note: str | None, command: str) -> list[str]:
    """The schedule's note on its default v, in ``command``'s flags (a list of zero or one line)."""
    from microbatch.commands._flags import cli_text

    return [cli_text(note, ("virtual",), command)] if note else []


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
