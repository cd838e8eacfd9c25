"""The HTML report and its figures: one self-contained file from saved results.

``build_report(results, out_path)`` takes the JSON objects that ``tune --json`` (or
``tune --out DIR``), ``plan --json``, ``pipeline --json``, ``simulate --json`` and
``validate --json`` print, recognises each by its keys, and writes:

- ``out_path``: one HTML file with every figure inline as SVG (no network, no CDN, no script);
- ``<out_path stem>-figures/*.png``: the same figures as PNG images (``FIGURE_SIZE_PX``).

Figures: the throughput curve with the knee and the tolerance band; peak memory against b_m
with the linear fit, the measured points and the budget line; the bubble diagram, predicted
and measured; then tables: the plan with its recommendation and reasons, predicted against
measured with the errors, and the exported configs.

This module is the seam between results and pictures: ``report.py`` keeps the terminal
renderings (tables, the ASCII bubble diagram); matplotlib is imported only here, lazily.
"""

from __future__ import annotations

import html
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["classify", "load_results", "build_report", "FIGURE_SIZE_PX", "Report"]

FIGURE_SIZE_IN = (8.0, 4.5)
FIGURE_DPI = 100
FIGURE_SIZE_PX = (int(FIGURE_SIZE_IN[0] * FIGURE_DPI), int(FIGURE_SIZE_IN[1] * FIGURE_DPI))
"""Width and height in pixels of every PNG figure."""

KIND_COLOURS = {"F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#72B7B2"}


def classify(result: dict) -> str:
    """Which command produced ``result``: tune, plan, pipeline, simulate or validate."""
    if not isinstance(result, dict):
        raise ConfigError(f"a result must be a JSON object, got {type(result).__name__}")
    if "points" in result and "micro_batch" in result:
        return "tune"
    if "recommended" in result and "candidates" in result:
        return "plan"
    if "measured" in result and "predicted" in result:
        return "pipeline"
    if "makespan" in result and "stage_stats" in result:
        return "simulate"
    if "rows" in result:
        return "validate"
    raise ConfigError(
        "cannot tell which command wrote this result (keys: "
        + ", ".join(sorted(result)[:12])
        + "); give the JSON that tune, plan, pipeline, simulate or validate print with --json"
    )


def load_results(paths: Iterable[str | Path]) -> list[tuple[str, dict]]:
    """Read result files (JSON; a directory means its ``result.json``), each with its kind."""
    out = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            path = path / "result.json"
        if not path.exists():
            raise ConfigError(
                f"result file {str(path)!r} does not exist; give files written by --json or --out"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"result file {str(path)!r} is not JSON ({e.msg} at line {e.lineno})") from None
        items = data if isinstance(data, list) else [data]
        for item in items:
            out.append((classify(item), item))
    if not out:
        raise ConfigError("no results given; pass one or more JSON files from tune, plan or pipeline")
    return out


# --------------------------------------------------------------------------------------
# Figures (matplotlib, imported lazily)


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Figure:
    """One figure: its title, its inline SVG text and the PNG file it was also saved as."""

    name: str
    title: str
    svg: str
    png_path: Path | None = None


def _save(fig, name: str, title: str, png_dir: Path | None) -> Figure:
    plt = _plt()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.find("<svg") :]  # drop the XML prolog so the SVG can sit inline
    png_path = None
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        png_path = png_dir / f"{name}.png"
        fig.savefig(png_path, format="png", dpi=FIGURE_DPI)
    plt.close(fig)
    return Figure(name=name, title=title, svg=svg, png_path=png_path)


def _new_fig():
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    return fig, ax


