"""The HTML report's sections, one per kind of result, each with its figures.

Each function takes one result (the JSON object a command prints with ``--json``) and returns
its HTML, and, where it draws, the :class:`~microbatch.show.figures.Figure` objects it made
(saved as PNG in ``png_dir`` when given). The plan's own section stays in
:mod:`microbatch.show.html`, beside the page that assembles them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from microbatch.records_fields import throughput_unit
from microbatch.show import export
from microbatch.show.figures import (
    FIGURE_DPI,
    FIGURE_SIZE_IN,
    Figure,
    memory_figure,
    render_figure,
    throughput_figure,
    timeline_figure,
)
from microbatch.show.html_parts import (
    SOURCE,
    bytes_column,
    esc,
    figure_html,
    mem,
    name_of,
    num,
    pct,
    seconds_column,
    table,
)
from microbatch.show.pipeline_report import shared_span_ms
from microbatch.show.recommendation import detail_lines
from microbatch.show.timeline import MAX_CHART_ACTIONS, Row, normalize_rows
from microbatch.show.validation import validation_cell
from microbatch.units import format_bytes, format_count

__all__ = [
    "human_header",
    "Section",
    "tune_section",
    "exports_section",
    "comparison_section",
    "pipeline_section",
    "simulate_section",
    "validate_section",
    "summary_section",
]

Section = tuple[str, list[Figure]]
"""A section's HTML and the figures it drew."""

_MS_PER_S = 1e3


def tune_section(t: dict[str, Any], png_dir: Path | None, kind: str = "tune", idx: int = 0) -> Section:
    """A measured curve (``tune``, or ``recommend`` on measurements made elsewhere): the answer and
    how the search stopped (interrupted, a probe past its time limit), the throughput and memory
    figures (named ``throughput-<mode>-<idx>``, ``memory-<mode>-<idx>``: ``idx`` is the result's
    place on the page, so two curves never share a file), and the table of points; a result without
    points (``recommend``), the table of its choice."""
    if kind == "tune":
        where = t.get("device_name") or t.get("device", "")
        head = f"Measured: {esc(name_of(t.get('model')))} — {esc(t.get('mode', 'train'))} on {esc(where)}" + (
            f" ({esc(t['device'])})" if t.get("device_name") and t.get("device") else ""
        )
    else:
        head = "Recommended from measurements"
    if t.get("interrupted"):
        head += " — interrupted"
    unit = throughput_unit(t)
    parts = [f"<h2>{head}</h2>", _knee_answer(t, unit), _details(t, unit), _stopped(t)]
    figs: list[Figure] = []
    points = t.get("points") or []
    if points:
        mode = re.sub(r"[^A-Za-z0-9_-]", "_", str(t.get("mode", "train")))  # an id and a file name
        figs = [
            render_figure(
                throughput_figure(t), f"throughput-{mode}-{idx}", "Throughput and the knee", png_dir
            ),
            render_figure(memory_figure(t), f"memory-{mode}-{idx}", "Memory against micro-batch", png_dir),
        ]
        parts += [figure_html(f) for f in figs]
        pts = sorted(points, key=lambda p: p["micro_batch"])
        parts.append(
            _points_table(
                [[p["micro_batch"], "OOM" if p.get("oom") else num(p.get("throughput"))] for p in pts],
                pts,
                first=("b_m", f"throughput ({unit})"),
            )
        )
    else:
        chosen = [("knee", t), ("fastest that fits", t.get("fastest_fitting") or {})]
        parts.append(
            _points_table(
                [[what, p.get("micro_batch"), num(p.get("throughput"))] for what, p in chosen],
                [p for _, p in chosen],
                first=("", "b_m", f"throughput ({unit})"),
            )
        )
    return "".join(parts), figs


