"""Options and output helpers shared by the commands."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import click

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


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` with non-finite floats as null (valid JSON for every parser)."""
    return json.dumps(_clean(obj), indent=2, allow_nan=False)


def emit(obj: Any, as_json: bool, render: Callable[[], str]) -> None:
    """Print ``obj`` as JSON when asked, else the human rendering."""
    if as_json:
        click.echo(dumps(obj))
    else:
        click.echo(render())
