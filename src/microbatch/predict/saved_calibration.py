"""A saved calibration's fields checked before a plan uses them (``plan --calibration`` on the calibration a plan's
``--json`` saved): split from :mod:`microbatch.predict.calibrate`, whose :meth:`Calibration.from_dict` calls it."""

from __future__ import annotations

import math
from typing import Any

from microbatch.errors import ConfigError
from microbatch.fields import is_finite_number

__all__ = ["check_saved", "clock_basis", "saved_efficiency", "EAGER_OPTIMIZER_FIELD"]

EAGER_OPTIMIZER_FIELD = "optimizer_over_passes"
"""A saved calibration's mark that its ``optimizer_memory`` is a rate over the unfused kernels' passes
(:data:`microbatch.predict.state.EAGER_PASSES`); a file without it (saved before 2026-12-05) holds a rate over the
28 B an AdamW step must move."""


def clock_basis(acc: Any, *, legacy: bool = False) -> float:
    """The clock an efficiency fitted against ``acc`` (an Accelerator or a row's name) is relative to: its row's
    default ``sustained_clock_fraction``, not ``acc``'s own (a power limit or clock given for the measured board
    describes that board); ``acc``'s own off the table (a CPU), 1 for a name. ``legacy``: the row's before the Hopper
    rows took HOPPER_BURST_TO_SUSTAINED and the B200 B200_BURST_TO_SUSTAINED, the basis of a file written without the
    field: 1, but the H100 96 GB's at 500 W (``power_limited_clock``)."""
    from microbatch.hardware import ACCELERATORS
    from microbatch.hardware_clocks import cited_burst_to_sustained

    name = acc if isinstance(acc, str) else acc.name
    row = ACCELERATORS.get(name) or (None if isinstance(acc, str) else acc)
    f = row.sustained_clock_fraction if row else 1.0
    cited = cited_burst_to_sustained(name) if legacy else None
    return float(f / cited[1]) if cited else float(f)


def saved_efficiency(d: dict[str, Any]) -> dict[str, Any] | None:
    """A saved calibration's efficiency fields as :class:`~microbatch.predict.gemm.RooflineEfficiency` takes them: a file
    without :data:`EAGER_OPTIMIZER_FIELD` has its ``optimizer_memory`` carried from the 28 B an AdamW step must move to
    the 80 its unfused kernels move (× 80/28, at most 1), the rate the planner now multiplies by each optimizer's
    passes."""
    from microbatch.predict.state import RECORDED_TO_PASSES

    eff = d.get("efficiency")
    if not eff or d.get(EAGER_OPTIMIZER_FIELD) or "optimizer_memory" not in eff:
        return eff
    return {**eff, "optimizer_memory": min(1.0, float(eff["optimizer_memory"]) * RECORDED_TO_PASSES)}


def check_saved(d: dict[str, Any], label: str) -> None:
    """ConfigError naming ``label`` and the field for a saved calibration whose numbers a plan would use out of range:
    ``memory`` an object, ``peak_flops`` and the sustained clock finite and > 0 (the clock at most 1.5), ``seq`` and
    each measured b_m whole numbers >= 1, the precision one the tool measures, ``fixed_bytes`` under 1 PiB."""
    from microbatch.precision import MEASURABLE

    fix = "give a tune result, or the calibration a plan saved, unedited"

    def bad(field: str, value: Any, rule: str) -> ConfigError:
        return ConfigError(f"{label}: {field} is {value!r}; it must be {rule}; {fix}")

    finite = is_finite_number

    details = d.get("details")
    if isinstance(details, dict) and details.get("from") == "microbench":
        # its GEMM ratios and attention ceiling are kept as words and numbers for reading, not as terms a plan applies
        # (a review: read back, they were dropped without a note and the GEMM line read as a fit)
        raise ConfigError(
            f"{label} is the calibration a plan saved from a kernel microbenchmark ({details.get('file') or 'its file'}); "
            "it does not carry the measured terms back: give the file the microbenchmark wrote (bench-gpu's)"
        )
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