def _knee_answer(t: dict[str, Any], unit: str) -> str:
    """The knee, the fastest that fits, the rule, and g where a global batch was given."""
    ff = t.get("fastest_fitting") or {}
    bounded = t.get("throughput_bound") and (t.get("reference_throughput") or 0) > (ff.get("throughput") or 0)
    fastest = (  # a file without it (hand-made, or older) says nothing of it rather than "b_m = None"
        f"Fastest that fits: b_m = {esc(ff.get('micro_batch'))} at {num(ff.get('throughput'))} {unit}, "
        f"peak {mem(ff.get('peak_memory_bytes'))}. "
        if ff.get("micro_batch") is not None
        else ""
    )
    rule = (
        f"Rule: {esc(t.get('rule'))}, tolerance {num(t.get('tolerance'), '{:g}')}"
        if t.get("rule")
        else "Rule: not recorded"
    )
    return (
        f"<p class='answer'>Knee: <b>b_m = {esc(t.get('micro_batch'))}</b> at {num(t.get('throughput'))} {unit} "
        f"({pct(t.get('fraction_of_best'))} of best, peak {mem(t.get('peak_memory_bytes'))}). "
        f"{fastest}{rule}"
        + (
            f", against the bound {num(t.get('reference_throughput'))} {unit} on any larger b_m "
            f"({pct(t.get('fraction_of_reference'))} of it)."
            if bounded
            else "."
        )
        + (f" g = {esc(t.get('grad_accum'))} for the global batch." if t.get("grad_accum") else "")
        + _left_out(t)
        + "</p>"
    )


def _details(t: dict[str, Any], unit: str) -> str:
    """What qualifies the knee, as the text says it (:func:`~microbatch.show.recommendation.detail_lines`: a curve
    not flattened, a bound no b_m reached, b_m the noise cannot tell apart, the largest predicted to fit) and the
    result's notes; "" when there is nothing, or the result lacks the choice's fields (a hand-made file)."""
    try:
        lines = detail_lines(t, unit, left_out=False) if "fastest_fitting" in t else []
    except (KeyError, TypeError):
        lines = []
    lines += [f"note: {n}" for n in t.get("notes") or []]
    if not lines:
        return ""
    return "<ul class='details'>" + "".join(f"<li>{esc(line)}</li>" for line in lines) + "</ul>"


def _left_out(t: dict[str, Any]) -> str:
    """`` Left out: b_m 8, 16 (step time over 0.36 ms).`` for the measured b_m the choice did not consider, as the
    text says them; "" when none."""
    reasons: dict[str, list[str]] = {}
    for item in t.get("left_out") or []:
        if isinstance(item, dict):
            reasons.setdefault(str(item.get("why")), []).append(str(item.get("micro_batch")))
    return "".join(f" Left out: b_m {esc(', '.join(b))} ({esc(why)})." for why, b in reasons.items())


def _stopped(t: dict[str, Any]) -> str:
    """How the search ended: interrupted (the knee is of the points measured so far) and why it stopped
    (the search's own words: a settled knee, a probe past its time limit, out of memory...)."""
    text = ""
    if t.get("interrupted"):
        n = len([p for p in t.get("points") or [] if not p.get("oom")])
        text += (
            f"<b>Interrupted</b> after {n} measured point{'s' if n != 1 else ''}: the knee is chosen from "
            "the points measured so far, not from a finished search. "
        )
    if t.get("stop_reason"):
        text += f"Stopped: {esc(str(t['stop_reason']).rstrip('.'))}."
    return f"<p class='stopped'>{text.strip()}</p>" if text else ""


def _points_table(
    rows: list[list[Any]],
    pts: list[dict[str, Any]],
    first: tuple[str, ...],
) -> str:
    """``rows`` with each point's step time and peak memory, in one unit per column chosen by the
    magnitude of the column (ms under a second, MiB under a GiB), so distinct values read distinct."""
    unit, steps = seconds_column([p.get("step_time_s") for p in pts])
    peaks = bytes_column([p.get("peak_memory_bytes") for p in pts])
    return table(
        [*first, f"step ({unit})", "peak memory"],
        [[*r, step, peak] for r, step, peak in zip(rows, steps, peaks, strict=True)],
    )


def exports_section(plan: dict[str, Any]) -> str:
    """The plan's recommendation as each trainer's configuration, ready to paste."""
    blocks = []
    for fmt in export.FORMATS:
        try:
            text = export.export_plan(plan, fmt).text()
        except Exception as e:  # a plan that one trainer cannot express: say so, keep the rest
            text = f"# not exportable: {e}"
        blocks.append(f"<h3>{esc(fmt)}</h3><pre>{esc(text)}</pre>")
    return "<h2>Configs to paste</h2>" + "".join(blocks) if blocks else ""


def comparison_section(res: dict[str, Any]) -> str:
    """The table of a multi-accelerator ``plan`` (``plan --gpu a,b``): one row per accelerator."""
    from microbatch.show.plan_report import comparison_rows

    records = [r for r in res.get("comparison") or [] if isinstance(r, dict)]
    if not records:
        return ""
    headers, *rows = comparison_rows(records)
    return "<h2>Plans compared across accelerators</h2>" + table(headers, rows)


