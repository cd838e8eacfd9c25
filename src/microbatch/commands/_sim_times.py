"""``simulate``'s op times, from its flags to :func:`microbatch.schedules.simulate.simulate`'s
keywords: ``--forward-time``, ``--backward-time``, ``--input-time``, ``--weight-time`` and the
per-stage ``--stage-times``, each checked with the flag named in its error."""

from __future__ import annotations

import math
from typing import Any

from microbatch.schedules.action import Schedule
from microbatch.schedules.registry import ScheduleSpec

__all__ = ["finite_time", "parse_stage_times", "resolve_times"]


_ENTRY_PARTS = {
    1: (("factor", False),),
    2: (("forward time F", False), ("backward time B", False)),
    3: (("forward time F", False), ("input-gradient time I", False), ("weight-gradient time W", True)),
}
"""Per entry form, each value's name and whether it may be 0 (as for the flags: only W may)."""


def parse_stage_times(text: str) -> list[tuple[float, ...]]:
    """``--stage-times``: comma-separated, one entry per virtual stage.

    An entry is a number (a speed factor applied to the base times), ``F:B`` (forward and full
    backward) or ``F:I:W`` (forward, input-gradient and weight-gradient times). Every value must
    be finite and > 0 (W may be 0), as for ``--forward-time`` and the others; the error names the
    flag and the entry (counted from 0, as the virtual stages are).
    """
    from microbatch.errors import ConfigError

    if not text.strip():
        raise ConfigError(
            "--stage-times is empty: give one entry per virtual stage, e.g. --stage-times 1,1,1.5,1, "
            "or leave the option out for equal stages"
        )
    raws = text.split(",")
    entries: list[tuple[float, ...]] = []
    for i, raw in enumerate(raws):
        parts = raw.strip().split(":")
        try:
            vals = tuple(float(x) for x in parts)
        except ValueError:
            raise ConfigError(
                f"--stage-times entry {i} is {raw.strip()!r}: each entry must be a number (a factor), F:B or "
                "F:I:W, e.g. --stage-times 1,1,1.5,1 or --stage-times 1:2,1:2,1.5:3,1:2"
            ) from None
        if len(vals) not in (1, 2, 3):
            raise ConfigError(
                f"--stage-times entry {i} is {raw.strip()!r}: give one value (a factor), two (F:B) or three (F:I:W)"
            )
        for x, (what, zero_ok) in zip(vals, _ENTRY_PARTS[len(vals)], strict=True):
            if not (math.isfinite(x) and (x >= 0 if zero_ok else x > 0)):
                raise ConfigError(
                    f"--stage-times entry {i} is {raw.strip()!r} (entries count from 0, one per virtual stage; "
                    f"{len(raws)} given): the {what} {x:g} must be a finite number {'>= 0' if zero_ok else '> 0'}; give a "
                    "measured or estimated value, e.g. --stage-times 1,1,1.5,1"
                )
        entries.append(vals)
    return entries


def finite_time(
    value: float, why: str, fix: str = "give times below ~1e300 (a larger unit, e.g. ms instead of ns)"
) -> float:
    """``value``, or a ConfigError saying that ``why`` overflowed the largest float, and ``fix``."""
    from microbatch.errors import ConfigError

    if not math.isfinite(value):
        raise ConfigError(f"{why} = {value:g}, past the largest float (~1.8e308); {fix}")
    return value


def resolve_times(
    spec: ScheduleSpec,
    schedule: Schedule,
    *,
    forward_time: float | None,
    backward_time: float | None,
    input_time: float | None,
    weight_time: float | None,
    stage_times: str | None,
) -> dict[str, Any]:
    """Keyword times for :func:`microbatch.schedules.simulate.simulate` from the command's options."""
    from microbatch.errors import ConfigError

    _check_time_flags(spec, backward_time, input_time, weight_time, stage_times)
    split = spec.split_backward
    tf = 1.0 if forward_time is None else forward_time
    tb = None if split else _base_backward(tf, backward_time, input_time, weight_time)
    if stage_times is None:
        return {
            "forward_time": tf,
            "backward_time": tb,
            "input_time": input_time if split else None,
            "weight_time": weight_time if split else None,
        }
    entries = parse_stage_times(stage_times)
    nst = schedule.num_virtual_stages
    if len(entries) != nst:
        raise ConfigError(
            f"--stage-times has {len(entries)} entries but the schedule has {nst} virtual stages "
            f"(p·v = {schedule.stages}·{schedule.virtual}); give one entry per virtual stage"
        )
    return _per_stage_times(entries, spec, tf, tb, input_time, weight_time)


