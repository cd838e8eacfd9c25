"""Ranks forked from a parent that has imported torch already (gloo on the CPU, Linux).

A rank started as a new Python pays ``import torch.distributed.pipelining`` before its first op: 5.2 s of
CPU on the 2-core dev VM (``/usr/bin/time python -c "import torch.distributed.pipelining"``; 2.7 s of it
torch itself, the rest DTensor and dynamo, which the package imports), and ``pipeline --predict`` starts
the ranks three times (two calibrations and the run): on a p = 4 run that is 62 s of CPU before any
stage runs, more than the run itself on a small model. So on the CPU the launcher keeps one warm parent, a
fork server of its own (:class:`multiprocessing.forkserver.ForkServer`, not the process-wide one a user
may have set up: started once per launcher process, torch imported once), and each rank is a fork of it:
a process of its own, as before (its own session, its stderr to the rank's file, its stdout to
/dev/null, the launcher's environment, working folder and ``sys.path`` with ``''`` first as ``python -c``
puts it, ``sys.argv`` as the worker's), with the imports already made. It imports microbatch from the
launcher's path after the fork (the server's own path is its start-up environment's), the launcher's
main module is not run again in it (multiprocessing's spawn would), the launcher's start method is left
as it was, and numpy's global generator is seeded afresh as a new interpreter's is.

Left on the old path, a new interpreter per rank (:func:`warm_ranks`): ``nccl`` (a CUDA context must not be
forked; the server never touches CUDA, but no GPU run has been measured this way), platforms other than
Linux, a launcher that is itself a daemonic multiprocessing worker or a fork of the process that started
the server, an environment that differs from the server's in what torch and the native libraries read once
at start-up (``OMP_*``, ``MKL_*``, ``LD_*``, ``MALLOC_*``, ``PYTHON*``, ``TORCH_LOGS``, ``TORCH_DISTRIBUTED_DEBUG``:
the server cannot take them back), and ``MICROBATCH_COLD_RANKS=1`` (a user's escape hatch, and the tests' check that both paths
agree).

:class:`RankProcess` has the part of :class:`subprocess.Popen`'s interface the launcher uses (``pid``,
``poll``, ``kill``, ``wait``), so the watching, killing and error reporting of
:mod:`microbatch.run.pipeline.launch` is the same on both paths.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

__all__ = [
    "COLD_ENV",
    "PRELOAD",
    "READY_S",
    "RankHandle",
    "RankProcess",
    "WarmStartError",
    "cold_asked",
    "server_alive",
    "start_warm",
    "warm_ranks",
]

COLD_ENV = "MICROBATCH_COLD_RANKS"
"""Set to ``1`` to start every rank as a new interpreter (the path before the fork server); ``0`` or unset: forked
where the run allows it. Any other value is refused (:func:`cold_asked`)."""

_COLD = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
    "": False,
}

PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining")
"""What the fork server imports once: torch and its pipelining package (microbatch is imported in each rank,
from the launcher's ``sys.path``, 0.2 s)."""

_START_UP_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "PYTHON")
"""Prefixes of the environment variables read once, when the server's native libraries load or Python starts."""

_TORCH_START_UP = (
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_LOGS",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_CPP_LOG_LEVEL",
)
"""torch's variables read when it is imported (``torch/distributed/__init__.py``, its logging); not the ones torch
sets itself as it runs (``TORCHINDUCTOR_CACHE_DIR``, set in the launcher by its first compile-related import)."""


class RankHandle(Protocol):
    """What the launcher holds of a rank: :class:`subprocess.Popen` or :class:`RankProcess`."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def _start_up_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_START_UP_ENV) or k in _TORCH_START_UP}


_server: Any = None
"""This process's fork server (created on first use); its owner and start-up environment below."""
_owner: int | None = None
_server_env: dict[str, str] | None = None
_broken = ""
"""Why the fork server could not serve (it died while importing, or did not answer): the cold path from then on."""
_lock = threading.Lock()

READY_S = 120.0
"""How long the launcher waits for the fork server to import torch and fork a child (5 s idle on the dev VM)."""


class WarmStartError(Exception):
    """The fork server could not start a rank: the launcher starts this launch's ranks as new interpreters."""


def warm_ranks(backend: str, env: Mapping[str, str] | None = None) -> bool:
    """True when the ranks of a run on ``backend`` are forked from the warm server (module docstring)."""
    seen = os.environ if env is None else env
    if cold_asked(seen) or backend != "gloo" or not _FORKABLE or _broken:
        return False
    import multiprocessing

    if multiprocessing.current_process().daemon:  # a daemonic worker may not have children of its own
        return False
    if _owner is not None and (_owner != os.getpid() or _server_env != _start_up_env(seen)):
        return False  # a fork of the owner (the server is not its child), or start-up settings changed
    try:
        os.getcwd()
    except OSError:  # the working folder was removed: the ranks cannot start in it
        return False
    return True


