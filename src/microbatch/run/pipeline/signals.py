"""SIGTERM as an interrupt: the pipeline command and its launcher stop every rank and exit 130 on it, as on Ctrl-C."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

__all__ = ["Terminated", "raise_on_sigterm"]


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
