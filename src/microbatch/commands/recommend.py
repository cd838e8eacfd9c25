"""``microbatch recommend``: pick the knee from measurements made elsewhere (JSON or CSV)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import click

from microbatch._json import check_size, loads
from microbatch.commands._columns import canonical_rows, check_lookalikes, unread_notes
from microbatch.commands._common import choice_config, choice_options, emit, flags_for, json_option, progress
from microbatch.errors import ConfigError
from microbatch.units import format_bytes

__all__ = ["cmd", "read_measurements", "read_rows", "read_rows_and_lines"]


def read_rows(path: str) -> list[Any]:
    """Rows of a measurements file: a JSON list, a JSON object with ``points`` (tune's result.json), or CSV.

    JSON goes through :func:`microbatch.records.result_points`, the one reader of result files;
    each row is then checked by :func:`microbatch.choose.knee.points_from_records`.
    """
    return read_rows_and_lines(path)[0]


def _file_of(path: str) -> Path:
    """``path``, or its ``result.json`` where it is a tune's folder (as --calibration and export take it)."""
    p = Path(path)
    return p / "result.json" if p.is_dir() and (p / "result.json").is_file() else p


def read_rows_and_lines(path: str) -> tuple[list[Any], list[int] | None]:
    """:func:`read_rows` and, for a CSV, each row's line in the file (None for JSON): messages name the line an
    editor shows."""
    return read_measurements(path)[:2]


def read_measurements(path: str) -> tuple[list[Any], list[int] | None, list[str]]:
    """:func:`read_rows_and_lines` and the notes on the file's columns that are not read (for the answer's notes)."""
    if not path.strip():
        raise ConfigError("--measurements '' names no file; give a JSON or CSV file of points")
    p = _file_of(path)
    if p.is_dir():
        raise ConfigError(
            f"--measurements {path!r} is a folder; give a JSON or CSV file of points (tune --out writes result.json in its folder)"
        )
    if not p.is_file():
        why = "is not a regular file" if p.exists() else "does not exist"
        raise ConfigError(f"--measurements {path!r} {why}; give a JSON or CSV file of points")
    check_size(p, "--measurements")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark (spreadsheets write one) is not a column
    except UnicodeDecodeError as e:
        head = p.read_bytes()[:2]
        utf16 = " UTF-16 (as PowerShell's > writes);" if head in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(
            f"--measurements {path!r} is not UTF-8 text ({e.reason} at byte {e.start});{utf16} save it as UTF-8 JSON "
            "or CSV"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"--measurements {path!r} cannot be read ({e}); give a JSON or CSV text file"
        ) from None
    if not text.strip():
        raise ConfigError(
            f"--measurements {path!r} is empty; give a JSON list of points or a CSV with a header "
            "micro_batch,throughput[,peak_memory_bytes,oom,step_time_s]"
        )
    if text.lstrip().startswith(("[", "{")) or p.suffix.lower() == ".json":
        return _json_rows(path, text)
    return _csv_rows(path, text)


def _json_rows(path: str, text: str) -> tuple[list[Any], None, list[str]]:
    """A JSON file's rows (tune's result or a list written by hand), and the notes on a list's keys not read."""
    from microbatch.records import result_points

    try:
        data = loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno}); "
            + (
                "it is JSON Lines (one object a line): wrap the lines in [ ] with a comma after each but the last"
                if _json_lines(text)
                else "fix the file"
            )
        ) from None
    rows = result_points(data, source=path)
    if not isinstance(data, list):  # tune's own result: its fields are its own
        return rows, None, []
    # a list written by hand: a known key in another case is that key; a key near one was meant as it
    keys = sorted({k for r in rows if isinstance(r, dict) for k in r})
    keys, rows = canonical_rows(path, keys, rows)
    check_lookalikes(path, keys, what="key")
    return rows, None, unread_notes(path, keys, near_only=True)


