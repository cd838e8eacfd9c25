"""Ctrl-C while a command keeps what it computed: the first interrupt stops the work, a second one, which used to end
the command before it had printed or written what the first one kept, is ignored until that is done."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["first_interrupt_only", "imported_keeping_interrupts", "second_interrupt_ignored"]


@contextmanager
def second_interrupt_ignored() -> Iterator[None]:
    """SIGINT ignored inside (the main thread only): the summary of what was kept after an interrupt takes seconds,
    and a second Ctrl-C there ended the command with none of it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def imported_keeping_interrupts(name: str) -> Any:
    """``importlib.import_module(name)``, a Ctrl-C during it raised once the import is done (the main thread only).

    torch's C start-up imports numpy and clears any error that import raised, a KeyboardInterrupt included: a Ctrl-C
    landing there was lost, and ``tune`` measured every point and exited 0 (a review, 5 times). Here the signal
    only marks the interrupt while the import runs, and after it the handler that was there gets it: Python's own
    raises KeyboardInterrupt, another callable is called, SIG_DFL ends the process as the signal would have."""
    import importlib
    import sys

    if name in sys.modules or threading.current_thread() is not threading.main_thread():
        return importlib.import_module(name)
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or previous is None:  # ignored, or a handler Python did not install
        return importlib.import_module(name)
    hits: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        module = importlib.import_module(name)
    finally:
        signal.signal(signal.SIGINT, previous)
    if hits:
        if previous is signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
        elif callable(previous) and previous is not signal.default_int_handler:
            previous(signal.SIGINT, None)
        else:
            raise KeyboardInterrupt
    return module


@contextmanager
def first_interrupt_only() -> Iterator[None]:
    """Inside (the main thread only), the first Ctrl-C raises KeyboardInterrupt as usual and any later one is ignored
    until the block ends: the work the first one stopped is kept, printed and written without a second one cutting
    that short (bench-gpu lost its partial result to a Ctrl-C 30-80 ms after the first)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    ):
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
