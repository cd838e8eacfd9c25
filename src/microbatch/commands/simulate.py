"""``microbatch simulate``: run a schedule on op times; print the bubble diagram, write charts."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import click

from microbatch.commands._common import (
    SCHEDULE_HELP,
    emit,
    force_option,
    json_option,
    microbatches_option,
    stages_option,
    use_color,
    virtual_option,
    width_option,
)
from microbatch.schedules.action import Schedule
from microbatch.schedules.registry import ScheduleSpec
from microbatch.show.text import bubble_lines, pct

if TYPE_CHECKING:
    from microbatch.schedules.simulate import SimResult

_Rows = list[list[tuple[float, float, str, int]]]

__all__ = ["cmd", "parse_stage_times", "resolve_times"]


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


def _finite(
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
        return _finite(input_time + weight_time, "the backward T_B = --input-time + --weight-time")
    # the usual assumption: a backward costs two forwards
    return _finite(
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
            f.append(_finite(x * tf, f"--stage-times entry {k}: the factor {x:g} × the forward time {tf:g}"))
            if split and input_time is not None and weight_time is not None:
                i_.append(
                    _finite(x * input_time, f"--stage-times entry {k}: {x:g} × --input-time {input_time:g}")
                )
                w.append(
                    _finite(
                        x * weight_time, f"--stage-times entry {k}: {x:g} × --weight-time {weight_time:g}"
                    )
                )
            elif tb is not None:
                b.append(
                    _finite(x * tb, f"--stage-times entry {k}: the factor {x:g} × the backward time {tb:g}")
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
                b.append(_finite(e[1] + e[2], f"--stage-times entry {k}: the backward I + W"))
    return {
        "forward_time": f,
        "backward_time": None if split else b,
        "input_time": i_ if split else None,
        "weight_time": w if split else None,
    }


@click.command("simulate")
@stages_option()
@microbatches_option
@click.option("--schedule", "-s", "schedule_name", required=True, help=SCHEDULE_HELP)
@virtual_option
@click.option("--forward-time", type=float, default=None, help="T_F per (virtual) stage [default 1].")
@click.option("--backward-time", type=float, default=None, help="T_B, full backward [default 2 × T_F].")
@click.option("--input-time", type=float, default=None, help="T_I, input-gradient backward (zero-bubble).")
@click.option("--weight-time", type=float, default=None, help="T_W, weight-gradient backward (zero-bubble).")
@click.option(
    "--comm-time",
    type=float,
    default=0.0,
    show_default=True,
    help="Point-to-point latency per cross-rank hop.",
)
@click.option(
    "--stage-times",
    default=None,
    help="Per virtual stage, comma-separated: a factor (1,1,1.5,1), F:B (1:2,1:2,…) or F:I:W.",
)
@click.option("--time-unit", default="", help="Label of the time unit in the output (e.g. ms).")
@click.option(
    "--svg", "svg_path", type=click.Path(dir_okay=False), default=None, help="Write the timeline as SVG."
)
@click.option(
    "--png", "png_path", type=click.Path(dir_okay=False), default=None, help="Write the timeline as PNG."
)
@width_option
@click.option("--no-diagram", is_flag=True, help="Print the numbers only.")
@click.option(
    "--intervals",
    "with_intervals",
    is_flag=True,
    help="With --json: add every op's (start, end, action) and the activation timeline per rank.",
)
@force_option
@json_option
def cmd(
    stages: int,
    microbatches: int,
    schedule_name: str,
    virtual: int | None,
    forward_time: float | None,
    backward_time: float | None,
    input_time: float | None,
    weight_time: float | None,
    comm_time: float,
    stage_times: str | None,
    time_unit: str,
    svg_path: str | None,
    png_path: str | None,
    width: int,
    no_diagram: bool,
    with_intervals: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Simulate a schedule on op times: makespan, bubble, idle and in-flight per rank, a diagram.

    \b
    An op starts when its rank is free and its inputs have arrived (plus --comm-time across
    ranks); each rank runs its own list in order, as torch does. Times are in any unit.
    Example: microbatch simulate -p 4 -m 8 -s 1f1b --forward-time 1 --backward-time 2 --svg 1f1b.svg
    """
    from microbatch.commands._schedule_inputs import diagram_rows_note, resolve_virtual
    from microbatch.schedules.registry import generate, get_spec
    from microbatch.schedules.simulate import simulate

    spec = get_spec(schedule_name)
    notes: list[str] = []
    virtual = resolve_virtual(spec, virtual, notes)
    given = {
        "forward_time": forward_time,
        "backward_time": backward_time,
        "input_time": input_time,
        "weight_time": weight_time,
    }
    _check_before_work(
        spec, stages, microbatches, virtual, given, comm_time, stage_times, svg_path, png_path, force
    )
    if (
        not spec.split_backward
        and input_time is not None
        and weight_time is not None
        and backward_time is None
    ):
        notes.append(
            f"{spec.name} runs a full backward: --input-time + --weight-time = {input_time + weight_time:g} is used "
            "as T_B; the split into I and W matters only to zero-bubble and DualPipeV schedules"
        )
    if with_intervals and not as_json:
        notes.append("--intervals adds every op's (start, end) to the --json output only; add --json")
    too_tall = diagram_rows_note(stages)
    if too_tall and not no_diagram:
        notes.append(too_tall)
    schedule = generate(spec.name, stages, microbatches, virtual)
    times = resolve_times(spec, schedule, **given, stage_times=stage_times)
    sim = simulate(schedule, comm_time=comm_time, **times)
    result = sim.to_dict()
    result["schedule"] = spec.name
    result["times"] = {k.removesuffix("_time"): v for k, v in times.items() if v is not None}
    result["fraction_is"] = "idle / total stage time"
    result["ratio_is"] = "idle / ideal busy time (Megatron)"
    result["peak_in_flight_unit"] = "micro-batches of one rank's layers"
    result["notes"] = notes
    uniform = not stage_times and comm_time == 0
    closed = _closed_form(spec, stages, microbatches, virtual, times) if uniform else None
    if closed is not None:
        result["closed_form"] = closed
    if with_intervals:
        result["intervals"] = [[[a, e, str(act)] for a, e, act in rank] for rank in sim.intervals]
        result["activations"] = [[[t, n] for t, n in rank] for rank in sim.activation_timeline()]
        result["activations_unit"] = "activation chunks: one micro-batch's activations of one virtual stage"
    rows = sim.timeline_rows()
    title = f"{spec.name}: p = {stages}, m = {microbatches}" + (f", v = {virtual}" if virtual > 1 else "")
    # a chart that cannot be written (checked above, so rare): the numbers are still printed
    failed = _write_charts(rows, sim.makespan, title, time_unit, svg_path, png_path, result, notes)
    emit(
        result,
        as_json,
        lambda: _render(
            sim, rows, title, result, spec.name, time_unit, width if not no_diagram and not too_tall else None
        ),
    )
    if failed:
        raise SystemExit(1)


