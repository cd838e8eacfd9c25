"""The field checks of a result file a command reads back (``tune``'s and ``recommend``'s numbers, any kind's bare
error envelope): split from :mod:`microbatch.records`, which re-exports :func:`check_fields`."""

from __future__ import annotations

import math
from typing import Any

from microbatch.errors import ConfigError
from microbatch.fields import number, short_repr

__all__ = [
    "POINT_NUMBERS",
    "RESULT_NUMBERS",
    "NON_NEGATIVE",
    "check_fields",
    "json_number",
    "throughput_unit",
]


POINT_NUMBERS = ("throughput", "peak_memory_bytes", "peak_allocated_bytes", "step_time_s", "micro_step_s",
                 "tokens_per_s", "samples_per_s")  # fmt: skip
"""Fields of a measured point (``tune``, ``recommend``) that are numbers or null."""

RESULT_NUMBERS = ("throughput", "tolerance", "reference_throughput", "bound_margin", "memory_budget_bytes",
                  "global_batch", "grad_accum", "data_parallel", "max_fitting_micro_batch", "seq")  # fmt: skip
"""Top-level fields of a ``tune`` or ``recommend`` result that are numbers or null."""


def throughput_unit(result: Any) -> str:
    """The unit of a result's ``throughput``: ``tokens/s`` where its points counted tokens (a batch of token ids, or
    decoding), ``samples/s`` for a ``tune`` whose batches held none (images, features: its points' ``samples_per_s``),
    ``per s`` for points that name neither (an older or edited file: samples/s there was off by the sequence length for
    token ids) and for measurements made elsewhere (``recommend``: the file's own unit, or the tune's it read, as its result says in ``throughput_unit``)."""
    if isinstance(result.get("throughput_unit"), str) and result["throughput_unit"]:
        return str(result["throughput_unit"])
    points = [p for p in result.get("points") or [] if isinstance(p, dict) and not p.get("oom")]
    if any(p.get("tokens_per_s") is not None for p in points) or result.get("mode") == "decode":
        return "tokens/s"
    if result.get("command") == "recommend" or "mode" not in result:
        return "per s"
    if points and not any("tokens_per_s" in p or p.get("samples_per_s") is not None for p in points):
        return "per s"  # points that name neither unit (written before they did, or edited): not a guess
    return "samples/s" if points else "tokens/s"


def json_number(v: Any) -> bool:
    """Null or a finite JSON number (Python's json reads the non-standard NaN and Infinity literals: refused)."""
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


NON_NEGATIVE = ("throughput", "peak_memory_bytes", "peak_allocated_bytes", "step_time_s", "micro_step_s",
                "tokens_per_s", "samples_per_s")  # fmt: skip
"""Point fields that cannot be negative (a rate, bytes, seconds)."""


SETTINGS = ("global_batch", "seq", "data_parallel", "pipeline_parallel", "tensor_parallel")
"""A result's settings that are whole numbers >= 1 where present (null: not given); a hand-edited ``"global_batch":
-64`` was drawn into a report as it was (a fuzzer's run)."""


def _check_settings(item: dict[str, Any], source: str) -> None:
    """ConfigError when a field of :data:`SETTINGS` is there and not a whole number >= 1."""
    for key in SETTINGS:
        v = item.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(
                f"{source}: {key} {short_repr(v)} must be a whole number >= 1; fix the file, or give the result a "
                "command wrote"
            )


def check_fields(kind: str, item: dict[str, Any], *, source: str) -> None:
    """Refuse a ``tune`` or ``recommend`` result whose numbers are not numbers: its knee (``micro_batch``)
    and each point's ``micro_batch`` whole numbers >= 1 (at most :data:`MAX_EXACT_WHOLE`), the fields of
    :data:`POINT_NUMBERS` and :data:`RESULT_NUMBERS` JSON numbers or null. ConfigError naming the file,
    the point and the field: a hand-edited or foreign file is refused with the place to fix, before
    anything is drawn. Any kind's bare error envelope (a refused or failed run's ``--json``: the command, version, error
    and kind, nothing computed) is refused, quoting it; a result that carries an error beside what it computed (a
    plan in which nothing fits) is read."""
    if isinstance(item.get("error"), str) and set(item) <= {"command", "version", "error", "kind", "params"}:
        raise ConfigError(f"{source} records a failed `microbatch {kind}` ({item['error'][:160]}); give the output "
                          "of a run that succeeded")  # fmt: skip
    if kind in ("tune", "recommend", "plan"):
        for sub in [item, *(s for s in item.get("plans") or () if isinstance(s, dict))]:
            _check_settings(sub, source)
    if kind not in ("tune", "recommend"):
        return
    fix = "fix the file, or give the result.json a tune wrote"
    for key in RESULT_NUMBERS:
        if not json_number(item.get(key)):
            raise ConfigError(f"{source}: {key} {short_repr(item[key])} is not a number; {fix}")
    points = item.get("points", [])
    if not isinstance(points, list):
        raise ConfigError(f"{source}: points is a {type(points).__name__}, not a list of points; {fix}")
    for i, pt in enumerate(points):
        where = f"{source}: point {i + 1}"
        if not isinstance(pt, dict):
            raise ConfigError(
                f"{where} is {short_repr(pt)}, not an object with micro_batch, throughput, ...; {fix}"
            )
        for key in POINT_NUMBERS:
            if not json_number(pt.get(key)):
                what = "is not finite" if isinstance(pt[key], float) else "is not a number"
                raise ConfigError(f"{where}: {key} {short_repr(pt[key])} {what}; {fix}")
            if key in NON_NEGATIVE and (pt.get(key) or 0) < 0:
                raise ConfigError(f"{where}: {key} {short_repr(pt[key])} is negative; {fix}")
        try:
            if (
                not json_number(pt.get("micro_batch"))
                or (number(pt.get("micro_batch"), what="micro_batch", whole=True) or 0) < 1
            ):
                raise ConfigError(
                    f"micro_batch {short_repr(pt.get('micro_batch'))} must be a whole number >= 1"
                )
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}; {fix}") from None
    sizes = [pt["micro_batch"] for pt in points]
    # once per b_m and checkpointing (tune --checkpointing auto measures a b_m again with it on after an
    # out-of-memory without), out-of-memory points aside
    runs = [(pt["micro_batch"], bool(pt.get("checkpointing"))) for pt in points if not pt.get("oom")]
    twice = sorted({b for b, c in runs if runs.count((b, c)) > 1})
    if twice:
        raise ConfigError(
            f"{source}: micro_batch {', '.join(map(str, twice))} measured more than once; keep one point each; {fix}"
        )
    knee = item.get("micro_batch")
    if knee is not None:
        try:
            if not json_number(knee) or (number(knee, what="micro_batch", whole=True) or 0) < 1:
                raise ConfigError(f"micro_batch {short_repr(knee)} must be a whole number >= 1")
        except ConfigError as e:
            raise ConfigError(f"{source}: the knee's {e}; {fix}") from None
        if points and knee not in sizes:
            raise ConfigError(
                f"{source}: the knee micro_batch {knee} is not among the points measured ({', '.join(map(str, sorted(sizes)))}); {fix}"
            )
