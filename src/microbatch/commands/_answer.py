"""The command's answer on stdout (:func:`emit`): in the envelope as JSON, or the human rendering, written whole.
Split from :mod:`microbatch.commands._common`, which every command imports it through."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from microbatch._json import dumps
from microbatch.commands._outputs import command_name, kept_text
from microbatch.envelope import envelope
from microbatch.interrupts import held_interrupt

__all__ = ["ANSWER_STARTED", "StdoutFailed", "emit"]


class StdoutFailed(OSError):
    """Printing the answer on stdout failed (a full disk behind a redirection): said as that, not as a path."""


ANSWER_STARTED: list[bool] = []
"""Set once :func:`emit` has begun writing the answer to stdout: the error envelope is then not written after it."""


def emit(obj: Any, as_json: bool, render: Callable[[], str]) -> None:
    """Print ``obj`` in the envelope (:func:`microbatch.envelope.envelope`: the running
    command's name and the version first) as JSON when asked, else the human rendering; :class:`StdoutFailed` where
    stdout cannot take it (a reader that left, EPIPE, is click's to handle: it exits 1 without a word)."""
    text = dumps(envelope(obj, command_name())) if as_json else render()
    if sys.stdout is None:  # closed by the caller (>&-): click would drop the answer without a word
        raise StdoutFailed(errno.EBADF, f"stdout is closed{kept_text(text, as_json)}")
    try:
        ANSWER_STARTED.append(True)  # a second envelope after part of this one would parse as neither
        with held_interrupt():  # a Ctrl-C mid-write: the answer finishes (a second one stops it at once)
            _write_answer(text)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise StdoutFailed(e.errno, f"{e.strerror}{kept_text(text, as_json)}") from e


def _write_answer(text: str) -> None:
    """``text`` and a newline on stdout, to its file descriptor in a loop of ``os.write`` where it has one: Python's
    buffered stream drops what is left of a large write that a signal interrupts when the handler returns (1 MB to a
    pipe gave 81,920 bytes and no error, here with CPython 3.11), which the held interrupt's handler does. Encoded as
    the stream would (its encoding and error handler: the plain letters of a latin-1 terminal); a stream without a
    descriptor (a test's capture) through click."""
    stream = sys.stdout
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1
    if (
        fd < 0 or sys.platform == "win32"
    ):  # a test's capture; Windows' console wants its own stream (encoding, CRLF)
        click.echo(text)
        return
    stream.flush()
    data = (text + "\n").encode(stream.encoding or "utf-8", getattr(stream, "errors", None) or "strict")
    while data:
        data = data[os.write(fd, data) :]