def throughput_figure(tune: dict, png_dir: Path | None) -> Figure:
    """Throughput against b_m (log2 axis), the knee, the fastest fitting point and the tolerance band."""
    pts = [p for p in tune.get("points", []) if not p.get("oom") and p.get("throughput")]
    ooms = [p for p in tune.get("points", []) if p.get("oom")]
    pts.sort(key=lambda p: p["micro_batch"])
    fig, ax = _new_fig()
    xs = [p["micro_batch"] for p in pts]
    ys = [p["throughput"] for p in pts]
    ax.plot(xs, ys, "o-", color="#4C78A8", label="measured")
    if ys:
        best = max(ys)
        tol = float(tune.get("tolerance") or 0.0)
        rule = tune.get("rule", "")
        ref = max(best, float(tune.get("reference_throughput") or 0.0))
        if ref > best:
            ax.axhline(ref, color="#F58518", ls="--", lw=1, label=f"bound on larger b_m ({ref:,.0f})")
        if tol > 0 and rule == "fraction":
            mu = float(tune.get("bound_margin") or 0.0)
            what = ("the bound" if ref > best else "best") + (f", {mu:.0%} margin" if mu else "")
            ax.axhspan(
                ref * (1 - tol) * (1 + mu),
                ref,
                color="#4C78A8",
                alpha=0.12,
                label=f"within {tol:.0%} of {what}",
            )
        elif tol > 0:
            ax.axhspan(best * (1 - tol), best, color="#4C78A8", alpha=0.12, label=f"best − {tol:.0%}")
    knee = tune.get("micro_batch")
    if knee is not None and tune.get("throughput"):
        ax.plot([knee], [tune["throughput"]], "*", ms=18, color="#E45756", label=f"knee b_m = {knee}")
    ff = tune.get("fastest_fitting") or {}
    if ff.get("micro_batch") is not None and ff.get("throughput") and ff.get("micro_batch") != knee:
        ax.plot(
            [ff["micro_batch"]],
            [ff["throughput"]],
            "D",
            ms=9,
            color="#54A24B",
            label=f"fastest that fits b_m = {ff['micro_batch']}",
        )
    for p in ooms:
        ax.axvline(p["micro_batch"], color="#999999", ls=":", lw=1)
    if ooms:
        ax.plot([], [], ls=":", color="#999999", label="out of memory")
    if xs and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch b_m")
    unit = "tokens/s" if tune.get("mode", "train") else "items/s"
    ax.set_ylabel(f"throughput ({unit})")
    ax.set_title(f"Throughput against micro-batch — {tune.get('model', '')} {tune.get('mode', '')}".strip())
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return _save(fig, f"throughput-{tune.get('mode', 'train')}", "Throughput and the knee", png_dir)


def memory_figure(tune: dict, png_dir: Path | None) -> Figure:
    """Peak memory against b_m: measured points, the linear fit and the budget line."""
    pts = [p for p in tune.get("points", []) if p.get("peak_memory_bytes") and not p.get("oom")]
    pts.sort(key=lambda p: p["micro_batch"])
    fig, ax = _new_fig()
    gib = 2**30
    xs = [p["micro_batch"] for p in pts]
    ys = [p["peak_memory_bytes"] / gib for p in pts]
    ax.plot(xs, ys, "o", color="#4C78A8", label="measured peak")
    fit = tune.get("memory_fit") or {}
    budget = tune.get("memory_budget_bytes")
    mf = tune.get("max_fitting_micro_batch")
    # Show the fit up to the largest fitting b_m, but no further than 4× the largest probe.
    top = min(max(xs + [mf or 0, 1]), 4 * max(xs + [1]))
    if fit.get("slope_bytes_per_sample") is not None and fit.get("intercept_bytes") is not None:
        line_x = [0, top * 1.1]
        line_y = [(fit["intercept_bytes"] + fit["slope_bytes_per_sample"] * x) / gib for x in line_x]
        ax.plot(
            line_x,
            line_y,
            "-",
            color="#F58518",
            label=f"fit: {fit['intercept_bytes'] / gib:.2f} GiB + {fit['slope_bytes_per_sample'] / 2**20:.1f} MiB × b_m",
        )
    if mf and mf > top:
        ax.plot([], [], " ", label=f"largest predicted to fit: {mf} (off the chart)")
    if budget and budget / gib < 2 * max(ys + [fit.get("intercept_bytes", 0) / gib]):
        ax.axhline(budget / gib, color="#E45756", ls="--", label=f"budget {budget / gib:.2f} GiB")
    elif budget:
        ax.plot([], [], " ", label=f"budget {budget / gib:.2f} GiB (off the chart)")
    if mf and mf <= top:
        ax.axvline(mf, color="#E45756", ls=":", lw=1, label=f"largest predicted to fit: {mf}")
    ax.set_xlabel("micro-batch b_m")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title("Peak memory is linear in b_m")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return _save(fig, f"memory-{tune.get('mode', 'train')}", "Memory against micro-batch", png_dir)


