"""``microbatch export``: a plan as a DeepSpeed, Hugging Face, Lightning or torchtitan config."""

from __future__ import annotations

import click

from microbatch.commands._common import emit, json_option, write_result

__all__ = ["cmd"]


@click.command("export")
@click.option(
    "--plan", "plan_path", required=True, type=click.Path(dir_okay=False), help="Output of `plan --json`."
)
@click.option(
    "--format", "fmt", required=True, type=click.Choice(["deepspeed", "hf", "lightning", "torchtitan"]),
    help="Target framework.",
)  # fmt: skip
@click.option("--gpu", help="With a multi-GPU comparison: which accelerator's plan to export.")
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False), help="Write the config here instead of stdout."
)
@json_option
def cmd(plan_path: str, fmt: str, gpu: str | None, output: str | None, as_json: bool) -> None:
    """Write the plan's recommendation in a framework's terms; B_global = b_m × g × d is kept.

    \b
    Example: microbatch plan --model gpt2 --gpu a100-80gb -B 512 -d 8 --json > plan.json
             microbatch export --plan plan.json --format deepspeed > ds_config.json
    Notes on what the format cannot express go to stderr.
    """
    import json
    from pathlib import Path

    from microbatch.errors import ConfigError
    from microbatch.show.export import export_plan

    try:
        data = json.loads(Path(plan_path).read_text())
    except OSError as e:
        raise ConfigError(
            f"cannot read --plan {plan_path!r} ({e.strerror}); give the file `plan --json` wrote"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--plan {plan_path!r} is not JSON ({e}); give the output of `microbatch plan --json`"
        ) from None
    ex = export_plan(data, fmt, gpu=gpu)
    payload = {"format": ex.format, "config": ex.config, "notes": list(ex.notes)}
    if output and as_json:
        write_result(output, payload)
    elif output:
        text = ex.text()
        Path(output).write_text(text + ("\n" if not text.endswith("\n") else ""))
    else:
        emit(payload, as_json, ex.text)
    if not as_json:
        for note in ex.notes:
            click.echo(f"note: {note}", err=True)
