"""``microbatch pipeline``: run pipeline-parallel training and compare the bubble with the prediction."""

from __future__ import annotations

import click

from microbatch.commands._common import dumps, emit, json_option, stages_option


@click.command("pipeline")
@stages_option(default=2)
@click.option(
    "--microbatches", "-m", type=int, default=4, show_default=True, help="m: micro-batches per step."
)
@click.option(
    "--schedule",
    default="1f1b",
    show_default=True,
    help="gpipe, 1f1b, interleaved-1f1b, zb-interleaved (torch's ZB1P) or zbv (zero-bubble V).",
)
@click.option("--virtual", "-v", type=int, default=None, help="v: stages per rank (default 1; zbv: 2).")
@click.option(
    "--model", default="tiny", show_default=True, help="Built-in model (tiny, small) or module:function."
)
@click.option(
    "--global-batch", "-B", type=int, default=None, help="B: sequences per optimizer step (default m)."
)
@click.option("--seq", type=int, default=None, help="s: tokens per sequence (default: the model's).")
@click.option(
    "--steps", type=int, default=3, show_default=True, help="N optimizer steps (the first warms up)."
)
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option(
    "--balance",
    type=click.Choice(["params", "time"]),
    default="params",
    show_default=True,
    help="Split layers by parameter count or by measured per-layer time.",
)
@click.option(
    "--check-gradients", is_flag=True, help="Compare gradients with the unsplit model after step 1."
)
@click.option(
    "--trace", type=click.Path(dir_okay=False), default=None, help="Write the timeline as a Chrome trace."
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds before a stuck run is killed.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--svg",
    "svg_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw the measured timeline as SVG.",
)
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw the measured timeline as PNG.",
)
@click.option("--width", type=int, default=100, show_default=True, help="Columns of the terminal diagrams.")
@json_option
def cmd(
    stages,
    microbatches,
    schedule,
    virtual,
    model,
    global_batch,
    seq,
    steps,
    backend,
    balance,
    check_gradients,
    trace,
    timeout_s,
    seed,
    svg_path,
    png_path,
    width,
    as_json,
):
    """Split a model into p stages, train it N steps under torch's pipeline schedule and measure.

    \b
    Prints the measured bubble (idle share of p × step time) beside the simulator's prediction fed
    with the measured per-stage times, busy/idle time, in-flight micro-batches and saved-activation
    bytes per rank, and with --check-gradients the largest relative gradient error against the
    unsplit model. Starts p local processes (gloo on the CPU); under torchrun it runs as one rank:
      torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST --master-port 29500 \\
          -m microbatch pipeline --stages 2 --microbatches 8 --schedule 1f1b
    Example: microbatch pipeline --stages 2 --microbatches 8 --schedule 1f1b --check-gradients
    """
    from microbatch.run.launch import run_external, run_pipeline, under_torchrun
    from microbatch.run.pipeline import PipelineConfig, schedule_name
    from microbatch.show.pipeline_report import chrome_trace

    name = schedule_name(schedule)
    if virtual is None:
        virtual = 2 if name == "zbv" else 1
    cfg = PipelineConfig(
        schedule=name,
        stages=stages,
        microbatches=microbatches,
        virtual=virtual,
        model=model,
        global_batch=global_batch,
        seq=seq,
        steps=steps,
        backend=backend,
        balance=balance,
        check_gradients=check_gradients,
        timeout_s=timeout_s,
        seed=seed,
    )
    external = under_torchrun()
    if external:
        report = run_external(cfg)
        if report is None:  # not rank 0: rank 0 prints
            _exit_rank()
    else:
        report = run_pipeline(cfg)
    if trace:
        with open(trace, "w") as f:
            f.write(dumps(chrome_trace(report)))
        report["trace"] = str(trace)
    rows_ms = _rows_ms(report)
    title = f"measured {report['schedule']}: p = {stages}, m = {microbatches}" + (
        f", v = {virtual}" if virtual > 1 else ""
    )
    if svg_path:
        from microbatch.show.text import save_timeline_svg

        save_timeline_svg(rows_ms, None, svg_path, title=title, time_unit="ms")
        report["svg"] = str(svg_path)
    if png_path:
        from microbatch.show.text import save_timeline_png

        save_timeline_png(rows_ms, None, png_path, title=title, time_unit="ms")
        report["png"] = str(png_path)
    emit(report, as_json, lambda: render(report, width))
    if external:
        _exit_rank()


