"""Rows of measured points (a CSV's, a JSON list's) read into :class:`~microbatch.choose.curve.CurvePoint` values, each
field checked, and which of them ran with activation checkpointing: split from :mod:`microbatch.choose.knee`, which
re-exports :func:`points_from_records`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from microbatch.choose.curve import CurvePoint
from microbatch.errors import ConfigError
from microbatch.fields import number, true_or_false
from microbatch.units import MAX_BYTES

__all__ = ["checkpointed", "points_from_records"]


def checkpointed(points: Sequence[CurvePoint]) -> set[int]:
    """The b_m whose point that ran (not out of memory) was measured with activation checkpointing on."""
    return {p.micro_batch for p in points if p.checkpointing and not p.oom}


def points_from_records(
    records: Iterable[dict[str, Any]], *, source: str = "measurements", lines: Sequence[int] | None = None
) -> list[CurvePoint]:
    """CurvePoints from dicts with ``micro_batch``, ``throughput``, optional ``peak_memory_bytes``,
    ``oom`` and ``step_time_s`` (extra keys are ignored; numbers may be strings, as in CSV). The
    field checks are :mod:`microbatch.records`'. Raises ConfigError naming the bad row: "row i" counting from 1, or
    "line n" where ``lines`` gives each record's line in its file (a CSV's, as an editor numbers them)."""
    records = list(records)
    name = _row_namer(lines)
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ConfigError(
                f"{source}: {name(i)} is {type(r).__name__}, not an object with micro_batch and throughput"
            )
        if "micro_batch" not in r:
            raise ConfigError(
                f"{source}: {name(i)} has no 'micro_batch'; each row needs micro_batch and throughput"
            )
        oom = true_or_false(r.get("oom", False), where=f"{source}: {name(i)}: oom")
        if "throughput" not in r and not oom:
            raise ConfigError(
                f"{source}: {name(i)} has no 'throughput'; each row needs micro_batch and throughput, {OOM_FIX}"
            )
        if (
            r.get("throughput", 0) in (None, "") and not oom
        ):  # an empty cell: how a spreadsheet marks one that failed
            raise ConfigError(
                f"{source}: {name(i)}: micro_batch {r['micro_batch']} has an empty throughput; a b_m that ran gives "
                f"its rate, {OOM_FIX}"
            )
        try:
            out.append(_point(r, oom))
        except ConfigError as e:
            hint = (
                "; leave a value not measured empty (null in JSON)"
                if str(e).endswith("must be finite")
                else ""
            )
            raise ConfigError(f"{source}: {name(i)}: {e}{hint}") from None
    if not out:
        raise ConfigError(f"{source}: no rows; give a list of {{micro_batch, throughput}} points")
    _check_oom_and_run(records, out, source, name)
    _check_repeats(records, out, source, name)
    return out


OOM_FIX = (
    'and a b_m that ran out of memory is written with oom true (a column oom in CSV, "oom": true in JSON)'
)
"""How a measurement that ran out of memory is written: the fix named where a row's throughput is missing or no rate."""


def _row_namer(lines: Sequence[int] | None) -> Callable[[int], str]:
    """The name of the i-th record (from 0) in messages: its file's line, or its row counting from 1."""
    return (lambda i: f"line {lines[i]}") if lines is not None else (lambda i: f"row {i + 1}")


def _names(indices: Sequence[int], name: Callable[[int], str]) -> str:
    """Several records named at once: "rows 2, 3" or "lines 3, 4"."""
    labels = [name(i).split() for i in indices]
    return f"{labels[0][0]}s " + ", ".join(label[1] for label in labels)


def _point(r: dict[str, Any], oom: bool) -> CurvePoint:
    """One record's point, each field checked (ConfigError naming the field and the value)."""
    b = number(r["micro_batch"], what="micro_batch", whole=True)
    peak = number(r.get("peak_memory_bytes"), what="peak_memory_bytes")
    if peak is not None and not 0 <= peak <= MAX_BYTES:
        raise ConfigError(f"peak_memory_bytes {peak!r} must be from 0 to 1 EiB (2**60 bytes: any device's)")
    step = number(r.get("step_time_s"), what="step_time_s")
    if step is not None and step <= 0:
        raise ConfigError(f"step_time_s {step!r} must be > 0 (seconds per optimizer step); check the file")
    return CurvePoint(
        micro_batch=None if b is None else int(b),  # type: ignore[arg-type]  # CurvePoint rejects None
        throughput=None if oom else _rate(r.get("throughput")),
        throughput_se=None if oom else _se_of(r),
        peak_memory_bytes=None if peak is None else int(round(peak)),
        oom=oom,
        step_time_s=step,
        checkpointing=true_or_false(r.get("checkpointing", False), where="checkpointing"),
    )


