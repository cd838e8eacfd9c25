"""Options and output helpers shared by the commands."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from microbatch._json import dumps

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")


def stages_option(required: bool = True, default: int | None = None) -> Callable:
    """``--stages`` with ``--pipeline-parallel`` as another name (every command accepts both)."""
    return click.option(
        "--stages",
        "--pipeline-parallel",
        "-p",
        "stages",
        type=int,
        required=required and default is None,
        default=default,
        help="Pipeline stages p (ranks). --pipeline-parallel is the same option.",
    )


def precision_options(f: Callable) -> Callable:
    """``--precision``, ``--grad-dtype`` and ``--optimizer``: the bytes of training state per parameter."""
    opts = [
        click.option(
            "--precision",
            type=click.Choice(["bf16-mixed", "fp16-mixed", "fp32"]),
            default="bf16-mixed",
            show_default=True,
        ),
        click.option(
            "--grad-dtype",
            type=click.Choice(["half", "fp32"]),
            default="half",
            show_default=True,
            help="half: 16 B/param with Adam (ZeRO paper); fp32: 18 B/param (Megatron).",
        ),
        click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", show_default=True),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def emit(obj: Any, as_json: bool, render: Callable[[], str]) -> None:
    """Print ``obj`` as JSON when asked, else the human rendering."""
    if as_json:
        click.echo(dumps(obj))
    else:
        click.echo(render())


def option_group(f: Callable, key: str, names: Sequence[str], opts: Sequence[Callable]) -> Callable:
    """Add the click options ``opts`` to the command ``f``, which receives the values of the
    parameters ``names`` as one keyword argument ``key`` (a dict) instead of one each."""
    import functools

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs[key] = {k: kwargs.pop(k, None) for k in names}
        return f(*args, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


MODEL_FLAGS = ("model", "hf_config", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq")
"""Parameters :func:`model_options` adds; the command receives them as one dict, ``model_spec``."""


def model_options(f: Callable) -> Callable:
    """Add the model options: ``--model NAME``, ``--hf-config PATH`` and the shape flags.

    The command receives one keyword argument ``model_spec`` (a dict of the nine values) and calls
    :func:`resolve_model` on it::

        @click.command("tune")
        @model_options
        def cmd(model_spec, ...):
            shape = resolve_model(model_spec, default="small")
    """
    opts = [
        click.option(
            "--model", "model", help="A registry model name (gpt2, llama-2-7b, megatron-530b, tiny, ...)."
        ),
        click.option(
            "--hf-config", "hf_config", type=click.Path(dir_okay=True), help="A Hugging Face config.json."
        ),
        click.option("--layers", type=int, help="L: transformer layers (shape flag)."),
        click.option("--hidden", type=int, help="h: hidden size (shape flag)."),
        click.option("--heads", type=int, help="a: attention heads (shape flag)."),
        click.option("--kv-heads", "kv_heads", type=int, help="Key/value heads (grouped-query attention)."),
        click.option("--ffn-hidden", "ffn_hidden", type=int, help="MLP inner width (default 4h)."),
        click.option("--vocab", type=int, help="V: vocabulary size (shape flag)."),
        click.option("--seq", type=int, help="s: sequence length (overrides the model's)."),
    ]
    return option_group(f, "model_spec", MODEL_FLAGS, opts)


def resolve_model(spec: dict, default: str | None = None):
    """The :class:`~microbatch.model.ModelShape` that ``model_spec`` names.

    ``--model`` or ``--hf-config`` (shape flags given with them override fields), or the shape
    flags alone; with none of them, the ``default`` registry model (a ConfigError if None).
    """
    from microbatch.model import resolve_model as _resolve

    spec = dict(spec)
    model, hf = spec.pop("model", None), spec.pop("hf_config", None)
    if model is None and hf is None and default is not None and all(v is None for v in spec.values()):
        model = default
    elif model is None and hf is None and default is not None and spec.get("layers") is None:
        model = default  # only --seq (or similar) given: override the default model's field
    return _resolve(model, hf, **spec)
