"""The one JSON envelope of the command line.

Every command's ``--json`` prints ``{"command": <name>, "version": <microbatch.__version__>,
...result}``, and a file a command writes for others to read (``tune --out``) holds the same; a
failure with ``--json`` prints ``{"command", "version", "error", "kind"}``. The commands never
build these themselves: ``commands/_common.py``'s ``emit`` and ``write_result`` and ``cli.main``
call this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from microbatch import __version__
from microbatch._json import loads

__all__ = [
    "ENVELOPE_KEYS",
    "ERROR_KINDS",
    "MARK",
    "envelope",
    "envelope_command",
    "error_envelope",
    "is_ours",
    "mark_line",
]

ENVELOPE_KEYS = ("command", "version")
"""The keys every JSON object of the command line starts with."""

ERROR_KINDS = {2: "bad_input", 1: "failure", 130: "interrupted"}
"""The ``kind`` of an error object for each exit status."""


def envelope(result: Any, command: str) -> dict[str, Any]:
    """``{"command": command, "version": microbatch.__version__, **result}``.

    A result that is not a mapping goes under ``"result"``; a result's own ``command`` or
    ``version`` (one read back from a file) gives way to this command's. A result kept after an interrupt
    (``"interrupted": true``: tune, noise, bench-gpu, demo, pipeline) carries ``"kind": "interrupted"`` as an error
    object of exit 130 does, so a script testing ``kind`` reads both alike.
    """
    body = dict(result) if isinstance(result, Mapping) else {"result": result}
    for key in ENVELOPE_KEYS:
        body.pop(key, None)
    if body.get("interrupted") is True:
        body.setdefault("kind", ERROR_KINDS[130])
    return {"command": command, "version": __version__, **body}


def error_envelope(message: str, exit_code: int, command: str | None) -> dict[str, Any]:
    """What ``--json`` prints when a command fails: ``{"command", "version", "error", "kind"}``.

    ``kind`` follows the exit status (:data:`ERROR_KINDS`): ``bad_input`` (2), ``failure`` (1 and
    anything else), ``interrupted`` (130); ``command`` is None when none was named.
    """
    kind = ERROR_KINDS.get(exit_code, "failure")
    return {"command": command, "version": __version__, "error": message, "kind": kind}


MARK = "written by microbatch"
"""The words every file the command line writes that cannot hold the envelope carries (an SVG's or
HTML's comment, a TOML's comment, a PNG's ``Software`` text): with the envelope, what
:func:`is_ours` recognises."""

_SNIFF_BYTES = 64 * 1024
"""How much of a file :func:`is_ours` reads for the mark (ours put it in the first few hundred bytes)."""

_ENVELOPE_READ_BYTES = 256 * 1024**2
"""The largest JSON file :func:`is_ours` parses for the envelope (the largest results are a few MB)."""


def mark_line(command: str, comment: str = "#") -> str:
    """The line that marks a file ``command`` wrote: ``# written by microbatch export 0.1.0``, or with
    ``comment="<!--"`` an XML/HTML comment."""
    text = f"{MARK} {command} {__version__}" if command else f"{MARK} {__version__}"
    return f"<!-- {text} -->" if comment == "<!--" else f"{comment} {text}"


def envelope_command(path: str | Path) -> str | None:
    """The ``command`` of the JSON envelope in the file at ``path``, or None (no envelope, unreadable, too large to
    be one of ours)."""
    p = Path(path)
    try:
        if p.stat().st_size > _ENVELOPE_READ_BYTES:
            return None
        data = loads(p.read_bytes())
    except (OSError, ValueError):
        return None
    command = data.get("command") if isinstance(data, dict) else None
    return command if isinstance(command, str) else None


def is_ours(path: str | Path) -> bool:
    """Whether the file at ``path`` is one the command line wrote, so that writing it again loses
    nothing of the user's: an empty file, a JSON object in the envelope (``command`` and ``version``
    strings), or a file carrying :data:`MARK` in its first 64 KiB. False for anything else,
    and for a file that cannot be read."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size == 0:
            return True
        with p.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
        if MARK.encode() in head or b"Software\x00" + MARK.encode() in head:
            return True
        if not head.lstrip().startswith(b"{") or size > _ENVELOPE_READ_BYTES:
            return False
        data = loads(p.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(isinstance(data.get(k), str) for k in ENVELOPE_KEYS)
