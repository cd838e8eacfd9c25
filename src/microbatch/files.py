"""A file written whole or not at all (:func:`write_text`): the commands' outputs, ``TuneResult.save`` and the tune
cache write through it, so a reader never sees half of one and a write cut short keeps the earlier file."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from pathlib import Path

__all__ = ["is_stream", "write_bytes", "write_text"]

_DESCRIPTOR = re.compile(r"/dev/(stdout|stderr)|/dev/fd/\d+|/proc/(self|\d+)/fd/\d+")
"""Names of an open file descriptor: whatever the shell connected it to (a pipe, a terminal, a log opened with
``>>``) is written in place."""


def _link_steps(path: str) -> list[str]:
    """``path`` and each path its symbolic links lead through (at most 16), before the kernel's own names resolve
    them further (/dev/stdout to a file the shell opened): a link to /dev/stdout names stdout."""
    steps = [path]
    for _ in range(16):
        try:
            target = os.readlink(steps[-1])
        except OSError:
            break
        steps.append(os.path.normpath(os.path.join(os.path.dirname(steps[-1]), target)))
    return steps


def is_stream(path: str | Path) -> bool:
    """Whether ``path`` is written in place, as a stream: a name of an open descriptor (:data:`_DESCRIPTOR`), or an
    existing file that is neither a regular file nor a folder (a character device as ``/dev/null`` or a terminal, a
    FIFO, ``<(...)``, a socket). A regular file is not, wherever it lies (``/dev/shm`` is a folder of them), nor a
    path that does not exist yet."""
    if any(
        _DESCRIPTOR.fullmatch(step) for step in _link_steps(str(path))
    ):  # a link to /dev/stdout is one too
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def write_bytes(path: str | Path, data: bytes) -> None:
    """:func:`write_text` for bytes (a PNG): whole or not at all where the file is its own, else in place."""
    _write(path, data)


def write_text(path: str | Path, text: str, *, always_whole: bool = False) -> None:
    """Write ``text`` to ``path`` (:func:`_write`)."""
    _write(path, text, always_whole=always_whole)


def _write(path: str | Path, text: str | bytes, *, always_whole: bool = False) -> None:
    """Write ``text`` (or bytes) to ``path``; an OSError raised by the write itself (a full disk) names the path.

    A file of its own (new, or regular with one link, in a folder this user may write) is written whole or not at
    all: to a temporary file beside it, then renamed over it (through a symbolic link, beside its target), so a write
    cut short (a full disk, ``ulimit -f``) leaves the earlier file as it was and a reader never sees half of one.
    Anything else is written in place, as asked: ``/dev/stdout`` (a pipe, or a log opened for appending), a device,
    a hard-linked file (its other names keep seeing it), a file in a folder only it may be written in.
    ``always_whole`` (a file of the tool's own, as the tune cache's): never in place — a hard link is broken, and a
    path that is not a regular file (a FIFO, which an in-place write waits on forever) raises ``OSError`` (EEXIST)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before the work
        target = Path(
            os.path.realpath(path)
        )  # a symbolic link into a folder not made yet: made too, as a path's
        if not is_stream(path):
            target.parent.mkdir(parents=True, exist_ok=True)
        real = _replaceable(Path(path))
        if always_whole and real is None:
            real = Path(os.path.realpath(path))
            if real.exists() and not real.is_file():
                raise OSError(errno.EEXIST, "not a regular file: remove it", str(path))
        binary = isinstance(text, bytes)
        enc = None if binary else "utf-8"
        if real is None:  # /dev/stdout appended, not truncated: `>> log` keeps the log's earlier lines
            with open(
                path,
                ("a" if is_stream(path) else "w") + ("b" if binary else ""),
                encoding=enc,
                opener=_opener,
            ) as f:
                f.write(text)
            return
        # the name kept short: a legal 250-byte name plus the suffix ran past 255 bytes (ENAMETOOLONG, a review)
        short = real.name.encode()[:100].decode("utf-8", "ignore")  # bytes count there: 63 emoji are 252
        part = real.parent / f".{short}.{os.getpid()}.{os.urandom(4).hex()}.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to a new file
        try:
            with os.fdopen(fd, "wb" if binary else "w", encoding=enc) as f:
                f.write(text)
            if real.exists():
                os.chmod(part, real.stat().st_mode & 0o7777)
            os.replace(part, real)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def _opener(path: str, flags: int) -> int:
    """``open``'s opener: a FIFO opened without waiting, so one nobody reads fails at once (ENXIO: "no such device or
    address") where a plain open waits for a reader forever, its Ctrl-C retried away (PEP 475), and the computed
    result behind it never printed (a helper's review); once open, it blocks as a FIFO does while its reader reads."""
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        fifo = False
    if not fifo:
        return os.open(path, flags, 0o666)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, "a FIFO nobody reads: start its reader first", path) from None
        raise
    os.set_blocking(fd, True)
    return fd


def _replaceable(path: Path) -> Path | None:
    """The file to replace whole for ``path`` (:func:`write_text`): its real path when it is new or a regular file
    with one link, not a stream (:func:`is_stream`), in a folder this user may write; else None (written in place)."""
    real = Path(os.path.realpath(path))
    if is_stream(path) or str(real).startswith("/proc/"):
        return None
    if not real.parent.is_dir() or not os.access(real.parent, os.W_OK):
        return None
    if real.exists() and (not real.is_file() or real.stat().st_nlink > 1):
        return None
    return real
