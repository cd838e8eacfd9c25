"""The command line: thin. Parse, call the library, render, exit.

Each command lives in ``microbatch/commands/<name>.py`` and is imported only when it runs,
so ``microbatch --help`` and the calculators start fast (no torch, no matplotlib).
Exit status: 0 success, 2 bad input (:class:`~microbatch.errors.ConfigError`, usage errors),
1 any other failure, 130 interrupted. Every command's ``--json`` prints one object in one
envelope, ``{"command": ..., "version": ..., ...}`` (:mod:`microbatch.envelope`);
a failure with ``--json`` prints ``{"command", "version", "error", "kind"}`` on stdout too.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from microbatch import __version__
from microbatch.errors import ConfigError, MicrobatchError

__all__ = ["COMMANDS", "LazyGroup", "group", "main"]

# name -> (module under microbatch.commands, one-line help). Keep the help here so that
# `microbatch --help` lists every command without importing any of them.
COMMANDS: dict[str, tuple[str, str]] = {
    "batch": ("batch", "Solve B_global = b_m × g × d for the missing one."),
    "bubble": ("bubble", "Pipeline bubble of a schedule: closed form, fraction and ratio."),
    "simulate": ("simulate", "Simulate a pipeline schedule and draw its bubble diagram."),
    "memory": ("memory", "Predict per-stage memory: weights, gradients, optimizer, activations."),
    "plan": ("plan", "Choose b_m, m, schedule, recompute and ZeRO for a cluster; will it fit?"),
    "export": ("export", "Write a plan as a DeepSpeed, Hugging Face, Lightning or torchtitan config."),
    "tune": ("tune", "Measure throughput and peak memory as b_m grows; pick the knee."),
    "recommend": ("recommend", "Pick the knee from measurements made elsewhere (JSON or CSV)."),
    "validate": ("validate", "Predict measured points from the others: the planner's error, stated."),
    "noise": ("noise", "Measure the gradient noise scale: a suggestion for B_global."),
    "pipeline": ("pipeline", "Run pipeline-parallel training and compare the bubble with the prediction."),
    "report": ("report", "Build one self-contained HTML report from saved results."),
    "demo": ("demo", "The whole story on a built-in model on the CPU, in about a minute."),
    "bench-gpu": (
        "bench_gpu",
        "Time GEMMs, attention, streaming and collectives here, for plan --calibration.",
    ),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"microbatch.commands.{COMMANDS[name][0]}")
        command: click.Command = module.cmd
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_) for name, (_, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="microbatch")
def group() -> None:
    """Choose and run micro-batching: B_global = b_m × g × d.

    The global batch is a statistical choice; the micro-batch is a physical one. microbatch
    predicts memory and step time, measures the real throughput curve, picks the knee and the
    number of pipeline micro-batches that buries the bubble, and runs the choice.

    Every command takes --json for scripts. Exit status: 0 success, 2 bad input, 1 failure,
    130 interrupted (what was computed is kept and printed).
    """


def _command_of(args: Sequence[str]) -> str | None:
    """The command named in ``args`` (the first word that is not an option), if it is one."""
    word = next((a for a in args if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` was given (before any ``--``)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def _fail(message: str, code: int, args: Sequence[str], kept: Sequence[Any] = ()) -> int:
    """Say why on stderr (already done by the caller) and, with --json, as an object on stdout; ``kept``: the
    points measured before a choice none of them met (:class:`~microbatch.errors.NoChoiceError`), as ``points``."""
    from microbatch.commands._answer import ANSWER_STARTED

    if (
        _wants_json(args) and not ANSWER_STARTED and not _other_rank()
    ):  # after part of the answer, another object would parse as neither
        from microbatch._json import dumps
        from microbatch.envelope import error_envelope

        body = error_envelope(message, code, _command_of(args))
        try:
            click.echo(dumps({**body, "points": list(kept)} if kept else body))
        except OSError as e:  # stdout full or gone (the cause of this failure, perhaps): said once, on stderr
            _stdout_gone()
            if not isinstance(e, BrokenPipeError):  # a reader that left wants no more words
                _say(f"error: could not write the JSON error envelope to stdout: {e.strerror or e}")
    return code


def _other_rank() -> bool:
    """Whether this process is a rank other than 0 that torchrun started (``TORCHELASTIC_RUN_ID`` set: not variables
    left in a shell, whose lone process must still answer): its error is said on its stderr, and rank 0 alone writes
    the JSON envelope (a review: torchrun's two ranks wrote two objects on one stdout, which parsed as neither)."""
    import os

    rank = os.environ.get("RANK", "").strip()
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and rank.isdigit() and int(rank) > 0


def _stdout_gone() -> None:
    """Point stdout at the null device, so that the interpreter's last flush does not fail again."""
    import os

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):  # no stdout at all: nothing to flush
        pass


