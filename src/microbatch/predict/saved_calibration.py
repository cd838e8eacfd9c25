"""A saved calibration's fields checked before a plan uses them (``plan --calibration`` on the calibration a plan's
``--json`` saved): split from :mod:`microbatch.predict.calibrate`, whose :meth:`Calibration.from_dict` calls it."""

from __future__ import annotations

import math
from typing import Any

from microbatch.errors import ConfigError
from microbatch.fields import is_finite_number

__all__ = ["check_saved"]


def check_saved(d: dict[str, Any], label: str) -> None:
    """ConfigError naming ``label`` and the field for a saved calibration whose numbers a plan would use out of range:
    ``memory`` an object, ``peak_flops`` and the sustained clock finite and > 0 (the clock at most 1.5), ``seq`` and
    each measured b_m whole numbers >= 1, the precision one the tool measures, ``fixed_bytes`` under 1 PiB."""
    from microbatch.precision import MEASURABLE

    fix = "give a tune result, or the calibration a plan saved, unedited"

    def bad(field: str, value: Any, rule: str) -> ConfigError:
        return ConfigError(f"{label}: {field} is {value!r}; it must be {rule}; {fix}")

    finite = is_finite_number

    mem = d.get("memory")
    if "memory" in d and not isinstance(mem, dict):
        raise bad("memory", mem, "an object with activation_scale and fixed_bytes")
    if isinstance(mem, dict) and finite(mem.get("fixed_bytes")) and mem["fixed_bytes"] > 2**50:
        raise bad(
            "memory.fixed_bytes", mem["fixed_bytes"], "at most 1 PiB (bytes a GPU holds besides the model)"
        )
    for name, low, high in (("peak_flops", 0.0, math.inf), ("sustained_clock_fraction", 1e-9, 1.5)):
        v = d.get(name)  # peak_flops 0: a calibration measured without a peak (a CPU's)
        if v is not None and not (finite(v) and low <= v <= high):
            raise bad(name, v, "a number >= 0" if high == math.inf else f"a number > 0 and at most {high}")
    if "seq" in d and not (finite(d["seq"]) and float(d["seq"]).is_integer() and d["seq"] >= 1):
        raise bad("seq", d["seq"], "a whole number >= 1")
    for b in d.get("micro_batches", ()) if isinstance(d.get("micro_batches"), list) else ():
        if not (finite(b) and float(b).is_integer() and b >= 1):
            raise bad("micro_batches", d["micro_batches"], "whole numbers >= 1")
    if "precision" in d and d["precision"] not in MEASURABLE:
        raise bad("precision", d["precision"], f"one of {', '.join(MEASURABLE)}")
