"""The HTML report's building blocks: escaping, tables, number formats, figures, the style sheet.

Plain string functions with no state; :mod:`microbatch.show.html_sections` and
:mod:`microbatch.show.html` build the report's sections and page from them.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from microbatch.show.figures import Figure
from microbatch.units import GIB, KIB, MIB, format_bytes

__all__ = [
    "CSS",
    "esc",
    "table",
    "gib",
    "mem",
    "bytes_column",
    "seconds_column",
    "pct",
    "num",
    "name_of",
    "figure_html",
]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1000px;color:#222;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem} h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
p.lead{color:#555;margin-top:0} table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:right} th{background:#f4f4f4}
tr.pick td{background:#fff4d6;font-weight:600} figure{margin:1rem 0} figcaption{font-size:.85rem;color:#555}
pre{background:#f6f8fa;padding:.6rem;overflow-x:auto;font-size:.8rem} .answer{font-size:1.1rem;background:#eef6ee;padding:.6rem;border-radius:6px}
svg{max-width:100%;height:auto} .wide{overflow-x:auto;max-width:100%}
"""
"""The page's style sheet (inline: the report needs no other file)."""


SOURCE = "_report_source"
"""The key the report's loader adds to each result: the file it was read from, shown under its section's title."""


def esc(x: Any) -> str:
    """``x`` as text, escaped for HTML."""
    return html.escape(str(x))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], highlight: int | None = None) -> str:
    """An HTML table (scrolling sideways when wide); row ``highlight`` is marked as the pick."""
    out = [
        "<div class='wide'><table><thead><tr>"
        + "".join(f"<th>{esc(h)}</th>" for h in headers)
        + "</tr></thead><tbody>"
    ]
    for i, r in enumerate(rows):
        cls = ' class="pick"' if highlight is not None and i == highlight else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def gib(b: float | None) -> str:
    """Bytes in GiB (one unit down a table's column), ``—`` for None."""
    return format_bytes(b, unit="GiB")


def mem(b: float | None) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1 (``232.10 MiB``,
    ``3.00 GiB``), ``—`` for None: one value alone, where a column's shared unit does not apply."""
    return format_bytes(b)


_MAX_EXTRA_DIGITS = 4
"""At most this many decimals more than a column's default, to keep distinct values distinct."""


def _distinct(values: Sequence[float | None], render: Callable[[float, int], str], digits: int) -> list[str]:
    """``render(v, d)`` for each value, with the fewest decimals ``d`` from ``digits`` up (at most
    :data:`_MAX_EXTRA_DIGITS` more) that keep distinct values apart; ``—`` for None."""
    real = sorted({v for v in values if v is not None})
    d = digits
    while d < digits + _MAX_EXTRA_DIGITS and len({render(v, d) for v in real}) < len(real):
        d += 1
    return ["—" if v is None else render(v, d) for v in values]


def bytes_column(values: Sequence[float | None], digits: int = 2) -> list[str]:
    """A table column of byte counts in one binary unit, chosen by the largest (GiB from 1 GiB, else
    MiB, KiB): 232.10 MiB and 242.13 MiB stay apart rather than both ``0.23 GiB`` or ``0.24 GiB``;
    more decimals where two distinct values would read the same. ``—`` for None."""
    top = max((abs(v) for v in values if v is not None), default=0.0)
    unit = "GiB" if top >= GIB else "MiB" if top >= MIB else "KiB" if top >= KIB else "B"
    return _distinct(values, lambda v, d: format_bytes(v, digits=d, unit=unit), digits)


_TIME_UNITS = (("s", 1.0), ("ms", 1e-3))
"""Units of a column of times, largest first, with their length in seconds."""


def seconds_column(values: Sequence[float | None], digits: int = 2) -> tuple[str, list[str]]:
    """A table column of times given in seconds, in one unit chosen by the largest (s from 1 s, else
    ms; s when there is none), and its unit for the header: 0.33 ms and 0.32 ms stay apart rather than both
    ``0.0003`` s; more decimals where two distinct values would read the same. ``—`` for None."""
    top = max((abs(v) for v in values if v is not None), default=0.0)
    unit, scale = _TIME_UNITS[0] if top >= 1.0 or not top else _TIME_UNITS[1]
    return unit, _distinct(values, lambda v, d: f"{v / scale:,.{d}f}", digits)


def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal, ``—`` for None."""
    return "—" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, fmt: str = "{:,.0f}") -> str:
    """``x`` through ``fmt``, ``—`` for None."""
    return "—" if x is None else fmt.format(x)


def name_of(x: Any) -> str:
    """The ``name`` of a model or GPU given as a dict (plan JSON), or the value itself."""
    return str(x.get("name", "")) if isinstance(x, dict) else str(x or "")


def figure_html(fig: Figure) -> str:
    """A figure inline as SVG with its caption, its id ``fig-<name>``."""
    return f"<figure id='fig-{fig.name}'>{fig.svg}<figcaption>{esc(fig.title)}</figcaption></figure>"