def cold_asked(env: Mapping[str, str]) -> bool:
    """Whether ``env`` asks for new interpreters (:data:`COLD_ENV`); a ConfigError naming the value otherwise."""
    value = env.get(COLD_ENV, "")
    asked = _COLD.get(value.strip().lower())
    if asked is None:
        from microbatch.errors import ConfigError

        raise ConfigError(
            f"{COLD_ENV}={value!r} is not a switch; set it to 1 to start each pipeline rank as a new interpreter, "
            "or to 0 (or unset it) to fork the CPU ranks from the warm fork server"
        )
    return asked


def server_alive() -> bool:
    """Whether this process's fork server is running (False before it started or after it died; a dead one is
    forgotten: its pipe closed and its socket removed, so that the next launch starts a new one)."""
    pid = getattr(_server, "_forkserver_pid", None)
    if pid is None or _owner != os.getpid():
        return False
    if not _exited(pid):
        return True
    _forget()
    return False


def _exited(pid: int) -> bool:
    """Whether this process's child ``pid`` has ended (reaped here if it had; True if it is not ours to wait for)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def _forget(unlink: bool = True) -> None:
    """Drop this process's fork server: close its "a client lives" pipe (it exits if it still runs) and, where
    ``unlink``, remove its socket file (not from a fork of the launcher: the file is the launcher's too)."""
    global _server, _owner, _server_env
    server, _server, _owner, _server_env = _server, None, None, None
    if server is None:
        return
    fd, address = getattr(server, "_forkserver_alive_fd", None), getattr(server, "_forkserver_address", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    if unlink and isinstance(address, str) and not address.startswith("\0"):
        try:
            os.unlink(address)
        except OSError:
            pass


class RankProcess:
    """A rank forked by the fork server, seen through :class:`subprocess.Popen`'s ``pid``, ``poll()``,
    ``kill()`` and ``wait(timeout)`` (its exit status: negative for the signal that killed it; 255 when the
    server that reports it died first)."""

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
    its stderr appended to ``err_path`` and its stdout to /dev/null, in a session of its own. The first call
    starts the server and waits until it has imported torch (a child that does nothing), so that an interrupt
    then leaves no rank behind. Raises :class:`WarmStartError` where the server cannot serve (and
    :func:`warm_ranks` is False from then on)."""
    import multiprocessing

    global _broken
    try:
        with _lock:
            _ready()
        torch_file = getattr(sys.modules.get("torch"), "__file__", None)
        process = _RankStart(
            target=_rank_entry,
            args=(main, args, env, err_path, os.getpid(), _server._forkserver_pid, torch_file),
        )
        process.start()
    except (EOFError, OSError) as e:  # OSError: TimeoutError too
        _broken = f"{type(e).__name__}: {e}"
        _kill_server()
        raise WarmStartError(f"the fork server could not start a rank ({_broken})") from e
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]  # exit joins none
    return RankProcess(process)


def _ready() -> None:
    """Start this process's fork server once, and wait until it has made its imports (at most ``READY_S``).
    It starts with ``OMP_NUM_THREADS=1`` where the launcher sets none, as the cold path gives gloo ranks: its
    native libraries single-threaded, so no thread but the main one is alive when it forks."""
    global _server, _owner, _server_env
    if _owner == os.getpid() and server_alive():
        return
    import multiprocessing

    _forget(unlink=_owner == os.getpid())  # not the socket of a launcher this process was forked from
    before = cast("str | None", multiprocessing.get_start_method(allow_none=True))  # None: not yet chosen
    _server = _Server()
    _server.set_forkserver_preload(list(PRELOAD))
    _owner, _server_env = os.getpid(), _start_up_env(os.environ)
    added = "OMP_NUM_THREADS" not in os.environ
    # SIGINT ignored across the exec, so a terminal's Ctrl-C during its imports does not print a traceback
    # from it (it is in the launcher's process group; it ignores SIGINT itself once its imports are made)
    main = threading.current_thread() is threading.main_thread()
    sigint = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        if added:
            os.environ["OMP_NUM_THREADS"] = "1"
        _server.ensure_running()
    finally:
        if main:
            signal.signal(signal.SIGINT, sigint)
        if added:
            os.environ.pop("OMP_NUM_THREADS", None)
        if before is None:  # ensure_running reads the start method, which fixes the launcher's default
            multiprocessing.set_start_method(None, force=True)
    probe = _RankStart(target=_nothing)
    probe.start()
    probe.join(READY_S)
    if probe.exitcode is None:
        raise TimeoutError(f"its first child was still running after {READY_S:.0f} s")
    if probe.exitcode != 0:
        raise OSError(f"its first child ended with exit status {probe.exitcode}")


def _kill_server() -> None:
    """Kill a fork server that failed, and forget it."""
    pid = getattr(_server, "_forkserver_pid", None)
    if pid is not None and _owner == os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):
            pass
    _forget()


def _after_fork_in_child() -> None:
    """A fork of the launcher (not a rank: those are the server's) does not hold the server alive, and starts
    with its lock free (a thread of the launcher may have held it at the fork)."""
    global _lock
    _lock = threading.Lock()
    if _owner is not None and _owner != os.getpid():
        _forget(unlink=False)


def _nothing() -> None:
    """A child that only proves the server ready."""


try:  # the fork server's process classes (Linux only: fork after importing torch is untested elsewhere)
    from multiprocessing import context as _mp_context
    from multiprocessing import forkserver as _forkserver
    from multiprocessing import popen_forkserver as _popen_forkserver
    from multiprocessing import process as _mp_process
    from multiprocessing import reduction as _reduction
    from multiprocessing import util as _mp_util

    class _Popen(_popen_forkserver.Popen):
        """One child of this module's server (``_server``) with its own preparation data: the launcher's path,
        argv, folder and key, not its main module (multiprocessing would run the launcher's script again in
        the rank) nor its start method (the rank's default stays the platform's)."""

        def _launch(self, process_obj: Any) -> None:
            prep = {
                "name": process_obj.name,
                "authkey": bytes(_mp_process.current_process().authkey),
                "sys_path": list(sys.path),
                "sys_argv": ["-c", *(process_obj._args[1] if process_obj._target is _rank_entry else [])],
                "dir": os.getcwd(),
                "orig_dir": _mp_process.ORIGINAL_DIR,  # type: ignore[attr-defined]
            }
            buf = io.BytesIO()
            _mp_context.set_spawning_popen(self)
            try:
                _reduction.dump(prep, buf)
                _reduction.dump(process_obj, buf)
            finally:
                _mp_context.set_spawning_popen(None)
            self.sentinel, w = _server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
            parent_w = os.dup(w)  # the child's sentinel of this process, as multiprocessing keeps it
            self.finalizer = _mp_util.Finalize(self, _mp_util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            from multiprocessing.connection import wait

            if not wait([self.sentinel], READY_S):  # the server forks once its imports are made
                raise TimeoutError(f"no child forked in {READY_S:.0f} s")
            self.pid = _forkserver.read_signed(self.sentinel)

    class _Server(_forkserver.ForkServer):
        """A fork server that is not restarted behind the launcher's back: multiprocessing's ``ensure_running``
        (called on every connect) starts a new one where the old died, without this module's settings, and the
        rank built for the old one's pid then exits on its death guard; here its death is an ``EOFError``, which
        :func:`start_warm` turns into the cold path."""

        def ensure_running(self) -> None:
            pid = getattr(self, "_forkserver_pid", None)
            if pid is not None and _exited(pid):
                self._forkserver_pid = None
                raise EOFError("the fork server died")
            super().ensure_running()

    class _RankStart(_mp_context.ForkServerProcess):
        """A process of this module's fork server, started by :class:`_Popen`; its start method is not forced
        on the child (the rank's default stays the platform's, as in a new interpreter)."""

        _start_method = None  # type: ignore[assignment]

        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return _Popen(process_obj)

    _FORKABLE = sys.platform.startswith("linux")
    os.register_at_fork(after_in_child=_after_fork_in_child)
except ImportError:  # pragma: no cover - warm_ranks() is False there
    _FORKABLE = False


def _rank_entry(
    main: Callable[[list[str]], None],
    args: list[str],
    env: dict[str, str],
    err_path: str,
    launcher: int,
    server: int,
    torch_file: str | None,
) -> None:
    """In the forked rank: become what ``python -c`` started by the launcher was, then run ``main``."""
    os.setsid()  # its own session: a Ctrl-C at the terminal reaches the launcher, which stops the ranks
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter's (the server ignores it)
    try:
        fd = os.open(err_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except (
        FileNotFoundError
    ):  # the launcher was stopped and removed its folder as this rank started: nothing to run
        os._exit(1)
    os.dup2(fd, 2)
    os.close(fd)
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.close(fd)
    from microbatch.run.pipeline.signals import LAUNCHER_PID_ENV, exit_with_parent

    exit_with_parent(server)  # SIGTERM when the server exits (as the launcher does): never an orphan
    env = dict(env)
    env[LAUNCHER_PID_ENV] = str(server)  # the worker's own guard watches the same parent
    os.environ.clear()
    os.environ.update(env)
    if sys.path[:1] != [""]:
        sys.path.insert(0, "")  # the working folder first, as for ``python -c``
    if "numpy" in sys.modules:  # seeded once in the server: each rank its own, as a new interpreter's
        sys.modules["numpy"].random.seed()
    torch = sys.modules.get("torch")  # None where the server's preload failed: imported by the rank
    if torch is not None and torch_file is not None and torch.__file__ != torch_file:
        print(
            f"the fork server imported torch from {torch.__file__}, the launcher from {torch_file}; "
            f"run with {COLD_ENV}=1 to start the ranks as new interpreters",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
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
