"""Output paths of the commands: checked before any work (writable, not a folder, not an input, never
a file of the user's replaced without ``--force``) and written so that a computed result is never lost."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from microbatch._json import dumps
from microbatch.envelope import envelope
from microbatch.files import is_stream, write_text

__all__ = [
    "write_text",
    "command_name",
    "check_out_dir",
    "check_output_file",
    "force_option",
    "keep_beside",
    "keep_result",
    "same_file",
    "write_result",
]


def command_name() -> str:
    """The name of the command that is running (``tune``, ``plan``, ...), from click's context."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or not ctx.command.name:
        raise RuntimeError("no command is running; pass command= to write_result()")
    return ctx.command.name


def write_result(path: str | Path, obj: Any, command: str | None = None) -> Path:
    """Write ``obj`` in the envelope as JSON to ``path`` (its folder made if missing); return the path.

    For result files other commands read back (``tune --out``, the demo's results).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_text(p, dumps(envelope(obj, command or command_name())) + "\n")
    return p


def check_out_dir(
    path: str | Path,
    flag: str = "--out",
    *,
    files: Sequence[str] = ("result.json",),
    force: bool | None = None,
) -> Path:
    """``path`` as a folder this process can write to (made if missing), checked before any work.

    ConfigError naming the flag, the folder, why and the fix when it cannot be made or written, when
    it is a file, or when one of ``files`` (what the command writes in it) exists and is not one of
    ours (:func:`microbatch.envelope.is_ours`) and ``force`` is not True (None: the command has no
    ``--force``).
    """
    import tempfile

    from microbatch.errors import ConfigError

    if not str(path).strip():  # Path('') is the working folder: a demo's files landed there
        raise ConfigError(f"{flag} '' names no folder; give a folder name, e.g. {flag} run1")
    p = Path(path)
    suffix = p.suffix.lower()
    if not p.is_dir() and suffix in {".json", ".csv", ".html", ".htm", ".png", ".svg", ".txt"}:
        # a file's name where a folder is asked for: it would become a folder named like a file
        raise ConfigError(
            f"{flag} {str(path)!r} names a {suffix} file, and {flag} is a folder ({', '.join(files)} written in "
            f"it); give a folder, e.g. {flag} {str(p.with_suffix('')) or 'run1'}"
        )
    blocker = _file_in_the_way(p)
    if blocker is not None:
        raise ConfigError(
            f"{flag} {str(path)!r} cannot be written: {blocker} is a file, not a folder; give {flag} a folder "
            "you can write to (new or existing)"
        )
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".microbatch-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{flag} {str(path)!r} cannot be written ({e.strerror or e}); the results would be lost after the "
            f"run: give {flag} a folder you can write to"
        ) from None
    for name in files:
        if (p / name).is_dir():  # found only when written, after the work
            raise ConfigError(
                f"{flag} {str(path)!r}: {name} is a folder there, where the command writes that file; move it, "
                f"or give {flag} another folder"
            )
        _check_not_theirs(p / name, f"{flag} {str(path)!r}: {name}", force)
    return p


def _file_in_the_way(path: Path) -> Path | None:
    """The first of ``path`` and its ancestors (nearest the root) that exists and is not a folder, if
    any: a folder cannot be made under it."""
    parts = [path, *path.parents][::-1]
    for q in parts:
        if q.exists() and not q.is_dir():
            return q
        if not q.exists():
            return None
    return None


def _check_not_theirs(path: Path, what: str, force: bool | None) -> None:
    """Refuse to replace an existing regular file that is not one of ours without ``--force``."""
    from microbatch.envelope import is_ours
    from microbatch.errors import ConfigError

    if force or not path.is_file() or is_ours(path):
        return
    fix = (
        "give --force to replace it, or another name" if force is not None else "move it, or write elsewhere"
    )
    raise ConfigError(
        f'{what} exists and is not a file microbatch wrote (no JSON envelope {{"command", "version"}}, no '
        f"'written by microbatch' mark): it may be yours and would be lost; {fix}"
    )


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether the paths ``a`` and ``b`` name one file: the same path once symbolic links, ``..`` and
    the working folder are resolved, or the same file on disk (a hard link). A folder means its
    ``result.json`` (as :func:`microbatch.records.load_json` reads it)."""
    pa, pb = Path(a), Path(b)
    pa, pb = (q / "result.json" if q.is_dir() else q for q in (pa, pb))
    if os.path.realpath(pa) == os.path.realpath(pb):
        return True
    try:
        return os.path.samefile(pa, pb)
    except OSError:
        return False


