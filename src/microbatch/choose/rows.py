"""Rows of measured points (a CSV's, a JSON list's) read into :class:`~microbatch.choose.curve.CurvePoint` values, each
field checked, and which of them ran with activation checkpointing: split from :mod:`microbatch.choose.knee`, which
re-exports :func:`points_from_records`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
    records: Iterable[dict[str, Any]], *, source: str = "measurements"
) -> list[CurvePoint]:
    """CurvePoints from dicts with ``micro_batch``, ``throughput``, optional ``peak_memory_bytes``,
    ``oom`` and ``step_time_s`` (extra keys are ignored; numbers may be strings, as in CSV). The
    field checks are :mod:`microbatch.records`'. Raises ConfigError naming the bad row."""
    records = list(records)
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ConfigError(
                f"{source}: row {i + 1} is {type(r).__name__}, not an object with micro_batch and throughput"
            )
        if "micro_batch" not in r:
            raise ConfigError(
                f"{source}: row {i + 1} has no 'micro_batch'; each row needs micro_batch and throughput"
            )
        oom = true_or_false(r.get("oom", False), where=f"{source}: row {i + 1}: oom")
        if "throughput" not in r and not oom:
            raise ConfigError(
                f"{source}: row {i + 1} has no 'throughput'; each row needs micro_batch and throughput"
            )
        try:
            b = number(r["micro_batch"], what="micro_batch", whole=True)
            peak = number(r.get("peak_memory_bytes"), what="peak_memory_bytes")
            if peak is not None and not 0 <= peak <= MAX_BYTES:
                raise ConfigError(
                    f"peak_memory_bytes {peak!r} must be from 0 to 1 EiB (2**60 bytes: any device's)"
                )
            step = number(r.get("step_time_s"), what="step_time_s")
            if step is not None and step <= 0:
                raise ConfigError(
                    f"step_time_s {step!r} must be > 0 (seconds per optimizer step); check the file"
                )
            out.append(
                CurvePoint(
                    micro_batch=None if b is None else int(b),  # type: ignore[arg-type]  # CurvePoint rejects None
                    throughput=None if oom else number(r.get("throughput"), what="throughput"),
                    peak_memory_bytes=None if peak is None else int(round(peak)),
                    oom=oom,
                    step_time_s=step,
                    checkpointing=true_or_false(r.get("checkpointing", False), where="checkpointing"),
                )
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: row {i + 1}: {e}") from None
    if not out:
        raise ConfigError(f"{source}: no rows; give a list of {{micro_batch, throughput}} points")
    _check_oom_and_run(records, out, source)
    rows: dict[int, list[int]] = {}  # the rows that ran (an out-of-memory one may precede a checkpointed one)
    for i, pt in enumerate(out):
        if not pt.oom:
            rows.setdefault(pt.micro_batch, []).append(i + 1)
    repeated = {k: v for k, v in rows.items() if len(v) > 1}
    if repeated:
        b, where = next(iter(repeated.items()))
        flags = {
            true_or_false(records[j - 1].get("checkpointing", False), where=f"{source}: row {j}")
            for j in where
        }
        why = " (with checkpointing on and off: one curve is chosen from, not two)" if len(flags) > 1 else ""
        raise ConfigError(
            f"{source}: micro_batch {b} appears {len(where)} times (rows {', '.join(map(str, where))}){why}; repeats "
            "are refused, not averaged: give one row per micro_batch (for example the median of your repeated runs)"
        )
    return out


def _check_oom_and_run(records: Sequence[Any], points: Sequence[CurvePoint], source: str) -> None:
    """ConfigError for a b_m that both ran out of memory and ran with the same checkpointing: the two contradict each
    other (tune writes an out-of-memory row without checkpointing, then one with it)."""
    seen: dict[tuple[int, bool], list[tuple[int, bool]]] = {}
    for i, (r, p) in enumerate(zip(records, points, strict=True)):
        ckpt = true_or_false(r.get("checkpointing", False), where=f"{source}: row {i + 1}")
        seen.setdefault((p.micro_batch, ckpt), []).append((i + 1, p.oom))
    for (b, ckpt), rows in seen.items():
        if len({oom for _, oom in rows}) > 1:
            raise ConfigError(
                f"{source}: micro_batch {b} both ran out of memory and ran (rows {', '.join(str(i) for i, _ in rows)}), "
                f"with checkpointing {'on' if ckpt else 'off'} in both; keep the row of the run you trust"
            )
