"""``microbatch simulate``: run a schedule on op times; print the bubble diagram, write charts."""

from __future__ import annotations

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
from microbatch.commands._sim_times import parse_stage_times, resolve_times
from microbatch.interrupts import first_interrupt_only
from microbatch.schedules.registry import ScheduleSpec
from microbatch.show.answers import render_simulate

if TYPE_CHECKING:
    from microbatch.schedules.simulate import SimResult

_Rows = list[list[tuple[float, float, str, int]]]

__all__ = ["cmd", "parse_stage_times", "resolve_times"]


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
    from microbatch.commands._schedule_inputs import diagram_rows_note, given_virtual, virtual_note
    from microbatch.schedules.registry import generate, get_spec
    from microbatch.schedules.simulate import simulate
    from microbatch.schedules.virtual import virtual_in_effect

    spec = get_spec(schedule_name)
    virtual, note = virtual_in_effect(spec, given_virtual(virtual))  # a V holds exactly two per rank
    notes = virtual_note(note, "simulate")
    given = {
        "forward_time": forward_time,
        "backward_time": backward_time,
        "input_time": input_time,
        "weight_time": weight_time,
    }
    drawn = (svg_path, png_path, with_intervals and as_json, as_json)
    _check_before_work(spec, stages, microbatches, virtual, given, comm_time, stage_times, drawn, force)
    _note_flags(spec, given, with_intervals and not as_json, notes)
    _note_explicit_entries(spec, given, stage_times, notes)
    too_tall = diagram_rows_note(stages)
    if too_tall and not no_diagram:
        notes.append(too_tall)
    schedule = generate(spec.name, stages, microbatches, virtual)
    times = resolve_times(spec, schedule, **given, stage_times=stage_times)
    sim = simulate(schedule, comm_time=comm_time, **times)
    result = _result(sim, spec.name, times, notes, with_intervals)
    if time_unit:  # what one unit of the times is (the report's diagram reads it)
        result["time_unit"] = time_unit
    uniform = not stage_times and comm_time == 0
    closed = _closed_form(spec, stages, microbatches, virtual, times) if uniform else None
    if closed is not None:
        result["closed_form"] = closed
    rows = sim.timeline_rows()
    title = f"{spec.name}: p = {stages}, m = {microbatches}" + (f", v = {virtual}" if virtual > 1 else "")
    # a chart that cannot be written (checked above, so rare): the numbers are still printed
    failed, interrupted = _draw(rows, sim.makespan, title, time_unit, svg_path, png_path, result, notes)
    emit(
        result,
        as_json,
        lambda: render_simulate(
            sim,
            rows,
            title,
            result,
            spec.idle_closed_form.source if spec.idle_closed_form is not None else "",
            time_unit,
            width if not no_diagram and not too_tall else None,
            color=use_color(),
        ),
    )
    if failed or interrupted:
        click.echo(f"error: {result['error']}", err=True)
        raise click.exceptions.Exit(1 if failed else 130)


def _note_flags(
    spec: ScheduleSpec, given: dict[str, float | None], intervals_without_json: bool, notes: list[str]
) -> None:
    """Note flags that do less than they may seem to: I + W given to a full backward, --intervals
    without --json."""
    input_time, weight_time = given["input_time"], given["weight_time"]
    if (
        not spec.split_backward
        and input_time is not None
        and weight_time is not None
        and given["backward_time"] is None
    ):
        notes.append(
            f"{spec.name} runs a full backward: --input-time + --weight-time = {input_time + weight_time:g} is used "
            "as T_B; the split into I and W matters only to zero-bubble and DualPipeV schedules"
        )
    if intervals_without_json:
        notes.append("--intervals adds every op's (start, end) to the --json output only; add --json")


def _note_explicit_entries(
    spec: ScheduleSpec, given: dict[str, float | None], stage_times: str | None, notes: list[str]
) -> None:
    """Note what ``--stage-times``' explicit entries (F:B, F:I:W) set in place of the time flags, and a split
    backward given to a schedule that runs a full one."""
    if not stage_times:
        return
    entries = parse_stage_times(stage_times)
    explicit = [i for i, e in enumerate(entries) if len(e) > 1]
    flags = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
    if explicit and flags:
        which = (
            "every entry"
            if len(explicit) == len(entries)
            else f"entr{'y' if len(explicit) == 1 else 'ies'} " + (", ".join(map(str, explicit)))
        )
        notes.append(
            f"--stage-times gives {which} its own times: {', '.join(flags)} set{'s' if len(flags) == 1 else ''} only "
            "the factor entries" + ("" if len(explicit) < len(entries) else " (none here: they set nothing)")
        )
    if not spec.split_backward and any(len(e) == 3 for e in entries):
        notes.append(f"{spec.name} runs a full backward: an F:I:W entry's I + W is used as its B")


def _result(
    sim: SimResult, schedule_name: str, times: dict[str, Any], notes: list[str], with_intervals: bool
) -> dict[str, Any]:
    """The simulation's summary with the times it ran on and what its numbers are (and, ``with_intervals``, each
    rank's intervals and activation timeline)."""
    result = sim.to_dict()
    result["schedule"] = schedule_name
    result["times"] = {k.removesuffix("_time"): v for k, v in times.items() if v is not None}
    result["fraction_is"] = "idle / total stage time"
    result["ratio_is"] = "idle / ideal busy time (Megatron)"
    result["peak_in_flight_unit"] = "micro-batches of one rank's layers"
    result["notes"] = notes
    if with_intervals:
        result["intervals"] = [[[a, e, str(act)] for a, e, act in rank] for rank in sim.intervals]
        result["activations"] = [[[t, n] for t, n in rank] for rank in sim.activation_timeline()]
        result["activations_unit"] = "activation chunks: one micro-batch's activations of one virtual stage"
    return result