def _exit_rank() -> None:
    """End a torchrun rank now that its work is done and written.

    Native threads that torch's gloo and pipelining runtime leave behind can abort the process at
    interpreter shutdown ("terminate called without an active exception", exit -6) after a
    successful run, which torchrun would report as a failure; the local workers end the same way.
    """
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rows_ms(report: dict) -> list[list[tuple[float, float, str, int]]]:
    """The measured last step as per-rank rows for :mod:`microbatch.show.text`, in milliseconds."""
    from microbatch.show.pipeline_report import timeline_rows

    return [[(a * 1e3, e * 1e3, lab, i) for a, e, lab, i in row] for row in timeline_rows(report)]


def _pred_rows_ms(report: dict) -> list[list[tuple[float, float, str, int]]]:
    rows: list[list[tuple[float, float, str, int]]] = [[] for _ in range(report["stages"])]
    for it in report["predicted_timeline"]:
        rows[it["rank"]].append((it["start_s"] * 1e3, it["end_s"] * 1e3, it["label"], it["microbatch"]))
    return rows


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def render(report: dict, width: int = 100) -> str:
    from microbatch.commands.bubble import use_color
    from microbatch.show.text import render_timeline_text

    m, p, v = report["measured"], report["predicted"], report["virtual"]
    lines = [
        f"pipeline {report['schedule']}: p = {report['stages']} ranks, m = {report['microbatches']} micro-batches"
        + (f", v = {v} stages per rank" if v > 1 else "")
        + f"; model {report['model']}, B = {report['global_batch']}, b_m = {report['micro_batch']}, "
        f"layers per stage {report['layers_per_stage']}",
        f"  {report['measured_steps']} measured step(s) of {report['steps']} on {report['device']} (torch "
        f"{report['torch_version']})",
        "",
        "                       measured   predicted",
        f"  bubble (idle share)   {m['bubble_fraction']:7.1%}     {p['bubble_fraction']:7.1%}",
        f"  step time             {m['step_time_s'] * 1e3:7.2f} ms  {p['step_time_s'] * 1e3:7.2f} ms",
        f"  with the measured hand-off latency ({p['with_comm']['comm_time_s'] * 1e3:.2f} ms per cross-rank "
        f"input): bubble {p['with_comm']['bubble_fraction']:.1%}, step {p['with_comm']['step_time_s'] * 1e3:.2f} ms",
        "",
        "  rank  stages     busy ms   idle ms  in flight (pred)  act/µbatch   peak act",
    ]
    for st, pif in zip(m["stage_stats"], p["peak_in_flight"], strict=True):
        lines.append(
            f"  {st['stage']:>4}  {','.join(map(str, st['virtual_stages'])):<9} {st['busy_s'] * 1e3:8.2f}  "
            f"{st['idle_s'] * 1e3:8.2f}  {st['peak_in_flight']:>6g} ({pif:g})      "
            f"{_fmt_bytes(st['activation_bytes_per_microbatch']):>10}  {_fmt_bytes(st['peak_activation_bytes']):>9}"
            + (f"  cuda peak {_fmt_bytes(st['cuda_peak_bytes'])}" if st.get("cuda_peak_bytes") else "")
        )
    span_ms = max(m["step_time_s"], p["step_time_s"]) * 1e3  # one scale for both diagrams
    color = use_color()
    lines += ["", "measured (last step; times from the first op)"]
    lines.append(
        render_timeline_text(
            _rows_ms(report), span_ms, width=width, color=color, legend=False, time_unit="ms"
        )
    )
    lines += ["predicted (simulator, measured op times, no communication time)"]
    lines.append(
        render_timeline_text(_pred_rows_ms(report), span_ms, width=width, color=color, time_unit="ms")
    )
    if report["gradients_match"] is not None:
        verdict = "match" if report["gradients_match"] else "DO NOT MATCH"
        lines += [
            "",
            f"  gradients {verdict} the unsplit model: largest relative error "
            f"{report['max_grad_rel_error']:.2e} (tolerance {report['grad_tolerance']:.0e})",
        ]
    if report.get("trace"):
        lines.append(
            f"  Chrome trace written to {report['trace']} (open in chrome://tracing or ui.perfetto.dev)"
        )
    for key in ("svg", "png"):
        if key in report:
            lines.append(f"  wrote {report[key]}")
    return "\n".join(lines)
