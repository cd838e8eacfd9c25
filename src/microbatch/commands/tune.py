"""``microbatch tune``: measure throughput and peak memory as b_m grows; pick the knee."""

from __future__ import annotations

import sys

import click

from microbatch.commands._common import dumps, emit, json_option, model_options
from microbatch.commands.recommend import choice_kwargs, choice_options, render_recommendation


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
@click.option("--precision", type=click.Choice(["fp32", "bf16-mixed"]), default="fp32", show_default=True)
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
@click.option("--start", type=int, default=1, show_default=True, help="First b_m probed (then doubled).")
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
    default="wall",
    show_default=True,
    help="CPU timing clock; process (the probe's CPU time, with --threads 1) is steadier on a shared machine.",
)
@click.option(
    "--threads",
    type=int,
    help="torch threads in the probe process (default: torch's; 1 is steadier on a shared CPU).",
)
@click.option("--no-cache", is_flag=True, help="Measure every point again (do not read or write the cache).")
@choice_options
@json_option
def cmd(
    model_spec,
    mode,
    device,
    precision,
    checkpointing,
    backend,
    start,
    max_micro_batch,
    patience,
    refine,
    repeats,
    out,
    clock,
    threads,
    no_cache,
    choice_spec,
    as_json,
):
    """Measure the throughput curve of a model and choose b_m at its knee.

    \b
    Example: microbatch tune --model small --seq 128 --memory-budget 2GiB
             microbatch tune --hf-config config.json --seq 1024 --device cuda --precision bf16-mixed

    --seq is the LONGEST sequence the data will hold: peak memory is set by the longest
    sequence, so tune at that length. On the CPU each probe runs in a child process under a
    hard memory limit (--memory-budget, or 80% of the available memory), so an out-of-memory
    ends only the child. Results are cached ($MICROBATCH_CACHE_DIR, default
    ~/.cache/microbatch); Ctrl-C keeps what was measured.

    \b
    It doubles b_m from --start and stops when the knee is settled (1 / the slope of a line
    fitted to the step time of the five largest probes bounds what any larger b_m can reach,
    and a measured b_m is within the tolerance of that bound), when --patience doublings in a
    row gain less than the tolerance, at the memory limit, or at --max-micro-batch.
    """
    from microbatch.choose.tune import CPU_TIMING, CUDA_TIMING, tune_model
    from microbatch.commands._common import resolve_model
    from microbatch.errors import ConfigError
    from microbatch.measure.probes import TimingConfig

    kw = choice_kwargs(choice_spec, reference="bound")
    shape_flags = any(
        model_spec.get(k) is not None
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")
    )
    seq = model_spec.get("seq")
    if seq is not None and seq < 1:
        raise ConfigError(f"--seq {seq} must be >= 1: give the longest sequence the data will hold")
    if model_spec.get("hf_config"):
        if shape_flags or model_spec.get("model"):
            raise ConfigError(
                "--hf-config builds the model from its config; do not add --model or shape flags"
            )
        target = {"hf_config": model_spec["hf_config"]}
    elif model_spec.get("model") and not shape_flags:
        from microbatch.model import get_model

        get_model(model_spec["model"])  # unknown names fail here, before any process starts
        target = {"model": model_spec["model"]}
    else:
        target = {"model": resolve_model(model_spec, default="small")}
    timing = None
    if repeats is not None or clock != "wall":
        base = CUDA_TIMING if device.startswith("cuda") else CPU_TIMING
        if repeats is not None and repeats < 1:
            raise ConfigError(f"--repeats {repeats} must be >= 1")
        repeats = base.max_repeats if repeats is None else repeats
        timing = TimingConfig(
            warmup=base.warmup,
            min_repeats=min(base.min_repeats, repeats),
            max_repeats=repeats,
            max_time_s=base.max_time_s,
            rel_tol=base.rel_tol,
            clock=clock,
        )

    progress = None
    on_point = None
    if not as_json and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        task = progress.add_task(f"tuning: probing b_m = {start}", total=None)
        unit = "tok/s"

        def on_point(m, cached):
            what = "out of memory" if m.oom else f"{m.throughput:,.0f} {unit}"
            progress.console.print(f"  b_m = {m.micro_batch:>5}: {what}{' (cached)' if cached else ''}")
            progress.update(task, description=f"tuning: last b_m = {m.micro_batch}")

    try:
        if progress is not None:
            progress.start()
        result = tune_model(
            target.get("model"),
            hf_config=target.get("hf_config"),
            backend=backend,
            seq=seq,
            mode=mode,
            device=device,
            precision=precision,
            checkpointing=checkpointing,
            start=start,
            max_micro_batch=max_micro_batch,
            refine=refine,
            patience=patience,
            timing=timing,
            use_cache=not no_cache,
            threads=threads,
            on_point=on_point,
            **kw,
        )
    finally:
        if progress is not None:
            progress.stop()
    d = result.to_dict()
    if out:
        path = result.save(out)
        if not as_json:
            click.echo(f"wrote {path}", err=True)

    def render() -> str:
        head = (
            f"tune {result.model} ({result.mode}, seq {result.seq}, {result.precision}, {result.device_name}, "
            f"torch {result.torch_version})"
        )
        tail = [
            f"stopped: {result.stop_reason}",
            f"{result.probes} probes measured, {result.cached} from the cache, {result.oom_events} out of memory, "
            f"{result.wall_time_s:.1f} s; memory method: {result.memory_method}",
        ]
        if result.static_bytes:
            tail.append(
                f"static memory (process, weights{', gradients, optimizer' if mode == 'train' else ''}): "
                f"{result.static_bytes / 2**20:.0f} MiB"
            )
        if result.memory_budget_bytes is not None:
            tail.append(
                f"memory budget: {result.memory_budget_bytes / 2**30:.2f} GiB ({result.memory_budget_source})"
            )
        if result.interrupted:
            tail.append("interrupted: the choice uses the points measured so far")
        return "\n".join([head, "", render_recommendation(d, d["points"], unit="tokens/s"), *tail])

    if as_json:
        click.echo(dumps(d))
    else:
        emit(d, False, render)