_PLAIN = {"−": "-", "–": "-", "—": "-", "×": "x", "·": ".", "≥": ">=", "≤": "<=", "≈": "~", "…": "...", "²": "^2",
          "Σ": "S", "τ": "tau", "σ": "sigma", "µ": "u", "→": "->", "±": "+/-", "√": "sqrt"}  # fmt: skip
"""What the command line's typography becomes on a stream whose encoding lacks it: a minus read as "?" under latin-1
(``(p?1)/(v×m+p?1)``, a review)."""


def _plain(e: UnicodeError) -> tuple[str, int]:
    """A codec error handler: each character :data:`_PLAIN` knows in plain letters, any other as "?"."""
    if not isinstance(e, UnicodeEncodeError):
        raise e
    return "".join(_PLAIN.get(ch, "?") for ch in e.object[e.start : e.end]), e.end


def _tolerant_streams() -> None:
    """stdout and stderr write what their encoding cannot hold (−, ×, τ under latin-1 or cp1252) in plain letters
    (:func:`_plain`) instead of failing a finished command on its last print."""
    import codecs

    codecs.register_error("microbatch-plain", _plain)
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if stream is not None and encoding not in ("utf8", "utf8sig") and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="microbatch-plain")
            except (OSError, ValueError):  # a stream that cannot be reconfigured keeps its ways
                pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``microbatch`` console script.

    Exit 0 on success, 2 on bad input, 1 on any other failure, 130 when interrupted. With
    ``--json`` a failure also prints ``{"command", "version", "error", "kind"}`` on stdout, ``kind``
    being ``bad_input``, ``failure`` or ``interrupted`` (``does_not_fit`` from a plan in which nothing fits and a
    ``memory --gpu`` whose peak does not, exit 2, the answer kept in the object), and ``points`` where a tune measured points
    none of which meets a limit (:class:`~microbatch.errors.NoChoiceError`).
    """
    from microbatch.interrupts import interrupts_kept_in_first_import
    from microbatch.run.pipeline.signals import raise_on_sigterm

    interrupts_kept_in_first_import(
        "torch"
    )  # wherever a command first imports it: its start-up swallows a Ctrl-C
    args = list(sys.argv[1:] if argv is None else argv)
    from microbatch.commands._answer import ANSWER_STARTED

    ANSWER_STARTED.clear()  # this command's answer: none written yet (main runs many times in one process)
    _tolerant_streams()
    restore = (
        raise_on_sigterm()
    )  # SIGTERM (timeout, a job scheduler) stops a command as Ctrl-C does: kept, 130
    stderr = sys.stderr
    if stderr is not None and not isinstance(stderr, _SilentOnFailure):
        sys.stderr = _SilentOnFailure(stderr)
    try:
        return _main(args)
    finally:
        sys.stderr = stderr
        restore()


class _SilentOnFailure:
    """stderr, its writes dropped once one fails (a full disk behind ``2>log``, ``2>/dev/full``): progress, notes and
    warnings cost their lines, not the command's work nor its answer on stdout (a tune lost its result and its
    envelope, exit 1). Everything else is the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._failed = stream, False

    def attempt(self, call: Any, *args: Any) -> Any:
        """``call(*args)`` unless a write failed before; None where it fails (and every later one is dropped)."""
        if not self._failed:
            try:
                return call(*args)
            except OSError:
                self._failed = True
        return None

    def write(self, text: str) -> int:
        done = self.attempt(self._stream.write, text)
        return len(text) if done is None else int(done)

    def flush(self) -> None:
        self.attempt(self._stream.flush)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    @property
    def buffer(self) -> Any:
        """The bytes under it, as silent (click writes through them where the stream's encoding is ASCII)."""
        import io

        owner, raw = self, self._stream.buffer

        class Silent(io.BufferedIOBase):
            def writable(self) -> bool:
                return True

            def write(self, data: Any) -> int:
                done = owner.attempt(raw.write, data)
                return len(data) if done is None else int(done)

            def flush(self) -> None:
                owner.attempt(raw.flush)

        return Silent()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _repeats(args: list[str]) -> None:
    """:func:`~microbatch.commands._repeats.check_repeated_options` on the named command's words, before it runs."""
    from microbatch.commands._repeats import check_repeated_options

    name = _command_of(args)
    if name is not None:
        command = group.get_command(click.Context(group), name)
        if command is not None:
            check_repeated_options(command, args[args.index(name) + 1 :])