def _timeline_rows(timeline: Any) -> list[list[dict]]:
    """Normalise a timeline to rows (one per rank) of {start, end, kind, microbatch}.

    Accepts rows per rank (lists of dicts or of ``(start, end, kind, microbatch)`` tuples), a
    dict keyed by rank, or one flat list of dicts that carry ``rank`` (``pipeline --json``),
    with times as ``start``/``end`` or ``start_s``/``end_s`` and the kind as ``kind`` or ``label``.
    """

    def norm(it: Any) -> dict:
        if isinstance(it, dict):
            return {
                "start": float(it.get("start", it.get("start_s", 0.0))),
                "end": float(it.get("end", it.get("end_s", 0.0))),
                "kind": str(it.get("kind", it.get("label", "F"))),
                "microbatch": it.get("microbatch", ""),
            }
        return {"start": float(it[0]), "end": float(it[1]), "kind": str(it[2]), "microbatch": it[3]}

    if isinstance(timeline, dict):
        timeline = [timeline[k] for k in sorted(timeline, key=lambda k: int(k))]
    timeline = list(timeline or [])
    if timeline and isinstance(timeline[0], dict) and "rank" in timeline[0]:
        n = 1 + max(int(it["rank"]) for it in timeline)
        rows: list[list[dict]] = [[] for _ in range(n)]
        for it in timeline:
            rows[int(it["rank"])].append(norm(it))
        return rows
    return [[norm(it) for it in row] for row in timeline]


def bubble_figure(rows: list[list[dict]], title: str, name: str, png_dir: Path | None) -> Figure:
    """Stages as rows, time as columns, a block per F/B/I/W of each micro-batch, idle as gaps."""
    fig, ax = _new_fig()
    makespan = max((it["end"] for r in rows for it in r), default=1.0)
    for rank, row in enumerate(rows):
        for it in row:
            kind = str(it.get("kind", "F"))[:1].upper()
            ax.barh(
                rank,
                it["end"] - it["start"],
                left=it["start"],
                height=0.8,
                color=KIND_COLOURS.get(kind, "#888888"),
                edgecolor="white",
                linewidth=0.5,
            )
            if (it["end"] - it["start"]) / makespan > 0.025:
                ax.text(
                    (it["start"] + it["end"]) / 2,
                    rank,
                    f"{kind}{it.get('microbatch', '')}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {i}" for i in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time")
    ax.set_title(title)
    from matplotlib.patches import Patch

    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    present = {str(it.get("kind", ""))[:1].upper() for r in rows for it in r}
    handles = [Patch(color=c, label=names[k]) for k, c in KIND_COLOURS.items() if k in present]
    ax.legend(handles=handles, loc="lower right", fontsize=8, ncol=4)
    fig.tight_layout()
    return _save(fig, name, title, png_dir)


# --------------------------------------------------------------------------------------
# HTML


def _name(x: Any) -> str:
    """The ``name`` of a model or GPU given as a dict (plan JSON), or the value itself."""
    return str(x.get("name", "")) if isinstance(x, dict) else str(x or "")


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], highlight: int | None = None) -> str:
    out = [
        "<div class='wide'><table><thead><tr>"
        + "".join(f"<th>{_esc(h)}</th>" for h in headers)
        + "</tr></thead><tbody>"
    ]
    for i, r in enumerate(rows):
        cls = ' class="pick"' if highlight is not None and i == highlight else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _gib(b: Any) -> str:
    return "—" if b is None else f"{b / 2**30:.2f} GiB"


