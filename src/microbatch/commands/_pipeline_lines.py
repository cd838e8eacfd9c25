"""``microbatch pipeline``'s progress lines on stderr: each phase as it starts, the steps as the ranks finish them."""

from __future__ import annotations

from typing import Any

__all__ = ["PipelineLines"]


class PipelineLines:
    """Progress lines on stderr for ``pipeline``: each phase as it starts, the steps of each run of
    ranks (the first seen, the last, and at most one every 2 s between), with the seconds since the start.
    The checks' line is said once the next phase starts, so that a refusal stays one line."""

    LABELS = {
        "calibrate": "calibration run of torch's runtime (between-op costs)",
        "profile": "profiling the stages on one process",
        "calibrate_loaded": "calibration run loaded like the real stages",
    }

    def __init__(self) -> None:
        import time

        self.clock = time.perf_counter
        self.t0 = self.clock()
        self.phase = ""
        self.checked = False
        self.last_step: float | None = None
        """When the last step line was said (None: none yet in this run of ranks)."""
        self.started = False
        """Whether the ranks of the phase's run (a calibration's or the real one's) have started."""

    def say(self, text: str) -> None:
        from microbatch.commands._common import progress

        progress(f"pipeline: {text} [{self.clock() - self.t0:.1f} s]")

    def __call__(self, e: Any) -> None:
        if e.phase in ("check", "run"):  # said with the work that follows: a refusal stays one line
            self.phase = "run" if e.phase == "run" else self.phase or "check"
            self.started = False
            return
        if not self.checked:
            self.checked = True
            self.say("checked: layers, host memory, deadline")
        if e.phase in self.LABELS:
            self.phase = e.phase
            self.say(self.LABELS[e.phase])
        elif e.phase == "server":
            self.say("starting the ranks' fork server (torch imported once, for every rank of every launch)")
        elif e.phase == "start":
            self.started = True
            what = "the run: " if self.phase == "run" else ""
            self.say(f"{what}{e.ranks} ranks started for {e.total} step(s)")
            self.last_step = None
        elif e.phase == "step":
            now = self.clock()
            if self.last_step is None or e.done == e.total or now - self.last_step >= 2.0:
                self.last_step = now
                what = "step" if self.phase == "run" else "calibration step"
                self.say(f"  {what} {e.done}/{e.total} finished on every rank")
        elif e.phase == "summarise" and self.phase == "run":
            self.say("summarising the measured steps")

    def interrupted(self, e: Any, steps: int) -> str:
        """Say where a Ctrl-C came when it kept nothing of the run, and return the message the command
        ends with (after ``interrupted: ``). ``e``: the :class:`PipelineInterrupted` of a run of ranks
        (its steps are that run's: a calibration's are not the run's), or None; ``steps``: the run's."""
        where = {
            "": "before the run",
            "check": "during the checks",
            "calibrate": "during the calibration run",
            "profile": "while profiling the stages",
            "calibrate_loaded": "during the loaded calibration run",
            "run": "as the run's ranks started"
            if self.started
            else "during the run's checks, before its ranks started",
        }.get(self.phase, "before the run")
        why = getattr(e, "why", "")
        self.say(f"interrupted {where}: no step of the run was measured" + (f" ({why})" if why else ""))
        done = ""
        if e is not None and self.phase in ("calibrate", "calibrate_loaded"):
            kind = "loaded calibration" if self.phase == "calibrate_loaded" else "calibration"
            done = f" ({e.steps} of the {kind} run's {e.asked} steps had finished)"
        return f"{where}{done}; none of the run's {steps} step(s) was measured"
