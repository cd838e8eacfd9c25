"""A pipeline run drawn: the report as text with both timelines, and the timeline as a Chrome trace.

The report itself is data, built in :mod:`microbatch.run.pipeline.summary`; this module only
formats it (:func:`render`), converts its timelines to rows for :mod:`microbatch.show.text`
(:func:`measured_rows_ms`, :func:`predicted_rows_ms`) and writes the Chrome trace
(:func:`chrome_trace`).
"""

from __future__ import annotations

from typing import Any

from microbatch.run.pipeline.report import BeforeRun, PipelineReport
from microbatch.run.pipeline.summary import timeline_rows
from microbatch.show.text import render_timeline_text
from microbatch.units import format_bytes

__all__ = ["chrome_trace", "measured_rows_ms", "predicted_rows_ms", "render", "shared_span_ms"]


def measured_rows_ms(report: PipelineReport) -> list[list[tuple[float, float, str, int]]]:
    """The measured last step as per-rank rows for :mod:`microbatch.show.text`, in milliseconds."""
    return [[(a * 1e3, e * 1e3, lab, i) for a, e, lab, i in row] for row in timeline_rows(report)]


def predicted_rows_ms(report: PipelineReport) -> list[list[tuple[float, float, str, int]]]:
    """The simulator's prediction as per-rank rows for :mod:`microbatch.show.text`, in milliseconds."""
    rows: list[list[tuple[float, float, str, int]]] = [[] for _ in range(report.stages)]
    for it in report.predicted_timeline:
        rows[it.rank].append((it.start_s * 1e3, it.end_s * 1e3, it.label, it.microbatch))
    return rows


def shared_span_ms(*timelines: list[list[tuple[float, float, str, int]]]) -> float:
    """The end of the latest op over every timeline (ms from 0): the one span that timelines drawn
    together share, so that a column means the same time in each (terminal, SVG, HTML)."""
    return max((e for rows in timelines for row in rows for _, e, _, _ in row), default=0.0)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n, digits=1)


def render(
    report: PipelineReport, width: int = 100, *, color: bool = False, no_predict: str = "predict=False"
) -> str:
    """The report of :func:`microbatch.run.pipeline.summary.summarize` as text: measured beside
    predicted, a table per rank, both timelines on one time scale, the gradient check. ``no_predict``
    names the setting that skipped the prediction before the run, in the caller's words."""
    m, p, v = report.measured, report.predicted, report.virtual
    lines = [
        f"pipeline {report.schedule}: p = {report.stages} ranks, m = {report.microbatches} micro-batches"
        + (f", v = {v} stages per rank" if v > 1 else "")
        + f"; model {report.model}, B = {report.global_batch}, b_m = {report.micro_batch}, "
        f"layers per stage {report.layers_per_stage}",
        f"  {report.measured_steps} measured step(s) of {report.steps} on {report.device} (torch "
        f"{report.torch_version})",
        "",
    ]
    b = report.before_run
    pw = p.with_comm
    lines += [
        "                       before the run   replay (measured ops)   measured",
        f"  bubble (idle share)   {_pct(b.bubble_fraction if b else None):>14}   {pw.bubble_fraction:>21.1%}   "
        f"{m.bubble_fraction:>8.1%}"
        + (f" ± {m.bubble_se * 100:.1f} pt (standard error over steps)" if m.bubble_se is not None else ""),
        f"  step time             {_ms(b.step_time_s if b else None):>14}   {_ms(pw.step_time_s):>21}   "
        f"{_ms(m.step_time_s):>8}",
        _before_line(b) if b else f"  before the run: not predicted ({no_predict})",
        f"  replay: the simulator on torch's order with this run's op times and hand-off "
        f"{pw.comm_time_s * 1e3:.2f} ms (without it: bubble {p.bubble_fraction:.1%})",
        "",
        "  rank  stages     busy ms   idle ms  counted in flight (sim)  act/µbatch",
    ]
    for st, pif in zip(m.stage_stats, p.peak_in_flight, strict=True):
        lines.append(
            f"  {st.stage:>4}  {','.join(map(str, st.virtual_stages)):<9} {st.busy_s * 1e3:8.2f}  "
            f"{st.idle_s * 1e3:8.2f}  {st.counted_in_flight:>10g} ({pif:g})         "
            f"{_bytes(st.activation_bytes_per_microbatch):>10}"
            + (f"  cuda peak {_bytes(st.cuda_peak_bytes)}" if st.cuda_peak_bytes else "")
        )
    lines += [
        "",
        "  activation memory per rank: measured = peak of saved storages alive; predicted = torch's order walked",
        "  with each stage's saved bytes per micro-batch (calibrated) and predict/memory's formula (uncalibrated)",
        "  rank   measured  predicted  error   uncalibrated  error   host peak",
    ]
    for row in report.memory:
        err = "-" if row.error_pct is None else f"{row.error_pct:+.1f}%"
        uerr = "-" if row.uncalibrated_error_pct is None else f"{row.uncalibrated_error_pct:+.1f}%"
        lines.append(
            f"  {row.rank:>4}  {_bytes(row.measured_peak_bytes):>9}  {_bytes(row.predicted_bytes):>9}  "
            f"{err:>6}  {_bytes(row.uncalibrated_bytes):>12}  {uerr:>6}  {_bytes(row.host_peak_bytes):>10}"
        )
    measured_rows, predicted_rows = measured_rows_ms(report), predicted_rows_ms(report)
    span_ms = shared_span_ms(measured_rows, predicted_rows)
    same = {"width": width, "color": color, "time_unit": "ms", "origin": 0.0, "fill_width": True}
    lines += ["", "measured (last step; ms from the barrier before step(); both diagrams on one time scale)"]
    lines.append(render_timeline_text(measured_rows, span_ms, legend=False, **same))  # type: ignore[arg-type]
    lines += [
        "replay (the simulator on the measured op times, without the hand-off time the column above adds)"
    ]
    lines.append(render_timeline_text(predicted_rows, span_ms, **same))  # type: ignore[arg-type]
    if report.gradients_match is not None:
        verdict = "match" if report.gradients_match else "DO NOT MATCH"
        lines += [
            "",
            f"  gradients {verdict} the unsplit model: largest relative error "
            f"{report.max_grad_rel_error:.2e} (tolerance {report.grad_tolerance:.1e})",
        ]
    if report.outputs.get("trace"):
        lines.append(
            f"  Chrome trace written to {report.outputs['trace']} (open in chrome://tracing or ui.perfetto.dev)"
        )
    for key in ("svg", "png"):
        if key in report.outputs:
            lines.append(f"  wrote {report.outputs[key]}")
    lines += [f"  note: {n}" for n in report.notes]
    return "\n".join(lines)


