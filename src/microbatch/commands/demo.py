"""``microbatch demo``: the whole story on the CPU in about a minute, ending in the HTML report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from microbatch.commands._common import check_out_dir, emit, json_option
from microbatch.commands._outputs import keep_result
from microbatch.interrupts import first_interrupt_only
from microbatch.units import GIB

__all__ = ["cmd"]

DEMO_BUDGET_BYTES = 4 * GIB
"""The memory budget of the demo's tunes on the CPU (it fits the built-in small models)."""


def _step(quiet: bool, text: str) -> float:
    if not quiet:
        click.echo(click.style(f"\n▶ {text}", bold=True), err=True)
    return time.perf_counter()


def _done(quiet: bool, t0: float, text: str) -> None:
    if not quiet:
        click.echo(f"  {text}  ({time.perf_counter() - t0:.1f} s)", err=True)


def _save(out: Path, name: str, obj: dict[str, Any], summary: dict[str, Any]) -> Path:
    """Write ``obj`` as ``<command> --json`` prints it (the envelope): ``tune-train.json`` → tune; where --out cannot
    be written now (the disk filled, the folder was locked) it is kept beside (a temporary file) and said, and the
    demo goes on: a late write error lost the minutes measured before it. ``summary["saved"]`` names it once written
    in --out (what an interrupt tells from a file of the same name this run did not write)."""
    path, why = keep_result(out / name, obj, command=name.removesuffix(".json").split("-")[0])
    if why:
        click.echo(f"note: {why}", err=True)
    elif "saved" in summary:
        summary["saved"].append(name)
    return path


DEMO_FILES = ("tune-train.json", "tune-decode.json", "plan.json", "simulate-gpipe.json", "simulate-1f1b.json",
              "pipeline.json", "validate.json", "report.html")  # fmt: skip
"""The files the demo writes in --out: each replaced only when it is one of ours."""


@click.command("demo")
@click.option(
    "--out",
    "out_dir",
    default="microbatch-demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the saved results, the figures and report.html.",
)
@click.option(
    "--model",
    "model_name",
    default="small",
    show_default=True,
    help="Built-in model to tune and run for real on the CPU.",
)
@click.option("--quick", is_flag=True, help="Smaller sweeps (for tests): fewer probes, shorter timing.")
@json_option
def cmd(out_dir: str, model_name: str, quick: bool, as_json: bool) -> None:
    """Tune a built-in small GPT for training and decoding, plan a 4-stage pipeline for
    Llama-3-8B on H100s, simulate GPipe against 1F1B, run a real 2-stage pipeline,
    and write one HTML report. Runs on the CPU in about a minute on 2 cores (57-75 s as the load varies).

    Every result is also saved as JSON in --out, so `microbatch report` can rebuild the
    report and scripts can read the numbers.
    """
    from microbatch.show.html import build_report

    quiet = False  # progress on stderr with --json too (stdout holds the one JSON document): it was silent 30-60 s
    _check_model_fits(model_name)  # an unknown or too large model fails here, before any work
    # made and written to before any work (no result lost at the end); no file of the user's in it replaced
    out = check_out_dir(out_dir, files=DEMO_FILES)
    results: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"out": str(out), "saved": []}  # the files this run wrote, by name
    t_start = time.perf_counter()

    phases: tuple[tuple[str, Callable[[], None]], ...] = (
        ("tune", lambda: _tune_both(out, model_name, quick, quiet, results, summary)),
        ("plan", lambda: _plan_llama(out, quiet, results, summary)),
        ("simulate", lambda: _simulate_gpipe_and_1f1b(out, quiet, results, summary)),
        ("pipeline", lambda: _run_small_pipeline(out, model_name, quiet, results, summary)),
        ("validate", lambda: _validate_training(out, quiet, results, summary)),
    )
    with first_interrupt_only():  # a second Ctrl-C must not lose the report of what the first one kept
        for phase, run in phases:
            try:
                run()
            except KeyboardInterrupt:  # a later phase stopped: the report and summary of those before it
                summary.update(interrupted=True, interrupted_in=phase)
            if summary.get("interrupted"):  # Ctrl-C ends the tune's search early; the demo stops there too
                _stop(out, quiet, results, summary, as_json)
        # 6. Show: one self-contained HTML report.
        t0 = _step(quiet, "write the report")
        try:
            rep = build_report(results, out / "report.html", title="microbatch demo")
        except KeyboardInterrupt:  # every result is saved: say so, and how to build the report from them
            summary.update(interrupted=True, interrupted_in="the report")
            _stop(out, quiet, results, summary, as_json, report=False)
    summary.pop("saved")
    summary["report"] = str(rep.html_path)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    _done(quiet, t0, f"{len(rep.png_paths)} figures")
    emit(
        summary,
        as_json,
        lambda: (
            f"\nreport: {rep.html_path.resolve()}\n(all results as JSON in {out}/; "
            f"total {summary['seconds']} s)"
        ),
    )


