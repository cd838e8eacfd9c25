"""The columns of a measurements file (a CSV's header, a hand-written JSON list's keys) as ``recommend`` reads them:
the known names matched whatever their case or spacing, and a column that looks like the peak memory or the
out-of-memory marker under another name refused, not dropped (a review, 2026-12-08: ``Peak_Memory_Bytes`` and ``OOM``
were skipped without a word, and the knee chosen over a memory budget and from a b_m that ran out of memory)."""

from __future__ import annotations

import difflib
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["CSV_COLUMNS", "canonical_rows", "check_lookalikes", "unread_notes"]

CSV_COLUMNS = (
    "micro_batch", "throughput", "peak_memory_bytes", "oom", "step_time_s", "checkpointing", "throughput_se",
)  # fmt: skip
"""The columns a measurements file may hold; any other is not read."""

_OOM_FIX = "a b_m that ran out of memory is marked in oom (true/false, 1/0): rename it, or remove it"
_PEAK_FIX = (
    "the peak memory is read from peak_memory_bytes, in bytes: rename it, converting its values to bytes "
    "(GiB × 1073741824, MiB × 1048576, GB × 1e9), or remove it"
)
_MEMORY_WORDS = {"mem", "memory"}
_PEAK_WORDS = {"peak", "max", "used", "allocated", "alloc", "reserved", "bytes", "b", "gib", "mib", "kib", "gb", "mb",
               "kb", "rss", "vram", "maxrss", "vmhwm"}  # fmt: skip


def _looks_like(col: str) -> tuple[str, str] | None:
    """(the column ``col`` was meant as, the fix) where its words say the out-of-memory marker (``out_of_memory``,
    ``is_oom``) or a peak memory (``peak_memory_gib``, ``max_mem_MiB``, ``rss_kb``), else None: whole words, so
    ``memory_headroom`` or ``notes about memory`` are not taken for either (a review of the first version, which
    matched substrings)."""
    plain = _plain(col)
    words = set(plain.split("_"))
    if words & {"oom", "ooms", "oomed"} or "out_of_mem" in plain:
        return "oom", _OOM_FIX
    if words & {"rss", "vram", "maxrss", "vmhwm"} or (words & _MEMORY_WORDS and words & _PEAK_WORDS):
        return "peak_memory_bytes", _PEAK_FIX
    return None


def _plain(name: str) -> str:
    """``name`` as the known columns spell it: trimmed, lower case, spaces and hyphens as underscores."""
    return name.strip().lower().replace(" ", "_").replace("-", "_")


def canonical_rows(path: str, cols: list[str], rows: list[Any]) -> tuple[list[str], list[Any]]:
    """The columns and rows with each known column under its own name (``Peak_Memory_Bytes`` → ``peak_memory_bytes``,
    ``OOM`` → ``oom``); ConfigError where two columns become one."""
    rename = {c: _plain(c) for c in cols if _plain(c) in CSV_COLUMNS and c != _plain(c)}
    if not rename:
        return cols, rows
    new = [rename.get(c, c) for c in cols]
    twice = sorted({c for c in new if new.count(c) > 1})
    if twice:
        both = [c for c in cols if rename.get(c, c) == twice[0]]
        raise ConfigError(f"{path}: columns {' and '.join(map(repr, both))} both name {twice[0]}; keep one")
    out = [
        {rename.get(k, k): v for k, v in r.items()} if isinstance(r, dict) else r for r in rows
    ]  # fmt: skip
    return new, out


def check_lookalikes(path: str, cols: list[str], *, what: str = "column") -> None:
    """ConfigError for a column that holds the peak memory or the out-of-memory marker under another name, where the
    real one is absent (``peak_memory_gib``, ``peak_memory``, ``out_of_memory``): dropping it would choose as if
    nothing were measured."""
    for col in (c for c in cols if c not in CSV_COLUMNS):
        like = _looks_like(col)  # out_of_memory is the marker, not a peak
        if like is not None and like[0] not in cols:
            raise ConfigError(f"{path}: {what} {col!r} is not read, and there is no {like[0]}: {like[1]}")


def unread_notes(path: str, cols: list[str], *, near_only: bool = False) -> list[str]:
    """Notes naming the columns that are not read, with the known column each is nearest; ``near_only``: only those
    near one (a JSON list's keys, which may carry anything else)."""
    notes = []
    what = "key" if near_only else "column"
    for col in (c for c in cols if c and c not in CSV_COLUMNS):
        near = difflib.get_close_matches(col, CSV_COLUMNS, n=1, cutoff=0.6)
        if near_only and (
            not near or near[0] in cols
        ):  # a tune's own fields beside the column: nothing meant
            continue
        if near or not near_only:
            notes.append(
                f"{path}: {what} {col!r} is not read" + (f" (did you mean {near[0]!r}?)" if near else "")
            )
    return notes
