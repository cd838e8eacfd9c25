"""A review of pipeline (a helper, 2026-12-07). A Ctrl-C while a finished run is summarised: every rank had finished every step,
and the interrupt threw them all away ("none of the run's 20 step(s) was measured"). Summarising takes seconds;
the steps are kept whole. A real run: two ranks, a tiny model, bounded."""

from __future__ import annotations

import json
import os
import signal

import pytest

from microbatch.cli import main
from microbatch.run.pipeline import launch

pytest.importorskip("torch")


@pytest.mark.timeout(240)
def test_an_interrupt_while_summarising_keeps_every_step(monkeypatch, capsys):
    real = launch.summarize
    sent = []

    def interrupted_summarize(raw, run):
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C lands as the summary starts
        sent.append(True)
        return real(raw, run)

    monkeypatch.setattr(launch, "summarize", interrupted_summarize)
    code = main(["pipeline", "-p", "2", "-m", "4", "--steps", "3", "--no-predict", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert sent and code == 0, out.get("error")
    assert out["steps"] == 3 and "measured" in out and "kind" not in out


def test_a_prediction_past_the_deadline_is_said_before_the_ranks_start(capsys):
    """The check before any work refuses only what compute alone cannot finish; the prediction made before the run
    (13 ms a step where compute alone was 1.7 ms) is said when it puts the steps past the deadline."""
    from microbatch.commands.pipeline import _say_past_deadline
    from microbatch.run.pipeline.config import STARTUP_S, PipelineConfig

    cfg = PipelineConfig(stages=2, microbatches=4, steps=10000, timeout_s=10)
    _say_past_deadline(cfg, 0.0097)
    err = capsys.readouterr().err
    assert f"puts 10000 steps at 97 s (9.7 ms each), past the {10 + STARTUP_S:.0f} s deadline" in err
    assert "lower --steps to about" in err
    _say_past_deadline(cfg, 0.001)  # 10 s: inside it
    assert capsys.readouterr().err == ""