def _stop(
    out: Path, quiet: bool, results: list[dict[str, Any]], summary: dict[str, Any], as_json: bool,
    report: bool = True,
) -> NoReturn:  # fmt: skip
    """Interrupted: the report of what was measured (each result is already saved; ``report`` False: interrupted
    while writing it, the files this run saved named for ``microbatch report``), the summary, exit 130. Files of the
    demo's names in --out that this run did not write (an earlier run's, or the user's) are named, not removed:
    ``report out/*.json`` mixed them in without a word."""
    import shlex

    from microbatch.show.html import build_report

    saved = summary.pop("saved")
    others = [
        n for n in DEMO_FILES if (out / n).is_file() and n not in saved and (report or n != "report.html")
    ]
    if others:
        summary["not_this_run"] = others
    if report:
        rep = build_report(results, out / "report.html", title="microbatch demo (interrupted)")
        summary["report"] = str(rep.html_path)
        said = f"\nreport of what was measured: {rep.html_path.resolve()}"
    else:
        paths = " ".join(shlex.quote(str(out / n)) for n in saved)
        said = f"\nno report written; build it from this run's results: microbatch report {paths}"
    if others:
        said += f"\n{out} also holds {', '.join(others)}, not written by this run: leave them out of a report of it"
    emit(summary, as_json, lambda: said)
    if not quiet:
        click.echo(
            f"interrupted during {summary['interrupted_in']}: kept "
            f"{'its points and ' if str(summary['interrupted_in']).startswith('tune') else ''}the results before it in "
            f"{out}/; the steps after it did not run",
            err=True,
        )
    raise click.exceptions.Exit(130)


def _check_model_fits(model_name: str) -> None:
    """Refuse an unknown model, or one whose training state the demo's budget cannot hold."""
    from microbatch.choose.tune.preflight import static_train_bytes
    from microbatch.errors import ConfigError
    from microbatch.model import get_model, model_names
    from microbatch.units import format_bytes

    def need_of(name: str) -> float:
        return static_train_bytes(get_model(name).param_count(), "train")

    fit = [n for n in model_names() if need_of(n) <= DEMO_BUDGET_BYTES]
    try:
        need = need_of(model_name)  # an unknown name fails here, before any work
    except ConfigError:  # the registry's message names plan's shape flags, which demo does not have
        raise ConfigError(
            f"--model {model_name!r} is not a built-in model; the demo runs one whose training state fits its "
            f"{format_bytes(DEMO_BUDGET_BYTES)} on the CPU: use --model {', '.join(fit)}"
        ) from None
    if need > DEMO_BUDGET_BYTES:  # nor does a model the demo's budget cannot hold start
        raise ConfigError(
            f"--model {model_name} needs {format_bytes(need)} for its weights, gradients and AdamW state, over the "
            f"demo's {format_bytes(DEMO_BUDGET_BYTES)} on the CPU; use --model {', '.join(fit)}, or tune it with "
            f"`microbatch tune --model {model_name} --memory-budget ...` on a machine that holds it"
        )


def _pick(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: d.get(k) for k in keys}