def _check_before_work(
    spec: ScheduleSpec,
    stages: int,
    microbatches: int,
    virtual: int,
    given: dict[str, float | None],
    comm_time: float,
    stage_times: str | None,
    svg_path: str | None,
    png_path: str | None,
    force: bool,
) -> None:
    """Everything that can be checked before the work: sizes, times, output paths."""
    from microbatch.commands._common import check_output_file
    from microbatch.commands._schedule_inputs import MAX_DIAGRAM_RANKS, check_times, diagram_rows_note
    from microbatch.errors import ConfigError
    from microbatch.schedules.registry import check_servable, check_simulable

    check_servable(spec.name, stages, microbatches, virtual)
    check_simulable(spec.name, stages, microbatches, virtual)
    check_times(**given, comm_time=comm_time)
    if stage_times is not None:
        parse_stage_times(stage_times)  # its syntax and values, before the schedule is built
    check_output_file(svg_path, "--svg", (".svg",), force=force)
    check_output_file(png_path, "--png", (".png",), force=force)
    if (svg_path or png_path) and diagram_rows_note(stages):  # a chart of one row per rank
        raise ConfigError(
            f"--{'svg' if svg_path else 'png'}: p = {stages:,} ranks is over the chart limit of {MAX_DIAGRAM_RANKS:,} "
            "rows (one per rank; at p = 2,000 a PNG took 46 s); draw a smaller p, or leave the chart out"
        )


