"""JSON text with non-finite floats as null, so every parser reads what the library writes."""

from __future__ import annotations

import json
import math
import operator
import sys
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["MAX_INPUT_BYTES", "check_size", "finite", "dumps", "json_kind", "load_json", "loads"]


def json_kind(value: Any) -> str:
    """A loaded JSON value as a message names it: ``a JSON number (42)``, ``a JSON null (null)``."""
    kind = (
        "null" if value is None else "boolean" if isinstance(value, bool)
        else "number" if isinstance(value, (int, float)) else "string" if isinstance(value, str)
        else "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "value"
    )  # fmt: skip
    return f"a JSON {kind} ({json.dumps(value, default=str)[:40]})"


def loads(text: str | bytes) -> Any:
    """:func:`json.loads`, with a document nested past what the parser can follow raised as the
    :class:`json.JSONDecodeError` every reader of a user's file already turns into its message (the parser recurses
    once per level: a file of 100,000 ``[`` otherwise escapes as a RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        limit = sys.getrecursionlimit()
        raise json.JSONDecodeError(
            f"nested deeper than the {limit} levels the reader follows", doc, 0
        ) from None


def finite(obj: Any) -> Any:
    """``obj`` with NaN and ±inf floats replaced by None (dict keys as strings, tuples as lists), and the whole
    numbers of other libraries (NumPy's, a 0-d integer tensor: ``__index__``), which the checks accept, as ints."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):  # a NumPy scalar (int, float, bool)
        return finite(obj.item())
    if not isinstance(obj, (int, str, type(None))) and hasattr(type(obj), "__index__"):
        try:
            return operator.index(obj)
        except TypeError:
            return obj
    return obj


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` with non-finite floats as null (valid JSON for every parser)."""
    return json.dumps(finite(obj), indent=2, allow_nan=False)


def load_json(
    source: str | Path | dict[str, Any] | list[Any],
    *,
    what: str = "result file",
    fix: str = "give files a command wrote (its JSON output, or the result.json of its output folder)",
) -> Any:
    """The JSON value at ``source`` (a directory means its ``result.json``), or ``source`` itself when
    it is already a dict or list. Raises :class:`ConfigError` naming ``what``, the path and ``fix``."""
    if isinstance(source, (dict, list)):
        return source
    if str(source) == "":
        raise ConfigError(f"{what} is an empty path; {fix}")
    if not isinstance(source, (str, Path)):  # a value read from a file that held a number, a string, null
        raise ConfigError(f"{what} holds {json_kind(source)}, not an object; {fix}")
    path = Path(source)
    if path.is_dir():
        path = path / "result.json"
    if not path.is_file():
        why = "is not a regular file" if path.exists() else "does not exist"
        raise ConfigError(f"{what} {str(path)!r} {why}; {fix}")
    check_size(path, what)
    try:
        value = loads(
            path.read_text(encoding="utf-8-sig")
        )  # an editor's or PowerShell's byte-order mark is no error
    except json.JSONDecodeError as e:
        msg = e.msg.removesuffix(" at")  # "Unterminated string starting at" already ends so
        raise ConfigError(f"{what} {str(path)!r} is not JSON ({msg} at line {e.lineno}); {fix}") from None
    except UnicodeDecodeError as e:  # UTF-16 (PowerShell's > writes it), Latin-1: say the encoding wanted
        raise ConfigError(
            f"{what} {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 (PowerShell: "
            f"Out-File -Encoding utf8); {fix}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} is not readable ({e}); {fix}") from None
    if not isinstance(value, (dict, list)):
        raise ConfigError(f"{what} {str(path)!r} holds {json_kind(value)}, not an object; {fix}")
    return value


MAX_INPUT_BYTES = 256 * 1024**2
"""The largest file read as a result or measurements: 256 MiB, past any this tool writes (a tune result is
kilobytes; 2.1 million measured points, 100 MB of JSON, took 47 s and 2.2 GB to read) and short of a checkpoint or
a disk image named by mistake, which was read whole until the process ran out of memory."""


def check_size(path: Path, what: str) -> None:
    """ConfigError when ``path`` is larger than :data:`MAX_INPUT_BYTES`, before it is read."""
    size = path.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise ConfigError(
            f"{what} {str(path)!r} is {size / 1024**2:,.0f} MiB, past the {MAX_INPUT_BYTES // 1024**2} MiB a result "
            "or measurement file may be (they are kilobytes); is it the file you meant?"
        )