def _tune_both(
    out: Path,
    model_name: str,
    quick: bool,
    quiet: bool,
    results: list[dict[str, Any]],
    summary: dict[str, Any],
) -> None:
    """1. Measure: the throughput and memory curve of a built-in model, training and decoding."""
    from microbatch.choose.config import ChoiceConfig
    from microbatch.choose.tune import tune_model
    from microbatch.choose.tune.config import ProbeConfig, SearchConfig
    from microbatch.commands.tune import with_provenance
    from microbatch.measure.timing import TimingConfig

    # One thread and the probe's own CPU time: steady numbers on a small or shared machine
    # (several threads on two busy cores can run many times slower than one).
    timing = TimingConfig(clock="process", max_time_s=2.0 if quick else 4.0)
    search = SearchConfig(max_micro_batch=16 if quick else 64, patience=3, use_cache=False)
    choice = ChoiceConfig(memory_budget_bytes=DEMO_BUDGET_BYTES)
    for mode in ("train", "decode"):
        t0 = _step(
            quiet, f"tune {model_name} ({mode}) on the CPU: doubling b_m, each probe in a child process"
        )
        probe = ProbeConfig(mode=mode, device="cpu", threads=1, timing=timing)
        res = tune_model(model_name, probe=probe, search=search, choice=choice)
        # as tune's file: validate then times this CPU at the probes' one thread
        d = with_provenance(res.to_dict(), {"model": model_name}, probe)
        _save(out, f"tune-{mode}.json", d, summary)
        results.append(d)
        summary[f"tune_{mode}"] = _pick(
            d,
            ("micro_batch", "throughput", "fraction_of_best", "peak_memory_bytes", "max_fitting_micro_batch"),
        )
        ff = d.get("fastest_fitting") or {}
        _done(
            quiet,
            t0,
            f"knee b_m = {d['micro_batch']} ({100 * d['fraction_of_best']:.0f}% of best); "
            f"fastest that fits b_m = {ff.get('micro_batch')}; probed "
            f"{[p['micro_batch'] for p in d['points']]}",
        )
        if res.interrupted:
            summary.update(interrupted=True, interrupted_in=f"tune ({mode})")
            return


