"""A line on stderr while long work has said nothing for a while: progress without a terminal.

``tune`` without a terminal prints one line per probe; its first probe (the child starting, the model built,
one set-up step) or a probe at a long sequence can take minutes, which was silence in a log. :class:`Heartbeat`
says, every ``every_s`` seconds without news, what is running and for how long. A refusal comes before it
speaks (the first line waits ``every_s``), so it stays one line.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from microbatch.commands._common import progress

__all__ = ["HEARTBEAT_S", "Heartbeat"]

HEARTBEAT_S = 30.0
"""Seconds without news before a line (and between lines)."""


class Heartbeat:
    """``with Heartbeat(first, later):`` — a daemon thread prints ``first`` (before any :meth:`news`) or
    ``later`` with the seconds elapsed, each time ``every_s`` pass without :meth:`news`."""

    def __init__(self, first: str, later: str, every_s: float | None = None) -> None:
        self.first, self.later = first, later
        self.every_s = HEARTBEAT_S if every_s is None else every_s
        self._stop = threading.Event()
        self._t0 = self._last = time.perf_counter()
        self._news = False
        self._thread = threading.Thread(target=self._run, name="microbatch-heartbeat", daemon=True)

    def news(self) -> None:
        """Something was said: the next line waits ``every_s`` again."""
        self._news, self._last = True, time.perf_counter()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 4)):
            now = time.perf_counter()
            if now - self._last >= self.every_s:
                progress(f"{self.later if self._news else self.first} [{now - self._t0:.0f} s]")
                self._last = now

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
