"""The in-flight rule, read from a schedule's spec: the activation chunks each rank holds at its peak, the
micro-batches, layer-micro-batches, and those of the end stages (the embedding's and the output layer's). The memory
model (:mod:`microbatch.predict`), the pipeline runner's memory and the bubble command read these.
"""

from __future__ import annotations

import math

from microbatch.errors import ConfigError, check_positive_int
from microbatch.schedules.registry import ScheduleSpec, get_spec, schedule_names, stage_ranks
from microbatch.schedules.spec_checks import check_count

__all__ = [
    "end_stages_in_flight",
    "in_flight_chunks",
    "in_flight_formula",
    "in_flight_layers",
    "in_flight_microbatches",
    "served_spec",
]


def in_flight_chunks(name: str, stage: int, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Activation chunks (one micro-batch × one virtual stage, L/v layers) rank ``stage`` holds at
    its peak under schedule ``name``: the spec's in-flight rule (:mod:`microbatch.schedules.rules`).

    Raises :class:`ConfigError` for a schedule without a rule (the simulator counts those).
    """
    spec = get_spec(name)
    if spec.in_flight is None:
        raise _no_rule(spec.name)
    answer = spec.in_flight(stage, stages, microbatches, virtual)
    return check_count(spec.name, "in_flight", answer, microbatches * virtual)


def in_flight_microbatches(name: str, stage: int, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Micro-batches with activations held on rank ``stage`` at its peak: min(m, ⌈chunks / v⌉).

    GPipe m; 1F1B min(m, p − i); ZB-H1 min(m, p); interleaved 1F1B its warm-up count in chunks of
    L/v layers, rounded up to whole micro-batches (see :mod:`microbatch.schedules.rules`).
    """
    chunks = in_flight_chunks(name, stage, stages, microbatches, virtual)
    return min(microbatches, math.ceil(chunks / virtual))


def end_stages_in_flight(name: str, stages: int, microbatches: int, virtual: int = 1) -> tuple[int, int]:
    """(micro-batches the first virtual stage holds, the last holds) at their peaks under schedule ``name``: the
    spec's :attr:`~ScheduleSpec.ends` rule, else the in-flight micro-batches of the ranks that hold them."""
    spec = get_spec(name)
    if spec.ends is not None:
        answer = spec.ends(stages, microbatches, virtual)
        pair = answer if isinstance(answer, tuple) and len(answer) == 2 else (answer, answer)
        return check_count(spec.name, "ends", pair[0], microbatches), check_count(
            spec.name, "ends", pair[1], microbatches
        )
    last = stage_ranks(name, stages, virtual)[-1]
    return (
        in_flight_microbatches(name, 0, stages, microbatches, virtual),
        in_flight_microbatches(name, last, stages, microbatches, virtual),
    )


def in_flight_layers(
    name: str, stage: int, stages: int, microbatches: int, virtual: int, stage_layers: float
) -> float:
    """Layer-micro-batches of activations rank ``stage`` holds at its peak: chunks × L_stage / v.

    On the first rank of interleaved 1F1B this is L_stage·p·(1 + (p−1)/(p·v)) when p divides m
    (Korthikanti et al. 2022 sec 4.2.3).
    """
    chunks = in_flight_chunks(name, stage, stages, microbatches, virtual)
    return chunks * stage_layers / virtual


def in_flight_formula(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[float]:
    """Peak in flight per rank, rank 0 first, in micro-batches of a rank's layers (chunks / v): the
    unit of :attr:`microbatch.schedules.simulate.SimResult.peak_in_flight`. GPipe [m, …];
    1F1B [min(m, p − i)]. Seed 002; Korthikanti et al. 2022 sec 4.2.3."""
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)
    check_positive_int("virtual", virtual)
    chunks = [in_flight_chunks(name, i, stages, microbatches, virtual) for i in range(stages)]
    return [c if virtual == 1 else c / virtual for c in chunks]


def _no_rule(name: str) -> ConfigError:
    """The error of a schedule the memory model cannot serve: it has no in-flight rule (the simulator counts it)."""
    return ConfigError(
        f"schedule {name!r} has no in-flight rule; use one of {', '.join(schedule_names(in_flight=True))}, or give its "
        "ScheduleSpec in_flight=(rank, p, m, v) -> chunks held (microbatch simulate counts what each rank holds)",
        params=("schedule",),
    )


def served_spec(name: str, *, planned: bool = False) -> ScheduleSpec:
    """The spec ``name`` (or one of its aliases, in any case) names, if the memory model serves it (an in-flight
    rule) and, ``planned``, the planner too (a step-time closed form); else a ConfigError saying what its spec lacks.
    Configs keep the returned ``.name``: ``interleaved`` and ``1F1B`` are read as the registry names them."""
    served = schedule_names(planned=True) if planned else schedule_names(in_flight=True)
    try:
        spec = get_spec(name)
    except ConfigError:
        raise ConfigError(
            f"schedule {name!r} is not known; use {'auto or ' if planned else ''}one of {', '.join(served)}",
            params=("schedule",),
        ) from None
    if spec.in_flight is None:
        raise _no_rule(spec.name)
    if planned and spec.step_time is None:
        raise ConfigError(
            f"schedule {spec.name!r} has no step-time closed form, so the planner cannot price it; give its "
            f"ScheduleSpec step_time=(p, m, v, stage times) -> (seconds, bubble fraction), or use one of "
            f"{', '.join(served)}",
            params=("schedule",),
        )
    return spec
