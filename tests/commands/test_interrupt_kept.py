"""A second Ctrl-C while a command keeps what the first one stopped, and a demo stopped after its tune: what was
computed is printed and written (a read-only sweep of interrupts, 2026-12-06)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.interrupts import first_interrupt_only


def test_the_first_ctrl_c_raises_and_a_second_is_ignored_until_the_block_ends() -> None:
    outer = signal.getsignal(signal.SIGINT)
    raised = 0
    with first_interrupt_only():
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises as the call returns
        except KeyboardInterrupt:
            raised += 1
        os.kill(os.getpid(), signal.SIGINT)  # ignored: the kept result is being written
    assert raised == 1 and signal.getsignal(signal.SIGINT) is outer


def test_a_demo_stopped_after_its_tune_reports_what_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in a phase after the tune printed only "interrupted": no summary, no report of the phases done."""
    from microbatch.commands import demo

    def tuned(out, model_name, quick, quiet, results, summary):  # type: ignore[no-untyped-def]
        summary["tune_train"] = {"micro_batch": 4}

    def stopped(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_tune_both", tuned)
    monkeypatch.setattr(demo, "_simulate_gpipe_and_1f1b", stopped)
    rc = main(["demo", "--quick", "--model", "tiny", "--out", str(tmp_path / "d"), "--json"])
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert (
        rc == 130
        and d["interrupted"] is True
        and d["interrupted_in"] == "simulate"
        and d["tune_train"] == {"micro_batch": 4}
    )
    assert "plan" in d and (tmp_path / "d" / "plan.json").is_file() and Path(d["report"]).is_file()
    assert not (tmp_path / "d" / "pipeline.json").exists()  # the phases after it did not run


def test_a_demo_result_that_cannot_be_written_is_kept_beside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from microbatch.commands.demo import _save

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder was")  # the folder replaced under the demo
    path = _save(blocked, "plan.json", {"recommended": None}, {})
    err = capsys.readouterr().err
    assert path.is_file() and path.parent != blocked and "the result was kept in" in err
    assert json.loads(path.read_text())["command"] == "plan"
