"""What ``validate`` says: the one-line summary of a validation and its text rendering.

:func:`microbatch.predict.validation.validate_result` returns typed values (the errors at the largest
b_m, the targets, the rows); the sentences are written here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from microbatch.units import format_bytes, format_signed_pct

__all__ = ["validation_cell", "validation_summary", "with_summary", "render_validation"]


def validation_summary(d: Mapping[str, Any]) -> str:
    """One line: what was calibrated on, the calibrated and uncalibrated errors at the largest b_m against
    the targets (met or NOT met), and the worst leave-one-out errors. ``d`` is
    :meth:`~microbatch.predict.validation.Validation.to_dict` (or ``validate_result``'s object)."""
    e = d["errors"]

    def f(x: float | None) -> str:
        return "n/a" if x is None else format_signed_pct(100 * x)

    return (
        f"{d['model']} s={d['seq']} {d['precision']} on "
        f"{d['device_name'] or d['device']}: calibrated on b_m "
        f"{', '.join(map(str, d['fit_on']))}, at the largest b_m {e['largest_micro_batch']} memory "
        f"{f(e['memory_calibrated'])} (uncalibrated {f(e['memory_uncalibrated'])}; target "
        f"±{100 * e['memory_target']:.0f}%: {'met' if e['memory_met'] else 'NOT met'}; what it grew from the smallest "
        f"b_m {f(e.get('memory_growth_calibrated'))}, uncalibrated {f(e.get('memory_growth_uncalibrated'))}"
        + (
            f", with eager layers {f(e['memory_growth_uncalibrated_eager'])}"
            if e.get("memory_growth_uncalibrated_eager") is not None
            and e["memory_growth_uncalibrated_eager"] != e.get("memory_growth_uncalibrated")
            else ""
        )
        + "), step time "
        f"{f(e['step_calibrated'])} (uncalibrated {f(e['step_uncalibrated'])}; target "
        f"±{100 * e['step_target']:.0f}%: {'met' if e['step_met'] else 'NOT met'}); "
        f"worst leave-one-out: memory {f(e['memory_loo_worst'])}, step {f(e['step_loo_worst'])}"
    )


def with_summary(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with its ``summary`` line after ``rows`` (where ``validate --json`` has always had it)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key == "summary":
            continue
        out[key] = value
        if key == "rows":
            out["summary"] = validation_summary(d)
    if "summary" not in out:
        out["summary"] = validation_summary(d)
    return out


_PCT = "pct"
"""A column of signed percentages (:func:`~microbatch.units.format_signed_pct`, without its sign of percent)."""

_COLUMNS = (
    ("micro_batch", "b_m", "{}"),
    ("fit", "fit", "{}"),
    ("mem_MiB", "mem MiB", "{:,.1f}"),
    ("mem_uncal_MiB", "uncal", "{:,.1f}"),
    ("mem_uncal_err_%", "err%", _PCT),
    ("mem_cal_MiB", "cal", "{:,.1f}"),
    ("mem_cal_err_%", "err%", _PCT),
    ("mem_loo_err_%", "loo%", _PCT),
    ("step_ms", "step ms", "{:,.2f}"),
    ("step_uncal_ms", "uncal", "{:,.2f}"),
    ("step_uncal_err_%", "err%", _PCT),
    ("step_cal_ms", "cal", "{:,.2f}"),
    ("step_cal_err_%", "err%", _PCT),
    ("step_loo_err_%", "loo%", _PCT),
)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "—"
    return format_signed_pct(value)[:-1] if fmt == _PCT else fmt.format(value)


def validation_cell(key: str, value: Any) -> str:
    """One value of a validation row as the text table shows it (its column's digits: the HTML report's too); a
    column the table does not know, a float to one decimal."""
    fmt = next((f for k, _, f in _COLUMNS if k == key), "{:,.1f}" if isinstance(value, float) else "{}")
    return _cell(value, fmt)


def render_validation(d: Mapping[str, Any]) -> str:
    """The ``validate --json`` object as text: a table, the summary, the calibration, the warnings."""
    head = [h for _, h, _ in _COLUMNS]
    body = [[_cell(r.get(k), fmt) for k, _, fmt in _COLUMNS] for r in d["rows"]]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        f"{d['model']} s={d['seq']} {d['precision']}, checkpointing {'on' if d['checkpointing'] else 'off'}, "
        f"measured on {d['device_name'] or d['device']} ({d['memory_key']}, {d['time_key']}); step times "
        f"predicted for {d['accelerator']['name']}: {d['accelerator']['source']}",
        "uncal = analytic model; cal = calibrated on the smallest probes (fit = probe); loo = leave-one-out; "
        "mem MiB and step ms are measured; err% = (predicted − measured) / measured: below 0, predicted low",
        "",
        "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    cal = d["calibration"]
    mem, eff = cal["memory"], cal["efficiency"]
    lines += [
        "",
        d.get("summary") or validation_summary(d),
        "",
        f"calibration (b_m {', '.join(map(str, cal['micro_batches']))}): activation_scale "
        f"{mem['activation_scale']:.3f}, fixed_bytes {format_bytes(mem['fixed_bytes'], digits=1, unit='MiB')}"
        + (
            f"; gemm_max {eff['gemm_max']:.3f}, half_rows {eff['half_rows']:,.0f} (vs {cal['accelerator']})"
            if eff
            else ""
        ),
    ]
    if d["oom"]:
        lines.append(f"out of memory (not predicted here): b_m {', '.join(map(str, d['oom']))}")
    lines += [f"note: {w}" for w in d["warnings"]]
    return "\n".join(lines)