def _csv_rows(path: str, text: str) -> tuple[list[Any], list[int], list[str]]:
    """A CSV's rows, each with its line in the file (the header checked, an empty spreadsheet row skipped), and the
    notes on its columns that are not read."""
    reader = csv.DictReader(io.StringIO(text))
    raw = [c.strip() for c in (reader.fieldnames or [])]
    cols, _ = canonical_rows(path, raw, [])
    missing = [c for c in ("micro_batch", "throughput") if c not in cols]
    if missing:
        sep = next((s for s in (";", "\t") if len(cols) == 1 and s in cols[0]), None)
        raise ConfigError(
            f"{path}: CSV is missing column(s) {', '.join(missing)}; columns found: {', '.join(cols) or 'none'}; "
            "need micro_batch, throughput[, peak_memory_bytes, oom, step_time_s]"
            + (f"; the file separates its columns with {'a tab' if sep == chr(9) else repr(sep)}: write them with ','"
               if sep else _near_columns(missing, cols))
        )  # fmt: skip
    twice = sorted({c for c in cols if cols.count(c) > 1})
    if twice:
        raise ConfigError(f"{path}: CSV names column(s) {', '.join(twice)} more than once; keep one of each")
    check_lookalikes(path, cols)
    rows, lines = [], []
    for row in reader:
        if None in row and all(not str(x).strip() for x in row[None]):  # trailing commas: empty cells
            del row[None]
        if None not in row and all(
            not (v or "").strip() for v in row.values()
        ):  # a spreadsheet's empty row: ,,
            continue
        if None in row:  # more cells than the header: csv puts the rest under None (an unquoted 1,000)
            raise ConfigError(
                f"{path}: line {reader.line_num} has {len(cols) + len(row[None])} cells, the header {len(cols)}; write numbers "
                'without thousands separators (1000, not 1,000) or quote them ("1,000")'
            )
        rows.append({(k or "").strip(): (v.strip() if isinstance(v, str) else v) for k, v in row.items()})
        lines.append(reader.line_num)  # the row's last line: its only one unless a quoted cell spans lines
    return canonical_rows(path, raw, rows)[1], lines, unread_notes(path, cols)


def _json_lines(text: str) -> bool:
    """Whether ``text`` is JSON Lines: two or more lines, each one JSON object."""
    lines = [x for x in text.splitlines() if x.strip()]
    if len(lines) < 2:
        return False
    try:
        return all(isinstance(loads(x), dict) for x in lines)
    except json.JSONDecodeError:
        return False


def _near_columns(missing: list[str], cols: list[str]) -> str:
    """ "; did you mean" for each missing column a found one names (its case, a unit after it: ``Throughput (tokens/s)``,
    ``samples_per_s``), or ""."""
    like = {
        "micro_batch": ("micro", "mbs", "batch_size", "bs"),
        "throughput": ("throughput", "per_s", "/s", "tok", "sampl"),
    }
    near = []
    for m in missing:
        plain = [c for c in cols if c.lower().split("(")[0].strip().replace(" ", "_") == m]
        hits = plain or [c for w in like[m] for c in cols if w in c.lower() and "global" not in c.lower()]
        if hits:
            near.append(f"{hits[0]!r} to {m}")
    return (
        f"; rename {', '.join(near)} (the header names them exactly: micro_batch,throughput,...)"
        if near
        else ""
    )


TUNE_SETTINGS = ("memory_budget", "memory_headroom", "max_latency_ms", "rule", "tolerance", "reference",
                 "global_batch", "data_parallel")  # fmt: skip
"""The choice's settings a tune result records, read back where no flag gives them."""


def _size(v: Any) -> str:
    """A budget as a flag takes it back (``4GiB``: no space), or as the file wrote it when it is no number."""
    return format_bytes(float(v)).replace(" ", "") if isinstance(v, int | float) else str(v)