def _closed_form(
    spec: ScheduleSpec, stages: int, microbatches: int, virtual: int, times: dict[str, Any]
) -> dict[str, Any] | None:
    """The closed form the simulated schedule should match on equal stages without comm time, if any."""
    from microbatch.schedules.simulate import ZB_IDLE_SCHEDULES, bubble_fraction, bubble_ratio, zb_idle_time

    closed: dict[str, Any] | None = None
    # The closed forms hold for equal stages and no comm time, and for m >= p (GPipe's for every m).
    if spec.fill_drain_bubble and (microbatches >= stages or spec.name == "gpipe"):
        closed = {
            "bubble_fraction": bubble_fraction(stages, microbatches, virtual),
            "bubble_ratio": bubble_ratio(stages, microbatches, virtual),
        }
    if spec.split_backward and spec.name in ZB_IDLE_SCHEDULES:
        closed = {
            "idle_time_per_stage": zb_idle_time(
                spec.name, stages, times["forward_time"], times["input_time"], times["weight_time"]
            ),
            "valid_when": "T_W <= T_F and T_W <= T_I (Qi et al. 2024, Table 2)",
        }
    if spec.name == "dualpipev" and times.get("input_time") is not None:
        from microbatch.schedules.closed_forms import (
            DUALPIPEV_CLOSED_FORM_RULE,
            dualpipev_closed_form_holds,
            dualpipev_idle_time,
        )

        tf, ti, tw = times["forward_time"], times["input_time"], times["weight_time"] or 0.0
        closed = {
            "idle_time_per_stage": dualpipev_idle_time(stages, tf, ti, tw),
            "valid_when": f"{DUALPIPEV_CLOSED_FORM_RULE} (exact), a lower bound otherwise "
            "(DeepSeek-V3 report, sec 3.2.1, as torch runs it)",
            "exact": dualpipev_closed_form_holds(tf, ti, tw),
        }
    return closed


def _write_charts(
    rows: _Rows,
    makespan: float,
    title: str,
    time_unit: str,
    svg_path: str | None,
    png_path: str | None,
    result: dict[str, Any],
    notes: list[str],
) -> bool:
    """Write the SVG and PNG asked for, noting each in ``result``; True when one could not be written."""
    failed = False
    if svg_path:
        from microbatch.show.text import save_timeline_svg

        try:
            save_timeline_svg(rows, makespan, svg_path, title=title, time_unit=time_unit)
            result["svg"] = str(svg_path)
        except OSError as e:
            notes.append(f"could not write --svg {svg_path} ({e.strerror or e}); the result is printed here")
            failed = True
    if png_path:
        from microbatch.show.text import save_timeline_png

        try:
            save_timeline_png(rows, makespan, png_path, title=title, time_unit=time_unit)
            result["png"] = str(png_path)
        except OSError as e:
            notes.append(f"could not write --png {png_path} ({e.strerror or e}); the result is printed here")
            failed = True
    return failed


def _render(
    sim: SimResult,
    rows: _Rows,
    title: str,
    result: dict[str, Any],
    schedule_name: str,
    time_unit: str,
    diagram_width: int | None,
) -> str:
    """The text answer: numbers, closed form, notes, per-rank table and (unless ``diagram_width`` is None) the diagram."""
    from microbatch.show.text import render_stats_table, render_timeline_text
    from microbatch.units import format_number

    unit = f" {time_unit}" if time_unit else ""
    lines = [
        title,
        f"  makespan         {format_number(sim.makespan)}{unit}",
        *bubble_lines(sim.bubble_fraction, sim.bubble_ratio, sim.peak_in_flight),
    ]
    cf = result.get("closed_form", {})
    if "bubble_fraction" in cf:
        lines.append(f"  closed form      {pct(cf['bubble_fraction']):>6}  (p−1)/(v·m+p−1), uniform stages")
    if "idle_time_per_stage" in cf:
        lines.append(
            f"  closed form      idle per stage {format_number(cf['idle_time_per_stage'])}{unit}  "
            + (
                "(DeepSeek-V3 report, sec 3.2.1)"
                if schedule_name == "dualpipev"
                else "(Qi et al. 2024, Table 2)"
            )
        )
    lines += [f"  note: {n}" for n in result["notes"]]
    lines += ["", render_stats_table(result["stage_stats"], time_unit=time_unit)]
    if diagram_width is not None:
        lines += [
            "",
            render_timeline_text(
                rows, sim.makespan, width=diagram_width, color=use_color(), time_unit=time_unit
            ),
        ]
    for key in ("svg", "png"):
        if key in result:
            lines.append(f"wrote {result[key]}")
    return "\n".join(lines)