def _plan_llama(out: Path, quiet: bool, results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """2. Predict: a plan for a large model on a named GPU."""
    from microbatch.hardware import get_accelerator
    from microbatch.model import get_model
    from microbatch.predict.plan import PlanConfig, make_plan

    t0 = _step(quiet, "plan Llama-3-8B, seq 8192, on 64 H100s: p = 4, d = 16, global batch 1024")
    plan = make_plan(
        PlanConfig(
            shape=get_model("llama-3-8b"),
            gpu=get_accelerator("h100-sxm"),
            global_batch=1024,
            data_parallel=16,
            pipeline_parallel=4,
        )
    )
    from microbatch.commands._flags import flag_for
    from microbatch.show.plan_report import plan_dict

    pd = plan_dict(plan, words={p: flag_for(p, "plan") for p in ("zero", "choose")})
    _save(out, "plan.json", pd, summary)
    results.append(pd)
    rec = pd["recommended"] or {}
    summary["plan"] = _pick(
        rec,
        ("micro_batch", "microbatches", "schedule", "recompute", "zero", "bubble_fraction",
         "peak_memory_bytes", "fits"),
    )  # fmt: skip
    _done(
        quiet,
        t0,
        f"recommended b_m = {rec.get('micro_batch')}, m = {rec.get('microbatches')}, "
        f"{rec.get('schedule')}, recompute {rec.get('recompute')}, ZeRO {rec.get('zero')}, "
        f"bubble {100 * (rec.get('bubble_fraction') or 0):.1f}%",
    )


def _simulate_gpipe_and_1f1b(
    out: Path, quiet: bool, results: list[dict[str, Any]], summary: dict[str, Any]
) -> None:
    """3. Simulate GPipe against 1F1B: the same bubble, different memory."""
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate
    from microbatch.show.text import render_timeline_text

    t0 = _step(quiet, "simulate GPipe against 1F1B, p = 4, m = 8 (B = 2F)")
    for name in ("gpipe", "1f1b"):
        sim = simulate(generate(name, 4, 8), forward_time=1.0, backward_time=2.0)
        sd = sim.to_dict()
        sd["timeline"] = [
            [{"start": a, "end": b, "kind": act.kind, "microbatch": act.microbatch} for a, b, act in row]
            for row in sim.intervals
        ]
        _save(out, f"simulate-{name}.json", sd, summary)
        results.append(sd)
        summary[f"simulate_{name}"] = {
            "bubble_fraction": sd["bubble_fraction"],
            "peak_in_flight": sd["peak_in_flight"],
        }
        if not quiet:
            click.echo(
                f"  {name}: bubble {100 * sd['bubble_fraction']:.1f}%, in flight {sd['peak_in_flight']}",
                err=True,
            )
            click.echo(render_timeline_text(sim.intervals, sim.makespan, width=72, legend=False), err=True)
    _done(quiet, t0, "same bubble; GPipe holds m micro-batches per stage, 1F1B min(m, p−i)")


def _run_small_pipeline(
    out: Path, model_name: str, quiet: bool, results: list[dict[str, Any]], summary: dict[str, Any]
) -> None:
    """4. Run: a real 2-stage pipeline on torch.distributed.pipelining (gloo, 2 processes)."""
    from dataclasses import replace

    from microbatch.errors import MicrobatchError
    from microbatch.run.pipeline.before_run import predict_run
    from microbatch.run.pipeline.config import PipelineConfig
    from microbatch.run.pipeline.launch import run_pipeline

    t0 = _step(
        quiet,
        f"run a real 2-stage 1F1B pipeline of {model_name} (gloo, 2 processes), m = 4, gradients checked",
    )
    try:
        cfg = PipelineConfig(
            schedule="1f1b", stages=2, microbatches=4, model=model_name, steps=2, check_gradients=True
        )
        before = predict_run(cfg)  # made before the ranks start: the prediction the measurement can refute
        pr = replace(run_pipeline(cfg), before_run=before)
        _save(out, "pipeline.json", pr.to_json(), summary)
        results.append(pr.to_json())
        summary["pipeline"] = {
            "measured_bubble_fraction": pr.measured.bubble_fraction,
            "predicted_bubble_fraction": before.bubble_fraction,
            "replayed_bubble_fraction": pr.predicted.bubble_fraction,  # its own op times: a consistency check
            "gradients_match": pr.gradients_match,
            "max_grad_rel_error": pr.max_grad_rel_error,
        }
        _done(
            quiet,
            t0,
            f"measured bubble {100 * pr.measured.bubble_fraction:.1f}% against {100 * before.bubble_fraction:.1f}% "
            f"predicted before the run (its own op times replayed: {100 * pr.predicted.bubble_fraction:.1f}%); "
            f"gradients match: {pr.gradients_match} (max rel. error {pr.max_grad_rel_error:.1e})",
        )
    except MicrobatchError as e:  # the rest of the demo still stands; say what failed
        summary["pipeline"] = {"error": str(e)}
        _done(quiet, t0, f"pipeline run failed: {e}")


def _validate_training(
    out: Path, quiet: bool, results: list[dict[str, Any]], summary: dict[str, Any]
) -> None:
    """5. Close the loop: predict the measured training points from the smallest probes."""
    from microbatch.errors import MicrobatchError
    from microbatch.measure.cpu import measure_cpu
    from microbatch.predict.validation import validate_result
    from microbatch.show.validation import with_summary

    t0 = _step(quiet, "validate: predict the largest probes from the smallest (calibrated planner)")
    try:
        vd = with_summary(
            validate_result(json.loads((out / "tune-train.json").read_text()), measure=measure_cpu)
        )
        _save(out, "validate.json", vd, summary)
        results.append(vd)
        summary["validate"] = vd["summary"]
        _done(quiet, t0, vd["summary"])
    except MicrobatchError as e:  # e.g. too few training points; the rest of the demo still stands
        summary["validate"] = {"error": str(e)}
        _done(quiet, t0, f"validation failed: {e}")