def _word(v: Any) -> str:
    """A setting as a flag takes it (a number at its shortest)."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def tune_settings(path: str, choice_spec: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``choice_spec`` with what a tune result file records in place of the settings no flag gave (a flag given
    wins), and the note that says which were read; unchanged, with no note, for any other file. ``recommend`` on
    tune's own result then chooses as tune chose (it took the defaults: reference measured, no B, no budget)."""
    from microbatch.commands._schedule_inputs import user_gave

    p = _file_of(path)
    try:
        data = loads(p.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return choice_spec, None  # read_rows_and_lines says what is wrong with it
    from microbatch.records import classify

    try:  # a tune result by its envelope, or by its keys where it has none (the Python API's, older files)
        if not isinstance(data, dict) or classify(data) != "tune":
            return choice_spec, None
    except ConfigError:
        return choice_spec, None
    recorded = {k: data.get("memory_budget_bytes" if k == "memory_budget" else k) for k in TUNE_SETTINGS}
    taken = {k: v for k, v in recorded.items() if v is not None and not user_gave(k)}
    if not taken:
        return choice_spec, None
    from microbatch.choose.config import DEFAULT_TOLERANCE, ChoiceConfig

    usual = {  # the settings every choice starts from: said only where the tune's differ
        "rule": "fraction", "data_parallel": 1, "tolerance": DEFAULT_TOLERANCE, "reference": "measured",
        "memory_headroom": ChoiceConfig.memory_headroom,
    }  # fmt: skip
    words = ", ".join(
        f"--{k.replace('_', '-')} {_size(v) if k == 'memory_budget' else _word(v)}"
        for k, v in taken.items()
        if usual.get(k) != v
    )
    note = f"settings of the tune that wrote {path}: {words} (a flag given overrides)" if words else None
    return {**choice_spec, **taken}, note


class _said_where:  # noqa: N801 - a context manager, named like one
    """A ConfigError raised again with ``read_back`` (the note naming the tune file's settings) after it: a value the
    user did not type says where it came from; nothing when ``read_back`` is None."""

    def __init__(self, read_back: str | None) -> None:
        self.read_back = read_back

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self.read_back is not None and isinstance(exc, ConfigError):
            raise ConfigError(f"{exc} ({self.read_back})", params=exc.params) from None


def _note(d: dict[str, Any], note: str) -> None:
    """``note`` added to the result's notes and said on stderr."""
    d["notes"] = [*d.get("notes", []), note]
    progress(f"note: {note}")


PEAK_FLOOR_BYTES = 1 << 20
"""Below 1 MiB no measured peak is likely in bytes (a PyTorch process's allocator holds more for the smallest model):
peaks all under it, with a budget, are likely GiB or MiB read as bytes."""


def _check_peak_units(choice: Any, points: list[Any]) -> None:
    """ConfigError where every measured peak is under 1 MiB and a budget of at least that is given: no process peaks
    so low, so the column holds GiB or MiB read as bytes, and every point would pass the budget (a knee chosen as if
    memory were free). A budget under 1 MiB is taken as meant with peaks of its scale (a curve written by hand)."""
    budget = choice.memory_budget_bytes
    peaks = [p.peak_memory_bytes for p in points if not p.oom and p.peak_memory_bytes]
    if budget is not None and budget >= PEAK_FLOOR_BYTES and peaks and max(peaks) < PEAK_FLOOR_BYTES:
        raise ConfigError(
            f"every peak_memory_bytes is under 1 MiB (the largest {max(peaks):,}), which no process peaks at, and "
            f"the memory budget is {format_bytes(budget)}: every point would pass it; the column holds GiB or MiB "
            "read as bytes: convert it to bytes (GiB × 1073741824, MiB × 1048576)",
            params=("measurements",),
        )
    if budget is not None and budget < PEAK_FLOOR_BYTES and peaks and min(peaks) >= PEAK_FLOOR_BYTES:
        raise ConfigError(
            f"the memory budget is {budget:,} B (a number without a unit is bytes) and every measured peak is at "
            f"least {format_bytes(min(peaks))}; write the budget with its unit (--memory-budget "
            + (f"{budget}GiB)" if budget <= 4096 else "80GiB, 500MB)"),
            params=("memory_budget",),
        )


def _oom_with_rates(rows: list[Any], lines: list[int] | None) -> list[str]:
    """Notes for rows marked out of memory that also give a throughput: the rate is not read (the point is the
    OOM's), said so a tool's partial rate is not dropped without a word."""
    from microbatch.fields import true_or_false

    out = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or r.get("throughput") in (None, ""):
            continue
        try:
            oom = true_or_false(r.get("oom", False), where="oom")
        except ConfigError:
            continue  # the row's own check names it
        if oom:
            where = f"line {lines[i]}" if lines is not None else f"row {i + 1}"
            out.append(
                f"{where}: micro_batch {r.get('micro_batch')} is marked oom and gives a throughput "
                f"({r['throughput']}): taken as out of memory, its throughput not read"
            )
    return out


def _unused_settings(choice_spec: dict[str, Any], choice: Any, points: list[Any]) -> list[str]:
    """Notes for settings that had nothing to act on, or that acted on a column likely in other units."""
    notes = []
    budget = choice.memory_budget_bytes
    if choice_spec.get("memory_headroom") is not None and budget is None:
        notes.append(
            "--memory-headroom had nothing to act on: it is kept free of a --memory-budget, and none was given"
        )
    peaks = [p.peak_memory_bytes for p in points if not p.oom and p.peak_memory_bytes]
    if budget is not None and not peaks:
        notes.append(
            "--memory-budget had nothing to act on: no point gives peak_memory_bytes, so every measured b_m was "
            "taken as fitting; add a peak_memory_bytes column to filter by memory"
        )
    elif budget is not None and max(peaks) < PEAK_FLOOR_BYTES:
        notes.append(
            f"every peak_memory_bytes is under 1 MiB (the largest {max(peaks):,} B) and was compared with the budget "
            "as bytes; if the column holds GiB or MiB, convert it to bytes (GiB × 1073741824)"
        )
    elif budget is not None and max(peaks) < budget / 100:
        notes.append(
            f"every peak_memory_bytes is under 1% of the {format_bytes(budget)} budget (the largest "
            f"{format_bytes(max(peaks))}), so memory left nothing out; if the column holds KiB (ru_maxrss, "
            "/usr/bin/time's maximum resident size) or MiB, convert it to bytes (KiB × 1024)"
        )
    if budget is not None and budget < PEAK_FLOOR_BYTES:
        notes.append(
            f"the memory budget is {budget:,} B, under 1 MiB: a number without a unit is bytes; write it with one "
            "(--memory-budget 80GiB) if it was meant in GiB"
        )
    if (
        choice_spec.get("reference") == "bound" and choice.rule != "fraction"
    ):  # given, not read from a tune's file
        notes.append(
            "--reference bound had nothing to act on: the bound raises the reference of rule fraction only"
        )
    return notes


@click.command("recommend")
@click.option(
    "--measurements",
    "-m",
    required=True,
    help="JSON list (or tune's result.json) or CSV with columns micro_batch, throughput[, peak_memory_bytes, oom, step_time_s].",
)
@choice_options
@json_option
def cmd(measurements: str, choice_spec: dict[str, Any], as_json: bool) -> None:
    """Pick the knee b_m from measurements made anywhere.

    \b
    Example: microbatch recommend --measurements curve.csv --global-batch 512 --data-parallel 4
    The knee is the smallest b_m within the tolerance of the best throughput (rule fraction),
    among the points that fit --memory-budget and --max-latency-ms.
    """
    from microbatch.choose.knee import recommend_measured
    from microbatch.choose.rows import checkpointed, points_from_records
    from microbatch.show.recommendation import render_recommendation

    rows, lines, column_notes = read_measurements(measurements)
    given, (choice_spec, read_back) = choice_spec, tune_settings(measurements, choice_spec)
    with _said_where(read_back), flags_for("max_latency_ms", "tolerance", "memory_headroom", "global_batch",
                                            "data_parallel"):  # fmt: skip
        choice = choice_config(choice_spec)
    points = points_from_records(rows, source=measurements, lines=lines)
    _check_peak_units(choice, points)
    with _said_where(read_back):
        d = recommend_measured(points, choice).to_dict()
    ckpt = checkpointed(points)
    named = {
        "the knee": d.get("micro_batch"),
        "the fastest that fits": (d.get("fastest_fitting") or {}).get("micro_batch"),
    }
    for b in sorted(
        {b for b in named.values() if b in ckpt}
    ):  # tune measured it again so after running out of memory
        what = " and ".join(k for k, v in named.items() if v == b)
        was = "were" if " and " in what else "was"
        _note(
            d,
            f"{what}, b_m = {b}, {was} measured with activation checkpointing on: run it with checkpointing",
        )
    for note in (
        ([read_back] if read_back else [])
        + column_notes
        + _oom_with_rates(rows, lines)
        + _unused_settings(given, choice, points)
    ):
        _note(d, note)
    pts = [
        {
            "micro_batch": p.micro_batch,
            "throughput": p.throughput,
            "peak_memory_bytes": p.peak_memory_bytes,
            "oom": p.oom,
            "step_time_s": p.step_time_s,
            "checkpointing": p.checkpointing,
        }
        for p in points
    ]
    d["throughput_unit"] = unit = _unit_of(measurements)  # the report reads it back
    emit(d, as_json, lambda: render_recommendation(d, pts, unit=unit))


def _unit_of(path: str) -> str:
    """The throughput's unit: a tune result's own (tokens/s for decoding or token batches, samples/s), else the
    file's, unknown here ("per s")."""
    from microbatch.records import classify
    from microbatch.records_fields import throughput_unit

    try:
        data = loads(_file_of(path).read_text(encoding="utf-8-sig"))
        return throughput_unit(data) if isinstance(data, dict) and classify(data) == "tune" else "per s"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ConfigError):
        return "per s"