def _check_working_folder() -> None:
    """ConfigError when the working folder was removed after the shell entered it: torch's own libraries then fail
    to load (oneMKL's "FATAL ERROR", exit 2 with no envelope) and relative paths lead nowhere (a review)."""
    import os

    try:
        os.getcwd()
    except FileNotFoundError:
        raise ConfigError(
            "the working folder no longer exists (it was removed after this shell entered it); cd into a folder "
            "that exists and run again"
        ) from None


def _interrupted(why: str) -> str:
    """The line an interrupt ends with: ``interrupted``, with the library's words after it unless they say it."""
    return why if why.startswith("interrupted") else f"interrupted: {why}" if why else "interrupted"


def _main(args: list[str]) -> int:
    """:func:`main` on ``args``, its errors turned into exit codes and one line each."""
    try:
        _check_working_folder()
        _repeats(args)
        code = group.main(args=args, prog_name="microbatch", standalone_mode=False)
        if isinstance(code, int):  # click returns an Exit's code here (tune's 130 after Ctrl-C)
            return code
    except click.exceptions.Abort as e:  # click turns a KeyboardInterrupt into Abort: keep its message
        cause = e.__cause__ or e.__context__
        said = _interrupted(str(cause)) if isinstance(cause, KeyboardInterrupt) else "interrupted"
        _say(said)
        return _fail(said, 130, args)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.UsageError as e:  # one line: click's message names the value and the rule; the fix is --help
        if type(e).__name__ == "NoArgsIsHelpError":  # `microbatch` alone: the help itself
            _quietly(e.show)
            return _fail(e.format_message(), 2, args)
        where = e.ctx.command_path if e.ctx is not None else "microbatch"
        message = f"{e.format_message().rstrip('.')}; see '{where} --help'"
        command = _command_of(args)
        said_json = "'--json'" in e.format_message()  # click's complaint is about --json itself
        if where == "microbatch" and command and said_json and "--json" in args[: args.index(command)]:
            message = f"--json goes after the command: microbatch {command} ... --json"
        _say(f"error: {message}")
        return _fail(message, 2, args)
    except click.ClickException as e:
        _quietly(e.show)
        return _fail(e.format_message(), e.exit_code, args)
    except ConfigError as e:  # the library names parameters; the user typed flags
        from microbatch.commands._flags import cli_message

        message = cli_message(e, _command_of(args))
        _say(f"error: {message}")
        return _fail(message, 2, args, getattr(e, "points", ()))
    except MicrobatchError as e:  # a run that failed; its message may name parameters too
        from microbatch.commands._flags import cli_message

        message = cli_message(e, _command_of(args))
        _say(f"error: {message}")
        return _fail(message, 1, args)
    except OSError as e:  # the file system said no (full, read-only, gone): its words, no traceback
        import errno

        from microbatch.commands._answer import StdoutFailed

        if isinstance(e, StdoutFailed):  # the answer itself could not be printed: no envelope after it either
            _stdout_gone()
            _say(f"error: could not write to stdout: {e.strerror or e}")
            return 1
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        full = e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
        path_refused = e.errno in (errno.ENAMETOOLONG, errno.EACCES, errno.EPERM) and bool(where)
        advice = (
            "; free space or choose another path, and run again"
            if full
            else "; give a shorter path, or one this user may read and write"
            if path_refused
            else ""
        )
        message = f"could not use{where}: {e.strerror or e}{advice}"
        _say(f"error: {message}")
        return _fail(message, 2 if path_refused else 1, args)
    except KeyboardInterrupt as e:
        said = _interrupted(str(e))  # what the library kept, or that nothing was
        _say(said)
        return _fail(said, 130, args)
    except MemoryError:  # this process's own memory (an input file far too large): one line, not a traceback
        message = "this process ran out of memory (an input file too large to read? a measurement file is kilobytes)"
        _say(f"error: {message}")
        return _fail(message, 1, args)
    return 0


def _say(line: str) -> None:
    """``line`` on stderr, if stderr takes it: a full disk behind ``2>log`` must not cost the answer on stdout."""
    _quietly(lambda: click.echo(line, err=True))


def _quietly(write: Any) -> None:
    try:
        write()
    except (OSError, ValueError):  # stderr full, gone or closed: the envelope on stdout still says it
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
