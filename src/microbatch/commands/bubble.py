"""``microbatch bubble``: the pipeline bubble of a schedule — closed form, fraction and ratio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from microbatch.commands._common import (
    SCHEDULE_HELP,
    emit,
    json_option,
    microbatches_option,
    stages_option,
    use_color,
    virtual_option,
    width_option,
)
from microbatch.commands._sim_times import finite_time
from microbatch.show.answers import render_bubble
from microbatch.show.text import pct

if TYPE_CHECKING:
    from microbatch.schedules.registry import ScheduleSpec
    from microbatch.schedules.simulate import SimResult

__all__ = ["cmd"]


@click.command("bubble")
@stages_option()
@microbatches_option
@click.option("--schedule", "-s", "schedule_name", default="gpipe", show_default=True, help=SCHEDULE_HELP)
@virtual_option
@click.option(
    "--forward-time",
    type=float,
    default=None,
    help="Split-backward schedules only (zb-h1, zbv, zb-interleaved, dualpipev): T_F (default 1).",
)
@click.option(
    "--input-time",
    type=float,
    default=None,
    help="Split-backward schedules only: T_I, input-gradient time (default 1).",
)
@click.option(
    "--weight-time",
    type=float,
    default=None,
    help="Split-backward schedules only: T_W, weight-gradient time (default 1).",
)
@width_option
@click.option("--no-diagram", is_flag=True, help="Print the numbers only.")
@json_option
def cmd(
    stages: int,
    microbatches: int,
    schedule_name: str,
    virtual: int | None,
    forward_time: float | None,
    input_time: float | None,
    weight_time: float | None,
    width: int,
    no_diagram: bool,
    as_json: bool,
) -> None:
    """The bubble of p stages and m micro-batches: the idle fraction and Megatron's ratio.

    \b
    fraction = idle / total stage time = (p−1)/(v·m+p−1)   (GPipe, 1F1B; interleaved with v)
    ratio    = idle / ideal busy time  = (p−1)/(v·m)        (the number Megatron quotes)
    zb-h1: idle per stage (p−1)(T_F+T_I−T_W) (Qi et al. 2024, Table 2).
    dualpipev: idle per rank max((p−1)(2T_F+T_I−T_W), (p−1)(T_F+2T_I−T_W)−T_F), per-chunk times, when
    T_W <= T_I (DeepSeek-V3 report, sec 3.2.1, as torch runs it); else simulated.
    Peak in-flight micro-batches per rank come from simulating the schedule.

    \b
    Example: microbatch bubble --stages 4 --microbatches 4   → 42.9% idle
    """
    from microbatch.commands._schedule_inputs import check_times, given_virtual, virtual_note
    from microbatch.schedules.registry import check_servable, get_spec
    from microbatch.schedules.virtual import virtual_in_effect

    spec = get_spec(schedule_name)
    virtual, note = virtual_in_effect(spec, given_virtual(virtual))  # a V holds exactly two per rank
    notes = virtual_note(note, "bubble")
    check_servable(spec.name, stages, microbatches, virtual)
    check_times(forward_time=forward_time, input_time=input_time, weight_time=weight_time)
    result: dict[str, Any] = {
        "schedule": spec.name,
        "stages": stages,
        "microbatches": microbatches,
        "virtual": virtual,
    }
    tf, ti, tw = (1.0 if t is None else t for t in (forward_time, input_time, weight_time))
    shape = _Shape(spec, stages, microbatches, virtual)
    closed, idle_closed, draw, run_sim = _what_to_run(shape, (tf, ti, tw), no_diagram, notes)
    sim: SimResult | None
    if spec.split_backward:
        sim = _split_backward_bubble(
            shape, (forward_time, input_time, weight_time), run_sim, idle_closed, result, notes
        )
    else:
        sim = _full_backward_bubble(
            shape, (forward_time, input_time, weight_time), run_sim, closed, result, notes
        )
    result["fraction_is"] = "idle / total stage time"
    result["ratio_is"] = "idle / ideal busy time (Megatron)"
    result["simulated_bubble_fraction"] = sim.bubble_fraction if sim is not None else None
    result["peak_in_flight"], sim = _peak_in_flight(shape, sim, closed)
    result["peak_in_flight_unit"] = "micro-batches of one rank's layers"
    result["notes"] = notes
    title = f"{spec.name}: p = {stages} stages, m = {microbatches} micro-batches" + (
        f", v = {virtual} stages per rank" if virtual > 1 else ""
    )
    emit(
        result, as_json, lambda: render_bubble(title, result, sim if draw else None, width, color=use_color())
    )


@dataclass(frozen=True)
class _Shape:
    """The schedule and its size (p, m, v), resolved once."""

    spec: ScheduleSpec
    stages: int
    microbatches: int
    virtual: int


def _what_to_run(
    shape: _Shape, times: tuple[float, float, float], no_diagram: bool, notes: list[str]
) -> tuple[bool, bool, bool, bool]:
    """Whether a closed form gives the bubble (and whether it is the idle-time closed form of a split
    backward, :attr:`ScheduleSpec.idle_closed_form`), whether a diagram is drawn and
    whether the schedule is simulated: a closed form needs no schedule, so it is built and simulated
    only for a diagram, or where no closed form exists, and never past the simulation limit (stated
    up front)."""
    from microbatch.commands._schedule_inputs import diagram_rows_note
    from microbatch.schedules.limits import MAX_SIMULATED_ACTIONS, check_simulable, count_actions

    spec, stages, microbatches, virtual = shape.spec, shape.stages, shape.microbatches, shape.virtual
    tf, ti, tw = times
    idle_form = spec.idle_closed_form if spec.split_backward else None
    idle_closed = idle_form is not None and idle_form.holds(tf, ti, tw)
    if idle_form is not None and not idle_closed:
        notes.append(
            f"the {idle_form.label} closed form needs {idle_form.rule} (it is a lower bound otherwise): simulated"
        )
    elif idle_form is not None and not idle_form.holds_at(stages, microbatches):
        idle_closed = False
        notes.append(
            f"m = {microbatches} < p = {stages}: the {idle_form.label} closed form assumes m >= p; torch's order "
            "(one round) simulated"
        )
    closed = spec.fill_drain_holds(stages, microbatches) or idle_closed
    too_big = count_actions(spec.name, stages, microbatches, virtual) > MAX_SIMULATED_ACTIONS
    too_tall = diagram_rows_note(stages)
    if not closed:
        check_simulable(spec.name, stages, microbatches, virtual, closed_form="")  # none holds here
    elif too_big and not no_diagram:
        notes.append(
            f"no diagram: {count_actions(spec.name, stages, microbatches, virtual):,} actions is over the "
            f"simulation limit of {MAX_SIMULATED_ACTIONS:,}; the numbers are the closed form"
        )
    if too_tall and not no_diagram and not (closed and too_big):
        notes.append(too_tall + ("; the numbers are the closed form" if closed else ""))
    draw = not no_diagram and not too_tall
    run_sim = not closed or (draw and not too_big)
    return closed, idle_closed, draw, run_sim


def _split_backward_bubble(
    shape: _Shape,
    given: tuple[float | None, float | None, float | None],
    run_sim: bool,
    idle_closed: bool,
    result: dict[str, Any],
    notes: list[str],
) -> SimResult | None:
    """The idle time of a zero-bubble or DualPipeV schedule (closed form, else simulated) into ``result``."""
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate

    spec, stages, microbatches, virtual = shape.spec, shape.stages, shape.microbatches, shape.virtual
    tf, ti, tw = (1.0 if t is None else t for t in given)
    sim = None
    flags = [t is not None for t in given]
    if not all(flags):
        notes.append(
            f"times T_F = {tf:g}, T_I = {ti:g}, T_W = {tw:g}"
            + (" (defaults; give --forward-time, --input-time, --weight-time)" if not any(flags) else "")
        )
    if run_sim:
        sim = simulate(
            generate(spec.name, stages, microbatches, virtual),
            forward_time=tf,
            input_time=ti,
            weight_time=tw,
        )
    busy = finite_time(microbatches * virtual * (tf + ti + tw), "the busy time m·v·(T_F + T_I + T_W)")
    if idle_closed and spec.idle_closed_form is not None:
        idle = spec.idle_closed_form.idle_time(stages, tf, ti, tw)
        result["method"] = spec.idle_closed_form.method
    else:
        assert sim is not None  # no closed form: simulated above
        idle = sum(sim.idle) / stages
        result["method"] = (
            "simulation (no closed form for this schedule)"
            if spec.idle_closed_form is None
            else "simulation (the closed form does not hold here: see the notes)"
        )
    result["times"] = {"forward": tf, "input": ti, "weight": tw}
    result["idle_time_per_stage"] = finite_time(idle, "the idle time per stage")
    result["bubble_fraction"] = idle / (idle + busy) if idle + busy > 0 else 0.0
    result["bubble_ratio"] = idle / busy if busy > 0 else 0.0
    return sim


def _full_backward_bubble(
    shape: _Shape,
    given: tuple[float | None, float | None, float | None],
    run_sim: bool,
    closed: bool,
    result: dict[str, Any],
    notes: list[str],
) -> SimResult | None:
    """The bubble of a schedule with a full backward (closed form, else simulated) into ``result``."""
    from microbatch.schedules.closed_forms import fill_drain_bubble
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import bubble_fraction, simulate

    spec, stages, microbatches, virtual = shape.spec, shape.stages, shape.microbatches, shape.virtual
    sim = None
    for flag, t in zip(("--forward-time", "--input-time", "--weight-time"), given, strict=True):
        if t is not None:
            notes.append(f"{flag} ignored: the {spec.name} bubble does not depend on op times")
    if run_sim:
        sim = simulate(
            generate(spec.name, stages, microbatches, virtual), forward_time=1.0, backward_time=2.0
        )
    if closed:
        one_round = virtual > 1 and microbatches < stages
        result["method"] = (
            "closed form at m < p: (p·v+m−1−v·m)/(p·v+m−1) and (p·v+m−1−v·m)/(v·m): torch's order runs one "
            "round, the last micro-batch one pass through the p·v chunks behind the first"
            if one_round
            else "closed form: (p−1)/(v·m+p−1) and (p−1)/(v·m) (Huang et al. 2019; Narayanan et al. 2021)"
        )
        if one_round:
            notes.append(
                f"m < p: the m >= p form (p−1)/(v·m+p−1) would say {pct(bubble_fraction(stages, microbatches, virtual))}"
            )
        fraction, ratio = fill_drain_bubble(stages, microbatches, virtual)
        result["bubble_fraction"], result["bubble_ratio"] = fraction, ratio
    else:
        assert sim is not None
        result["method"] = "simulation with T_B = 2 T_F (no closed form for this schedule here)"
        result["bubble_fraction"] = sim.bubble_fraction
        result["bubble_ratio"] = sim.bubble_ratio
    return sim


def _peak_in_flight(shape: _Shape, sim: SimResult | None, closed: bool) -> tuple[Any, SimResult | None]:
    """Peak in-flight micro-batches per rank: the registry's rule, else simulated (and the simulation)."""
    from microbatch.schedules.in_flight import in_flight_formula
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate

    spec, stages, microbatches, virtual = shape.spec, shape.stages, shape.microbatches, shape.virtual
    if spec.in_flight is not None:
        return in_flight_formula(spec.name, stages, microbatches, virtual), sim
    assert sim is not None or not closed
    if sim is None:
        sim = simulate(
            generate(spec.name, stages, microbatches, virtual),
            forward_time=1.0,
            input_time=1.0,
            weight_time=1.0,
        )
    return list(sim.peak_in_flight), sim
