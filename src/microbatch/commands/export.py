"""``microbatch export``: a plan or a tune as a DeepSpeed, Hugging Face, Lightning or torchtitan config."""

from __future__ import annotations

from typing import Any

import click

from microbatch.commands._common import check_output_file, emit, force_option, json_option, write_result
from microbatch.commands._outputs import landing_path, write_text

__all__ = ["cmd"]


@click.command("export")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), help="Output of `plan --json`.")
@click.option(
    "--tune",
    "tune_path",
    type=click.Path(),
    help="A tune's result (`tune --out DIR`: DIR or DIR/result.json).",
)
@click.option(
    "--format", "fmt", required=True, type=click.Choice(["deepspeed", "hf", "lightning", "torchtitan"]),
    help="Target framework.",
)  # fmt: skip
@click.option("--gpu", help="With a multi-GPU plan (required there): which accelerator's plan to export.")
@click.option(
    "--gpus-per-node", type=click.IntRange(min=1), help="Lightning: accelerators per node (default: up to 8)."
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    help="Write the config here instead of stdout; with --json the file holds the JSON envelope (the config under "
    "'config', for report), not the config a framework reads.",
)
@force_option
@json_option
def cmd(
    plan_path: str | None,
    tune_path: str | None,
    fmt: str,
    gpu: str | None,
    gpus_per_node: int | None,
    output: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Write a plan's recommendation or a tune's knee in a framework's terms; B_global = b_m × g × d is kept.

    \b
    Example: microbatch plan --model gpt2 --gpu a100-80gb -B 512 -d 8 --json > plan.json
             microbatch export --plan plan.json --format deepspeed > ds_config.json
             microbatch tune --model small -B 256 --out run1
             microbatch export --tune run1 --format hf
    Notes on what the format cannot express go to stderr.
    """

    from microbatch.commands._flags import cli_text
    from microbatch.errors import ConfigError
    from microbatch.records import load_json
    from microbatch.show.export import export_plan, export_tune

    if (plan_path is None) == (tune_path is None):
        raise ConfigError(
            "give exactly one of --plan (a `plan --json` file) or --tune (a tune's result.json)"
        )
    bare_json = output is not None and fmt != "torchtitan" and not as_json  # a config with no room for a mark
    want = ".toml" if fmt == "torchtitan" and not as_json else ".json"  # what the file will hold
    wrong = {".toml", ".json"} - {
        want
    }  # another suffix (or none) is the user's choice; the other format's is not
    if output is not None and any(str(output).lower().endswith(w) for w in wrong):
        raise ConfigError(
            f"--output {output} would hold {'TOML' if want == '.toml' else 'JSON'} ({fmt}"
            + (", --json: the envelope" if as_json else "")
            + f"); name it with {want}"
        )
    if (
        output is not None
    ):  # before the work; a missing folder is made; never the input, never a file not ours
        inputs = [("--plan", plan_path), ("--tune", tune_path)]
        check_output_file(output, "--output", inputs=inputs, force=force or bare_json)  # bare JSON: below
    if plan_path is not None:
        data = load_json(plan_path, what="--plan", fix="give the file `microbatch plan --json` wrote")
        _check_kind(data, "--plan", plan_path)
        ex = export_plan(data, fmt, gpu=gpu, gpus_per_node=gpus_per_node)
    else:
        if gpu is not None:
            raise ConfigError(
                "--gpu picks one plan of a multi-GPU plan; a tune result has one device: drop --gpu"
            )
        data = load_json(
            str(tune_path), what="--tune", fix="give the result.json `microbatch tune --out DIR` wrote"
        )
        _check_kind(data, "--tune", str(tune_path))
        ex = export_tune(data, fmt, gpus_per_node=gpus_per_node)
    if bare_json and not force:
        _check_replaces_an_export(str(output), ex.config, fmt)
    # the library names its keywords: export's own, and the plan's a note asks to plan with
    asked = ("gpus_per_node", "loss_kernel", "layer_kernels", "zero3_impl")
    notes = [cli_text(n, asked, "export") for n in ex.notes]
    payload = {"format": ex.format, "config": ex.config, "notes": notes}
    if output and as_json:  # the file holds the envelope (a result `report` reads); stdout the same
        write_result(output, payload)
        emit({**payload, "output": output}, as_json, ex.text)
    elif output:
        text = ex.text()
        if fmt == "torchtitan":  # TOML takes a comment: the mark that lets a later export replace it
            from microbatch.envelope import mark_line

            text = mark_line("export") + "\n" + text
        write_text(output, text + ("\n" if not text.endswith("\n") else ""))
    else:
        emit(payload, as_json, ex.text)
    if not as_json:
        for note in notes:
            click.echo(f"note: {note}", err=True)


_FLAG_OF = {"plan": "--plan", "tune": "--tune"}


def _check_kind(data: Any, flag: str, path: str) -> None:
    """Refuse, in the words of what was given, a result of another command than ``flag`` reads: a
    tune result given as --plan (or the reverse) is named as such, with the flag that reads it."""
    from microbatch.errors import ConfigError
    from microbatch.records import check_fields, classify

    try:
        kind = classify(data)
    except ConfigError:
        return  # not a result file: the reader of the flag says what it lacks
    want = flag.removeprefix("--")
    if kind == want:
        check_fields(kind, data, source=path)  # a tune's points: numbers, before they are read
        return
    if kind in _FLAG_OF:
        raise ConfigError(
            f"{flag} {path} holds a {kind} result (written by `microbatch {kind}`), not a {want} result; "
            f"give it as {_FLAG_OF[kind]} {path}"
        )
    raise ConfigError(
        f"{flag} {path} holds a {kind} result (written by `microbatch {kind}`); export reads a plan "
        "(--plan, from `microbatch plan --json`) or a tune (--tune, from `microbatch tune --out DIR`)"
    )


def _key_paths(d: dict[str, Any], prefix: str = "") -> set[str]:
    """Every key of a nested JSON object as a dotted path: a config's shape, its values aside."""
    out: set[str] = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _key_paths(v, f"{prefix}{k}.")
    return out


def _check_replaces_an_export(output: str, config: dict[str, Any], fmt: str) -> None:
    """A JSON config (DeepSpeed, HF, Lightning) has no room for the mark that says microbatch wrote it: an existing
    file is taken as an earlier export when it is a JSON object with the same keys as this one, nested ones included
    (re-exporting after re-planning; a hand-written config adds offload or overlap settings), else refused without
    ``--force``, saying so. Checked after the export is computed
    (milliseconds), so the comparison can be made."""

    from microbatch._json import loads
    from microbatch.errors import ConfigError

    path = landing_path(output)
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        old = loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict) and _key_paths(old) == _key_paths(config):
        return
    raise ConfigError(
        f"--output {output} exists and is not a {fmt} config with the keys this export writes (a JSON config carries "
        "no mark of who wrote it): it may be yours and would be lost; give --force to replace it, or another name"
    )
