"""What every config export reads from a plan: its JSON objects, a candidate's precision, a schedule's spec.

Shared by :mod:`microbatch.show.export` (DeepSpeed, Hugging Face, Lightning) and
:mod:`microbatch.show.export_torchtitan`.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.schedules.registry import ScheduleSpec, get_spec

__all__ = ["Json", "precision_of", "schedule_spec"]

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
