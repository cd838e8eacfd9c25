"""The matplotlib figures: throughput, memory and the one bubble chart.

matplotlib is imported only inside these functions, on the Agg canvas and without pyplot's
global state, so importing this module costs nothing. Every figure is a
:class:`matplotlib.figure.Figure`; :func:`render_figure` turns one into inline SVG text (and a
PNG file) for the HTML report, and :func:`save_timeline_png` writes the bubble chart alone.

Colours come from the one table in :mod:`microbatch.show.timeline`.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from microbatch.records_fields import throughput_unit
from microbatch.show.timeline import (
    COLORS,
    KIND_COLORS,
    KIND_NAMES,
    UNKNOWN_COLOR,
    Row,
    kind_of,
    kind_order,
    normalize_rows,
    window,
)
from microbatch.units import GIB, MIB, format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure as MplFigure

__all__ = [
    "FIGURE_SIZE_IN",
    "FIGURE_DPI",
    "FIGURE_SIZE_PX",
    "Figure",
    "new_figure",
    "render_figure",
    "prefix_svg_ids",
    "throughput_figure",
    "memory_figure",
    "timeline_figure",
    "save_timeline_png",
]

FIGURE_SIZE_IN = (8.0, 4.5)
"""Width and height in inches of every figure of the HTML report."""

FIGURE_DPI = 100
"""Dots per inch of the report's PNG figures."""

FIGURE_SIZE_PX = (int(FIGURE_SIZE_IN[0] * FIGURE_DPI), int(FIGURE_SIZE_IN[1] * FIGURE_DPI))
"""Width and height in pixels of every PNG figure of the HTML report."""

LABEL_MIN_SHARE = 0.025
"""An op of the bubble chart is labelled (``F3``) when it spans at least this share of the time."""


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One figure of the report: its name, title, inline SVG text and the PNG it was saved as."""

    name: str
    """File stem and HTML id (``fig-<name>``)."""
    title: str
    """Caption."""
    svg: str
    """The SVG element, without the XML prolog, to sit inline in HTML."""
    png_path: Path | None = None
    """Where the PNG copy goes, when one is asked for (written by :meth:`write_png`, once the page is)."""
    png_data: bytes = b""
    """The PNG copy's bytes, held until the report is written: a report that fails later leaves no figure."""
    x_limits: tuple[float, float] | None = None
    """The x-axis range of the first axes as drawn (for checking that charts share one scale)."""
    x_label: str = ""
    """The x-axis label of the first axes, with its unit (``time (ms)``)."""

    def write_png(self) -> None:
        """Write the PNG copy to :attr:`png_path` (its folder made), whole or not at all."""
        from microbatch.files import write_bytes

        if self.png_path is not None:
            write_bytes(self.png_path, self.png_data)


def literal(text: str) -> str:
    """``text`` drawn as written: its dollar signs escaped, so that matplotlib reads no TeX in a model's name or path
    (``hf_$x$`` was drawn as maths; a ``$\\frac{`` in one stopped the report)."""
    return text.replace("$", r"\$")


TITLE_POINTS = 11.0
"""A figure title's font size (points)."""


def set_title(ax: Any, text: str) -> None:
    """``text`` as ``ax``'s title, drawn as written (:func:`literal`) and wrapped to the figure's width: a pipeline's
    predicted diagram's title and a Hugging Face model's long name were cut off at both edges. The width in
    characters: the figure's width in points over about 0.55 of the font size a character."""
    import textwrap

    width_pt = ax.figure.get_size_inches()[0] * 72.0
    chars = max(20, int(width_pt / (0.55 * TITLE_POINTS)))
    ax.set_title(textwrap.fill(literal(text), width=chars), fontsize=TITLE_POINTS)


