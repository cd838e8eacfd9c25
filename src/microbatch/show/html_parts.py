"""The HTML report's building blocks: escaping, tables, number formats, figures, the style sheet.

Plain string functions with no state; :mod:`microbatch.show.html_sections` and
:mod:`microbatch.show.html` build the report's sections and page from them.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

from microbatch.show.figures import Figure
from microbatch.units import format_bytes

__all__ = ["CSS", "esc", "table", "gib", "pct", "num", "name_of", "figure_html"]

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
