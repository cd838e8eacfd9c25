"""A Ctrl-C while a finished run is summarised (a helper's review, 2026-12-07): every rank had finished every step,
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
