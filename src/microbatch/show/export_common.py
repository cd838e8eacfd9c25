"""What every config export reads from a plan: its JSON objects, a candidate's precision, a schedule's spec, the
accelerator a comparison's plan is for, and the words (recompute, precision, schedule) the exports write.

Shared by :mod:`microbatch.show.export` (DeepSpeed, Hugging Face, Lightning) and
:mod:`microbatch.show.export_torchtitan`.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.schedules.registry import ScheduleSpec, get_spec

__all__ = ["Json", "accelerator_key", "check_names", "precision_of", "schedule_spec"]

Json = dict[str, Any]
"""A JSON object: a plan, a candidate, a configuration."""


def precision_of(c: Json) -> str:
    """The candidate's precision (bf16-mixed when it says none)."""
    return str(c.get("precision", "bf16-mixed"))


def schedule_spec(name: str | None) -> ScheduleSpec | None:
    """The registry's entry of schedule ``name``; None for no name or one the registry does not know."""
    try:
        return None if name is None else get_spec(name)
    except ConfigError:
        return None


def accelerator_key(name: object) -> object:
    """The registry's name of accelerator ``name`` (an alias, such as ``h100-80gb``, resolved; case and ``_``
    ignored); ``name`` itself when the registry does not know it."""
    from microbatch.hardware import get_accelerator

    if not isinstance(name, str):
        return name
    try:
        return get_accelerator(name).name
    except ConfigError:
        return name


def check_names(c: Json, what: str) -> None:
    """ConfigError for a recompute, schedule or precision the tool does not know (a hand-edited plan): the
    config would carry the word as it is (torchtitan's ``mode = "bogus"``)."""
    from microbatch.precision import PRECISIONS
    from microbatch.predict.activations import RECOMPUTE_CHOICES

    rc = c.get("recompute", "none")
    if rc not in RECOMPUTE_CHOICES:
        raise ConfigError(
            f"the {what}'s recompute {rc!r} is not one of {', '.join(RECOMPUTE_CHOICES)}; plan again"
        )
    if precision_of(c) not in PRECISIONS:
        raise ConfigError(f"the {what}'s precision {precision_of(c)!r} is not one of {', '.join(PRECISIONS)}")
    if c.get("schedule") is not None and schedule_spec(str(c["schedule"])) is None:
        from microbatch.schedules.registry import schedule_names

        raise ConfigError(
            f"the {what}'s schedule {c['schedule']!r} is not one of {', '.join(schedule_names())}; plan again"
        )