def new_figure(size_in: tuple[float, float] = FIGURE_SIZE_IN, dpi: int = FIGURE_DPI) -> MplFigure:
    """An empty matplotlib figure on the Agg canvas (no pyplot, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=size_in, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def render_figure(fig: MplFigure, name: str, title: str, png_dir: Path | None) -> Figure:
    """``fig`` as inline SVG text, and as PNG bytes for ``png_dir/<name>.png`` when ``png_dir`` is given (written by
    :meth:`Figure.write_png`)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name}):  # the same figure, the same text
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = prefix_svg_ids(svg[svg.find("<svg") :], name)  # no XML prolog: the SVG sits inline
    png_path, png = None, io.BytesIO()
    if png_dir is not None:
        png_path = png_dir / f"{name}.png"
        from microbatch import __version__
        from microbatch.envelope import MARK

        # the mark tells a later report that the file is ours to replace (microbatch.envelope.is_ours)
        fig.savefig(png, format="png", dpi=fig.dpi, metadata={"Software": f"{MARK} {__version__}"})
    axes = fig.get_axes()
    xlim = (float(axes[0].get_xlim()[0]), float(axes[0].get_xlim()[1])) if axes else None
    xlabel = axes[0].get_xlabel() if axes else ""
    return Figure(
        name=name,
        title=title,
        svg=svg,
        png_path=png_path,
        png_data=png.getvalue(),
        x_limits=xlim,
        x_label=xlabel,
    )


_SVG_ID = re.compile(r"""(\bid=["']|url\(#|href=["']#)([^"')]+)""")
"""An element id in SVG text, where it is defined (``id="patch_1"``) or referred to (``url(#p1)``,
``xlink:href="#DejaVuSans-31"``)."""


def prefix_svg_ids(svg: str, prefix: str) -> str:
    """``svg`` with every id it defines, and every reference to one, prefixed ``<prefix>-``: matplotlib
    numbers its ids per file (``figure_1``, ``patch_1``, the glyphs ``DejaVuSans-31``), so two figures
    inline in one HTML page would repeat them; with each figure's own prefix the page's ids are unique."""
    defined = {m.group(2) for m in _SVG_ID.finditer(svg) if m.group(1).startswith("id")}

    def one(m: re.Match[str]) -> str:
        return m.group(1) + f"{prefix}-{m.group(2)}" if m.group(2) in defined else m.group(0)

    return _SVG_ID.sub(one, svg)


def _axes(fig: MplFigure) -> Axes:
    return fig.add_subplot(1, 1, 1)


