"""``microbatch pipeline``: run pipeline-parallel training and compare the bubble with the prediction."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from microbatch._json import dumps
from microbatch.commands._common import (
    check_batch_bound,
    emit,
    force_option,
    json_option,
    progress,
    stages_option,
    width_option,
)
from microbatch.envelope import ERROR_KINDS
from microbatch.measure.device import exit_past_teardown
from microbatch.schedules.registry import schedule_names

if TYPE_CHECKING:
    from microbatch.run.pipeline.config import PipelineConfig
    from microbatch.run.pipeline.report import BeforeRun, PipelineReport
    from microbatch.run.pipeline.resolved import ResolvedRun

__all__ = ["cmd"]


@click.command("pipeline")
@stages_option(default=2)
@click.option(
    "--microbatches", "-m", type=int, default=4, show_default=True, help="m: micro-batches per step."
)
@click.option(
    "--schedule",
    default="1f1b",
    show_default=True,
    help="A schedule torch runs: "
    + ", ".join(schedule_names(torch=True))
    + " (aliases: "
    + ", ".join(a for a in schedule_names(torch=True, aliases=True) if a not in schedule_names())
    + "). zb-h1 has no torch class of its own: torch runs it as its interleaved zero-bubble class "
    "(ScheduleInterleavedZeroBubble) with one stage per rank, under that class's rule on m.",
)
@click.option(
    "--virtual",
    "-v",
    type=int,
    default=None,
    help="v: stages per rank (default 1; zbv and dualpipev: 2). p·v stages need p·v <= the model's layers "
    "(a built-in model: its blocks + 2, the embedding and the head).",
)
@click.option(
    "--model",
    default="tiny",
    show_default=True,
    help="A built-in preset (tiny, small, gpt2, llama-2-7b, ...: every preset of microbatch.model, if it fits "
    "the host's memory and the deadline) or module:function: a function of an importable module (every rank "
    "imports it) that takes no arguments and returns the same nn.Module on every call (it is seeded with "
    "--seed), a stack of layers — nn.Sequential, or embed/layers/head — that starts with an nn.Embedding and "
    "maps token ids (b, s) to logits (b, s, V).",
)
@click.option(
    "--global-batch",
    "-B",
    type=int,
    default=None,
    callback=check_batch_bound,
    help="B: sequences per optimizer step, a multiple of m (each micro-batch holds B/m; default m).",
)
@click.option("--seq", type=int, default=None, help="s: tokens per sequence (default: the model's).")
@click.option(
    "--steps",
    type=int,
    default=3,
    show_default=True,
    help="N optimizer steps (the first warms up). The measured bubble is the mean over the rest, "
    "shown with its standard error: on a shared CPU one step's bubble moves by several points, so "
    "give more steps (e.g. 30 on a small model) to compare it with the prediction.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="The weights' dtype on every rank (a factory's model is cast to it: a bf16 factory runs in float32 "
    "unless given here); host memory and the gradient check's tolerance follow it.",
)
@click.option(
    "--backend",
    type=click.Choice(["gloo", "nccl"]),
    default="gloo",
    show_default=True,
    help="torch.distributed backend: gloo (CPU processes) or nccl (one GPU per rank).",
)
@click.option(
    "--balance",
    type=click.Choice(["params", "time"]),
    default="params",
    show_default=True,
    help="Split layers by parameter count or by measured per-layer time.",
)
@click.option(
    "--check-gradients",
    is_flag=True,
    help="Compare gradients with the unsplit model after step 1; a mismatch exits 1 (dropout in training "
    "mode draws other masks in the reference, so it cannot match).",
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
    help="Seconds each collective of the process group (gloo) may wait for a peer, at least 10; a local run "
    "is killed after this plus 60 s of start-up in all, and one whose compute cannot finish by then is refused.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the weights (the same on every rank) and of the synthetic token batches, 0 to 2^32 − 1.",
)
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
@width_option
@click.option(
    "--predict/--no-predict",
    "predict_first",
    default=True,
    show_default=True,
    help="Predict bubble and step time before the run: a one-process profile of the stages and a short "
    "calibration run of the runtime (on the CPU a second one loaded like the real stages, up to about 10 s "
    "of stage work: tiny 1F1B p = 2 took 22 s in all on an idle 2-core VM, 7.5 s without, 2026-12-01). "
    "Progress lines go to stderr; Ctrl-C keeps the steps every rank finished (exit 130).",
)
@force_option
@json_option
def cmd(
    stages: int,
    microbatches: int,
    schedule: str,
    virtual: int | None,
    model: str,
    global_batch: int | None,
    seq: int | None,
    steps: int,
    dtype: str,
    backend: str,
    balance: str,
    check_gradients: bool,
    trace: str | None,
    timeout_s: float,
    seed: int,
    svg_path: str | None,
    png_path: str | None,
    width: int,
    predict_first: bool,
    force: bool,
    as_json: bool,
) -> None:
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
    from microbatch.commands._common import check_output_file
    from microbatch.commands._schedule_inputs import given_virtual, virtual_note
    from microbatch.run.pipeline.config import PipelineConfig
    from microbatch.run.pipeline.launch import under_torchrun
    from microbatch.schedules.registry import get_spec
    from microbatch.schedules.virtual import virtual_in_effect

    spec = get_spec(schedule)  # the schedule asked (zb-h1 keeps its rule and name; torch's class runs it)
    virtual, note = virtual_in_effect(spec, given_virtual(virtual))  # a V holds exactly two per rank
    notes = virtual_note(note, "pipeline") + _runs_as_note(spec.name)
    # every output path is checked before any process starts
    check_output_file(trace, "--trace", (".json",), force=force)
    check_output_file(svg_path, "--svg", (".svg",), force=force)
    check_output_file(png_path, "--png", (".png",), force=force)
    cfg = PipelineConfig(
        schedule=spec.name,
        stages=stages,
        microbatches=microbatches,
        virtual=virtual,
        model=model,
        global_batch=global_batch,
        seq=seq,
        steps=steps,
        dtype=dtype,
        backend=backend,
        balance=balance,
        check_gradients=check_gradients,
        timeout_s=timeout_s,
        seed=seed,
    )
    external = under_torchrun()
    report = replace(_run(cfg, external, predict_first), notes=notes)
    _note_uncalibrated(report, cfg)
    if report.interrupted:
        why = "the deadline passed" if report.stop_reason else "Ctrl-C or SIGTERM"
        notes.append(
            f"interrupted ({why}) after {report.steps} of {report.steps_asked} steps: the figures are "
            "those of the steps every rank finished"
        )
    title = f"measured {report.schedule}: p = {stages}, m = {microbatches}" + (
        f", v = {virtual}" if virtual > 1 else ""
    )
    # a file that cannot be written after the run: the result is kept, printed and saved beside
    failed = not _write_outputs(report, title, trace, svg_path, png_path)
    _emit(report, failed, as_json, width)
    _end(report, external, failed)


def _note_uncalibrated(report: PipelineReport, cfg: PipelineConfig) -> None:
    """Say what the figures are (:func:`~microbatch.run.pipeline.summary.figure_notes`), and why the memory
    table has no uncalibrated prediction, where it has none."""
    from microbatch.run.pipeline.memory import uncalibrated_gap
    from microbatch.run.pipeline.resolved import resolve
    from microbatch.run.pipeline.summary import figure_notes

    report.notes.extend(figure_notes(report))
    if not report.memory or any(row.uncalibrated_bytes is not None for row in report.memory):
        return
    why = uncalibrated_gap(resolve(cfg), list(report.layers_per_stage))
    if why:
        report.notes.append(
            f"no uncalibrated memory prediction: {why}; the calibrated one walks torch's order"
        )


def _runs_as_note(name: str) -> list[str]:
    """A note where the schedule asked runs as another entry's torch class (zb-h1)."""
    from microbatch.schedules.registry import get_spec, torch_spec

    if get_spec(name).run_as is None:
        return []
    runner = torch_spec(name)
    return [
        f"{name} has no torch class of its own: torch runs it as its {runner.name} class {runner.torch_name} "
        f"with one stage per rank, whose order is {name}'s"
    ]


