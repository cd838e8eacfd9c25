"""Ranks forked from a parent that has imported torch already (gloo on the CPU).

A rank started as a new Python pays ``import torch.distributed.pipelining`` before its first op: 5.2 s of
CPU on the 2-core dev VM (``/usr/bin/time python -c "import torch.distributed.pipelining"``; 2.7 s of it
torch itself, the rest DTensor and dynamo, which the package imports), and ``pipeline --predict`` starts
the ranks three times (two calibrations and the run): on a p = 4 run that is 62 s of CPU before any
stage runs, more than the run itself on a small model. So on the CPU the launcher keeps one warm parent,
Python's *fork server* (:mod:`multiprocessing`, started once per launcher process, its imports done
once), and each rank is a fork of it: a process of its own, as before (its own session, its stderr to
the rank's file, its stdout to /dev/null, the launcher's environment and working folder, ``''`` first
on its path as ``python -c`` puts it), with the imports already made.

Left on the old path, a new interpreter per rank: ``nccl`` (a CUDA context must not be forked; the fork
server never touches CUDA, but a GPU run is not measured here) and ``MICROBATCH_COLD_RANKS=1`` (a user's
escape hatch, and the tests' check that both paths agree).

:class:`RankProcess` has the part of :class:`subprocess.Popen`'s interface the launcher uses (``pid``,
``poll``, ``kill``, ``wait``), so the watching, killing and error reporting of
:mod:`microbatch.run.pipeline.launch` is the same on both paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["COLD_ENV", "PRELOAD", "RankHandle", "RankProcess", "start_warm", "warm_ranks"]

COLD_ENV = "MICROBATCH_COLD_RANKS"
"""Set to ``1`` to start every rank as a new interpreter (the path before the fork server)."""

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "microbatch.run.pipeline.rank",
    "microbatch.run.pipeline.launch",
)
"""What the fork server imports once: torch, its pipelining package, and the rank's own code."""


class RankHandle(Protocol):
    """What the launcher holds of a rank: :class:`subprocess.Popen` or :class:`RankProcess`."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def warm_ranks(backend: str, env: dict[str, str] | None = None) -> bool:
    """True when the ranks of a run on ``backend`` are forked from the warm parent: gloo, on a platform
    with ``fork`` (not Windows), and not turned off with ``MICROBATCH_COLD_RANKS=1``."""
    seen = os.environ if env is None else env
    return backend == "gloo" and _FORKABLE and seen.get(COLD_ENV, "") not in ("1", "true", "yes")


class RankProcess:
    """A rank forked by the fork server, seen through :class:`subprocess.Popen`'s ``pid``, ``poll()``,
    ``kill()`` and ``wait(timeout)`` (its exit status: negative for the signal that killed it)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid
        self.args = "warm rank"

    def poll(self) -> int | None:
        code: int | None = self._process.exitcode
        return code

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return int(code)


def start_warm(
    main: Callable[[list[str]], None], args: list[str], env: dict[str, str], err_path: str
) -> RankProcess:
    """Fork one rank from the fork server: it runs ``main(args)`` with ``env`` as its whole environment,
    its stderr appended to ``err_path`` and its stdout to /dev/null, in a session of its own."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # before it first starts
    process = _RankStart(target=_rank_entry, args=(main, args, env, err_path, os.getcwd(), os.getpid()))
    process.start()
    return RankProcess(process)


def _without_main(prepare: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """multiprocessing's preparation data for a child (``prepare``), less the launcher's main module: a
    rank runs the launcher's code, not its script (a script that calls ``run_pipeline`` at its top level,
    with no ``if __name__ == "__main__"``, would run again in every rank, and there refuse to start)."""

    def rank_preparation(name: str) -> dict[str, Any]:
        data = prepare(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    return rank_preparation


try:  # the fork server's process classes (not on Windows, where nothing is forked)
    from multiprocessing import context as _mp_context
    from multiprocessing import popen_forkserver as _popen_forkserver
    from multiprocessing import spawn as _spawn

    class _Popen(_popen_forkserver.Popen):
        """The fork server's start of one child, its preparation data :func:`_without_main` (the start
        reads ``spawn.get_preparation_data``, replaced for its duration)."""

        def _launch(self, process_obj: Any) -> None:
            real = _spawn.get_preparation_data
            _spawn.get_preparation_data = _without_main(real)  # type: ignore[assignment]
            try:
                super()._launch(process_obj)  # type: ignore[misc]
            finally:
                _spawn.get_preparation_data = real

    class _RankStart(_mp_context.ForkServerProcess):
        """A process of the fork server started by :class:`_Popen`."""

        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return _Popen(process_obj)

    _FORKABLE = hasattr(os, "fork")
except ImportError:  # pragma: no cover - warm_ranks() is False there
    _FORKABLE = False


def _rank_entry(
    main: Callable[[list[str]], None],
    args: list[str],
    env: dict[str, str],
    err_path: str,
    cwd: str,
    launcher: int,
) -> None:
    """In the forked rank: become what ``python -c`` started by the launcher was, then run ``main``."""
    os.setsid()  # its own session: a Ctrl-C at the terminal reaches the launcher, which stops the ranks
    fd = os.open(err_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.close(fd)
    from microbatch.run.pipeline.signals import LAUNCHER_PID_ENV

    env = dict(env)
    env[LAUNCHER_PID_ENV] = str(os.getppid())  # the fork server: it exits when the launcher does
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if sys.path[:1] != [""]:
        sys.path.insert(0, "")  # the working folder first, as for ``python -c``
    _release_server(launcher)
    main(args)


def _release_server(launcher: int) -> None:
    """Let the fork server exit with the launcher. The server ends when every holder of its "a client
    lives" pipe has closed it, and multiprocessing hands that pipe to each child: a rank holding it kept
    the server alive after the launcher's SIGKILL, and the rank, whose death signal is its parent's
    (:func:`~microbatch.run.pipeline.signals.exit_with_parent`), ran on. Closed here; where this Python
    keeps it elsewhere, a thread ends the rank when the launcher is gone (every 0.5 s)."""
    try:
        from multiprocessing import forkserver

        server: Any = forkserver._forkserver
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        closed = True
    except (AttributeError, TypeError, OSError):
        closed = False
    if not _alive(launcher):  # the launcher died between the fork and here
        os._exit(1)
    if not closed:
        import threading
        import time

        def watch() -> None:
            while _alive(launcher):
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="microbatch-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