def chrome_trace(report: PipelineReport) -> dict[str, Any]:
    """The measured timeline of the last step as a Chrome trace (``chrome://tracing``, Perfetto):
    one process per rank, one thread per stage, one complete event per F/B/I/W, and a counter of
    the micro-batches in flight on each rank."""
    events: list[dict[str, Any]] = []
    for r in range(report.stages):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    for it in report.timeline:
        events.append(
            {
                "name": f"{it.kind}{it.microbatch}",
                "cat": it.kind,
                "ph": "X",
                "pid": it.rank,
                "tid": it.stage,
                "ts": it.start_s * 1e6,
                "dur": (it.end_s - it.start_s) * 1e6,
                "args": {"stage": it.stage, "microbatch": it.microbatch},
            }
        )
    # in-flight micro-batches per rank as a counter track: +1 at a forward's end, -1 at the end of
    # the last part of its backward (B, or W when the backward is split)
    split = any(it.kind == "W" for it in report.timeline)
    last = "W" if split else "B"
    for r in range(report.stages):
        steps = sorted(
            (it.end_s, 1 if it.kind == "F" else -1)
            for it in report.timeline
            if it.rank == r and it.kind in ("F", last)
        )
        held = 0
        for t, d in steps:
            held += d
            events.append(
                {"name": "in flight", "ph": "C", "pid": r, "ts": t * 1e6, "args": {"micro-batches": held}}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _before_line(b: BeforeRun) -> str:
    """The measured runtime terms behind the prediction made before the run, on one line."""
    rt = b.runtime
    if not rt:
        return (
            f"  before the run: one-process profile + runtime overhead {_ms(b.overhead_s)} per action and "
            f"hand-off {_ms(b.comm_time_s)} (calibration run)"
        )
    how = (
        "a calibration run whose stages load the cores as the real ones (terms as latency)"
        if rt.get("loaded")
        else "a calibration run"
    )
    return (
        f"  before the run: one-process profile + from {how}: after a send "
        f"{_ms(rt['after_send_s']['fwd'])} fwd / {_ms(rt['after_send_s']['bwd'])} bwd, after a local op "
        f"{_ms(rt['after_local_s'])}, hand-off {_ms(rt['hop_s']['fwd'])} fwd / {_ms(rt['hop_s']['bwd'])} bwd"
    )