def _pct(x: Any) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _num(x: Any, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1000px;color:#222;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem} h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
p.lead{color:#555;margin-top:0} table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:right} th{background:#f4f4f4}
tr.pick td{background:#fff4d6;font-weight:600} figure{margin:1rem 0} figcaption{font-size:.85rem;color:#555}
pre{background:#f6f8fa;padding:.6rem;overflow-x:auto;font-size:.8rem} .answer{font-size:1.1rem;background:#eef6ee;padding:.6rem;border-radius:6px}
svg{max-width:100%;height:auto} .wide{overflow-x:auto;max-width:100%}
"""


@dataclass
class Report:
    """What :func:`build_report` wrote."""

    html_path: Path
    png_paths: list[Path] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)


def _tune_section(t: dict, png_dir: Path | None, figs: list[Figure]) -> str:
    parts = [
        f"<h2>Measured: {_esc(t.get('model', ''))} — {_esc(t.get('mode', 'train'))} on {_esc(t.get('device', ''))}</h2>"
    ]
    ff = t.get("fastest_fitting") or {}
    parts.append(
        f"<p class='answer'>Knee: <b>b_m = {_esc(t.get('micro_batch'))}</b> at {_num(t.get('throughput'))} "
        f"({_pct(t.get('fraction_of_best'))} of best, peak {_gib(t.get('peak_memory_bytes'))}). "
        f"Fastest that fits: b_m = {_esc(ff.get('micro_batch'))} at {_num(ff.get('throughput'))}, "
        f"peak {_gib(ff.get('peak_memory_bytes'))}. Rule: {_esc(t.get('rule'))}, tolerance {_esc(t.get('tolerance'))}"
        + (
            f", against the bound {_num(t.get('reference_throughput'))} on any larger b_m "
            f"({_pct(t.get('fraction_of_reference'))} of it)."
            if (
                t.get("throughput_bound")
                and (t.get("reference_throughput") or 0) > (ff.get("throughput") or 0)
            )
            else "."
        )
        + (f" g = {_esc(t.get('grad_accum'))} for the global batch." if t.get("grad_accum") else "")
        + "</p>"
    )
    for fig in (throughput_figure(t, png_dir), memory_figure(t, png_dir)):
        figs.append(fig)
        parts.append(
            f"<figure id='fig-{fig.name}'>{fig.svg}<figcaption>{_esc(fig.title)}</figcaption></figure>"
        )
    rows = []
    for p in sorted(t.get("points", []), key=lambda p: p["micro_batch"]):
        rows.append(
            [
                p["micro_batch"],
                "OOM" if p.get("oom") else _num(p.get("throughput")),
                _num(p.get("step_time_s"), "{:.4f}"),
                _gib(p.get("peak_memory_bytes")),
            ]
        )
    parts.append(_table(["b_m", "throughput", "step (s)", "peak memory"], rows))
    return "".join(parts)


def _plan_section(plan: dict) -> str:
    rec = plan.get("recommended") or {}
    cands = plan.get("candidates", [])
    parts = [
        f"<h2>Plan: {_esc(_name(plan.get('model')))} on {_esc(_name(plan.get('gpu')))}, "
        f"p = {_esc(plan.get('pipeline_parallel', 1))}, d = {_esc(plan.get('data_parallel', 1))}, "
        f"t = {_esc(plan.get('tensor_parallel', 1))}, global batch {_esc(plan.get('global_batch', ''))}</h2>"
    ]
    if rec:
        parts.append(
            f"<p class='answer'>Recommended: b_m = <b>{_esc(rec.get('micro_batch'))}</b>, m = {_esc(rec.get('microbatches'))}, "
            f"{_esc(rec.get('schedule'))}"
            + (f" (v = {_esc(rec.get('virtual'))})" if (rec.get("virtual") or 1) > 1 else "")
            + f", recompute {_esc(rec.get('recompute'))}, ZeRO {_esc(rec.get('zero'))}: bubble {_pct(rec.get('bubble_fraction'))}, "
            f"peak {_gib(rec.get('peak_memory_bytes'))}, step {_num(rec.get('step_time_s'), '{:.3f}')} s, MFU {_pct(rec.get('mfu'))}.</p>"
        )
    for key in ("reasons", "explanation", "lints", "warnings"):
        val = plan.get(key) or rec.get(key)
        if val:
            items = val if isinstance(val, list) else [val]
            parts.append(
                "<ul>"
                + "".join(f"<li>{_esc(v if isinstance(v, str) else v.get('message', v))}</li>" for v in items)
                + "</ul>"
            )
    shown = sorted(cands, key=lambda c: (not c.get("fits", True), c.get("step_time_s") or 1e300))[:15]
    hi = next(
        (
            i
            for i, c in enumerate(shown)
            if all(
                c.get(k) == rec.get(k) for k in ("micro_batch", "schedule", "recompute", "zero", "virtual")
            )
        ),
        None,
    )
    rows = [
        [
            c.get("micro_batch"),
            c.get("microbatches"),
            c.get("schedule"),
            c.get("virtual"),
            c.get("recompute"),
            c.get("zero"),
            _pct(c.get("bubble_fraction")),
            _gib(c.get("peak_memory_bytes")),
            "yes" if c.get("fits") else "no",
            _num(c.get("step_time_s"), "{:.3f}"),
            _num(c.get("tokens_per_s")),
            _pct(c.get("mfu")),
        ]
        for c in shown
    ]
    parts.append(
        _table(
            [
                "b_m",
                "m",
                "schedule",
                "v",
                "recompute",
                "ZeRO",
                "bubble",
                "peak memory",
                "fits",
                "step (s)",
                "tokens/s",
                "MFU",
            ],
            rows,
            hi,
        )
    )
    parts.append(_exports_section(plan))
    return "".join(parts)


def _exports_section(plan: dict) -> str:
    try:
        from microbatch.show import export
    except ImportError:  # pragma: no cover - export lands with the planner
        return ""
    blocks = []
    for fmt in getattr(export, "FORMATS", ("deepspeed", "hf", "lightning", "torchtitan")):
        try:
            text = export.export_plan(plan, fmt).text()
        except Exception as e:  # a plan that one trainer cannot express: say so, keep the rest
            text = f"# not exportable: {e}"
        blocks.append(f"<h3>{_esc(fmt)}</h3><pre>{_esc(text)}</pre>")
    return "<h2>Configs to paste</h2>" + "".join(blocks) if blocks else ""


def _pipeline_section(res: dict, png_dir: Path | None, figs: list[Figure], idx: int) -> str:
    meas, pred = res.get("measured", {}), res.get("predicted", {})
    parts = [
        f"<h2>Pipeline run: {_esc(res.get('schedule'))}, p = {_esc(res.get('stages'))}, m = {_esc(res.get('microbatches'))}</h2>"
    ]
    rows = [["bubble fraction", _pct(pred.get("bubble_fraction")), _pct(meas.get("bubble_fraction"))]]
    pif = pred.get("peak_in_flight") or []
    for i, s in enumerate(meas.get("stage_stats", [])):
        rows.append(
            [f"in flight, rank {s.get('stage', i)}", pif[i] if i < len(pif) else "—", s.get("peak_in_flight")]
        )
    parts.append(_table(["", "predicted", "measured"], rows))
    if res.get("gradients_match") is not None:
        parts.append(
            f"<p>Gradients match the unsplit model: <b>{_esc(res.get('gradients_match'))}</b> "
            f"(largest relative error {_num(res.get('max_grad_rel_error'), '{:.2e}')}).</p>"
        )
    for key, title in (("timeline", "measured"), ("predicted_timeline", "predicted")):
        tl = meas.get("timeline") if key == "timeline" else pred.get("timeline")
        if tl is None:
            tl = res.get(key)
        if tl:
            fig = bubble_figure(
                _timeline_rows(tl),
                f"Bubble diagram, {title} — {res.get('schedule')}",
                f"bubble-{title}-{idx}",
                png_dir,
            )
            figs.append(fig)
            parts.append(
                f"<figure id='fig-{fig.name}'>{fig.svg}<figcaption>{_esc(fig.title)}</figcaption></figure>"
            )
    return "".join(parts)


def _simulate_section(res: dict, png_dir: Path | None, figs: list[Figure], idx: int) -> str:
    parts = [
        f"<h2>Simulated: {_esc(res.get('schedule'))}, p = {_esc(res.get('stages'))}, m = {_esc(res.get('microbatches'))}</h2>",
        f"<p>Bubble fraction {_pct(res.get('bubble_fraction'))} (idle over total stage time); "
        f"peak in flight per rank {_esc(res.get('peak_in_flight'))}.</p>",
    ]
    tl = res.get("timeline") or res.get("intervals")
    if tl:
        fig = bubble_figure(
            _timeline_rows(tl),
            f"Bubble diagram, simulated — {res.get('schedule')}",
            f"bubble-sim-{idx}",
            png_dir,
        )
        figs.append(fig)
        parts.append(
            f"<figure id='fig-{fig.name}'>{fig.svg}<figcaption>{_esc(fig.title)}</figcaption></figure>"
        )
    return "".join(parts)


def _validate_section(res: dict) -> str:
    rows = res.get("rows", [])
    if not rows:
        return ""
    headers = list(rows[0].keys())
    body = []
    for r in rows:
        body.append([(_num(r[h], "{:.3g}") if isinstance(r[h], float) else r[h]) for h in headers])
    return (
        "<h2>Predicted against measured</h2>"
        + _table(headers, body)
        + (f"<p>{_esc(res.get('summary'))}</p>" if res.get("summary") else "")
    )


def build_report(
    results: Sequence[tuple[str, dict]] | Sequence[dict],
    out_path: str | Path,
    *,
    title: str = "microbatch report",
    png: bool = True,
) -> Report:
    """Write the HTML report (and PNG figures beside it) from saved results."""
    out = Path(out_path)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"report path {str(out)!r} must end in .html; for example --out report.html")
    items = [(classify(r), r) if isinstance(r, dict) else r for r in results]
    png_dir = out.with_name(out.stem + "-figures") if png else None
    figs: list[Figure] = []
    sections: list[str] = []
    body: list[str] = []
    order = {"tune": 0, "plan": 1, "simulate": 2, "pipeline": 3, "validate": 4}
    for i, (kind, res) in enumerate(sorted(items, key=lambda kr: order.get(kr[0], 9))):
        if kind == "tune":
            body.append(_tune_section(res, png_dir, figs))
        elif kind == "plan":
            body.append(_plan_section(res))
        elif kind == "pipeline":
            body.append(_pipeline_section(res, png_dir, figs, i))
        elif kind == "simulate":
            body.append(_simulate_section(res, png_dir, figs, i))
        elif kind == "validate":
            body.append(_validate_section(res))
        sections.append(kind)
    doc = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{_esc(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{_esc(title)}</h1>"
        "<p class='lead'>B_global = b_m × g × d. The global batch is a statistical choice; the micro-batch is a "
        "physical one. Bubble fractions are idle time over total stage time.</p>"
        + "".join(body)
        + "</body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    return Report(html_path=out, png_paths=[f.png_path for f in figs if f.png_path], sections=sections)
