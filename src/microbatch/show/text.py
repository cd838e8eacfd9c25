"""Formatting: terminal bubble diagrams and timeline charts (SVG, PNG).

Everything here takes *plain data*, so a simulated and a measured timeline are drawn the same
way: per rank, a sequence of rows ``(start, end, label, microbatch)`` where ``label`` is the
kind (``F``, ``B``, ``I``, ``W``), optionally prefixed by a chunk number (``1F``). Rows of
``(start, end, action)`` with an :class:`~microbatch.schedules.schedule.Action`, and dicts with keys
``start``, ``end``, ``kind`` (or ``label``) and ``microbatch``, are accepted too.

- :func:`render_timeline_text` — the bubble diagram for a terminal: plain text, or ANSI colours
  (through rich) when the caller says the output is a terminal;
- :func:`timeline_svg` — a self-contained SVG string (no matplotlib; an HTML report can inline it);
- :func:`save_timeline_png` — a PNG through matplotlib (the one bubble chart of
  :mod:`microbatch.show.figures`, re-exported here).

Rows, kinds and colours come from :mod:`microbatch.show.timeline`.

This module never prints; the commands decide where the text goes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from microbatch.show.figures import save_timeline_png
from microbatch.show.timeline import (
    KIND_COLORS,
    KIND_NAMES,
    KIND_TERMINAL,
    UNKNOWN_COLOR,
    Row,
    kind_of,
    kind_order,
    normalize_rows,
    window,
)
from microbatch.units import format_number

__all__ = [
    "pct",
    "in_flight_text",
    "bubble_lines",
    "Row",
    "KIND_NAMES",
    "KIND_COLORS",
    "KIND_TERMINAL",
    "IDLE_CHAR",
    "FILL_CHAR",
    "normalize_rows",
    "render_timeline_text",
    "render_stats_table",
    "timeline_svg",
    "save_timeline_svg",
    "save_timeline_png",
]

IDLE_CHAR = "."
"""Plain-text cell of an idle slot."""

FILL_CHAR = "-"
"""Plain-text cells of an op after its label (``B0------``)."""


def render_timeline_text(
    intervals_by_rank: Iterable[Iterable[Any]],
    makespan: float | None = None,
    *,
    width: int = 100,
    color: bool = False,
    legend: bool = True,
    rank_label: str = "rank",
    time_unit: str = "",
    origin: float | None = None,
    fill_width: bool = False,
) -> str:
    """A bubble diagram: one line per rank, time left to right, idle as ``.``.

    Diagrams drawn together share one time scale when each gets the same ``origin`` (the time of
    column 0 on the rows' clock; default the earliest start), the same ``makespan`` (then the end
    time on that clock) and ``fill_width=True`` (exactly ``width`` columns for the span, instead of
    widening short timelines to show labels).

    Each op shows its label and micro-batch (``F3--``, ``B0------``; ``1F3`` for chunk 1) when it
    is wide enough, else its kind letter in every column (``FBBFBB``). ``width`` is the most columns the time axis may
    use; short timelines get a fixed number of columns per op so labels stay readable.
    ``color=True`` returns ANSI colours (rich), for a terminal; the text is the same either way.
    """
    rows = normalize_rows(intervals_by_rank)
    t0, span = window(rows, makespan)
    if origin is not None:
        end = t0 + span
        t0, span = float(origin), max(0.0, end - float(origin))
    if not rows or span <= 0:
        return "(empty timeline)"
    width = max(10, int(width))
    durations = [r[1] - r[0] for rank in rows for r in rank if r[1] > r[0]]
    longest = max((len(f"{r[2]}{r[3]}") for rank in rows for r in rank), default=2)
    d_min = min(durations) if durations else span
    if not (
        math.isfinite((longest + 1) / d_min) and math.isfinite(width / span)
    ):  # subnormal times: no scale
        return f"(timeline too short to draw: {span:.3g}{' ' + time_unit if time_unit else ''} long)"
    want = (longest + 1) / d_min  # columns per time unit to show every label
    scale = want if span * want <= width and not fill_width else width / span
    ncols = max(1, math.ceil(span * scale - 1e-9))
    labels = d_min * scale >= longest  # every op can show its label, or none does

    lines_cells = _cells(rows, t0, scale, ncols, labels)
    name_w = len(f"{rank_label} {len(rows) - 1}")
    unit = f" {time_unit}" if time_unit else ""
    per_col = span / ncols
    header = f"{'':<{name_w}}  0{unit}".ljust(
        name_w + 2 + max(0, ncols - len(format_number(span)))
    ) + format_number(span)
    plain_lines = [header.rstrip()]
    for r, cells in enumerate(lines_cells):
        plain_lines.append(f"{rank_label} {r}".ljust(name_w) + " |" + "".join(c for c, _ in cells) + "|")
    legend_line = ""
    if legend:
        kinds = sorted({kind_of(r[2]) for rank in rows for r in rank}, key=kind_order)
        parts = [f"{k} {KIND_NAMES.get(k, k)}" for k in kinds]
        legend_line = (
            "  ".join(parts + [f"{IDLE_CHAR} idle"]) + f"; one column = {format_number(per_col)}{unit}"
        )
    if not color:
        return "\n".join(plain_lines + ([legend_line] if legend else []))

    return _in_colour(
        plain_lines[0], lines_cells, rows, rank_label, legend, f"{format_number(per_col)}{unit}"
    )


def _cells(
    rows: list[list[tuple[float, float, str, int]]], t0: float, scale: float, ncols: int, labels: bool
) -> list[list[tuple[str, str | None]]]:
    """Per rank, each column's character and the kind of op in it (None: idle)."""
    lines_cells: list[list[tuple[str, str | None]]] = []
    for rank in rows:
        cells: list[tuple[str, str | None]] = [(IDLE_CHAR, None)] * ncols
        for start, end, label, mb in rank:
            c0 = min(ncols - 1, int(round((start - t0) * scale)))
            c1 = min(ncols, max(c0 + 1, int(round((end - t0) * scale))))
            text = f"{label}{mb}" if mb >= 0 else label
            w = c1 - c0
            kind = kind_of(label)
            # the whole label when it fits (filled with "-"), else the kind letter alone
            shown = text.ljust(w, FILL_CHAR) if labels and len(text) <= w else kind * w
            for j in range(w):
                cells[c0 + j] = (shown[j], kind)
        lines_cells.append(cells)

    return lines_cells


