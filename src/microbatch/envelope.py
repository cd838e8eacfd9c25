"""The one JSON envelope of the command line.

Every command's ``--json`` prints ``{"command": <name>, "version": <microbatch.__version__>,
...result}``, and a file a command writes for others to read (``tune --out``) holds the same; a
failure with ``--json`` prints ``{"command", "version", "error", "kind"}``. The commands never
build these themselves: ``commands/_common.py``'s ``emit`` and ``write_result`` and ``cli.main``
call this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from microbatch import __version__

__all__ = ["ENVELOPE_KEYS", "ERROR_KINDS", "envelope", "error_envelope"]

ENVELOPE_KEYS = ("command", "version")
"""The keys every JSON object of the command line starts with."""

ERROR_KINDS = {2: "bad_input", 1: "failure", 130: "interrupted"}
"""The ``kind`` of an error object for each exit status."""


def envelope(result: Any, command: str) -> dict[str, Any]:
    """``{"command": command, "version": microbatch.__version__, **result}``.

    A result that is not a mapping goes under ``"result"``; a result's own ``command`` or
    ``version`` (one read back from a file) gives way to this command's.
    """
    body = dict(result) if isinstance(result, Mapping) else {"result": result}
    for key in ENVELOPE_KEYS:
        body.pop(key, None)
    return {"command": command, "version": __version__, **body}


def error_envelope(message: str, exit_code: int, command: str | None) -> dict[str, Any]:
    """What ``--json`` prints when a command fails: ``{"command", "version", "error", "kind"}``.

    ``kind`` follows the exit status (:data:`ERROR_KINDS`): ``bad_input`` (2), ``failure`` (1 and
    anything else), ``interrupted`` (130); ``command`` is None when none was named.
    """
    kind = ERROR_KINDS.get(exit_code, "failure")
    return {"command": command, "version": __version__, "error": message, "kind": kind}
