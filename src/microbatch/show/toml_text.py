"""TOML text of a few flat tables (a framework's configuration): the subset the exports write, by hand.

Python 3.11 reads TOML (``tomllib``) but writes none; the exports need only tables of strings, numbers,
booleans and lists of them, so this writes exactly that and refuses anything else.
"""

from __future__ import annotations

import json
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["toml_text"]


def _value(v: object) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string for these characters
    raise ConfigError(f"cannot write {v!r} to TOML")


def toml_text(tables: dict[str, Any]) -> str:
    """``[name]`` then ``key = value`` lines for each table of ``tables``."""
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)
