"""Inputs shared by ``bubble``, ``simulate`` and ``pipeline``, checked before any work starts:
the virtual stages a schedule gets when ``--virtual`` is not given, op times, output paths."""

from __future__ import annotations

import math
import os

import click
from click.core import ParameterSource

from microbatch.errors import ConfigError
from microbatch.schedules.registry import ScheduleSpec

__all__ = ["check_output_path", "check_times", "resolve_virtual"]


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
    if spec.placement == "v":
        return 2
    if spec.name == "interleaved-1f1b":
        notes.append(
            "v = 1 (the default): interleaved-1f1b with one stage per rank is 1F1B; give --virtual 2 or "
            "more to interleave"
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


def check_output_path(path: str | None, flag: str, suffixes: tuple[str, ...]) -> None:
    """Refuse, before any work, an output path whose folder is missing or not writable, or whose
    suffix names another format (``--png out.svg``)."""
    if not path:
        return
    ext = os.path.splitext(path)[1].lower()
    if ext and ext not in suffixes:
        raise ConfigError(
            f"{flag} {path}: the suffix {ext} names another format than {flag} writes ({'/'.join(suffixes)}); "
            f"use a name ending in {suffixes[0]}"
            + (f", or --{ext[1:]} for that format" if ext in (".svg", ".png") else "")
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(
            f"{flag} {path}: the folder {folder} does not exist; create it (mkdir -p {folder}) or write elsewhere"
        )
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: the folder {folder} is not writable; write elsewhere")
    if os.path.isdir(path):
        raise ConfigError(
            f"{flag} {path} is a folder; give a file name, e.g. {os.path.join(path, 'out' + suffixes[0])}"
        )