def _se_of(r: dict[str, Any]) -> float | None:
    """A row's relative standard error: its ``throughput_se``, else from the ``spread`` and ``repeats`` of a tune's
    point (:func:`~microbatch.choose.noise.relative_se`, as tune's own search reads them), else None: the noise a tune
    measured was dropped on the way back (``recommend`` on its result said "no repeats measured", a user's walk)."""
    from microbatch.choose.noise import relative_se

    se, spread, repeats = _share(r.get("throughput_se")), _share(r.get("spread")), r.get("repeats")
    if se is not None and se > 1:  # a relative error over 100%: the column holds the rate's own units
        raise ConfigError(
            f"throughput_se {r.get('throughput_se')!r} is over 1: it is the throughput's relative standard error (0.02 "
            "for 2%), not in the throughput's units; divide it by the throughput"
        )
    if se is not None:
        return se
    if spread is not None and isinstance(repeats, int) and not isinstance(repeats, bool):
        return relative_se(spread, repeats) or None
    return None  # a negative or missing spread: no noise


def _share(v: Any) -> float | None:
    """``v`` as a float where it is a finite number >= 0 (a relative error or spread; a CSV's cell is its text), else
    None."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    return None


def _rate(raw: Any) -> float | None:
    """A row's throughput: a measured rate above 0, or None where the cell is empty (CurvePoint then asks for one).
    "oom", NaN, inf and 0 are how other tools write a point that did not run: ConfigError naming how to write it."""
    try:
        rate = number(raw, what="throughput")
    except ConfigError as e:
        text = str(raw).strip().lower()
        if text not in ("nan", "inf", "+inf", "-inf", "infinity") and not any(
            w in text for w in ("oom", "memory")
        ):
            raise
        raise ConfigError(f"{e}: a throughput is a measured rate (> 0), {OOM_FIX}") from None
    if rate is not None and rate < 0:  # the curve point's rule (>= 0) is not a row's: a rate measured is > 0
        raise ConfigError(f"throughput {raw!r} is below 0: a measured rate is > 0; check the column's sign")
    if rate == 0:
        raise ConfigError(
            f"throughput {raw!r} is no measured rate (a b_m that ran gives one > 0), {OOM_FIX}; a b_m that did "
            "not run for another reason is left out"
        )
    return rate


def _check_repeats(
    records: Sequence[Any], points: Sequence[CurvePoint], source: str, name: Callable[[int], str]
) -> None:
    """ConfigError for a b_m that ran in two rows: repeats are refused, not averaged."""
    rows: dict[int, list[int]] = {}  # the rows that ran (an out-of-memory one may precede a checkpointed one)
    for i, pt in enumerate(points):
        if not pt.oom:
            rows.setdefault(pt.micro_batch, []).append(i)
    repeated = {k: v for k, v in rows.items() if len(v) > 1}
    if repeated:
        b, where = next(iter(repeated.items()))
        flags = {
            true_or_false(records[j].get("checkpointing", False), where=f"{source}: {name(j)}") for j in where
        }
        why = " (with checkpointing on and off: one curve is chosen from, not two)" if len(flags) > 1 else ""
        raise ConfigError(
            f"{source}: micro_batch {b} appears {len(where)} times ({_names(where, name)}){why}; repeats "
            "are refused, not averaged: give one row per micro_batch (for example the median of your repeated runs)"
        )


def _check_oom_and_run(
    records: Sequence[Any], points: Sequence[CurvePoint], source: str, name: Callable[[int], str]
) -> None:
    """ConfigError for a b_m that both ran out of memory and ran with the same checkpointing: the two contradict each
    other (tune writes an out-of-memory row without checkpointing, then one with it)."""
    seen: dict[tuple[int, bool], list[tuple[int, bool]]] = {}
    for i, (r, p) in enumerate(zip(records, points, strict=True)):
        ckpt = true_or_false(r.get("checkpointing", False), where=f"{source}: {name(i)}")
        seen.setdefault((p.micro_batch, ckpt), []).append((i, p.oom))
    for (b, ckpt), rows in seen.items():
        if len({oom for _, oom in rows}) > 1:
            raise ConfigError(
                f"{source}: micro_batch {b} both ran out of memory and ran ({_names([i for i, _ in rows], name)}), "
                f"with checkpointing {'on' if ckpt else 'off'} in both; keep the row of the run you trust"
            )
