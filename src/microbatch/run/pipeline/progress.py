"""What a pipeline command is doing now, and what its ranks measured before a Ctrl-C.

**Progress.** A pipeline command runs for tens of seconds (checks, a calibration run, a
per-stage profile, a loaded calibration run, the run itself). The library never prints, so each
phase is announced as a :class:`Progress` value to the function the caller installed with
:func:`progress_to` (the command prints a line on stderr); with none installed, :func:`announce`
does nothing. The phases (:data:`PHASES`) are announced where they happen: the checks and the run by
the caller, the calibrations and the profile by :func:`microbatch.run.pipeline.before_run.predict_run`,
the ranks' start, each measured step and the summary by :func:`microbatch.run.pipeline.launch.run_pipeline`.

**Steps kept.** Each worker appends every finished step's record (and, after the first, the rank's
setup: its stages, the layers per stage, torch's order, the gradient check) to a file of its own, one
JSON object a line (:class:`StepLog`). The launcher counts those lines for the progress, and on a
Ctrl-C or SIGTERM (after it has killed every rank) reads them back (:func:`read_partial`): the steps
that every rank finished make the same raw result a whole run gives, so the report of an interrupted
run is :func:`microbatch.run.pipeline.summary.summarize` of fewer steps. It is raised as
:class:`PipelineInterrupted`, a ``KeyboardInterrupt`` that carries it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from microbatch.errors import PipelineError

if TYPE_CHECKING:
    from microbatch.run.pipeline.report import PipelineReport

__all__ = [
    "PHASES",
    "PipelineDeadline",
    "PipelineInterrupted",
    "Progress",
    "StepCounter",
    "StepLog",
    "announce",
    "progress_to",
    "read_partial",
    "step_log_path",
]

PHASES = ("check", "calibrate", "profile", "calibrate_loaded", "run", "server", "start", "step", "summarise")
"""The moments announced, in the order a run with a prediction passes them: the checks, the bare
calibration run, the one-process profile of the stages, the loaded calibration run, the run itself;
``server`` (the ranks' fork server starting: torch imported once, the first launch only), ``start``, ``step``
and ``summarise`` belong to whichever run of ranks is going on (a calibration's or the real one's)."""


@dataclass(frozen=True, kw_only=True)
class Progress:
    """One moment of a pipeline command worth a progress line."""

    phase: str
    """One of :data:`PHASES`."""
    done: int | None = None
    """``step``: the steps every rank has finished so far."""
    total: int | None = None
    """``start`` and ``step``: the steps the run of ranks was asked for; ``start``: its ranks in ``ranks``."""
    ranks: int | None = None
    """``start``: how many rank processes were started."""


_SINK: ContextVar[Callable[[Progress], object] | None] = ContextVar(
    "microbatch_pipeline_progress", default=None
)


@contextmanager
def progress_to(fn: Callable[[Progress], object]) -> Iterator[None]:
    """Send every :func:`announce` made inside the ``with`` block (in this context) to ``fn``."""
    token = _SINK.set(fn)
    try:
        yield
    finally:
        _SINK.reset(token)


def announce(phase: str, **fields: int | None) -> None:
    """Tell the installed progress function (if any) that ``phase`` is reached; ``fields`` are
    :class:`Progress`'s ``done``, ``total`` and ``ranks``."""
    fn = _SINK.get()
    if fn is not None:
        fn(Progress(phase=phase, **fields))


# -- the steps each rank writes ---------------------------------------------------------------------


def step_log_path(folder: str, rank: int) -> str:
    """The file rank ``rank`` appends its finished steps to, in the run's temporary ``folder``."""
    return os.path.join(folder, f"rank{rank}.steps.jsonl")


class StepLog:
    """A rank's record of finished steps: ``write(kind, obj)`` appends one JSON line (``kind``
    ``setup`` or ``step``) and flushes it, so that a killed rank leaves every finished step behind."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "w"):
            pass

    def write(self, kind: str, obj: dict[str, Any]) -> None:
        line = json.dumps({"kind": kind, "data": obj}) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()


def _records(path: str) -> list[dict[str, Any]]:
    """The whole lines of a step log (a line cut short by a kill is left out)."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError:
        return []
    out = []
    for line in lines[:-1]:  # the text after the last newline is unfinished
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


class StepCounter:
    """Steps every rank has finished, read from the ranks' logs as they grow (each read takes only
    the bytes added since the last; a rank writes its setup line just before its first step's)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self._offsets = [0] * len(paths)
        self._lines = [0] * len(paths)
        self.last = 0
        """What the last call returned."""

    def __call__(self) -> int:
        for k, p in enumerate(self.paths):
            try:
                with open(p, "rb") as f:
                    f.seek(self._offsets[k])
                    new = f.read()
            except OSError:
                continue
            self._offsets[k] += len(new)
            self._lines[k] += new.count(b"\n")
        self.last = max(0, min(self._lines, default=0) - 1)
        return self.last


def read_partial(paths: list[str], head: dict[str, Any]) -> dict[str, Any] | None:
    """The raw result (as rank 0 gathers it: ``head`` — config, torch version, device — and one
    entry per rank) of the steps every rank finished, from the ranks' logs; None when some rank
    finished none."""
    ranks = []
    for p in paths:
        recs = _records(p)
        setup = next((r["data"] for r in recs if r["kind"] == "setup"), None)
        steps = [r["data"] for r in recs if r["kind"] == "step"]
        if setup is None or not steps:
            return None
        ranks.append({**setup, "steps": steps})
    if not ranks:
        return None
    n = min(len(r["steps"]) for r in ranks)
    for r in ranks:
        r["steps"] = r["steps"][:n]
    return {**head, "ranks": ranks}


class PipelineDeadline(PipelineError):
    """The run passed its deadline; every rank has been killed, and the steps every rank finished are kept:
    ``report`` (:func:`microbatch.run.pipeline.summary.summarize` of them), ``steps`` and ``asked`` as in
    :class:`PipelineInterrupted`. A :class:`~microbatch.errors.PipelineError` (the run failed), with its result."""

    def __init__(
        self, message: str, report: PipelineReport, steps: int, asked: int, params: tuple[str, ...]
    ) -> None:
        super().__init__(message, params=params)
        self.report, self.steps, self.asked = report, steps, asked


class PipelineInterrupted(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM while the ranks ran; every rank has been killed.

    ``report``: :func:`microbatch.run.pipeline.summary.summarize` of the steps every rank finished
    (None when none did, or when they could not be summarised: ``why`` says so); ``steps``: how many
    steps that report holds; ``asked``: the steps the run was asked for."""

    def __init__(self, report: PipelineReport | None, steps: int, asked: int, why: str = "") -> None:
        super().__init__(f"interrupted after {steps} of {asked} steps")
        self.report, self.steps, self.asked, self.why = report, steps, asked, why
