"""Ctrl-C while a command keeps what it computed: the first interrupt stops the work, a second one, which used to end
the command before it had printed or written what the first one kept, is ignored until that is done."""

from __future__ import annotations

import importlib.machinery
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "first_interrupt_only", "imported_keeping_interrupts", "interrupts_kept_in_first_import", "second_interrupt_ignored",
]  # fmt: skip


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

    if name in sys.modules:
        return importlib.import_module(name)
    with _signals_held():
        module = importlib.import_module(name)
    return module


_HELD = (signal.SIGINT, signal.SIGTERM)
"""The signals held while an import that swallows them runs: Ctrl-C, and SIGTERM where the command line turns it into
one (:func:`microbatch.run.pipeline.signals.raise_on_sigterm`)."""


@contextmanager
def _signals_held() -> Iterator[None]:
    """Inside (the main thread only), :data:`_HELD` signals are marked, not acted on; after, each handler that was
    there gets its signal: Python's own SIGINT handler raises KeyboardInterrupt, another callable is called, SIG_DFL
    ends the process as the signal would have. A signal ignored, or with a handler Python did not install, is left
    alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[int] = []
    previous: dict[signal.Signals, Any] = {}
    for s in _HELD:
        was = signal.getsignal(s)
        if was is not signal.SIG_IGN and was is not None:
            previous[s] = signal.signal(s, lambda signum, frame: hits.append(signum))
    try:
        yield
    finally:
        for s, was in previous.items():
            signal.signal(s, was)
    for hit in dict.fromkeys(hits):
        was = previous[signal.Signals(hit)]
        if was is signal.SIG_DFL:
            signal.raise_signal(hit)
        elif callable(was) and was is not signal.default_int_handler:
            was(hit, None)
        else:
            raise KeyboardInterrupt


class _HeldLoader:
    """A module's own loader, its ``exec_module`` run with :func:`_signals_held` (:func:`interrupts_kept_in_first_import`);
    the module keeps its own loader (put back in its spec before the module runs a line)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.inner
        with _signals_held():
            self.inner.exec_module(module)


class _FirstImportFinder:
    """Finds nothing of its own: on the first import of one of ``names`` it hands the path finder's spec back with
    its loader wrapped in :class:`_HeldLoader`, then steps aside."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names:  # nothing imported before this test: every import passes here
            return None
        self.names.discard(fullname)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HeldLoader(spec.loader)  # type: ignore[assignment]  # a Loader in all but its base
        return spec


def interrupts_kept_in_first_import(*names: str) -> None:
    """Wherever a command first imports one of ``names`` (top-level modules; torch by default), a Ctrl-C or SIGTERM
    during that import is acted on once it is done (:func:`imported_keeping_interrupts`, for every place at once).
    The command line's start installs it: a review's Ctrl-C 0.28 s into ``validate`` (torch imported to measure the
    CPU) was lost, the run exiting 0, or ended in a traceback (exit 1). Once per process; modules imported already
    are passed by."""
    import sys

    wanted = tuple(n for n in (names or ("torch",)) if n not in sys.modules)
    if wanted and not any(isinstance(f, _FirstImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FirstImportFinder(wanted))


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