def _end(report: PipelineReport, external: bool, failed: bool) -> None:
    """Exit 130 after an interrupted run, 1 after a failed gradient check or when an output could not be written
    (a torchrun rank too, past the interpreter's teardown: the status its JSON's ``kind`` says)."""
    from microbatch.commands._common import progress

    ended = _failure(report, failed)
    if ended is not None:
        progress(ended[1] if ended[0] == 130 else f"error: {ended[1]}")
    if external:
        exit_past_teardown(0 if ended is None else ended[0])
    if ended is not None:
        raise click.exceptions.Exit(ended[0])


def _emit(report: PipelineReport, failed: bool, as_json: bool, width: int) -> None:
    """Print the report; where the command will exit non-zero (:func:`_failure`) the JSON keeps the whole result
    with ``error`` and ``kind`` beside it."""
    from microbatch.commands._common import use_color
    from microbatch.show.pipeline_report import render

    out = report.to_json()
    ended = _failure(report, failed)
    if ended is not None:
        out["error"], out["kind"] = ended[1], ERROR_KINDS[ended[0]]
    emit(out, as_json, lambda: render(report, width, color=use_color(), no_predict="--no-predict"))


def _failure(report: PipelineReport, failed: bool) -> tuple[int, str] | None:
    """(exit status, why) when the command ends non-zero: 130 after an interrupted run, 1 after a run past its
    deadline (its steps kept), a failed gradient check or an output that could not be written (``failed``; the
    first such note); None when it succeeded."""
    if report.interrupted:
        kept = f"kept the {report.steps} step(s) of {report.steps_asked} every rank finished"
        return (1, f"{report.stop_reason}; {kept}") if report.stop_reason else (130, f"interrupted: {kept}")
    if report.gradients_match is False:  # a failed check: the whole result is printed
        return 1, (
            f"the gradients do not match the unsplit model (largest relative error "
            f"{report.max_grad_rel_error:.2e}, tolerance {report.grad_tolerance:.1e})"
        )
    if failed:
        return 1, next(
            (n for n in report.notes if n.startswith("could not write")), "an output could not be written"
        )
    return None