def check_output_file(
    path: str | None,
    flag: str,
    suffixes: tuple[str, ...] = (),
    *,
    inputs: Sequence[tuple[str, str | None]] = (),
    force: bool | None = None,
) -> None:
    """Refuse, before any work, an output file that could not be written: a suffix that names
    another format (``--png out.svg``), a path that is a folder, one of the ``inputs`` (``(flag,
    path)`` pairs: writing would destroy what is read, even with ``--force``), a folder that is a
    file, a folder that cannot be made (a missing one is made when the file is written, as every
    command does, not before: a refusal leaves nothing behind) or written (tried with a temporary file in
    the nearest folder that exists), an existing file that is not one of ours (:func:`microbatch.envelope.is_ours`)
    unless ``force`` (None: the command has no ``--force``).

    ConfigError naming the flag, the path, why and the fix.
    """
    import tempfile

    from microbatch.errors import ConfigError

    if path is None:
        return
    if not str(path).strip():  # an empty name was skipped: nothing written, nothing said
        raise ConfigError(f"{flag} '' names no file; give a file name")
    ext = os.path.splitext(path)[1].lower()
    if suffixes and ext and ext not in suffixes:
        raise ConfigError(
            f"{flag} {path}: the suffix {ext} names another format than {flag} writes ({'/'.join(suffixes)}); "
            f"use a name ending in {suffixes[0]}"
            + (f", or --{ext[1:]} for that format" if ext in (".svg", ".png") else "")
        )
    if is_stream(path):  # /dev/stdout into a pipe, /dev/null, <(...): written in place
        return
    landing = landing_path(path)
    if landing.is_dir():
        example = os.path.join(path, "out" + (suffixes[0] if suffixes else ".json"))
        raise ConfigError(f"{flag} {path} is a folder; give a file name, e.g. {example}")
    for in_flag, in_path in inputs:
        if in_path and same_file(path, in_path):
            raise ConfigError(
                f"{flag} {path} is the input {in_flag} {in_path}: writing it would replace what is read; "
                f"give {flag} another file"
            )
    folder = (
        landing.parent
    )  # where the write lands: a symbolic link's target folder, made at the write if missing
    blocker = _file_in_the_way(folder)
    if blocker is not None:
        raise ConfigError(
            f"{flag} {path} cannot be written: {blocker} is a file, not a folder; give {flag} a path in a "
            "folder (new or existing)"
        )
    base = next(q for q in (folder, *folder.parents) if q.exists())  # made at the write, if missing
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".microbatch-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{flag} {path}: the folder {base} cannot be written ({e.strerror or e}); write elsewhere"
        ) from None
    _check_not_theirs(landing, f"{flag} {path}", force)
    _check_not_another_commands(landing, f"{flag} {path}", force)


def landing_path(path: str | Path) -> Path:
    """The file a write to ``path`` lands on once its missing folders are made: symbolic links resolved as far as the
    path exists, ``..`` after a folder not yet made taken off with it (``new/../mine.cfg`` is ``mine.cfg``, which the
    path as given does not reach while ``new`` is missing: a review replaced a user's file through it)."""
    return Path(os.path.realpath(path))


