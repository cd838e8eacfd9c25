"""The stages per rank (v) of a schedule: the one it runs with when the caller gives none (a fact of its registry
entry), and the ones the planner tries."""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.batch import divisors
from microbatch.schedules.registry import ScheduleSpec, get_spec

__all__ = ["virtual_in_effect", "virtual_options"]


def virtual_in_effect(spec: ScheduleSpec, virtual: int | None) -> tuple[int, str | None]:
    """(v in effect, a note or None) for ``virtual`` as given (None: not given).

    Given, it stands. Not given: a V placement's stages per rank (zbv, dualpipev: exactly two), else 1,
    with a note when the schedule interleaves only at v >= 2 (``v1_equivalent``: with one stage per
    rank interleaved 1F1B has plain 1F1B's bubble, not its memory). The note names the parameter ``virtual``.
    """
    if virtual is not None:
        return virtual, None
    if spec.stages_per_rank is not None:
        return spec.stages_per_rank, None
    if spec.v1_equivalent is not None:
        return 1, (
            f"v = 1 (the default): {spec.name} with one stage per rank has {spec.v1_equivalent.upper()}'s bubble "
            "but warms up 2(p − 1 − rank) forwards (torch's order), so it holds more in flight; give virtual 2 or "
            f"more to interleave, or schedule {spec.v1_equivalent}"
        )
    return 1, None


def virtual_options(
    name: str, layers: int, stages: int, requested: Sequence[int] = (), split: Sequence[int] | None = None
) -> list[int]:
    """The chunks per rank v the planner tries for schedule ``name``: its fixed
    :attr:`ScheduleSpec.stages_per_rank`; for a free v, the ``requested`` ones, else every v > 1 with
    p·v dividing the layers (v = 1 of an interleaved schedule has its :attr:`ScheduleSpec.v1_equivalent`'s bubble with
    more in flight: never the better candidate) —
    or, on stages of uneven layers ``split``, every v > 1 that leaves each chunk a layer (v ≤ min(split))."""
    fixed = get_spec(name).stages_per_rank
    if fixed is not None:
        return [fixed]
    if requested:
        return list(requested)
    if split is not None:
        return list(range(2, min(split) + 1))
    return [v for v in divisors(layers // stages) if v > 1 and layers % (stages * v) == 0]