def _check_time_flags(
    spec: ScheduleSpec,
    backward_time: float | None,
    input_time: float | None,
    weight_time: float | None,
    stage_times: str | None,
) -> None:
    """Refuse a full and a split backward together, half a split one, or none where the schedule splits."""
    from microbatch.errors import ConfigError

    if backward_time is not None and (input_time is not None or weight_time is not None):
        raise ConfigError(
            "--backward-time was given with --input-time/--weight-time: give --backward-time B for a full "
            "backward, or --input-time I and --weight-time W for a split one, not both"
        )
    if (input_time is None) != (weight_time is None):
        missing = "--weight-time" if weight_time is None else "--input-time"
        raise ConfigError(f"a split backward needs both --input-time and --weight-time; add {missing}")
    if spec.split_backward and input_time is None and not stage_times:
        raise ConfigError(
            f"schedule {spec.name!r} splits the backward into I and W: --input-time and --weight-time are "
            "required (e.g. --input-time 1 --weight-time 1)"
            + ("; --backward-time alone does not say how to split it" if backward_time is not None else "")
        )


def _base_backward(
    tf: float, backward_time: float | None, input_time: float | None, weight_time: float | None
) -> float:
    """T_B of a schedule with a full backward: given, I + W, or two forwards."""
    if backward_time is not None:
        return backward_time
    if input_time is not None and weight_time is not None:
        return finite_time(input_time + weight_time, "the backward T_B = --input-time + --weight-time")
    # the usual assumption: a backward costs two forwards
    return finite_time(
        2.0 * tf,
        f"--forward-time {tf:g} makes the default backward time 2 × --forward-time",
        "give --backward-time too, or a --forward-time below ~1e300",
    )


def _per_stage_times(
    entries: list[tuple[float, ...]],
    spec: ScheduleSpec,
    tf: float,
    tb: float | None,
    input_time: float | None,
    weight_time: float | None,
) -> dict[str, Any]:
    """The lists of times per virtual stage from ``--stage-times`` entries and the base times."""
    from microbatch.errors import ConfigError

    split = spec.split_backward
    f: list[float] = []
    b: list[float] = []
    i_: list[float] = []
    w: list[float] = []
    for k, e in enumerate(entries):
        if len(e) == 1:
            if split and (input_time is None or weight_time is None):
                raise ConfigError(
                    f"--stage-times entry {k} is a factor but {spec.name!r} has no base --input-time/--weight-time; "
                    "give them, or write the entry as F:I:W"
                )
            x = e[0]
            f.append(
                finite_time(x * tf, f"--stage-times entry {k}: the factor {x:g} × the forward time {tf:g}")
            )
            if split and input_time is not None and weight_time is not None:
                i_.append(
                    finite_time(
                        x * input_time, f"--stage-times entry {k}: {x:g} × --input-time {input_time:g}"
                    )
                )
                w.append(
                    finite_time(
                        x * weight_time, f"--stage-times entry {k}: {x:g} × --weight-time {weight_time:g}"
                    )
                )
            elif tb is not None:
                b.append(
                    finite_time(
                        x * tb, f"--stage-times entry {k}: the factor {x:g} × the backward time {tb:g}"
                    )
                )
        elif len(e) == 2:
            if split:
                raise ConfigError(
                    f"--stage-times entry {k} is F:B but {spec.name!r} splits the backward; write it as F:I:W"
                )
            f.append(e[0])
            b.append(e[1])
        else:
            f.append(e[0])
            if split:
                i_.append(e[1])
                w.append(e[2])
            else:
                b.append(finite_time(e[1] + e[2], f"--stage-times entry {k}: the backward I + W"))
    return {
        "forward_time": f,
        "backward_time": None if split else b,
        "input_time": i_ if split else None,
        "weight_time": w if split else None,
    }
