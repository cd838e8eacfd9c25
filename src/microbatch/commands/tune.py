"""``microbatch tune``: measure throughput and peak memory as b_m grows; pick the knee.

The flags build the three config objects of :mod:`microbatch.choose.config` (flags and fields
share their names: ``--max-micro-batch`` → ``SearchConfig.max_micro_batch``); the command
calls :func:`microbatch.choose.tune.tune_model` with them and renders the result.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from microbatch.choose.tune.probing import SMALL_CPU
from microbatch.commands._common import (
    check_out_dir,
    choice_config,
    choice_options,
    emit,
    flags_for,
    json_option,
    keep_result,
    model_options,
    progress,
)
from microbatch.commands._decode_flags import new_tokens_flag, with_decode_workload
from microbatch.commands._flags import cli_text
from microbatch.commands._outputs import write_out
from microbatch.errors import NoChoiceError, ProbeTimeoutError
from microbatch.hardware import usable_cores
from microbatch.precision import MEASURABLE

if TYPE_CHECKING:
    from microbatch.choose.config import ChoiceConfig
    from microbatch.choose.result import TuneResult
    from microbatch.choose.tune.config import ProbeConfig, SearchConfig
    from microbatch.choose.tune.search import OnPoint
    from microbatch.measure.timing import TimingConfig

__all__ = ["cmd", "SMALL_CPU", "FLAG_NAMES", "cpu_timing_defaults"]

FLAG_NAMES = {"start": "--start", "max": "--max-micro-batch", "B": "--global-batch", "d": "--data-parallel"}
"""How the command line names the walk's settings (``check_walk``'s ``names``; the Python API's are
:data:`microbatch.choose.tune.preflight.KEYWORD_NAMES`)."""


def cpu_timing_defaults(
    threads: int | None, clock: str | None, cores: int | None = None
) -> tuple[int | None, str, str]:
    """(threads, clock, a line saying why) for a CPU tune: the flags given, the rest from the cores
    (:func:`microbatch.choose.tune.probing.cpu_timing_rule`, the rule ``microbatch.tune`` follows too)."""
    from microbatch.choose.tune.probing import cpu_timing_rule
    from microbatch.errors import ConfigError

    n = usable_cores() if cores is None else cores
    if clock == "process" and threads is not None and threads != 1:
        raise ConfigError(
            f"--clock process with --threads {threads}: the process clock adds up the CPU time of every thread, "
            "so it would not measure the step; use --threads 1 with --clock process, or --clock wall"
        )
    threads, clock, chosen = cpu_timing_rule(threads, clock, n)
    if chosen and threads == 1:
        return (
            1,
            "process",
            (
                f"timing: 1 thread, process clock ({n} cores detected: steadier where other work shares "
                "the cores; --threads/--clock to change)"
            ),
        )
    if chosen:
        return (
            None,
            "wall",
            f"timing: torch's threads, wall clock ({n} cores detected; --threads/--clock to change)",
        )
    what = "torch's threads" if threads is None else f"{threads} thread{'s' if threads > 1 else ''}"
    return threads, clock, f"timing: {what}, {clock} clock (as given)"


def _target(model_spec: Mapping[str, Any]) -> dict[str, Any]:
    """``model`` (a registry name or a shape) or ``hf_config`` for :func:`tune_model`, from the model flags."""
    from microbatch.commands._common import resolve_model
    from microbatch.errors import ConfigError

    shape_flags = any(
        model_spec.get(k) is not None
        for k in ("layers", "hidden", "heads", "head_size", "kv_heads", "ffn_hidden", "vocab")
    )
    if model_spec.get("hf_config"):
        if shape_flags or model_spec.get("model"):
            raise ConfigError(
                "--hf-config builds the model from its config; do not add --model or shape flags"
            )
        return {"hf_config": model_spec["hf_config"]}
    if model_spec.get("model") and not shape_flags:
        from microbatch.model import get_model

        get_model(model_spec["model"])  # unknown names fail here, before any process starts
        return {"model": model_spec["model"]}
    return {"model": resolve_model(model_spec, default="small")}


def with_provenance(d: dict[str, Any], target: dict[str, Any], probe: Any) -> dict[str, Any]:
    """``d`` (a tune result's dict) with what a file of it needs besides: the probes' torch threads (None: torch's
    own), which ``validate`` times the CPU with, and the shape measured (``model_shape``). ``probe`` is the
    :class:`~microbatch.choose.tune.config.ProbeConfig` it ran with; ``target`` its model or HF config."""
    d["threads"] = probe.threads
    d["model_shape"] = _measured_shape(target, probe.seq, probe.backend).to_dict()
    return d


def _measured_shape(target: dict[str, Any], seq: int | None, backend: str) -> Any:
    """The shape of the model a tune measured: its registry entry, the shape given, or its config's; the built-in
    GPT (``backend`` builtin, :mod:`microbatch.measure.gpt`) applies no dropout, nor does the Llama layout
    ``backend`` hf builds for a shape with rotary positions (:func:`~microbatch.measure.hf.hf_config_from_shape`),
    so their shape says none (a calibration or validation from the file then prices the model that ran)."""
    from dataclasses import replace

    from microbatch.model import ModelShape, from_hf_config, get_model

    model = target.get("model")
    if model is None:
        return from_hf_config(target["hf_config"], seq=seq)
    if isinstance(model, ModelShape):
        shape = model.with_seq(seq) if seq else model
    else:
        shape = get_model(str(model), seq=seq)
    ran = shape.dropout and (backend == "hf" and shape.learned_positions)
    return replace(shape, dropout=ran) if ran != shape.dropout else shape


def _timing(device: str, repeats: int | None, clock: str | None) -> TimingConfig | None:
    """The probe timing of ``--repeats`` and ``--clock`` (None: the device's default)."""
    from microbatch.choose.tune.probing import default_timing
    from microbatch.errors import check_positive_int
    from microbatch.measure.timing import TimingConfig

    if (
        repeats is None and clock is None
    ):  # a --clock wall given is kept: on a small CPU the default is process
        return None
    base = default_timing(device)
    if repeats is not None:
        check_positive_int("--repeats", repeats, fix="timed repeats at most per probe, e.g. 10")
    most = base.max_repeats if repeats is None else repeats
    return TimingConfig(
        warmup=base.warmup,
        min_repeats=min(base.min_repeats, most),
        max_repeats=most,
        max_time_s=base.max_time_s,
        rel_tol=base.rel_tol,
        clock=clock or "wall",
    )


@click.command("tune")
@model_options
@click.option(
    "--mode",
    type=click.Choice(["train", "decode"]),
    default="train",
    show_default=True,
    help="train: forward + backward micro-steps; decode: KV-cache decoding after a prefill.",
)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (cuda:N).")
@click.option("--precision", type=click.Choice(list(MEASURABLE)), default="fp32", show_default=True)
@click.option(
    "--checkpointing",
    type=click.Choice(["off", "on", "auto"]),
    default="off",
    show_default=True,
    help="Activation checkpointing; auto turns it on only where a b_m does not fit without it.",
)
@click.option(
    "--backend",
    type=click.Choice(["builtin", "hf"]),
    default="builtin",
    show_default=True,
    help="For --model: the built-in PyTorch GPT, or a transformers model of the same shape (random weights).",
)
@click.option(
    "--start",
    type=int,
    default=1,
    show_default=True,
    help="First b_m probed (then doubled; with -B, the next divisor of B / d).",
)
@click.option("--max-micro-batch", type=int, default=1024, show_default=True, help="Largest b_m probed.")
@click.option(
    "--patience",
    type=int,
    default=2,
    show_default=True,
    help="Also stop after this many doublings in a row gain less than the tolerance (or fall).",
)
@click.option("--refine", is_flag=True, help="Probe once more between the knee and the point below it.")
@click.option(
    "--repeats",
    type=int,
    default=None,
    help="Timed repeats at most per probe (default 10 on CPU, 30 on CUDA).",
)
@click.option(
    "--out", type=click.Path(file_okay=False), help="Write result.json (the curve and the choice) here."
)
@click.option(
    "--clock",
    type=click.Choice(["wall", "process"]),
    default=None,
    help="CPU timing clock; process (the probe's CPU time, with --threads 1) is steadier on a shared machine. "
    f"Default: process with one thread on a CPU of {SMALL_CPU} cores or fewer, wall otherwise.",
)
@click.option(
    "--threads",
    type=int,
    help=f"torch threads in the probe process (default: 1 on a CPU of {SMALL_CPU} cores or fewer, "
    "where other work competes for the cores; torch's own above).",
)
@click.option(
    "--probe-timeout",
    "probe_timeout_s",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds one probe may take on the CPU (a child process): one past it is stopped and the search "
    "ends with the points below it.",
)
@click.option(
    "--new-tokens",
    type=int,
    default=None,
    help="With --mode decode: tokens decoded after the prefill (the prompt is --seq minus them; default 32, and at "
    "least the warm-up and repeats).",
)
@click.option(
    "--use-cache/--no-cache",
    default=True,
    show_default=True,
    help="Reuse points measured before and save new ones; --no-cache measures every point again.",
)
@choice_options
@json_option
def cmd(
    model_spec: dict[str, Any],
    choice_spec: dict[str, Any],
    out: str | None,
    repeats: int | None,
    clock: str | None,
    as_json: bool,
    **flags: Any,
) -> None:
    """Measure the throughput curve of a model and choose b_m at its knee.

    \b
    Example: microbatch tune --model small --seq 128 --memory-budget 2GiB
             microbatch tune --hf-config config.json --seq 1024 --device cuda --precision bf16-mixed

    --seq is the LONGEST sequence the data will hold: peak memory is set by the longest
    sequence, so tune at that length. On the CPU each probe runs in a child process under a
    hard memory limit (--memory-budget, or 80% of the available memory), so an out-of-memory
    ends only the child. Results are cached ($MICROBATCH_CACHE_DIR, default
    $XDG_CACHE_HOME/microbatch or ~/.cache/microbatch); Ctrl-C keeps what was measured (printed, and in --out), then exits 130.
    Every setting, the output folder and the model's static memory are checked before the
    first probe; progress goes to stderr, one line per probe.

    \b
    It doubles b_m from --start (with -B, steps along the divisors of B / d: for 96, ... 32,
    48, 96) and stops when the knee is settled (1 / the slope of a line
    fitted to the step time of the five largest probes bounds what any larger b_m can reach,
    and a measured b_m is within the tolerance of that bound), when --patience doublings in a
    row gain less than the tolerance, at the memory limit, or at --max-micro-batch.
    """
    from microbatch.choose.tune.preflight import check_walk
    from microbatch.show.recommendation import render_tune

    probe, search, choice, timing_line = _configs(model_spec, choice_spec, repeats, clock, flags)
    check_walk(search, choice, FLAG_NAMES)  # tune_model checks it too, naming its keywords
    target = _target(model_spec)
    out_dir = (
        check_out_dir(out) if out is not None else None
    )  # before any probe: a result is never lost to a bad path

    try:
        result = _measure(
            target,
            probe,
            search,
            choice,
            timing_line,
            live_display=sys.stderr is not None and sys.stderr.isatty() and not as_json,
        )
    except NoChoiceError as e:
        # measured, but no point meets a limit: keep the points, show them (with --json the error carries them),
        # then say so
        if not as_json:
            from microbatch.show.recommendation import render_curve

            click.echo("\n".join(render_curve({"mode": probe.mode}, e.points)))
        raise _kept(e, out_dir, bool(search.use_cache)) from None
    d = with_decode_workload(result.to_dict(), probe)
    if choice.max_latency_ms is not None:  # recommend reads it back to choose as tune chose
        d["max_latency_ms"] = choice.max_latency_ms
    if d.get("stop_reason"):  # a probe past its time limit names the limit and the fix: as flags here
        d["stop_reason"] = cli_text(d["stop_reason"], (*ProbeTimeoutError.PARAMS, "max_latency_ms"), "tune")
    if timing_line:
        d["timing_choice"] = timing_line
    with_provenance(d, target, probe)
    kept = write_out(out_dir / "result.json", d) if out_dir is not None else None  # what --json prints
    emit(d, as_json, lambda: render_tune(d, again="--no-cache"))
    if "kept_in" in d and not result.interrupted:
        raise click.exceptions.Exit(1)
    if result.interrupted:
        n = sum(1 for p in result.points if not p.oom)
        progress(
            f"interrupted: kept the {n} point(s) measured (b_m {', '.join(str(p.micro_batch) for p in result.points)})"
            + (" in the cache" if search.use_cache else "")
            + (f" and {kept}" if kept else "")
            + "; the choice above uses them"
        )
        raise click.exceptions.Exit(130)


def _kept(e: NoChoiceError, out_dir: Path | None, cached: bool) -> NoChoiceError:
    """The refusal of a choice no measured point meets, its points written to ``out_dir``/result.json (no knee in
    it) and the message saying where they are."""
    where = []
    if out_dir is not None:
        path, _ = keep_result(
            out_dir / "result.json", {"points": e.points, "micro_batch": None, "error": str(e)}
        )
        where.append(str(path))
    if cached:
        where.append("the cache (a rerun without the limit reuses them)")
    kept = f"; the {len(e.points)} measured point(s) are kept in {' and '.join(where)}" if where else ""
    return NoChoiceError(f"{e}{kept}", points=e.points, params=e.params)


def _configs(
    model_spec: dict[str, Any],
    choice_spec: dict[str, Any],
    repeats: int | None,
    clock: str | None,
    flags: dict[str, Any],
) -> tuple[ProbeConfig, SearchConfig, ChoiceConfig, str | None]:
    """The probe, search and choice configs from the flags (errors name the flags), and the line that
    says which timing the CPU defaults chose (None when none was chosen)."""
    from microbatch.choose.tune.config import ProbeConfig, SearchConfig

    device = flags["device"]
    threads, timing_line = flags["threads"], None
    if device.split(":")[0] == "cpu":
        threads, clock, timing_line = cpu_timing_defaults(threads, clock)
    elif clock is None:
        clock = "wall"
    with flags_for("threads", "seq", "start", "probe_timeout_s", "new_tokens", "max_micro_batch", "patience", "max_latency_ms", "tolerance",
                   "memory_headroom", "global_batch", "data_parallel", "device"):  # fmt: skip
        probe = ProbeConfig(
            mode=flags["mode"],
            seq=model_spec.get("seq"),
            device=device,
            precision=flags["precision"],
            backend=flags["backend"],
            timing=_timing(device, repeats, clock),
            threads=threads,
            probe_timeout_s=flags["probe_timeout_s"],
            new_tokens=new_tokens_flag(flags["new_tokens"], flags["mode"]),
        )
        search = SearchConfig(
            start=flags["start"],
            max_micro_batch=flags["max_micro_batch"],
            patience=flags["patience"],
            refine=flags["refine"],
            checkpointing=flags["checkpointing"],
            use_cache=flags["use_cache"],
        )
        choice = choice_config(choice_spec)
    return probe, search, choice, timing_line


def _measure(
    target: dict[str, Any],
    probe: ProbeConfig,
    search: SearchConfig,
    choice: ChoiceConfig,
    timing_line: str | None,
    *,
    live_display: bool,
) -> TuneResult:
    """Run the search with progress on stderr: a live display, or one line per probe."""
    from contextlib import nullcontext

    from microbatch.choose.tune import tune_model
    from microbatch.commands._heartbeat import Heartbeat

    live, beat = None, None
    if live_display:
        live, on_point = _progress(search.start)
    else:  # one line per probe, and one while a long probe says nothing (no terminal: a spinner has nowhere)
        beat = Heartbeat(
            f"tune: probing b_m = {search.start} (the first probe also starts the probe process, builds the model "
            "and runs one set-up step)",
            "tune: probing the next b_m",
        )
        on_point = _lines(beat.news)
    if timing_line:
        on_point = _first_say(timing_line, on_point)  # once work starts: a refusal stays one line
    import warnings

    from microbatch.choose.tune.cache import CachedAnswer

    try:
        if live is not None:
            live.start()
        warnings.simplefilter(
            "ignore", CachedAnswer
        )  # the answer's text says it (show.recommendation.cache_line)
        with beat or nullcontext():
            result = tune_model(
                target.get("model"),
                hf_config=target.get("hf_config"),
                probe=probe,
                search=search,
                choice=choice,
                on_point=on_point,
            )
    finally:
        if live is not None:
            live.stop()
    return result


def _first_say(line: str, on_point: OnPoint) -> OnPoint:
    """``on_point`` that first prints ``line`` on stderr, once."""
    said: list[bool] = []

    def wrapped(m: Any, cached: bool) -> None:
        if not said:
            progress(line)
            said.append(True)
        on_point(m, cached)

    return wrapped


def _lines(news: Callable[[], None] | None = None) -> OnPoint:
    """``on_point`` printing one line per point on stderr (no spinner: for pipes, logs and CI); ``news()``
    (a :class:`~microbatch.commands._heartbeat.Heartbeat`'s) is called with each."""
    import time

    from microbatch.measure.probes import Measurement

    t0 = time.perf_counter()

    def on_point(m: Measurement, cached: bool) -> None:
        if news is not None:
            news()
        what = "out of memory" if m.oom else f"{m.throughput:,.0f} tok/s"
        progress(
            f"tune: b_m = {m.micro_batch}: {what}{' (cached)' if cached else ''} [{time.perf_counter() - t0:.1f} s]"
        )

    return on_point


def _progress(start: int) -> tuple[Any, OnPoint]:
    """A transient spinner on stderr and the ``on_point`` that prints each point above it."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from microbatch.measure.probes import Measurement

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = progress.add_task(f"tuning: probing b_m = {start}", total=None)

    def on_point(m: Measurement, cached: bool) -> None:
        what = "out of memory" if m.oom else f"{m.throughput:,.0f} tok/s"
        progress.console.print(f"  b_m = {m.micro_batch:>5}: {what}{' (cached)' if cached else ''}")
        progress.update(task, description=f"tuning: last b_m = {m.micro_batch}")

    return progress, on_point