def _write_outputs(
    report: PipelineReport, title: str, trace: str | None, svg_path: str | None, png_path: str | None
) -> bool:
    """Write the Chrome trace, SVG and PNG asked for, each recorded in ``report.outputs``; False when
    one could not be written (noted in ``report.notes``, and the whole result kept beside)."""
    from microbatch.show.pipeline_report import chrome_trace, measured_rows_ms

    ok = True
    if trace:
        ok &= _write(report, "trace", trace, lambda: dumps(_marked_trace(chrome_trace(report))))
    rows_ms = measured_rows_ms(report)
    if svg_path:
        from microbatch.envelope import mark_line
        from microbatch.show.text import timeline_svg

        ok &= _write(
            report,
            "svg",
            svg_path,
            lambda: (
                mark_line("pipeline", comment="<!--")
                + "\n"
                + timeline_svg(rows_ms, None, title=title, time_unit="ms")
            ),
        )
    if png_path:
        from microbatch.show.text import save_timeline_png

        try:
            save_timeline_png(rows_ms, None, png_path, title=title, time_unit="ms")
            report.outputs["png"] = str(png_path)
        except OSError as e:
            report.notes.append(f"could not write --png {png_path} ({e}); the result is printed below")
            ok = False
    if not ok:  # the whole result is kept beside, in the temporary folder
        from microbatch.commands._common import keep_beside

        kept = keep_beside(report.to_json(), "pipeline")
        report.notes.append(f"the whole result is kept in {kept}")
    return ok