def _check_not_another_commands(path: Path, what: str, force: bool | None) -> None:
    """Refuse, without ``--force``, to replace a result another command wrote (a ``tune`` result under a
    ``bench-gpu --out``): it is microbatch's, but it is not this command's to lose."""
    from microbatch.envelope import envelope_command
    from microbatch.errors import ConfigError

    ctx = click.get_current_context(silent=True)
    if force or ctx is None or not ctx.command.name or not path.is_file():
        return
    other = envelope_command(path)
    if other is None or other == ctx.command.name:
        return
    fix = "give --force to replace it, or another name" if force is not None else "give another name"
    raise ConfigError(
        f"{what} holds a `{other}` result, which this `{ctx.command.name}` run would replace; {fix}"
    )


force_option = click.option(
    "--force", is_flag=True, help="Replace an output file that exists and is not one microbatch wrote."
)
"""``--force``: without it an existing output file that does not carry the envelope or the mark
(:func:`microbatch.envelope.is_ours`) is refused, never replaced."""


def keep_beside(obj: Any, command: str | None = None) -> Path:
    """Write ``obj`` (in the envelope) to a new file in the temporary folder and return its path:
    where a result goes when the path asked for cannot take it, so that it is never lost."""
    import tempfile

    name = command or command_name()
    fd, other = tempfile.mkstemp(prefix=f"microbatch-{name}-", suffix=".json")
    os.close(fd)
    return write_result(other, obj, command=name)


def write_out(path: str | Path, d: dict[str, Any]) -> str:
    """Write the result ``d`` to ``path`` (:func:`keep_result`), say where on stderr, and return where it is; where it
    could not be written there, ``d`` gets ``kept_in`` and a note (the command then exits 1: a script's next step
    would read a missing file)."""
    where, why = keep_result(path, d)
    click.echo(why or f"wrote {where}", err=True)
    if why:  # kept_in null: neither there nor in the temporary folder (the answer printed is all there is)
        d.update(kept_in=str(where) if where != Path(path) else None, notes=[*d.get("notes", []), why])
        d.setdefault("error", why)  # the exit 1 a script sees, in the envelope as pipeline's and simulate's
        if not d.get(
            "interrupted"
        ):  # an interrupted run exits 130 whatever its file: its kind stays interrupted
            d.setdefault("kind", "failure")
    return str(where)


def keep_result(path: str | Path, obj: Any, command: str | None = None) -> tuple[Path, str | None]:
    """:func:`write_result` to ``path``; if that fails now (the folder vanished, the disk filled),
    :func:`keep_beside` it and return that path with a line saying why (else None)."""
    try:
        return write_result(path, obj, command), None
    except OSError as e:
        try:
            kept = keep_beside(obj, command)
        except OSError as again:  # the temporary folder full too: the result is only what is printed
            return Path(path), (
                f"could not write {path} ({e.strerror or e}) nor keep it in the temporary folder "
                f"({again.strerror or again}); the result is only what is printed"
            )
        return kept, f"could not write {path} ({e.strerror or e}); the result was kept in {kept}"


def kept_text(text: str, as_json: bool) -> str:
    """The answer stdout could not take, written to a new file in the temporary folder: "; the answer was kept in
    PATH", or "" where that fails too (a run's result is not lost to a full disk behind ``> result.json``)."""
    import tempfile

    try:
        fd, path = tempfile.mkstemp(
            prefix=f"microbatch-{command_name()}-", suffix=".json" if as_json else ".txt"
        )
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError:
        return ""
    return f"; the answer was kept in {path}"


def check_not_stdout_with_json(path: str | None, flag: str, as_json: bool, example: str) -> None:
    """Refuse, before any work, an output file that is this process's stdout while ``--json`` prints there too: the
    two documents would share one stream and neither would parse (``simulate --svg /dev/stdout --json``)."""
    from microbatch.errors import ConfigError

    if not (path and as_json) or not is_stream(path):  # a link to /dev/stdout is one too
        return
    try:
        same = os.path.samefile(path, "/dev/stdout")
    except OSError:
        same = os.path.realpath(path) == os.path.realpath("/dev/stdout")
    if same:
        raise ConfigError(
            f"{flag} {path} with --json: the file and the JSON would share stdout, and neither would parse; write "
            f"it to a file (e.g. {flag} {example}) or drop --json"
        )