def _in_colour(
    header: str,
    lines_cells: list[list[tuple[str, str | None]]],
    rows: list[list[tuple[float, float, str, int]]],
    rank_label: str,
    legend: bool,
    column: str,
) -> str:
    """The diagram with ANSI colours (rich), one styled span per run of equal style; ``column``:
    the time one column stands for, for the legend."""
    from rich.console import Console
    from rich.text import Text

    name_w = len(f"{rank_label} {len(rows) - 1}")
    ncols = len(lines_cells[0]) if lines_cells else 0
    console = Console(force_terminal=True, color_system="standard", width=name_w + ncols + 8, record=False)
    out = [Text(header)]
    for r, cells in enumerate(lines_cells):
        t = Text(f"{rank_label} {r}".ljust(name_w) + " |")
        run, run_style = "", ""
        for ch, cell_kind in cells:  # one styled span per run of equal style; the colour fills, not "-"
            style = KIND_TERMINAL.get(cell_kind, "") if cell_kind else "dim"
            if style != run_style and run:
                t.append(run, style=run_style)
                run = ""
            run_style = style
            run += " " if (cell_kind and ch == FILL_CHAR) else ch
        if run:
            t.append(run, style=run_style)
        t.append("|")
        out.append(t)
    if legend:
        lt = Text()
        for k in sorted({kind_of(r[2]) for rank in rows for r in rank}, key=kind_order):
            lt.append(f" {k} ", style=KIND_TERMINAL.get(k, ""))
            lt.append(f" {KIND_NAMES.get(k, k)}  ")
        lt.append(f"{IDLE_CHAR} idle; one column = {column}", style="dim")
        out.append(lt)
    with console.capture() as cap:
        for t in out:
            console.print(t, overflow="ignore", no_wrap=True, crop=False)
    return cap.get().rstrip("\n")


def render_stats_table(stage_stats: Sequence[Mapping[str, Any]], *, time_unit: str = "") -> str:
    """Per-rank busy / idle / peak in-flight as an aligned plain-text table."""
    unit = f" ({time_unit})" if time_unit else ""
    head = ("rank", f"busy{unit}", f"idle{unit}", "idle %", "peak in flight")
    body = []
    for s in stage_stats:
        total = s["busy"] + s["idle"]
        pct = 100 * s["idle"] / total if total > 0 else 0.0
        body.append(
            (
                str(s["stage"]),
                format_number(s["busy"]),
                format_number(s["idle"]),
                f"{pct:.1f}",
                format_number(s["peak_in_flight"]),
            )
        )
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *body]]
    return "\n".join(lines)