def _run(cfg: PipelineConfig, external: bool, predict_first: bool) -> PipelineReport:
    """The report of this rank under torchrun (rank 0; the other ranks end here), else of the local run.
    The config is resolved here, once, and the resolved run handed to both."""
    from microbatch.run.pipeline.resolved import resolve

    run = resolve(cfg)
    if external:
        from microbatch.run.pipeline.launch import run_external

        report = run_external(run)
        if report is None:  # not rank 0: rank 0 prints
            exit_past_teardown()
        return report
    return _run_local(run, predict_first)


def _run_local(run: ResolvedRun, predict_first: bool) -> PipelineReport:
    """The prediction (``predict_first``) and the run of ``cfg`` in local ranks, with a progress line
    on stderr at each phase. A Ctrl-C in the run returns the report of the steps every rank finished,
    marked ``interrupted`` (``steps_asked``: the steps asked for); one before any such step says where
    it came and is raised again (exit 130)."""
    from microbatch.commands._pipeline_lines import PipelineLines
    from microbatch.run.pipeline.launch import run_resolved
    from microbatch.run.pipeline.progress import PipelineDeadline, PipelineInterrupted, announce, progress_to
    from microbatch.run.pipeline.signals import raise_on_sigterm

    lines = PipelineLines()
    before: BeforeRun | None = None
    # SIGTERM is an interrupt in every phase (calibration, checks), not only the run
    restore = raise_on_sigterm()
    with progress_to(lines):
        try:
            announce("check")
            if predict_first:
                from microbatch.run.pipeline.before_run import predict_resolved

                before = predict_resolved(run)
                _say_past_deadline(run.cfg, before.step_time_s)
            announce("run")
            report = run_resolved(run)
        except PipelineInterrupted as e:
            if lines.phase != "run" or e.report is None:
                raise KeyboardInterrupt(lines.interrupted(e, run.cfg.steps)) from None
            report = replace(e.report, interrupted=True, steps_asked=e.asked)
        except PipelineDeadline as e:  # a failure, with the steps every rank finished
            report = replace(e.report, interrupted=True, steps_asked=e.asked, stop_reason=str(e))
        except KeyboardInterrupt:
            raise KeyboardInterrupt(lines.interrupted(None, run.cfg.steps)) from None
        finally:
            restore()
    return report if before is None else replace(report, before_run=before)


def _say_past_deadline(cfg: Any, step_s: float) -> None:
    """Say, before the ranks start, when the prediction just made puts the steps past the deadline: the run goes ahead
    (the prediction may be wrong, and the steps finished by then are kept), but nobody waits the deadline out unwarned.
    The check made before any work refuses only what compute alone cannot finish (a bound, not a prediction)."""
    deadline, _ = cfg.deadline()
    total = step_s * cfg.steps
    if total > deadline:
        progress(
            f"pipeline: the prediction puts {cfg.steps} steps at {total:.3g} s ({step_s * 1e3:.3g} ms each), past "
            f"the {deadline:.0f} s deadline (--timeout {cfg.timeout_s:g} + start-up): the ranks will be stopped there "
            f"and the steps finished kept; lower --steps to about {max(1, int(deadline / step_s * 0.8))} or raise "
            "--timeout"
        )


def _marked_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """The Chrome trace with the mark first (its ``otherData``, which trace viewers show and otherwise
    ignore): a later run may replace the file (:func:`microbatch.envelope.is_ours`)."""
    from microbatch.envelope import mark_line

    other = {"written_by": mark_line("pipeline", comment="").strip(), **trace.get("otherData", {})}
    return {"otherData": other, **{k: v for k, v in trace.items() if k != "otherData"}}


def _write(report: PipelineReport, key: str, path: str, text: Any) -> bool:
    """Write ``text()`` to ``path`` and record it in ``report.outputs[key]``; on failure add a note and
    return False (the run's result is never lost to a late error)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before the run
        with open(path, "w") as f:
            f.write(text())
    except OSError as e:
        report.notes.append(f"could not write --{key} {path} ({e.strerror or e})")
        return False
    report.outputs[key] = str(path)
    return True