def _uses_seconds(timeline: Any) -> bool:
    """Whether a timeline's items give their times as ``start_s``/``end_s`` (seconds)."""
    items: Any = timeline.values() if isinstance(timeline, dict) else timeline
    for it in items or []:
        if isinstance(it, dict):
            return "start_s" in it
        if isinstance(it, (list, tuple)) and it and isinstance(it[0], dict):
            return "start_s" in it[0]
    return False


def _zeroed(rows: list[list[Row]], scale: float) -> list[list[Row]]:
    """``rows`` shifted to start at 0 and multiplied by ``scale``."""
    t0 = min((r[0] for rank in rows for r in rank), default=0.0)
    return [[((a - t0) * scale, (e - t0) * scale, lab, mb) for a, e, lab, mb in rank] for rank in rows]


def _bubble(
    rows: list[list[Row]], span: float, unit: str, title: str, name: str, png_dir: Path | None
) -> Figure:
    fig = timeline_figure(rows, span, title=title, time_unit=unit, size_in=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    return render_figure(fig, name, title, png_dir)


def _pipeline_memory(res: dict[str, Any]) -> str:
    """Each rank's peak activation memory measured against the prediction (calibrated on the run's own kept bytes,
    and the uncalibrated one), as the text report shows it, and the host's memory where the run read it."""
    ranks = [r for r in res.get("memory") or [] if isinstance(r, dict)]
    if not ranks:
        return ""
    rows = [
        [r.get("rank"), mem(r.get("measured_peak_bytes")), mem(r.get("predicted_bytes")),
         signed_pct(r.get("error_pct")), mem(r.get("uncalibrated_bytes")), signed_pct(r.get("uncalibrated_error_pct"))]
        for r in ranks
    ]  # fmt: skip
    host = res.get("host_memory") or {}
    line = (
        f"<p>Host memory: measured {mem(host.get('measured_bytes'))}, predicted {mem(host.get('predicted_bytes'))} "
        f"({signed_pct(host.get('error_pct'))}).</p>"
        if host.get("measured_bytes") is not None
        else ""
    )
    headers = ["rank", "activations measured", "predicted", "error", "uncalibrated", "error"]
    return "<h3>Activation memory by rank</h3>" + table(headers, rows) + line


def signed_pct(v: Any) -> str:
    """A percentage already in percent, signed (``-3.6%``); a dash for none."""
    return f"{v:+.1f}%" if isinstance(v, (int, float)) and not isinstance(v, bool) else "—"


def pipeline_section(res: dict[str, Any], png_dir: Path | None, idx: int) -> Section:
    """A pipeline run: the bubble predicted before the run, replayed with the run's op times and
    measured (± its standard error over steps), the in-flight counts, the gradient check, and the
    measured and predicted bubble charts on one time scale."""
    meas, pred = res.get("measured", {}), res.get("predicted", {})
    stopped = " — interrupted" if res.get("interrupted") else ""
    parts = [
        f"<h2>Pipeline run: {esc(res.get('schedule'))}, p = {esc(res.get('stages'))}, "
        f"m = {esc(res.get('microbatches'))}{stopped}</h2>",
        f"<p>{esc(name_of(res.get('model')))} on {esc(res.get('device') or 'an unnamed device')}, "
        f"{esc(res.get('measured_steps', res.get('steps')))} measured steps"
        + (f" of {esc(res.get('steps_asked'))} asked" if res.get("steps_asked") else "")
        + (f", torch {esc(res.get('torch_version'))}" if res.get("torch_version") else "")
        + (f"; stopped: {esc(res.get('stop_reason') or res.get('error'))}" if stopped else "")
        + ".</p>",
    ]
    before = res.get("before_run") or {}
    replay = pred.get("with_comm") or pred
    se = meas.get("bubble_se")
    measured = pct(meas.get("bubble_fraction")) + ("" if se is None else f" ± {100 * se:.1f} pt")
    rows: list[list[Any]] = [
        ["bubble fraction", pct(before.get("bubble_fraction")), pct(replay.get("bubble_fraction")), measured]
    ]
    pif = pred.get("peak_in_flight") or []
    for i, s in enumerate(meas.get("stage_stats", [])):
        rows.append(
            [
                f"in flight (counted), rank {s.get('stage', i)}",
                "—",
                pif[i] if i < len(pif) else "—",
                s.get("counted_in_flight", s.get("peak_in_flight")),
            ]
        )
    steps = [before.get("step_time_s"), replay.get("step_time_s"), meas.get("step_time_s")]
    if any(isinstance(s, (int, float)) for s in steps):
        unit, shown = seconds_column(steps)
        rows.insert(1, [f"step time ({unit})", *shown])
    parts.append(table(["", "before the run", "replay (measured op times)", "measured"], rows))
    if se is not None:
        parts.append(
            f"<p>Measured: the mean over {esc(len(meas.get('bubble_steps') or []))} steps after the first, "
            "± its standard error.</p>"
        )
    parts.append(_pipeline_memory(res))
    if res.get("gradients_match") is not None:
        parts.append(
            f"<p>Gradients match the unsplit model: <b>{esc(res.get('gradients_match'))}</b> "
            f"(largest relative error {num(res.get('max_grad_rel_error'), '{:.2e}')}).</p>"
        )
    timelines = []
    for key, what in (("timeline", "measured"), ("predicted_timeline", "predicted")):
        tl = (meas if key == "timeline" else pred).get("timeline")
        if tl is None:
            tl = res.get(key)
        if tl:
            seconds = _uses_seconds(tl)
            timelines.append((what, _zeroed(normalize_rows(tl), _MS_PER_S if seconds else 1.0), seconds))
    # one time axis for both charts, as the terminal report draws them: 0 to the latest end over
    # both timelines (shared_span_ms), in ms when the result gives seconds
    span = shared_span_ms(*(rws for _, rws, _ in timelines)) or 1.0
    without = pred.get("bubble_fraction")
    titles = {
        "measured": "measured (last step)",
        "predicted": "predicted (replay of the measured op times, the hand-offs not drawn"
        + (f": bubble {pct(without)})" if isinstance(without, (int, float)) else ")"),
    }
    figs = [
        _bubble(
            rws,
            span,
            "ms" if seconds else res.get("time_unit", ""),
            f"Bubble diagram, {titles[what]} — {res.get('schedule')}",
            f"bubble-{what}-{idx}",
            png_dir,
        )
        for what, rws, seconds in timelines
    ]
    parts += [figure_html(f) for f in figs]
    return "".join(parts), figs


def _in_flight(values: Any) -> str:
    """Per-rank in-flight counts as the terminal writes them (at most 16 ranks shown), or as given if not a list."""
    from microbatch.show.text import in_flight_text

    ok = isinstance(values, list) and all(isinstance(v, int | float) for v in values)
    return in_flight_text(values) if ok else str(values)


def simulate_section(res: dict[str, Any], png_dir: Path | None, idx: int) -> Section:
    """A simulated schedule: the bubble fraction, in-flight counts and its bubble chart."""
    parts = [
        f"<h2>Simulated: {esc(res.get('schedule'))}, p = {esc(res.get('stages'))}, "
        f"m = {esc(res.get('microbatches'))}</h2>",
        f"<p>Bubble fraction {pct(res.get('bubble_fraction'))} (idle over total stage time); "
        f"peak in flight per rank, rank 0 first: {esc(_in_flight(res.get('peak_in_flight')))}.</p>",
    ]
    figs: list[Figure] = []
    tl = res.get("timeline") or res.get("intervals")
    drawn = normalize_rows(tl) if tl else []  # whatever form the file holds them in
    ops = sum(len(rank) for rank in drawn)
    if ops > MAX_CHART_ACTIONS:  # a report of a 1,000,000-op file took 99 s and made a 217 MB page
        parts.append(
            f"<p>Its {ops:,} ops are not drawn (over {MAX_CHART_ACTIONS:,}); simulate a smaller m or p to see "
            "the shape.</p>"
        )
        tl = None
    if tl:
        forward = (res.get("times") or {}).get("forward")
        # one forward time, or a stage's each (--stage-times): the unit is then the first stage's forward
        staged = isinstance(forward, list)
        first = forward[0] if staged and forward else forward
        name = "stage 0's forward" if staged else "forward"
        unit = res.get("time_unit") or (
            f"{name} = {first:g}" if isinstance(first, int | float) and first else ""
        )
        rows = _zeroed(drawn, 1.0)
        span = max((r[1] for rank in rows for r in rank), default=1.0)
        figs.append(
            _bubble(
                rows,
                span,
                unit,
                f"Bubble diagram, simulated — {res.get('schedule')}",
                f"bubble-sim-{idx}",
                png_dir,
            )
        )
        parts.append(figure_html(figs[0]))
    else:  # simulate writes its intervals only when asked: say why no diagram is drawn
        parts.append(
            "<p>No bubble diagram: this result holds no timeline (simulate writes one when asked for its intervals; "
            "run it again so to draw one here).</p>"
        )
    return "".join(parts), figs


def validate_section(res: dict[str, Any]) -> str:
    """Predicted against measured, row by row, with the summary."""
    rows = res.get("rows", [])
    if not rows:
        return ""
    keys = list(rows[0].keys())
    body = [[validation_cell(h, r.get(h)) for h in keys] for r in rows]  # the text table's digits
    warned = [w for w in (res.get("warnings") or []) + (res.get("notes") or []) if isinstance(w, str)]
    return (
        "<h2>Predicted against measured</h2>"
        + table([human_header(k) for k in keys], body)
        + (f"<p>{esc(res.get('summary'))}</p>" if res.get("summary") else "")
        + ("<ul>" + "".join(f"<li>{esc(w)}</li>" for w in dict.fromkeys(warned)) + "</ul>" if warned else "")
    )


_WORDS = {"mem": "memory", "uncal": "uncalibrated", "cal": "calibrated", "loo": "leave-one-out",
          "err": "error", "micro": "micro-", "ms": "(ms)", "MiB": "(MiB)", "%": "(%)", "fit": "fit on"}  # fmt: skip


def human_header(key: str) -> str:
    """A column header in words: ``mem_uncal_err_%`` → ``memory uncalibrated error (%)``."""
    key = {"mem_MiB": "mem_measured_MiB", "step_ms": "step_measured_ms"}.get(key, key)
    words = [_WORDS.get(w, w) for w in key.split("_")]
    return " ".join(words).replace("micro- ", "micro-").replace("micro-batch", "b_m")


_SKIP = {"command", "version", SOURCE}
_MAX_ROWS = 50


def _cell(key: str, v: Any) -> str:
    """One value of a generic table: bytes in binary units (a key ending ``_bytes``, or a breakdown under ``memory``),
    floats short, flat lists joined, nested ones as JSON, nothing as a dash."""
    if v is None:
        return "—"
    if key in _BYTE_MAPS and isinstance(v, dict):
        return ", ".join(f"{k} {_cell(k + '_bytes', x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list)) for x in v):
        import json

        return json.dumps(v)
    if key.endswith("_bytes") and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format_bytes(v)
    if (
        key in ("params", "total_params", "active_params")
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
    ):
        return format_count(int(v))  # 81.9 M, not 8.191e+07
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and all(not isinstance(x, (dict, list)) for x in v):
        return ", ".join(str(x) for x in v)
    if isinstance(v, dict):
        return name_of(v) if "name" in v else ", ".join(f"{k} {_cell(k, x)}" for k, x in v.items())
    return str(v)


_BYTE_MAPS = ("memory", "activation_terms")
"""The keys whose mapping holds bytes by part (``memory``'s weights, gradients ...; the activations' terms)."""


def _header(key: str) -> str:
    """A generic table's column or field name, the JSON's key less a ``_bytes`` its values no longer are in:
    ``peak_memory_bytes`` (shown in GiB or MiB) is ``peak_memory``."""
    return key.removesuffix("_bytes")


def summary_section(kind: str, res: dict[str, Any]) -> str:
    """Any other command's result: its fields as a table (bytes in binary units), and each list of
    records (per-stage memory, per-rank statistics) as a table of its own."""
    fields = [[_header(k), _cell(k, v)] for k, v in res.items() if k not in _SKIP and not _is_records(v)]
    parts = [f"<h2>{esc(kind)}</h2>", table(["field", "value"], fields)]
    for k, v in res.items():
        if k in _SKIP or not _is_records(v):
            continue
        headers = list(dict.fromkeys(h for r in v[:_MAX_ROWS] for h in r))
        parts.append(f"<h3>{esc(k)}</h3>")
        rows = [[_cell(h, r.get(h, "—")) for h in headers] for r in v[:_MAX_ROWS]]
        parts.append(table([_header(h) for h in headers], rows))
    return "".join(parts)


def _is_records(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)
