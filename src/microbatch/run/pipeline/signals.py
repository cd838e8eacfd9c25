"""SIGTERM as an interrupt: the pipeline command and its launcher stop every rank and exit 130 on it, as on Ctrl-C;
and a worker that ends with its launcher, however the launcher died (:func:`exit_with_parent`)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["LAUNCHER_PID_ENV", "Terminated", "exit_with_parent", "raise_on_sigterm"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while the ranks ran: handled as an interrupt (every rank is killed, exit 130)."""


def raise_on_sigterm() -> Callable[[], object]:
    """Make SIGTERM raise :class:`Terminated` in this (main) thread, once; return the function that puts
    the previous handler back. Elsewhere than the main thread it changes nothing (Python allows signal
    handlers only there)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # the caller chose to ignore it: so do we
        return lambda: None
    raised = False

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal raised
        if not raised:  # a second SIGTERM must not cut the clean-up short
            raised = True
            raise Terminated(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


LAUNCHER_PID_ENV = "MICROBATCH_LAUNCHER_PID"
"""Environment variable in which the launcher gives its workers its process id (:func:`exit_with_parent`)."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_EVERY_S = 0.5
"""How often the watchdog thread of :func:`exit_with_parent` looks at the parent, where prctl is missing."""


def exit_with_parent(launcher_pid: int | None) -> str:
    """Make this worker end when the launcher that started it dies, even by SIGKILL (which it cannot
    catch, so it cannot kill its ranks; they were re-parented to PID 1 and ran every step). On Linux the
    kernel sends SIGTERM at the parent's death (``prctl(PR_SET_PDEATHSIG)``; SIGTERM's default action is
    restored first, so the worker ends on it); elsewhere a daemon thread compares ``os.getppid()`` with
    ``launcher_pid`` every :data:`WATCH_EVERY_S` and ends the process. A parent already gone before the
    guard was set (the race between the start and the prctl) ends it at once. Returns how it is guarded
    (``"prctl"``, ``"watchdog"`` or ``""`` without a launcher)."""
    import os

    if not launcher_pid:
        return ""
    how = "watchdog"
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):
            pass
    if os.getppid() != launcher_pid:  # it died before the guard was set
        os._exit(1)
    if how == "watchdog":
        import threading
        import time

        def watch() -> None:
            while os.getppid() == launcher_pid:
                time.sleep(WATCH_EVERY_S)
            os._exit(1)

        threading.Thread(target=watch, name="microbatch-parent-watchdog", daemon=True).start()
    return how
