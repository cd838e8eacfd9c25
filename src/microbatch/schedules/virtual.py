"""The stages per rank (v) a schedule runs with when the caller gives none: a fact of its registry entry."""

from __future__ import annotations

from microbatch.schedules.registry import ScheduleSpec

__all__ = ["virtual_in_effect"]


def virtual_in_effect(spec: ScheduleSpec, virtual: int | None) -> tuple[int, str | None]:
    """(v in effect, a note or None) for ``virtual`` as given (None: not given).

    Given, it stands. Not given: a V placement's stages per rank (zbv, dualpipev: exactly two), else 1,
    with a note when the schedule interleaves only at v >= 2 (``v1_equivalent``: with one stage per
    rank interleaved 1F1B is plain 1F1B). The note names the parameter ``virtual``.
    """
    if virtual is not None:
        return virtual, None
    if spec.stages_per_rank is not None:
        return spec.stages_per_rank, None
    if spec.v1_equivalent is not None:
        return 1, (
            f"v = 1 (the default): {spec.name} with one stage per rank is {spec.v1_equivalent.upper()}; give "
            "virtual 2 or more to interleave"
        )
    return 1, None