def throughput_figure(tune: dict[str, Any]) -> MplFigure:
    """Throughput against b_m (log2 axis), the knee, the fastest fitting point and the tolerance band."""
    pts = [p for p in tune.get("points", []) if not p.get("oom") and p.get("throughput")]
    ooms = [p for p in tune.get("points", []) if p.get("oom")]
    pts.sort(key=lambda p: p["micro_batch"])
    fig = new_figure()
    ax = _axes(fig)
    xs = [p["micro_batch"] for p in pts]
    ys = [p["throughput"] for p in pts]
    ax.plot(xs, ys, "o-", color=COLORS["measured"], label="measured")
    left = {i.get("micro_batch") for i in tune.get("left_out") or [] if isinstance(i, dict)}
    if left & set(xs):  # measured, but past a limit the choice kept (a latency, the memory budget)
        out = [p for p in pts if p["micro_batch"] in left]
        ax.plot([p["micro_batch"] for p in out], [p["throughput"] for p in out], "o", ms=11, mfc="none",
                color=COLORS["unknown"], label="left out (past a limit)")  # fmt: skip
    chosen_from = [p["throughput"] for p in pts if p["micro_batch"] not in left] or ys
    if ys:
        best = max(chosen_from)
        tol = float(tune.get("tolerance") or 0.0)
        rule = tune.get("rule", "")
        ref = max(best, float(tune.get("reference_throughput") or 0.0))
        if ref > best:
            ax.axhline(ref, color=COLORS["fit"], ls="--", lw=1, label=f"bound on larger b_m ({ref:,.0f})")
        if tol > 0 and rule == "fraction":
            mu = float(tune.get("bound_margin") or 0.0)
            what = ("the bound" if ref > best else "best") + (f", {mu:.1%} margin" if mu >= 0.0005 else "")
            line = ref * (1 - tol) * (1 + mu)
            if line < ref:
                ax.axhspan(
                    line, ref, color=COLORS["measured"], alpha=0.12, label=f"within {tol:.0%} of {what}"
                )
            else:  # the margin lifts the line over the reference: no b_m can reach it (the text says so too)
                ax.axhline(line, color=COLORS["measured"], ls=":", lw=1,
                           label=f"line {line:,.0f} ({tol:.0%} below {what}): over it, none reaches it")  # fmt: skip
        elif tol > 0:
            ax.axhspan(
                best * (1 - tol), best, color=COLORS["measured"], alpha=0.12, label=f"best − {tol:.0%}"
            )
    knee = tune.get("micro_batch")
    if knee is not None and tune.get("throughput"):
        ax.plot([knee], [tune["throughput"]], "*", ms=18, color=COLORS["limit"], label=f"knee b_m = {knee}")
    ff = tune.get("fastest_fitting") or {}
    if ff.get("micro_batch") is not None and ff.get("throughput") and ff.get("micro_batch") != knee:
        ax.plot(
            [ff["micro_batch"]],
            [ff["throughput"]],
            "D",
            ms=9,
            color=COLORS["alternative"],
            label=f"fastest that fits b_m = {ff['micro_batch']}",
        )
    for p in ooms:
        ax.axvline(p["micro_batch"], color=COLORS["unknown"], ls=":", lw=1)
    if ooms:
        ax.plot([], [], ls=":", color=COLORS["unknown"], label="out of memory")
    if xs and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)  # throughput from zero: the plateau's height reads true
    ax.set_xlabel("micro-batch b_m")
    unit = throughput_unit(tune)
    ax.set_ylabel(f"throughput ({unit})")
    model = tune.get("model", "")
    name = model.get("name", "") if isinstance(model, dict) else model
    set_title(ax, f"Throughput against micro-batch — {name} {tune.get('mode', '')}".strip())
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def memory_figure(tune: dict[str, Any]) -> MplFigure:
    """Peak memory against b_m: measured points, the linear fit and the budget line; in GiB, or in MiB where every
    peak is under one GiB (a CPU tune of a small model: its axis read 0.300-0.335 GiB beside the text's MiB)."""
    pts = [p for p in tune.get("points", []) if p.get("peak_memory_bytes") and not p.get("oom")]
    pts.sort(key=lambda p: p["micro_batch"])
    scale, unit = (GIB, "GiB") if max([p["peak_memory_bytes"] for p in pts] or [GIB]) >= GIB else (MIB, "MiB")
    fig = new_figure()
    ax = _axes(fig)
    xs = [p["micro_batch"] for p in pts]
    ys = [p["peak_memory_bytes"] / scale for p in pts]
    ax.plot(xs, ys, "o", color=COLORS["measured"], label="measured peak")
    fit = tune.get("memory_fit") or {}
    budget = tune.get("memory_budget_bytes")
    mf = tune.get("max_fitting_micro_batch")
    # Show the fit up to the largest fitting b_m, but no further than 4× the largest probe.
    top = min(max([*xs, mf or 0, 1]), 4 * max([*xs, 1]))
    if fit.get("slope_bytes_per_sample") is not None and fit.get("intercept_bytes") is not None:
        line_x = [0, top * 1.1]
        line_y = [(fit["intercept_bytes"] + fit["slope_bytes_per_sample"] * x) / scale for x in line_x]
        ax.plot(
            line_x,
            line_y,
            "-",
            color=COLORS["fit"],
            label=f"fit: {format_bytes(fit['intercept_bytes'], unit=unit)} + "
            f"{format_bytes(fit['slope_bytes_per_sample'], digits=1, unit='MiB')} × b_m",
        )
    if mf and mf > top:
        ax.plot([], [], " ", label=f"largest predicted to fit: {mf} (right of the b_m range drawn)")
    if budget and budget / scale < 2 * max([*ys, fit.get("intercept_bytes", 0) / scale]):
        ax.axhline(
            budget / scale, color=COLORS["limit"], ls="--", label=f"budget {format_bytes(budget, unit=unit)}"
        )
    elif budget:
        ax.plot([], [], " ", label=f"budget {format_bytes(budget, unit=unit)} (above the memory range drawn)")
    if mf and mf <= top:
        ax.axvline(mf, color=COLORS["limit"], ls=":", lw=1, label=f"largest predicted to fit: {mf}")
    ax.set_xlabel("micro-batch b_m")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title("Peak memory is linear in b_m")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def timeline_figure(
    rows: list[list[Row]],
    makespan: float | None = None,
    *,
    title: str | None = None,
    time_unit: str = "",
    rank_label: str = "rank",
    size_in: tuple[float, float] | None = None,
    dpi: int = FIGURE_DPI,
) -> MplFigure:
    """The bubble chart: ranks as lanes, time left to right from the first start, one box per
    F/B/I/W coloured by kind (labelled ``F3`` where wide enough), idle time as gaps.

    ``rows`` as :func:`~microbatch.show.timeline.normalize_rows` returns them; ``time_unit`` labels
    the axis (``time (ms)``); ``size_in`` defaults to 10 inches wide, 0.4 inch per rank.
    """
    t0, span = window(rows, makespan)
    span = span if span > 0 else 1.0
    fig = new_figure(size_in or (10.0, 1.0 + 0.4 * max(1, len(rows))), dpi)
    ax = _axes(fig)
    kinds_seen: set[str] = set()
    for r, rank in enumerate(rows):
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for start, stop, label, mb in rank:
            kind = kind_of(label)
            by_kind.setdefault(kind, []).append((start - t0, stop - start))
            if (stop - start) / span >= LABEL_MIN_SHARE:
                text = f"{label}{mb}" if mb >= 0 else label
                ax.text((start + stop) / 2 - t0, r, text, ha="center", va="center", fontsize=7, color="white")
        for kind, spans in by_kind.items():
            ax.broken_barh(
                spans,
                (r - 0.4, 0.8),
                facecolors=KIND_COLORS.get(kind, UNKNOWN_COLOR),
                edgecolor="white",
                linewidth=0.3,
            )
        kinds_seen.update(by_kind)
    ax.set_yticks(range(len(rows)), [f"{rank_label} {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(literal(f"time ({time_unit})" if time_unit else "time"))
    if title:
        set_title(ax, title)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color=KIND_COLORS.get(k, UNKNOWN_COLOR), label=f"{k} {KIND_NAMES.get(k, k)}")
            for k in sorted(kinds_seen, key=kind_order)
        ],
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        frameon=False,
        fontsize=8,
    )
    fig.tight_layout()
    return fig


def save_timeline_png(
    intervals_by_rank: Iterable[Iterable[Any]],
    makespan: float | None,
    path: str | Path,
    *,
    title: str | None = None,
    time_unit: str = "",
    rank_label: str = "rank",
    dpi: int = 120,
) -> Path:
    """Draw the timeline with :func:`timeline_figure` to a PNG at ``path``; returns the path."""
    fig = timeline_figure(
        normalize_rows(intervals_by_rank),
        makespan,
        title=title,
        time_unit=time_unit,
        rank_label=rank_label,
        dpi=dpi,
    )
    p = Path(path)
    from microbatch import __version__
    from microbatch.envelope import MARK
    from microbatch.files import write_bytes

    # the mark tells a later run that this file is ours to replace (microbatch.envelope.is_ours)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": f"{MARK} {__version__}"})
    write_bytes(p, buf.getvalue())  # whole or not at all: a full disk leaves the earlier picture as it was
    return p