def timeline_svg(
    intervals_by_rank: Iterable[Iterable[Any]],
    makespan: float | None = None,
    *,
    title: str | None = None,
    time_unit: str = "",
    width_px: int = 960,
    row_px: int = 26,
    rank_label: str = "rank",
) -> str:
    """A self-contained SVG chart of the timeline: one lane per rank, one coloured box per op."""
    rows = normalize_rows(intervals_by_rank)
    t0, span = window(rows, makespan)
    span = max(span, 1e-12)
    left, right, top = 70, 20, 34 if title else 12
    axis_h, legend_h = 30, 24
    plot_w = max(100, width_px - left - right)
    height = top + row_px * len(rows) + axis_h + legend_h
    sx = plot_w / span
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px}" height="{height}" '
        f'viewBox="0 0 {width_px} {height}" font-family="sans-serif" font-size="11">',
        f'<rect x="0" y="0" width="{width_px}" height="{height}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{left}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>')
    for r, rank in enumerate(rows):
        y = top + r * row_px
        out.append(
            f'<rect x="{left}" y="{y + 2}" width="{plot_w:.2f}" height="{row_px - 4}" fill="#f2f2f2"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{y + row_px / 2 + 4:.1f}" text-anchor="end">{escape(rank_label)} {r}</text>'
        )
        for start, end, label, mb in rank:
            x = left + (start - t0) * sx
            w = max((end - start) * sx, 0.5)
            kind = kind_of(label)
            fill = KIND_COLORS.get(kind, UNKNOWN_COLOR)
            text = f"{label}{mb}" if mb >= 0 else label
            out.append(
                f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row_px - 4}" fill="{fill}" '
                f'stroke="white" stroke-width="0.5"><title>{escape(text)}: {format_number(start)}–{format_number(end)}</title></rect>'
            )
            if w >= 7 * len(text):
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + row_px / 2 + 4:.1f}" text-anchor="middle" '
                    f'fill="white">{escape(text)}</text>'
                )
    y_axis = top + row_px * len(rows) + 4
    out.append(f'<line x1="{left}" y1="{y_axis}" x2="{left + plot_w}" y2="{y_axis}" stroke="black"/>')
    for tick in _ticks(0.0, span):
        x = left + tick * sx
        out.append(f'<line x1="{x:.2f}" y1="{y_axis}" x2="{x:.2f}" y2="{y_axis + 4}" stroke="black"/>')
        out.append(f'<text x="{x:.2f}" y="{y_axis + 16}" text-anchor="middle">{format_number(tick)}</text>')
    if time_unit:
        out.append(
            f'<text x="{left + plot_w}" y="{y_axis + 28}" text-anchor="end">time ({escape(time_unit)})</text>'
        )
    kinds = sorted({kind_of(r[2]) for rank in rows for r in rank}, key=kind_order)
    lx, ly = left, height - 8
    for k in kinds:
        out.append(
            f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{KIND_COLORS.get(k, UNKNOWN_COLOR)}"/>'
        )
        name = f"{k} {KIND_NAMES.get(k, k)}"
        out.append(f'<text x="{lx + 16}" y="{ly}">{escape(name)}</text>')
        lx += 24 + 7 * len(name)
    out.append("</svg>")
    return "\n".join(out)


def _ticks(lo: float, hi: float, n: int = 8) -> list[float]:
    """About ``n`` round tick positions in [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    first = math.ceil(lo / step) * step
    out = []
    k = 0
    while first + k * step <= hi + 1e-9 * step:
        out.append(first + k * step)
        k += 1
    return out


def save_timeline_svg(
    intervals_by_rank: Iterable[Iterable[Any]], makespan: float | None, path: str | Path, **kw: Any
) -> Path:
    """Write :func:`timeline_svg` to ``path``, after a comment that marks it as ours to replace
    (:func:`microbatch.envelope.is_ours`); returns the path."""
    from microbatch.envelope import mark_line
    from microbatch.files import write_text

    p = Path(path)
    text = mark_line("", comment="<!--") + "\n" + timeline_svg(intervals_by_rank, makespan, **kw)
    write_text(p, text)  # whole or not at all: a full disk leaves the earlier drawing as it was
    return p


def pct(x: float) -> str:
    """A share as a percentage with one decimal."""
    return f"{100 * x:.1f}%"


IN_FLIGHT_SHOWN = 16
"""The most ranks whose in-flight counts one line shows: the first and last eight of more (the JSON has them all)."""


def in_flight_text(values: Sequence[float]) -> str:
    """Peak in-flight counts, rank 0 first, as short numbers; past :data:`IN_FLIGHT_SHOWN` ranks the first and last
    eight, the rest counted."""
    words = [format_number(round(v, 3)) for v in values]
    if len(words) <= IN_FLIGHT_SHOWN + 3:  # hiding fewer than four would take more room than it saves
        return " ".join(words)
    half = IN_FLIGHT_SHOWN // 2
    return " ".join([*words[:half], f"… ({len(words) - 2 * half:,} ranks) …", *words[-half:]])


def bubble_lines(fraction: float, ratio: float, peak_in_flight: Sequence[float]) -> list[str]:
    """The bubble's fraction, ratio and peak in-flight counts, one aligned line each."""
    return [
        f"  bubble fraction  {pct(fraction):>6}  idle / total stage time",
        f"  bubble ratio     {pct(ratio):>6}  idle / ideal busy time (Megatron's number)",
        f"  peak in flight   {in_flight_text(peak_in_flight)}  micro-batches per rank, rank 0 first",
    ]
