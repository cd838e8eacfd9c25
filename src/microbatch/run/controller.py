"""A micro-batch size that survives out-of-memory: :class:`MicroBatchController`.

Passed to :func:`microbatch.run.accumulate.accumulate` step after step, it holds the size to
run, halves it when a step runs out of memory (the step is redone, so its gradient does not
change), remembers the size that last worked, and, if asked, grows back toward the tuned knee
after a number of clean steps, never above it. Every change is an :class:`ResizeEvent` in
:attr:`MicroBatchController.history` and one log record (logger ``microbatch.run.controller``,
level WARNING for a split, INFO for a growth; the library never prints: configure ``logging``
to see them).

Under DDP every rank holds its own controller; :func:`~microbatch.run.accumulate.accumulate`
agrees the new size across ranks, so the controllers stay equal.

Pure Python: no torch.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from microbatch.errors import ConfigError, check_positive_int

__all__ = ["MicroBatchController", "ResizeEvent"]

log = logging.getLogger(__name__)
logging.getLogger("microbatch").addHandler(logging.NullHandler())  # silent unless the user configures logging


@dataclass(frozen=True, kw_only=True)
class ResizeEvent:
    """One change of the micro-batch size."""

    step: int
    """The step (0-based count of the controller's completed steps) in which it happened."""
    old: int
    """The micro-batch size before (rows)."""
    new: int
    """The micro-batch size after (rows)."""
    kind: str
    """``"split"`` (out of memory: the step was redone at ``new``) or ``"grow"`` (after clean steps)."""
    reason: str
    """Why: the out-of-memory error in one line, or the count of clean steps."""


class MicroBatchController:
    """The micro-batch size across steps: halved on out-of-memory, optionally grown back to the knee.

    ``initial``: the size to start with (the tuned knee, typically). ``knee``: the largest size
    growth may return to (default ``initial``); never exceeded. ``grow_after``: after this many
    consecutive steps without out-of-memory at a size below ``knee``, double it (capped at
    ``knee``); None (the default) never grows. ``max_history``: events kept in :attr:`history`
    (the oldest are dropped; the counts stay exact).
    """

    def __init__(
        self, initial: int, *, knee: int | None = None, grow_after: int | None = None, max_history: int = 1000
    ) -> None:
        check_positive_int("initial", initial, fix="give the micro-batch size to start with (rows)")
        if knee is not None:
            check_positive_int("knee", knee, fix="give the tuned knee (rows), or None for the initial size")
            if knee < initial:
                raise ConfigError(
                    f"knee {knee} is below initial {initial}; growth never passes the knee, so start at or below "
                    f"it: initial={knee}, or knee >= {initial}"
                )
        if grow_after is not None:
            check_positive_int("grow_after", grow_after, fix="give the clean steps before growing, or None")
        check_positive_int("max_history", max_history, fix="give how many resize events to keep")
        self.initial = initial
        """The size given at the start."""
        self.knee = initial if knee is None else knee
        """The largest size growth returns to."""
        self.grow_after = grow_after
        """Clean steps before the size doubles toward the knee (None: never)."""
        self.max_history = max_history
        """How many events :attr:`history` keeps."""
        self.micro_batch_size = initial
        """The size the next step runs at: the last that worked (or the last grown to)."""
        self.steps = 0
        """Steps completed through this controller."""
        self.splits = 0
        """Times a step ran out of memory and was redone at half the size."""
        self.grows = 0
        """Times the size grew after clean steps."""
        self.clean_steps = 0
        """Consecutive completed steps without out-of-memory since the last change."""
        self.history: list[ResizeEvent] = []
        """The latest resize events, oldest first."""

    def __repr__(self) -> str:
        return (
            f"MicroBatchController(micro_batch_size={self.micro_batch_size}, initial={self.initial}, "
            f"knee={self.knee}, grow_after={self.grow_after}, steps={self.steps}, splits={self.splits}, "
            f"grows={self.grows})"
        )

    def _record(self, event: ResizeEvent) -> None:
        self.history.append(event)
        if len(self.history) > self.max_history:
            del self.history[: len(self.history) - self.max_history]

    def record_split(self, new: int, reason: str) -> None:
        """A step ran out of memory at the current size and is redone at ``new`` (smaller): log it once."""
        old = self.micro_batch_size
        if not 1 <= new < old:
            raise ConfigError(f"a split must go to a smaller size >= 1, got {old} -> {new}")
        self.micro_batch_size = new
        self.splits += 1
        self.clean_steps = 0
        self._record(ResizeEvent(step=self.steps, old=old, new=new, kind="split", reason=reason))
        log.warning(
            "step %d: out of memory at micro-batch %d, redoing the step at %d (%s)",
            self.steps,
            old,
            new,
            reason,
        )

    def record_step(self) -> None:
        """A step completed: count it and, when growth is on, grow after ``grow_after`` clean steps."""
        self.steps += 1
        self.clean_steps += 1
        size = self.micro_batch_size
        if self.grow_after is not None and size < self.knee and self.clean_steps >= self.grow_after:
            new = min(2 * size, self.knee)
            reason = f"{self.clean_steps} clean steps at {size}"
            self.micro_batch_size = new
            self.grows += 1
            self.clean_steps = 0
            self._record(ResizeEvent(step=self.steps - 1, old=size, new=new, kind="grow", reason=reason))
            log.info("step %d: %s, growing the micro-batch to %d", self.steps - 1, reason, new)

    def summary(self) -> dict[str, Any]:
        """For logging: the current size, the settings, the counts and the kept events (JSON-ready)."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "initial": self.initial,
            "knee": self.knee,
            "grow_after": self.grow_after,
            "steps": self.steps,
            "splits": self.splits,
            "grows": self.grows,
            "history": [asdict(e) for e in self.history],
        }
