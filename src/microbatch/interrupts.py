"""Ctrl-C while a command keeps what it computed: the first interrupt stops the work, a second one, which used to end
the command before it had printed or written what the first one kept, is ignored until that is done."""

from __future__ import annotations

import importlib.machinery
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "first_interrupt_only", "held_interrupt", "imported_keeping_interrupts", "interrupts_kept_in_first_import", "second_interrupt_ignored",
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


@contextmanager
def held_interrupt() -> Iterator[None]:
    """Inside (the main thread only), a first Ctrl-C or SIGTERM is held and dropped when the block ends: what the
    block finishes (the answer being written) is what was asked for; a second acts at once (:func:`_signals_held`:
    a reader that never reads the answer's pipe cannot hold the command forever)."""
    with _signals_held(pending=[]):
        yield


def imported_keeping_interrupts(name: str) -> Any:
    """``importlib.import_module(name)``, a Ctrl-C during it raised once the import is done (the main thread only).

    torch's C start-up imports numpy and clears any error that import raised, a KeyboardInterrupt included: a Ctrl-C
    landing there was lost, and ``tune`` measured every point and exited 0 (a review, 5 times). Here the signal
    only marks the interrupt while the import runs, and after it the handler that was there gets it: Python's own
    raises KeyboardInterrupt, another callable is called, SIG_DFL ends the process as the signal would have."""

    if name in sys.modules:
        return importlib.import_module(name)
    with _signals_held():
        module = importlib.import_module(name)
    return module


_HELD = (signal.SIGINT, signal.SIGTERM)
"""The signals held while an import that swallows them runs: Ctrl-C, and SIGTERM where the command line turns it into
one (:func:`microbatch.run.pipeline.signals.raise_on_sigterm`)."""


def _deliver(signum: int, was: Any) -> None:
    """Hand ``signum`` to the handler ``was`` that was there: SIG_DFL ends the process as the signal would have,
    a program's callable is called, Python's own SIGINT handler raises KeyboardInterrupt."""
    if was is signal.SIG_DFL:
        signal.raise_signal(signum)
    elif callable(was) and was is not signal.default_int_handler:
        was(signum, None)
    else:
        raise KeyboardInterrupt


@contextmanager
def _signals_held(pending: list[tuple[int, Any]] | None = None) -> Iterator[None]:
    """Inside (the main thread only), the first of :data:`_HELD` signals is marked, not acted on; a second acts at
    once (a hung import is stopped by a second Ctrl-C). After the block, even one that raised, the marked signal goes
    to the handler that was there (:func:`_deliver`) — or, with ``pending``, is put there for the caller to deliver.
    A signal ignored, or with a handler Python did not install, is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[int] = []
    previous: dict[signal.Signals, Any] = {}

    def restore() -> None:
        for s, was in previous.items():
            signal.signal(s, was)

    def hold(signum: int, frame: Any) -> None:
        hits.append(signum)
        if len(hits) > 1:  # the second: now
            restore()
            _deliver(signum, previous[signal.Signals(signum)])

    for s in _HELD:
        was = signal.getsignal(s)
        if was is not signal.SIG_IGN and was is not None:
            previous[s] = signal.signal(s, hold)
    try:
        yield
    finally:
        restore()
        if len(hits) == 1:
            held = (hits[0], previous[signal.Signals(hits[0])])
            if pending is None:
                _deliver(*held)
            else:
                pending.append(held)


class _HeldLoader:
    """A module's own loader, its ``exec_module`` run with :func:`_signals_held` (:func:`interrupts_kept_in_first_import`);
    the module keeps its own loader (put back in its spec before the module runs a line)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:

        names = _finder_names()
        names.discard(module.__name__)  # its first import is under way: the finder steps aside for it
        module.__spec__.loader = module.__loader__ = self.inner
        pending: list[tuple[int, Any]] = []
        try:
            with _signals_held(pending):
                self.inner.exec_module(module)
        except BaseException:
            if (
                pending
            ):  # the import failed anyway: the signal now, not lost under an ImportError someone catches
                _deliver(*pending[0])
            raise
        if not pending:
            return
        if (
            sys.getprofile() is not None
        ):  # a profiler runs: deliver here (the import machinery drops the module)
            _deliver(*pending[0])
            return
        sys.setprofile(_deliver_after_import(module.__name__, pending[0]))

    def __getattr__(
        self, name: str
    ) -> Any:  # get_filename, is_package, get_resource_reader...: the loader's own
        return getattr(self.inner, name)


def _deliver_after_import(name: str, held: tuple[int, Any]) -> Any:
    """A profile function that delivers ``held`` when the import system's ``_find_and_load`` of ``name`` returns:
    the module is in ``sys.modules`` then, whole. Raised inside ``exec_module``, the import machinery took the module
    out of ``sys.modules`` while its C extension stayed loaded, and torch could not be imported again in that process
    ("Only a single TORCH_LIBRARY can be used", a review). Also at the first return outside the import machinery,
    should the import run by another path."""
    here = __file__

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event != "return":
            return
        code = frame.f_code
        done = code.co_name == "_find_and_load" and frame.f_locals.get("name") == name
        if done or not (code.co_filename.startswith("<frozen importlib") or code.co_filename == here):
            sys.setprofile(None)
            _deliver(*held)

    return hook


class _FirstImportFinder:
    """Finds nothing of its own: on the first import of one of ``names`` it hands the path finder's spec back with
    its loader wrapped in :class:`_HeldLoader`, then steps aside."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names:  # nothing imported before this test: every import passes here
            return None
        # a name is taken off only when its module runs (:class:`_HeldLoader`): a find_spec("torch") check before
        # the import (transformers makes one) used it up, and the import after it was not held (a review)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HeldLoader(spec.loader)  # type: ignore[assignment]  # a Loader in all but its base
        return spec


def _finder_names() -> set[str]:
    """The names the installed :class:`_FirstImportFinder` still holds (an empty set where none is installed)."""

    return next((f.names for f in sys.meta_path if isinstance(f, _FirstImportFinder)), set())


def interrupts_kept_in_first_import(*names: str) -> None:
    """Wherever a command first imports one of ``names`` (top-level modules; torch by default), a Ctrl-C or SIGTERM
    during that import is acted on once it is done (:func:`imported_keeping_interrupts`, for every place at once).
    The command line's start installs it: a review's Ctrl-C 0.28 s into ``validate`` (torch imported to measure the
    CPU) was lost, the run exiting 0, or ended in a traceback (exit 1). Once per process; modules imported already
    are passed by."""

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
