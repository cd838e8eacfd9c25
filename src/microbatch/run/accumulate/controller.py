"""A micro-batch size that survives out-of-memory: :class:`MicroBatchController`.

Passed to :func:`microbatch.run.accumulate.exact.accumulate` step after step, it holds the size to
run, halves it when a step runs out of memory (the step is redone, so its gradient does not
change), remembers the size that last worked, and, if asked, grows back toward the tuned knee
after a number of clean steps, never above it. Every change is an :class:`ResizeEvent` in
:attr:`MicroBatchController.history` and one log record (logger ``microbatch.run.controller``,
level WARNING for a split, INFO for a growth; the library never prints: configure ``logging``
to see them).

**What a step is.** By default, one :func:`~microbatch.run.accumulate.exact.accumulate` call: in a
loop written by hand, that call takes the optimizer step's whole batch, so a step is an optimizer
step. A Trainer with gradient accumulation makes several calls per optimizer step (one per batch
it hands to its training step); there the integrations give the controller a ``step_counter``
(the Trainer's own count of optimizer steps, ``trainer.state.global_step`` or
``trainer.global_step``), and then :attr:`~MicroBatchController.steps`, the events' ``step``, the
log lines and the ``grow_after`` window all count optimizer steps, the numbers the Trainer logs;
:attr:`~MicroBatchController.calls` still counts the calls. Optimizer steps, because that is the
unit the user sets everything else in (``grow_after``, ``max_steps``, logging intervals) and the
step number a log line must be matched against; and growing after N optimizer steps is growing
after N × g calls, so the window is no shorter.

Under DDP every rank holds its own controller; :func:`~microbatch.run.accumulate.exact.accumulate`
agrees the new size across ranks, so the controllers stay equal.

Pure Python: no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from microbatch.errors import ConfigError, check_positive_int

__all__ = ["MicroBatchController", "ResizeEvent"]

log = logging.getLogger("microbatch.run.controller")
"""The logger of the resizes; its name kept from before the module moved into the package (users
configure it by that name: ``docs/accumulate.md``)."""
logging.getLogger("microbatch").addHandler(logging.NullHandler())  # silent unless the user configures logging


@dataclass(frozen=True, kw_only=True)
class ResizeEvent:
    """One change of the micro-batch size."""

    step: int
    """The first step (0-based, see :attr:`MicroBatchController.steps`) run at the new size: for a split,
    the step that was redone; for a growth, the step after the clean ones."""
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
    (the oldest are dropped; the counts stay exact). ``step_counter``: a function returning the
    optimizer steps completed so far (for example ``lambda: trainer.global_step``), for loops that
    call :func:`~microbatch.run.accumulate.exact.accumulate` several times per optimizer step; None (the
    default): each completed call is a step (see the module's docstring). ``one_call``: made by
    :func:`~microbatch.run.accumulate.exact.accumulate` for a single call without a controller; its log lines
    and errors say "this call" instead of a step number (every such call would be "step 0").
    """

    def __init__(
        self,
        initial: int,
        *,
        knee: int | None = None,
        grow_after: int | None = None,
        max_history: int = 1000,
        step_counter: Callable[[], int] | None = None,
        one_call: bool = False,
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
        if step_counter is not None and not callable(step_counter):
            raise ConfigError(
                f"step_counter must be a function returning the optimizer steps done (or None), got {step_counter!r}"
            )
        initial, knee = int(initial), None if knee is None else int(knee)  # NumPy's too: summary() is JSON
        grow_after = None if grow_after is None else int(grow_after)
        max_history = int(max_history)
        self.initial = initial
        """The size given at the start."""
        self.knee = initial if knee is None else knee
        """The largest size growth returns to."""
        self.grow_after = grow_after
        """Clean steps before the size doubles toward the knee (None: never)."""
        self.max_history = max_history
        """How many events :attr:`history` keeps."""
        self.step_counter = step_counter
        """Optimizer steps completed so far (None: the calls count the steps); an integration sets it."""
        self.one_call = one_call
        """Made for one call only (no step numbers in its log lines)."""
        self.micro_batch_size = initial
        """The size the next step runs at: the last that worked (or the last grown to)."""
        self.calls = 0
        """:func:`~microbatch.run.accumulate.exact.accumulate` calls completed through this controller."""
        self.splits = 0
        """Times a step ran out of memory and was redone at half the size."""
        self.grows = 0
        """Times the size grew after clean steps."""
        self.history: list[ResizeEvent] = []
        """The latest resize events, oldest first."""
        self._changed_at = 0  # self.steps when the size last changed
        self._split_last = False  # the last change was a split: the step it happened in is not clean

    @property
    def steps(self) -> int:
        """Steps completed: ``step_counter()`` (optimizer steps) when set, else :attr:`calls`."""
        return self.calls if self.step_counter is None else int(self.step_counter())

    @property
    def clean_steps(self) -> int:
        """Steps completed without out-of-memory since the size last changed: after a growth, the steps from the one it
        began on; after a split, the steps after the one that split (redone at the smaller size, it ran out of memory
        first: not clean)."""
        return max(0, self.steps - self._changed_at - int(self._split_last))

    @property
    def step_unit(self) -> str:
        """What :attr:`steps` counts: ``"optimizer step"`` (``step_counter`` set) or ``"accumulate call"``."""
        return "accumulate call" if self.step_counter is None else "optimizer step"

    def __repr__(self) -> str:
        return (
            f"MicroBatchController(micro_batch_size={self.micro_batch_size}, initial={self.initial}, "
            f"knee={self.knee}, grow_after={self.grow_after}, steps={self.steps}, splits={self.splits}, "
            f"grows={self.grows}, step_unit={self.step_unit!r})"
        )

    def where(self) -> str:
        """How log lines and errors name the current step: ``"step N"``, or ``"this call"`` (``one_call``)."""
        return "this call" if self.one_call else f"step {self.steps}"

    def _record(self, event: ResizeEvent) -> None:
        self.history.append(event)
        if len(self.history) > self.max_history:
            del self.history[: len(self.history) - self.max_history]

    def record_split(self, new: int, reason: str) -> None:
        """A step ran out of memory at the current size and is redone at ``new`` (smaller): log it once."""
        old = self.micro_batch_size
        if not 1 <= new < old:
            raise ConfigError(f"a split must go to a smaller size >= 1, got {old} -> {new}")
        step = self.steps
        self.micro_batch_size = new
        self.splits += 1
        self._changed_at, self._split_last = step, True
        self._record(ResizeEvent(step=step, old=old, new=new, kind="split", reason=reason))
        log.warning(
            "%s: out of memory at micro-batch %d, redoing the step at %d (%s)", self.where(), old, new, reason
        )

    def start_step(self) -> None:
        """Before a call runs: grow if ``grow_after`` steps completed cleanly (with a ``step_counter``, the
        optimizer steps complete between calls, so this is where the window closes)."""
        if self.steps < self._changed_at:  # the counter went back (a new fit reusing the controller)
            self._changed_at, self._split_last = self.steps, False
        self._maybe_grow()

    def record_step(self) -> None:
        """A call completed: count it and, when growth is on, grow after ``grow_after`` clean steps."""
        self.calls += 1
        self._maybe_grow()

    def _maybe_grow(self) -> None:
        size, clean = self.micro_batch_size, self.clean_steps
        if self.grow_after is None or size >= self.knee or clean < self.grow_after:
            return
        new = min(2 * size, self.knee)
        reason = f"{clean} clean {self.step_unit}s at {size}"
        step = self.steps
        self.micro_batch_size = new
        self.grows += 1
        self._changed_at, self._split_last = step, False
        self._record(ResizeEvent(step=step, old=size, new=new, kind="grow", reason=reason))
        log.info("step %d: %s, growing the micro-batch to %d", step, reason, new)

    def summary(self) -> dict[str, Any]:
        """For logging: the current size, the settings, the counts and the kept events (JSON-ready)."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "initial": self.initial,
            "knee": self.knee,
            "grow_after": self.grow_after,
            "steps": self.steps,
            "step_unit": self.step_unit,
            "calls": self.calls,
            "splits": self.splits,
            "grows": self.grows,
            "history": [asdict(e) for e in self.history],
        }