def _check_before_work(
    spec: ScheduleSpec,
    stages: int,
    microbatches: int,
    virtual: int,
    given: dict[str, float | None],
    comm_time: float,
    stage_times: str | None,
    drawn: tuple[str | None, str | None, bool, bool],
    force: bool,
) -> None:
    """Everything that can be checked before the work: sizes, times, output paths, what is drawn or listed
    (``drawn``: the SVG's path, the PNG's, whether every op is listed, whether --json prints on stdout)."""
    svg_path, png_path, with_intervals, as_json = drawn
    from microbatch.commands._common import check_output_file
    from microbatch.commands._outputs import check_not_stdout_with_json, same_file

    check_not_stdout_with_json(svg_path, "--svg", as_json, "bubble.svg")
    check_not_stdout_with_json(png_path, "--png", as_json, "bubble.png")
    from microbatch.commands._schedule_inputs import MAX_DIAGRAM_RANKS, check_times, diagram_rows_note
    from microbatch.commands._texts import CLOSED_FORM
    from microbatch.errors import ConfigError
    from microbatch.schedules.limits import check_simulable, count_actions
    from microbatch.schedules.registry import check_servable
    from microbatch.show.timeline import MAX_CHART_ACTIONS

    check_servable(spec.name, stages, microbatches, virtual)
    check_simulable(spec.name, stages, microbatches, virtual, closed_form=CLOSED_FORM)
    check_times(**given, comm_time=comm_time)
    if stage_times is not None:
        parse_stage_times(stage_times)  # its syntax and values, before the schedule is built
    check_output_file(svg_path, "--svg", (".svg",), force=force)
    check_output_file(png_path, "--png", (".png",), force=force)
    if svg_path and png_path and same_file(svg_path, png_path):
        raise ConfigError(
            f"--svg {svg_path} and --png {png_path} name one file: the PNG would replace the SVG; give each its own "
            "name, e.g. --svg timeline.svg --png timeline.png"
        )
    if (svg_path or png_path) and diagram_rows_note(stages):  # a chart of one row per rank
        raise ConfigError(
            f"--{'svg' if svg_path else 'png'}: p = {stages:,} ranks is over the chart limit of {MAX_DIAGRAM_RANKS:,} "
            "rows (one per rank; at p = 2,000 a PNG took 46 s); draw a smaller p, or leave the chart out"
        )
    flags = [
        flag for flag, on in (("--svg", svg_path), ("--png", png_path), ("--intervals", with_intervals)) if on
    ]
    ops = count_actions(spec.name, stages, microbatches, virtual)
    if flags and ops > MAX_CHART_ACTIONS:
        raise ConfigError(
            f"{' and '.join(flags)}: this schedule has {ops:,} ops, over the limit of {MAX_CHART_ACTIONS:,} a chart "
            "or the op list is made of (at 1,000,000 ops an SVG was 144 MB, the --intervals JSON 115 MB); draw "
            "a smaller m or p to see the shape (the bubble fraction is the same form), or leave them out: the "
            "numbers are simulated whole"
        )


def _closed_form(
    spec: ScheduleSpec, stages: int, microbatches: int, virtual: int, times: dict[str, Any]
) -> dict[str, Any] | None:
    """The closed form the simulated schedule should match on equal stages without comm time, if any."""
    from microbatch.schedules.closed_forms import fill_drain_bubble

    closed: dict[str, Any] | None = None
    # The closed forms hold for equal stages and no comm time (GPipe's and interleaving's at every m).
    if spec.fill_drain_holds(stages, microbatches):
        fraction, ratio = fill_drain_bubble(stages, microbatches, virtual)
        one_round = virtual > 1 and microbatches < stages
        formula = "(p·v+m−1−v·m)/(p·v+m−1), one round at m < p" if one_round else "(p−1)/(v·m+p−1)"
        closed = {"bubble_fraction": fraction, "bubble_ratio": ratio, "formula": formula}
    form = spec.idle_closed_form
    if (
        spec.split_backward
        and form is not None
        and times.get("input_time") is not None
        and form.holds_at(
            stages, microbatches
        )  # ZB-H1's (p−1)(T_F+T_I−T_W) needs m >= p: one round is simulated
    ):
        tf, ti, tw = times["forward_time"], times["input_time"], times["weight_time"] or 0.0
        closed = {"idle_time_per_stage": form.idle_time(stages, tf, ti, tw), "valid_when": form.valid_when}
        if form.exact_when is not None:
            closed["exact"] = form.holds(tf, ti, tw)
    return closed


def _draw(
    rows: _Rows, makespan: float, title: str, time_unit: str, svg_path: str | None, png_path: str | None,
    result: dict[str, Any], notes: list[str],
) -> tuple[bool, bool]:  # fmt: skip
    """:func:`_write_charts` where a Ctrl-C keeps the numbers (the simulation is done): (failed, interrupted), an
    interrupt said in ``result`` (kind ``interrupted``, the charts already written named)."""
    with first_interrupt_only():
        try:
            return _write_charts(rows, makespan, title, time_unit, svg_path, png_path, result, notes), False
        except KeyboardInterrupt:
            written = [result[k] for k in ("svg", "png") if k in result]
            said = "interrupted while the charts were written" + (
                f" ({', '.join(written)} written)" if written else ""
            )
            result.update(interrupted=True, error=said, kind="interrupted")
            return False, True


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
    """Write the SVG and PNG asked for, noting each in ``result``; True when one could not be written, and then
    ``result`` carries the first failure as its ``error`` (kind ``failure``: the command exits 1 with what it
    computed kept in the envelope)."""
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
    if failed:
        result["error"], result["kind"] = next(n for n in notes if n.startswith("could not write")), "failure"
    return failed
