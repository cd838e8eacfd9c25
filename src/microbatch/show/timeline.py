"""The timeline as data, and the one colour table every picture uses.

A timeline is, per rank, rows ``(start, end, label, microbatch)`` where ``label`` is the kind
(``F`` forward, ``B`` backward, ``I`` input gradient, ``W`` weight gradient), optionally prefixed
by a chunk number (``1F``). :func:`normalize_rows` turns every shape the library and its JSON
produce into those rows, so a simulated and a measured timeline are drawn the same way by
:mod:`microbatch.show.text` (terminal, SVG) and :mod:`microbatch.show.figures` (matplotlib).

``KIND_COLORS`` and ``COLORS`` are the one colour table: the SVG, the PNG and the HTML report
all read it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

MAX_CHART_ACTIONS = 100_000
"""Most ops (boxes) an SVG or PNG chart, or ``--intervals``, is made of: at p = 4, m = 125,000 (1,000,000 ops) the SVG
was 144 MB and took 10 s and 1.1 GB, a PNG 22-37 s, ``--json --intervals`` 115 MB on stdout, and a ``report`` of that
file 99 s and a 217 MB page (a helper's runs, 2 cores); a tenth of that draws in about a second. The numbers need no
chart: the simulation itself goes to :data:`~microbatch.schedules.limits.MAX_SIMULATED_ACTIONS`."""

_ACTION_TEXT = re.compile(r"\d*([A-Za-z])(\d+)")
"""An action as text: stage, kind letter, micro-batch (``"2F0"``)."""

__all__ = [
    "MAX_CHART_ACTIONS",
    "Row",
    "KIND_NAMES",
    "KIND_COLORS",
    "KIND_TERMINAL",
    "COLORS",
    "UNKNOWN_COLOR",
    "kind_of",
    "kind_order",
    "normalize_rows",
    "window",
]

Row = tuple[float, float, str, int]
"""One op on one rank: ``(start, end, label, microbatch)``; ``microbatch`` is -1 when unknown."""

KIND_NAMES = {"F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad"}
"""What each kind letter means, for legends."""

KIND_COLORS = {"F": "#4C78A8", "B": "#54A24B", "I": "#72B7B2", "W": "#E45756"}
"""Fill colour of each kind in the SVG, the PNG and the HTML report."""

KIND_TERMINAL = {"F": "white on blue", "B": "black on green", "I": "black on cyan", "W": "white on red"}
"""rich styles of each kind in a colour terminal."""

UNKNOWN_COLOR = "#999999"
"""Fill of a kind not in :data:`KIND_COLORS`, and of out-of-memory marks."""

COLORS = {
    "measured": "#4C78A8",
    "fit": "#F58518",
    "limit": "#E45756",
    "alternative": "#54A24B",
    "unknown": UNKNOWN_COLOR,
}
"""Colours of the other figures: measured points, fitted lines and bounds, limits (knee, budget),
the alternative choice (fastest that fits), and what is out of range."""


def kind_of(label: str) -> str:
    """The kind letter of a label (``"1F"`` -> ``"F"``); unknown labels keep their last char."""
    return label[-1] if label else "?"


def kind_order(kind: str) -> int:
    """Sort key of a kind letter: F, B, I, W, then the rest."""
    return "FBIW".find(kind) % 5


def _row(item: Any) -> Row:
    """One op as a :data:`Row`: a mapping, ``(start, end, Action)`` or ``(start, end, label, mb)``."""
    if isinstance(item, Mapping):
        label = str(item.get("label", item.get("kind", "?")))
        start = item["start"] if "start" in item else item["start_s"]
        end = item["end"] if "end" in item else item["end_s"]
        mb = item.get("microbatch", -1)
        return (float(start), float(end), label, -1 if mb in (None, "") else int(mb))
    if len(item) == 3:  # (start, end, Action), or (start, end, "2F0") as `simulate --intervals` writes it
        start, end, action = item
        if isinstance(action, str):
            m = _ACTION_TEXT.fullmatch(action)
            if m is None:
                return (float(start), float(end), action, -1)
            return (float(start), float(end), m.group(1), int(m.group(2)))
        return (float(start), float(end), str(action.kind), int(action.microbatch))
    start, end, label, mb = item
    return (float(start), float(end), str(label), int(mb))


def normalize_rows(timeline: Any) -> list[list[Row]]:
    """Per rank, rows as ``(start, end, label, microbatch)``, sorted by start.

    Accepts rows per rank (each row a mapping, ``(start, end, Action)`` or ``(start, end, label,
    microbatch)``), a mapping keyed by rank, or one flat list of mappings that carry ``rank``
    (``pipeline --json``). A mapping gives its times as ``start``/``end`` or ``start_s``/``end_s``
    (kept as given: the caller knows the unit) and its kind as ``label`` or ``kind``.
    """
    if isinstance(timeline, Mapping):
        timeline = [timeline[k] for k in sorted(timeline, key=int)]
    ranks: list[Iterable[Any]] = list(timeline or [])
    if ranks and isinstance(ranks[0], Mapping) and "rank" in ranks[0]:
        flat: list[Mapping[str, Any]] = list(ranks)  # type: ignore[arg-type]  # checked just above
        per_rank: list[list[Mapping[str, Any]]] = [[] for _ in range(1 + max(int(it["rank"]) for it in flat))]
        for it in flat:
            per_rank[int(it["rank"])].append(it)
        ranks = list(per_rank)
    out: list[list[Row]] = []
    for rank in ranks:
        rows = [_row(item) for item in rank]
        rows.sort(key=lambda r: (r[0], r[1]))
        out.append(rows)
    return out


def window(rows: list[list[Row]], makespan: float | None) -> tuple[float, float]:
    """``(t0, span)``: times are drawn relative to the earliest start ``t0`` (0 for a simulation;
    a measured timeline may use any clock). ``makespan`` is the end time on the rows' clock, or,
    when smaller than ``t0``, a duration from ``t0``; by default the last end."""
    t0 = min((r[0] for rank in rows for r in rank), default=0.0)
    last = max((r[1] for rank in rows for r in rank), default=t0)
    if makespan is None:
        end = last
    else:
        end = float(makespan)
        if end < t0:
            end = t0 + end
    return t0, max(0.0, end - t0)
